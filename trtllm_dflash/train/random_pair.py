"""Tiny random target + drafter pairs in the real on-disk formats.

For tests and for smoke-testing a deployment pipeline where no model hub is reachable. The target is
written by transformers' own `save_pretrained` (so it is a genuine HF checkpoint), with a byte-level
BPE tokenizer trained on the Python standard library's source and a ChatML chat template; the
drafter is written in the z-lab format by `save_drafter`. Random weights: outputs are meaningless
and acceptance is near zero, but every code path and format is the real one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trtllm_dflash.checkpoint.formats import save_drafter
from trtllm_dflash.models.drafter import DFlashDrafter
from trtllm_dflash.models.spec import DecoderSpec, DFlash2Params, DFlashParams
from trtllm_dflash.train.corpus import stdlib_modules, train_bpe_tokenizer


def _random_gpt_oss(common: dict, num_layers: int) -> GptOssForCausalLM:
    """4 experts (top 2), YaRN RoPE, sliding / full layers alternating with a window of 4 tokens (so it matters
    on short prompts), and weights large enough that the sinks, the biases and the SwiGLU clamp at 7 all act
    (HF's initialisation leaves biases at zero and activations far below the clamp)."""
    rope = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 1024}
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    hf = GptOssForCausalLM(GptOssConfig(**common, rope_parameters=rope, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=4, layer_types=layer_types, attention_bias=True))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("sinks", "_bias", "router.bias")) or "self_attn" in name and name.endswith("bias"):
                p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1)
            elif name.endswith("gate_up_proj"):
                p.normal_(0.0, 1.0)  # |gate_up| ~ 8: often clamped
    return hf


def _random_qwen3_moe(common: dict, num_layers: int) -> Qwen3MoeForCausalLM:
    """8 experts of half the dense width (top 2, renormalized), layer 1 dense (mlp_only_layers), and a router with
    weights large enough that tokens pick different experts (HF's initialisation routes almost uniformly)."""
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **common, rope_theta=1_000_000.0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=common["intermediate_size"] // 2, decoder_sparse_step=1,
        mlp_only_layers=[1] if num_layers > 1 else [], norm_topk_prob=True))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return hf


def _random_deepseek_v3(common: dict, num_layers: int) -> DeepseekV3ForCausalLM:
    """DeepSeek-V3 / Kimi K2's shape in small: multi-head latent attention (queries through a rank-48 bottleneck, a
    32-dim latent + 8 roped dims cached per position, 16 unroped query / key and 16 value dims per head, YaRN RoPE
    with interleaved pairs and its mscale on the softmax scale), layer 0 dense, the others 8 routed experts in 4 groups
    (the best 2 groups eligible, top 2, renormalized, x 2.5) plus a shared expert. Router weights and the choice bias
    spread (HF initialises the bias to 0 and routes almost uniformly)."""
    rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    fields = {k: v for k, v in common.items() if k != "head_dim"} | {
        "num_key_value_heads": common["num_attention_heads"], "rope_parameters": rope, "q_lora_rank": 48,
        "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "moe_intermediate_size": common["intermediate_size"] // 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
        "first_k_dense_replace": min(1, num_layers - 1), "num_mtp_layers": 0}
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return hf


def _random_gemma4(common: dict, num_layers: int) -> Gemma4ForCausalLM:
    """The dense Gemma 4 text shape in small: sliding (window 4, so it matters on short prompts) and full layers
    alternating, full layers with twice the head_dim, one KV head and V = K (attention_k_eq_v), the default
    per-layer-type RoPE (proportional, a quarter of the dims rotated, on full layers), tied embeddings and logits
    soft-capped at 2. Norm weights and layer scalars are spread around 1 (HF initialises them to exactly 1)."""
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    hf = Gemma4ForCausalLM(Gemma4TextConfig(
        **(common | {"tie_word_embeddings": True}), layer_types=layer_types, sliding_window=4,
        global_head_dim=2 * common["head_dim"], num_global_key_value_heads=1, attention_k_eq_v=True,
        final_logit_softcapping=2.0, hidden_size_per_layer_input=0, pad_token_id=0, bos_token_id=None))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        hf.model.embed_tokens.weight.normal_(0.0, 0.15)  # logits of a few units: the cap at 2 bends them
        for layer in hf.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return hf


