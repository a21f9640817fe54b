"""Choosing the verify length k of a DFlash step from pass costs and acceptance estimates (`--block-size auto`).

Vocabulary (speculative/core.py): a step with verify length k runs the target over [anchor, d_1 .. d_{k-1}]
(k tokens per request) and commits accepted + 1 tokens, 1 <= accepted + 1 <= k. k = 1 is a plain
autoregressive step: no drafter pass, nothing to accept. The drafter always drafts the whole block in
one pass and a step verifies its first k - 1 drafts, so the drafts, and whether d_j is accepted, do not
depend on k: acceptance observed at any k tells about every k.

    E[committed | k] = 1 + sum_{j=1}^{k-1} P(accepted >= j)
    k* = argmax_k  E[committed | k] / t_step(batch, context, k)

The batch size multiplies both the committed tokens and nothing else, so maximising tokens per second
of the batch is maximising this ratio with the batch's step costs. Nothing here changes a token: every
k commits exactly what the target alone would (the acceptance rule is the same for every k).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

# Conditional acceptance P(d_j accepted | d_1..d_{j-1} accepted) assumed before any step is seen, and how many
# observations it weighs: weak, so that a handful of steps overrules it.
PRIOR_RATE = 0.6
PRIOR_WEIGHT = 4.0
# Per step, older evidence is multiplied by this: the estimate follows the recent steps (a window of about
# 1 / (1 - DECAY) steps) and, while no step verifies a position, drifts back to the prior, which makes the
# chooser try longer blocks again after a spell of k = 1.
DECAY = 0.98
# The chooser prices a step at the batch's longest context rounded up to a multiple of this: the rounding moves
# every k's cost alike (on the demo at batch 32, by up to 6%), so the ratios the choice rests on barely move.
CONTEXT_STEP = 16
# Weight of one step's observed / predicted time in the running cost correction (a window of ~10 steps).
TIME_WEIGHT = 0.1
# A speculative step measures the ratio of its cost to an AR step's only this many steps after an AR step of its batch
# size (CostCorrection): apart by more, the machine's drift between the two would count as the ratio.
FRESH_STEPS = 16
# The engine's acceptance rates are recorded (the next run's prior) every this many steps, and at the end of a run.
SAVE_EVERY = 256


def expected_committed(accept_at_least: Sequence[float], k: int) -> float:
    """E[committed tokens | verify length k] = 1 + sum_{j < k} P(accepted >= j).

    accept_at_least[j - 1] = P(accepted >= j), j = 1 .. K. Example: [0.5, 0.25], k = 3 -> 1.75.
    """
    assert 1 <= k <= len(accept_at_least) + 1, (k, len(accept_at_least))
    return 1.0 + sum(accept_at_least[: k - 1])


def choose_verify_length(accept_at_least: Sequence[float], step_seconds: Sequence[float]) -> int:
    """The k in 1 .. len(step_seconds) with the most expected committed tokens per second (ties: the smaller k).

    step_seconds[k - 1]: what one step verifying k tokens per request costs the batch (k = 1: an AR step;
    k > 1: the drafter pass, the verify pass and the rest of the step). Example: P(accepted >= j) = [0.9, 0.1],
    costs [1.0, 1.5, 3.0] -> rates 1.0, 1.27, 0.67 -> k = 2.
    """
    assert len(step_seconds) <= len(accept_at_least) + 1 and all(t > 0 for t in step_seconds), step_seconds
    best_k, best_rate = 1, 0.0
    for k, seconds in enumerate(step_seconds, start=1):
        rate = expected_committed(accept_at_least, k) / seconds
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


class StepCostModel(Protocol):
    """Anything that prices a step: runtime/costs.py's PassCosts, or a hand-made table in tests."""

    def step_seconds(self, batch: int, context: float, k: int) -> float:
        """Seconds of one decoding step of `batch` requests at mean context `context`, verifying k tokens each."""
        ...

    def context_seconds(self, batch: int, positions: float) -> float:
        """Seconds to hand the drafter `positions` held-back positions of features for each of `batch` requests."""
        ...


