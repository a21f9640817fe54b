"""FP8 (E4M3) per-tensor weights and activations, as in ModelOpt's FP8_DEFAULT_CFG unified HF export.

Tensors per linear: `weight` float8_e4m3fn [out, in], `weight_scale` fp32 scalar = amax(|W|) / 448,
`input_scale` fp32 scalar = calibrated activation amax / 448; W ~= weight * weight_scale.
ModelOpt does not unify weight scales over q/k/v or gate/up for FP8 (it does for NVFP4); a runtime that
fuses them requantizes with the group max.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP8Weight:
    """One FP8 linear as stored in the unified HF checkpoint (`<prefix>.weight`, `.weight_scale`, ...)."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn
    weight_scale: torch.Tensor  # [] fp32 = amax / 448
    input_scale: torch.Tensor | None = None  # [] fp32 = activation amax / 448; None for weight-only

    def __post_init__(self) -> None:
        assert self.weight.dtype == torch.float8_e4m3fn and self.weight.ndim == 2, (
            self.weight.dtype, self.weight.shape)
        for name in ("weight_scale", "input_scale"):
            t = getattr(self, name)
            assert t is None or (t.dtype == torch.float32 and t.ndim == 0), (
                f"{name} must be an fp32 scalar, got {t.dtype} {tuple(t.shape)}")


def quantize_fp8_weight(w: torch.Tensor, global_amax: torch.Tensor | None = None) -> FP8Weight:
    """Quantize a linear weight [out, in] to FP8 per-tensor, byte-for-byte as ModelOpt's export does.

    The division w / weight_scale runs in w's dtype (torch promotion with a 0-dim fp32 scale), so a bf16
    weight is rounded to bf16 before the FP8 cast, exactly like ModelOpt's `to_quantized_weight`.
    `global_amax` (scalar, default amax(|w|)) lets shards or fused projections share one scale.

    Example: w = [[448, -1, 0.3]] (amax 448) -> weight_scale 1.0, weight [[448, -1, 0.3125]] (E4M3 rounding).
    """
    assert w.ndim == 2 and w.is_floating_point(), f"expected a float [out, in] weight, got {w.dtype} {tuple(w.shape)}"
    local_amax = w.abs().amax().float()
    amax = local_amax if global_amax is None else global_amax.detach().float().reshape(())
    assert torch.isfinite(amax) and amax > 0, f"cannot FP8-quantize a weight with amax {amax.item()}"
    assert amax >= local_amax, f"global_amax {amax.item()} is below this weight's amax {local_amax.item()}"
    weight_scale = amax.to(w.device) / E4M3_MAX
    return FP8Weight(weight=(w.detach() / weight_scale).to(torch.float8_e4m3fn), weight_scale=weight_scale)


def dequantize_fp8(q: FP8Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8Weight -> dense [out, in] weight = weight * weight_scale, computed in fp32.

    (ModelOpt's `from_quantized_weight` multiplies in the target dtype, rounding the scale to bf16 first.)
    Example: weight [[448, -1]], weight_scale 0.5 -> [[224, -0.5]].
    """
    return (q.weight.float() * q.weight_scale).to(dtype)


def fake_quant_fp8_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize activations [...] with the calibrated per-tensor `input_scale` (amax / 448).

    y = fp8(clamp(x / input_scale, -448, 448)) * input_scale, in fp32, returned in x's dtype. ModelOpt's
    fake quant computes the same from amax (x * (448 / amax), then / (448 / amax)); the two agree exactly
    when 448 / amax is a power of two and otherwise can differ in the last bit of rare FP8 ties.

    Example: input_scale 0.5: x = [1.0, 0.3, 1000] -> x / 0.5 = [2, 0.6, 2000] -> [2, 0.625, 448] -> [1, 0.3125, 224].

    `input_scale` may also be one per row, shaped as x[..., 0] (grouped experts: each row its expert's scale).
    """
    assert x.is_floating_point(), x.dtype
    scale = row_scales(x, input_scale)[..., None]
    q = (x.detach().float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def row_scales(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """`input_scale` (a scalar, or one per row of x: shaped as x[..., 0]) as float32 on x's device, shaped as
    x[..., 0] (a scalar: 0-dim)."""
    if input_scale.numel() == 1:
        return input_scale.detach().float().reshape(()).to(x.device)
    assert input_scale.shape == x.shape[:-1], \
        f"input_scale must be a scalar or one per row {tuple(x.shape[:-1])}, got shape {tuple(input_scale.shape)}"
    return input_scale.detach().float().to(x.device)
