"""Typed architecture descriptions of the target decoder and the DFlash drafter.

Both are read from Hugging Face `config.json` dicts. Transformers' own config classes normalise the
fields (e.g. legacy `rope_theta` / `rope_scaling` into `rope_parameters`), and its RoPE initialisers
compute the inverse frequencies, so our RoPE equals HF's for every rope type it supports.

Qwen3 MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B) is Qwen3 attention with a sparse MLP
in every layer but those `mlp_only_layers` / `decoder_sparse_step` leave dense: a router without bias
(`mlp.gate`), a softmax over all experts, the top k renormalized when `norm_topk_prob`, and experts that are SwiGLU
MLPs of `moe_intermediate_size` stored one by one (`mlp.experts.{e}.gate_proj` ...), as the published checkpoints
and transformers' `save_pretrained` write them (models/moe.py `SparseMoE`).

Gemma 4 (`gemma4_text`, or the text part of a `gemma4` multimodal directory) is supported in its dense shape
(the 31B): per-layer-type attention (sliding layers: head_dim / num_key_value_heads and one RoPE; full layers:
global_head_dim / num_global_key_value_heads, V = K's projection when attention_k_eq_v, and another RoPE),
which `DecoderSpec.layer_spec(i)` resolves into a plain per-layer spec.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from transformers import (
    DeepseekV3Config,
    Gemma4TextConfig,
    GptOssConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from trtllm_dflash.errors import UserError

# model_type -> (HF config class, family has per-head q_norm/k_norm)
FAMILIES: dict[str, tuple[type[PretrainedConfig], bool]] = {
    "qwen3": (Qwen3Config, True),
    "qwen3_moe": (Qwen3MoeConfig, True),  # Qwen3 attention, sparse MLPs of routed SwiGLU experts
    "llama": (LlamaConfig, False),
    "gpt_oss": (GptOssConfig, False),  # mixture-of-experts MLP, attention sinks, sliding-window layers
    "gemma4_text": (Gemma4TextConfig, True),  # sandwich norms, per-layer-type head dims and RoPE, soft-capped logits
    # Qwen3.5: Gated DeltaNet layers (a recurrent state per request) and gated full attention with partial RoPE
    "qwen3_5_text": (Qwen3_5TextConfig, True),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, True),  # ... with Qwen3 MoE's routed experts and a gated shared expert
    # DeepSeek-V3 / Kimi K2: multi-head latent attention (models/mla.py), sigmoid group-limited routing + shared experts
    "deepseek_v3": (DeepseekV3Config, False),
}
# A multimodal Gemma 4 directory (Gemma4ForConditionalGeneration): its `text_config` is a gemma4_text config, and
# its text weights are stored under `model.language_model.` (checkpoint/formats.py).
GEMMA4_MULTIMODAL = "gemma4"
# The same for Qwen3.5 (Qwen3_5ForConditionalGeneration, what the published Qwen3.5 directories are): a qwen3_5_text
# `text_config`, its text weights under `model.language_model.`.
QWEN3_5_MULTIMODAL = "qwen3_5"
# ... and Kimi K2.5 / K2.6 (Kimi_K25ForConditionalGeneration): a deepseek_v3 text model (`kimi_k2` in its config).
MULTIMODAL = {GEMMA4_MULTIMODAL: "gemma4_text", QWEN3_5_MULTIMODAL: "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
              "kimi_k25": "deepseek_v3"}

# Every HF config key we read; the engine keeps exactly these, so a config.json round-trips.
_HF_KEYS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias", "mlp_bias",
    "tie_word_embeddings", "num_local_experts", "num_experts_per_tok", "layer_types", "sliding_window",
    "hidden_activation", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
    "final_logit_softcapping", "hidden_size_per_layer_input", "input_embedding_scale",
    "num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "shared_expert_intermediate_size",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
    "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
)

# Gemma 4 parts outside the dense text model (the 31B), each refused with its own sentence: (field, is_used, what).
_GEMMA4_UNSUPPORTED = (
    ("hidden_size_per_layer_input", lambda v: bool(v), "per-layer input embeddings (the E2B / E4B models)"),
    ("num_kv_shared_layers", lambda v: bool(v), "KV sharing across layers"),
    ("enable_moe_block", lambda v: bool(v), "mixture-of-experts blocks (the 26B-A4B model)"),
    ("use_bidirectional_attention", lambda v: v == "all", "bidirectional attention"),
)


def text_config_dict(raw: dict) -> dict:
    """The text model's config of a multimodal Gemma 4 / Qwen3.5 config.json (its `text_config`; the top-level
    tie_word_embeddings decides whether the lm_head is the embedding, as in Gemma4ForConditionalGeneration and
    Qwen3_5ForConditionalGeneration)."""
    text = dict(raw.get("text_config") or {})
    text["model_type"] = MULTIMODAL[raw["model_type"]]
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def hf_config_from_dict(raw: dict, source: str) -> PretrainedConfig:
    """Parse a config.json dict with transformers' class for its `model_type` (no remote code)."""
    model_type = raw.get("model_type")
    if model_type in MULTIMODAL:
        raw = text_config_dict(raw)
        model_type = raw["model_type"]
    if model_type not in FAMILIES:
        raise UserError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}, "
            f"{', '.join(MULTIMODAL)} (their text part)."
        )
    cls, _ = FAMILIES[model_type]
    fields = {k: v for k, v in raw.items() if k not in ("transformers_version", "auto_map")}
    cfg = cls(**fields)
    if model_type == "gemma4_text":
        for field, used, what in _GEMMA4_UNSUPPORTED:
            if used(getattr(cfg, field, None)):
                raise UserError(f"{source}: {field} {getattr(cfg, field)!r} asks for {what}, which is not supported; "
                                "only the dense Gemma 4 text model (the 31B shape) is.")
    return cfg