class AcceptanceEstimate:
    """P(d_j accepted | d_1..d_{j-1} accepted) per block position j = 1 .. K, from recent steps, with a prior.

    Counts are exponentially decayed per step (DECAY) and smoothed by PRIOR_WEIGHT observations at the prior
    rates: for the engine's estimate, the rates its last run recorded (runtime/costs.py) or else PRIOR_RATE; for a
    request's estimate, the engine's own rates (a request starts from what the engine has seen lately and moves
    towards what its own steps show).
    """

    def __init__(self, num_positions: int, prior_rate: float = PRIOR_RATE, prior_weight: float = PRIOR_WEIGHT,
                 decay: float = DECAY, prior: Sequence[float] | None = None):
        """`prior`: rates per position to start from (e.g. the last run's, runtime/costs.py); default prior_rate."""
        self.prior_weight, self.decay = prior_weight, decay
        self.prior = list(prior) if prior is not None else [prior_rate] * num_positions
        assert len(self.prior) == num_positions and all(0.0 <= q <= 1.0 for q in self.prior), self.prior
        self.verified = [0.0] * num_positions  # decayed count of steps that verified d_j with d_1..d_{j-1} accepted
        self.accepted = [0.0] * num_positions  # ... and accepted d_j

    def observe(self, verify_length: int, accepted: Sequence[int]) -> None:
        """One step: every request verified verify_length - 1 drafts and accepted accepted[r] of them."""
        self.observe_rows([(verify_length, n) for n in accepted])

    def observe_rows(self, rows: Sequence[tuple[int, int]]) -> None:
        """One step whose requests verified different numbers of drafts: (verify length, accepted) per request."""
        self.verified = [v * self.decay for v in self.verified]
        self.accepted = [a * self.decay for a in self.accepted]
        for verify_length, n in rows:
            assert 0 <= n < verify_length, (n, verify_length)
            for j in range(1, min(n + 1, verify_length - 1) + 1):  # d_j was verified iff d_1..d_{j-1} were accepted
                self.verified[j - 1] += 1
                self.accepted[j - 1] += n >= j

    @property
    def evidence(self) -> float:
        """The decayed number of steps behind the estimate of position 1 (0: the prior alone)."""
        return self.verified[0] if self.verified else 0.0

    def conditional_rates(self, prior: Sequence[float] | None = None) -> list[float]:
        """The rates per position, smoothed towards `prior` (per position; default: this estimate's own prior)."""
        prior = prior if prior is not None else self.prior
        return [(a + self.prior_weight * q) / (v + self.prior_weight)
                for a, v, q in zip(self.accepted, self.verified, prior)]

    def accept_at_least(self, prior: Sequence[float] | None = None) -> list[float]:
        """P(accepted >= j) for j = 1 .. K: the running product of the conditional rates."""
        out, p = [], 1.0
        for q in self.conditional_rates(prior):
            p *= q
            out.append(p)
        return out


# A draft tree of `budget` nodes (`--tree-budget` with `--block-size auto`) is priced by its own estimate of committed
# tokens per request and step, which starts at the chain's of as many tokens times this (DDTree's trees of the chain's
# size committed 1.25x the chain's tokens on the demo pair: docs/run.md) and weighs that like PRIOR_WEIGHT steps.
TREE_PRIOR_GAIN = 1.25


