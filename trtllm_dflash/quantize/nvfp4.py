"""NVFP4 weights and activations in pure torch, bit-exact with ModelOpt's unified HF checkpoint.

Format (ModelOpt `modelopt/torch/quantization/qtensor/nvfp4_tensor.py`, TensorRT-LLM NVFP4 linears):
  value    E2M1 code: bit 3 = sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  packing  two codes per uint8, element 2i in the low nibble, element 2i+1 in the high nibble:
           codes [a, b] -> byte (b << 4) | a.
  block    16 consecutive elements along the input (last) dim share one FP8 E4M3 scale.
  scales   weight_scale_2 = amax(|W|) / (6 * 448)              fp32 per tensor ("global scale")
           weight_scale   = amax(|block|) / (6 * weight_scale_2) float8_e4m3fn per block, <= 448
           W ~= e2m1 * weight_scale * weight_scale_2
Rounding to E2M1 is round-to-nearest, ties to even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4; magnitudes above 6 saturate to 6.

Activations (W4A4) are quantized at run time per 16-block with the same two-level scheme; the global
scale is the calibrated `input_scale` = amax(|x|) / (6 * 448) from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtllm_dflash.quantize.fp8 import row_scales

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# E2M1 code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0).
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
# Midpoints between neighbouring magnitudes. A tie goes to the even code: down at 0.25, 1.25, 2.5, 5.0
# (even code below), up at 0.75, 1.75, 3.5 (even code above).
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIES_ROUNDING_UP = torch.tensor([0.75, 1.75, 3.5])
# The fake-quant kernel ModelOpt runs on GPUs replaces block scales below this (absolute) value by 1.0.
_MIN_ACTIVATION_BLOCK_SCALE = 1e-5


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4 linear as stored in the unified HF checkpoint (`<prefix>.weight`, `.weight_scale`, ...)."""

    weight: torch.Tensor  # [out, in/2] uint8, two E2M1 codes per byte (element 2i low nibble)
    weight_scale: torch.Tensor  # [out, in/16] float8_e4m3fn, per-block scale
    weight_scale_2: torch.Tensor  # [] fp32, per-tensor scale = global_amax / (6 * 448)
    input_scale: torch.Tensor | None = None  # [] fp32 = activation amax / (6 * 448); None for weight-only

    def __post_init__(self) -> None:
        assert self.weight.dtype == torch.uint8 and self.weight.ndim == 2, (self.weight.dtype, self.weight.shape)
        out_features, in_features = self.weight.shape[0], 2 * self.weight.shape[1]
        assert self.weight_scale.dtype == torch.float8_e4m3fn, self.weight_scale.dtype
        assert self.weight_scale.shape == (out_features, in_features // BLOCK_SIZE), (
            f"weight_scale {tuple(self.weight_scale.shape)} does not match weight [{out_features}, {in_features}/16]")
        _assert_fp32_scalar("weight_scale_2", self.weight_scale_2)
        if self.input_scale is not None:
            _assert_fp32_scalar("input_scale", self.input_scale)

    @property
    def shape(self) -> tuple[int, int]:
        """The unpacked weight shape [out, in]."""
        return self.weight.shape[0], 2 * self.weight.shape[1]


