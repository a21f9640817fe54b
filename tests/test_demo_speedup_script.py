"""benchmarks/demo_speedup.py's in-run pass timing on a small engine (the script itself runs for minutes)."""

from __future__ import annotations

from tests.conftest import ROOT, load_script
from trtllm_dflash.runtime.compare import side_by_side
from trtllm_dflash.runtime.decoding import Request


def test_pass_times_counts_every_pass_of_the_runs_and_leaves_the_executor_as_it_was(biased_engines):
    """Every DFlash step is one drafter and one verify pass, every AR token after the prefill's first one is one AR
    pass, prefills are not counted; afterwards the executor runs its class's methods again, and the outputs are
    those of a run without the timing."""
    engine = biased_engines[8]
    ex = engine.executor
    requests = [Request(i, [5 + i, 9, 11 + 2 * i], max_new_tokens=12 + i) for i in range(3)]
    plain = side_by_side(engine, requests)
    with load_script(ROOT / "benchmarks" / "demo_speedup.py", "demo_speedup_script").pass_times(ex) as times:
        timed = side_by_side(engine, requests, repeats=2)
    steps = sum(len(r.acceptance_lengths) for r in timed.results)
    ar_tokens = sum(len(r.output_token_ids) for r in timed.results)
    assert steps > 0 and len(times["verify"]) == len(times["draft"]) == 2 * steps
    assert len(times["ar"]) == 2 * (ar_tokens - len(requests))
    assert all(t > 0 for kind in times.values() for t in kind)
    assert "draft" not in vars(ex) and "target_forward" not in vars(ex)
    assert [r.output_token_ids for r in timed.results] == [r.output_token_ids for r in plain.results]
