"""Faithful CPU emulation of quantized linears (ModelOpt unified format) for the torch executor.

Weights are dequantized once at load (e2m1 x block scale x global scale for NVFP4, e4m3 x scale for
FP8), so the weight error is exactly the stored format's. Activations are quantized at every call as
the deployed kernels do: NVFP4 W4A4 quantizes each 16-element block of the input with the calibrated
`input_scale` as global scale; FP8 casts the input scaled by `input_scale` to e4m3. The matmul then runs
in the compute dtype: numerics equal the quantized GEMM up to accumulation order.

gpt-oss's fused experts (quantize/experts.py) are dequantized the same way, and their two inputs quantized as
ModelOpt's `_QuantGptOssExperts` does: one input_scale per projection for all experts, applied to the tokens
before routing (gate_up_proj) and to every expert's gated activations (down_proj).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.models.moe import Experts
from trtllm_dflash.quantize.experts import EXPERT_SCALE_SUFFIXES, dequantize_experts, read_quantized_experts
from trtllm_dflash.quantize.fp8 import FP8Weight, dequantize_fp8, fake_quant_fp8_activation
from trtllm_dflash.quantize.modelopt_cpu import read_quantized_linear
from trtllm_dflash.quantize.nvfp4 import NVFP4Weight, dequantize_nvfp4, fake_quant_nvfp4_activation

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")


class ActivationQuant(nn.Module):
    """Quantize-dequantize an activation as the deployed kernel does with the calibrated `input_scale`."""

    def __init__(self, fmt: Literal["nvfp4", "fp8"], input_scale: torch.Tensor):
        super().__init__()
        self.fmt = fmt
        self.register_buffer("input_scale", input_scale.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():  # the Q/DQ nodes of compile/onnx_ops.py
            ops = torch.ops.dflash_onnx
            return (ops.nvfp4_qdq if self.fmt == "nvfp4" else ops.fp8_qdq)(x, self.input_scale)
        quant = fake_quant_nvfp4_activation if self.fmt == "nvfp4" else fake_quant_fp8_activation
        return quant(x, self.input_scale).to(x.dtype)


class QuantizedInput(nn.Module):
    """Wraps a linear whose weight is already dequantized; quantizes its input like the real kernel.

    For an ONNX export (compile/onnx_export.py) the linear is given its stored weight back
    (`keep_stored_weight`): the graph then holds the FP8 / NVFP4 weight as stored and quantize / dequantize
    nodes (compile/onnx_ops.py) that compute what `forward` computes eagerly."""

    def __init__(self, linear: nn.Linear, fmt: Literal["nvfp4", "fp8"], input_scale: torch.Tensor):
        super().__init__()
        self.linear, self.fmt = linear, fmt
        self.register_buffer("input_scale", input_scale.float(), persistent=False)
        # Set for an export only: FP8 weight [out, in] + scale, or NVFP4 packed weight + block scales + global scale
        for name in ("stored_weight", "stored_weight_scale", "stored_weight_scale_2"):
            self.register_buffer(name, None, persistent=False)

    def keep_stored_weight(self, q: FP8Weight | NVFP4Weight) -> None:
        """Hold the checkpoint's weight as stored (the same values as the dequantized one) for an export."""
        if isinstance(q, NVFP4Weight):  # two E2M1 codes per byte, element 2i in the low nibble: ONNX's packing
            self.stored_weight = q.weight.contiguous().view(torch.float4_e2m1fn_x2)
            self.stored_weight_scale, self.stored_weight_scale_2 = q.weight_scale, q.weight_scale_2.float()
        else:
            self.stored_weight, self.stored_weight_scale = q.weight.contiguous(), q.weight_scale.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            return self._exported(x)
        quant = fake_quant_nvfp4_activation if self.fmt == "nvfp4" else fake_quant_fp8_activation
        return self.linear(quant(x, self.input_scale).to(x.dtype))

    def _exported(self, x: torch.Tensor) -> torch.Tensor:
        if self.stored_weight is None:
            raise ValueError(f"{self.fmt} linears export only with their stored weight (keep_stored_weight)")
        ops = torch.ops.dflash_onnx
        if self.fmt == "nvfp4":
            weight = ops.nvfp4_dequantize(self.stored_weight, self.stored_weight_scale, self.stored_weight_scale_2)
            x = ops.nvfp4_qdq(x, self.input_scale)
        else:
            weight = ops.fp8_dequantize(self.stored_weight, self.stored_weight_scale)
            x = ops.fp8_qdq(x, self.input_scale)
        return F.linear(x, weight.to(x.dtype), self.linear.bias)


def dequantize_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype
                          ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, torch.Tensor]]]:
    """Replace every quantized linear's tensors by a plain `.weight` in `dtype`.

    Fused experts' projections (`...mlp.experts.gate_up_proj` with `..._weight_scale` etc.) become a plain
    [E, K, N] tensor under the same name.
    Returns the plain state dict and {module prefix or expert projection: (format, input_scale)} for
    `quantize_inputs`.
    """
    plain, inputs = {}, {}
    prefixes = {name[: -len(".weight_scale")] for name in state if name.endswith(".weight_scale")}
    experts = {name[: -len("_weight_scale")] for name in state if name.endswith("_weight_scale")}
    for name, tensor in state.items():
        if any(name.endswith(s) for s in SCALE_SUFFIXES) and name.rsplit(".", 1)[0] in prefixes:
            continue
        if any(name.endswith(s) and name[: -len(s)] in experts for s in EXPERT_SCALE_SUFFIXES):
            continue
        if name in experts:
            q = read_quantized_experts(state, name)
            plain[name] = dequantize_experts(q, dtype)
            if q.input_scale is not None:
                inputs[name] = (q.fmt, q.input_scale)
            continue
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix in prefixes:
            q = read_quantized_linear(state, prefix)
            if isinstance(q, NVFP4Weight):
                plain[name] = dequantize_nvfp4(q, torch.float32).to(dtype)
                fmt = "nvfp4"
            else:
                assert isinstance(q, FP8Weight)
                plain[name] = dequantize_fp8(q, torch.float32).to(dtype)
                fmt = "fp8"
            if q.input_scale is not None:
                inputs[prefix] = (fmt, q.input_scale)
        else:
            plain[name] = tensor
    return plain, inputs


def quantize_inputs(model: nn.Module, inputs: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Wrap the listed linears of `model` (by module path) with activation quantization, in place; for an
    experts' projection (`...mlp.experts.gate_up_proj`), quantize that projection's input."""
    for prefix, (fmt, scale) in inputs.items():
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(parent, Experts):
            setattr(parent, f"{child}_input", ActivationQuant(fmt, scale))
        else:
            setattr(parent, child, QuantizedInput(getattr(parent, child), fmt, scale))
