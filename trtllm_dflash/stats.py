"""Every statistic the project reports, computed in one place with one convention each.

Acceptance length (AL): the tokens one DFlash verify step commits, accepted drafts + 1 (as the DFlash paper
and `run` report it). A run's mean AL is the mean over all its verify steps (not over requests).

Convention for no verify step: the mean acceptance length is **1.0**. Without a verify step every token was
committed by a one-token step (the prefill, `--mode ar`, or a `--block-size auto` step at k = 1), which is
plain decoding's acceptance length; it is never None and never 0. The Triton output `mean_acceptance_length`,
`run --summary`, `bench`, `compare`, `train-drafter`'s held-out estimate and the benchmarks/ scripts all use it.

Draft acceptance rate (accepted drafts / drafted tokens): None when nothing was drafted (0 / 0 has no value
to stand in for); Triton's FP32 `acceptance_rate` output, which cannot carry None, serves 0.0 there.

Percentiles: trtllm-bench's block (minimum, maximum, average, p50, p90, p95, p99), numpy's default linear
interpolation, None for no values.

The machine: `cpu_name()`, the CPU model from /proc/cpuinfo.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from trtllm_dflash.runtime.decoding import Result

PERCENTILES = (50, 90, 95, 99)


# ---------------------------------------------------------------- acceptance

def all_steps(results: Iterable[Result]) -> list[int]:
    """The acceptance lengths of every verify step of `results`, in order."""
    return [n for r in results for n in r.acceptance_lengths]


def acceptance_length_from_totals(committed: int, steps: int) -> float:
    """Mean acceptance length from running totals: `committed` tokens over `steps` verify steps (1.0 if none)."""
    return committed / steps if steps else 1.0


def mean_acceptance_length(steps: Iterable[int]) -> float:
    """Mean tokens committed per verify step; 1.0 when there is no verify step (the module's convention).

    `steps`: acceptance lengths (a Result's `acceptance_lengths`, or `all_steps(results)` for a run)."""
    steps = list(steps)
    return acceptance_length_from_totals(sum(steps), len(steps))


def verify_steps(results: Iterable[Result], block_size: int) -> list[tuple[int, int]]:
    """(verify length k, acceptance length) of every verify step; k is block_size unless --block-size auto chose it
    (auto's k = 1 steps are plain AR steps: no drafts, no acceptance length)."""
    steps = []
    for r in results:
        lengths = [k for k in r.verify_lengths if k > 1] or [block_size] * len(r.acceptance_lengths)
        steps += zip(lengths, r.acceptance_lengths)
    return steps


def drafted_tokens(result: Result, block_size: int) -> int:
    """Draft tokens the target verified for one request: k - 1 per verify step of k tokens."""
    return sum(k - 1 for k, _ in verify_steps([result], block_size))


def accepted_tokens(result: Result) -> int:
    """Draft tokens accepted for one request: acceptance length - 1 per verify step."""
    return sum(n - 1 for n in result.acceptance_lengths)


def draft_acceptance_rate(accepted: int, drafted: int) -> float | None:
    """Accepted draft tokens / draft tokens (TensorRT-LLM's acceptance rate); None when nothing was drafted."""
    return accepted / drafted if drafted else None


def acceptance_per_position(results: Iterable[Result], block_size: int) -> list[float | None]:
    """For block position j = 1 .. block_size - 1: the share of the verify steps with a j-th draft that accepted it
    (with a fixed block, every verify step has one; with --block-size auto, None where no step verified j).
    An empty list when there is no verify step."""
    steps = verify_steps(results, block_size)
    out = []
    for j in range(1, block_size):
        had = [n for k, n in steps if k - 1 >= j]
        out.append(sum(n - 1 >= j for n in had) / len(had) if had else None)
    return out if steps else []


# ---------------------------------------------------------------- percentiles

def percentiles(values: Sequence[float], *, scale: float = 1.0, ndigits: int = 4) -> dict[str, float] | None:
    """trtllm-bench's percentile block of `values` x `scale`: minimum, maximum, average, p50, p90, p95, p99
    (numpy's linear interpolation), each rounded to `ndigits`; None when there are no values."""
    if len(values) == 0:
        return None
    v = np.asarray(values, dtype=float) * scale
    stats = {"minimum": v.min(), "maximum": v.max(), "average": v.mean()}
    stats |= {f"p{q}": np.percentile(v, q) for q in PERCENTILES}
    return {k: round(float(x), ndigits) for k, x in stats.items()}


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float] | None:
    """The percentile block of times given in seconds, in milliseconds rounded to the microsecond."""
    return percentiles(seconds, scale=1e3, ndigits=3)


# ---------------------------------------------------------------- the machine

def cpu_name() -> str:
    """The CPU model ("model name" in /proc/cpuinfo); elsewhere platform.processor(), or "unknown CPU"."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"
