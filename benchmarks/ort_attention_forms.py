"""Which attention forms onnxruntime can run for a paged (or in-place) KV cache on this CPU, and what a paged read costs
(issues 28 and 29): the facts behind keeping the compiled graphs on static rows for now.

    python benchmarks/ort_attention_forms.py --rounds 200

1. In-place forms onnxruntime ships (contrib ops), tried on the CPU execution provider: `PagedAttention` (block tables)
   and `GroupQueryAttention` with its cache bound as both past and present (reads the cache in place, with per-row
   lengths), at batch 2 with a verify block of 3 tokens, checked against a float64 reference where it runs.
2. One layer's attention at the demo target's shape (4 query heads, 2 KV heads, head_dim 64, fp32) in the two forms an
   ONNX graph can express with standard ops: static rows (what our graphs do: Slice of the rows' first `keys`
   positions, then Attention) and paged (Gather of each request's rows through its block table, then Attention), at
   batch 1 / 8, 1 / 16 tokens per row, 304 / 1008 attended keys; medians of --rounds calls each, the forms
   alternating, 1 thread. Both copy the attended keys before the Attention node reads them; the question is by how
   much the paged gather differs. A third form, "whole", is the Attention node alone over caches exactly as long as
   the keys (no Slice): what the static form would cost if the caches were kept as long as the longest request
   (resized as it grows) instead of sliced every pass.
Results: benchmarks/results/ort_attention_forms.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16  # the demo target's attention; our blocks of 16 positions
LAYERS = 16  # the demo target's: a pass reads 16 layers' caches, each from memory (not from the CPU's caches)
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def session(nodes, inputs, outputs, threads: int = 1, dtype: int = F32) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, dtype, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    options.log_severity_level = 4  # a refused contrib op is recorded, not logged
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def value(name: str, dtype: int, shape: list) -> object:
    return helper.make_tensor_value_info(name, dtype, shape)


def contrib_ops() -> dict:
    """Whether each in-place contrib op runs DFlash's verify pass (several rows, several new tokens each) here."""
    facts = {"onnxruntime": ort.__version__}
    paged = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "past", "bt"], ["o"],
                             domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS)
    half = TensorProto.FLOAT16  # its only types (float and the others are refused at load)
    try:
        session([paged], [value("q", half, ["N", HEADS * HEAD_DIM]), value("k", half, ["N", KV_HEADS * HEAD_DIM]),
                          value("v", half, ["N", KV_HEADS * HEAD_DIM]), value("kc", half, ["NB", BLOCK, KV_HEADS, HEAD_DIM]),
                          value("vc", half, ["NB", BLOCK, KV_HEADS, HEAD_DIM]), value("cu", TensorProto.INT32, ["B1"]),
                          value("past", TensorProto.INT32, ["B"]), value("bt", TensorProto.INT32, ["B", "M"])], ["o"],
                dtype=half)
        facts["PagedAttention"] = "a CPU kernel"
    except Exception as e:  # noqa: BLE001 - the message is the fact recorded
        facts["PagedAttention"] = f"refused: {str(e).splitlines()[0][:200]}"

    batch, tokens, length = 2, 3, 64
    gqa = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["o", "pk_out", "pv_out"],
                           domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS)
    s = session([gqa], [value("q", F32, ["B", "T", HEADS * HEAD_DIM]), value("k", F32, ["B", "T", KV_HEADS * HEAD_DIM]),
                        value("v", F32, ["B", "T", KV_HEADS * HEAD_DIM]), value("pk", F32, ["B", KV_HEADS, "L", HEAD_DIM]),
                        value("pv", F32, ["B", KV_HEADS, "L", HEAD_DIM]), value("seqlens", TensorProto.INT32, ["B"]),
                        value("total", TensorProto.INT32, [])], ["o", "pk_out", "pv_out"])
    rng = np.random.default_rng(0)
    starts = np.array([5, 9])
    q = rng.standard_normal((batch, tokens, HEADS * HEAD_DIM), dtype=np.float32)
    k, v = (rng.standard_normal((batch, tokens, KV_HEADS * HEAD_DIM), dtype=np.float32) for _ in range(2))
    caches = [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, KV_HEADS, length, HEAD_DIM), dtype=np.float32))
              for _ in range(2)]
    io = s.io_binding()
    for name, array in (("q", q), ("k", k), ("v", v), ("seqlens", (starts + tokens - 1).astype(np.int32)),
                        ("total", np.array(int((starts + tokens).max()), dtype=np.int32))):
        io.bind_cpu_input(name, array)
    for name, cache in zip(("pk", "pv"), caches):  # past and present one buffer: read and written in place
        io.bind_ortvalue_input(name, cache)
        io.bind_ortvalue_output(name + "_out", cache)
    io.bind_output("o")
    try:
        s.run_with_iobinding(io)
        facts["GroupQueryAttention"] = "runs batch 2 x 3 new tokens with the cache in place"
    except Exception as e:  # noqa: BLE001
        facts["GroupQueryAttention"] = f"refused at batch {batch} x {tokens} new tokens: {str(e).splitlines()[0][-120:]}"
    return facts


