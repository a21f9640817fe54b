"""How each executor's thread policy holds up when other work shares the CPU (issue 28, item 6).

Runs `trtllm-dflash run` on an engine in fresh processes (an OpenMP wait policy is read once, when torch starts),
once per (load, policy, mode) in every round, the order shuffled within a round, and reports the median tokens/s
of each and its ratio to the same policy on the quiet machine. "Load" is N processes spinning in pure Python beside
the run (`--busy`), as a shared laptop or node would have; the load average when each run starts is recorded,
since the machine may have other work of its own.

    python benchmarks/threads_under_load.py --engine engines/demo --busy 0,2 --rounds 3 \
        --policies default,threads1,passive --output benchmarks/results/threads_under_load.json

Policies:
  default   no --threads: trtllm-dflash's default (runtime/runner.py cpu_threads; before it, torch's one per core)
  threads1  --threads 1 (no barrier at all)
  threads2  --threads 2 (torch's default on this 2-core machine: libgomp spins at its barriers before sleeping)
  passive   OMP_WAIT_POLICY=PASSIVE, --threads 2 (a waiting thread sleeps at once and gives its core away)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {
    "default": ({}, []),
    "threads1": ({}, ["--threads", "1"]),
    "threads2": ({}, ["--threads", "2"]),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "2"]),
    "passive-threads1": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "1"]),
}
SPIN = "while True:\n    pass\n"


def one_run(engine: Path, prompts: Path, backend: str, mode: str, policy: str, max_new_tokens: int,
            timeout: float) -> dict:
    env_extra, args = POLICIES[policy]
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        argv = [sys.executable, "-m", "trtllm_dflash.cli", "run", str(engine), "--input", str(prompts),
                "--output", str(Path(tmp) / "out.jsonl"), "--summary", str(summary), "--mode", mode,
                "--backend", backend, "--max-new-tokens", str(max_new_tokens), *args]
        load = os.getloadavg()[0]
        try:
            done = subprocess.run(argv, env={**os.environ, **env_extra}, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"tokens_per_s": None, "load_before": load, "note": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip().splitlines()[-1:]}")
        data = json.loads(summary.read_text())
        return {"tokens_per_s": data["output_tokens_per_s"], "load_before": load,
                "mean_acceptance_length": data["mean_acceptance_length"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, default=ROOT / "engines" / "demo")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=1, help="requests per run (1: batch 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--busy", default="0,2", help="competing spinning processes per condition")
    p.add_argument("--policies", default="default,threads1,passive")
    p.add_argument("--modes", default="ar,dflash")
    p.add_argument("--backends", default="torch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as collapsed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "threads_under_load.json")
    a = p.parse_args()

    lines = [line for line in a.prompts.read_text().splitlines() if line.strip()][: a.num_prompts]
    prompts = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    busy_levels = [int(x) for x in a.busy.split(",")]
    cells = [(b, be, pol, mode) for b in busy_levels for be in a.backends.split(",")
             for pol in a.policies.split(",") for mode in a.modes.split(",")]
    rng = random.Random(a.seed)
    samples: dict[tuple, list[dict]] = {c: [] for c in cells}
    start = time.time()
    for r in range(a.rounds):
        for busy in busy_levels:  # one load condition at a time, its cells shuffled
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
            try:
                todo = [c for c in cells if c[0] == busy]
                rng.shuffle(todo)
                for cell in todo:
                    _, backend, policy, mode = cell
                    sample = one_run(a.engine, prompts, backend, mode, policy, a.max_new_tokens, a.timeout)
                    samples[cell].append(sample)
                    print(f"round {r + 1} busy {busy} {backend} {policy} {mode}: {sample}", file=sys.stderr,
                          flush=True)
            finally:
                for s in spinners:
                    s.kill()
                    s.wait()

    def median(cell):
        values = [s["tokens_per_s"] or 0.0 for s in samples[cell]]
        return statistics.median(values)

    rows = []
    for cell in cells:
        busy, backend, policy, mode = cell
        quiet = (busy_levels[0], backend, policy, mode)
        rows.append({"busy": busy, "backend": backend, "policy": policy, "mode": mode,
                     "median_tokens_per_s": median(cell),
                     "vs_same_policy_at_busy_%d" % busy_levels[0]: round(median(cell) / median(quiet), 3)
                     if median(quiet) else None,
                     "samples": samples[cell]})
    report = {"engine": str(a.engine), "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens,
              "rounds": a.rounds, "cpus": len(os.sched_getaffinity(0)), "minutes": round((time.time() - start) / 60, 1),
              "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(report, indent=1) + "\n")
    for row in rows:
        print(f"busy {row['busy']} {row['backend']:12s} {row['policy']:16s} {row['mode']:6s} "
              f"{row['median_tokens_per_s']:8.1f} tok/s", file=sys.stderr)


if __name__ == "__main__":
    main()
