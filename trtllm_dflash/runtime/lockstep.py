"""Tensor-parallel decoding in lockstep: rank 0 drives the scheduler, the other ranks follow.

Every rank runs the same Decoder over its shard of the model, so every rank must see the same
requests at the same step; then the all-reduced / all-gathered activations make every rank compute
the same logits and take the same decisions. Before each step, rank 0 broadcasts a small header
(number of new requests, stop flag, number of cancelled requests) and, when there are any, the new
requests and the cancelled ids themselves. The one decision that rests on a rank's own clock, `--block-size
auto`'s verify length (it learns from the steps' times), is rank 0's, broadcast within the step (Rank0Chooses).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from trtllm_dflash.runtime.decoding import Decoder, Request, Result, Update, run_to_completion
from trtllm_dflash.runtime.verify import AutoBlock, StepShape
from trtllm_dflash.speculative.schedule import AcceptanceEstimate


class LockstepDriver:
    """Rank 0's view: the Decoder interface (submit / step / has_work / generate), mirrored to all ranks."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self._new: list[Request] = []
        self._cancelled: list[str | int] = []

    def submit(self, request: Request) -> None:
        self.decoder.check(request)  # raise here, on rank 0, before any rank has seen it
        self._new.append(request)

    def cancel(self, request_id: str | int) -> None:
        self._cancelled.append(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._new or self._cancelled) or self.decoder.has_work

    @property
    def num_active(self) -> int:
        return self.decoder.num_active

    def step(self) -> list[Update]:
        (new, cancelled), self._new, self._cancelled = (self._new, self._cancelled), [], []
        dist.broadcast(torch.tensor([len(new), 0, len(cancelled)]), src=0)
        if new or cancelled:
            dist.broadcast_object_list([new, cancelled], src=0)
        _apply(self.decoder, new, cancelled)
        return self.decoder.step()

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        return run_to_completion(self, requests)

    def save(self) -> None:
        """Keep what the policy learnt for the next run (rank 0's: followers record nothing)."""
        self.decoder.save()

    def close(self) -> None:
        """Release the followers (they return from `follow`)."""
        dist.broadcast(torch.tensor([0, 1, 0]), src=0)


def _apply(decoder: Decoder, new: list[Request], cancelled: list[str | int]) -> None:
    for request in new:
        decoder.submit(request)
    for request_id in cancelled:
        decoder.cancel(request_id)


def follow(decoder: Decoder) -> None:
    """Ranks > 0: mirror rank 0's steps until it closes."""
    header = torch.zeros(3, dtype=torch.long)
    while True:
        dist.broadcast(header, src=0)
        n_new, stop, n_cancelled = header.tolist()
        if stop:
            return
        new, cancelled = [], []
        if n_new or n_cancelled:
            box = [None, None]
            dist.broadcast_object_list(box, src=0)
            new, cancelled = box
        _apply(decoder, new, cancelled)
        decoder.step()


class Rank0Chooses:
    """`--block-size auto` under tensor parallelism: AutoBlock's choice of k rests on this rank's own step times, so
    ranks left to choose alone would verify blocks of different lengths and their collectives would not pair up.
    Rank 0 chooses and broadcasts its choice (k, and whether it is a tree step) within the step; every rank takes it.
    Only rank 0 learns from what the steps accepted and took (the followers' estimates are never asked)."""

    def __init__(self, policy: AutoBlock, leader: bool):
        self.policy, self.leader = policy, leader
        self.drafts, self.defers_context, self.width = policy.drafts, policy.defers_context, policy.width
        self.longest, self.budget, self.candidates = policy.longest, policy.budget, policy.candidates
        self.tree_step = False

    def new_request(self) -> AcceptanceEstimate:
        return self.policy.new_request()

    def choose(self, shape: StepShape) -> int:
        choice = torch.zeros(2, dtype=torch.long)
        if self.leader:
            choice[0], choice[1] = self.policy.choose(shape), self.policy.tree_step
        dist.broadcast(choice, src=0)
        k, tree = choice.tolist()
        self.tree_step = bool(tree)
        return k

    def observe(self, k: int, accepted: Sequence[int], shape: StepShape, seconds: float,
                chains: Sequence[tuple[int, int]] = ()) -> None:
        if self.leader:
            self.policy.observe(k, accepted, shape, seconds, chains)

    def save(self) -> None:
        if self.leader:
            self.policy.save()
