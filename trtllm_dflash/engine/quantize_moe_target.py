"""The build's quantization of a gpt-oss (mixture-of-experts) target: one decoder layer at a time.

What it produces is what ModelOpt's PTQ of the whole model produces (`mtq.quantize` with NVFP4_DEFAULT_CFG /
FP8_DEFAULT_CFG, max calibration, then `export_hf_checkpoint`; tests/test_gpt_oss_quantized.py compares them
tensor for tensor): the attention's q/k/v/o linears and the fused experts (`_QuantGptOssExperts`) quantized,
router, sinks, norms, embedding and lm_head not. The experts keep ModelOpt's exported layout (quantize/experts.py).

Max calibration only records max |x| at each quantizer while the model runs unquantized, so layer i's amaxes
depend only on the unquantized outputs of layers 0..i-1. This module therefore runs transformers' own
`GptOssDecoderLayer` (bf16, eager attention, the masks and RoPE `GptOssModel.forward` makes) on the calibration
prompts' hidden states, one layer at a time, and records at the points where ModelOpt's quantizers sit:

    q/k/v/o_proj            the linear's input
    experts.gate_up_proj    the experts' input, every token before routing (one quantizer for all experts)
    experts.down_proj       the gated activations of every expert (one quantizer for all experts)

and packs with quantize/ (byte-equal to ModelOpt's export) following the export's rules: NVFP4 q/k/v share one
weight_scale_2 and input_scale, each expert projection one weight_scale_2 over all experts.

ModelOpt's own wrappers are not run here: `_QuantGptOssExperts` makes a transposed copy of all of a layer's expert
weights on every forward, which would double the memory this stage is bounded by.

Memory: one layer's weights in bf16 (its HF module), that layer's quantized tensors, one expert's float32 copy
while it is packed, and the calibration hidden states (prompts x tokens x hidden in bf16). Never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

from trtllm_dflash.checkpoint.formats import TargetCheckpoint
from trtllm_dflash.engine.quantize_layers import LayerByLayer
from trtllm_dflash.models.spec import hf_config_from_dict
from trtllm_dflash.quantize.experts import EXPERT_SCALE_SUFFIXES, EXPERT_WEIGHTS, expert_tensors, quantize_experts
from trtllm_dflash.quantize.fp8 import quantize_fp8_weight
from trtllm_dflash.quantize.nvfp4 import E2M1_MAX, E4M3_MAX, quantize_nvfp4_weight

# NVFP4 linears that read the same input share global scales (ModelOpt's export of fused q/k/v).
LINEAR_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",))


class LayerwiseQuantizedTarget(LayerByLayer):
    """The quantized tensors of a gpt-oss target under their HF names, computed a decoder layer at a time (the reading
    order: quantize_layers.LayerByLayer). Names and membership are known without computing anything."""

    def __init__(self, target: TargetCheckpoint, fmt: Literal["nvfp4", "fp8"], batches: list[torch.Tensor]):
        assert target.spec.num_experts, "LayerwiseQuantizedTarget quantizes gpt-oss targets"
        super().__init__(target.spec.num_layers)
        self.target, self.fmt, self.batches = target, fmt, batches
        self.config = hf_config_from_dict(target.hf_config, str(target.directory / "config.json"))
        # What ModelOpt calibrates with: eager attention (transformers' only choice for gpt-oss on CPU) and eager
        # experts (ModelOpt switches transformers' grouped_mm experts to eager to see their matmuls).
        self.config._attn_implementation = self.config._experts_implementation = "eager"
        self.names = [name for i in range(target.spec.num_layers) for name in self.layer_names(i)]
        self._names = set(self.names)
        self.hidden: list[torch.Tensor] = []  # [1, T, hidden] bf16 per calibration prompt: the input of layer done + 1

    def layer_names(self, i: int) -> list[str]:
        linear = (".weight", ".weight_scale", ".weight_scale_2", ".input_scale")
        experts = ("",) + EXPERT_SCALE_SUFFIXES
        if self.fmt == "fp8":  # per-tensor FP8 has no second-level scale
            linear, experts = tuple(s for s in linear if s != ".weight_scale_2"), ("", "_weight_scale", "_input_scale")
        prefix = f"model.layers.{i}."
        return ([f"{prefix}self_attn.{p}{s}" for group in LINEAR_GROUPS for p in group for s in linear]
                + [f"{prefix}mlp.experts.{p}{s}" for p in EXPERT_WEIGHTS for s in experts])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def _embeddings(self) -> list[torch.Tensor]:
        embed = self.target.tensors.get("model.embed_tokens.weight").to(torch.bfloat16)
        return [embed[b[0]][None] for b in self.batches]

    @torch.no_grad()
    def _quantize_layer(self, i: int) -> dict[str, torch.Tensor]:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer  # (~1 s to import)

        if i == 0:
            self.hidden = self._embeddings()
        prefix, bf16 = f"model.layers.{i}.", torch.bfloat16
        with torch.device("meta"):
            layer = GptOssDecoderLayer(self.config, i)
        layer.load_state_dict({n: self.target.tensors.get(prefix + n).to(bf16) for n in layer.state_dict()},
                              assign=True)
        amax = self._calibrate(layer.eval(), i)

        out: dict[str, torch.Tensor] = {}
        attn = layer.self_attn
        for group in LINEAR_GROUPS:
            weights = {p: getattr(attn, p).weight for p in group}
            weight_amax = torch.stack([w.abs().amax().float() for w in weights.values()]).amax()
            input_amax = torch.stack([amax[p] for p in group]).amax()
            for p, w in weights.items():
                name = f"{prefix}self_attn.{p}"
                if self.fmt == "nvfp4":
                    q = quantize_nvfp4_weight(w, weight_amax)
                    out |= {f"{name}.weight": q.weight, f"{name}.weight_scale": q.weight_scale,
                            f"{name}.weight_scale_2": q.weight_scale_2,
                            f"{name}.input_scale": input_amax / (E2M1_MAX * E4M3_MAX)}
                else:  # (FP8: each linear its own weight scale, divided in bf16 as ModelOpt does for 2-D weights)
                    q = quantize_fp8_weight(w)
                    out |= {f"{name}.weight": q.weight, f"{name}.weight_scale": q.weight_scale,
                            f"{name}.input_scale": amax[p] / E4M3_MAX}
        for p in EXPERT_WEIGHTS:
            out |= expert_tensors(f"{prefix}mlp.experts.{p}",
                                  quantize_experts(getattr(layer.mlp.experts, p), self.fmt, amax[p]))
            setattr(layer.mlp.experts, p, None)  # (free the bf16 weights as soon as they are packed)
        return out

    def _calibrate(self, layer: torch.nn.Module, i: int) -> dict[str, torch.Tensor]:
        """Run layer i (a GptOssDecoderLayer) on self.hidden, which becomes its outputs; returns max |input| at
        each quantizer's place."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

        amax: dict[str, torch.Tensor] = {}

        def record(key: str, x: torch.Tensor) -> None:
            m = x.detach().abs().amax().float()
            amax[key] = torch.maximum(amax[key], m) if key in amax else m

        hooks = [getattr(layer.self_attn, p).register_forward_pre_hook(
            lambda _, args, p=p: record(p, args[0])) for group in LINEAR_GROUPS for p in group]
        experts = layer.mlp.experts
        hooks.append(experts.register_forward_pre_hook(lambda _, args: record("gate_up_proj", args[0])))
        gate = experts._apply_gate

        def recorded_gate(gate_up: torch.Tensor) -> torch.Tensor:
            gated = gate(gate_up)  # the left operand of `@ down_proj[e]`
            record("down_proj", gated)
            return gated

        experts._apply_gate = recorded_gate
        make_mask = create_sliding_window_causal_mask if self.config.layer_types[i] == "sliding_attention" \
            else create_causal_mask
        rotary = GptOssRotaryEmbedding(self.config)
        try:
            for k, h in enumerate(self.hidden):  # as GptOssModel.forward runs one layer
                positions = torch.arange(h.shape[1])[None]
                mask = make_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None)
                self.hidden[k] = layer(h, attention_mask=mask, position_ids=positions,
                                       position_embeddings=rotary(h, positions))
        finally:
            for hook in hooks:
                hook.remove()
        return amax
