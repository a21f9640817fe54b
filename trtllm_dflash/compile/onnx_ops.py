"""The KV cache of an exported graph: ONNX TensorScatter writes into caches that are graph inputs.

The models read and write their caches only through `KVCache.write` / `KVCache.read` (models/layers.py).
`GraphKVCache` has the same two methods over per-layer tensors `[batch, kv_heads, max_len, head_dim]` that
are graph inputs; each write returns a new tensor (the graph output "present"), which the runtime binds to
the input's own buffer, so the write happens in place:

    past_key_i [batch, kv_heads, max_len, hd] --TensorScatter(update [batch, kv_heads, T, hd],
                                                  write_indices [batch], axis=2)--> present_key_i

TensorScatter (ONNX opset 24) writes update[b] at positions write_indices[b] .. + T - 1 of row b; its batch
axis is the cache's axis 0, so row b of the cache belongs to row b of the step (see onnx_export.py for how
an executor binds the rows of its slots). TensorRT parses it into its KV-cache update layer (COMPILED.md §2).

`tensor_scatter` is a torch custom op with a real eager implementation (so the export wrappers also run
in plain torch) and an onnxscript translation for the exporter (TRANSLATIONS).
"""

from __future__ import annotations

import torch
from onnxscript.onnx_opset import opset24

TENSOR_SCATTER_OPSET = 24


@torch.library.custom_op("dflash_onnx::tensor_scatter", mutates_args=())
def tensor_scatter(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """ONNX TensorScatter(mode="linear", axis=2): cache [B, H, L, D], update [B, H, T, D], write_indices [B]."""
    assert cache.ndim == 4 and update.shape[:2] == cache.shape[:2] and write_indices.shape == cache.shape[:1]
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]  # [B, 1]
    cols = write_indices[:, None] + torch.arange(update.shape[2], device=cache.device)  # [B, T]
    out = cache.clone()
    out[rows, :, cols] = update.transpose(1, 2)  # indexed view: [B, T, H, D]
    return out


@tensor_scatter.register_fake
def _(cache, update, write_indices):
    return torch.empty_like(cache)


def _tensor_scatter_onnx(cache, update, write_indices):
    return opset24.TensorScatter(cache, update, write_indices, axis=2, mode="linear")


# custom_translation_table for torch.onnx.export
TRANSLATIONS = {torch.ops.dflash_onnx.tensor_scatter.default: _tensor_scatter_onnx}


class GraphKVCache:
    """Stands in for `KVCache` while a graph is traced: per-layer caches [batch, kv_heads, max_len, head_dim].

    Row b of every cache is row b of the step's batch: the `slots` the models pass are ignored. Writes
    cover positions[b, 0] .. positions[b, 0] + T - 1, so each row's positions must be consecutive (they
    are: start + arange(T)).
    """

    def __init__(self, past: list[torch.Tensor]):
        # past: [k_0, v_0, k_1, v_1, ...]
        self.keys, self.values = list(past[0::2]), list(past[1::2])

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        # positions: [B, T]; k, v: [B, T, kv_heads, hd]
        start = positions[:, 0]
        self.keys[layer] = tensor_scatter(self.keys[layer], k.transpose(1, 2), start)
        self.values[layer] = tensor_scatter(self.values[layer], v.transpose(1, 2), start)

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [B, length, kv_heads, hd]
        torch._check(length <= self.keys[layer].shape[2])
        return (self.keys[layer][:, :, :length].transpose(1, 2),
                self.values[layer][:, :, :length].transpose(1, 2))

    def present(self) -> list[torch.Tensor]:
        """[k_0, v_0, k_1, v_1, ...] after the writes."""
        return [t for kv in zip(self.keys, self.values) for t in kv]
