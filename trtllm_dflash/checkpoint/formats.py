"""Checkpoint formats: HF decoder directories (targets) and z-lab DFlash drafters, plus pair validation.
Drafters in vLLM's speculators format are read by checkpoint/speculators.py into the same DrafterCheckpoint.

Tensor names and shapes are stated declaratively (`target_tensor_shapes`, `drafter_tensor_shapes`);
loading checks a checkpoint against them before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trtllm_dflash.checkpoint.fp8_blocks import FP8BlockDir
from trtllm_dflash.checkpoint.int4_packed import PackedInt4Dir, check_pack_quantized
from trtllm_dflash.checkpoint.mxfp4 import BLOCK as MXFP4_BLOCK
from trtllm_dflash.checkpoint.mxfp4 import MXFP4Dir
from trtllm_dflash.checkpoint.tensors import RenamedSafetensorsDir, SafetensorsDir, check_tensors, save_safetensors
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import read_json_object, require_dir
from trtllm_dflash.models.spec import (
    MULTIMODAL,
    DecoderSpec,
    DFlash2Params,
    DFlashParams,
    build_target_layer_ids,
    hf_config_from_dict,
)

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


def _layer_shapes(spec: DecoderSpec, prefix: str, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Tensors of decoder layer `layer` (Gemma 4 layers differ by type: `DecoderSpec.layer_spec`)."""
    spec = spec.layer_spec(layer)
    h, hd, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if spec.qk_norm:
        shapes |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if spec.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                   "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (h,)}
    if spec.attention_k_eq_v:  # V is the k_proj output
        shapes = {name: shape for name, shape in shapes.items() if not name.startswith("self_attn.v_proj.")}
    if spec.is_gemma4:
        shapes |= {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
                   "layer_scalar": (1,)}
    if spec.mlp_bias:
        shapes |= {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)}
    if spec.is_mla:  # DeepSeek-V3 / Kimi K2: latent attention instead (models/mla.py)
        shapes = {name: shape for name, shape in shapes.items() if not name.startswith("self_attn.")}
        shapes |= {f"self_attn.{name}": shape for name, shape in _latent_attention_shapes(spec).items()}
    if spec.is_qwen3_5:  # q_proj: each head's query and output gate
        shapes["self_attn.q_proj.weight"] = (2 * q, h)
    if spec.is_linear(layer):  # Qwen3.5's Gated DeltaNet instead of attention
        shapes = {name: shape for name, shape in shapes.items() if not name.startswith("self_attn.")}
        shapes |= {f"linear_attn.{name}": shape for name, shape in _linear_attention_shapes(spec).items()}
    if spec.is_sparse(layer):  # Qwen3 MoE: a router and SwiGLU experts stored one by one
        shapes = {name: shape for name, shape in shapes.items() if not name.startswith("mlp.")}
        e, m = spec.routed_experts, spec.moe_intermediate_size
        shapes["mlp.gate.weight"] = (e, h)
        for x in range(e):
            shapes |= {f"mlp.experts.{x}.gate_proj.weight": (m, h), f"mlp.experts.{x}.up_proj.weight": (m, h),
                       f"mlp.experts.{x}.down_proj.weight": (h, m)}
        if spec.n_shared_experts:  # DeepSeek-V3: the router's choice bias, the shared experts as one MLP
            w = spec.n_shared_experts * m
            shapes |= {"mlp.gate.e_score_correction_bias": (e,), "mlp.shared_experts.gate_proj.weight": (w, h),
                       "mlp.shared_experts.up_proj.weight": (w, h), "mlp.shared_experts.down_proj.weight": (h, w)}
        if spec.shared_expert:  # Qwen3.5 MoE
            shapes |= {"mlp.shared_expert.gate_proj.weight": (i, h), "mlp.shared_expert.up_proj.weight": (i, h),
                       "mlp.shared_expert.down_proj.weight": (h, i), "mlp.shared_expert_gate.weight": (1, h)}
    return {f"{prefix}{name}": shape for name, shape in shapes.items()}