def _random_qwen3_5(common: dict, num_layers: int, moe: bool = False
                    ) -> Qwen3_5ForConditionalGeneration | Qwen3_5MoeForConditionalGeneration:
    """Qwen3.5 as published: a multimodal directory (Qwen3_5ForConditionalGeneration, here with a one-block vision
    tower that text never reaches) whose text model has Gated DeltaNet layers (2 key heads, 4 value heads: each key
    head shared by two) and a full-attention layer every fourth (gated, RoPE over a quarter of head_dim). Its
    zero-centred norm weights are spread around 0 (HF initialises them to exactly 0: scale 1), and its Gated DeltaNet
    layers remember: HF's initial decay (A up to 16: exp(g) ~ 1e-5 a token) forgets every earlier token at once, and
    their output is small against the residual stream, so a wrong recurrent state would hardly change a token. Here
    A in (0.02, 0.3) keeps ~0.9 of the state a token and out_proj is 5x larger. `moe`: Qwen3.5 MoE, every MLP 8
    routed experts of half the width (top 2) and a shared expert of 3/4 of it, with a router that spreads the tokens."""
    text = common | {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
    eos = text.pop("eos_token_id")
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": common["hidden_size"], "num_position_embeddings": 16}
    if moe:
        width = text.pop("intermediate_size")
        text |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": width // 2,
                 "shared_expert_intermediate_size": 3 * width // 4}
    config, model = (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe else (
        Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    hf = model(config(text_config=text | {"eos_token_id": eos}, vision_config=vision,
                      tie_word_embeddings=common["tie_word_embeddings"]))
    hf.generation_config.eos_token_id = eos
    with torch.no_grad():
        for name, p in hf.model.language_model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.uniform_(-0.5, 0.5)
            elif name.endswith("linear_attn.A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())
            elif name.endswith("linear_attn.out_proj.weight"):
                p.mul_(5.0)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return hf


def write_random_pair(out_dir: Path, family: str = "qwen3", *, vocab_size: int = 512, hidden_size: int = 64,
                      num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                      intermediate_size: int = 128, draft_layers: int = 2, block_size: int = 8,
                      target_layer_ids: list[int] | None = None, tie_word_embeddings: bool = False,
                      seed: int = 0, shard: bool = False, dflash2: bool = False) -> tuple[Path, Path]:
    """Write `out_dir/target` (HF) and `out_dir/drafter` (z-lab; `dflash2`: a DFlash2 drafter whose convolutions and
    selector are far from their identity initialization, so that they change the drafts); returns both paths."""
    out_dir = Path(out_dir)
    target_dir, drafter_dir = out_dir / "target", out_dir / "drafter"
    tokenizer = train_bpe_tokenizer(vocab_size, tuple(stdlib_modules(held_out=False, include_tests=False)[:40]))
    mask_id = tokenizer.convert_tokens_to_ids("<|MASK|>")
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                  eos_token_id=eos_ids, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    if family == "qwen3":
        hf = Qwen3ForCausalLM(Qwen3Config(**common, rope_theta=1_000_000.0))
    elif family == "qwen3_moe":
        hf = _random_qwen3_moe(common, num_layers)
    elif family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
        hf = LlamaForCausalLM(LlamaConfig(**common, rope_scaling=rope))
    elif family == "gpt_oss":
        hf = _random_gpt_oss(common, num_layers)
    elif family == "gemma4":
        hf = _random_gemma4(common, num_layers)
    elif family == "deepseek_v3":
        hf = _random_deepseek_v3(common, num_layers)
    elif family in ("qwen3_5", "qwen3_5_moe"):
        hf = _random_qwen3_5(common, num_layers, moe=family == "qwen3_5_moe")
    else:
        raise ValueError(f"family must be qwen3, qwen3_moe, qwen3_5, qwen3_5_moe, deepseek_v3, llama, gpt_oss or "
                         f"gemma4, got {family!r}")
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(str(target_dir), max_shard_size="100KB" if shard else "5GB")
    tokenizer.save_pretrained(str(target_dir))

    ids = target_layer_ids or sorted({0, num_layers // 2, num_layers - 1})
    draft_spec = DecoderSpec(
        model_type="qwen3", vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=draft_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, qk_norm=True, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=4096,
        # (a Gemma drafter sees the embedding rows as Gemma's own layers do: scaled by sqrt(hidden))
        input_embedding_scale=hidden_size**0.5 if family == "gemma4" else 1.0,
    )
    d2 = DFlash2Params(conv_group_size=16, selector_rank=32, selector_top_k=8) if dflash2 else None
    params = DFlashParams(block_size, mask_id, tuple(ids), d2)
    drafter = DFlashDrafter(draft_spec, params)
    with torch.no_grad():  # RMSNorm weights away from 1 so the tests see them
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("base_kernel"):
                p.add_(torch.randn_like(p) * 0.3)
            elif "_conv.kernel_projection" in name:
                p.normal_(0.0, 0.05)
            elif name.startswith("candidate_selector."):  # edges of about the logits' spread
                p.normal_(0.0, 0.1 if "hidden_projection" in name else 0.3)
    save_drafter(drafter_dir, draft_spec, params, num_layers, drafter.state_dict(), "float32")
    return target_dir, drafter_dir
