"""The gated delta rule in Qwen3.5's ONNX graphs: token by token (one Scan step per token, the graphs before
2026-12-05) against chunks (models/linear_attention.chunk_scanned, one Scan step per chunk), side by side (issue 30).

    python benchmarks/recurrent_forms.py [--rounds 5] [--before /tmp/before] [--end-to-end-only --output F]

1. The recurrence alone, exported from torch as the graphs export it, run by onnxruntime (1 thread) at Qwen3.5-27B's
   share on 2 ranks (24 value heads, key and value heads of 128): token by token, chunks of 16 (what the graphs run)
   and chunks of 64 (transformers' prefill chunk), at batch 1 and 8 over 1 token (a plain step), 16 (a verify
   block) and 512 / 2048 (prompts); medians of --rounds runs in alternating order; each form's largest error
   against `token_by_token` (transformers' token-by-token rule in eager torch). For passes of up to 16 tokens also the
   two forms in eager torch, where the torch executor runs a verify block token by token (why it does).
2. With --before CHECKOUT (`git worktree add /tmp/before <commit>`): a random Qwen3.5 pair at the demo's width (8
   layers, hidden 256, untrained drafter: DFlash accepts about nothing, so its steps measure verify passes) built
   with `backend: onnxruntime` by each checkout, then run in fresh processes (each checkout first on sys.path), in
   rounds of alternating order, with the onnxruntime executor: one 512-token prompt's prefill, and 8 held-out
   prompts x 64 new tokens at batch 1 (AR and DFlash, greedy, tokens compared across the checkouts). With
   --end-to-end-only, this part alone (results/recurrent_one_token.json: before / after one-token passes left the
   states after their token; results/recurrent_decode_graph.json: before / after one-token passes ran target_decode;
   both 2026-12-05).

Writes benchmarks/results/recurrent_forms.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
HEADS, KEY_DIM, VALUE_DIM = 24, 128, 128
CASES = [(1, 1), (8, 1), (1, 16), (8, 16), (1, 512), (1, 2048)]
FORMS = {"token by token": 0, "chunks of 16": 16, "chunks of 64": 64}


BUILD = r'''
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from backends import build_demo
print(build_demo(Path(sys.argv[1]), "qwen3_5"))
'''

RUN = r'''
import json, sys, time
import torch
torch.set_num_threads(1)
from pathlib import Path
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine

engine_dir, prompts_path = sys.argv[1:3]
out = {}
engine = Engine.load(Path(engine_dir), backend="onnxruntime", threads=1)
long_prompt = torch.randint(4, engine.executor.vocab_size, (512,), generator=torch.Generator().manual_seed(0))
prompts = [json.loads(line)["prompt"] for line in open(prompts_path) if line.strip()][:8]
requests = [Request(i, engine.tokenizer(p)["input_ids"], 64) for i, p in enumerate(prompts)]
for mode in ("ar", "dflash"):
    decoder = engine.decoder(mode)
    for _ in decoder.generate(requests[:1]):  # warm-up
        pass
    t = time.perf_counter()
    results = list(decoder.generate(requests))
    wall = time.perf_counter() - t
    tokens = {r.request.id: r.output_token_ids for r in results}
    out[mode] = {"tokens_per_s": sum(map(len, tokens.values())) / wall, "tokens": tokens}
t = time.perf_counter()
first = next(iter(engine.decoder("ar").generate([Request(99, long_prompt.tolist(), 1)])))
out["prefill"] = {"ms": 1e3 * (time.perf_counter() - t), "tokens": first.output_token_ids}
print(json.dumps(out))
'''


def scanned_per_token(q, k, v, g, beta, state):
    """The form the graphs ran before: one torch scan step (one ONNX Scan step) per token."""
    from torch._higher_order_ops.scan import scan

    from trtllm_dflash.models.linear_attention import delta_step

    def token(s, xs):
        q_i, *rest = xs
        s = delta_step(s, *rest)
        return s, (s * q_i[..., :, None]).sum(dim=-2)

    final, outs = scan(token, state, (q * q.shape[-1] ** -0.5, k, v, g, beta), dim=1)
    return outs, final


class Recurrence(torch.nn.Module):
    def __init__(self, chunk: int):
        super().__init__()
        self.chunk = chunk

    def forward(self, q, k, v, g, beta, state):
        from trtllm_dflash.models.linear_attention import chunk_scanned

        if self.chunk == 0:
            return scanned_per_token(q, k, v, g, beta, state)
        return chunk_scanned(q, k, v, g, beta, state, self.chunk)


def inputs(batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(batch * 10_000 + tokens)
    q, k = (F.normalize(torch.randn(batch, tokens, HEADS, KEY_DIM, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(batch, tokens, HEADS, VALUE_DIM, generator=gen)
    g = -0.5 * torch.rand(batch, tokens, HEADS, generator=gen)
    beta = torch.rand(batch, tokens, HEADS, generator=gen)
    return q, k, v, g, beta, 0.1 * torch.randn(batch, HEADS, KEY_DIM, VALUE_DIM, generator=gen)


def forms(rounds: int, tmp: Path) -> list[dict]:
    """Each case's medians (ms) and largest error against `token_by_token`, per form: the exported graphs in
    onnxruntime, and for passes of up to 16 tokens the same two forms in eager torch (the torch executor's choice)."""
    import onnxruntime as ort

    from trtllm_dflash.models.linear_attention import chunk_scanned, token_by_token

    batch, seq = Dim("batch", min=1), Dim("seq", min=1)
    dynamic = ({0: batch, 1: seq},) * 5 + ({0: batch},)
    names = ["q", "k", "v", "g", "beta", "state"]
    sessions = {}
    for form, chunk in FORMS.items():
        with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
            program = torch.export.export(Recurrence(chunk), inputs(2, 40), dynamic_shapes=dynamic, strict=True)
        path = tmp / f"recurrence_{chunk}.onnx"
        torch.onnx.export(program, dynamo=True, opset_version=23, optimize=True, input_names=names).save(str(path))
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        sessions[form] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rows = []
    for batch_size, tokens in CASES:
        x = inputs(batch_size, tokens)
        feeds = dict(zip(names, (t.numpy() for t in x)))
        runs = {form: (lambda s=s: [torch.from_numpy(o) for o in s.run(None, feeds)]) for form, s in sessions.items()}
        if tokens <= 16:  # (a prompt in the torch executor: transformers' chunks of 64)
            runs |= {"eager token by token": lambda: token_by_token(*x),
                     "eager chunks of 16": lambda: chunk_scanned(*x)}
        want = token_by_token(*x)
        errors = {form: max(float((got - w).abs().max()) for got, w in zip(run(), want)) for form, run in runs.items()}
        times: dict[str, list[float]] = {form: [] for form in runs}
        for r in range(rounds):
            for form in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                t = time.perf_counter()
                runs[form]()
                times[form].append(1e3 * (time.perf_counter() - t))
        row = {"batch": batch_size, "tokens": tokens, "load_before": os.getloadavg()[0]}
        for form in runs:
            row[form] = {"ms": round(statistics.median(times[form]), 3), "max_error": errors[form]}
        rows.append(row)
        print(f"batch {batch_size}, {tokens} tokens: " + ", ".join(f"{f} {row[f]['ms']:.2f} ms" for f in runs),
              file=sys.stderr, flush=True)
    return rows


def engines(before: Path, rounds: int, tmp: Path) -> dict:
    sides = {"before": before.resolve(), "after": ROOT}
    built = {}
    for side, checkout in sides.items():
        out = subprocess.run([sys.executable, "-c", BUILD, str(tmp / side / "engine")], cwd=checkout, text=True,
                             env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"{side}: {out.stderr.strip().splitlines()[-3:]}")
        built[side] = out.stdout.strip().splitlines()[-1]
    samples: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, "-c", RUN, built[side], str(ROOT / "benchmarks" / "prompts" /
                                  "heldout_code.jsonl")], cwd=sides[side], text=True, capture_output=True,
                                 env={**os.environ, "PYTHONPATH": str(sides[side])}, timeout=3600)
            if out.returncode != 0:
                raise RuntimeError(f"{side}: {out.stderr.strip().splitlines()[-3:]}")
            samples[side].append({**json.loads(out.stdout.strip().splitlines()[-1]), "load_before": load})
            print(f"round {r + 1} {side}: prefill {samples[side][-1]['prefill']['ms']:.0f} ms",
                  file=sys.stderr, flush=True)
    cells = [k for k in samples["after"][0] if k != "load_before"]
    first = samples["after"][0]
    same = {cell: all(s[cell]["tokens"] == first[cell]["tokens"] for side in sides for s in samples[side])
            for cell in cells}
    rev = subprocess.run(["git", "-C", str(before), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    report = {"before": rev, "identical_tokens": same}
    for side in sides:
        report[side] = {cell: round(statistics.median(s[cell]["ms" if "prefill" in cell else "tokens_per_s"]
                                                      for s in samples[side]), 1) for cell in cells}
        report[side]["load_before"] = [s["load_before"] for s in samples[side]]
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", type=Path, help="an earlier checkout, its engine run beside this one's (end to end)")
    p.add_argument("--end-to-end-only", action="store_true", help="with --before: skip the recurrence alone")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "recurrent_forms.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": 1, "cpus": len(os.sched_getaffinity(0)),
              "loadavg_start": open("/proc/loadavg").read().strip(), "heads": HEADS, "key_dim": KEY_DIM,
              "value_dim": VALUE_DIM, "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        report["forms"] = [] if args.end_to_end_only else forms(args.rounds, Path(tmp))
        if args.before:
            report["engines"] = engines(args.before, args.rounds, Path(tmp))
    report["minutes"] = round((time.time() - started) / 60, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print("| batch | tokens | " + " | ".join(f"{f} ms" for f in FORMS) + " | token by token / chunks of 16 |")
    print("|---|---|" + "---|" * (len(FORMS) + 1))
    for row in report["forms"]:
        ratio = row["token by token"]["ms"] / row["chunks of 16"]["ms"]
        print(f"| {row['batch']} | {row['tokens']} | " + " | ".join(f"{row[f]['ms']:.2f}" for f in FORMS) +
              f" | {ratio:.2f}x |")
    print("\n| batch | tokens | eager torch, token by token ms | eager torch, chunks of 16 ms | token / chunks |")
    print("|---|---|---|---|---|")
    for row in report["forms"]:
        if "eager chunks of 16" in row:
            before, after = row["eager token by token"]["ms"], row["eager chunks of 16"]["ms"]
            print(f"| {row['batch']} | {row['tokens']} | {before:.2f} | {after:.2f} | {before / after:.2f}x |")
    if "engines" in report:
        e = report["engines"]
        print("\n| onnxruntime | measure | before | after | after / before | tokens identical |")
        print("|---|---|---|---|---|---|")
        for cell, same in e["identical_tokens"].items():
            unit = "ms (512-token prefill)" if "prefill" in cell else "tok/s"
            before, after = e["before"][cell], e["after"][cell]
            print(f"| {cell} | {unit} | {before} | {after} | {after / before:.2f}x | {same} |")


if __name__ == "__main__":
    main()
