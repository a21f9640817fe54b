"""The tensor-parallel group a sharded model runs in: its rank, size and collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Rank `rank` of `size` ranks; collectives go through torch.distributed (gloo on CPU, nccl on CUDA).

    The default (size 1) makes every collective a no-op, so one model code path serves both. Under
    torch.export (compile/onnx_export.py, which registers `torch.ops.dflash_onnx`) a collective becomes one
    custom op that the exporter writes as TensorRT's DistCollective node, so a rank's ONNX graph holds it.
    """

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (row-parallel outputs, vocab-parallel embeddings)."""
        if self.size > 1:
            if torch.compiler.is_exporting():
                return torch.ops.dflash_onnx.all_reduce(x, self.size)
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        if torch.compiler.is_exporting():
            return torch.ops.dflash_onnx.all_gather_last(x, self.size)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