def forms(batch: int, tokens: int, keys: int, slots: int, threads: int):
    """(static session + feeds, paged session + feeds) of one layer's attention over `keys` positions per row."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((batch, HEADS, tokens, HEAD_DIM), dtype=np.float32)
    mask = np.ones((batch, 1, tokens, keys), dtype=bool)
    length = 2064  # the demo engine's max_seq_len + a block
    attend = [helper.make_node("Attention", ["q", "k", "v", "mask"], ["o"])]
    common = [value("q", F32, ["B", HEADS, "T", HEAD_DIM]), value("mask", TensorProto.BOOL, ["B", 1, "T", "K"])]

    # static rows: the batch's rows of a [slots, kv, length, hd] cache, their first `keys` positions
    static = session([helper.make_node("Slice", ["cache_k", "zero", "keys", "axis"], ["k"]),
                      helper.make_node("Slice", ["cache_v", "zero", "keys", "axis"], ["v"])] + attend,
                     common + [value("cache_k", F32, ["B", KV_HEADS, "L", HEAD_DIM]),
                               value("cache_v", F32, ["B", KV_HEADS, "L", HEAD_DIM]),
                               value("zero", I64, [1]), value("keys", I64, [1]), value("axis", I64, [1])], ["o"], threads)
    def caches() -> list[np.ndarray]:  # one K and one V buffer per layer: each pass reads them from memory, as a model's
        return [rng.standard_normal((slots, KV_HEADS, length, HEAD_DIM), dtype=np.float32) for _ in range(2 * LAYERS)]

    static_caches = caches()
    static_feeds = [{"q": q, "mask": mask, "cache_k": k[:batch], "cache_v": v[:batch], "zero": np.array([0]),
                     "keys": np.array([keys]), "axis": np.array([2])}
                    for k, v in zip(static_caches[0::2], static_caches[1::2])]

    # paged: rows [B, keys] of a [blocks * 16, kv, hd] cache through each request's block table (blocks scattered)
    blocks = slots * length // BLOCK
    paged = session([helper.make_node("Gather", ["pool_k", "rows"], ["gk"], axis=0),
                     helper.make_node("Gather", ["pool_v", "rows"], ["gv"], axis=0),
                     helper.make_node("Transpose", ["gk"], ["k"], perm=[0, 2, 1, 3]),
                     helper.make_node("Transpose", ["gv"], ["v"], perm=[0, 2, 1, 3])] + attend,
                    common + [value("pool_k", F32, ["R", KV_HEADS, HEAD_DIM]), value("pool_v", F32, ["R", KV_HEADS, HEAD_DIM]),
                              value("rows", I64, ["B", "K"])], ["o"], threads)
    pools = [rng.standard_normal((blocks * BLOCK, KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in range(2 * LAYERS)]
    table = rng.permutation(blocks)[: batch * -(-keys // BLOCK)].reshape(batch, -1)
    positions = np.arange(keys)
    rows = table[:, positions // BLOCK] * BLOCK + positions % BLOCK
    paged_feeds = [{"q": q, "mask": mask, "pool_k": k, "pool_v": v, "rows": rows}
                   for k, v in zip(pools[0::2], pools[1::2])]

    # whole: caches exactly `keys` long, read by Attention where they lie (no Slice: what a cache resized to the
    # longest request's length would give)
    whole = session(attend, common + [value("k", F32, ["B", KV_HEADS, "K", HEAD_DIM]),
                                      value("v", F32, ["B", KV_HEADS, "K", HEAD_DIM])], ["o"], threads)
    exact = [np.ascontiguousarray(c[:batch, :, :keys]) for c in static_caches]
    whole_feeds = [{"q": q, "mask": mask, "k": k, "v": v} for k, v in zip(exact[0::2], exact[1::2])]
    return {"static": (static, static_feeds), "paged": (paged, paged_feeds), "whole": (whole, whole_feeds)}


def timed(run, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "ort_attention_forms.json")
    args = ap.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    facts = contrib_ops()
    print(json.dumps(facts, indent=1), flush=True)
    rows = []
    for batch in (1, 8):
        for tokens in (1, 16):
            for keys in (304, 1008):
                sessions = forms(batch, tokens, keys, slots=8, threads=1)
                static_out, whole_out = (sessions[f][0].run(None, sessions[f][1][0])[0] for f in ("static", "whole"))
                np.testing.assert_allclose(whole_out, static_out, rtol=1e-5, atol=1e-6)  # the same keys, read two ways

                def one_pass(s, feeds):  # every layer's attention once, each over its own caches
                    for layer in feeds:
                        s.run(None, layer)

                times: dict[str, list[float]] = {form: [] for form in sessions}
                for _ in range(4):  # the forms alternating, in chunks
                    for form, (s, feeds) in sessions.items():
                        times[form] += timed(lambda: one_pass(s, feeds), max(1, args.rounds // 4 // LAYERS))
                ms = {k: round(statistics.median(v) / LAYERS * 1e3, 4) for k, v in times.items()}  # per layer
                row = {"batch": batch, "tokens": tokens, "keys": keys, "static_ms": ms["static"],
                       "paged_ms": ms["paged"], "whole_ms": ms["whole"],
                       "paged_over_static": round(ms["paged"] / ms["static"], 2),
                       "whole_over_static": round(ms["whole"] / ms["static"], 2)}
                rows.append(row)
                print(row, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": load,
              "load_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]), "threads": 1,
              "rounds": args.rounds, "contrib_ops": facts, "one_layer_attention": rows}
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
