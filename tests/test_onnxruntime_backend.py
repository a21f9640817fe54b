"""`backend: onnxruntime`: engines with ONNX graphs, run by the onnxruntime executor, give exactly the torch
executor's tokens (greedy and sampled, dflash and ar, requests joining mid-run); and its bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.config import BuildConfig
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.engine_dir import graph_dir
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine

pytest.importorskip("onnxruntime")


def build(pair, out, **fields):
    cfg = BuildConfig(target=pair / "target", drafter=pair / "drafter", output=out, dtype="float32",
                      max_batch_size=4, max_seq_len=256, backend="onnxruntime").model_copy(update=fields)
    return build_engine(cfg, progress=False)


@pytest.fixture(params=["qwen3", pytest.param("llama", marks=pytest.mark.extended)])  # (test_onnx_export.py's note)
def ort_engine(request, ort_engine_dir):
    return ort_engine_dir(request.param)  # tests/conftest.py: shared with tests/test_onnx_export.py


@pytest.fixture
def qwen3_ort_engine(ort_engine_dir):
    return ort_engine_dir("qwen3")


def requests(vocab: int) -> list[Request]:
    """7 requests for 4 slots (so some join mid-run), prompts of 3..19 tokens, greedy and sampled."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(7):
        length = int(torch.randint(3, 20, (1,), generator=g))
        prompt = torch.randint(4, vocab, (length,), generator=g).tolist()
        out.append(Request(id=i, prompt_token_ids=prompt, max_new_tokens=8 + 5 * i,
                           temperature=0.0 if i % 2 == 0 else 0.8, seed=1000 + i))
    return out


@pytest.mark.slow
def test_graphs_are_in_the_engine_and_its_manifest(ort_engine, capsys):
    manifest = json.loads((ort_engine / "manifest.json").read_text())["files"]
    for name in ("target_step.onnx", "drafter_context.onnx", "drafter_draft.onnx", "accept.onnx", "accept_plugin.onnx"):
        assert (graph_dir(ort_engine, 0) / name).is_file()
        assert f"onnx/rank0/{name}" in manifest
    assert json.loads((ort_engine / "config.json").read_text())["backend"] == "onnxruntime"
    assert main(["inspect", str(ort_engine)]) == 0
    assert "backend  onnxruntime: onnx/rank0/accept.onnx (" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_same_tokens_as_the_torch_executor(ort_engine, mode):
    torch_engine = Engine.load(ort_engine, backend="torch")
    ort = Engine.load(ort_engine)  # the engine's own backend
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    reqs = requests(torch_engine.executor.vocab_size)
    expected = {r.request.id: r.output_token_ids for r in torch_engine.decoder(mode).generate(reqs)}
    got = {r.request.id: (r.output_token_ids, r.acceptance_lengths) for r in ort.decoder(mode).generate(reqs)}
    assert {k: v[0] for k, v in got.items()} == expected
    if mode == "dflash":  # the drafter graph drafts what the torch drafter drafts: same acceptance
        ref = {r.request.id: r.acceptance_lengths for r in torch_engine.decoder(mode).generate(reqs)}
        assert {k: v[1] for k, v in got.items()} == ref


