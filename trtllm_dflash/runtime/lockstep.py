"""Tensor-parallel decoding in lockstep: rank 0 drives the scheduler, the other ranks follow.

Every rank runs the same Decoder over its shard of the model, so every rank must see the same
requests at the same step; then the all-reduced / all-gathered activations make every rank compute
the same logits and take the same decisions. Before each step, rank 0 broadcasts a small header
(number of new requests, stop flag) and, when there are new requests, the requests themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from trtllm_dflash.runtime.decoding import Decoder, Request, Result, Update, run_to_completion


class LockstepDriver:
    """Rank 0's view: the Decoder interface (submit / step / has_work / generate), mirrored to all ranks."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self._new: list[Request] = []

    def submit(self, request: Request) -> None:
        self.decoder.check(request)  # raise here, on rank 0, before any rank has seen it
        self._new.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self._new) or self.decoder.has_work

    @property
    def num_active(self) -> int:
        return self.decoder.num_active

    def step(self) -> list[Update]:
        new, self._new = self._new, []
        dist.broadcast(torch.tensor([len(new), 0]), src=0)
        if new:
            dist.broadcast_object_list([new], src=0)
        for request in new:
            self.decoder.submit(request)
        return self.decoder.step()

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        return run_to_completion(self, requests)

    def close(self) -> None:
        """Release the followers (they return from `follow`)."""
        dist.broadcast(torch.tensor([0, 1]), src=0)


def follow(decoder: Decoder) -> None:
    """Ranks > 0: mirror rank 0's steps until it closes."""
    header = torch.zeros(2, dtype=torch.long)
    while True:
        dist.broadcast(header, src=0)
        n_new, stop = header.tolist()
        if stop:
            return
        if n_new:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            for request in box[0]:
                decoder.submit(request)
        decoder.step()
