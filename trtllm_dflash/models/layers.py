"""Building blocks shared by the target decoder and the DFlash drafter.

Numerics follow transformers' Llama / Qwen3 modules exactly (RMSNorm in fp32, RoPE tables in fp32,
neox-style rotate_half), so the equality tests against HF can use tight tolerances.

Under `torch.export` (compile/onnx_export.py) RoPE and attention become ONNX's own RotaryEmbedding and
Attention nodes (opset 23), which TensorRT maps to its native layers; eager code never takes those branches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.models.shard import kv_heads, o_proj_columns, padded_vocab, query_heads
from trtllm_dflash.models.spec import DecoderSpec
from trtllm_dflash.parallel.group import SINGLE, TPGroup


def exporting() -> bool:
    """True while torch.export traces the models (compile/onnx_export.py, which registers `torch.ops.onnx`).

    The export traces with dynamo (the models' `int(positions.max())` needs it), and dynamo reads
    torch.onnx.is_in_onnx_export() as False and does not trace the torch.onnx.ops wrappers: hence this test
    and the registered ops themselves below."""
    return torch.compiler.is_exporting()


class RMSNorm(nn.Module):
    """`weight_in_fp32`: gpt-oss and Gemma 4 scale by the weight before casting back (one rounding in bf16),
    Llama / Qwen3 after. `offset`: Qwen3.5 stores weight - 1 (zero-centred) and scales by 1 + weight, in fp32."""

    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.weight_in_fp32, self.offset = eps, weight_in_fp32 or offset, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if exporting() and dtype == torch.float32 and not self.offset:  # one RMSNormalization node (opset 23)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return ((self.weight.float() + 1.0 if self.offset else self.weight.float()) * x32).to(dtype)
        return self.weight * x32.to(dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32 (Gemma 4's v_norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for absolute positions; `positions` may differ per request. `layer_type`: Gemma 4's
    RoPE of that layer type."""

    def __init__(self, spec: DecoderSpec, layer_type: str | None = None):
        super().__init__()
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            inv_freq, scaling = spec.rope_inv_freq(layer_type)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, T, 1, head_dim] (broadcast over heads)
        freqs = positions.float()[..., None] * self.inv_freq
        if exporting():  # RotaryEmbedding's half-width tables: [B, T, head_dim / 2]
            return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos[:, :, None, :], sin[:, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, heads, head_dim]; tables narrower than head_dim (Qwen3.5's partial RoPE) rotate the first dims only
    rotated_dims = cos.shape[-1] * (2 if exporting() else 1)
    if rotated_dims < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotated_dims], cos, sin), x[..., rotated_dims:]), dim=-1)
    if exporting():  # cos, sin: [B, T, head_dim / 2]; the op takes [B, heads, T, head_dim]
        return torch.ops.onnx.RotaryEmbedding.opset23(x.transpose(1, 2), cos, sin).transpose(1, 2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# hidden_act -> the gate's activation: SiLU (Llama / Qwen3), tanh-approximated GELU (Gemma 4)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel (its partial sums all-reduced) over `tp`."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE):
        super().__init__()
        h, i, bias = spec.hidden_size, spec.intermediate_size // tp.size, spec.mlp_bias
        self.tp = tp
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        if spec.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {spec.hidden_act!r} is not supported (only {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce (an expert's: summed with the others' first)."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nn.Module):
    """q/k/v/o projections (+ Qwen3's per-head q_norm/k_norm), named as in HF checkpoints. `spec` is the
    layer's (`DecoderSpec.layer_spec`): Gemma 4 full layers have their own head_dim and KV heads, and with
    attention_k_eq_v no v_proj (V = the k_proj output); Gemma 4 also norms V (without a weight). Qwen3.5: q_proj
    gives each head its query and an output gate ([heads, 2 * head_dim]), and the attention output is multiplied by
    sigmoid(gate) before o_proj.

    Under tensor parallelism (models/shard.py) this rank holds its query and KV heads, and the o_proj
    input columns it multiplies (`o_columns`, a slice of its attention output); `output` all-reduces.
    """

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE):
        super().__init__()
        h, hd, bias = spec.hidden_size, spec.head_dim, spec.attention_bias
        heads, kv = query_heads(spec, tp.size, tp.rank), kv_heads(spec, tp.size, tp.rank)
        cols = o_proj_columns(spec, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads, self.head_dim, self.tp = len(heads), len(kv), hd, tp
        self.o_columns = slice(cols.start - heads.start * hd, cols.stop - heads.start * hd)
        self.output_gate = spec.is_qwen3_5
        self.q_proj = nn.Linear(h, len(heads) * hd * (2 if self.output_gate else 1), bias=bias)
        self.k_proj = nn.Linear(h, len(kv) * hd, bias=bias)
        self.v_proj = None if spec.attention_k_eq_v else nn.Linear(h, len(kv) * hd, bias=bias)
        self.v_norm_eps = spec.rms_norm_eps if spec.is_gemma4 else None
        self.scale = spec.attention_scale  # None: SDPA's default head_dim ** -0.5
        self.o_proj = nn.Linear(len(cols), h, bias=bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps, spec.is_gemma4, spec.is_qwen3_5)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps, spec.is_gemma4, spec.is_qwen3_5)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: one learned sink logit per query head (this rank's heads under tp)
        self.sinks = nn.Parameter(torch.zeros(len(heads))) if spec.attention_sinks else None

    def query(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, hidden] -> [B, T, heads, head_dim]
        return self.query_and_gate(x)[0]

    def query_and_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [B, T, hidden] -> the query [B, T, heads, head_dim] (normed, not yet roped) and Qwen3.5's output gate
        [B, T, heads * head_dim] (None for the other families)."""
        q, gate = self.q_proj(x), None
        if self.output_gate:
            q, gate = q.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
            gate = gate.flatten(2)
        else:
            q = q.unflatten(-1, (self.num_heads, self.head_dim))
        return (self.q_norm(q) if self.q_norm is not None else q), gate

    def key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, T, hidden] -> k, v: [B, T, kv_heads, head_dim] (k normed, not yet roped)
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = k if self.v_proj is None else self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.v_norm_eps is not None:
            v = rms_normalize(v, self.v_norm_eps)
        return (self.k_norm(k) if self.k_norm is not None else k), v

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        # attended (and Qwen3.5's gate): [B, T, heads * head_dim] -> [B, T, hidden], summed over the ranks
        if gate is not None:
            attended = attended * torch.sigmoid(gate)
        return self.tp.all_reduce(self.o_proj(attended[..., self.o_columns]))


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds rows [r * V/tp, (r+1) * V/tp) of the (padded) vocabulary; other ids give zeros before
    the all-reduce."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE):
        self.per_rank = padded_vocab(spec.vocab_size, tp.size) // tp.size
        super().__init__(self.per_rank, spec.hidden_size)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.tp.rank * self.per_rank
        inside = (local >= 0) & (local < self.per_rank)
        x = super().forward(local.clamp(0, self.per_rank - 1)) * inside[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(x)


def drop_replicated_biases(model: nn.Module, tp: TPGroup) -> None:
    """Row-parallel biases are stored on every rank but added once: keep rank 0's."""
    if tp.rank == 0:
        return
    for module in model.modules():
        for linear in ((module.o_proj,) if isinstance(module, AttentionProjections) else
                       (module.down_proj,) if isinstance(module, MLP) else ()):
            if getattr(linear, "bias", None) is not None:
                linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Masked multi-head attention with grouped KV heads.

    q: [B, Tq, heads, hd]; k, v: [B, Tk, kv_heads, hd]; mask: [B, Tq, Tk] bool (True = may attend);
    sinks: [heads] or None; scale: of q.k (None: hd ** -0.5). Returns [B, Tq, heads * hd].
    """
    if scale is not None and sinks is not None:
        raise ValueError("an attention scale other than head_dim ** -0.5 is only supported without sinks.")
    if sinks is not None:
        return _exported_attend_with_sinks(q, k, v, mask, sinks) if exporting() else _attend_with_sinks(
            q, k, v, mask, sinks)
    if exporting():  # ONNX Attention: grouped KV heads from the shapes, the same scale (None: head_dim ** -0.5)
        out = torch.ops.onnx.Attention.opset23(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask[:, None], scale=scale)[0]
        return out.transpose(1, 2).flatten(2)
    if q.is_cuda and q.shape[2] != k.shape[2]:
        return attend_groups_as_rows(q, k, v, mask, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], enable_gqa=q.shape[2] != k.shape[2], scale=scale,
    )  # [B, heads, Tq, hd]
    return out.transpose(1, 2).flatten(2)


def attend_groups_as_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """`attend` in the form a fused CUDA SDPA backend takes: masked GQA without enable_gqa and without copying K/V.

    Why: in torch 2.11-2.13 on CUDA, flash attention refuses any attn_mask, and memory-efficient attention refuses
    unequal query / KV head counts (its GQA support, pytorch#191085, came after 2.13: 2.13's sdp_utils_cpp.h still
    has the two-argument check_batch_size_and_num_heads_dense); cuDNN takes masked GQA but only leads the default
    priority order on sm90/sm100 with cuDNN > 9.15.1, so masked enable_gqa usually runs the math kernel. Expanding
    K/V to the query heads cannot be a view (two strides in one dimension). So the g query heads that share KV head j
    become g * Tq query rows of one head j (query head h = j * g + i reads KV head j; every row's softmax is its own):
    K/V keep kv_heads heads and stay views of the cache, only q (Tq <= a block of tokens) and the mask are copied.
    Equal head counts + an additive float mask [B, 1, g * Tq, Tk] + unit last-dim strides: what the memory-efficient
    backend (sdp_utils.cpp, can_use_mem_efficient_attention) accepts; not run on a GPU here. Masked keys get the
    dtype's lowest value, not -inf, so a row that sees no key (a CUDA graph's padding row) gives no NaN.

    Shapes as `attend`'s: q [B, Tq, heads, hd]; k, v [B, Tk, kv_heads, hd]; mask [B, Tq, Tk] -> [B, Tq, heads * hd]."""
    b, tq, heads, hd = q.shape
    kv, tk = k.shape[2], k.shape[1]
    g = heads // kv
    rows = q.view(b, tq, kv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, kv, g * tq, hd)  # [B, kv, g * Tq, hd]
    bias = torch.where(mask, torch.zeros((), dtype=q.dtype, device=q.device), torch.finfo(q.dtype).min)
    bias = bias[:, None, None].expand(b, 1, g, tq, tk).reshape(b, 1, g * tq, tk)
    out = F.scaled_dot_product_attention(rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale)
    return out.view(b, kv, g, tq, hd).permute(0, 3, 1, 2, 4).flatten(2)  # [B, Tq, heads * hd]


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss eager attention: softmax over [scores, sink] in the compute dtype, the sink's share
    dropped, so a head may attend to nothing. (SDPA has no sink term.)"""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, heads, Tk, hd]: query head h reads KV head h // groups
    v = v.repeat_interleave(groups, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ k.transpose(2, 3) * q.shape[-1] ** -0.5  # [B, heads, Tq, Tk]
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    logits = torch.cat([scores, sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v).transpose(1, 2).flatten(2)


def _exported_attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                                sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks as ONNX's own Attention node (which has no sink input), so TensorRT still gets its
    native attention layer: one extra key and value of zeros, whose score q.0 = 0 plus an additive mask of
    sinks[h] is exactly the sink logit, and whose value adds nothing. The boolean mask becomes additive (0 or the
    dtype's lowest), the same softmax over [scores, sink] as _attend_with_sinks."""
    b, tq = q.shape[:2]
    heads = q.shape[2]
    zero = k.new_zeros(b, 1, *k.shape[2:])  # [B, 1, kv_heads, hd]
    k, v = torch.cat([k, zero], dim=1), torch.cat([v, zero], dim=1)
    bias = torch.where(mask, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)  # [B, Tq, Tk]
    sink = sinks.to(q.dtype)[None, :, None, None].expand(b, heads, tq, 1)
    bias = torch.cat([bias[:, None].expand(b, heads, tq, mask.shape[-1]), sink], dim=-1)  # [B, heads, Tq, Tk + 1]
    out = torch.ops.onnx.Attention.opset23(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=bias)[0]
    return out.transpose(1, 2).flatten(2)


class KVCache:
    """Static per-slot KV cache: one [num_slots, capacity, kv_heads, head_dim] tensor pair per layer
    (`num_kv_heads` / `head_dim` per layer where layers differ, as Gemma 4's sliding and full layers do).

    A request owns one slot. Entries are addressed by absolute position; "cropping" is free because
    readers mask by position, and stale entries past a request's valid length are overwritten before
    they can become visible.
    """

    # The models ask every cache (this one, runtime/kv_blocks.PagedKVCache, compile/onnx_ops.GraphKVCache) whether
    # a layer's write and attention are one op over the cache in place (write_and_attend): only an exported one-token
    # graph's are
    in_place = False
    # ... and whether its sliding-window layers' caches are rings of this many positions, attended whole (only an
    # exported target_step's for onnxruntime are: GraphKVCache)
    ring = None

    def __init__(self, num_layers: int, num_slots: int, capacity: int, num_kv_heads: int | list[int],
                 head_dim: int | list[int], dtype: torch.dtype, device: torch.device | str = "cpu",
                 v_head_dim: list[int] | None = None):
        """`v_head_dim`: per layer, where V's head size differs from K's (a latent attention layer keeps none: V is
        part of K)."""
        kv = num_kv_heads if isinstance(num_kv_heads, list) else [num_kv_heads] * num_layers
        hd = head_dim if isinstance(head_dim, list) else [head_dim] * num_layers
        vd = v_head_dim or hd
        assert len(kv) == len(hd) == len(vd) == num_layers, (kv, hd, vd, num_layers)
        self.k = [torch.zeros(num_slots, capacity, n, d, dtype=dtype, device=device) for n, d in zip(kv, hd)]
        self.v = [torch.zeros(num_slots, capacity, n, d, dtype=dtype, device=device) for n, d in zip(kv, vd)]
        self.capacity = capacity

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [B]; positions: [B, T]; k, v: [B, T, kv_heads, hd]
        rows = slots[:, None].expand_as(positions)
        self.k[layer][rows, positions] = k
        self.v[layer][rows, positions] = v

    def move(self, layer: int, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the slots' entries at positions src [B, n] to positions dst [B, n] (all read before any is written)."""
        rows = slots[:, None].expand_as(src)
        self.k[layer][rows, dst] = self.k[layer][rows, src]
        self.v[layer][rows, dst] = self.v[layer][rows, src]

    def read(self, layer: int, slots: torch.Tensor, length: int, run: slice | None = None, first: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, length - first, kv_heads, hd] of the slots' positions first .. length - 1. With `run` (the slots as
        one slice of consecutive slots, known on the host), views of the cache: nothing is copied. Otherwise a copy:
        index_select on the [:, first:length] view copies the same rows as advanced indexing [slots, first:length],
        2.5x (batch 1) to 4.5x (batch 8) faster on the CPU."""
        if run is not None:
            return self.k[layer][run, first:length], self.v[layer][run, first:length]
        return (self.k[layer][:, first:length].index_select(0, slots),
                self.v[layer][:, first:length].index_select(0, slots))