@pytest.mark.slow
def test_one_token_passes_attend_in_place(ort_engine, tmp_path):
    """target_decode.onnx: each layer's cache write and attention one GroupQueryAttention node over the bound cache
    (no Slice); a one-token pass through it gives target_step's logits, features and caches (rows at different
    positions, one at position 0), and an engine without it (built before it existed) runs target_step instead with
    the same tokens."""
    import onnx

    from trtllm_dflash.engine_dir import write_manifest

    graph = onnx.load(str(graph_dir(ort_engine, 0) / "target_decode.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    layers = json.loads((ort_engine / "config.json").read_text())["target"]["num_hidden_layers"]
    assert ops.count("GroupQueryAttention") == layers and "Slice" not in ops and "Attention" not in ops
    executor = Engine.load(ort_engine).executor
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(4, executor.vocab_size, (3, 40), generator=g)
    slots, zeros = torch.arange(3), torch.zeros(3, dtype=torch.long)
    executor.target_forward(prompts, zeros, slots, capture=False)  # 40 positions cached in each row
    starts, token = torch.tensor([40, 17, 0]), torch.randint(4, executor.vocab_size, (3, 1), generator=g)
    decode = executor.target_forward(token, starts, slots, capture=True)
    after = [buf.clone() for _, buf in executor._target.named()]
    sessions, executor._sessions = executor._sessions, {k: v for k, v in executor._sessions.items()
                                                        if k != "target_decode.onnx"}
    step = executor.target_forward(token, starts, slots, capture=True)  # the same pass through target_step
    executor._sessions = sessions
    torch.testing.assert_close(decode.logits, step.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode.hidden, step.hidden, atol=1e-4, rtol=1e-4)
    for a, (_, b) in zip(after, executor._target.named()):
        torch.testing.assert_close(a, b)

    older = tmp_path / "engine"
    shutil.copytree(ort_engine, older)
    (graph_dir(older, 0) / "target_decode.onnx").unlink()
    write_manifest(older)
    reqs = requests(executor.vocab_size)
    tokens = [{r.request.id: r.output_token_ids for r in Engine.load(e).decoder("ar").generate(reqs)}
              for e in (ort_engine, older)]
    assert tokens[0] == tokens[1]


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["onnxruntime", "tensorrt"])
def test_prefix_blocks_are_copied_between_requests_and_change_no_token(qwen3_ort_engine, executor):
    """Static rows with prefix reuse (cache_rows.PrefixRows), the onnxruntime executor and the TensorRT executor's
    bindings (onnxruntime standing in for TensorRT): four requests with a shared prefix of 40 tokens and tails of their
    own, submitted together: the first prefills its prompt and publishes its two full blocks, and the other three,
    admitted after it in the same step (a second wave), get them copied into their rows and prefill only the rest (3 x
    32 fewer prompt positions computed); tokens and acceptance lengths are those without reuse, dflash and ar, greedy
    and sampled. --block-size auto (speculating at once: hand-made pass costs) publishes the first request's blocks
    once its drafter holds the prompt, so the other three, submitted after it, find them (tokens only: auto's
    choices follow the steps' timings); so does auto running plain steps only (drafting made dear), which gives the
    drafter the prompt's blocks when the first request ends."""
    from tests.tensorrt_standin import standin_executor
    from tests.test_block_size_auto import hand_costs
    from trtllm_dflash.runtime.decoding import Decoder
    from trtllm_dflash.runtime.verify import AutoBlock
    from trtllm_dflash.speculative.schedule import AutoBlockSize

    g = torch.Generator().manual_seed(5)
    engine = Engine.load(qwen3_ort_engine, backend="torch")
    vocab = engine.executor.vocab_size
    shared = torch.randint(4, vocab, (40,), generator=g).tolist()
    reqs = [Request(i, shared + torch.randint(4, vocab, (3 + 2 * i,), generator=g).tolist(), 12,
                    temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(4)]

    loaded = {}

    def load(reuse: bool):
        if executor == "tensorrt":
            return standin_executor(qwen3_ort_engine, prefix_cache=reuse)
        loaded[reuse] = Engine.load(qwen3_ort_engine, backend="onnxruntime", prefix_cache=reuse)
        return loaded[reuse].executor

    for mode in ("dflash", "ar", "auto", "auto, plain steps"):
        results, prefilled = {}, {}
        for reuse in (True, False):
            ex = load(reuse)
            prefilled[reuse] = 0
            forward = ex.target_forward

            def counted(token_ids, starts, slots, capture, last_index=None, rows=None):
                if last_index is not None:  # a prefill: the positions it computes
                    prefilled[reuse] += int((last_index + 1).sum())
                return forward(token_ids, starts, slots, capture, last_index=last_index, rows=rows)

            ex.target_forward = counted
            auto = mode.startswith("auto")
            draft_ms = 1e3 if mode == "auto, plain steps" else 1.0
            policy = AutoBlock(AutoBlockSize(hand_costs(draft_ms), block_size=ex.block_size)) if auto else \
                engine.decoder(mode).policy
            decoder = Decoder(ex, policy, engine.config.eos_token_ids)
            results[reuse] = {r.request.id: (r.output_token_ids, None if auto else r.acceptance_lengths)
                              for wave in ((reqs[:1], reqs[1:]) if auto else (reqs,)) for r in decoder.generate(wave)}
            assert (ex.prefix_rows is not None) == reuse
        assert results[True] == results[False], mode
        assert prefilled[False] - prefilled[True] == 3 * 32, (mode, prefilled)
    if loaded:  # what `bench` reports of the static rows' pool (the last run's: auto's plain steps, with reuse)
        from trtllm_dflash.bench.runner import _kv_cache_report

        # full blocks before each prompt's last token: 2, 2, 2 and 3 (a 49-token prompt); hit: the later three's 2
        rows = loaded[True].executor.rows_bytes  # 4 rows of 264 positions; the pool: 16 blocks of 16 positions
        assert _kv_cache_report(loaded[True]) == {
            "layout": "static", "slots": 4, "rows_bytes": rows, "prefix_cache": True, "block_tokens": 16,
            "prefix_pool_blocks": (256 + 8) // 16, "prefix_pool_bytes": rows * 256 // (4 * 264),
            "prefix_blocks_looked_up": 9, "prefix_hit_rate": round(6 / 9, 4)}
        assert _kv_cache_report(loaded[False]) == {"layout": "static", "slots": 4, "rows_bytes": rows}


@pytest.mark.slow
def test_kv_cache_memory_sizes_the_static_rows_prefix_pool(qwen3_ort_engine, tmp_path, capsys):
    """--kv-cache-memory on the onnxruntime executor: the static rows take their share and the prefix pool the rest (a
    size), or a fraction of the memory free then; a size too small for max_batch_size rows and a block gets fewer rows
    (requests wait for one: the same tokens), said on stderr; a budget smaller than one row and a block, or leaving
    less than one prefix block beside all rows, is one sentence and writes nothing; without the prefix cache the rows
    alone fit."""
    from trtllm_dflash.runtime.kv_blocks import format_size

    default = Engine.load(qwen3_ort_engine, backend="onnxruntime").executor
    rows, length = default.rows_bytes, default._cache_length
    assert default.prefix_rows.num_blocks == length // 16  # one row's worth
    row, block = rows // default.num_slots, rows // (default.num_slots * length) * 16
    sized = Engine.load(qwen3_ort_engine, backend="onnxruntime", kv_cache_memory=str(rows + 5 * block + 7)).executor
    assert sized.prefix_rows.num_blocks == 5
    fraction = Engine.load(qwen3_ort_engine, backend="onnxruntime", kv_cache_memory="0.001").executor
    assert fraction.prefix_rows.num_blocks > 5
    lines = []
    two = Engine.load(qwen3_ort_engine, backend="onnxruntime", kv_cache_memory=str(2 * row + 3 * block + 5),
                      report=lines.append)
    assert (two.executor.num_slots, two.executor.prefix_rows.num_blocks) == (2, 3)
    assert lines == [f"--kv-cache-memory {2 * row + 3 * block + 5}: 2 of the engine's 4 request rows (max_batch_size) "
                     "fit; further requests wait for a free row."]
    reqs = requests(default.vocab_size)
    assert {r.request.id: r.output_token_ids for r in two.decoder("dflash").generate(reqs)} == \
        {r.request.id: r.output_token_ids for r in Engine.load(qwen3_ort_engine, backend="torch").decoder("dflash")
         .generate(reqs)}
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_token_ids": [5, 6, 7]}) + "\n")
    for value, extra, words in (
            ("1KiB", (), f"--kv-cache-memory 1KiB: smaller than one static row and one prefix block, "
                         f"{format_size(row + block)} (a row holds {length} positions of every layer); give more, or "
                         "add --no-prefix-cache."),
            (str(row - 1), ("--no-prefix-cache",), f"--kv-cache-memory {row - 1}: smaller than one static row, "
                                                   f"{format_size(row)} (a row holds {length} positions of every layer)."),
            (str(rows + 10), (), f"--kv-cache-memory {rows + 10}: leaves 10 B beside the static rows' "
                                 f"{format_size(rows)}, less than one prefix block's {format_size(block)}; give more, "
                                 "or add --no-prefix-cache.")):
        out = tmp_path / "out.jsonl"
        code = main(["run", str(qwen3_ort_engine), "--input", str(inp), "--output", str(out), "--backend",
                     "onnxruntime", "--kv-cache-memory", value, *extra])
        assert (code, capsys.readouterr().err.strip()) == (EXIT_USER_ERROR, f"error: {words}") and not out.exists()
    assert main(["run", str(qwen3_ort_engine), "--input", str(inp), "--output", str(out), "--backend", "onnxruntime",
                 "--kv-cache-memory", str(rows + 10), "--no-prefix-cache", "--max-new-tokens", "4"]) == 0
    assert len(json.loads(out.read_text())["output_token_ids"]) == 4


def test_the_prefix_pool_copies_blocks_and_drops_the_least_recently_used():
    """PrefixRows over two rows of one layer's caches and a pool of 2 blocks of 4 positions: a published prompt's
    full blocks (not its last token's) come back into another row with their values; a third block published drops
    the least recently used one, after which a prompt starting with it hits nothing."""
    from trtllm_dflash.runtime.cache_rows import CacheRows, LayerCaches, PrefixRows

    caches = LayerCaches.zeros(1, 2, 1, 16, 2, torch.float32)
    rows = CacheRows((caches,))
    pool = PrefixRows((caches,), rows, num_blocks=2, block_tokens=4)
    a, b = list(range(10, 19)), list(range(30, 35))  # a: 2 full blocks before its last token; b: 1
    assert pool.reserve(0, a, "target") == 0
    caches.keys[0][0, 0, :9] = torch.arange(9.0)[:, None]
    pool.publish(0)
    pool.release(0)
    assert pool.reserve(1, a[:7] + [99], "target") == 4  # block 1 is not full before the last token
    assert pool.reserve(1, a[:9] + [99], "target") == 8
    assert torch.equal(caches.keys[0][1, 0, :8], torch.arange(8.0)[:, None].expand(8, 2))
    assert pool.reserve(1, a, "target+drafter") == 0  # other caches: other hashes
    assert pool.reserve(0, b, "target") == 0
    pool.publish(0)  # pool full: drops a's first block (least recently used)
    assert pool.reserve(1, a, "target") == 0 and pool.reserve(1, b, "target") == 4
    assert pool.reserve(1, a, None) == 0


@pytest.mark.slow
def test_cli_run_backends_agree(ort_engine, tmp_path, capsys):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [5 + i, 6, 7, 8], "temperature": 0.5 * (i % 2)})
                               + "\n" for i in range(5)))
    texts = {}
    for backend in ("torch", "onnxruntime"):
        out = tmp_path / f"{backend}.jsonl"
        assert main(["run", str(ort_engine), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "12",
                     "--backend", backend]) == 0
        texts[backend] = sorted((r["id"], r["output_token_ids"]) for r in map(json.loads, out.read_text().splitlines()))
    assert texts["torch"] == texts["onnxruntime"]
    # Streaming: the same text through either executor.
    streamed = {}
    for backend in ("torch", "onnxruntime"):
        capsys.readouterr()
        assert main(["run", str(ort_engine), "--stream", "def f(x):", "--max-new-tokens", "12", "--backend", backend]) == 0
        streamed[backend] = capsys.readouterr().out
    assert streamed["torch"] == streamed["onnxruntime"] and streamed["torch"].strip()