class TreeEstimate:
    """Committed tokens per request in a tree step (`--block-size auto` with `--tree-budget`): decayed counts with a
    prior, as AcceptanceEstimate's. Every step ages it (DECAY), a tree step also adds what it committed, so while the
    chains win it drifts back to its prior and the chooser tries a tree again. Example: prior 4.0 (weight 4), two
    tree steps committing 2 and 3 per request -> (2 + 3 + 4 x 4.0 x decay^k...) / (2 + 4) ~ 3.5.

    `ratio`: a tree step's observed seconds over what its chain-priced prediction (with the chains' correction) says,
    lately (TIME_WEIGHT): what the tree step costs beyond a chain of as many tokens (its candidates, the tree built on
    the host, the accepted nodes moved), which the pass costs never measured."""

    def __init__(self, prior_weight: float = PRIOR_WEIGHT, decay: float = DECAY, weight: float = TIME_WEIGHT):
        self.prior_weight, self.decay, self.weight = prior_weight, decay, weight
        self.committed = self.steps = 0.0
        self.ratio = 1.0

    def observe_time(self, predicted_seconds: float, observed_seconds: float) -> None:
        if predicted_seconds > 0 and observed_seconds > 0:
            self.ratio += self.weight * (observed_seconds / predicted_seconds - self.ratio)

    def age(self) -> None:
        self.committed *= self.decay
        self.steps *= self.decay

    def observe(self, committed: Sequence[int]) -> None:
        """One tree step: the tokens each request committed (its accepted path and the bonus)."""
        self.committed += sum(committed) / len(committed)
        self.steps += 1

    def expected(self, prior: float) -> float:
        return (self.committed + self.prior_weight * prior) / (self.steps + self.prior_weight)


@dataclass
class _Correction:
    """One batch-size bucket's correction (CostCorrection)."""

    level: float = 1.0  # an AR step's observed / predicted seconds, lately
    ratio: float = 1.0  # a speculative step's observed / predicted over an AR step's, measured side by side
    last_ar: float = -math.inf  # the step count at the bucket's last AR step


class CostCorrection:
    """How much longer real steps take than the cost model predicts (observed / predicted seconds), per bucket of
    batch sizes (1, 2-3, 4-7, ...): a level, for plain AR steps (k = 1), and a ratio of speculative steps (k > 1)
    to AR steps.

    Why correct at all: the model is calibrated on each pass alone, repeated, with its weights hot in the caches; a
    real speculative step alternates drafter and target passes (each evicting the other's weights) and adds the
    scheduler's own work around them, which the calibration never sees, and that work is a larger share of a small
    batch's step than of a large one's (hence the buckets).

    Why a level and a ratio: a shared machine's speed drifts by a third over seconds (runtime/costs.py), every
    k's alike. A factor common to every k cannot change a choice; only the ratio can, and a ratio of two classes
    measured minutes apart would be mostly drift. So a speculative step within FRESH_STEPS steps of an AR step of
    its bucket moves the ratio (it and the level describe the same moment); a later one, with no recent AR step to
    compare with, moves only the level (read as the machine's drift at the ratio last measured). Example: AR steps
    as predicted, then speculative steps at 1.3x their prediction: the ratio moves from 1 towards 1.3 by
    TIME_WEIGHT a step, and the speculative steps' cost in the choice with it.
    """

    def __init__(self, weight: float = TIME_WEIGHT, fresh_steps: int = FRESH_STEPS):
        self.weight, self.fresh_steps = weight, fresh_steps
        self._buckets: dict[int, _Correction] = {}
        self._steps = 0

    def bucket(self, batch: int) -> _Correction:
        return self._buckets.setdefault(batch.bit_length(), _Correction())

    def factor(self, batch: int, k: int) -> float:
        b = self.bucket(batch)
        return b.level * (b.ratio if k > 1 else 1.0)

    def observe(self, batch: int, k: int, predicted_seconds: float, observed_seconds: float) -> None:
        if not (predicted_seconds > 0 and observed_seconds > 0):
            return
        self._steps += 1
        b, r, w = self.bucket(batch), observed_seconds / predicted_seconds, self.weight
        if k == 1:
            b.level += w * (r - b.level)
            b.last_ar = self._steps
        elif self._steps - b.last_ar <= self.fresh_steps:
            b.ratio += w * (r / b.level - b.ratio)
        else:
            b.level += w * (r / b.ratio - b.level)


