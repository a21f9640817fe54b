"""`--block-size auto`: the k chooser on hand-made cost tables, the acceptance estimate, losslessness for any
sequence of verify lengths (greedy and sampled, batched, requests joining mid-run), and the cost-profile cache
(a foreign or stale profile is measured again, a corrupt one refused in one sentence)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.errors import UserError
from trtllm_dflash.runtime import costs as costs_module
from trtllm_dflash.runtime.costs import (PassCosts, acceptance_path, load_or_measure, profile_key, profile_path,
                                         read_acceptance, read_profile, write_acceptance)
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.speculative.schedule import (PRIOR_RATE, TREE_PRIOR_GAIN, AcceptanceEstimate, AutoBlockSize,
                                                CostCorrection, choose_verify_length, expected_committed)

# ------------------------------------------------------------------------------------------------
# The chooser: a pure function of P(accepted >= j) and the step costs
# ------------------------------------------------------------------------------------------------

GEOMETRIC = [0.6 ** j for j in range(1, 16)]  # P(accepted >= j) for a block of 16


def test_expected_committed():
    assert expected_committed([0.5, 0.25], 1) == 1.0
    assert expected_committed([0.5, 0.25], 3) == 1.75


def test_k_is_1_when_verify_is_expensive():
    # A step of k tokens costs k AR steps (a CPU at large batch): nothing beats one token per AR step.
    assert choose_verify_length(GEOMETRIC, [float(k) for k in range(1, 17)]) == 1
    # Even a free verify does not pay for a drafter pass that costs two AR steps at this acceptance (2.5 < 3).
    assert choose_verify_length(GEOMETRIC, [1.0] + [3.0] * 15) == 1


def test_k_is_the_full_block_when_verify_is_cheap():
    # Verify as cheap as an AR step and a free drafter (a GPU at batch 1): every extra draft is a free chance.
    assert choose_verify_length(GEOMETRIC, [1.0] * 16) == 16
    assert choose_verify_length([1.0] * 7, [1.0] + [1.5] * 7) == 8  # perfect acceptance: 8 / 1.5 > 1


@pytest.mark.parametrize("at_least,seconds,k", [
    # rates E[committed | k] / t_k worked out by hand in the comments
    ([0.9, 0.8, 0.3, 0.1], [1.0, 1.6, 2.0, 2.9, 3.9], 3),  # 1.0, 1.19, 1.35, 1.03, 0.79
    ([0.9, 0.1], [1.0, 1.5, 3.0], 2),  # 1.0, 1.27, 0.67
    ([0.2, 0.1], [1.0, 1.1, 1.15], 3),  # 1.0, 1.09, 1.13
    ([0.5], [1.0, 1.5], 1),  # 1.0, 1.0: a tie goes to the smaller k
], ids=["peak-at-3", "peak-at-2", "late-peak", "tie"])
def test_k_is_the_exact_argmax_in_between(at_least, seconds, k):
    assert choose_verify_length(at_least, seconds) == k


def test_random_tables_match_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        K = rng.randint(1, 15)
        q = [rng.random() for _ in range(K)]
        at_least = [float(torch.tensor(q[: j + 1]).prod()) for j in range(K)]
        seconds = sorted(rng.uniform(0.5, 5) for _ in range(K + 1))
        rates = [(1 + sum(at_least[: k - 1])) / t for k, t in enumerate(seconds, start=1)]
        assert choose_verify_length(at_least, seconds) == rates.index(max(rates)) + 1


def roofline_ms(batch: int, tokens: int, ar_ms: float = 5.0, capacity: int = 8) -> float:
    """A made-up machine: a target pass costs the same up to `capacity` tokens, then in proportion (a GPU's shape)."""
    return ar_ms * max(1.0, batch * tokens / capacity)


def hand_costs(draft_ms: float = 1.0) -> PassCosts:
    batches, tokens = (1, 2, 4, 8), (1, 2, 4, 8)
    target = tuple(tuple(roofline_ms(b, t) / 1e3 for t in tokens) for b in batches)
    tiny = tuple(tuple(1e-9 for _ in tokens) for _ in batches)
    draft = tuple(tuple(draft_ms / 1e3 for _ in tokens) for _ in batches)
    return PassCosts(batches, tokens, (64,), (target,), (draft,), tiny, tiny)


def test_auto_block_size_on_a_hand_made_cost_table():
    # Tokens free until the batch fills the machine: the whole block at batch 1, plain AR at batch 8.
    auto = AutoBlockSize(hand_costs(), block_size=8)
    assert auto.choose(batch=1, context=64) == 8
    assert auto.choose(batch=8, context=64) == 1
    # In between, the exact argmax of the table's rates.
    k = auto.choose(batch=2, context=64)
    at_least = auto.estimate.accept_at_least()
    rates = [expected_committed(at_least, j) / auto.costs.step_seconds(2, 64, j) for j in range(1, 9)]
    assert k == rates.index(max(rates)) + 1 and 1 < k < 8
    # After steps that accepted everything, long blocks pay at batch 4 too; after steps accepting nothing, k = 1.
    for _ in range(30):
        auto.observe(8, [7] * 4)
    assert auto.choose(batch=4, context=64) > 2
    for _ in range(200):  # long enough for the rejections to outweigh the (decayed) acceptances
        auto.observe(8, [0] * 4)
    assert auto.choose(batch=2, context=64) == 1


def test_a_tree_is_one_more_choice_on_a_hand_made_cost_table():
    """With a tree budget, the tree is priced as a verify of budget + 1 tokens and by its own estimate: at first the
    chain's expected tokens at that length x TREE_PRIOR_GAIN (so where long chains pay, the tree is tried), then what
    tree steps committed; while chains run, it drifts back to that prior."""
    auto = AutoBlockSize(hand_costs(), block_size=8, tree_budget=7)
    assert auto.choose_tree(batch=1, context=64) is None  # 8 tokens cost 1 here: the tree's prior beats the chain
    assert auto.choose(batch=1, context=64) == 8  # (choose alone never picks it)
    assert auto.choose_tree(batch=8, context=64) == 1  # tokens are dear at batch 8: plain steps
    for _ in range(40):  # tree steps that commit 1 token a request
        auto.observe_tree([1, 1])
    assert auto.choose_tree(batch=1, context=64) == 8
    for _ in range(300):  # chain steps accepting everything; the tree's evidence ages away
        auto.observe(8, [7, 7])
    assert auto.choose_tree(batch=1, context=64) is None
    at_least = auto.estimate.accept_at_least()
    assert auto.tree.expected(TREE_PRIOR_GAIN * expected_committed(at_least, 8)) > expected_committed(at_least, 8)
    # Tree steps that take 3x their chain-priced prediction (the host's tree, the candidates): their own ratio learns
    # it and the chain wins again, while the chains' correction is untouched.
    for _ in range(40):
        auto.observe_tree_time(batch=1, context=64, seconds=3 * auto.predicted_seconds(1, 64, 8))
    assert auto.tree.ratio == pytest.approx(3.0, rel=0.05) and auto.correction.factor(1, 8) == 1.0
    assert auto.choose_tree(batch=1, context=64) == 8
    with pytest.raises(AssertionError):  # (the runner refuses such budgets in one sentence first)
        AutoBlockSize(hand_costs(), block_size=8, tree_budget=8)


def test_requests_own_acceptance_decides_the_batchs_k():
    auto = AutoBlockSize(hand_costs(), block_size=8)
    easy, hard = auto.new_request(), auto.new_request()
    # A new request starts from the engine's estimate.
    assert easy.accept_at_least(auto.estimate.conditional_rates()) == pytest.approx(auto.estimate.accept_at_least())
    for _ in range(100):  # in one batch: every draft of `easy` accepted, none of `hard`
        auto.observe(8, [7, 0], [easy, hard])
    assert auto.choose(batch=2, context=64, requests=[easy]) == 8
    assert auto.choose(batch=2, context=64, requests=[hard]) == 1
    # Both: the argmax of the batch's expected committed tokens, the sum of the two requests'.
    engine = auto.estimate.conditional_rates()
    at_least = [(a + b) / 2 for a, b in zip(easy.accept_at_least(engine), hard.accept_at_least(engine))]
    rates = [expected_committed(at_least, k) / auto.costs.step_seconds(2, 64, k) for k in range(1, 9)]
    assert auto.choose(batch=2, context=64, requests=[easy, hard]) == rates.index(max(rates)) + 1


def test_steps_slower_than_predicted_correct_the_costs():
    # Batch 1 on the hand table: the model favours the whole block; real speculative steps that take 3x what
    # the model says beside AR steps that take what it says (the calibration never sees the scheduler's work) must
    # bring the choice down to k = 1, and AR steps as slow must bring it back up.
    auto = AutoBlockSize(hand_costs(), block_size=8)
    assert auto.choose(batch=1, context=64) == 8
    for _ in range(40):
        auto.observe_time(1, 64, 1, auto.predicted_seconds(1, 64, 1))
        auto.observe_time(1, 64, 8, 3 * auto.predicted_seconds(1, 64, 8))
    assert auto.correction.factor(1, 8) == pytest.approx(3.0, rel=0.05) and auto.correction.factor(1, 1) == 1.0
    assert auto.choose(batch=1, context=64) == 1
    for _ in range(40):
        auto.observe_time(1, 64, 1, 3 * auto.predicted_seconds(1, 64, 1))
        auto.observe_time(1, 64, 8, 3 * auto.predicted_seconds(1, 64, 8))
    assert auto.choose(batch=1, context=64) == 8


def test_the_machines_drift_does_not_change_the_choice():
    """Every step 2x slower than predicted, speculative steps alone for a long spell (no AR step to compare with):
    read as the machine slowing down, which moves every k's cost alike, so the choice stays the model's."""
    auto = AutoBlockSize(hand_costs(), block_size=8)
    for _ in range(100):
        auto.observe_time(1, 64, 8, 2 * auto.predicted_seconds(1, 64, 8))
    assert auto.correction.factor(1, 8) == pytest.approx(2.0, rel=0.05)
    assert auto.correction.factor(1, 1) == pytest.approx(auto.correction.factor(1, 8))
    assert auto.choose(batch=1, context=64) == 8


def test_cost_correction_is_per_batch_size_bucket():
    """Speculative steps at batch 2 that take 3x their prediction beside AR steps as predicted: batch 2 and 3 (one
    bucket) price speculation at 3x, batch 1 and 4 keep the model's own costs."""
    c = CostCorrection(weight=1.0)
    c.observe(2, 1, predicted_seconds=0.010, observed_seconds=0.010)
    c.observe(2, 4, predicted_seconds=0.010, observed_seconds=0.030)
    assert c.factor(2, 4) == c.factor(3, 16) == pytest.approx(3.0)
    assert c.factor(1, 4) == c.factor(4, 4) == 1.0


def test_held_back_features_are_priced_into_a_speculative_step():
    """After plain AR steps, a speculative step first hands the drafter their features (one append_context of all
    the held-back positions); the choice pays for it, and the time correction does not count it twice."""
    batches, tokens = (1, 2, 4, 8), (1, 2, 4, 8)
    target = tuple(tuple(roofline_ms(b, t) / 1e3 for t in tokens) for b in batches)
    draft = tuple(tuple(1e-3 for _ in tokens) for _ in batches)
    context = tuple(tuple(0.5e-3 * t for t in tokens) for _ in batches)  # 0.5 ms per position, any batch
    tiny = tuple(tuple(1e-9 for _ in tokens) for _ in batches)
    costs = PassCosts(batches, tokens, (64,), (target,), (draft,), context, tiny)
    assert costs.context_seconds(1, 8) == pytest.approx(4e-3)
    assert costs.context_seconds(1, 100) == pytest.approx(50e-3)  # continued linearly past the grid
    assert costs.context_seconds(1, 0) == 0.0
    auto = AutoBlockSize(costs, block_size=8)
    assert auto.choose(batch=1, context=64) > 1
    assert auto.choose(batch=1, context=64, pending=100) == 1  # a 50 ms hand-over outweighs one step's gain
    k = auto.choose(batch=1, context=64, pending=4)  # 2 ms: still the exact argmax, flush included
    at_least = auto.estimate.accept_at_least()
    rates = [expected_committed(at_least, j) / (costs.step_seconds(1, 64, j) + (2e-3 if j > 1 else 0))
             for j in range(1, 9)]
    assert k == rates.index(max(rates)) + 1
    # Paid once for the requests' remaining tokens, a step bears its own tokens' share: 50 ms spread over 10,000
    # tokens to go no longer stops speculation; over 40, a step committing E tokens bears E / 40 of it.
    assert auto.choose(batch=1, context=64, pending=100, remaining=10_000) == auto.choose(batch=1, context=64)
    k = auto.choose(batch=1, context=64, pending=100, remaining=40)
    rates = [expected_committed(at_least, j) / (costs.step_seconds(1, 64, j)
                                                 + (50e-3 * expected_committed(at_least, j) / 40 if j > 1 else 0))
             for j in range(1, 9)]
    assert k == rates.index(max(rates)) + 1
    # A speculative step that took exactly its predicted time plus the hand-over leaves the correction at 1.
    auto.observe_time(1, 64, 8, costs.step_seconds(1, 64, 8) + costs.context_seconds(1, 100), pending=100)
    assert auto.correction.factor(1, 8) == pytest.approx(1.0)


def test_cost_correction_is_a_running_mean_of_observed_over_predicted():
    c = CostCorrection(weight=0.5, fresh_steps=2)
    c.observe(1, 1, predicted_seconds=0.010, observed_seconds=0.020)  # AR: the level, 1 + 0.5 x (2 - 1)
    assert c.factor(1, 1) == c.factor(1, 4) == 1.5
    c.observe(1, 4, predicted_seconds=0.010, observed_seconds=0.030)  # 1 step after an AR step: the ratio (3 / 1.5)
    assert c.factor(1, 1) == 1.5 and c.factor(1, 4) == pytest.approx(1.5 * 1.5)  # ratio 1 + 0.5 x (2 - 1)
    c.observe(1, 4, predicted_seconds=0.010, observed_seconds=0.030)  # 2 steps after: still the ratio
    assert c.factor(1, 4) == pytest.approx(1.5 * 1.75)
    c.observe(1, 4, predicted_seconds=0.010, observed_seconds=0.0)  # nothing to compare with: ignored
    c.observe(1, 4, predicted_seconds=0.010, observed_seconds=0.0525)  # 3 steps after: the level (0.0525 / 1.75 = 3)
    assert c.factor(1, 1) == pytest.approx(2.25) and c.factor(1, 4) == pytest.approx(2.25 * 1.75)


def test_pass_costs_interpolate_between_grid_points():
    costs = hand_costs(draft_ms=1.0)
    # batch 3, 3 tokens: halfway between the grid's batches 2 and 4 and tokens 2 and 4.
    corners = [roofline_ms(b, t) for b in (2, 4) for t in (2, 4)]
    assert costs.step_seconds(3, 64, 3) == pytest.approx((sum(corners) / 4 + 1.0) / 1e3, rel=1e-6)
    assert costs.step_seconds(1, 64, 1) == pytest.approx(5.0 / 1e3, rel=1e-6)  # k = 1: no drafter pass
    assert costs.step_seconds(1, 4096, 1) == costs.step_seconds(1, 64, 1)  # one context measured: no slope


def test_acceptance_estimate_learns_and_forgets():
    est = AcceptanceEstimate(num_positions=3, prior_rate=0.5, prior_weight=2.0, decay=0.5)
    assert est.conditional_rates() == [0.5, 0.5, 0.5]
    est.observe(4, [3, 3, 0, 1])  # d1 verified 4x, accepted 3x; d2 verified 3x, accepted 2x; d3: 2x, 2x
    rates = est.conditional_rates()  # (accepted + 2 x 0.5) / (verified + 2)
    assert rates == pytest.approx([(3 + 1) / (4 + 2), (2 + 1) / (3 + 2), (2 + 1) / (2 + 2)])
    assert est.accept_at_least() == pytest.approx([rates[0], rates[0] * rates[1], rates[0] * rates[1] * rates[2]])
    est.observe(2, [0])  # k = 2: only d1 was verified
    assert est.verified[2] == pytest.approx(0.5 * 2)
    for _ in range(40):  # AR steps (k = 1) verify nothing: the evidence fades back to the prior
        est.observe(1, [0, 0])
    assert est.conditional_rates() == pytest.approx([0.5, 0.5, 0.5], abs=1e-6)


# ------------------------------------------------------------------------------------------------
# Lossless for every verify length
# ------------------------------------------------------------------------------------------------

class RandomVerifyLength(AutoBlockSize):
    """A k in 1 .. block_size drawn at random each step: any sequence of choices must keep the tokens."""

    def __init__(self, block_size: int, seed: int = 0):
        super().__init__(costs=None, block_size=block_size)
        self.rng, self.chosen = random.Random(seed), []

    def choose(self, batch: int, context: float, requests=(), pending: float = 0.0, remaining=None) -> int:
        self.chosen.append(self.rng.randint(1, self.block_size))
        return self.chosen[-1]

    def observe_time(self, batch: int, context: float, k: int, seconds: float, pending: float = 0.0) -> None:
        pass  # no cost model: the choice is random


def mixed_requests(vocab: int, n: int = 6) -> list[Request]:
    """n requests (more than the 4 slots: some join mid-run), greedy and sampled."""
    g = torch.Generator().manual_seed(1)
    return [Request(id=i, prompt_token_ids=torch.randint(4, vocab, (3 + 5 * i,), generator=g).tolist(),
                    max_new_tokens=[40, 9, 33, 25, 17, 30][i % 6], temperature=0.0 if i % 2 == 0 else 0.9,
                    seed=77 + i) for i in range(n)]


def decode(executor, mode, reqs, auto=None) -> dict:
    return {r.request.id: r for r in Decoder.for_mode(executor, mode, (), auto).generate(reqs)}


def test_any_verify_lengths_keep_dflash_equal_to_ar(biased_engines):
    ex = biased_engines[8].executor
    reqs = mixed_requests(ex.vocab_size)
    ar = decode(ex, "ar", reqs)
    policy = RandomVerifyLength(ex.block_size)
    auto = decode(ex, "dflash", reqs, policy)
    for req in reqs:
        assert auto[req.id].output_token_ids == ar[req.id].output_token_ids, req.id
        verified = [k for k in auto[req.id].verify_lengths if k > 1]  # the others were plain AR steps
        assert len(auto[req.id].acceptance_lengths) == len(verified)
        assert all(1 <= n <= k for n, k in zip(auto[req.id].acceptance_lengths, verified))
    assert set(policy.chosen) == set(range(1, 9))
    steps = [n for r in auto.values() for n in r.acceptance_lengths]
    assert max(steps) > 2  # drafts were accepted after AR steps: the drafter's context was kept up to date


class RandomVerifyOrTree(RandomVerifyLength):
    """A tree of `tree_budget` nodes or a random k each step (AutoBlock runs the tree as TreeDrafting's step)."""

    def __init__(self, block_size: int, tree_budget: int, seed: int = 0):
        super().__init__(block_size, seed)
        self.tree_budget = tree_budget

    def choose_tree(self, batch: int, context: float, requests=(), pending: float = 0.0, remaining=None):
        tree = self.rng.random() < 0.4
        self.chosen.append(None if tree else self.rng.randint(1, self.block_size))
        return self.chosen[-1]

    def observe_tree(self, committed, chains=(), requests=()) -> None:
        assert all(n >= 1 for n in committed) and len(chains) == len(committed)
        assert all(0 <= n < verify_length <= self.block_size for verify_length, n in chains)

    def observe_tree_time(self, batch: int, context: float, seconds: float, pending: float = 0.0) -> None:
        pass  # no cost model: the choice is random


def test_auto_with_trees_keeps_dflash_equal_to_ar(biased_engines, monkeypatch):
    """--block-size auto --tree-budget 7: tree steps among chain and plain steps, in any order (deferred prompt
    features handed over first), commit ar's tokens, greedy and sampled, requests joining mid-run; every tree the
    policy chose ran as one tree pass."""
    ex = biased_engines[8].executor
    reqs = mixed_requests(ex.vocab_size)
    ar = decode(ex, "ar", reqs)
    policy = RandomVerifyOrTree(ex.block_size, tree_budget=7)
    passes, verify_tree = [], ex.verify_tree
    monkeypatch.setattr(ex, "verify_tree", lambda *args, **kw: passes.append(args[0].shape) or verify_tree(*args, **kw))
    auto = decode(ex, "dflash", reqs, policy)
    assert {i: r.output_token_ids for i, r in auto.items()} == {i: r.output_token_ids for i, r in ar.items()}
    assert None in policy.chosen and 1 in policy.chosen and 8 in policy.chosen
    assert len(passes) == policy.chosen.count(None) and all(shape[1] == 8 for shape in passes)  # the anchor + 7
    assert max(n for r in auto.values() for n in r.acceptance_lengths) > 2


class FullBlock(RandomVerifyLength):
    """Always the whole block: the prompt's features wait in `pending_context` until the first draft."""

    def choose(self, batch: int, context: float, requests=(), pending: float = 0.0, remaining=None) -> int:
        return self.block_size


def drafter_context(ex, requests, auto, steps: int) -> list[torch.Tensor]:
    """The drafter's cached keys of every layer, positions 0 .. start - 1 of each request's slot, after `steps`."""
    decoder = Decoder.for_mode(ex, "dflash", (), auto)
    for r in requests:
        decoder.submit(r)
    for _ in range(steps):
        decoder.step()
    active = {a.slot: a.start for a in decoder._active}
    return [k[slot, :start].clone() for k in ex.draft_cache.k for slot, start in sorted(active.items())]


def test_deferred_prompt_context_reaches_the_drafter_at_its_positions(biased_engines):
    # With --block-size auto the drafter gets the prompt's features just before the first draft (one call per
    # distinct pending length: prompts of 3 .. 23 tokens, AR rows), not at admission: after the same steps its
    # cache holds what plain dflash's holds, at the same positions.
    ex = biased_engines[8].executor
    reqs = [replace(r, max_new_tokens=60) for r in mixed_requests(ex.vocab_size, n=4)]
    plain = drafter_context(ex, reqs, None, steps=3)
    deferred = drafter_context(ex, reqs, FullBlock(ex.block_size), steps=3)
    assert len(deferred) == len(plain) == 4 * len(ex.draft_cache.k)
    for a, b in zip(deferred, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and the tokens and acceptance of whole runs agree
    greedy = [r for r in mixed_requests(ex.vocab_size) if r.temperature == 0.0]
    runs = decode(ex, "dflash", greedy), decode(ex, "dflash", greedy, FullBlock(ex.block_size))
    for req in greedy:
        assert runs[0][req.id].output_token_ids == runs[1][req.id].output_token_ids
        assert runs[0][req.id].acceptance_lengths == runs[1][req.id].acceptance_lengths, req.id


@pytest.fixture(scope="module")
def engine_dir(biased_pairs, tmp_path_factory):
    from tests.conftest import build

    return build(biased_pairs[8], tmp_path_factory.mktemp("auto") / "engine", max_batch_size=4)


@pytest.mark.slow
def test_measured_auto_equals_ar_and_caches_its_profile(biased_engines, engine_dir, tmp_path, monkeypatch):
    """The real path: Engine.load measures the pass costs once, caches them, and decodes losslessly."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    lines = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two busy cores measure 5x slower (the profile's key has the threads)
    try:
        engine = Engine.load(engine_dir, block_size="auto", report=lines.append)
    finally:
        torch.set_num_threads(threads)
    assert engine.auto_block is not None and any("measuring" in line for line in lines)
    reqs = mixed_requests(engine.executor.vocab_size)
    ar = decode(biased_engines[8].executor, "ar", reqs)
    auto = {r.request.id: r for r in engine.decoder("dflash").generate(reqs)}
    assert all(auto[r.id].output_token_ids == ar[r.id].output_token_ids for r in reqs)
    assert all(1 <= k <= 8 for r in auto.values() for k in r.verify_lengths)

    def no_measuring(executor, contexts=None):
        raise AssertionError("a cached profile with the same key must be reused")

    monkeypatch.setattr(costs_module, "measure", no_measuring)
    torch.set_num_threads(1)
    try:
        again = Engine.load(engine_dir, block_size="auto")
    finally:
        torch.set_num_threads(threads)
    assert again.auto_block.costs == engine.auto_block.costs


# ------------------------------------------------------------------------------------------------
# The profile cache
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def cached_profile(biased_engines, engine_dir, tmp_path, monkeypatch):
    """An engine directory, its executor and a profile cache in tmp_path, with `measure` counted (hand-made costs)."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_measure(executor, contexts=None):
        calls.append(executor)
        return hand_costs()

    monkeypatch.setattr(costs_module, "measure", fake_measure)
    executor = biased_engines[8].executor
    load_or_measure(engine_dir, executor, "torch")
    assert len(calls) == 1
    return engine_dir, executor, profile_path(profile_key(engine_dir, executor, "torch")), calls


def test_pass_costs_are_timed_to_the_end_of_the_devices_work():
    """A CUDA pass returns once its kernels are queued: the timing rounds wait for the device before and after each
    call (costs.device_sync), so a pass costs its work, not its launch. Here a call queues 20 ms of "device" work that
    the sync waits for."""
    import time

    queued = []

    def launch():
        queued.append(0.02)

    def sync():
        while queued:
            time.sleep(queued.pop())

    rounds = costs_module._Rounds(sync)
    rounds.add(launch)
    assert rounds.run()[0] >= 0.02
    assert costs_module.device_sync(torch.device("cpu"))() is None


@pytest.mark.parametrize("field,value", [("device", "another CPU"), ("threads", 977), ("manifest_sha256", "0" * 64),
                                         ("version", 0)], ids=["foreign-machine", "other-threads", "other-engine",
                                                               "older-format"])
def test_foreign_or_stale_profile_is_measured_again(cached_profile, field, value):
    engine_dir, executor, path, calls = cached_profile
    load_or_measure(engine_dir, executor, "torch")
    assert len(calls) == 1  # same key: reused
    data = json.loads(path.read_text())
    data["key"][field] = value
    path.write_text(json.dumps(data))
    lines = []
    load_or_measure(engine_dir, executor, "torch", report=lines.append)
    assert len(calls) == 2 and field in lines[0]
    assert read_profile(path)[0] == profile_key(engine_dir, executor, "torch")  # replaced by the new measurement


def test_profile_of_an_older_format_with_other_tables_is_measured_again(cached_profile):
    # Version 1 stored one drafter pass per batch size (no verify-length axis): not an error, just stale.
    engine_dir, executor, path, calls = cached_profile
    data = json.loads(path.read_text())
    data["key"]["version"] = 1
    data["costs"]["draft_s"] = [[0.001 for _ in data["costs"]["batches"]]]
    path.write_text(json.dumps(data))
    lines = []
    load_or_measure(engine_dir, executor, "torch", report=lines.append)
    assert len(calls) == 2 and "version" in lines[0]


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2],  # cut short
    lambda text: "not json at all",
    lambda text: json.dumps({"key": json.loads(text)["key"]}),  # no costs
    lambda text: text.replace("[", "[-1.0, ", 1),  # a grid that is not increasing positive integers
], ids=["truncated", "garbage", "no-costs", "bad-grid"])
def test_corrupt_profile_is_refused_in_one_sentence(cached_profile, damage):
    engine_dir, executor, path, calls = cached_profile
    path.write_text(damage(path.read_text()))
    with pytest.raises(UserError, match="not a readable cost profile") as err:
        load_or_measure(engine_dir, executor, "torch")
    assert str(err.value).count("\n") == 0 and len(calls) == 1


