"""DeepSeek-V3's published FP8 format (deepseek-ai/DeepSeek-V3, DeepSeek-R1 and their fine-tunes), dequantized on read.

config.json says `quantization_config: {quant_method: "fp8", fmt: "e4m3", weight_block_size: [128, 128],
activation_scheme: "dynamic"}`; each quantized linear's weight W [out, in] is stored as float8_e4m3fn next to
`weight_scale_inv` [ceil(out / 128), ceil(in / 128)] float32, one scale per block of 128 x 128 (the last row and column
of blocks partial: kv_a_proj_with_mqa's 576 rows are 4.5 blocks), and

    W = fp8 value * scale_inv of its block

(DeepSeek's reference `weight_dequant`, transformers' `Fp8Dequantize`). Embeddings, lm_head, norms, the routers and
their biases are stored unquantized. The weights are presented under their HF names in bfloat16 (one rounding of the
exact fp32 product, as transformers' `dequantize=True` load gives them), so the rest of the build reads a plain
checkpoint; the build streams them a tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtllm_dflash.checkpoint.tensors import SafetensorsDir
from trtllm_dflash.errors import UserError

SCALE_SUFFIX = "_scale_inv"  # `<module>.weight_scale_inv`


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight [rows, cols] float8_e4m3fn, scale_inv [ceil(rows / bm), ceil(cols / bn)] -> W [rows, cols] in `dtype`."""
    rows, cols = weight.shape
    bm, bn = block
    scale = scale_inv.float().repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bn, dim=1)[:, :cols]
    return (weight.float() * scale).to(dtype)


class FP8BlockDir(SafetensorsDir):
    """A checkpoint directory whose weights with a `weight_scale_inv` beside them are FP8 blocks: presented as the
    bfloat16 weights they stand for (the scales themselves are not listed); everything else is read as stored."""

    def __init__(self, directory: Path, block: tuple[int, int]):
        super().__init__(directory)
        self.block = block
        self.scaled = {n[: -len(SCALE_SUFFIX)] for n in self.files if n.endswith(".weight" + SCALE_SUFFIX)}
        for name in sorted(self.scaled):
            if name not in self.files:
                raise UserError(f"{directory}: tensor {name!r} is missing beside its {name + SCALE_SUFFIX!r}.")
            (rows, cols), dtype = super().shape_dtype(name)
            want = (-(-rows // block[0]), -(-cols // block[1]))
            got, scale_dtype = super().shape_dtype(name + SCALE_SUFFIX)
            if dtype != "F8_E4M3" or got != want:
                raise UserError(f"{self.files[name]}: FP8 tensor {name!r} has dtype {dtype} and a "
                                f"{name + SCALE_SUFFIX!r} of shape {list(got)}; expected F8_E4M3 and {list(want)} for "
                                f"weight_block_size {list(block)} (config.json's quantization_config).")

    def names(self) -> list[str]:
        return [n for n in super().names() if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self.scaled)]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        shape, dtype = super().shape_dtype(name)
        return (shape, "BF16") if name in self.scaled else (shape, dtype)

    def get(self, name: str) -> torch.Tensor:
        if name in self.scaled:
            return dequantize_fp8_blocks(super().get(name), super().get(name + SCALE_SUFFIX), self.block)
        return super().get(name)
