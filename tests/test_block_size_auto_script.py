"""benchmarks/block_size_auto.py's checks on hand-made bench reports (the script itself runs for minutes)."""

from __future__ import annotations

from tests.conftest import ROOT, load_script


def bound(block_size: int, measured: float | None) -> dict:
    return {"block_size": block_size, "speedup_bound": 1.5, "step_costs_ms": {}, "acceptance_length": 3.0,
            "measured_speedup": measured, "measured_tpot_speedup": measured}


def test_bound_checks_without_a_concurrency_1_run_are_empty_not_a_crash():
    """`--concurrency 2` has no batch-1 speedup to hold against the bound: no rows (it used to divide None after the
    whole benchmark had run, losing its results), while a measured block gets its ratio."""
    script = load_script(ROOT / "benchmarks" / "block_size_auto.py", "block_size_auto_script")
    assert script.bound_checks({"speedup_bound": [bound(4, None), bound(8, None)]}) == []
    rows = script.bound_checks({"speedup_bound": [bound(4, 1.2), bound(8, None)]})
    assert [(r["block_size"], r["measured_over_bound"], r["measured_tpot_over_bound"]) for r in rows] == [(4, 0.8, 0.8)]
