"""How many tokens a decoding step verifies per request: one policy object per Decoder, asked every step.

    PlainDecoding      k = 1 every step: plain autoregressive decoding; the drafter never runs (`--mode ar`).
    FixedBlock(k)      k every step: DFlash with a block of k tokens, the anchor and k - 1 drafts (`--block-size k`).
    AutoBlock(auto)    the k in 1 .. block_size that maximises expected tokens/s for the running batch, from
                       measured pass costs and the acceptance seen so far (`--block-size auto`,
                       speculative/schedule.py); k = 1 is a plain step that keeps the target's features for later;
                       with `--tree-budget n` (n < block_size) a tree of n nodes is one more choice.
    TreeDrafting(n)    a tree of the n best draft nodes and the anchor every step (`--tree-budget n`, DDTree).

Every policy is lossless: the tokens committed are the target's own whatever k is (speculative/core.py), so the
decoders of one engine under different policies give the same tokens, at different speeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from trtllm_dflash.runtime.options import Mode
from trtllm_dflash.speculative.schedule import AcceptanceEstimate, AutoBlockSize


@dataclass(frozen=True)
class StepShape:
    """What a policy is told about the step it chooses for (all host values)."""

    batch: int  # running requests
    context: int  # the longest request's committed positions
    estimates: Sequence[AcceptanceEstimate | None]  # each request's own acceptance estimate (AutoBlock's)
    pending: float  # held-back positions per request that a speculative step hands to the drafter first
    remaining: float  # tokens per request still allowed (mean of max_new_tokens - committed)


class VerifyPolicy(Protocol):
    drafts: bool  # whether steps use the drafter (and prefills and plain steps keep the target's features for it)
    width: int | None  # positions of the drafter's block (None: the executor's block_size)
    defers_context: bool  # prompts' features are held back until a speculative step needs them (AutoBlock)
    longest: int  # the most tokens a step may verify

    def new_request(self) -> AcceptanceEstimate | None:
        """A new request's own acceptance estimate, if the policy keeps one."""
        ...

    def choose(self, shape: StepShape) -> int:
        """Tokens verified per request this step, 1 .. longest (1: a plain step)."""
        ...

    def observe(self, k: int, accepted: Sequence[int], shape: StepShape, seconds: float) -> None:
        """What the step verifying k tokens accepted per request (drafts, in `shape.estimates`' order), in `seconds`."""
        ...


class PlainDecoding:
    """One token per step, without the drafter."""

    drafts, defers_context, longest, width = False, False, 1, None

    def new_request(self) -> None:
        return None

    def choose(self, shape: StepShape) -> int:
        return 1

    def observe(self, k: int, accepted: Sequence[int], shape: StepShape, seconds: float) -> None:
        pass


@dataclass(frozen=True)
class FixedBlock:
    """A block of k tokens every step: the anchor and k - 1 drafts (k >= 2), drafted by a pass over k positions (a
    shorter block of the trained drafter when k is less than its block size)."""

    k: int
    drafts = True
    defers_context = False

    def __post_init__(self):
        if self.k < 2:
            raise ValueError(f"a DFlash block verifies at least 2 tokens (the anchor and a draft), got {self.k}")

    @property
    def longest(self) -> int:
        return self.k

    @property
    def width(self) -> int:
        return self.k

    def new_request(self) -> None:
        return None

    def choose(self, shape: StepShape) -> int:
        return self.k

    def observe(self, k: int, accepted: Sequence[int], shape: StepShape, seconds: float) -> None:
        pass


@dataclass(frozen=True)
class TreeDrafting:
    """`--tree-budget N` (DDTree, speculative/tree.py): every step drafts the trained block's positions in one drafter
    pass and verifies a tree of the `budget` best draft nodes (the `candidates` best tokens of each position extend
    it) with the anchor in one target pass; the accepted path is the longest the target's own tokens follow."""

    budget: int
    candidates: int = 8
    drafts = True
    defers_context = False
    width = None
    longest = 1  # (a tree's pass is sized by the executor's tree_budget, not its block)

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError(f"a draft tree has at least one node, got a budget of {self.budget}")

    def new_request(self) -> None:
        return None

    def choose(self, shape: StepShape) -> int:
        return self.budget + 1

    def observe(self, k: int, accepted: Sequence[int], shape: StepShape, seconds: float,
                chains: Sequence[tuple[int, int]] = ()) -> None:
        pass


def verify_policy(mode: Mode, block_size: int, auto: AutoBlockSize | None = None) -> VerifyPolicy:
    """The policy of `run --mode` (and `--block-size`): plain decoding for "ar"; for "dflash", `auto`'s choice when
    given (`--block-size auto`), else a fixed block of `block_size` tokens."""
    if mode == "ar":
        return PlainDecoding()
    return AutoBlock(auto) if auto is not None else FixedBlock(block_size)


class AutoBlock:
    """`--block-size auto`: the engine's AutoBlockSize chooses k per step and learns from what each step accepted and
    how long it took. Decoders of one engine share it, so each starts from what the previous ones saw. With a tree
    budget (`--tree-budget`, at most block_size - 1), a step may verify a draft tree of that many nodes instead
    (`tree_step`: the Decoder runs it as TreeDrafting's), when its own estimate says it commits more per second."""

    drafts, defers_context = True, True
    width = None  # the whole trained block: its pass costs were measured so, and the first k - 1 drafts are read
    candidates = TreeDrafting.candidates  # (a tree step's tokens per position)

    def __init__(self, auto: AutoBlockSize):
        self.auto = auto
        self.longest = auto.block_size
        self.budget = auto.tree_budget
        self.tree_step = False  # whether the step chosen last is a tree's

    def new_request(self) -> AcceptanceEstimate:
        return self.auto.new_request()

    def choose(self, shape: StepShape) -> int:
        args = (shape.batch, shape.context, shape.estimates, shape.pending, shape.remaining)
        if not self.budget:
            return self.auto.choose(*args)
        k = self.auto.choose_tree(*args)
        self.tree_step = k is None
        return self.budget + 1 if k is None else k

    def observe(self, k: int, accepted: Sequence[int], shape: StepShape, seconds: float,
                chains: Sequence[tuple[int, int]] = ()) -> None:
        """`chains` (tree steps): per request what the chain of the best drafts would have verified and accepted."""
        if self.tree_step:  # (its time teaches the tree's own cost ratio, not the chains' correction)
            self.auto.observe_tree([n + 1 for n in accepted], chains, shape.estimates)
            self.auto.observe_tree_time(shape.batch, shape.context, seconds, shape.pending)
            return
        self.auto.observe(k, accepted, shape.estimates)  # k = 1 verifies no draft: only the step is counted
        self.auto.observe_time(shape.batch, shape.context, k, seconds, shape.pending)

    def save(self) -> None:
        """The acceptance seen, as the next run's prior."""
        self.auto.save()
