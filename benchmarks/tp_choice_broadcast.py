"""What `--block-size auto` adds to a tensor-parallel step: rank 0's choice of k broadcast to the other ranks
(runtime/lockstep.py's Rank0Chooses: two int64 on the host, through gloo, the CPU part of every process group).

    python benchmarks/tp_choice_broadcast.py --ranks 2 --calls 2000

`--ranks` processes on this machine (torch.multiprocessing, a file store), each broadcast timed on rank 0 after 200
unmeasured ones; the median and 90th percentile of `--rounds` runs go to benchmarks/results/tp_choice_broadcast.json
with the load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def rank_main(rank: int, ranks: int, store: str, calls: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    choice = torch.zeros(2, dtype=torch.long)  # what Rank0Chooses.choose broadcasts
    for _ in range(200):
        dist.broadcast(choice, src=0)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.broadcast(choice, src=0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        times.sort()
        Path(out).write_text(json.dumps({"median_us": round(statistics.median(times) * 1e6, 1),
                                         "p90_us": round(times[int(0.9 * len(times))] * 1e6, 1)}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "tp_choice_broadcast.json")
    a = p.parse_args()
    runs = []
    for _ in range(a.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            load = os.getloadavg()[0]
            out = Path(tmp) / "out.json"
            mp.start_processes(rank_main, args=(a.ranks, str(Path(tmp) / "store"), a.calls, str(out)),
                               nprocs=a.ranks, start_method="spawn")
            runs.append({**json.loads(out.read_text()), "load_before": round(load, 2)})
            print(runs[-1], flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "ranks": a.ranks, "calls": a.calls, "cpus": os.cpu_count(),
              "median_us": statistics.median(r["median_us"] for r in runs),
              "p90_us": statistics.median(r["p90_us"] for r in runs), "runs": runs}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    a.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