def _assert_fp32_scalar(name: str, t: torch.Tensor) -> None:
    assert t.dtype == torch.float32 and t.ndim == 0, f"{name} must be an fp32 scalar, got {t.dtype} {tuple(t.shape)}"


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8 in 0..15), same shape.

    Example: [0.3, -0.75, 1.25, 5.0, 7.0, -0.1] -> [1, 10, 2, 6, 7, 8]
    (0.5, -1, 1, 4, 6 saturated, -0; the sign bit follows `x < 0`, so -0.0 encodes as +0).
    """
    magnitude = x.abs()
    code = torch.searchsorted(_E2M1_MIDPOINTS.to(x.device), magnitude)  # number of midpoints < |x|
    code += torch.isin(magnitude, _TIES_ROUNDING_UP.to(x.device))
    return code.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> fp32 values, same shape. Example: [1, 10, 7, 15] -> [0.5, -1, 6, -6]."""
    assert codes.dtype == torch.uint8, codes.dtype
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 codes -> [..., n/2] bytes, element 2i in the low nibble.

    Example: [1, 10, 7, 15] -> [0xA1, 0xF7].
    """
    assert codes.dtype == torch.uint8 and codes.shape[-1] % 2 == 0, (codes.dtype, codes.shape)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] uint8 codes; inverse of `pack_nibbles`. Example: [0xA1, 0xF7] -> [1, 10, 7, 15]."""
    assert packed.dtype == torch.uint8, packed.dtype
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantize_nvfp4_weight(w: torch.Tensor, global_amax: torch.Tensor | None = None) -> NVFP4Weight:
    """Quantize a linear weight [out, in] to NVFP4, byte-for-byte as ModelOpt's export does.

    `global_amax` (a scalar, default amax(|w|)) sets weight_scale_2 = global_amax / (6 * 448). Pass the
    max amax over a fused group (q/k/v, gate/up) or over all TP shards so they share one weight_scale_2,
    as TensorRT-LLM requires; ModelOpt's export does exactly this for q/k/v and gate/up.

    Example (one 16-block, amax 6): w = [6, 3, -1.5, 0.2, 0, ...] -> weight_scale_2 = 6/2688,
    weight_scale = 6 / (6 * 6/2688) = 448, so the block's scale is 448 * 6/2688 = 1 and the codes are
    [7, 5, 11, 0, 0, ...] (0.2 < 0.25 rounds to 0), packed as bytes [0x57, 0x0B, 0, ...].
    """
    assert w.ndim == 2 and w.is_floating_point(), f"expected a float [out, in] weight, got {w.dtype} {tuple(w.shape)}"
    out_features, in_features = w.shape
    assert in_features % BLOCK_SIZE == 0, f"in_features {in_features} is not a multiple of {BLOCK_SIZE}"
    local_amax = w.abs().amax().float()
    amax = local_amax if global_amax is None else global_amax.detach().float().reshape(())
    assert torch.isfinite(amax) and amax > 0, f"cannot NVFP4-quantize a weight with amax {amax.item()}"
    assert amax >= local_amax, f"global_amax {amax.item()} is below this weight's amax {local_amax.item()}"
    weight_scale_2 = amax.to(w.device) / (E2M1_MAX * E4M3_MAX)

    blocks = w.detach().float().reshape(out_features, -1, BLOCK_SIZE)  # [out, in/16, 16]
    block_scale = blocks.abs().amax(dim=-1) / (E2M1_MAX * weight_scale_2)  # [out, in/16]
    # An all-zero block gets scale 1; scales outside FP8 range are clamped, not flushed or NaN.
    block_scale[block_scale == 0] = 1.0
    weight_scale = block_scale.clamp(min=2**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)

    scaled = blocks / (weight_scale.float() * weight_scale_2).unsqueeze(-1)
    codes = encode_e2m1(scaled.reshape(out_features, in_features))
    return NVFP4Weight(weight=pack_nibbles(codes), weight_scale=weight_scale, weight_scale_2=weight_scale_2)


def dequantize_nvfp4(q: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NVFP4Weight -> dense [out, in] weight: e2m1 * (weight_scale * weight_scale_2), computed in fp32.

    Example: bytes [0x57, 0x0B, 0, ...], weight_scale 448, weight_scale_2 6/2688 -> [6, 3, -1.5, 0, ...].
    """
    out_features, in_features = q.shape
    values = decode_e2m1(unpack_nibbles(q.weight)).reshape(out_features, -1, BLOCK_SIZE)
    scale = q.weight_scale.float() * q.weight_scale_2  # [out, in/16]
    return (values * scale.unsqueeze(-1)).reshape(out_features, in_features).to(dtype)


def fake_quant_nvfp4_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize activations [..., in] as NVFP4 W4A4 does at run time; same shape and dtype.

    Per 16-block along the last dim: scale = fp8(min(amax(|block|) / (6 * input_scale), 448)) * input_scale,
    y = sign(x) * e2m1_round(|x| / scale) * scale. `input_scale` is the calibrated global scale
    amax / (6 * 448). This is ModelOpt's fake quantization (its GPU kernel `fp4_fake_quant_block`, which
    `mtq` runs for both weights and inputs of an NVFP4 model); blocks whose scale falls below 1e-5 use
    scale 1.0 there, which turns them to zeros, and so they do here. Deployment kernels (the
    `cvt_warp_fp16_to_fp4` family in TensorRT-LLM / vLLM) multiply by approximate reciprocals instead of
    dividing, so they may differ in the last bit on exact rounding ties.

    Example: input_scale 1/2688 (amax 1), block [1, 0.3, -0.1, 0, ...]: scale = fp8(448) / 2688 = 1/6,
    |x| / scale = [6, 1.8, 0.6, 0] -> [6, 2, 0.5, 0] -> y = [1, 1/3, -1/12, 0, ...].
    """
    assert x.is_floating_point() and x.shape[-1] % BLOCK_SIZE == 0, (x.dtype, tuple(x.shape))
    global_scale = row_scales(x, input_scale)[..., None, None]  # (a scalar, or one per row: see fp8's)
    global_scale = torch.where(global_scale > 0, global_scale, 1e-12)

    blocks = x.detach().float().reshape(*x.shape[:-1], -1, BLOCK_SIZE)  # [..., in/16, 16]
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (block_amax / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    scale = scale * global_scale
    scale = torch.where(scale >= _MIN_ACTIVATION_BLOCK_SCALE, scale, 1.0)
    y = decode_e2m1(encode_e2m1(blocks / scale)) * scale
    return y.reshape(x.shape).to(x.dtype)
