"""Typed architecture descriptions of the target decoder and the DFlash drafter.

Both are read from Hugging Face `config.json` dicts. Transformers' own config classes normalise the
fields (e.g. legacy `rope_theta` / `rope_scaling` into `rope_parameters`), and its RoPE initialisers
compute the inverse frequencies, so our RoPE equals HF's for every rope type it supports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GptOssConfig, LlamaConfig, PretrainedConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from trtllm_dflash.errors import UserError

# model_type -> (HF config class, family has per-head q_norm/k_norm)
FAMILIES: dict[str, tuple[type[PretrainedConfig], bool]] = {
    "qwen3": (Qwen3Config, True),
    "llama": (LlamaConfig, False),
    "gpt_oss": (GptOssConfig, False),  # mixture-of-experts MLP, attention sinks, sliding-window layers
}

# Every HF config key we read; the engine keeps exactly these, so a config.json round-trips.
_HF_KEYS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias", "mlp_bias",
    "tie_word_embeddings", "num_local_experts", "num_experts_per_tok", "layer_types", "sliding_window",
)


def hf_config_from_dict(raw: dict, source: str) -> PretrainedConfig:
    """Parse a config.json dict with transformers' class for its `model_type` (no remote code)."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}."
        )
    cls, _ = FAMILIES[model_type]
    fields = {k: v for k, v in raw.items() if k not in ("transformers_version", "auto_map")}
    return cls(**fields)


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
    num_experts_per_tok: int = 0
    # Per layer "full_attention" | "sliding_attention"; None = all full. A sliding layer's query at position p
    # sees keys at positions > p - sliding_window (transformers' sliding_window_overlay).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # gpt-oss: a learned per-head logit `sinks` joins every softmax denominator (and takes no value).
    attention_sinks: bool = False

    @property
    def is_gpt_oss(self) -> bool:
        """gpt-oss numerics: RMSNorm multiplies its weight in fp32, MoE MLP, attention sinks."""
        return self.model_type == "gpt_oss"

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf(cls, cfg: PretrainedConfig) -> "DecoderSpec":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # transformers applies a window only where layer_types says so and sliding_window is set (Qwen3 clears it
        # unless use_sliding_window); all-full configs are stored as None so their engine config stays unchanged.
        layer_types = tuple(getattr(cfg, "layer_types", None) or ())
        window = getattr(cfg, "sliding_window", None)
        if window is None or "sliding_attention" not in layer_types:
            layer_types, window = (), None
        return cls(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            qk_norm=FAMILIES[cfg.model_type][1],
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            hidden_act=cfg.hidden_act,
            rope_parameters=dict(cfg.rope_parameters),
            max_position_embeddings=cfg.max_position_embeddings,
            num_experts=int(getattr(cfg, "num_local_experts", 0) or 0),
            num_experts_per_tok=int(getattr(cfg, "num_experts_per_tok", 0) or 0) if cfg.model_type == "gpt_oss" else 0,
            layer_types=layer_types or None,
            sliding_window=window,
            attention_sinks=cfg.model_type == "gpt_oss",
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
        if self.layer_types is not None:
            fields |= {"layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
                       "use_sliding_window": True}  # Qwen3Config drops sliding_window without it
        elif self.is_gpt_oss:  # GptOssConfig's default layer_types alternate sliding / full
            fields["layer_types"] = ["full_attention"] * self.num_layers
        return fields

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim/2] fp32, attention_scaling), exactly as transformers computes them."""
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = self.rope_parameters["rope_theta"]
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            return 1.0 / (base**exponents), 1.0
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UserError(f"rope_parameters.rope_type {rope_type!r} is not supported.")
        cfg = hf_config_from_dict(self.to_hf_dict(), "rope_parameters")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        return inv_freq.float(), float(scaling)


@dataclass(frozen=True)
class DFlashParams:
    """The drafter's DFlash parameters (z-lab config.json: `block_size`, `dflash_config`)."""

    block_size: int  # tokens per block: the anchor + block_size-1 drafts
    mask_token_id: int  # a row of the target's embedding, used for every not-yet-drafted slot
    target_layer_ids: tuple[int, ...]  # outputs of these 0-based target decoder layers feed the drafter


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The reference's default feature layers: evenly spaced over [1, L-3] (DFLASH.md §1)."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_features - 1))) for i in range(num_features)]
