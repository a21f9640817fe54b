"""Torch vs onnxruntime executor on the demo engine: tokens/s at batch 1 and 8, DFlash and AR, side by side.

    python benchmarks/backends.py [--engine engines/demo-onnx] [--repeats 5] [--threads 2]
    python benchmarks/backends.py --family qwen3_5 --output benchmarks/results/backends_qwen3_5.json

Builds the demo pair with `backend: onnxruntime` (build_configs/demo.yaml otherwise unchanged) unless
--engine names one (or, with --family, a random pair of that family at the demo's width: hidden 256, 8 layers, 8
query / 4 KV heads of 32, vocab 4096, block 16; its drafter is untrained, so DFlash accepts about nothing and its rows
measure the executors' verify passes, not a speedup), then runs the same held-out prompts through both executors of
that one engine, in both modes, closed loop at each concurrency (bench's loop), alternating the order of the four
configurations each repeat; times are medians of --repeats runs after a warm-up. Writes
benchmarks/results/backends.json and prints a markdown table. Outputs of all four configurations must
be token for token identical (greedy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from trtllm_dflash.bench.machine import describe, machine_info
from trtllm_dflash.bench.runner import closed_loop
from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.stats import all_steps, mean_acceptance_length
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [(backend, mode) for backend in ("torch", "onnxruntime") for mode in ("ar", "dflash")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, help="an engine built with backend: onnxruntime (default: build the demo)")
    p.add_argument("--family", help="build a random pair of this family (train/random_pair.py) instead of the demo")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads and onnxruntime intra-op threads")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "backends.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = args.engine or build_demo(Path(tmp) / "demo-onnx", args.family)
        report = run(engine_dir, args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


def build_demo(out: Path, family: str | None = None) -> Path:
    """The demo (or a random pair of `family` at its width) built with backend: onnxruntime into `out`."""
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=out)
    update = {"backend": "onnxruntime"}
    if family is not None:
        target, drafter = write_random_pair(out.parent / f"{family}-pair", family, vocab_size=4096, hidden_size=256,
                                            num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32,
                                            intermediate_size=768, block_size=16)
        update |= {"target": target, "drafter": drafter}
    print(f"building {family or 'the demo'} engine with backend: onnxruntime into {out}", file=sys.stderr, flush=True)
    return build_engine(cfg.model_copy(update=update), progress=False)


def run(engine_dir: Path, args) -> dict:
    engines = {backend: Engine.load(engine_dir, backend=backend, threads=args.threads) for backend in ("torch", "onnxruntime")}
    tok = engines["torch"].tokenizer
    defaults = Defaults(args.max_new_tokens, 0.0, 0, engines["torch"].config.max_seq_len,
                        engines["torch"].executor.vocab_size)
    requests, errors = read_requests(args.prompts, tok, defaults)
    assert not errors, errors
    requests = requests[: args.num_prompts]
    points = []
    for concurrency in args.concurrency:
        seconds: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
        tokens, acceptance = {}, {}
        for c in CONFIGS:  # warm-up, and the outputs to compare
            backend, mode = c
            timed = closed_loop(engines[backend].decoder(mode), requests, concurrency)
            tokens[c] = {r.request.id: r.output_token_ids for r in timed.results}
            acceptance[c] = mean_acceptance_length(all_steps(timed.results))
        for rep in range(args.repeats):
            order = CONFIGS if rep % 2 == 0 else CONFIGS[::-1]
            for backend, mode in order:
                timed = closed_loop(engines[backend].decoder(mode), requests, concurrency)
                seconds[(backend, mode)].append(timed.wall_s)
        n_tokens = sum(len(t) for t in tokens[CONFIGS[0]].values())
        identical = all(tokens[c] == tokens[CONFIGS[0]] for c in CONFIGS)
        for backend, mode in CONFIGS:
            median = statistics.median(seconds[(backend, mode)])
            points.append({"concurrency": concurrency, "backend": backend, "mode": mode,
                           "median_wall_s": round(median, 4), "output_tokens": n_tokens,
                           "tokens_per_s": round(n_tokens / median, 2),
                           "mean_acceptance_length": round(acceptance[(backend, mode)], 3),
                           "identical_to_torch_ar": identical})
        print(f"concurrency {concurrency} done", file=sys.stderr, flush=True)
    return {"date": datetime.date.today().isoformat(), "machine": machine_info(), "engine": str(engine_dir),
            "prompts": str(args.prompts.relative_to(ROOT)) if args.prompts.is_relative_to(ROOT) else str(args.prompts),
            "num_prompts": len(requests), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "load_average": os.getloadavg(), "points": points}


def table(report: dict) -> str:
    by = {(p["concurrency"], p["backend"], p["mode"]): p for p in report["points"]}
    lines = ["| concurrency | mode | torch tokens/s | onnxruntime tokens/s | onnxruntime / torch | AL | identical |",
             "|---|---|---|---|---|---|---|"]
    for concurrency in sorted({p["concurrency"] for p in report["points"]}):
        for mode in ("ar", "dflash"):
            t, o = by[(concurrency, "torch", mode)], by[(concurrency, "onnxruntime", mode)]
            lines.append(f"| {concurrency} | {mode} | {t['tokens_per_s']} | {o['tokens_per_s']} | "
                         f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x | {o['mean_acceptance_length']} | "
                         f"{'yes' if o['identical_to_torch_ar'] else 'NO'} |")
    for backend in ("torch", "onnxruntime"):
        ratios = [by[(c, backend, "dflash")]["tokens_per_s"] / by[(c, backend, "ar")]["tokens_per_s"]
                  for c in sorted({p["concurrency"] for p in report["points"]})]
        lines.append(f"\nDFlash / AR under {backend}: " + ", ".join(f"{r:.2f}x" for r in ratios))
    lines.append(f"\n{report['num_prompts']} held-out prompts, {report['max_new_tokens']} new tokens, greedy, medians "
                 f"of {report['repeats']} runs, {report['threads']} threads; {describe(report['machine'])}; "
                 f"load average {', '.join(f'{x:.1f}' for x in report['load_average'])}; {report['date']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
