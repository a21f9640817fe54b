"""DFlash vs AR on the demo engine at batch size 1: acceptance, speedup, step costs and the speedup bound.

    python benchmarks/demo_speedup.py --engine engines/demo --repeats 5 --block-sizes 4,8,16

Both modes run on the same engine and the same held-out prompts, one request at a time, alternating
which mode goes first; times are medians over `--repeats` runs. Writes benchmarks/results/demo_speedup.json
and prints a markdown table.

The bound AL x t_ar / (t_verify + t_draft) is given twice: from `step_costs` (the passes timed in rounds after the
runs, as `bench` does), and from the passes the timed runs made themselves (medians of every drafter, verify and
AR pass in them). On this shared machine a pass timed a minute later can cost 20% more or less than in the runs;
the second bound has no such gap, so measured / in-run bound is what the loop adds around its passes (acceptance,
scheduling, the prefill both modes share).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from trtllm_dflash.runtime.compare import side_by_side, step_costs
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.stats import cpu_name

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def pass_times(executor) -> Iterator[dict[str, list[float]]]:
    """Seconds of every drafter pass, verify pass (a target pass over a block) and AR pass (over one token) the
    executor runs inside the block; prefill passes (those given `last_index`) are not counted. Times the
    executor's own methods from the outside, for this benchmark only."""
    times: dict[str, list[float]] = {"draft": [], "verify": [], "ar": []}
    draft, target_forward = executor.draft, executor.target_forward

    def timed_draft(*args, **kwargs):
        start = time.perf_counter()
        out = draft(*args, **kwargs)
        times["draft"].append(time.perf_counter() - start)
        return out

    def timed_target_forward(tokens, *args, **kwargs):
        start = time.perf_counter()
        out = target_forward(tokens, *args, **kwargs)
        if kwargs.get("last_index") is None:
            times["ar" if tokens.shape[1] == 1 else "verify"].append(time.perf_counter() - start)
        return out

    executor.draft, executor.target_forward = timed_draft, timed_target_forward
    try:
        yield times
    finally:
        del executor.draft, executor.target_forward  # the class's methods again


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, default=ROOT / "engines" / "demo")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--block-sizes", type=lambda t: [int(x) for x in t.split(",")], default=[4, 8, 16])
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "demo_speedup.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} torch threads, no GPU",
        "torch": torch.__version__, "engine": str(args.engine),
        "prompts": str(args.prompts.relative_to(ROOT)) if args.prompts.is_relative_to(ROOT) else str(args.prompts),
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "batch_size": 1, "temperature": 0,
        "by_block_size": [],
    }
    lines = ["| block size | AL | AR tokens/s | DFlash tokens/s | speedup | bound | draft ms | verify ms | AR step ms | "
             "in-run bound | in-run draft / verify / AR ms | speedup / in-run bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for block_size in args.block_sizes:
        engine = Engine.load(args.engine, block_size=block_size, threads=args.threads)
        defaults = Defaults(args.max_new_tokens, 0.0, 0, engine.config.max_seq_len, engine.executor.vocab_size)
        requests, errors = read_requests(args.prompts, engine.tokenizer, defaults)
        assert not errors, errors
        requests = requests[: args.num_prompts]
        side_by_side(engine, requests[:2], repeats=1)  # warm-up
        with pass_times(engine.executor) as in_run:
            cmp = side_by_side(engine, requests, repeats=args.repeats)
        in_run_s = {name: statistics.median(t) for name, t in in_run.items()}
        in_run_bound = cmp.mean_acceptance_length * in_run_s["ar"] / (in_run_s["verify"] + in_run_s["draft"])
        mean_prompt = sum(len(r.prompt_token_ids) for r in requests) / len(requests)
        costs = step_costs(engine.executor, context_len=int(mean_prompt + args.max_new_tokens / 2),
                           context_rows=round(cmp.mean_acceptance_length), repeats=50)
        row = {
            "block_size": block_size, "dtype": engine.config.dtype, "num_prompts": len(requests),
            "outputs_identical": cmp.identical,
            "mean_acceptance_length": round(cmp.mean_acceptance_length, 3),
            "ar_tokens_per_s": round(cmp.ar.tokens_per_s, 2),
            "dflash_tokens_per_s": round(cmp.dflash.tokens_per_s, 2),
            "speedup": round(cmp.speedup, 3),
            "step_costs_ms": {"context_len": costs.context_len, "draft": round(costs.draft_s * 1e3, 3),
                              "verify": round(costs.verify_s * 1e3, 3), "ar": round(costs.ar_s * 1e3, 3)},
            "speedup_bound": round(costs.speedup_bound(cmp.mean_acceptance_length), 3),
            "in_run_pass_ms": {name: round(t * 1e3, 3) for name, t in in_run_s.items()},
            "in_run_passes": {name: len(t) for name, t in in_run.items()},
            "in_run_speedup_bound": round(in_run_bound, 3),
            "speedup_over_in_run_bound": round(cmp.speedup / in_run_bound, 3),
        }
        report["by_block_size"].append(row)
        c = row["step_costs_ms"]
        lines.append(f"| {block_size} | {row['mean_acceptance_length']} | {row['ar_tokens_per_s']} | "
                     f"{row['dflash_tokens_per_s']} | {row['speedup']}x | {row['speedup_bound']}x | {c['draft']} | "
                     f"{c['verify']} | {c['ar']} | {row['in_run_speedup_bound']}x | "
                     f"{' / '.join(str(v) for v in row['in_run_pass_ms'].values())} | "
                     f"{row['speedup_over_in_run_bound']} |")
        print(lines[-1], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    identical = all(r["outputs_identical"] for r in report["by_block_size"])
    print("\n".join(lines))
    print(f"\n{len(requests)} held-out prompts, batch size 1, greedy, {args.max_new_tokens} new tokens, medians of "
          f"{args.repeats} runs; outputs identical to AR: {identical}; step costs at context "
          f"{report['by_block_size'][0]['step_costs_ms']['context_len']}; bound = AL x t_ar / (t_verify + t_draft); "
          f"{report['machine']}, {report['date']}")


if __name__ == "__main__":
    main()