@pytest.mark.slow
def test_bad_inputs(qwen3_pair, qwen3_engine_dir, qwen3_ort_engine, tmp_path, capsys):
    def refused(argv, *words):
        assert main(argv) == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
        for w in words:
            assert w in err, (w, err)

    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    run = ["run", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--backend", "onnxruntime"]
    refused([run[0], str(qwen3_engine_dir), *run[1:]], "the engine has no ONNX graphs", "backend: onnxruntime")
    refused([run[0], str(qwen3_ort_engine), *run[1:], "--device", "cuda"], "--device cuda")
    assert not (tmp_path / "o.jsonl").exists()
    # What the onnxruntime backend cannot build yet is refused before any work.
    for key, value in (("tp_size", 2), ("dtype", "bfloat16"), ("quantization", "nvfp4")):
        config = tmp_path / f"{key}.yaml"
        config.write_text(f"target: {qwen3_pair / 'target'}\ndrafter: {qwen3_pair / 'drafter'}\n"
                          f"output: {tmp_path / key}\nbackend: onnxruntime\n{key}: {value}\n")
        refused(["build", str(config)], f"backend onnxruntime builds {key}", f"not {value}")
        assert not (tmp_path / key).exists()
    # TensorRT: plans are made by `compile` on the GPU machine; this one has neither TensorRT nor a GPU.
    before = sorted(p.name for p in qwen3_ort_engine.rglob("*"))
    refused(["compile", str(qwen3_engine_dir)], "the engine has no ONNX graphs to compile")
    refused(["compile", str(qwen3_ort_engine)], "compile needs TensorRT")
    refused(["compile", str(qwen3_ort_engine), "--plugin-library", str(tmp_path / "nope.so")], "--plugin-library",
            "no such file")
    refused([run[0], str(qwen3_ort_engine), *run[1:-1], "tensorrt"], "the engine has no TensorRT plans",
            "trtllm-dflash compile")
    assert sorted(p.name for p in qwen3_ort_engine.rglob("*")) == before
    # A damaged graph is found by the manifest before onnxruntime reads it.
    damaged = tmp_path / "damaged"
    shutil.copytree(qwen3_ort_engine, damaged)
    graph = graph_dir(damaged, 0) / "drafter_draft.onnx"
    graph.write_bytes(graph.read_bytes()[:-1] + b"\x00")
    refused([run[0], str(damaged), *run[1:]], "drafter_draft.onnx: engine file does not match manifest.json")
    # An engine of an earlier version, whose target graph read the attended length from its positions (here: a
    # stand-in graph without key_positions, listed in the manifest), is refused before any request runs.
    import onnx
    from onnx import TensorProto, helper

    from trtllm_dflash.engine_dir import write_manifest

    old = tmp_path / "old"
    shutil.copytree(qwen3_ort_engine, old)
    x = helper.make_tensor_value_info("token_ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("logits", TensorProto.INT64, ["batch", "seq"])
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["token_ids"], ["logits"])],
                                                  "target_step", [x], [y])),
              str(graph_dir(old, 0) / "target_step.onnx"))
    write_manifest(old)
    refused([run[0], str(old), *run[1:]], "target_step.onnx: this graph was exported by an earlier trtllm-dflash "
            "(it has no key_positions input)", "build the engine again")
    assert not (tmp_path / "o.jsonl").exists()


