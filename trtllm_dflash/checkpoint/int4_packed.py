"""Kimi K2.x's published INT4 experts (compressed-tensors' `pack-quantized` format), dequantized on read.

config.json says `quantization_config: {quant_method: "compressed-tensors", format: "pack-quantized", config_groups:
{group_0: {weights: {num_bits: 4, type: "int", symmetric: true, strategy: "group", group_size: 32}, ...}}, ignore:
[...]}`; each quantized linear (Kimi K2: the routed experts; attention, shared experts, dense layers and lm_head are in
`ignore` and stored in bfloat16) is stored as

    <module>.weight_packed  int32 [out, ceil(in / 8)]   eight 4-bit codes per word, code i at bits 4i .. 4i + 3,
                                                         each the value + 8 (compressed-tensors' pack_to_int32)
    <module>.weight_scale   [out, in / group_size]       one scale per group of a row (strategy "channel": [out, 1])
    <module>.weight_shape   [2]                          out, in

and W[r, c] = (code - 8) * weight_scale[r, c // group_size] (symmetric: no zero point). The weights are presented
under their HF names in bfloat16 (the product is exact in fp32 and rounded once), a tensor at a time, over any other
store (a multimodal directory's renamed one).
"""

from __future__ import annotations

import torch

from trtllm_dflash.checkpoint.tensors import SafetensorsDir
from trtllm_dflash.errors import UserError

PARTS = ("_packed", "_scale", "_shape")  # `<module>.weight` + each


def check_pack_quantized(quant: dict, where: str) -> None:
    """UserError (one sentence) unless `quant` is compressed-tensors' pack-quantized symmetric INT4 by group or channel,
    the form Kimi K2.x is published in."""
    groups = quant.get("config_groups")
    if quant.get("format") != "pack-quantized":
        raise UserError(f"{where}: quantization_config.format {quant.get('format')!r} is not read; only compressed-"
                        "tensors' pack-quantized INT4 (Kimi K2.x as published) is.")
    if not isinstance(groups, dict) or not groups:
        raise UserError(f"{where}: quantization_config.config_groups is missing or empty.")
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict) or (w.get("num_bits"), w.get("type"), w.get("symmetric")) != (4, "int", True) or \
                w.get("strategy") not in ("group", "channel") or group.get("input_activations"):
            raise UserError(f"{where}: quantization_config.config_groups.{name} is not symmetric 4-bit integer weights "
                            "by group or channel with unquantized activations, the only compressed-tensors form read.")


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed int32 [out, ceil(in / 8)], scale [out, groups] -> W [out, in] in `dtype`."""
    rows, cols = shape
    nibbles = packed.contiguous().view(torch.uint8)  # little-endian words: byte j holds codes 2j (low) and 2j + 1
    codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(rows, -1)[:, :cols]
    values = codes.to(torch.float32) - 8.0
    per_group = -(-cols // scale.shape[1])
    return (values * scale.float().repeat_interleave(per_group, dim=1)[:, :cols]).to(dtype)


class PackedInt4Dir(SafetensorsDir):
    """`inner`'s tensors, its pack-quantized weights presented as the bfloat16 weights they stand for (their packed
    parts are not listed)."""

    def __init__(self, inner: SafetensorsDir):
        self.inner, self.directory = inner, inner.directory
        self.packed = {n[: -len("_packed")] for n in inner.names() if n.endswith(".weight_packed")}
        for name in sorted(self.packed):
            for part in PARTS[1:]:
                if name + part not in inner:
                    raise UserError(f"{self.directory}: tensor {name + part!r} is missing beside "
                                    f"{name + '_packed'!r} (quantization_config: pack-quantized).")
        parts = {name + p for name in self.packed for p in PARTS}
        self.files = {n: f for n, f in inner.files.items() if n not in parts}
        self.files |= {name: inner.files[name + "_packed"] for name in self.packed}
        self._shapes: dict[str, tuple[int, int]] = {}

    def names(self) -> list[str]:
        return sorted(self.files)

    def _shape(self, name: str) -> tuple[int, int]:
        if name not in self._shapes:
            rows, cols = (int(v) for v in self.inner.get(name + "_shape").tolist())
            self._shapes[name] = (rows, cols)
        return self._shapes[name]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        if name in self.packed:
            return self._shape(name), "BF16"
        return self.inner.shape_dtype(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self.packed:
            packed = self.inner.get(name + "_packed")
            if packed.dtype != torch.int32:
                raise UserError(f"{self.files[name]}: tensor {name + '_packed'!r} has dtype {packed.dtype}, expected "
                                "int32 (pack-quantized).")
            return dequantize_int4(packed, self.inner.get(name + "_scale"), self._shape(name))
        return self.inner.get(name)
