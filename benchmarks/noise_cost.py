"""Cost of the sampling noise on this machine's CPU, before and after issue 28, side by side in one process.

    python benchmarks/noise_cost.py --rounds 7 --vocab 151936

before: the noise as trtllm-dflash drew it until issue 28 (speculative/core.py at 789cb05^): a CPU torch.Generator
        seeded per (request seed, position), torch.rand over the vocabulary in float64, -log(-log(u)), one Python call
        per sampled row.
after:  speculative/noise.py's `gumbel` (counter-based hash, all rows in one call, pieces of the vocabulary on the
        CPU), and the same with the pieces turned off (one piece, as a GPU runs it) to show what the pieces buy.

The variants alternate inside each round; medians over rounds, per call and per row, 1 thread (as the CPU executors
run by default), with the load average before and after. Results: benchmarks/results/noise_cost.json. Nothing here
ran on a GPU; there the point is no host work and no copy, not this CPU cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trtllm_dflash.speculative import noise

ROOT = Path(__file__).resolve().parents[1]
_MASK64 = (1 << 63) - 1


def before(seeds: list[int], positions: list[list[int]], vocab_size: int) -> torch.Tensor:
    """The pre-issue-28 noise, row by row (as sample_tokens drew it then)."""
    rows = []
    for seed, row in zip(seeds, positions):
        for position in row:
            gen = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + position) & _MASK64)
            u = torch.rand(vocab_size, generator=gen, dtype=torch.float64)
            rows.append(-torch.log(-torch.log(u.clamp_min(1e-300))).float())
    return torch.stack(rows)


def one_piece(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    saved, noise.CPU_PIECE_ELEMENTS = noise.CPU_PIECE_ELEMENTS, 1 << 62
    try:
        return noise.gumbel(seeds, positions, vocab_size)
    finally:
        noise.CPU_PIECE_ELEMENTS = saved


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--shapes", default="1x1,1x16,8x16", help="batch x rows per request, comma-separated")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "noise_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = loadavg()
    results = []
    for shape in args.shapes.split(","):
        batch, rows = map(int, shape.split("x"))
        seeds, positions = list(range(11, 11 + batch)), [[100 + j for j in range(rows)] for _ in range(batch)]
        seeds_t, positions_t = torch.tensor(seeds), torch.tensor(positions)
        variants = {"before": lambda: before(seeds, positions, args.vocab),
                    "after": lambda: noise.gumbel(seeds_t, positions_t, args.vocab),
                    "after_one_piece": lambda: one_piece(seeds_t, positions_t, args.vocab)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        row = {"batch": batch, "rows": rows, "vocab": args.vocab}
        for name, ts in times.items():
            row[f"{name}_ms"] = round(statistics.median(ts) * 1e3, 2)
            row[f"{name}_ms_per_row"] = round(statistics.median(ts) * 1e3 / (batch * rows), 2)
        row["after_over_before"] = round(row["after_ms"] / row["before_ms"], 2)
        results.append(row)
        print(json.dumps(row))
    report = {"rounds": args.rounds, "threads": 1, "loadavg_before": load_before, "loadavg_after": loadavg(),
              "results": results}
    print("loadavg before:", load_before, "| after:", report["loadavg_after"])
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
