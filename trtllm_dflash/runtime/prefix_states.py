"""Prefix reuse for hybrid targets (Qwen3.5's Gated DeltaNet layers): recurrent states kept at prompt-block boundaries.

A paged cache shares a prompt's attention K/V block by block (runtime/kv_blocks.py), but a Gated DeltaNet layer's
state after a prefix is one matrix per layer, built from every token before it (models/linear_attention.py): blocks
alone cannot resume it. So the executor also keeps the states at chosen block boundaries of the prompts it prefills
(`checkpoint`), under the prefix hash of the block that ends there (kv_blocks.prefix_hashes: it covers every token
before and what the caches hold), and a later request takes a cached prefix only up to the last boundary whose state
is kept (`boundary`), that state copied into its slot (`admit`).

Which boundaries: the decoder ends a prefill pass at each (`Executor.checkpoints`, runtime/decoding.py):
- the end of a prompt's last full block (an identical prompt, the next turn of a conversation, a preempted request
  recomputed);
- where a prompt leaves a cached prefix whose state is not kept (the second request of a system prompt keeps the
  state at its end, so the third and later ones resume there);
- for requests admitted together that share a prefix, where it ends (the one that computes it keeps it for the
  others).
A state at every block, as the K/V blocks are kept, would cost far more: 72 MiB per 16 tokens for one rank of
Qwen3.5-27B at tp 2 (48 layers of 24 value heads of 128 x 128 in fp32). vLLM's prefix caching for hybrid models and
SGLang's MambaRadixCache also keep states at chosen points only.

The pool holds `capacity` states (one per slot, counted in --kv-cache-memory), the least recently used evicted first;
states are copied in and out, never shared by reference. The torch executor's paged cache shares the blocks; the
compiled executors' static rows copy them from their prefix pool (runtime/cache_rows.py PrefixRows) and the states
from here alike.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from trtllm_dflash.models.linear_attention import RecurrentStates
from trtllm_dflash.runtime.kv_blocks import BLOCK_TOKENS


class PrefixStates:
    """Up to `capacity` kept states of `states`' layers (each: every layer's conv inputs and recurrent state), by the
    prefix hash of the block they follow, and each admitted request's checkpoints. The executor's slots may sit in rows
    of `states` of their own (the compiled executors' CacheRows): the methods that touch a state take the row."""

    def __init__(self, states: RecurrentStates, capacity: int, block_tokens: int = BLOCK_TOKENS):
        self._states, self.capacity, self.block_tokens = states, capacity, block_tokens
        self._conv = [torch.empty(capacity, states.kernel - 1, c.shape[-1], dtype=c.dtype, device=c.device)
                      for c in states.conv]
        self._state = [torch.empty(capacity, *s.shape[1:], dtype=s.dtype, device=s.device) for s in states.state]
        self._kept: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> pool index, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self._slots: dict[int, tuple[tuple[int, ...], list[bytes]]] = {}  # slot -> (checkpoints, prompt block hashes)
        self.kept = self.resumed = 0  # states kept, and requests that resumed from one

    @staticmethod
    def bytes_each(states: RecurrentStates) -> int:
        """Bytes of one kept state of `states`' layers."""
        conv = sum((states.kernel - 1) * c.shape[-1] * c.element_size() for c in states.conv)
        return conv + sum(s[0].nbytes for s in states.state)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_each(self._states)

    def boundary(self, hashes: list[bytes], blocks: int) -> int:
        """The most blocks n <= `blocks` (the cached ones) of a prompt with block `hashes` after which a state is kept
        (0: none): what a request may take."""
        return next((n for n in range(min(blocks, len(hashes)), 0, -1) if hashes[n - 1] in self._kept), 0)

    def admit(self, slot: int, row: int, hashes: list[bytes], found: int, cached: int) -> None:
        """A request took `slot` (its states in `row`) with a prompt of block `hashes`, of which the first `found` were
        cached and the first `cached` positions taken (boundary's): resume its states there, and note its
        checkpoints: where the cached prefix it found goes on without a kept state (another prompt's blocks: the next
        request with that prefix resumes there), and its prompt's last full block."""
        if cached:
            self._resume(row, cached, hashes[cached // self.block_tokens - 1])
        points = {n * self.block_tokens for n in (found, len(hashes))}
        self._slots[slot] = (tuple(sorted(p for p in points if p > cached)), hashes)

    def checkpoints(self, slot: int) -> tuple[int, ...]:
        return self._slots[slot][0] if slot in self._slots else ()

    def checkpoint(self, slot: int, row: int, position: int) -> None:
        """A prefill pass of the request in `slot` (`row`) has just ended at `position`, a block boundary of its
        prompt: keep its states there (RecurrentStates.state_at), under the hash of the block ending there; nothing if
        one is kept already."""
        hashes = self._slots[slot][1]
        assert position % self.block_tokens == 0 and 0 < position <= len(hashes) * self.block_tokens, position
        key = hashes[position // self.block_tokens - 1]
        if key in self._kept:
            self._kept.move_to_end(key)
            return
        index = self._free.pop() if self._free else self._kept.popitem(last=False)[1]
        for layer, (conv, state) in enumerate(self._states.state_at(row, position)):
            self._conv[layer][index] = conv
            self._state[layer][index] = state
        self._kept[key] = index
        self.kept += 1

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def _resume(self, row: int, position: int, key: bytes) -> None:
        index = self._kept[key]
        self._kept.move_to_end(key)
        self._states.resume_at(row, position, [(c[index], s[index]) for c, s in zip(self._conv, self._state)])
        self.resumed += 1


class KeepsPrefixStates:
    """The Executor contract's checkpoint methods (runtime/executor.py) for an executor whose `prefix_states` (None: no
    hybrid prefix reuse) keeps the states of a slot's request in row `_state_row(slot)` of its recurrent states."""

    prefix_states: PrefixStates | None

    def _state_row(self, slot: int) -> int:
        return slot

    @property
    def resumes_states(self) -> bool:
        return self.prefix_states is not None

    def checkpoints(self, slot: int) -> tuple[int, ...]:
        return self.prefix_states.checkpoints(slot) if self.prefix_states is not None else ()

    def checkpoint(self, slot: int, position: int) -> None:
        if self.prefix_states is not None:
            self.prefix_states.checkpoint(slot, self._state_row(slot), position)