class AutoBlockSize:
    """The `--block-size auto` policy of one engine: pass costs (measured at load, corrected by the steps' own
    times) and the acceptance estimate (learnt)."""

    def __init__(self, costs: StepCostModel, block_size: int, estimate: AcceptanceEstimate | None = None,
                 correction: CostCorrection | None = None, record: Callable[[list[float]], None] | None = None,
                 tree_budget: int = 0):
        """`record`: called with the engine's conditional rates every SAVE_EVERY steps and by `save` (runtime/costs.py
        keeps them as the next run's prior). `tree_budget` (at most block_size - 1): a draft tree of that many nodes is
        one more choice (`choose_tree`), priced as a verify of budget + 1 tokens and by its own TreeEstimate."""
        assert 0 <= tree_budget < block_size, (tree_budget, block_size)
        self.costs, self.block_size, self.tree_budget = costs, block_size, tree_budget
        self.estimate = estimate or AcceptanceEstimate(block_size - 1)
        self.correction = correction or CostCorrection()
        self.tree = TreeEstimate(decay=self.estimate.decay)
        self.record, self._steps = record, 0
        # Predicted seconds for k = 1 .. block_size by (batch, context rounded up to CONTEXT_STEP): interpolating
        # the cost tables for every k costs ~1 ms of Python, a tenth of a small model's AR step.
        self._seconds: dict[tuple[int, int], list[float]] = {}

    def predicted_seconds(self, batch: int, context: float, k: int) -> float:
        """The cost model's uncorrected seconds for one step (what `observe_time` compares a real step with)."""
        return self.costs.step_seconds(batch, context, k)

    def new_request(self) -> AcceptanceEstimate:
        """A request's own estimate (its prior: the engine's rates at each choice)."""
        return AcceptanceEstimate(self.block_size - 1, decay=self.estimate.decay)

    def choose(self, batch: int, context: float, requests: Sequence[AcceptanceEstimate] = (),
               pending: float = 0.0, remaining: float | None = None) -> int:
        """The verify length k in 1 .. block_size for a step of `batch` requests (how: `_best`)."""
        return self._best(batch, context, requests, pending, remaining)[0]

    def choose_tree(self, batch: int, context: float, requests: Sequence[AcceptanceEstimate] = (),
                    pending: float = 0.0, remaining: float | None = None) -> int | None:
        """`choose`, with the tree as one more choice: None when the tree of `tree_budget` nodes is expected to commit
        more tokens per second than the best chain, else the chain's verify length. The tree's verify pass is priced
        as a chain's of budget + 1 tokens (the same target pass, another mask; the drafter pass reads out the whole
        block and its candidates: the cost correction measures what that adds)."""
        k, tree = self._best(batch, context, requests, pending, remaining)
        return None if tree else k

    def _best(self, batch: int, context: float, requests: Sequence[AcceptanceEstimate], pending: float,
              remaining: float | None) -> tuple[int, bool]:
        """(the best chain's verify length, whether the tree beats it). The verify length for a step of `batch` requests; with the requests' own estimates, the batch's expected
        committed tokens are the sum of theirs (E[committed | k] is linear in P(accepted >= j), so the mean of
        their P(accepted >= j) stands for the batch).

        `pending`: positions of features per request that plain AR steps held back from the drafter; a speculative
        step hands them over first. That is paid once and serves every later step of the requests: with
        `remaining`, the tokens the requests may still commit (the mean of their budgets left, this step's included),
        a speculative step is charged the share of its own tokens, hand-over x E[committed | k] / remaining; without
        it, the whole hand-over. Example: a 4 ms hand-over and 40 tokens to go charge a step committing 2.5 tokens
        0.25 ms. A budget is an upper bound (a request may stop earlier), so the charge is a lower one."""
        key = (batch, -(-int(context) // CONTEXT_STEP) * CONTEXT_STEP)
        if key not in self._seconds:
            self._seconds[key] = [self.predicted_seconds(batch, key[1], k) for k in range(1, self.block_size + 1)]
        if requests:
            engine = self.estimate.conditional_rates()
            per_request = [r.accept_at_least(engine) for r in requests]
            at_least = [sum(col) / len(per_request) for col in zip(*per_request)]
        else:
            at_least = self.estimate.accept_at_least()
        hand_over = self._hand_over_seconds(batch, pending)
        seconds = [self._seconds[key][0] * self.correction.factor(batch, 1)]
        for k, t in enumerate(self._seconds[key][1:], start=2):
            tokens = expected_committed(at_least, k)
            share = tokens / max(remaining, tokens) if remaining is not None else 1.0
            seconds.append((t + hand_over * share) * self.correction.factor(batch, k))
        k = choose_verify_length(at_least, seconds)
        if not self.tree_budget:
            return k, False
        # the tree against the best chain, by expected committed tokens per second
        nodes = self.tree_budget + 1
        tokens = self.tree.expected(TREE_PRIOR_GAIN * expected_committed(at_least, nodes))
        share = tokens / max(remaining, tokens) if remaining is not None else 1.0
        tree_seconds = ((self._seconds[key][nodes - 1] + hand_over * share) * self.correction.factor(batch, nodes)
                        * self.tree.ratio)
        return k, tokens / tree_seconds > expected_committed(at_least, k) / seconds[k - 1]

    def observe_tree(self, committed: Sequence[int], chains: Sequence[tuple[int, int]] = (),
                     requests: Sequence[AcceptanceEstimate] = ()) -> None:
        """A tree step: the tokens each request committed, and per request what the chain of the best drafts would
        have verified and accepted as far as the tree's pass tells (speculative/tree.py chain_outcomes), which the
        chains' estimates learn (the engine's, and the requests' own in the order of `requests`)."""
        self.tree.age()
        self.tree.observe(committed)
        if chains:
            self.estimate.observe_rows(chains)
            for estimate, row in zip(requests, chains):
                estimate.observe_rows([row])

    def observe_tree_time(self, batch: int, context: float, seconds: float, pending: float = 0.0) -> None:
        """A tree step took `seconds`: its own cost ratio learns it (the chains' correction does not)."""
        nodes = self.tree_budget + 1
        predicted = ((self.predicted_seconds(batch, context, nodes) + self._hand_over_seconds(batch, pending))
                     * self.correction.factor(batch, nodes))
        self.tree.observe_time(predicted, seconds)

    def observe(self, verify_length: int, accepted: Sequence[int],
                requests: Sequence[AcceptanceEstimate] = ()) -> None:
        """One step's accepted drafts per request (in the order of `requests`, their own estimates, if given). Every
        step ages the tree's estimate."""
        self.tree.age()
        self.estimate.observe(verify_length, accepted)
        for estimate, n in zip(requests, accepted):
            estimate.observe(verify_length, [n])
        self._steps += 1
        if self._steps % SAVE_EVERY == 0:
            self.save()

    def save(self) -> None:
        """Hand the engine's rates to `record`, once any step has verified a draft."""
        if self.record is not None and self.estimate.evidence > 0:
            self.record(self.estimate.conditional_rates())

    def observe_time(self, batch: int, context: float, k: int, seconds: float, pending: float = 0.0) -> None:
        """A step of `batch` requests at longest context `context`, verifying k tokens each (after handing the drafter
        `pending` held-back positions per request, if k > 1), took `seconds`."""
        hand_over = self._hand_over_seconds(batch, pending) if k > 1 else 0.0
        self.correction.observe(batch, k, self.predicted_seconds(batch, context, k) + hand_over, seconds)

    def _hand_over_seconds(self, batch: int, pending: float) -> float:
        """What a speculative step pays first to give the drafter `pending` held-back positions per request."""
        return self.costs.context_seconds(batch, pending) if pending > 0 else 0.0
