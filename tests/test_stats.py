"""trtllm_dflash.stats: one definition, one convention, per statistic; and its callers use it."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_dflash import stats
from trtllm_dflash.bench.metrics import decoding_stats, per_category
from trtllm_dflash.runtime.decoding import Request, Result
from trtllm_dflash.runtime.jsonl import summarize


def result(rid, steps, verify_lengths=(), n_out=None, ttft=0.01, e2e=0.05) -> Result:
    n_out = n_out if n_out is not None else 1 + sum(steps) + sum(1 for k in verify_lengths if k == 1)
    return Result(Request(rid, [1, 2, 3], 64), list(range(n_out)), "length", list(steps), ttft_s=ttft, e2e_s=e2e,
                  verify_lengths=list(verify_lengths))


def test_mean_acceptance_length_and_its_no_step_convention():
    assert stats.mean_acceptance_length([3, 1, 5]) == 3.0
    assert stats.mean_acceptance_length(iter([2, 3])) == 2.5
    # The one convention: no verify step -> 1.0 (plain decoding), never None or 0
    assert stats.mean_acceptance_length([]) == 1.0
    assert stats.acceptance_length_from_totals(0, 0) == 1.0
    assert stats.acceptance_length_from_totals(9, 3) == 3.0
    rs = [result("a", [3, 1]), result("b", []), result("c", [4])]
    assert stats.all_steps(rs) == [3, 1, 4]
    assert stats.mean_acceptance_length(stats.all_steps(rs)) == pytest.approx(8 / 3)


def test_callers_share_the_convention():
    """run's summary, bench's decoding stats and per-category AL give the same value, 1.0 with no verify step."""
    prefill_only = [result("a", [], n_out=1), result("b", [], n_out=1)]
    for mode in ("ar", "dflash"):
        assert summarize(mode, prefill_only, 1.0, 4)["mean_acceptance_length"] == 1.0
    dec = decoding_stats(prefill_only, 4)
    assert dec["acceptance_length"] == 1.0 and dec["num_verify_steps"] == 0
    assert dec["draft_acceptance_rate"] is None and dec["acceptance_length_percentiles"] is None
    assert per_category(prefill_only, {"a": "x", "b": "y"})["x"]["acceptance_length"] == 1.0

    rs = [result("a", [3, 1, 4]), result("b", [2])]
    assert summarize("dflash", rs, 1.0, 4)["mean_acceptance_length"] == 2.5
    assert decoding_stats(rs, 4)["acceptance_length"] == 2.5


def test_drafts_and_rates():
    fixed = result("a", [3, 1, 4])  # block 4: 3 drafts per verify step
    assert stats.drafted_tokens(fixed, 4) == 9 and stats.accepted_tokens(fixed) == 5
    # --block-size auto: verify lengths 4, 1 (a plain AR step), 2; acceptance lengths only for k > 1
    auto = result("b", [3, 2], verify_lengths=[4, 1, 2])
    assert stats.verify_steps([auto], 8) == [(4, 3), (2, 2)]
    assert stats.drafted_tokens(auto, 8) == 3 + 1 and stats.accepted_tokens(auto) == 2 + 1
    assert stats.draft_acceptance_rate(3, 4) == 0.75
    assert stats.draft_acceptance_rate(0, 0) is None
    assert stats.drafted_tokens(result("c", []), 4) == 0


def test_acceptance_per_position():
    rs = [result("a", [1, 2, 4])]  # block 4: position 1 accepted in 2 of 3 steps, 2 in 1, 3 in 1
    assert stats.acceptance_per_position(rs, 4) == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    auto = [result("b", [2, 3], verify_lengths=[2, 1, 3])]  # position 2 exists in the k = 3 step only
    assert stats.acceptance_per_position(auto, 4) == [1.0, 1.0, None]
    assert stats.acceptance_per_position([result("c", [])], 4) == []


def test_percentiles_one_method():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    block = stats.percentiles(values)
    assert list(block) == ["minimum", "maximum", "average", "p50", "p90", "p95", "p99"]
    assert block["minimum"] == 1.0 and block["maximum"] == 5.0 and block["average"] == 3.0
    assert block["p50"] == 3.0 and block["p90"] == pytest.approx(4.6) and block["p99"] == pytest.approx(4.96)
    assert all(block[f"p{q}"] == round(float(np.percentile(values, q)), 4) for q in stats.PERCENTILES)
    assert stats.percentiles([]) is None and stats.percentiles_ms([]) is None
    ms = stats.percentiles_ms([0.0015, 0.0020004])  # seconds -> milliseconds, rounded to the microsecond
    assert ms["minimum"] == 1.5 and ms["maximum"] == 2.0 and ms["average"] == 1.75
    assert stats.percentiles([1, 2], ndigits=1) == stats.percentiles([1.0, 2.0], ndigits=1)
    # run's summary uses the same block for its times
    s = summarize("ar", [result("a", [], ttft=0.01, e2e=0.03), result("b", [], ttft=0.02, e2e=0.05)], 1.0, 4)
    assert s["ttft_ms"] == stats.percentiles_ms([0.01, 0.02]) and s["request_latency_ms"]["maximum"] == 50.0


def test_cpu_name_is_the_one_machine_name():
    from trtllm_dflash.bench import machine
    from trtllm_dflash.runtime import costs

    name = stats.cpu_name()
    assert isinstance(name, str) and name
    assert machine.machine_info()["cpu"] == name
    assert machine.cpu_name is stats.cpu_name and costs.cpu_name is stats.cpu_name