def test_cache_rows_stay_contiguous():
    """Slots come in any order; rows stay 0 .. n-1, and a freed row is refilled by the last one (caches moved)."""
    from trtllm_dflash.runtime.cache_rows import CacheRows, LayerCaches, batch_order, row_runs

    caches = LayerCaches.zeros(layers=1, num_slots=4, kv_heads=1, length=2, head_dim=1, dtype=torch.float32)
    rows = CacheRows([caches])
    (run,) = rows.runs_of(torch.tensor([7, 2, 5]))  # three new requests: rows 0, 1, 2
    assert (run.first, run.rows, run.batch_index.tolist()) == (0, 3, [0, 1, 2])
    caches.keys[0][2] = 5.0  # slot 5's cache
    rows.release(7)  # row 0 freed: slot 5 (last row) moves in
    assert rows.in_use == 2 and caches.keys[0][0].eq(5.0).all()
    (run,) = rows.runs_of(torch.tensor([2, 5]))
    assert (run.first, run.rows, run.batch_index.tolist()) == (0, 2, [1, 0])
    assert run.take(torch.tensor([[20], [50]])).tolist() == [[50], [20]]
    # the docstring's example: rows [2, 0, 4, 3] are two runs, and their outputs come back in batch order
    runs = row_runs([2, 0, 4, 3])
    assert [(r.first, r.rows, r.batch_index.tolist()) for r in runs] == [(0, 1, [1]), (2, 3, [0, 3, 2])]
    batch = torch.tensor([20, 0, 40, 30])
    assert batch_order(runs, [r.take(batch) for r in runs]).tolist() == batch.tolist()