def test_cli_refuses_a_corrupt_profile_with_exit_2(cached_profile, tmp_path, capsys):
    engine_dir, _, path, _ = cached_profile
    path.write_text("{")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6, 7]}\n')
    code = main(["run", str(engine_dir), "--input", str(prompts), "--output", str(tmp_path / "out.jsonl"),
                 "--block-size", "auto"])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR
    assert err.startswith(f"error: {path}: not a readable cost profile") and err.count("\n") == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_block_size_words_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "engine", "--stream", "x", "--block-size", "sometimes"])
    assert exc.value.code == 2 and "must be an integer or auto" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# The acceptance record: the last run's rates are the next run's prior
# ------------------------------------------------------------------------------------------------

def test_the_last_runs_acceptance_is_the_next_runs_prior(cached_profile, tmp_path, capsys):
    engine_dir = cached_profile[0]
    first = Engine.load(engine_dir, block_size="auto")
    flat = [PRIOR_RATE] * 7
    assert first.auto_block.estimate.prior == flat
    reqs = mixed_requests(first.executor.vocab_size)
    results = list(first.decoder("dflash").generate(reqs))
    assert any(k > 1 for r in results for k in r.verify_lengths)  # drafts were verified: there is something to record
    rates = first.auto_block.estimate.conditional_rates()
    path = acceptance_path(engine_dir)
    assert json.loads(path.read_text())["rates"] == rates != flat
    assert Engine.load(engine_dir, block_size="auto").auto_block.estimate.prior == rates
    # A record of another engine (or another block size) is not this engine's: the default prior.
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"manifest_sha256": "0" * 64}))
    assert Engine.load(engine_dir, block_size="auto").auto_block.estimate.prior == flat
    path.write_text(json.dumps(data | {"rates": rates[:3]}))
    assert Engine.load(engine_dir, block_size="auto").auto_block.estimate.prior == flat
    # One that is not a record at all: one sentence naming it, exit 2, nothing written.
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 0, "prompt_token_ids": [5, 6, 7]}) + "\n")
    for bad in ("{not json", json.dumps(data | {"rates": [1.5] * 7})):
        path.write_text(bad)
        capsys.readouterr()
        assert main(["run", str(engine_dir), "--input", str(prompts), "--output", str(tmp_path / "out.jsonl"),
                     "--block-size", "auto"]) == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert f"{path}: not a readable acceptance record" in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out.jsonl").exists()


def test_an_unwritable_cache_costs_the_next_run_its_prior_not_this_run(engine_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(blocker / "cache"))
    write_acceptance(engine_dir, [0.5] * 7)  # no error: the run's results matter more than the next run's prior
    assert read_acceptance(engine_dir, 7) is None
