"""Our cached, batched drafter equals a from-scratch implementation of the drafter's equations
(docs/algorithm.md §The drafter; DFlash2: §DFlash2 drafters).

The reference below recomputes everything for one request in float64, with no cache and no mask:
the context features of all committed positions and the block go through every layer together. For a DFlash2
drafter it also applies the convolutions row by row and tap by tap, and walks the candidate selector candidate by
candidate.
"""

import math

import torch
from safetensors.torch import load_file

from trtllm_dflash.checkpoint.formats import load_drafter
from trtllm_dflash.models.drafter import DFlashDrafter


def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):  # x: [T, heads, hd]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv  # [T, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def conv(W, name, side, x, source, group):
    """DFlash2's causal convolution of one block's rows x [T, H] (`side` 0: a sublayer's input, 1: its output), with
    the dynamic kernel projected from `source` (the sublayer's normed input): out[i] = sum over taps t <= i of
    (base[side, t] + delta[i, side, t] per channel group) * x[i - t]."""
    base, proj = W[f"{name}.base_kernel"], W[f"{name}.kernel_projection.weight"]
    taps = base.shape[1]
    delta = (source @ proj.T).view(x.shape[0], 2, taps, -1)
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(min(taps, i + 1)):
            out[i] += (base[side, t] + delta[i, side, t].repeat_interleave(group)) * x[i - t]
    return out


def reference_walk(W, logits, hidden, anchor, top_k):
    """DFlash2's drafts: logits [K, V], hidden [K, H]; at each position the best of the top_k tokens by
    logit + sum_r pred[previous, r] * (hidden_projection h)[r] * succ[candidate, r], one candidate at a time."""
    pred, succ = W["candidate_selector.predecessor_codebook"], W["candidate_selector.successor_codebook"]
    proj = W["candidate_selector.hidden_projection.weight"]
    previous, drafts = anchor, []
    for i in range(logits.shape[0]):
        h = proj @ hidden[i]
        candidates = logits[i].argsort(descending=True)[:top_k].tolist()
        score = {c: float(logits[i, c]) + sum(float(pred[previous, r] * h[r] * succ[c, r]) for r in range(len(h)))
                 for c in candidates}
        previous = max(candidates, key=score.__getitem__)
        drafts.append(previous)
    return drafts


def reference_draft(W, spec, target_hidden, block_embeds, start, theta, group=None):
    """target_hidden: [start, n_feat*H] features of positions 0..start-1; block_embeds: [block, H]; `group`: a
    DFlash2 drafter's conv_group_size (None: DFlash)."""
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    ctx = rms(target_hidden @ W["fc.weight"].T, W["hidden_norm.weight"])
    x = block_embeds
    block = x.shape[0]
    pos_ctx, pos_blk = torch.arange(start), start + torch.arange(block)
    for i in range(spec.num_layers):
        L = lambda n: W[f"layers.{i}.{n}"]  # noqa: E731
        normed = rms(x, L("input_layernorm.weight"))
        h = normed if group is None else conv(W, f"layers.{i}.attention_conv", 0, normed, normed, group)
        q = rope(rms((h @ L("self_attn.q_proj.weight").T).view(block, nh, hd), L("self_attn.q_norm.weight")),
                 pos_blk, theta)
        kv_in = torch.cat([ctx, h])
        k = rms((kv_in @ L("self_attn.k_proj.weight").T).view(-1, nkv, hd), L("self_attn.k_norm.weight"))
        k = rope(k, torch.cat([pos_ctx, pos_blk]), theta)
        v = (kv_in @ L("self_attn.v_proj.weight").T).view(-1, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)  # no mask: non-causal
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(block, nh * hd)
        out = attn @ L("self_attn.o_proj.weight").T
        x = x + (out if group is None else conv(W, f"layers.{i}.attention_conv", 1, out, normed, group))
        normed = rms(x, L("post_attention_layernorm.weight"))
        m = normed if group is None else conv(W, f"layers.{i}.mlp_conv", 0, normed, normed, group)
        gate, up = m @ L("mlp.gate_proj.weight").T, m @ L("mlp.up_proj.weight").T
        out = (torch.nn.functional.silu(gate) * up) @ L("mlp.down_proj.weight").T
        x = x + (out if group is None else conv(W, f"layers.{i}.mlp_conv", 1, out, normed, group))
    return rms(x, W["norm.weight"])


def test_cached_batched_drafter_equals_reference(qwen3_pair):
    ckpt = load_drafter(qwen3_pair / "drafter")
    assert len(ckpt.tensors.names()) == 3 + 11 * ckpt.spec.num_layers  # 58 for 5 layers, as in z-lab checkpoints
    check_cached_batched_drafter(ckpt)


def test_dflash2_drafter_equals_reference(dflash2_pair):
    """The convolutions inside the cached, batched drafter (prefill, fused and separate context passes)."""
    ckpt = load_drafter(dflash2_pair / "drafter")
    # + base_kernel and kernel_projection of 2 convolutions a layer, + the selector's 3 (z-lab DFlash2 checkpoints)
    assert len(ckpt.tensors.names()) == 3 + 15 * ckpt.spec.num_layers + 3
    check_cached_batched_drafter(ckpt)


