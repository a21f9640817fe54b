"""gpt-oss's fused expert weights in ModelOpt's unified HF format (NVFP4 / FP8), in pure torch.

transformers stores the experts of a layer as two 3-D tensors applied as x @ W[e]: gate_up_proj [E, H, 2I] and
down_proj [E, I, H]. ModelOpt (`_QuantGptOssExperts`, exported by `_export_quantized_weight` with its BMM-expert
transpose) keeps that layout and names the scales after the weight, one set per projection for all experts:

    NVFP4  <p>                uint8 [E, K/2, N]         two e2m1 codes per byte, packed along the input dim K
           <p>_weight_scale   float8_e4m3fn [E, K/16, N] one scale per 16 inputs
           <p>_weight_scale_2 fp32 []                    amax(|W|) over all experts / (6 * 448)
           <p>_input_scale    fp32 []                    calibrated activation amax / (6 * 448)
    FP8    <p>                float8_e4m3fn [E, K, N]
           <p>_weight_scale   fp32 []                    amax(|W|) over all experts / 448
           <p>_input_scale    fp32 []                    calibrated activation amax / 448

where [K, N] is [H, 2I] for gate_up_proj and [I, H] for down_proj. Expert e transposed ([N, K]) is exactly an
NVFP4 / FP8 linear of quantize/nvfp4.py / fp8.py with the shared global scale, which is how these functions
pack and unpack it, a few hundred output features of one expert at a time (so no full-size float copy of the
experts, nor of one expert, is ever made).

One difference from the 2-D linears: ModelOpt divides a 3-D FP8 weight by a [1]-shaped scale, which promotes the
division to fp32 (a 2-D weight is divided in its own dtype); `quantize_experts` does the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from trtllm_dflash.quantize.fp8 import E4M3_MAX
from trtllm_dflash.quantize.nvfp4 import BLOCK_SIZE, E2M1_MAX, NVFP4Weight, dequantize_nvfp4, quantize_nvfp4_weight

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# Output features packed at a time: rows are independent given the global scale, and ~20 MB of temporaries at
# gpt-oss's width (the float copies of a whole 2880 x 5760 expert would be ~0.5 GB).
ROWS_PER_CHUNK = 256
EXPERT_SCALE_SUFFIXES = ("_weight_scale", "_weight_scale_2", "_input_scale")


@dataclass(frozen=True)
class QuantizedExperts:
    """One projection of a layer's experts (`<p>`, `<p>_weight_scale`, ...) as ModelOpt exports it."""

    fmt: Literal["nvfp4", "fp8"]
    weight: torch.Tensor  # NVFP4: uint8 [E, K/2, N]; FP8: float8_e4m3fn [E, K, N]
    weight_scale: torch.Tensor  # NVFP4: float8_e4m3fn [E, K/16, N]; FP8: fp32 []
    weight_scale_2: torch.Tensor | None  # NVFP4: fp32 []; FP8: None
    input_scale: torch.Tensor | None  # fp32 []

    def __post_init__(self) -> None:
        assert self.weight.ndim == 3, f"expert weights are [E, K, N], got {tuple(self.weight.shape)}"
        if self.fmt == "nvfp4":
            e, half_k, n = self.weight.shape
            assert self.weight.dtype == torch.uint8, self.weight.dtype
            assert self.weight_scale.dtype == torch.float8_e4m3fn, self.weight_scale.dtype
            assert self.weight_scale.shape == (e, 2 * half_k // BLOCK_SIZE, n), (
                f"weight_scale {tuple(self.weight_scale.shape)} does not match weight [{e}, {2 * half_k}/16, {n}]")
            assert self.weight_scale_2 is not None and self.weight_scale_2.shape == (), self.weight_scale_2
        else:
            assert self.weight.dtype == torch.float8_e4m3fn and self.weight_scale.shape == (), (
                self.weight.dtype, tuple(self.weight_scale.shape))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The unpacked shape [E, K, N]."""
        e, k, n = self.weight.shape
        return (e, 2 * k, n) if self.fmt == "nvfp4" else (e, k, n)

    def expert(self, e: int) -> NVFP4Weight:
        """Expert e of an NVFP4 projection as the [N, K] linear it is."""
        return NVFP4Weight(weight=self.weight[e].T.contiguous(), weight_scale=self.weight_scale[e].T.contiguous(),
                           weight_scale_2=self.weight_scale_2)


def quantize_experts(w: torch.Tensor, fmt: Literal["nvfp4", "fp8"], input_amax: torch.Tensor | None = None
                     ) -> QuantizedExperts:
    """Quantize one projection's experts w [E, K, N] (x @ w[e]) as ModelOpt's export does, expert by expert.

    The global scale is amax(|w|) over all experts; `input_amax` (the calibrated max |input|) gives input_scale.
    """
    assert w.ndim == 3 and w.is_floating_point(), (w.dtype, tuple(w.shape))
    amax = torch.maximum(w.max(), -w.min()).float()  # = amax(|w|), without a full-size |w|
    e, k, n = w.shape
    chunks = [(i, slice(r, r + ROWS_PER_CHUNK)) for i in range(e) for r in range(0, n, ROWS_PER_CHUNK)]
    if fmt == "nvfp4":
        weight = torch.empty(e, k // 2, n, dtype=torch.uint8)
        weight_scale = torch.empty(e, k // BLOCK_SIZE, n, dtype=torch.float8_e4m3fn)
        for i, rows in chunks:
            q = quantize_nvfp4_weight(w[i, :, rows].T.contiguous(), amax)  # [rows, K]: blocks run along K
            weight[i, :, rows], weight_scale[i, :, rows] = q.weight.T, q.weight_scale.T
        input_scale = None if input_amax is None else (input_amax.float() / (E2M1_MAX * E4M3_MAX)).reshape(())
        return QuantizedExperts("nvfp4", weight, weight_scale, q.weight_scale_2, input_scale)
    scale = amax / E4M3_MAX
    weight = torch.empty(e, k, n, dtype=torch.float8_e4m3fn)
    for i, rows in chunks:
        weight[i, :, rows] = (w[i, :, rows].float() / scale).to(torch.float8_e4m3fn)
    input_scale = None if input_amax is None else (input_amax.float() / E4M3_MAX).reshape(())
    return QuantizedExperts("fp8", weight, scale, None, input_scale)


def dequantize_experts(q: QuantizedExperts, dtype: torch.dtype) -> torch.Tensor:
    """[E, K, N] in `dtype`, computed in fp32 one expert at a time (exactly the stored values)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.weight.device)
    for e in range(q.shape[0]):
        if q.fmt == "nvfp4":
            out[e] = dequantize_nvfp4(q.expert(e), torch.float32).T.to(dtype)
        else:
            out[e] = (q.weight[e].float() * q.weight_scale).to(dtype)
    return out


