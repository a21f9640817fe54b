"""The DFlash drafter (z-lab `DFlashDraftModel`), with its context K/V kept per slot.

Equations (docs/algorithm.md §The drafter), per draft layer with block hidden states x and fused target features
ctx = hidden_norm(fc(concat(target hidden of target_layer_ids))):

    Q = rope(q_norm(q_proj(input_layernorm(x))))                          block tokens only
    K = [rope(k_norm(k_proj(ctx))) ; rope(k_norm(k_proj(input_layernorm(x))))]
    V = [v_proj(ctx) ; v_proj(input_layernorm(x))]
    x = x + o_proj(softmax(Q K^T / sqrt(hd)) V)       non-causal: every block query sees all of K
    x = x + mlp(post_attention_layernorm(x))

`x` starts as the target's raw embedding rows of the block times `input_embedding_scale` (1 unless the
drafter's config says otherwise: the target's own scale, e.g. Gemma's sqrt(hidden), is not applied).
A DFlash2 drafter (params.dflash2; z-lab / speculators `DFlash2DraftModel`) convolves each sublayer's input and
output over the block (`GroupedDynamicConv`: h, d = prepare(input_layernorm(x)); x = x + finish(o_proj(attn(h)), d);
the same around the MLP) and drafts by its `CandidateSelector`'s walk instead of a per-position argmax.
`ctx` is the same for every layer and never passes through input_layernorm or an MLP. Its K/V do not
depend on the block, so they are computed once per committed position and cached, exactly what the
reference's DynamicCache + crop achieves: in the draft pass itself for the few positions a step commits
(`forward(..., context=)`, as the reference does), or on their own for many at once (`append_context`: a
prompt, or the positions that plain AR steps held back). The drafter has no embedding: the target's is
used. Nor has it an lm_head, except a speculators-format drafter whose lm_head differs from the target's
(a pruned draft vocabulary): it drafts in its own vocabulary, and d2t maps each draft to a target id.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trtllm_dflash.models.layers import (
    MLP,
    AttentionProjections,
    KVCache,
    RMSNorm,
    Rotary,
    apply_rotary,
    attend,
    drop_replicated_biases,
    exporting,
)
from trtllm_dflash.models.spec import DecoderSpec, DFlash2Params, DFlashParams
from trtllm_dflash.parallel.group import SINGLE, TPGroup


def grouped_dynamic_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int,
                         block: int) -> torch.Tensor:
    """DFlash2's causal convolution within each block: out[i, c] = sum_t (base[t, c] + delta[i, t, c // group_size])
    * x[i - t, c], the taps that reach before a block's first row being zero.

    x: [B, Q, H] rows of Q / block blocks; delta: [B, Q, taps, H / group_size]; base: [taps, H]."""
    B, Q, H = x.shape
    taps, groups = base.shape[0], H // group_size
    xb = x.reshape(B, Q // block, block, groups, group_size)
    delta = delta.reshape(B, Q // block, block, taps, groups, 1)
    out = xb * (base[0].reshape(groups, group_size) + delta[:, :, :, 0])
    for t in range(1, min(taps, block)):
        shifted = torch.cat([xb.new_zeros(B, Q // block, t, groups, group_size), xb[:, :, : block - t]], dim=2)
        out = out + shifted * (base[t].reshape(groups, group_size) + delta[:, :, :, t])
    return out.reshape(B, Q, H)


class GroupedDynamicConv(nn.Module):
    """A DFlash2 sublayer's two convolutions (z-lab / speculators `GroupedDynamicCausalConv`): one projection of the
    sublayer's (normed) input gives both dynamic kernels; `prepare` convolves the input with the first, `finish` the
    sublayer's output with the second. base_kernel [2, taps, H] holds their static parts."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * (hidden_size // group_size), bias=False)
        with torch.no_grad():  # the identity (a DFlash layer), as the reference initializes it for training
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the convolved input, the output side's dynamic kernel) of h [B, Q, H] in blocks of `block` rows."""
        kernels = self.kernel_projection(h).unflatten(-1, (2, self.taps, -1))
        return grouped_dynamic_conv(h, kernels[..., 0, :, :], self.base_kernel[0], self.group_size, block), \
            kernels[..., 1, :, :]

    def finish(self, out: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        return grouped_dynamic_conv(out, delta, self.base_kernel[1], self.group_size, block)


class DraftLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TPGroup, dflash2: DFlash2Params | None = None):
        super().__init__()
        self.self_attn = AttentionProjections(spec, tp)
        self.mlp = MLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if dflash2 is not None:  # DFlash2: a convolution around each sublayer
            self.attention_conv = GroupedDynamicConv(spec.hidden_size, dflash2.conv_kernel_size,
                                                     dflash2.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(spec.hidden_size, dflash2.conv_kernel_size, dflash2.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def attention_input(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block rows' input to attention (normed; DFlash2: convolved) and what `attention_residual` needs."""
        h = self.input_layernorm(x)
        return (h, None) if self.attention_conv is None else self.attention_conv.prepare(h, block)

    def attention_residual(self, attended: torch.Tensor, delta: torch.Tensor | None, block: int) -> torch.Tensor:
        """o_proj of the attention output (DFlash2: convolved with the kernel `attention_input` made)."""
        out = self.self_attn.output(attended)
        return out if delta is None else self.attention_conv.finish(out, delta, block)

    def mlp_residual(self, x: torch.Tensor, block: int) -> torch.Tensor:
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            return self.mlp(h)
        h, delta = self.mlp_conv.prepare(h, block)
        return self.mlp_conv.finish(self.mlp(h), delta, block)


class CandidateSelector(nn.Module):
    """DFlash2's selector: per draft position the `top_k` best tokens of the drafter's logits, each scored
    logit + <predecessor_codebook[previous token] * hidden_projection(hidden), successor_codebook[candidate]>,
    walked greedily from the anchor (each position's choice is the next one's predecessor)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=0.02)  # (the reference's initializer_range)

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor
               ) -> torch.Tensor:
        """Scores [..., k] of candidates [..., k] after predecessors [...] (unary: their logits [..., k], float32)."""
        context = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)
        edges = (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1)
        return unary + edges.float()

    def walk(self, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Drafts [B, K] from logits [B, K, V] (float32) and hidden states [B, K, H] of the positions after anchors [B]."""
        unary, candidates = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        previous, drafts = anchors, []
        for i in range(logits.shape[1]):
            best = self.scores(unary[:, i], hidden[:, i], previous, candidates[:, i]).argmax(dim=-1, keepdim=True)
            previous = candidates[:, i].gather(-1, best).squeeze(-1)
            drafts.append(previous)
        return torch.stack(drafts, dim=1)


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of draft-vocabulary ids; d2t holds offsets (speculators' convention), e.g. with kept target
    ids [0, 5, 9]: d2t = [0, 4, 7], and draft ids [2, 0] -> target ids [9, 0]."""
    return draft_ids + d2t[draft_ids]


class DFlashDrafter(nn.Module):
    """Under tensor parallelism (`tp`) the draft layers are split like the target's; fc and the norms are
    replicated, and so are an own lm_head and d2t (`draft_vocab_size`: its rows; None: the target's lm_head)."""

    def __init__(self, spec: DecoderSpec, params: DFlashParams, tp: TPGroup = SINGLE,
                 draft_vocab_size: int | None = None):
        super().__init__()
        assert spec.qk_norm, "DFlash draft layers are Qwen3 layers (q_norm/k_norm)"
        self.spec, self.params = spec, params
        n_feat = len(params.target_layer_ids)
        self.fc = nn.Linear(n_feat * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(spec, tp, params.dflash2) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = Rotary(spec)
        d2 = params.dflash2
        self.candidate_selector = (None if d2 is None else
                                   CandidateSelector(spec.hidden_size, spec.vocab_size, d2.selector_rank, d2.selector_top_k))
        has_head = draft_vocab_size is not None
        self.draft_lm_head = nn.Linear(spec.hidden_size, draft_vocab_size, bias=False) if has_head else None
        pruned = has_head and draft_vocab_size < spec.vocab_size
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long) if pruned else None)

    def new_cache(self, num_slots: int, capacity: int) -> KVCache:
        s, p = self.spec, self.norm.weight  # (fc may be wrapped by a quantized-input module)
        kv = self.layers[0].self_attn.num_kv_heads
        return KVCache(s.num_layers, num_slots, capacity, kv, s.head_dim, p.dtype, p.device)

    @classmethod
    def from_state_dict(cls, spec: DecoderSpec, params: DFlashParams, state_dict: dict[str, torch.Tensor],
                        tp: TPGroup = SINGLE, draft_vocab_size: int | None = None) -> "DFlashDrafter":
        """Build without random init and adopt the given tensors (z-lab names; under `tp`, this rank's shard)."""
        with torch.device("meta"):
            model = cls(spec, params, tp, draft_vocab_size)
        model.load_state_dict(state_dict, strict=True, assign=True)
        drop_replicated_biases(model, tp)
        return model.requires_grad_(False).eval()

    def forward_blocks(
        self,
        target_hidden: torch.Tensor,  # [B, S, n_feat * hidden] features of every position
        block_embeds: torch.Tensor,  # [B, Q, hidden] embeddings of N blocks of block_size (Q = N * block)
        block_positions: torch.Tensor,  # [B, Q]
        mask: torch.Tensor,  # [B, Q, S + Q] bool: which context and block keys each block query sees
    ) -> torch.Tensor:
        """Many blocks in one differentiable pass without a cache (training); returns normed [B, Q, hidden].

        With mask = (context keys < the block's anchor) + (keys of its own block), each block gets exactly
        what `forward` gives it at inference.
        """
        x = self.scale_embeddings(block_embeds)
        S = target_hidden.shape[1]
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos_c, sin_c = self.rotary(torch.arange(S, device=x.device).expand(x.shape[0], S), x.dtype)
        cos_b, sin_b = self.rotary(block_positions, x.dtype)
        block = self.params.block_size
        for layer in self.layers:
            attn = layer.self_attn
            h, delta = layer.attention_input(x, block)
            q = apply_rotary(attn.query(h), cos_b, sin_b)
            k_ctx, v_ctx = attn.key_value(ctx)
            k_blk, v_blk = attn.key_value(h)
            k = torch.cat([apply_rotary(k_ctx, cos_c, sin_c), apply_rotary(k_blk, cos_b, sin_b)], dim=1)
            v = torch.cat([v_ctx, v_blk], dim=1)
            x = x + layer.attention_residual(attend(q, k, v, mask), delta, block)
            x = x + layer.mlp_residual(x, block)
        return self.norm(x)

    def scale_embeddings(self, block_embeds: torch.Tensor) -> torch.Tensor:
        scale = self.spec.input_embedding_scale
        return block_embeds if scale == 1.0 else block_embeds * scale

    def draft_logits(self, hidden: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
        """A DFlash2 drafter's logits (float32): the target's lm_head's times output_multiplier, soft-capped."""
        d2 = self.params.dflash2
        logits = target_logits(hidden) * d2.output_multiplier
        cap = d2.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy_tokens(self, hidden: torch.Tensor,  # [B, K, hidden] final-normed
                      target_logits: Callable[[torch.Tensor], torch.Tensor],
                      anchors: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy drafts [B, K] as target token ids: the argmax of the target's lm_head (`target_logits`), or
        of the drafter's own lm_head mapped through d2t; a DFlash2 drafter's selector walk from `anchors` [B]."""
        if self.candidate_selector is not None:
            return self.candidate_selector.walk(self.draft_logits(hidden, target_logits), hidden, anchors)
        if self.draft_lm_head is None:
            return target_logits(hidden).argmax(dim=-1)
        ids = self.draft_lm_head(hidden).float().argmax(dim=-1)
        return ids if self.d2t is None else draft_to_target(ids, self.d2t)

    def top_candidates(self, hidden: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor], k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely drafts per position, best first, as target token ids, and their log-probabilities
        (float32): [B, K, k] each (tree drafting: speculative/tree.py). The first are `greedy_tokens`."""
        if self.draft_lm_head is None:
            logprobs = torch.log_softmax(target_logits(hidden), dim=-1)
        else:
            logprobs = torch.log_softmax(self.draft_lm_head(hidden).float(), dim=-1)
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        if self.draft_lm_head is not None and self.d2t is not None:
            ids = draft_to_target(ids, self.d2t)
        return ids, values

    @torch.inference_mode()
    def append_context(
        self,
        target_hidden: torch.Tensor,  # [B, C, n_feat * hidden] captured target features
        positions: torch.Tensor,  # [B, C] their absolute positions
        slots: torch.Tensor,  # [B]
        cache: KVCache,
    ) -> None:
        """Write the context K/V of these positions into every layer's cache."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx)
            cache.write(i, slots, positions, apply_rotary(k, cos, sin), v)

    @torch.inference_mode()
    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, block, hidden]: target embedding of [anchor, MASK...]
        block_positions: torch.Tensor,  # [B, block] = start .. start + block - 1
        context_len: torch.Tensor,  # [B] context positions < context_len are valid (= start)
        slots: torch.Tensor,  # [B]
        cache: KVCache,
        context: torch.Tensor | None = None,  # [B, C, n_feat * hidden] features of positions not yet in the cache
        context_positions: torch.Tensor | None = None,  # [B, C] their absolute positions
        kv_len: int | None = None,  # context keys attended: at least max(context_len), known on the host
        run: slice | None = None,  # the slots as one slice of consecutive slots (the cache is read as views)
    ) -> torch.Tensor:
        """One non-causal pass over the block; returns the final-normed hidden states [B, block, hidden].

        With `context`, the pass first adds those positions to the context cache, as append_context would, in the
        same layers: each layer projects the context rows and the block rows in one K/V projection (the reference's
        k_proj(cat[target_hidden, noise])), writes the context rows' K/V and attends over the updated cache. One
        drafter pass per step instead of two. Context rows at or after a request's context_len are padding: they
        are written, stay masked and are overwritten before they become visible.

        Eager, the block's own K/V are written into the cache too, at the block's positions (at or after context_len:
        masked until the context reaches them, and overwritten by the context's K/V first), and every layer attends to
        one read of positions 0 .. kv_len + block - 1 (at most the cache's capacity; a view where the slots are one run) instead of copying the
        context read into a concatenation with the block: key j is visible to row b's block when
        j < context_len_b + block (its context, then its block, in position order, as the concatenation had them).
        Exported, the context read and the block's K/V are concatenated: a TensorRT plan's cache output must be one
        KV-cache update of its input, so a graph writes each cache once (the context rows)."""
        x = self.scale_embeddings(block_embeds)
        block = x.shape[1]
        kv_len = int(context_len.max()) if kv_len is None else kv_len
        in_cache = not exporting()  # the block's K/V written into the cache and read back with the context
        if context is not None:
            ctx = self.hidden_norm(self.fc(context))
            C = ctx.shape[1]
            cos, sin = self.rotary(torch.cat([context_positions, block_positions], dim=1), x.dtype)
        else:
            C = 0
            cos, sin = self.rotary(block_positions, x.dtype)
        cos_b, sin_b = cos[:, C:], sin[:, C:]
        if in_cache:  # keys 0 .. read - 1: each row's context, then its block, in position order (all < capacity)
            read = min(kv_len + block, cache.capacity)
            keys = torch.arange(read, device=x.device)
            visible = keys[None, :] < (context_len + block)[:, None]
        else:  # keys: the context's kv_len, then the block's
            ctx_visible = torch.arange(kv_len, device=x.device)[None, :] < context_len[:, None]
            visible = torch.cat([ctx_visible, ctx_visible.new_ones(x.shape[0], block)], dim=1)
        mask = visible[:, None, :].expand(-1, block, -1)  # [B, block, keys]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h, delta = layer.attention_input(x, block)
            q = apply_rotary(attn.query(h), cos_b, sin_b)
            k_new, v_new = attn.key_value(h if context is None else torch.cat([ctx, h], dim=1))  # [B, C + block, ...]
            k_new = apply_rotary(k_new, cos, sin)
            if context is not None:
                cache.write(i, slots, context_positions, k_new[:, :C], v_new[:, :C])
            if in_cache:
                cache.write(i, slots, block_positions, k_new[:, C:], v_new[:, C:])  # after the context's padding rows
                k, v = cache.read(i, slots, read, run)
            else:
                k_ctx, v_ctx = cache.read(i, slots, kv_len, run)
                k, v = torch.cat([k_ctx, k_new[:, C:]], dim=1), torch.cat([v_ctx, v_new[:, C:]], dim=1)
            x = x + layer.attention_residual(attend(q, k, v, mask), delta, block)
            x = x + layer.mlp_residual(x, block)
        return self.norm(x)