def _latent_attention_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """A multi-head latent attention's tensors (transformers' DeepseekV3Attention)."""
    h, heads, r, rope = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.head_dim
    q = heads * (spec.qk_nope_head_dim + rope)
    shapes = ({"q_a_proj.weight": (spec.q_lora_rank, h), "q_a_layernorm.weight": (spec.q_lora_rank,),
               "q_b_proj.weight": (q, spec.q_lora_rank)} if spec.q_lora_rank else {"q_proj.weight": (q, h)})
    shapes |= {"kv_a_proj_with_mqa.weight": (r + rope, h), "kv_a_layernorm.weight": (r,),
               "kv_b_proj.weight": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), r),
               "o_proj.weight": (h, heads * spec.v_head_dim)}
    if spec.attention_bias:
        shapes |= {"q_a_proj.bias": (spec.q_lora_rank,)} if spec.q_lora_rank else {}
        shapes |= {"kv_a_proj_with_mqa.bias": (r + rope,), "o_proj.bias": (h,)}
    return shapes


def _linear_attention_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (transformers' Qwen3_5GatedDeltaNet)."""
    h, nv, dv = spec.hidden_size, spec.linear_num_value_heads, spec.linear_value_head_dim
    channels = 2 * spec.linear_num_key_heads * spec.linear_key_head_dim + nv * dv
    return {"in_proj_qkv.weight": (channels, h), "in_proj_z.weight": (nv * dv, h), "in_proj_b.weight": (nv, h),
            "in_proj_a.weight": (nv, h), "conv1d.weight": (channels, 1, spec.linear_conv_kernel), "dt_bias": (nv,),
            "A_log": (nv,), "norm.weight": (dv,), "out_proj.weight": (h, nv * dv)}


def expert_weight_shapes(spec: DecoderSpec) -> dict[str, tuple[int, int, int]]:
    """HF names -> shapes of the MoE expert weights (applied as x @ W; gate/up columns interleaved)."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    shapes: dict[str, tuple[int, int, int]] = {}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        shapes |= {prefix + "gate_up_proj": (e, h, 2 * i), prefix + "down_proj": (e, i, h)}
    return shapes


def _moe_layer_shapes(spec: DecoderSpec, prefix: str, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """gpt-oss: the attention tensors of `_layer_shapes` plus per-head sinks; a router and experts as the MLP."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    shapes = {name: shape for name, shape in _layer_shapes(spec, prefix).items() if ".mlp." not in name}
    return shapes | {
        f"{prefix}self_attn.sinks": (spec.num_heads,),
        f"{prefix}mlp.router.weight": (e, h),
        f"{prefix}mlp.router.bias": (e,),
        f"{prefix}mlp.experts.gate_up_proj": (e, h, 2 * i),
        f"{prefix}mlp.experts.gate_up_proj_bias": (e, 2 * i),
        f"{prefix}mlp.experts.down_proj": (e, i, h),
        f"{prefix}mlp.experts.down_proj_bias": (e, h),
    }


def target_tensor_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """HF names of a Llama / Qwen3 / gpt-oss / Gemma 4 causal LM's tensors -> shapes (gpt-oss experts
    dequantized; a multimodal Gemma 4 directory's text weights renamed from `model.language_model.`)."""
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    layer_shapes = _moe_layer_shapes if spec.num_experts else _layer_shapes
    for i in range(spec.num_layers):
        shapes |= layer_shapes(spec, f"model.layers.{i}.", i)
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


# A drafter with its own lm_head (speculators format, checkpoint/speculators.py): its [draft_vocab_size, hidden]
# weight, and with a pruned vocabulary the int64 offsets d2t [draft_vocab_size] (target id = draft id + d2t).
# Not named `lm_head.weight`: that name is the target's, split over the vocabulary under tensor parallelism,
# while these are replicated.
DRAFT_LM_HEAD, D2T = "draft_lm_head.weight", "d2t"


def drafter_tensor_shapes(spec: DecoderSpec, params: DFlashParams,
                          draft_vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """z-lab DFlash drafter tensors -> shapes (58 tensors for 5 layers; no embedding, no lm_head; DFlash2: 4 more per
    layer and 3 of the selector), plus DRAFT_LM_HEAD when the drafter has its own lm_head of `draft_vocab_size` rows."""
    h = spec.hidden_size
    shapes = {"fc.weight": (h, len(params.target_layer_ids) * h), "hidden_norm.weight": (h,)}
    for i in range(spec.num_layers):
        shapes |= _layer_shapes(spec, f"layers.{i}.")
    shapes["norm.weight"] = (h,)
    if (d2 := params.dflash2) is not None:
        taps, groups = d2.conv_kernel_size, h // d2.conv_group_size
        for i in range(spec.num_layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, h)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
        shapes |= {"candidate_selector.hidden_projection.weight": (d2.selector_rank, h),
                   "candidate_selector.predecessor_codebook": (spec.vocab_size, d2.selector_rank),
                   "candidate_selector.successor_codebook": (spec.vocab_size, d2.selector_rank)}
    if draft_vocab_size is not None:
        shapes[DRAFT_LM_HEAD] = (draft_vocab_size, h)
    return shapes


@dataclass(frozen=True)
class TargetCheckpoint:
    directory: Path
    hf_config: dict  # config.json as read
    spec: DecoderSpec
    tensors: SafetensorsDir
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class DrafterCheckpoint:
    directory: Path
    hf_config: dict
    spec: DecoderSpec
    params: DFlashParams
    num_target_layers: int | None  # `num_target_layers` if the config states it
    tensors: SafetensorsDir  # under our (z-lab) names, whatever the format's
    format: str = "z-lab"  # or "speculators"
    draft_vocab_size: int | None = None  # rows of the drafter's own lm_head; None: it uses the target's

    @property
    def maps_vocab(self) -> bool:
        """Its own lm_head covers a pruned vocabulary, so drafts go through d2t to become target ids."""
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.spec.vocab_size

    def engine_tensor_names(self) -> list[str]:
        """The drafter tensors an engine keeps, under our names."""
        names = list(drafter_tensor_shapes(self.spec, self.params, self.draft_vocab_size))
        return names + [D2T] if self.maps_vocab else names


def _spec_from(raw: dict, config_path: Path) -> DecoderSpec:
    multimodal = raw.get("model_type") in MULTIMODAL  # (its text_config holds the fields)
    fields = raw.get("text_config") if multimodal else raw
    width = ("shared_expert_intermediate_size" if raw.get("model_type") in ("qwen3_5_moe", "qwen3_5_moe_text")
             else "intermediate_size")  # (Qwen3.5 MoE has no dense MLP)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", width, "vocab_size")
    for key in required:
        if not isinstance(fields, dict) or key not in fields:
            raise UserError(f"{config_path}: field {'text_config.' if multimodal else ''}{key!r} is missing.")
    try:
        spec = DecoderSpec.from_hf(hf_config_from_dict(raw, str(config_path)))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{config_path}: invalid config ({exc}).") from None
    if spec.num_heads % spec.num_kv_heads:
        raise UserError(
            f"{config_path}: num_attention_heads {spec.num_heads} is not a multiple of "
            f"num_key_value_heads {spec.num_kv_heads}."
        )
    if spec.num_global_kv_heads and spec.num_heads % spec.num_global_kv_heads:
        raise UserError(
            f"{config_path}: num_attention_heads {spec.num_heads} is not a multiple of "
            f"num_global_key_value_heads {spec.num_global_kv_heads}."
        )
    if spec.head_dim % 2:
        raise UserError(f"{config_path}: head_dim {spec.head_dim} must be even for rotary embeddings.")
    return spec


def _eos_ids(*values) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


# A multimodal Gemma 4 / Qwen3.5 directory (Gemma4ForConditionalGeneration, Qwen3_5ForConditionalGeneration) stores
# its text model under this prefix (and the lm_head, when not tied, as a causal LM does); its vision / audio towers
# and Qwen3.5's multi-token-prediction head (`mtp.`) are not read.
MULTIMODAL_TEXT_PREFIXES = {"model.language_model.": "model.", "lm_head.": "lm_head.",
                            # (Kimi K2.5 / K2.6 as published; transformers renames them as above when it loads them)
                            "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}


def _target_tensors(directory: Path, raw: dict, spec: DecoderSpec, config_path: Path) -> SafetensorsDir:
    """The target's tensors under their HF names; a published MXFP4 gpt-oss checkpoint's experts, a DeepSeek-V3
    checkpoint's FP8 blocks and a Kimi K2.x checkpoint's INT4 experts dequantized."""
    quant = raw.get("quantization_config")
    int4 = spec.is_mla and isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors"
    if int4:  # Kimi K2.x as published
        check_pack_quantized(quant, str(config_path))
    if raw.get("model_type") in MULTIMODAL:
        store = RenamedSafetensorsDir(directory, MULTIMODAL_TEXT_PREFIXES)
        if int4:
            return PackedInt4Dir(store)
        if isinstance(quant, dict):
            raise UserError(f"{config_path}: quantized {raw['model_type']} checkpoints (quantization_config) are not "
                            "supported; use the bfloat16 checkpoint.")
        return store
    if int4:
        return PackedInt4Dir(SafetensorsDir(directory))
    if spec.is_mla and isinstance(quant, dict) and quant.get("quant_method") == "fp8":  # DeepSeek-V3 as published
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise UserError(f"{config_path}: quantization_config.weight_block_size {block!r} must be two positive "
                            "integers (DeepSeek-V3's FP8 blocks: [128, 128]).")
        return FP8BlockDir(directory, (block[0], block[1]))
    if (spec.is_qwen3_5 or spec.is_mla) and isinstance(quant, dict):
        read = (", DeepSeek-V3 FP8 blocks (quant_method fp8) or Kimi K2.x INT4 (compressed-tensors)" if spec.is_mla
                else "")
        raise UserError(f"{config_path}: quantized {spec.model_type} checkpoints (quantization_config "
                        f"{quant.get('quant_method')!r}) are not supported yet; use a bfloat16 checkpoint{read}.")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not spec.num_experts or method is None:
        return SafetensorsDir(directory)
    if method != "mxfp4":
        raise UserError(f"{config_path}: quantization_config.quant_method {method!r} is not supported for "
                        "gpt-oss targets; supported: mxfp4 (the published checkpoints) or an unquantized checkpoint.")
    for field, n in (("hidden_size", spec.hidden_size), ("intermediate_size", spec.intermediate_size)):
        if n % MXFP4_BLOCK:
            raise UserError(f"{config_path}: {field} {n} is not a multiple of the MXFP4 block {MXFP4_BLOCK}.")
    return MXFP4Dir(directory, expert_weight_shapes(spec))


def load_target(directory: Path) -> TargetCheckpoint:
    """Read config.json, generation_config.json and the safetensors headers (tensors: `load_pair`)."""
    directory = Path(directory)
    require_dir(directory, "target checkpoint directory")
    config_path = directory / "config.json"
    raw = read_json_object(config_path, "target config.json")
    spec = _spec_from(raw, config_path)
    tensors = _target_tensors(directory, raw, spec, config_path)
    gen_path = directory / "generation_config.json"
    gen = read_json_object(gen_path, "generation_config.json") if gen_path.exists() else {}
    eos = _eos_ids(gen.get("eos_token_id"), raw.get("eos_token_id"))
    return TargetCheckpoint(directory, raw, spec, tensors, eos)


def parse_dflash2(fields: dict, raw: dict, config_path: Path, prefix: str, spec: DecoderSpec,
                  block_size: int) -> DFlash2Params:
    """A DFlash2 drafter's convolution and selector settings from `fields` (z-lab: dflash_config, speculators: the top
    level; `prefix` names it in messages), its logit scalars from there or the top level of `raw`; one sentence per
    bad value."""
    values = {}
    for key, default in (("conv_kernel_size", 2), ("conv_group_size", 16), ("selector_rank", 256),
                         ("selector_top_k", 16)):
        value = fields.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{config_path}: field '{prefix}{key}' must be a positive integer, got {value!r}.")
        values[key] = value
    for key, default in (("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        value = fields.get(key, raw.get(key, default))
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not 0 < value < float("inf")):
            raise UserError(f"{config_path}: field '{prefix}{key}' must be a positive number, got {value!r}.")
        values[key] = None if value is None else float(value)
    d2 = DFlash2Params(**values)
    if spec.hidden_size % d2.conv_group_size:
        raise UserError(f"{config_path}: field '{prefix}conv_group_size' {d2.conv_group_size} does not divide "
                        f"hidden_size {spec.hidden_size}.")
    if d2.conv_kernel_size > block_size:
        raise UserError(f"{config_path}: field '{prefix}conv_kernel_size' {d2.conv_kernel_size} is more taps than the "
                        f"block has tokens (block_size {block_size}).")
    if d2.selector_top_k > spec.vocab_size:
        raise UserError(f"{config_path}: field '{prefix}selector_top_k' {d2.selector_top_k} is more candidates than "
                        f"the vocabulary has tokens (vocab_size {spec.vocab_size}).")
    return d2


def parse_drafter_config(raw: dict, config_path: Path) -> tuple[DecoderSpec, DFlashParams, int | None]:
    archs = raw.get("architectures") or []
    if DRAFTER_ARCHITECTURE not in archs and DFLASH2_ARCHITECTURE not in archs:
        raise UserError(
            f"{config_path}: field 'architectures' is {archs!r}, expected [{DRAFTER_ARCHITECTURE!r}] "
            f"or [{DFLASH2_ARCHITECTURE!r}] (a z-lab DFlash or DFlash2 drafter)."
        )
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise UserError(f"{config_path}: field 'dflash_config' is missing or not an object.")
    # Qwen3.5+ drafters move block_size inside dflash_config.
    block_size = raw.get("block_size", dflash.get("block_size"))
    if not isinstance(block_size, int):
        raise UserError(f"{config_path}: field 'block_size' is missing or not an integer (got {block_size!r}).")
    mask_token_id = dflash.get("mask_token_id")
    if not isinstance(mask_token_id, int):
        raise UserError(
            f"{config_path}: field 'dflash_config.mask_token_id' is missing or not an integer (got {mask_token_id!r})."
        )
    num_target_layers = raw.get("num_target_layers")
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        if not isinstance(num_target_layers, int):
            raise UserError(
                f"{config_path}: neither 'dflash_config.target_layer_ids' nor 'num_target_layers' is set."
            )
        layer_ids = build_target_layer_ids(num_target_layers, raw.get("num_hidden_layers", 1))
    if not (isinstance(layer_ids, list) and layer_ids and all(isinstance(i, int) for i in layer_ids)):
        raise UserError(
            f"{config_path}: field 'dflash_config.target_layer_ids' must be a non-empty list of integers, got {layer_ids!r}."
        )
    if block_size < 2:
        raise UserError(f"{config_path}: field 'block_size' is {block_size}, but a DFlash block needs at least 2 tokens.")
    # The reference drafter is built from Qwen3 layers whatever its target (q_norm/k_norm always present).
    # Its block embeddings are the target's raw rows times dflash_config.input_embedding_scale (or the top-level
    # key, as the reference's _draft_value reads it).
    scale = dflash.get("input_embedding_scale", raw.get("input_embedding_scale", 1.0))
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale < float("inf"):
        raise UserError(f"{config_path}: field 'dflash_config.input_embedding_scale' must be a positive number, "
                        f"got {scale!r}.")
    raw = {**raw, "model_type": "qwen3", "input_embedding_scale": float(scale)}
    spec = dataclasses.replace(_spec_from(raw, config_path), qk_norm=True)
    dflash2 = (parse_dflash2(dflash, raw, config_path, "dflash_config.", spec, block_size)
               if DFLASH2_ARCHITECTURE in archs else None)
    params = DFlashParams(block_size, mask_token_id, tuple(layer_ids), dflash2)
    return spec, params, num_target_layers if isinstance(num_target_layers, int) else None


def load_drafter(directory: Path) -> DrafterCheckpoint:
    """A z-lab drafter, or a speculators one (its config.json has `speculators_model_type`)."""
    from trtllm_dflash.checkpoint import speculators  # (it builds on this module)

    directory = Path(directory)
    require_dir(directory, "drafter checkpoint directory")
    config_path = directory / "config.json"
    raw = read_json_object(config_path, "drafter config.json")
    if speculators.is_speculators_config(raw):
        return speculators.load_speculators_drafter(directory, raw, config_path)
    spec, params, num_target_layers = parse_drafter_config(raw, config_path)
    tensors = SafetensorsDir(directory)
    return DrafterCheckpoint(directory, raw, spec, params, num_target_layers, tensors)


# How each drafter format names the DFlash fields in config.json, and its layer ids' offset from z-lab's.
_DFLASH_FIELDS = {"z-lab": ("dflash_config.mask_token_id", "dflash_config.target_layer_ids", 0),
                  "speculators": ("mask_token_id", "aux_hidden_state_layer_ids", 1)}


def validate_pair(target: TargetCheckpoint, drafter: DrafterCheckpoint, max_seq_len: int | None = None) -> None:
    """Everything that must hold for this drafter to run on this target (in an engine of `max_seq_len` positions, when
    given); one sentence per failure."""
    t, d, p = target.spec, drafter.spec, drafter.params
    dcfg = drafter.directory / "config.json"
    mask_field, ids_field, id_offset = _DFLASH_FIELDS[drafter.format]
    if d.hidden_size != t.hidden_size:
        raise UserError(
            f"{dcfg}: hidden_size is {d.hidden_size} but the target's hidden_size is {t.hidden_size}; "
            "a DFlash drafter must match its target."
        )
    if d.vocab_size != t.vocab_size:
        raise UserError(
            f"{dcfg}: vocab_size is {d.vocab_size} but the target's vocab_size is {t.vocab_size}; "
            "the drafter shares the target's embedding and lm_head."
        )
    if not 0 <= p.mask_token_id < t.vocab_size:
        raise UserError(
            f"{dcfg}: {mask_field} {p.mask_token_id} is not a row of the target embedding "
            f"(vocab_size {t.vocab_size})."
        )
    bad = [i + id_offset for i in p.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise UserError(
            f"{dcfg}: {ids_field} {[i + id_offset for i in p.target_layer_ids]} has {bad} outside the "
            f"target's decoder layers {id_offset}..{t.num_layers - 1 + id_offset} (num_hidden_layers {t.num_layers})."
        )
    if drafter.num_target_layers is not None and drafter.num_target_layers != t.num_layers:
        raise UserError(
            f"{dcfg}: num_target_layers is {drafter.num_target_layers} but the target has "
            f"num_hidden_layers {t.num_layers}; this drafter was trained for another target."
        )
    if (d2 := p.dflash2) is not None:
        if d2.final_logit_softcapping is not None and t.final_logit_softcapping is not None:
            raise UserError(f"{dcfg}: final_logit_softcapping {d2.final_logit_softcapping} caps the drafter's logits, "
                            f"and the target caps its own ({t.final_logit_softcapping}); whether a DFlash2 drafter "
                            "caps them again is not settled, so the pair is refused.")
    window = drafter.hf_config.get("sliding_window")
    if "sliding_attention" in (drafter.hf_config.get("layer_types") or []) and window is not None:
        # The z-lab reference keeps such layers non-causal, vLLM / SpecForge make them causal within the block; a
        # config that says is_causal: false settles it, and a window that covers every position of the engine never
        # hides a key, so the layers attend exactly as full-attention ones (docs/algorithm.md §Sliding-window drafters).
        covered = (isinstance(window, int) and max_seq_len is not None
                   and max_seq_len + p.block_size <= window)
        if not covered or drafter.hf_config.get("is_causal") is not False:
            where = (f"max_seq_len {max_seq_len} + block_size {p.block_size} = {max_seq_len + p.block_size}"
                     if max_seq_len is not None else "an engine's max_seq_len + block_size")
            raise UserError(f"{dcfg}: layer_types has sliding_attention layers (sliding_window {window}); such a "
                            f"drafter runs only where its window covers every position ({where} must be at most "
                            f"{window}) and its config says is_causal: false (it says "
                            f"{drafter.hf_config.get('is_causal', 'nothing')}), where it attends as a full-attention "
                            "one.")


# Who reads a target_layer_id equal to the target's last layer differently from the z-lab reference and us
# (transformers' output_hidden_states[L]: the last layer's output after the final norm). docs/interop.md.
LAST_LAYER_READERS = (
    "vLLM and TensorRT-LLM capture it before the final norm (not the feature the drafter was trained on, so they "
    "accept fewer of its drafts), stock llama.cpp's graph does not expose it, SGLang reports failing to capture "
    "it (sgl-project/sglang#32204), and speculators' converter drops it")


def last_layer_warning(target: TargetCheckpoint, drafter: DrafterCheckpoint) -> str | None:
    """One sentence when the drafter reads the target's last decoder layer, else None.

    Warned, not refused: the pair is valid and runs exactly as the reference in this engine, and decoding stays
    lossless in every engine; what breaks is acceptance elsewhere. Drafters made by `train-drafter`'s defaults
    (and published ones) read layers 1 .. L-3 only."""
    last = target.spec.num_layers - 1
    if last not in drafter.params.target_layer_ids:
        return None
    _, ids_field, offset = _DFLASH_FIELDS[drafter.format]
    return (f"{drafter.directory / 'config.json'}: {ids_field} {[i + offset for i in drafter.params.target_layer_ids]} "
            f"reads the target's last layer ({last + offset}, of num_hidden_layers {target.spec.num_layers}), which "
            f"this engine and the z-lab reference take after the final norm; {LAST_LAYER_READERS}. Retrain with "
            "train-drafter's default layer ids (1 .. L-3) to move the drafter between engines.")


def load_pair(target_dir: Path, drafter_dir: Path, warn: Callable[[str], None] | None = None,
              max_seq_len: int | None = None) -> tuple[TargetCheckpoint, DrafterCheckpoint]:
    """Load both checkpoints, validate the pair from their configs (for an engine of `max_seq_len` positions, when
    given), then check every tensor's shape. `warn` receives the pair's portability warnings (last_layer_warning)."""
    from trtllm_dflash.checkpoint.speculators import share_target_vocab

    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    validate_pair(target, drafter, max_seq_len)
    if drafter.spec.layer_types is not None or drafter.spec.sliding_window is not None:
        # (a sliding-window drafter whose window covers the engine: full attention, exactly)
        drafter = dataclasses.replace(drafter, spec=dataclasses.replace(drafter.spec, layer_types=None,
                                                                         sliding_window=None))
    if warn is not None and (message := last_layer_warning(target, drafter)) is not None:
        warn(message)
    check_tensors(target.tensors, target_tensor_shapes(target.spec), "target")
    if drafter.format == "speculators":
        drafter = share_target_vocab(target, drafter)
        if drafter.params.dflash2 is not None and drafter.draft_vocab_size is not None:
            raise UserError(f"{drafter.directory}: tensor 'lm_head.weight' differs from the target's lm_head; a DFlash2 "
                            "drafter's candidate selector ranks the target's own logits.")
    check_tensors(drafter.tensors, drafter_tensor_shapes(drafter.spec, drafter.params, drafter.draft_vocab_size),
                  "drafter")
    return target, drafter


def save_drafter(directory: Path, spec: DecoderSpec, params: DFlashParams, num_target_layers: int,
                 state_dict: dict, dtype: str) -> None:
    """Write a drafter in the z-lab format (config.json + model.safetensors) that `load_drafter` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = spec.to_hf_dict()
    scale = {"input_embedding_scale": fields.pop("input_embedding_scale")} if "input_embedding_scale" in fields else {}
    d2 = {} if params.dflash2 is None else {k: v for k, v in dataclasses.asdict(params.dflash2).items()
                                            if v is not None}
    config = {
        "architectures": [DRAFTER_ARCHITECTURE if params.dflash2 is None else DFLASH2_ARCHITECTURE],
        **fields,
        "model_type": "qwen3",
        "block_size": params.block_size,
        "dflash_config": {"mask_token_id": params.mask_token_id,
                          "target_layer_ids": list(params.target_layer_ids), **scale, **d2},
        "num_target_layers": num_target_layers,
        "layer_types": ["full_attention"] * spec.num_layers,
        "dtype": dtype,
    }
    expected = drafter_tensor_shapes(spec, params)
    tensors = {name: state_dict[name].detach().to(getattr(torch, dtype)).contiguous() for name in expected}
    save_safetensors(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
