"""The target model: a Llama-3.x / Qwen3 / Qwen3 MoE / gpt-oss / Gemma 4 decoder with a static per-slot KV cache and
hidden-state capture.

Module and parameter names mirror transformers' `LlamaForCausalLM` / `Qwen3ForCausalLM` / `GptOssForCausalLM` /
`Gemma4ForCausalLM`, so an HF state dict loads as is. gpt-oss layers differ in three places: a mixture-of-experts
MLP (models/moe.py), a learned sink logit per head in the attention softmax, and every other layer attending to a
sliding window of keys (a mask condition here: the cache keeps every position). Gemma 4 (transformers'
Gemma4TextDecoderLayer) per layer:

    x = x + post_attention_layernorm(attn(input_layernorm(x)))        attention scale 1, V = rms(v) without weight
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))      mlp: GELU (tanh) gate
    x = x * layer_scalar

with sliding / full layers of different head_dim, KV heads and RoPE, embeddings scaled by sqrt(hidden) and the
logits soft-capped: cap * tanh(logits / cap).

Qwen3.5 is hybrid: its "linear_attention" layers are Gated DeltaNet (models/linear_attention.py: a recurrent state per
request that the next pass resumes at its own start, so a verify pass's rejected drafts leave no trace), the others
full attention whose output is gated per head (AttentionProjections); every RMSNorm scales by 1 + weight. A linear
layer has no KV cache (0 heads in the caches' per-layer layout). DeepSeek-V3 / Kimi K2 attend through a latent
(models/mla.py: one cached vector per position, no V).

Each request in a batch has its own absolute positions and its own cache slot; the causal mask is built from
absolute positions, so requests of different lengths batch together without any per-request bookkeeping here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trtllm_dflash.models.layers import (
    MLP,
    AttentionProjections,
    KVCache,
    RMSNorm,
    Rotary,
    VocabParallelEmbedding,
    apply_rotary,
    attend,
    drop_replicated_biases,
)
from trtllm_dflash.models.linear_attention import GatedDeltaNet, RecurrentPass, RecurrentStates
from trtllm_dflash.models.mla import LatentAttention
from trtllm_dflash.models.moe import MoEMLP, MoEParallel, SparseMoE
from trtllm_dflash.models.shard import padded_vocab
from trtllm_dflash.models.spec import DecoderSpec
from trtllm_dflash.parallel.group import SINGLE, TPGroup


def visible_keys(rows: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the cache rows [B or 1, 1, K] a pass reads: the position of the token each row holds [B or 1, 1, K], and
    which rows each query sees [B, T, K], causally. Without `tree`, a row holds its own position and a query sees the
    rows up to its position. With a draft tree's ancestor mask `tree` [B, T, T], node t is cached at row start + t and
    sits at position start + its depth (`positions` [B, T]; node 0 is the anchor, at row and position start): a row
    before start holds its own position and every node sees it; a node sees the nodes `tree` marks (its ancestors and
    itself) and no row past the tree."""
    if tree is None:
        return rows, rows <= positions[:, :, None]
    b, t = positions.shape
    offset = rows - positions[:, :1, None]  # [B, 1, K]
    node = offset.clamp(0, t - 1)
    seen = torch.where(offset < 0, rows, positions.gather(1, node[:, 0])[:, None])
    visible = (offset < 0) | (tree.gather(2, node.expand(b, t, -1)) & (offset < t))
    return seen, visible


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T_out, vocab] fp32 (T_out = T, or 1 with `last_index`)
    # [B, T, len(capture_layers) * hidden]: outputs of those decoder layers, as HF's
    # output_hidden_states[layer_id + 1] (the last layer's output is taken after the final norm)
    hidden: torch.Tensor | None


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TPGroup, moe_parallel: MoEParallel = "tp", layer: int = 0):
        super().__init__()
        fp32_weight, offset = spec.is_gpt_oss or spec.is_gemma4, spec.is_qwen3_5
        if spec.is_linear(layer):
            self.linear_attn, self.self_attn = GatedDeltaNet(spec, tp), None
        elif spec.is_mla:
            self.self_attn = LatentAttention(spec, tp)
        else:
            self.self_attn = AttentionProjections(spec.layer_spec(layer), tp)
        self.mlp = (MoEMLP(spec, tp, moe_parallel) if spec.num_experts else
                    SparseMoE(spec, tp, moe_parallel) if spec.is_sparse(layer) else MLP(spec, tp))
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, fp32_weight, offset)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, fp32_weight, offset)
        self.sandwich = spec.is_gemma4  # Gemma 4: norms after attention and around the MLP, and a layer scalar
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, fp32_weight)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, fp32_weight)
            self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, cos, sin, cache: KVCache, layer_idx: int, slots, positions, mask, run: slice | None = None,
                first_key: int = 0, recurrent: tuple[RecurrentStates, int, RecurrentPass] | None = None):
        """`mask` [B, T, keys] covers positions first_key .. first_key + keys - 1 (a sliding layer's window).
        `recurrent`: a linear layer's states, its index among them and the pass's view of them."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        if attn is None:
            attended = self.linear_attn(h, *recurrent)
        elif isinstance(attn, LatentAttention):
            attended = attn(h, cos, sin, cache, layer_idx, slots, positions, mask, run, first_key)
        else:
            q, gate = attn.query_and_gate(h)
            k, v = attn.key_value(h)
            if cache.in_place:  # an exported one-token pass: the write and the attention are one node
                attended = attn.output(cache.write_and_attend(layer_idx, apply_rotary(q, cos, sin),
                                                              apply_rotary(k, cos, sin), v, positions), gate)
            else:
                cache.write(layer_idx, slots, positions, apply_rotary(k, cos, sin), v)
                k_all, v_all = cache.read(layer_idx, slots, first_key + mask.shape[-1], run, first_key)
                attended = attn.output(attend(apply_rotary(q, cos, sin), k_all, v_all, mask, attn.sinks,
                                              attn.scale), gate)
        if not self.sandwich:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attended)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class DecoderBody(nn.Module):
    """HF's `model.` submodule: embed_tokens, layers, norm."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup, moe_parallel: MoEParallel = "tp"):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp, moe_parallel, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.is_gpt_oss or spec.is_gemma4, spec.is_qwen3_5)


