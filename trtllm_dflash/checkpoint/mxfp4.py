"""The published gpt-oss MXFP4 expert format (openai/gpt-oss-20b, -120b), dequantized on read.

config.json says `quantization_config.quant_method: "mxfp4"`; each expert weight W (HF layout [E, K, N],
applied as x @ W) is stored transposed as two uint8 tensors (transformers' integrations/mxfp4.py):

    {W}_blocks [E, N, K / 32, 16]   two e2m1 codes per byte, low nibble first: 32 values per block
    {W}_scales [E, N, K / 32]       e8m0: the block's power of two, biased by 127

value = FP4_VALUES[code] * 2 ** (scale - 127). `dequantize_mxfp4` is transformers' `convert_moe_packed_tensors`
step for step (same lookup table, same ldexp in the output dtype), so the weights equal HF's exactly.
Biases, router, attention, embeddings and lm_head are stored unquantized.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtllm_dflash.checkpoint.tensors import SafetensorsDir
from trtllm_dflash.errors import UserError

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [E, N, G, 16] uint8, scales [E, N, G] uint8 -> W [E, G * 32, N] in `dtype` (exact in bf16 and fp32)."""
    assert blocks.dtype == scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[:-1] == scales.shape, (blocks.shape, scales.shape)
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    experts, rows, groups, nbytes = blocks.shape
    out = torch.empty(experts, groups * nbytes * 2, rows, dtype=dtype)
    # One expert at a time: the int index tensors are 4x the packed size, and no second full-size copy is made
    # for the transpose.
    for e in range(experts):
        w = torch.empty(rows, groups, nbytes * 2, dtype=dtype)
        w[..., 0::2] = lut[(blocks[e] & 0x0F).int()]
        w[..., 1::2] = lut[(blocks[e] >> 4).int()]
        torch.ldexp(w, scales[e, ..., None].int() - SCALE_BIAS, out=w)
        out[e] = w.reshape(rows, -1).T
    return out


def packed_shapes(logical: tuple[int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """HF shape [E, K, N] of an expert weight -> shapes of its (_blocks, _scales)."""
    e, k, n = logical
    return (e, n, k // BLOCK, BLOCK // 2), (e, n, k // BLOCK)


class MXFP4Dir(SafetensorsDir):
    """A checkpoint directory whose listed expert weights are stored as MXFP4 `_blocks` / `_scales`: they are
    presented under their HF names and shapes (bf16, like transformers' dequantized load); everything else is
    read as stored."""

    def __init__(self, directory: Path, packed: dict[str, tuple[int, int, int]]):
        super().__init__(directory)
        self.logical = packed
        for name, shape in packed.items():
            for suffix, want in zip(("_blocks", "_scales"), packed_shapes(shape)):
                self._check(name + suffix, want)
            self.files[name] = self.files[name + "_blocks"]

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.files:
            raise UserError(f"{self.directory}: MXFP4 tensor {name!r} is missing "
                            "(config.json says quant_method mxfp4).")
        got, dtype = super().shape_dtype(name)
        if got != shape or dtype != "U8":
            raise UserError(f"{self.files[name]}: MXFP4 tensor {name!r} has shape {list(got)} and dtype {dtype}, "
                            f"expected {list(shape)} and U8 from config.json.")

    def names(self) -> list[str]:
        packed = {n + s for n in self.logical for s in ("_blocks", "_scales")}
        return [n for n in super().names() if n not in packed]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        if name in self.logical:
            return self.logical[name], "BF16"
        return super().shape_dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self.logical:
            return dequantize_mxfp4(super().get(name + "_blocks"), super().get(name + "_scales"))
        return super().get(name)