def test_dflash2_drafts_are_the_selectors_walk(dflash2_pair):
    """Drafts of a whole batch == the float64 walk of the reference's hidden states (the target's lm_head as the
    logits), and the selector changes some of them away from the per-position argmax."""
    ckpt = load_drafter(dflash2_pair / "drafter")
    W = {n: ckpt.tensors.get(n) for n in ckpt.tensors.names()}
    W64 = {n: t.double() for n, t in W.items()}
    drafter = DFlashDrafter.from_state_dict(ckpt.spec, ckpt.params, W)
    lm_head = load_file(str(dflash2_pair / "target" / "model.safetensors"))["lm_head.weight"]
    spec, block, top_k = ckpt.spec, ckpt.params.block_size, ckpt.params.dflash2.selector_top_k
    F = len(ckpt.params.target_layer_ids) * spec.hidden_size
    torch.manual_seed(1)
    rows, start = 6, 9
    features, embeds = torch.randn(rows, start, F), torch.randn(rows, block, spec.hidden_size)
    anchors = torch.randint(0, spec.vocab_size, (rows,))
    cache, slots = drafter.new_cache(num_slots=rows, capacity=32), torch.arange(rows)
    drafter.append_context(features, torch.arange(start).expand(rows, -1), slots, cache)
    hidden = drafter(embeds, start + torch.arange(block).expand(rows, -1), torch.full((rows,), start), slots, cache)
    drafts = drafter.greedy_tokens(hidden[:, 1:], lambda h: (h @ lm_head.T).float(), anchors)
    theta = spec.rope_parameters["rope_theta"]
    changed = 0
    for r in range(rows):
        want = reference_draft(W64, spec, features[r].double(), embeds[r].double(), start, theta,
                               ckpt.params.dflash2.conv_group_size)[1:]
        logits = want @ lm_head.double().T
        assert drafts[r].tolist() == reference_walk(W64, logits, want, int(anchors[r]), top_k)
        changed += int((drafts[r] != logits.argmax(-1)).sum())
    assert changed > 0


def check_cached_batched_drafter(ckpt):
    W = {n: ckpt.tensors.get(n) for n in ckpt.tensors.names()}
    drafter = DFlashDrafter.from_state_dict(ckpt.spec, ckpt.params, W)
    group = None if ckpt.params.dflash2 is None else ckpt.params.dflash2.conv_group_size
    W64 = {n: t.double() for n, t in W.items()}
    theta = ckpt.spec.rope_parameters["rope_theta"]
    H, F, block = ckpt.spec.hidden_size, len(ckpt.params.target_layer_ids) * ckpt.spec.hidden_size, ckpt.params.block_size
    torch.manual_seed(0)
    lengths = [5, 11, 8]  # committed positions per request after prefill
    features = [torch.randn(n + block, F) for n in lengths]  # features of every position they will commit
    cache = drafter.new_cache(num_slots=4, capacity=64)
    slots = torch.tensor([3, 1, 0])

    # Prefill: all prompt features, right-padded; padding lands past each start and must stay invisible.
    padded = torch.zeros(3, max(lengths), F)
    for r, n in enumerate(lengths):
        padded[r, :n] = features[r][:n]
    drafter.append_context(padded, torch.arange(max(lengths)).expand(3, -1), slots, cache)
    starts = torch.tensor(lengths)
    context = context_positions = None  # positions committed by the last step that the next draft pass adds itself
    for accepted, fused in (([2, 0, 5], False), ([1, 3, 0], True), ([0, 0, 0], True), (None, None)):
        embeds = torch.randn(3, block, H)
        added = () if context is None else (context, context_positions)
        got = drafter(embeds, starts[:, None] + torch.arange(block), starts, slots, cache, *added)
        for r in range(3):
            s = int(starts[r])
            want = reference_draft(W64, ckpt.spec, features[r][:s].double(), embeds[r].double(), s, theta, group)
            torch.testing.assert_close(got[r].double(), want, atol=1e-4, rtol=1e-4)
        if accepted is None:
            break
        committed = torch.tensor(accepted) + 1
        if fused:
            # As the Decoder does: each request's own committed rows, padded at the end to the longest; the padding
            # lands at or after the next start, masked until overwritten.
            context = torch.zeros(3, int(committed.max()), F)
            for r in range(3):
                context[r, : committed[r]] = features[r][int(starts[r]): int(starts[r] + committed[r])]
            context_positions = starts[:, None] + torch.arange(context.shape[1])
        else:
            # Commit accepted + 1 positions per request in a pass of their own: a full block of features, as a
            # verify pass gives them, whose rows past the committed ones are features of rejected drafts (here
            # noise): those positions must be overwritten before they become visible.
            step = torch.randn(3, block, F)
            for r in range(3):
                step[r, : committed[r]] = features[r][int(starts[r]): int(starts[r] + committed[r])]
            drafter.append_context(step, starts[:, None] + torch.arange(block), slots, cache)
            context = None
        starts = starts + committed