class TargetModel(nn.Module):
    """`spec` is the whole model's; under tensor parallelism (`tp`) this module holds one rank's shard, its
    experts split by intermediate features (`moe_parallel` "tp") or whole experts per rank ("ep")."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE, moe_parallel: MoEParallel = "tp"):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.model = DecoderBody(spec, tp, moe_parallel)
        self.lm_head = nn.Linear(spec.hidden_size, padded_vocab(spec.vocab_size, tp.size) // tp.size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # One RoPE per layer type where they differ (Gemma 4), else one ("all") for every layer.
        self.rope_keys = [spec.layer_type(i) if spec.is_gemma4 else "all" for i in range(spec.num_layers)]
        self.rotary = nn.ModuleDict({t: Rotary(spec, None if t == "all" else t) for t in sorted(set(self.rope_keys))})
        # Gated DeltaNet layers (Qwen3.5) -> their index in RecurrentStates
        self.linear_index = {layer: n for n, layer in enumerate(spec.linear_layers)}

    def kv_layout(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer, this rank's KV heads, K head size and V head size in the KV caches (a Gated DeltaNet layer: 0
        heads; a latent attention layer: one head of its latent and roped key, no V)."""
        heads, k_dims, v_dims = [], [], []
        for layer in self.model.layers:
            a = layer.self_attn
            heads.append(0 if a is None else a.num_kv_heads)
            k_dims.append(self.spec.head_dim if a is None else a.head_dim)
            v_dims.append(a.v_head_dim if isinstance(a, LatentAttention) else k_dims[-1])
        return heads, k_dims, v_dims

    def new_cache(self, num_slots: int, capacity: int) -> KVCache:
        p = self.lm_head.weight
        heads, k_dims, v_dims = self.kv_layout()
        return KVCache(self.spec.num_layers, num_slots, capacity, heads, k_dims, p.dtype, p.device, v_dims)

    def new_states(self, num_slots: int, depth: int) -> RecurrentStates | None:
        """The Gated DeltaNet layers' states (Qwen3.5), resuming passes of up to `depth` tokens; None without such
        layers."""
        p = self.lm_head.weight
        return RecurrentStates.of(self.spec, self.tp.size, num_slots, depth, p.dtype, p.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The raw embedding rows (what a drafter's block is made of); `forward` scales them by spec.embed_scale."""
        return self.model.embed_tokens(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head of already-normed hidden states, in fp32 (gathered over the vocabulary shards), soft-capped
        where the model does it (Gemma 4)."""
        logits = self.tp.all_gather_last(self.lm_head(hidden).float())[..., : self.spec.vocab_size]
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @classmethod
    def from_state_dict(cls, spec: DecoderSpec, state_dict: dict[str, torch.Tensor],
                        tp: TPGroup = SINGLE) -> "TargetModel":
        """Build without random init and adopt the given tensors (HF names, `lm_head` absent if tied;
        under `tp`, this rank's shard). How experts were split is read from the shard itself: fewer experts than
        the model has means expert parallelism."""
        experts = state_dict.get("model.layers.0.mlp.experts.gate_up_proj")
        moe_parallel: MoEParallel = "ep" if experts is not None and experts.shape[0] < spec.num_experts else "tp"
        sparse = next((i for i in range(spec.num_layers) if spec.is_sparse(i)), None)
        if sparse is not None:  # Qwen3 MoE: under "ep" a rank's shard has its own experts only
            prefix = f"model.layers.{sparse}.mlp.experts."
            held = {n[len(prefix):].split(".")[0] for n in state_dict if n.startswith(prefix)}
            moe_parallel = "ep" if len(held) < spec.routed_experts else "tp"
        with torch.device("meta"):
            model = cls(spec, tp, moe_parallel)
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        tied = {"lm_head.weight"} if spec.tie_word_embeddings else set()
        assert set(missing) == tied and not unexpected, (missing, unexpected)
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        drop_replicated_biases(model, tp)
        return model.requires_grad_(False).eval()

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] absolute positions (row-wise increasing)
        slots: torch.Tensor,  # [B] cache slot of each row
        cache: KVCache,
        capture_layers: tuple[int, ...] = (),
        last_index: torch.Tensor | None = None,  # [B]: return logits only at this column per row
        kv_len: int | None = None,  # keys attended: at least max(positions) + 1, known on the host (None: read it)
        run: slice | None = None,  # the slots as one slice of consecutive slots (the caches are then read as views)
        window_key: int = 0,  # sliding layers read keys from this position on (none of their queries sees one before)
        states: RecurrentStates | None = None,  # the Gated DeltaNet layers' (Qwen3.5)
        tree: torch.Tensor | None = None,  # [B, T, T] bool: a draft tree's ancestor mask (speculative/tree.py)
    ) -> TargetOutput:
        """With `tree`, `positions` are the nodes' RoPE positions (start + depth); node t is cached at start + t and
        sees the keys before start and the nodes the mask allows (in sliding-window layers, those of them within the
        window of its position: visible_keys)."""
        cached_at = positions  # where each token's K/V goes: its position, or a tree node's own row
        if tree is not None:
            cached_at = positions[:, :1] + torch.arange(token_ids.shape[1], device=positions.device)
        kv_len = int(cached_at.max()) + 1 if kv_len is None else kv_len
        x = self.embed(token_ids)
        if self.spec.embed_scale != 1.0:  # transformers rounds the scale to the weights' dtype first
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        rope = {t: r(positions, x.dtype) for t, r in self.rotary.items()}
        key_pos = torch.arange(kv_len, device=x.device)
        causal = visible_keys(key_pos[None, None, :], positions, tree)[1]  # [B, T, kv_len]
        window = self.spec.sliding_window
        if window and cache.ring is not None:  # rings (GraphKVCache): entry j holds the latest row r written
            # with r % ring == j, this pass's last or one before it (never written: negative)
            last, entry = cached_at[:, -1:], torch.arange(cache.ring, device=x.device)
            length = entry[-1:] + 1  # (the ring's length as a tensor: the exporter cannot take a tensor % a SymInt)
            rows = (last - (last - entry) % length)[:, None, :]  # [B, 1, ring]
            seen, visible = visible_keys(rows, positions, tree)
            sliding = (rows >= 0) & visible & (seen > positions[:, :, None] - window)
        elif window:  # over keys window_key .. kv_len - 1 only: the mask is built for the keys the layers read
            seen, visible = visible_keys(key_pos[None, None, window_key:], positions, tree)
            sliding = visible & (seen > positions[:, :, None] - window)
        else:
            sliding = causal
        step = None
        if self.linear_index:  # rows past last_index are a batched prefill's padding
            assert states is not None, "a target with Gated DeltaNet layers runs with its states (new_states)"
            T = token_ids.shape[1]
            valid = last_index + 1 if last_index is not None else torch.full_like(slots, T)
            step = states.begin(slots, positions[:, 0], T, valid)
            if tree is not None:  # each node's conv window and state along its own path
                states.tree_walk(step, positions - positions[:, :1], tree)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            windowed = self.spec.is_sliding(i)
            cos, sin = rope[self.rope_keys[i]]
            x = layer(x, cos, sin, cache, i, slots, cached_at, sliding if windowed else causal, run,
                      window_key if windowed else 0,
                      (states, self.linear_index[i], step) if i in self.linear_index else None)
            if i in capture_layers:
                captured[i] = x
        if step is not None:
            states.end(step)
        x = self.model.norm(x)
        # HF's hidden_states[num_layers] (what the reference reads for the last layer id) is taken
        # after the final norm.
        if self.spec.num_layers - 1 in capture_layers:
            captured[self.spec.num_layers - 1] = x
        hidden = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        if last_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_index][:, None]
        return TargetOutput(logits=self.logits(x), hidden=hidden)
