"""Paged vs static KV cache under one memory budget (issue 29): requests in flight and total tokens/s, side by side.

    python benchmarks/paged_kv.py --engine /tmp/kv/demo --slots 2 --rounds 3

The budget is what `--slots` static slots take (each max_seq_len + a block of positions of every layer of target and
drafter). The static run gets exactly those slots; the paged run gets the same bytes as `--kv-cache-memory` and
`--paged-slots` slots (default: the engine's max_batch_size, 8 for the demo): blocks are taken as requests grow, and
when none is free the latest arrival is preempted and recomputed later (counted). Both decode the same mixed-length workload (the held-out prompts,
max_new_tokens cycling through --lengths), all submitted at once, torch executor, 1 thread, greedy, `--mode`; the runs
alternate by round (static first on even rounds), medians. Reported: the most requests decoding at once, the mean over
steps, total output tokens/s, and whether the tokens are the same (prefix reuse off: the rounds repeat the prompts);
then batch 1 (the first 4 requests alone, the caches alternating request by request): paged reads gather each
request's blocks where the static cache reads views.
Results: benchmarks/results/paged_kv.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import TorchExecutor, cache_shape
from trtllm_dflash.runtime.kv_blocks import format_size
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.runtime.verify import verify_policy

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(decoder: Decoder, requests: list[Request]) -> dict:
    for r in requests:
        decoder.submit(r)
    in_flight, results = [], {}
    start = time.perf_counter()
    while decoder.has_work:
        for update in decoder.step():
            if update.result is not None:
                results[update.request.id] = update.result.output_token_ids
        in_flight.append(decoder.num_active)
    seconds = time.perf_counter() - start
    tokens = sum(len(t) for t in results.values())
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_in_flight": max(in_flight),
            "mean_in_flight": statistics.mean(in_flight), "preemptions": decoder.preemptions,
            "outputs": [results[r.id] for r in requests]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/demo"))
    ap.add_argument("--slots", type=float, default=2, help="the budget: this many static slots' memory (the static "
                                                              "run gets the whole slots of it)")
    ap.add_argument("--mode", choices=("dflash", "ar"), default="dflash")
    ap.add_argument("--lengths", default="32,64,128,256", help="max_new_tokens, cycled over the prompts")
    ap.add_argument("--paged-slots", type=int, help="request slots of the paged run (default: max_batch_size)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "paged_kv.json")
    args = ap.parse_args()
    engine = Engine.load(args.engine, backend="torch", threads=1)
    cfg, ex = engine.config, engine.executor
    per_position = sum(cache_shape(m).position_bytes() for m in (ex.target, ex.drafter))
    budget = int(args.slots * ex.target_cache.capacity * per_position)
    static = TorchExecutor(ex.target, ex.drafter, int(args.slots), cfg.max_seq_len)
    # No prefix reuse here: the rounds repeat the same prompts, which would find the earlier rounds' blocks cached.
    paged_slots = args.paged_slots or cfg.max_batch_size
    paged = TorchExecutor(ex.target, ex.drafter, paged_slots, cfg.max_seq_len, kv_cache_memory=budget,
                          prefix_cache=False)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [json.loads(line)["prompt"] for line in open(ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
               if line.strip()][: args.num_prompts]
    requests = [Request(i, engine.tokenizer(p)["input_ids"], lengths[i % len(lengths)]) for i, p in enumerate(prompts)]
    stop = cfg.eos_token_ids
    load_before = load()
    print(f"budget {format_size(budget)} = {args.slots} static slots of {ex.target_cache.capacity} positions; paged: "
          f"{paged.kv_blocks.num_blocks} blocks of 16, {paged_slots} slots; {len(requests)} requests, "
          f"max_new_tokens {lengths}; load before: {load_before}", flush=True)
    runs: dict[str, list[dict]] = {"static": [], "paged": []}
    with torch.inference_mode():
        for name, executor in (("static", static), ("paged", paged)):  # warm-up
            run(Decoder(executor, verify_policy(args.mode, executor.block_size, None), stop), requests[:2])
        for r in range(args.rounds):
            for name in (("static", "paged") if r % 2 == 0 else ("paged", "static")):
                executor = static if name == "static" else paged
                runs[name].append(run(Decoder(executor, verify_policy(args.mode, executor.block_size, None), stop),
                                      requests))
                print(f"round {r + 1} {name}: {runs[name][-1]['tokens_per_s']:.1f} tok/s, in flight peak "
                      f"{runs[name][-1]['peak_in_flight']}, mean {runs[name][-1]['mean_in_flight']:.2f}, "
                      f"preemptions {runs[name][-1]['preemptions']}", flush=True)
        # Batch 1: the first 4 requests one after another, the two caches alternating request by request.
        alone: dict[str, list[float]] = {"static": [], "paged": []}
        for r in range(args.rounds):
            for request in requests[:4]:
                for name in (("static", "paged") if r % 2 == 0 else ("paged", "static")):
                    executor = static if name == "static" else paged
                    one = run(Decoder(executor, verify_policy(args.mode, executor.block_size, None), stop), [request])
                    alone[name].append(one["tokens_per_s"])
        batch1 = {name: round(statistics.median(v), 1) for name, v in alone.items()}
        print(f"batch 1 (medians of {len(alone['paged'])} requests): {batch1}", flush=True)
    table = {name: {"tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in rs), 1),
                    "peak_in_flight": max(x["peak_in_flight"] for x in rs),
                    "mean_in_flight": round(statistics.median(x["mean_in_flight"] for x in rs), 2),
                    "preemptions": max(x["preemptions"] for x in rs)}
             for name, rs in runs.items()}
    same = all(x["outputs"] == runs["static"][0]["outputs"] for rs in runs.values() for x in rs)
    report = {"engine": str(args.engine), "mode": args.mode, "budget_bytes": budget, "budget_in_static_slots": args.slots,
              "static_slots": int(args.slots),
              "paged_blocks": paged.kv_blocks.num_blocks, "paged_slots": paged_slots, "lengths": lengths,
              "num_requests": len(requests), "rounds": args.rounds, "threads": 1, "load_before": load_before, "load_after": load(),
              "results": table, "outputs_identical": same, "batch_1_tokens_per_s": batch1,
              "batch_1_paged_over_static": round(batch1["paged"] / batch1["static"], 3),
              "paged_over_static_tokens_per_s": round(table["paged"]["tokens_per_s"] / table["static"]["tokens_per_s"], 2),
              "paged_over_static_in_flight": {k: round(table["paged"][k] / table["static"][k], 2)
                                              for k in ("peak_in_flight", "mean_in_flight")}}
    print(json.dumps(report, indent=1))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