@dataclass(frozen=True)
class DecoderSpec:
    """Architecture of a Llama / Qwen3-style decoder stack (the target, or the drafter's layers)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    hidden_act: str
    rope_parameters: dict
    max_position_embeddings: int
    # Mixture of experts (gpt-oss): 0 = a dense MLP. intermediate_size is then each expert's.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # (gpt-oss and Qwen3 MoE)
    # Routed SwiGLU experts stored one by one (Qwen3 MoE, models/moe.py SparseMoE): 0 = none. Layers in
    # `dense_layers` have a dense MLP of intermediate_size instead.
    routed_experts: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top k routing weights renormalized to sum to 1
    dense_layers: tuple[int, ...] = ()
    # Per layer "full_attention" | "sliding_attention"; None = all full. A sliding layer's query at position p
    # sees keys at positions > p - sliding_window (transformers' sliding_window_overlay).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # gpt-oss: a learned per-head logit `sinks` joins every softmax denominator (and takes no value).
    attention_sinks: bool = False
    # Gemma 4: full-attention layers have their own head_dim and KV heads, and with attention_k_eq_v no v_proj
    # (V is the k_proj output, before k_norm and RoPE). None = as the sliding layers.
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    # Softmax scale of q.k; None = head_dim ** -0.5 (Gemma 4: 1.0, its q_norm / k_norm set the scale)
    attention_scale: float | None = None
    # Gemma 4: logits = cap * tanh(logits / cap)
    final_logit_softcapping: float | None = None
    # A drafter's block embeddings are the target's raw embedding rows times this (z-lab dflash_config
    # `input_embedding_scale`; the target's own embedding scale, e.g. Gemma's sqrt(hidden), is not applied).
    input_embedding_scale: float = 1.0
    # Qwen3.5: its "linear_attention" layers (layer_types) are Gated DeltaNet (models/linear_attention.py) with these
    # key / value heads and head sizes and a causal conv of this kernel over their q, k, v; 0 = no such layers.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # Qwen3.5 MoE: every sparse MLP also runs a shared expert (a SwiGLU MLP of intermediate_size, which the config
    # calls shared_expert_intermediate_size) weighted by sigmoid(shared_expert_gate(x)).
    shared_expert: bool = False
    # DeepSeek-V3 / Kimi K2 multi-head latent attention (models/mla.py; 0 = none): queries through a q_lora_rank
    # bottleneck (0: one q_proj), keys and values from a kv_lora_rank latent that the cache holds with one roped key
    # part of qk_rope_head_dim (= head_dim, the RoPE width) per position; per head qk_nope_head_dim unroped query / key
    # dims and v_head_dim value dims. RoPE pairs interleaved when rope_interleave.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek-V3 routing: sigmoid scores, experts in n_group groups of which the topk_group best (each by its top 2
    # scores + e_score_correction_bias) are eligible, the chosen scores renormalized and times routed_scaling_factor;
    # n_shared_experts x moe_intermediate_size wide shared experts added to every sparse MLP.
    n_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    @property
    def is_qwen3_5(self) -> bool:
        """Qwen3.5 numerics (dense and MoE): RMSNorm scales by (1 + weight) in fp32, full attention gated per head by
        sigmoid of a second half of q_proj, RoPE over the first partial_rotary_factor of head_dim."""
        return self.model_type in ("qwen3_5_text", "qwen3_5_moe_text")

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` is a Gated DeltaNet (a recurrent state instead of a KV cache)."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> list[int]:
        """The numbers of the Gated DeltaNet layers (none but in Qwen3.5)."""
        return [i for i in range(self.num_layers) if self.is_linear(i)]

    @property
    def attention_layers(self) -> list[int]:
        """The numbers of the layers with a KV cache: every layer but the Gated DeltaNet ones."""
        return [i for i in range(self.num_layers) if not self.is_linear(i)]

    @property
    def has_recurrent_state(self) -> bool:
        """Some layers carry a recurrent state (Qwen3.5): a rejected draft cannot just be masked, the state after the
        accepted prefix must be kept (models/linear_attention.py)."""
        return bool(self.linear_conv_kernel)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3 / Kimi K2): the KV cache holds a latent per position."""
        return bool(self.kv_lora_rank)

    def cache_head(self) -> tuple[int, int, int]:
        """(KV heads, K head size, V head size) of an attention layer's cache, unsplit: a latent attention layer keeps
        one head of its latent and roped key and no V (models/mla.py); the compiled graphs' layers all have this one."""
        if self.is_mla:
            return 1, self.kv_lora_rank + self.head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def is_gpt_oss(self) -> bool:
        """gpt-oss numerics: RMSNorm multiplies its weight in fp32, MoE MLP, attention sinks."""
        return self.model_type == "gpt_oss"

    @property
    def has_experts(self) -> bool:
        """A mixture-of-experts target (gpt-oss's fused experts or routed ones): its routing has data-dependent
        shapes."""
        return bool(self.num_experts or self.routed_experts)

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer` has routed experts (Qwen3 MoE) rather than a dense MLP."""
        return bool(self.routed_experts) and layer not in self.dense_layers

    @property
    def is_gemma4(self) -> bool:
        """Gemma 4 numerics: RMSNorm multiplies its weight in fp32, sandwich norms around attention and MLP, a
        learned per-layer output scalar, V normed without weight, embeddings scaled by sqrt(hidden)."""
        return self.model_type == "gemma4_text"

    @property
    def embed_scale(self) -> float:
        """The target multiplies its embeddings by this (in the compute dtype, as transformers does)."""
        return self.hidden_size**0.5 if self.is_gemma4 else 1.0

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types is not None else "full_attention"

    def layer_spec(self, layer: int) -> "DecoderSpec":
        """The spec of one layer's attention: a Gemma 4 full-attention layer's own head_dim / KV heads / k_eq_v;
        every other layer (and family) has the model's."""
        if not self.is_gemma4 or self.is_sliding(layer):
            return dataclasses.replace(self, attention_k_eq_v=False) if self.attention_k_eq_v else self
        return dataclasses.replace(self, head_dim=self.global_head_dim or self.head_dim,
                                   num_kv_heads=self.num_global_kv_heads or self.num_kv_heads)

    @classmethod
    def from_hf(cls, cfg: PretrainedConfig) -> "DecoderSpec":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # transformers applies a window only where layer_types says so and sliding_window is set (Qwen3 clears it
        # unless use_sliding_window); all-full configs are stored as None so their engine config stays unchanged.
        layer_types = tuple(getattr(cfg, "layer_types", None) or ())
        window = getattr(cfg, "sliding_window", None)
        if window is None or "sliding_attention" not in layer_types:
            window = None
            if "linear_attention" not in layer_types:
                layer_types = ()
        gemma4 = cfg.model_type == "gemma4_text"
        qwen3_5 = cfg.model_type in ("qwen3_5_text", "qwen3_5_moe_text")
        shared = cfg.model_type == "qwen3_5_moe_text"  # (routed experts in every layer, renormalized, + a shared one)
        deepseek = cfg.model_type == "deepseek_v3"
        k_eq_v = gemma4 and bool(cfg.attention_k_eq_v)
        routed = (int(cfg.num_experts or 0) if cfg.model_type == "qwen3_moe" or shared else
                  int(cfg.n_routed_experts or 0) if deepseek else 0)
        dense = tuple(i for i in range(cfg.num_hidden_layers)
                      if i in (cfg.mlp_only_layers or []) or (i + 1) % cfg.decoder_sparse_step) if routed and not \
            (shared or deepseek) else tuple(range(min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers))) \
            if routed and deepseek else ()
        if deepseek:  # softmax scale: qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared
            scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
            rope = cfg.rope_parameters or {}
            if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
                factor = rope["factor"]
                mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
                scale *= mscale * mscale
        return cls(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.shared_expert_intermediate_size if shared else cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            qk_norm=FAMILIES[cfg.model_type][1],
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            hidden_act=cfg.hidden_activation if gemma4 else cfg.hidden_act,
            rope_parameters=dict(cfg.rope_parameters),
            max_position_embeddings=cfg.max_position_embeddings,
            num_experts=int(getattr(cfg, "num_local_experts", 0) or 0) if cfg.model_type == "gpt_oss" else 0,
            num_experts_per_tok=(int(getattr(cfg, "num_experts_per_tok", 0) or 0)
                                 if cfg.model_type == "gpt_oss" or routed else 0),
            routed_experts=routed,
            moe_intermediate_size=int(cfg.moe_intermediate_size) if routed else 0,
            norm_topk_prob=True if shared else bool(cfg.norm_topk_prob) if routed else False,
            dense_layers=dense,
            layer_types=layer_types or None,
            sliding_window=window,
            attention_sinks=cfg.model_type == "gpt_oss",
            global_head_dim=cfg.global_head_dim if gemma4 else None,
            num_global_kv_heads=(cfg.num_global_key_value_heads or cfg.num_key_value_heads) if k_eq_v else None,
            attention_k_eq_v=k_eq_v,
            attention_scale=1.0 if gemma4 else scale if deepseek else None,
            final_logit_softcapping=cfg.final_logit_softcapping if gemma4 else None,
            input_embedding_scale=float(getattr(cfg, "input_embedding_scale", None) or 1.0),
            linear_num_key_heads=cfg.linear_num_key_heads if qwen3_5 else 0,
            linear_num_value_heads=cfg.linear_num_value_heads if qwen3_5 else 0,
            linear_key_head_dim=cfg.linear_key_head_dim if qwen3_5 else 0,
            linear_value_head_dim=cfg.linear_value_head_dim if qwen3_5 else 0,
            linear_conv_kernel=cfg.linear_conv_kernel_dim if qwen3_5 else 0,
            shared_expert=shared,
            q_lora_rank=int(cfg.q_lora_rank or 0) if deepseek else 0,
            kv_lora_rank=cfg.kv_lora_rank if deepseek else 0,
            qk_nope_head_dim=cfg.qk_nope_head_dim if deepseek else 0,
            v_head_dim=cfg.v_head_dim if deepseek else 0,
            rope_interleave=bool(cfg.rope_interleave) if deepseek else False,
            n_group=int(cfg.n_group or 1) if deepseek else 0,
            topk_group=int(cfg.topk_group or 1) if deepseek else 0,
            routed_scaling_factor=float(cfg.routed_scaling_factor) if deepseek else 1.0,
            n_shared_experts=int(cfg.n_shared_experts or 0) if deepseek else 0,
        )

    def to_hf_dict(self) -> dict:
        """The config.json fields that rebuild this spec with `hf_config_from_dict`."""
        fields = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": self.rope_parameters,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.num_experts:
            fields |= {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok}
        if self.model_type == "qwen3_moe":
            fields |= {"num_experts": self.routed_experts, "num_experts_per_tok": self.num_experts_per_tok,
                       "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                       "decoder_sparse_step": 1, "mlp_only_layers": list(self.dense_layers)}
        if self.model_type == "deepseek_v3":
            fields |= {"q_lora_rank": self.q_lora_rank or None, "kv_lora_rank": self.kv_lora_rank,
                       "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.head_dim,
                       "v_head_dim": self.v_head_dim, "rope_interleave": self.rope_interleave,
                       "n_routed_experts": self.routed_experts, "num_experts_per_tok": self.num_experts_per_tok,
                       "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                       "n_group": self.n_group, "topk_group": self.topk_group,
                       "routed_scaling_factor": self.routed_scaling_factor, "n_shared_experts": self.n_shared_experts,
                       "first_k_dense_replace": len(self.dense_layers), "num_mtp_layers": 0}
            del fields["head_dim"]  # (DeepseekV3Config sets it to qk_rope_head_dim)
        if self.shared_expert:  # Qwen3.5 MoE: no dense MLP width, every layer sparse
            del fields["intermediate_size"]
            fields |= {"num_experts": self.routed_experts, "num_experts_per_tok": self.num_experts_per_tok,
                       "moe_intermediate_size": self.moe_intermediate_size,
                       "shared_expert_intermediate_size": self.intermediate_size}
        if self.is_qwen3_5:
            fields |= {"layer_types": list(self.layer_types or ()), "linear_num_key_heads": self.linear_num_key_heads,
                       "linear_num_value_heads": self.linear_num_value_heads,
                       "linear_key_head_dim": self.linear_key_head_dim,
                       "linear_value_head_dim": self.linear_value_head_dim,
                       "linear_conv_kernel_dim": self.linear_conv_kernel}
        elif self.layer_types is not None:
            fields |= {"layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
                       "use_sliding_window": True}  # Qwen3Config drops sliding_window without it
        elif self.is_gpt_oss or self.is_gemma4:  # their configs' default layer_types mix sliding / full
            fields["layer_types"] = ["full_attention"] * self.num_layers
        if self.is_gemma4:
            fields |= {"hidden_activation": self.hidden_act, "global_head_dim": self.global_head_dim,
                       "attention_k_eq_v": self.attention_k_eq_v,
                       "final_logit_softcapping": self.final_logit_softcapping,
                       "hidden_size_per_layer_input": 0}  # (Gemma4TextConfig's default turns per-layer inputs on)
            if self.attention_k_eq_v:
                fields["num_global_key_value_heads"] = self.num_global_kv_heads
        if self.input_embedding_scale != 1.0:
            fields["input_embedding_scale"] = self.input_embedding_scale
        return fields

    def rope_inv_freq(self, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim/2] fp32, attention_scaling), exactly as transformers computes them. Gemma 4 has
        one RoPE per `layer_type` (rope_parameters is keyed by it); its full layers' "proportional" RoPE spans
        global_head_dim and leaves the last dims unrotated (inv_freq 0)."""
        params = self.rope_parameters[layer_type] if self.is_gemma4 else self.rope_parameters
        rope_type = params.get("rope_type", "default")
        full = self.is_gemma4 and layer_type == "full_attention"
        head_dim = (self.global_head_dim or self.head_dim) if full else self.head_dim
        if rope_type == "default":  # over the first partial_rotary_factor of head_dim (Qwen3.5: a quarter)
            base = params["rope_theta"]
            head_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            return 1.0 / (base**exponents), 1.0
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UserError(f"rope_parameters.rope_type {rope_type!r} is not supported.")
        cfg = hf_config_from_dict(self.to_hf_dict(), "rope_parameters")
        kwargs = {}
        if self.is_gemma4:
            kwargs = {"layer_type": layer_type}
            if layer_type == "full_attention" and rope_type == "proportional":
                kwargs["head_dim_key"] = "global_head_dim"
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), **kwargs)
        return inv_freq.float(), float(scaling)


@dataclass(frozen=True)
class DFlash2Params:
    """What a DFlash2 drafter adds (z-lab `dflash_config` / speculators `DFlash2SpeculatorConfig`; docs/algorithm.md
    §DFlash2 drafters): a grouped dynamic causal convolution of `conv_kernel_size` taps over the block around every
    attention and MLP sublayer (one kernel per `conv_group_size` hidden channels), and a candidate selector that
    re-ranks the `selector_top_k` best tokens per position by a rank-`selector_rank` bilinear score of the
    predecessor token, the position's hidden state and the candidate. The drafter's logits are
    `output_multiplier` x the lm_head's, soft-capped at `final_logit_softcapping` (None: not capped)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None


@dataclass(frozen=True)
class DFlashParams:
    """The drafter's DFlash parameters (z-lab config.json: `block_size`, `dflash_config`)."""

    block_size: int  # tokens per block: the anchor + block_size-1 drafts
    mask_token_id: int  # a row of the target's embedding, used for every not-yet-drafted slot
    target_layer_ids: tuple[int, ...]  # outputs of these 0-based target decoder layers feed the drafter
    dflash2: DFlash2Params | None = None  # a DFlash2 drafter's convolutions and candidate selector; None: DFlash


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The reference's default feature layers: evenly spaced over [1, L-3] (docs/algorithm.md §Target features)."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_features - 1))) for i in range(num_features)]
