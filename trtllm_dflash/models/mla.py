"""Multi-head latent attention (DeepSeek-V3, Kimi K2): transformers' `DeepseekV3Attention`, parameter names as stored,
computed in the absorbed form over a latent KV cache.

Per token x, transformers computes (H heads; nope / rope / v: qk_nope_head_dim / qk_rope_head_dim / v_head_dim;
r: kv_lora_rank):

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))      [H, nope + rope] -> q_nope, q_rope
    c, k_r = kv_a_proj_with_mqa(x)                                        [r], [rope]     (k_r shared by the heads)
    c      = kv_a_layernorm(c);  k_nope, v = kv_b_proj(c)                 [H, nope], [H, v]
    scores = (q_nope . k_nope + rope(q_rope) . rope(k_r)) * scale;  out = o_proj(softmax(scores) @ v)

Since k_nope = W_UK[h] c and v = W_UV[h] c (the rows of kv_b_proj), q_nope . k_nope = (W_UK[h]^T q_nope) . c and
softmax @ v = W_UV[h] (softmax @ c): every head attends over the same per-position vector [c ; rope(k_r)] with the
query [W_UK[h]^T q_nope ; rope(q_rope)], and the result goes through W_UV[h]. So the cache holds that one vector per
position and layer (r + rope values: 576 for DeepSeek-V3 and Kimi K2, against 128 x (192 + 128) for their heads' K
and V), as one KV head whose V is its first r dims (the cache keeps no V of its own). Every pass (prefill, verify,
plain step) uses this form; on a GPU a long prefill would rather expand the latent per head (fewer FLOPs): not done.

Under tensor parallelism each rank holds H / tp_size heads (q_b_proj / q_proj and kv_b_proj rows, o_proj columns) and
the whole latent path (q_a_proj, kv_a_proj_with_mqa and their norms replicated): every rank caches the same latent.
"""

from __future__ import annotations

import torch
from torch import nn

from trtllm_dflash.models.layers import RMSNorm, apply_rotary, attend, exporting
from trtllm_dflash.models.spec import DecoderSpec
from trtllm_dflash.parallel.group import SINGLE, TPGroup

# DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank) are built without the config's eps
LATENT_NORM_EPS = 1e-6


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_interleave for one tensor: pairs (x0, x1), (x2, x3) ... each rotated by one
    frequency, the result laid out as [rotated evens ; rotated odds] (query and key alike, so their dot products are
    the interleaved ones). x: [B, T, heads, rope]; cos, sin: [B, T, 1, rope] (Rotary's, its halves equal).

    Exported (cos, sin: [B, T, rope / 2]): ONNX's RotaryEmbedding with interleaved pairs, which leaves each rotated
    pair in place instead. Queries and keys are laid out alike in either form, so their dot products are the same;
    only the layout of a graph's cached keys differs from the torch executor's (no cache moves between them)."""
    if exporting():
        return torch.ops.onnx.RotaryEmbedding.opset23(x.transpose(1, 2), cos, sin, interleaved=True).transpose(1, 2)
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class LatentAttention(nn.Module):
    """One rank's multi-head latent attention. As a KV-cache user: one KV head of kv_lora_rank + qk_rope_head_dim
    (`num_kv_heads`, `head_dim`) and no V (`v_head_dim` 0)."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE):
        super().__init__()
        h, bias = spec.hidden_size, spec.attention_bias
        self.tp, self.heads = tp, spec.num_heads // tp.size
        self.nope, self.rope, self.v_dim, self.rank = (spec.qk_nope_head_dim, spec.head_dim, spec.v_head_dim,
                                                       spec.kv_lora_rank)
        self.num_kv_heads, self.head_dim, self.v_head_dim = 1, self.rank + self.rope, 0
        q_width = self.heads * (self.nope + self.rope)
        if spec.q_lora_rank:
            self.q_a_proj = nn.Linear(h, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, h, bias=bias)
        self.scale = spec.attention_scale
        self.interleaved = spec.rope_interleave
        self.sinks = None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_interleaved(x, cos, sin) if self.interleaved else apply_rotary(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int, slots: torch.Tensor,
                positions: torch.Tensor, mask: torch.Tensor, run: slice | None = None, first_key: int = 0
                ) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden] (all-reduced); writes the pass's latents into `cache` (layer `layer`) and
        attends over the slots' cached positions first_key .. first_key + mask.shape[-1] - 1."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_rope = q.unflatten(-1, (self.heads, self.nope + self.rope)).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        key = torch.cat([self.kv_a_layernorm(latent), self._rotate(k_rope[:, :, None], cos, sin)[:, :, 0]], dim=-1)
        cache.write(layer, slots, positions, key[:, :, None], key.new_zeros(b, t, 1, 0))
        keys, _ = cache.read(layer, slots, first_key + mask.shape[-1], run, first_key)  # [B, Tk, 1, r + rope]
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        absorbed = torch.einsum("bthn,hnr->bthr", q_nope, w[:, : self.nope])  # W_UK^T q_nope
        query = torch.cat([absorbed, self._rotate(q_rope, cos, sin)], dim=-1)  # [B, T, H, r + rope]
        if exporting():  # ONNX Attention's V as wide as K (torch's shape function for it assumes so): [c ; k_r], whose
            # first r dims of the output are softmax @ c
            out = attend(query, keys, keys, mask, scale=self.scale).unflatten(-1, (self.heads, -1))[..., : self.rank]
        else:
            out = attend(query, keys, keys[..., : self.rank], mask, scale=self.scale).unflatten(-1, (self.heads, -1))
        out = torch.einsum("bthr,hvr->bthv", out, w[:, self.nope:]).flatten(2)  # W_UV (softmax @ c)
        return self.tp.all_reduce(self.o_proj(out))