@pytest.mark.slow
def test_onnxruntime_missing_is_one_sentence(qwen3_pair, qwen3_ort_engine, tmp_path, capsys, monkeypatch):
    """Without the onnx extra: `run --backend onnxruntime` and `build` with backend: onnxruntime say what to install."""
    import sys

    for module in ("onnxruntime", "onnxscript"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    assert main(["run", str(qwen3_ort_engine), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --backend onnxruntime needs onnxruntime: pip install "
                                               "'trtllm-dflash[onnx]'.")
    config = tmp_path / "b.yaml"
    config.write_text(f"target: {qwen3_pair / 'target'}\ndrafter: {qwen3_pair / 'drafter'}\noutput: {tmp_path / 'e'}\n"
                      "dtype: float32\nbackend: onnxruntime\n")
    assert main(["build", str(config)]) == 2
    assert "backend onnxruntime needs the onnx extra: pip install 'trtllm-dflash[onnx]'" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "e").exists()


# --------------------------------------------------------------------------------------------------------
# FP8 engines: the graphs keep ModelOpt's FP8 weights and Q/DQ nodes
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_engine(qwen3_pair, tmp_path_factory):
    return build(qwen3_pair, tmp_path_factory.mktemp("ort_fp8") / "engine", quantization="fp8",
                 quantize_drafter=True, calibration_samples=8)


@pytest.mark.slow
def test_fp8_graphs_hold_fp8_weights_and_qdq_nodes(fp8_engine):
    import onnx

    cfg = json.loads((fp8_engine / "config.json").read_text())
    quantized = cfg["quantization"]["quantized_modules"]
    graphs = {}
    for graph in ("target_step", "drafter_context", "drafter_draft"):
        path = graph_dir(fp8_engine, 0) / f"{graph}.onnx"
        onnx.checker.check_model(str(path))
        model = onnx.load(str(path), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        fp8 = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN]
        # An FP8 weight (+ DequantizeLinear) per quantized linear the graph runs, and a Q/DQ pair per quantized
        # input: linears that read the same input with the same scale (q/k/v, gate/up) share theirs.
        assert ops.count("DequantizeLinear") == len(fp8) + ops.count("QuantizeLinear") > len(fp8) > 0, graph
        graphs[graph] = (len(fp8), ops.count("QuantizeLinear"))
    layers = cfg["target"]["num_hidden_layers"]
    assert len([m for m in quantized if m.startswith("target.")]) == 7 * layers  # lm_head stays unquantized
    # target_step: q, k, v, o, gate, up, down per layer; inputs: qkv, o, gate/up, down
    assert graphs["target_step"] == (7 * layers, 4 * layers)


@pytest.mark.slow
def test_fp8_engine_is_within_a_stated_bound_of_the_torch_emulation(fp8_engine):
    """FP8 graphs in onnxruntime compute what models/quantized.py emulates, up to accumulation order; an input
    element next to an FP8 rounding boundary may then round one step the other way. Stated bound: logits
    within 1e-2 of the torch executor's (their spread here: ~0.16), and the same greedy token wherever the
    top two logits are further apart than that."""
    torch_engine, ort_engine = (Engine.load(fp8_engine, backend=b) for b in ("torch", "onnxruntime"))
    tokens = torch.randint(4, torch_engine.executor.vocab_size, (4, 120), generator=torch.Generator().manual_seed(3))
    outs = [e.executor.target_forward(tokens, torch.zeros(4, dtype=torch.long), torch.arange(4), capture=True)
            for e in (torch_engine, ort_engine)]
    diff = (outs[0].logits - outs[1].logits).abs()
    assert diff.max() < 1e-2 and diff.median() < 1e-5, (diff.max(), diff.median())
    top2 = outs[0].logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-2
    assert torch.equal(outs[0].logits.argmax(-1)[clear], outs[1].logits.argmax(-1)[clear])
    # the drafter's FP8 graphs: the same drafts as the torch executor for the same context
    for e, out in zip((torch_engine, ort_engine), outs):
        e.executor.append_context(out.hidden, torch.zeros(4, dtype=torch.long), torch.arange(4))
    anchors, starts = tokens[:, -1], torch.full((4,), 120)
    drafts = [e.executor.draft(anchors, starts, torch.arange(4)) for e in (torch_engine, ort_engine)]
    assert (drafts[0] == drafts[1]).float().mean() > 0.9


@pytest.mark.slow
def test_fp8_graphs_build_with_tensorrt_rtx(fp8_engine):
    """Ahead of time on this CPU, for SM89 (Ada, FP8 tensor cores) and SM120: the Q/DQ nodes parse into
    TensorRT's quantize / dequantize layers around the matrix multiplies."""
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed (the tensorrt-rtx extra)")
    from trtllm_dflash.compile.tensorrt_build import build_plan, engine_shapes, layer_types, parse_graph
    from trtllm_dflash.engine_dir import read_engine_config

    cfg = read_engine_config(fp8_engine)
    shapes = engine_shapes(cfg)
    for graph in ("target_step", "drafter_context", "drafter_draft"):
        path = graph_dir(fp8_engine, 0) / f"{graph}.onnx"
        layers = layer_types(parse_graph(rtx, path, static_dims={"max_len": shapes["max_len"].max}).network)
        assert layers["QUANTIZE"] > 0 and layers["DEQUANTIZE"] > layers["QUANTIZE"], (graph, layers)
        assert len(build_plan(rtx, path, dtype_note=cfg.dtype, shapes=shapes, targets=["SM89", "SM120"])) > 50_000


def test_cuda_needs_the_cuda_execution_provider():
    """`--device cuda` with the onnxruntime backend runs CUDA's execution provider (onnxruntime-gpu) with the
    caches on the GPU; an onnxruntime without it is one sentence. (Never run on a GPU: none here.)"""
    import types

    from trtllm_dflash.errors import UserError
    from trtllm_dflash.runtime.onnxruntime_executor import providers

    cpu_only = types.SimpleNamespace(get_available_providers=lambda: ["CPUExecutionProvider"])
    assert providers(cpu_only, torch.device("cpu")) == ["CPUExecutionProvider"]
    with pytest.raises(UserError, match=r"--device cuda:1 needs onnxruntime's CUDA execution provider, and this "
                                        r"onnxruntime has CPUExecutionProvider: pip install onnxruntime-gpu"):
        providers(cpu_only, torch.device("cuda", 1))
    gpu = types.SimpleNamespace(get_available_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert providers(gpu, torch.device("cuda", 1)) == [("CUDAExecutionProvider", {"device_id": "1"}),
                                                       "CPUExecutionProvider"]
    # the executor's own stream: onnxruntime's kernels run on it, after the torch ops that wrote their inputs
    stream = 0x7F00_1234_5600
    assert providers(gpu, torch.device("cuda", 1), stream) == [
        ("CUDAExecutionProvider", {"device_id": "1", "user_compute_stream": str(stream),
                                   "has_user_compute_stream": "1"}), "CPUExecutionProvider"]
