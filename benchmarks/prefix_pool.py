"""The compiled executors' prefix pool (runtime/cache_rows.PrefixRows): the copies of a prompt's blocks into the pool
when a request publishes them, and out of it into a later request's row on a hit, two checkouts side by side
(issue 29: the cost a unique prompt pays for prefix caching, and what a hit pays instead of its prefill).

    python benchmarks/prefix_pool.py --before /tmp/before --engine /tmp/peers/demo --rounds 3

An onnxruntime engine (build_configs/demo.yaml's). Each checkout runs in a fresh process of its own (the checkout
first on sys.path), in rounds whose order alternates, 1 thread: 12 prompts of --prompt-tokens random tokens + 1, each
reserved in row 0 (no hit), published (timed), then reserved in row 1 (a hit of every block, timed) and released; the
median of the last 10 (the first two touch the pool's memory for the first time). Medians over rounds go to
benchmarks/results/prefix_pool.json with the load average at each run. The prefill a hit saves, for scale: `run`
timings in docs/run.md (the demo engine's target prefill of 512 positions: ~135 ms here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
from trtllm_dflash.runtime.runner import Engine

engine_dir, tokens = sys.argv[1], int(sys.argv[2])
executor = Engine.load(engine_dir, backend="onnxruntime", threads=1).executor
pool = executor.prefix_rows
g = torch.Generator().manual_seed(0)
publish, hit = [], []
for _ in range(12):
    prompt = torch.randint(4, executor.vocab_size, (tokens + 1,), generator=g).tolist()
    assert pool.reserve(0, prompt, "bench") == 0
    t = time.perf_counter()
    pool.publish(0)
    publish.append(time.perf_counter() - t)
    t = time.perf_counter()
    found = pool.reserve(1, prompt, "bench")
    hit.append(time.perf_counter() - t)
    assert found == tokens // pool.block_tokens * pool.block_tokens, found
    pool.release(0)
    pool.release(1)
# (PrefixRows' private _buffers: what every checkout since the pool has, the earlier one under --before too)
print(json.dumps({"publish_ms": statistics.median(publish[2:]) * 1e3, "hit_ms": statistics.median(hit[2:]) * 1e3,
                  "blocks": tokens // pool.block_tokens, "buffers": len(pool._buffers)}))
'''


def child(checkout: Path, engine: Path, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, str(engine), str(tokens)], cwd=checkout, env=env, check=True,
                         capture_output=True, text=True).stdout
    return {**json.loads(out.strip().splitlines()[-1]), "load_before": round(load, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="a checkout of the earlier commit")
    p.add_argument("--engine", type=Path, default=Path("engines/demo"), help="an onnxruntime engine")
    p.add_argument("--prompt-tokens", type=int, default=480)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_pool.json")
    a = p.parse_args()
    sides = {"before": a.before.resolve(), "after": ROOT}
    started, runs = time.time(), {name: [] for name in sides}
    for r in range(a.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            runs[name].append(child(sides[name], a.engine.resolve(), a.prompt_tokens))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    rev = {name: subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() for name, path in sides.items()}
    table = {name: {key: round(statistics.median(x[key] for x in rs), 2) for key in ("publish_ms", "hit_ms")}
             for name, rs in runs.items()}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "before": rev["before"], "after": rev["after"],
              "engine": str(a.engine), "prompt_tokens": a.prompt_tokens, "blocks": runs["after"][0]["blocks"],
              "buffers": runs["after"][0]["buffers"], "rounds": a.rounds, "threads": 1,
              "minutes": round((time.time() - started) / 60, 1), "results": table,
              "publish_before_over_after": round(table["before"]["publish_ms"] / table["after"]["publish_ms"], 2),
              "hit_before_over_after": round(table["before"]["hit_ms"] / table["after"]["hit_ms"], 2),
              "runs": runs}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    a.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