def expert_tensors(name: str, q: QuantizedExperts) -> dict[str, torch.Tensor]:
    """The unified-format tensors of projection `name` (e.g. `model.layers.0.mlp.experts.down_proj`)."""
    out = {name: q.weight, name + "_weight_scale": q.weight_scale}
    if q.weight_scale_2 is not None:
        out[name + "_weight_scale_2"] = q.weight_scale_2
    if q.input_scale is not None:
        out[name + "_input_scale"] = q.input_scale
    return out


def read_quantized_experts(tensors: Mapping[str, torch.Tensor], name: str) -> QuantizedExperts | None:
    """Projection `name` of a unified checkpoint's experts, or None when it is stored unquantized."""
    if name + "_weight_scale" not in tensors:
        return None

    def scalar(suffix: str) -> torch.Tensor | None:
        t = tensors.get(name + suffix)
        return None if t is None else t.reshape(())

    weight = tensors[name]
    fmt: Literal["nvfp4", "fp8"] = "nvfp4" if weight.dtype == torch.uint8 else "fp8"
    weight_scale = tensors[name + "_weight_scale"]
    return QuantizedExperts(fmt, weight, weight_scale if fmt == "nvfp4" else weight_scale.reshape(()),
                            scalar("_weight_scale_2"), scalar("_input_scale"))
