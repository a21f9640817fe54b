"""Experts in the torch executor: grouped GEMMs (models/moe.py `routed_grouped`, what the executor runs since
2026-12-06) against transformers' expert-by-expert loop (`routed_loop`, what it ran before), side by side on the CPU.

    python benchmarks/moe_grouped.py --rounds 40

The families and shapes of benchmarks/moe_op.py (one MLP of experts, hidden 512: gpt-oss at 32 and 128 experts top 4,
intermediate 512; DeepSeek-V3 at 256 top 8 in 8 groups and Kimi K2 at 384 top 8, intermediate 128), fp32, 1 thread,
for 1, 16 and 128 tokens (a decode step, a verify block, a prefill chunk). Each row checks the two forms agree, then
times them alternating in chunks; medians. What it measures is the CPU's cost of the form that lets a GPU capture the
experts: no claim about a GPU, where the loop's cost is a host read per expert and layer (not measured: no GPU here).
Results: benchmarks/results/moe_grouped.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_op import FAMILIES  # noqa: E402  (the same modules and shapes)

from trtllm_dflash.models import moe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def loop_form():
    """Within: every MLP of experts runs the loop (models/moe.py takes it for operands grouped_mm does not take)."""
    groupable, moe.groupable = moe.groupable, lambda *tensors: False
    try:
        yield
    finally:
        moe.groupable = groupable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "moe_grouped.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows = []
    with torch.inference_mode():
        for family, make in FAMILIES:
            module = make(args.width).eval()
            for p in module.parameters():
                p.normal_(0.0, 0.05)
            for tokens in (1, 16, 128):
                x = torch.randn(1, tokens, args.width)
                grouped = module(x)
                with loop_form():
                    loop = module(x)
                torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-4)
                times: dict[str, list[float]] = {"grouped": [], "loop": []}
                for _ in range(4):
                    for name in ("loop", "grouped"):
                        with loop_form() if name == "loop" else contextlib.nullcontext():
                            for _ in range(args.rounds // 4):
                                start = time.perf_counter()
                                module(x)
                                times[name].append(time.perf_counter() - start)
                ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in times.items()}
                row = {"family": family, "tokens": tokens, "loop_ms": ms["loop"], "grouped_ms": ms["grouped"],
                       "grouped_over_loop": round(ms["grouped"] / ms["loop"], 2)}
                rows.append(row)
                print(row, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": load,
              "load_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]), "torch": torch.__version__,
              "threads": 1, "hidden": args.width,
              "intermediate": {"gpt-oss": args.width, "DeepSeek-V3 / Kimi K2": args.width // 4},
              "rounds": args.rounds, "rows": rows}
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
