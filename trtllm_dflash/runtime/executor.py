"""The Executor contract and its torch implementation.

The seam between the algorithm (runtime/decoding.py) and the hardware: given a batch's token ids,
start positions and cache slots, run the target (and the drafter) and return logits, captured
hidden states or draft tokens. The torch executor is the reference; a TensorRT executor binds the
same tensors to an engine.
"""

from __future__ import annotations

from typing import Protocol

import torch

from trtllm_dflash.models.drafter import DFlashDrafter
from trtllm_dflash.models.target import TargetModel, TargetOutput
from trtllm_dflash.speculative.core import block_input


class Executor(Protocol):
    num_slots: int
    vocab_size: int
    max_seq_len: int  # prompt + output tokens a slot holds

    def target_forward(self, token_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
                       capture: bool, last_index: torch.Tensor | None = None) -> TargetOutput: ...

    def draft(self, anchors: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor: ...

    def append_context(self, hidden: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> None: ...


class TorchExecutor:
    """Target + drafter as torch modules, with static per-slot KV caches for both."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, num_slots: int, max_seq_len: int,
                 block_size: int | None = None):
        self.target, self.drafter = target, drafter
        # Tokens per block at run time: the trained block size, or fewer (a shorter block of the same drafter).
        self.block_size = block_size or (drafter.params.block_size if drafter is not None else 1)
        self.num_slots, self.vocab_size, self.max_seq_len = num_slots, target.spec.vocab_size, max_seq_len
        # A verify pass writes block_size positions from the last committed one.
        margin = drafter.params.block_size if drafter is not None else 1
        self.target_cache = target.new_cache(num_slots, max_seq_len + margin)
        self.draft_cache = drafter.new_cache(num_slots, max_seq_len + margin) if drafter is not None else None
        self.device = target.lm_head.weight.device

    @torch.inference_mode()
    def target_forward(self, token_ids, starts, slots, capture, last_index=None) -> TargetOutput:
        """Run the target on token_ids [B, T] at positions starts[:, None] + arange(T).

        With `capture`, also return the outputs of the drafter's target_layer_ids [B, T, n_feat * H].
        """
        positions = starts[:, None] + torch.arange(token_ids.shape[1], device=self.device)
        layers = self.drafter.params.target_layer_ids if capture else ()
        return self.target(token_ids, positions, slots, self.target_cache, layers, last_index)

    @torch.inference_mode()
    def draft(self, anchors, starts, slots) -> torch.Tensor:
        """Greedy drafts [B, block_size - 1] for the block after each anchor (at position `starts`)."""
        assert self.drafter is not None
        p = self.drafter.params
        block = block_input(anchors, p.mask_token_id, self.block_size)
        positions = starts[:, None] + torch.arange(self.block_size, device=self.device)
        hidden = self.drafter(self.target.embed(block), positions, starts, slots, self.draft_cache)
        return self.target.logits(hidden[:, 1:]).argmax(dim=-1)

    @torch.inference_mode()
    def append_context(self, hidden, starts, slots) -> None:
        """Add captured target features hidden [B, C, F] at positions starts[:, None] + arange(C)."""
        assert self.drafter is not None
        positions = starts[:, None] + torch.arange(hidden.shape[1], device=self.device)
        self.drafter.append_context(hidden, positions, slots, self.draft_cache)
