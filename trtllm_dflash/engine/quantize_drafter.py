"""The build's drafter quantization (`quantize_drafter: true`): ModelOpt PTQ of the drafter's linears.

ModelOpt inserts quantizers into the drafter's nn.Linear layers (NVFP4_DEFAULT_CFG / FP8_DEFAULT_CFG, max
calibration) and calibrates them while the drafter drafts for real: the calibration prompts are decoded
with DFlash by the unquantized target and drafter (bfloat16), so every drafter linear, fc included, sees
the activations it sees at inference.

ModelOpt's HF export only writes transformers models, and the z-lab drafter is not one, so the
calibrated linears are packed here with quantize/ (whose packing is byte-equal to ModelOpt's export,
tests/test_quantize.py) following the export's rules: for NVFP4, q/k/v and gate/up share one
weight_scale_2 and one input_scale (the max over the group); for FP8 every linear keeps its own.
"""

from __future__ import annotations

import re
from typing import Literal

import torch

from trtllm_dflash.checkpoint.formats import DrafterCheckpoint, TargetCheckpoint
from trtllm_dflash.models.drafter import DFlashDrafter
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.quantize.fp8 import quantize_fp8_weight
from trtllm_dflash.quantize.modelopt_cpu import calibrate_module
from trtllm_dflash.quantize.nvfp4 import E2M1_MAX, E4M3_MAX, quantize_nvfp4_weight
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import TorchExecutor

CALIBRATION_NEW_TOKENS = 32  # drafted continuation per calibration prompt


def _group(name: str, fmt: str) -> str:
    """Linears that share global scales (NVFP4: a layer's q/k/v, and its gate/up)."""
    if fmt != "nvfp4":
        return name
    return re.sub(r"self_attn\.[qkv]_proj$", "self_attn.qkv", re.sub(r"mlp\.(gate|up)_proj$", "mlp.gate_up", name))


def quantize_drafter(target: TargetCheckpoint, drafter: DrafterCheckpoint, fmt: Literal["nvfp4", "fp8"],
                     batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Calibrate with ModelOpt during DFlash decoding of `batches`; returns the drafter's quantized linears
    in ModelOpt's unified format under z-lab names (`<linear>.weight`, `.weight_scale`, ...)."""
    bf16 = torch.bfloat16
    target_model = TargetModel.from_state_dict(target.spec,
                                               {n: target.tensors.get(n).to(bf16) for n in target.tensors.names()})
    model = DFlashDrafter.from_state_dict(drafter.spec, drafter.params,
                                          {n: drafter.tensors.get(n).to(bf16) for n in drafter.tensors.names()})
    prompts = [b[0].tolist() for b in batches]
    max_seq_len = max(map(len, prompts)) + CALIBRATION_NEW_TOKENS

    def forward_loop(m: DFlashDrafter) -> None:
        executor = TorchExecutor(target_model, m, num_slots=min(8, len(prompts)), max_seq_len=max_seq_len)
        requests = [Request(i, ids, CALIBRATION_NEW_TOKENS) for i, ids in enumerate(prompts)]
        for _ in Decoder.for_mode(executor, "dflash", stop_token_ids=()).generate(requests):
            pass

    calibrate_module(model, fmt, forward_loop)

    linears = {name: m for name, m in model.named_modules()
               if hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled}
    groups: dict[str, list[str]] = {}
    for name in linears:
        groups.setdefault(_group(name, fmt), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for members in groups.values():
        weight_amax = torch.stack([linears[n].weight.detach().float().abs().amax() for n in members]).amax()
        input_amax = torch.stack([linears[n].input_quantizer.amax.float().reshape(()) for n in members]).amax()
        for name in members:
            w = linears[name].weight.detach().float()
            if fmt == "nvfp4":
                q = quantize_nvfp4_weight(w, weight_amax)
                out |= {f"{name}.weight": q.weight, f"{name}.weight_scale": q.weight_scale,
                        f"{name}.weight_scale_2": q.weight_scale_2,
                        f"{name}.input_scale": (input_amax / (E2M1_MAX * E4M3_MAX)).float()}
            else:
                q = quantize_fp8_weight(w)
                out |= {f"{name}.weight": q.weight, f"{name}.weight_scale": q.weight_scale,
                        f"{name}.input_scale": input_amax / E4M3_MAX}  # (FP8 groups are single linears)
    return out
