"""One drafter pass a step against two (the context in a pass of its own), side by side in one process.

    python benchmarks/draft_pass.py --repeats 7                       # torch executor, engines/demo
    python benchmarks/draft_pass.py --repeats 7 --backend onnxruntime  # engines/demo-onnxruntime, built if missing

Since 2026-12-02 a DFlash step adds the features the step before committed to the drafter's context inside its
draft pass (DFlashDrafter.forward(context=), the reference's k_proj(cat[target_hidden, noise])); before, a
pass of their own (append_context) ran first. Both run here on the same engine, the same held-out prompts, one
request at a time, greedy, in rounds (fused, separate, ar; rotating which goes first), so a slow spell of the
machine falls on all three: `separate` is the same executor with every draft's context handed to
append_context first, which is exactly what the old step did. Reports DFlash tokens/s of each, their ratio
(median over rounds of the per-round ratio) and AR beside them; writes benchmarks/results/draft_pass[_BACKEND].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from trtllm_dflash.bench.machine import describe, machine_info
from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import DraftContext, Executor
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"


class ContextPassFirst:
    """An executor whose draft pass gets no context: it hands the context to append_context first (two drafter
    passes a step, the step as it was before 2026-12-02). Everything else is the wrapped executor's."""

    def __init__(self, executor: Executor):
        self.executor = executor

    def __getattr__(self, name: str):
        return getattr(self.executor, name)

    def draft(self, anchors, starts, slots, num_drafts=None, context: DraftContext | None = None,
              rows=None, width=None) -> torch.Tensor:
        if context is not None:
            self.executor.append_context(context.hidden, context.starts, slots)
        return self.executor.draft(anchors, starts, slots, num_drafts, rows=rows, width=width)


def decode_one_by_one(executor, mode: str, requests: list[Request], eos: list[int]) -> tuple[float, list[list[int]]]:
    """Seconds to decode the requests one at a time (batch size 1), and their tokens."""
    decoder = Decoder.for_mode(executor, mode, eos)
    start, tokens = time.perf_counter(), []
    for request in requests:
        tokens += [r.output_token_ids for r in decoder.generate([request])]
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("torch", "onnxruntime"), default="torch")
    p.add_argument("--engine", type=Path, help="default: engines/demo (torch) or engines/demo-onnxruntime, built "
                   "from build_configs/demo.yaml if missing")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    suffix = "" if args.backend == "torch" else f"-{args.backend}"
    if args.engine is None:
        args.engine = ROOT / "engines" / f"demo{suffix}"
        if not (args.engine / "manifest.json").is_file():
            cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=args.engine)
            build_engine(cfg.model_copy(update={"backend": args.backend}), force=True, progress=False)
    output = args.output or ROOT / "benchmarks" / "results" / f"draft_pass{suffix.replace('-', '_')}.json"

    engine = Engine.load(args.engine, block_size=args.block_size, backend=args.backend, threads=args.threads)
    defaults = Defaults(args.max_new_tokens, 0.0, 0, engine.config.max_seq_len, engine.executor.vocab_size)
    requests, errors = read_requests(PROMPTS, engine.tokenizer, defaults)
    assert not errors, errors
    requests = requests[: args.num_prompts]
    eos = list(engine.config.eos_token_ids)
    configs = {"fused": (engine.executor, "dflash"), "separate": (ContextPassFirst(engine.executor), "dflash"),
               "ar": (engine.executor, "ar")}
    for executor, mode in configs.values():  # warm-up
        decode_one_by_one(executor, mode, requests[:1], eos)
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    tokens: dict[str, list[list[int]]] = {}
    names = list(configs)
    for rep in range(args.repeats):
        for name in names[rep % 3:] + names[: rep % 3]:
            elapsed, tokens[name] = decode_one_by_one(*configs[name], requests, eos)
            seconds[name].append(elapsed)
    n_tokens = sum(len(t) for t in tokens["fused"])
    tps = {name: round(n_tokens / statistics.median(s), 2) for name, s in seconds.items()}
    ratio = statistics.median(s / f for f, s in zip(seconds["fused"], seconds["separate"]))
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
        "command": f"python benchmarks/draft_pass.py --backend {args.backend} --repeats {args.repeats}",
        "engine": str(args.engine), "backend": args.backend, "block_size": args.block_size,
        "num_prompts": len(requests), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "output_tokens": n_tokens, "tokens_per_s": tps,
        "seconds_per_repeat": {name: [round(t, 3) for t in s] for name, s in seconds.items()},
        "fused_over_separate_median_ratio": round(ratio, 3),
        "fused_over_ar": round(tps["fused"] / tps["ar"], 3), "separate_over_ar": round(tps["separate"] / tps["ar"], 3),
        "outputs_identical": tokens["fused"] == tokens["separate"] == tokens["ar"],
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"| backend | one drafter pass (tokens/s) | context pass first (tokens/s) | one / two passes | AR (tokens/s) "
          f"| one pass / AR | two passes / AR | outputs identical |\n|---|---|---|---|---|---|---|---|\n"
          f"| {args.backend} | {tps['fused']} | {tps['separate']} | {ratio:.3f}x | {tps['ar']} | "
          f"{report['fused_over_ar']}x | {report['separate_over_ar']}x | {report['outputs_identical']} |")
    print(f"{describe(report['machine'])}; {len(requests)} prompts, {args.max_new_tokens} new tokens, block "
          f"{args.block_size}, batch 1, medians of {args.repeats} rounds; JSON in {output}")


if __name__ == "__main__":
    main()
