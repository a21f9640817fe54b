"""Tensor-parallel split rules: which slice of every target and drafter tensor a rank holds.

The rules are TensorRT-LLM's (docs/tensorrt-llm.md §Tensor parallelism), applied to HF / z-lab tensor names:

- column-parallel (output features, dim 0): q_proj by query heads, k_proj / v_proj by KV heads,
  gate_proj / up_proj by intermediate features;
- row-parallel (input features, dim 1, the partial outputs are all-reduced): o_proj, down_proj;
- vocab-parallel (dim 0): embed_tokens and lm_head, the vocabulary zero-padded to a multiple of tp_size;
- gpt-oss: attention `sinks` by query heads; the router replicated; the experts (models/moe.py) either by
  intermediate features (`moe_parallel` "tp", TensorRT-LLM's default: gate_up_proj's interleaved gate/up
  columns 2i, 2i+1 stay on one rank, down_proj by rows, down_proj_bias replicated and added by rank 0) or
  by whole experts ("ep": every expert tensor by dim 0); quantized experts' block scales (`<p>_weight_scale`) are
  cut like their weights, their per-tensor scales replicated;
- Qwen3 MoE: the router (`mlp.gate`) replicated; the experts (`mlp.experts.{e}.gate_proj` ...) either each cut like a
  dense MLP of moe_intermediate_size (`moe_parallel` "tp") or whole, expert e on rank e // (num_experts / tp_size)
  only ("ep": `holds` says which tensors a rank's file has);
- DeepSeek-V3 / Kimi K2 (multi-head latent attention, models/mla.py): q_b_proj (or q_proj) and kv_b_proj by heads
  (each head's qk_nope + qk_rope / qk_nope + v rows), o_proj by heads' v_head_dim input columns; the latent path
  (q_a_proj, kv_a_proj_with_mqa and their norms) replicated; the router and its e_score_correction_bias replicated,
  the routed experts as Qwen3 MoE's, the shared experts cut like a dense MLP of n_shared_experts x
  moe_intermediate_size;
- Qwen3.5 MoE: as Qwen3 MoE, and the shared expert cut like a dense MLP (under "ep" too), its gate replicated;
- Qwen3.5: q_proj by query heads of [query; gate] rows (2 x head_dim each); a Gated DeltaNet layer by its key and
  value heads: in_proj_qkv and the conv's channels are three parts (q, k by key heads, v by value heads), each cut
  alike (`Split.parts`); in_proj_z, in_proj_a / in_proj_b, dt_bias and A_log by value heads; out_proj row-parallel;
  its gated norm (over one head's values) replicated;
- Gemma 4: each layer split by its own head_dim and KV heads (full layers: global_head_dim,
  num_global_key_value_heads; `DecoderSpec.layer_spec`); its layer_scalar replicated like the norms;
- replicated: norms, q_norm / k_norm, the drafter's fc and hidden_norm, biases of row-parallel linears
  (added by rank 0 only), and the per-tensor scales of quantized linears (weight_scale_2 / input_scale
  for NVFP4, weight_scale / input_scale for FP8), so global scales are identical on every rank.

KV heads fewer than ranks are replicated: rank r holds KV head r // (tp_size / num_kv_heads). Query
heads fewer than ranks are replicated the same way, and each replica of a head takes an equal share of
that head's o_proj input columns, so the all-reduced sum is still exactly one o_proj product.

Every slice is a contiguous range of the logical (unpacked) dimension. Packed or block-scaled tensors
are cut at the same logical range: NVFP4 weights hold 2 values per byte and their weight_scale one
value per 16 inputs, so a row-parallel cut must fall on a multiple of 16 (checked by `check_tp`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from trtllm_dflash.errors import UserError
from trtllm_dflash.models.spec import DecoderSpec

# Quantized linears are cut in blocks of this many inputs (NVFP4's weight_scale block).
ROW_ALIGN = 16

_LINEAR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn\.(?:q|k|v|o)_proj|mlp\.(?:experts\.\d+\.|shared_experts?\.)?"
                     r"(?:gate|up|down)_proj)"
                     r"\.(\w+)$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_SINKS = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.sinks$")
_LINEAR_ATTN = re.compile(r"(?:^|\.)layers\.\d+\.linear_attn\.(\w+?)(?:\.(\w+))?$")
_LATENT_ATTN = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj|q_a_proj|q_a_layernorm|"
                          r"kv_a_proj_with_mqa|kv_a_layernorm)\.(\w+)$")
# (quantized experts, quantize/experts.py: `<p>_weight_scale` is cut like `<p>`; the scalar scales are replicated)
_ROUTED_EXPERT = re.compile(r"(?:^|\.)layers\.\d+\.mlp\.experts\.(\d+)\.")
_EXPERTS = re.compile(r"(?:^|\.)layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)"
                      r"(_bias|_weight_scale|_weight_scale_2|_input_scale)?$")


@dataclass(frozen=True)
class Split:
    """Rank's range [start, stop) of the logical dimension `dim` (of logical size `full`). With `parts`, the dimension
    is those consecutive parts (their sizes) and the rank holds the same fraction [start / full, stop / full) of each
    (a Gated DeltaNet's q, k and v channels)."""

    dim: int
    start: int
    stop: int
    full: int
    parts: tuple[int, ...] = ()


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def _replicas(n: int, tp_size: int) -> int:
    """How many ranks share each of n heads (1 when n >= tp_size)."""
    return max(tp_size // n, 1)


def query_heads(spec: DecoderSpec, tp_size: int, rank: int) -> range:
    per = max(spec.num_heads // tp_size, 1)
    first = rank * spec.num_heads // tp_size if spec.num_heads >= tp_size else rank // _replicas(spec.num_heads, tp_size)
    return range(first, first + per)


def kv_heads(spec: DecoderSpec, tp_size: int, rank: int) -> range:
    n = spec.num_kv_heads
    per = max(n // tp_size, 1)
    first = rank * n // tp_size if n >= tp_size else rank // _replicas(n, tp_size)
    return range(first, first + per)


def o_proj_columns(spec: DecoderSpec, tp_size: int, rank: int) -> range:
    """Columns of o_proj's input (= of the attention output) this rank multiplies."""
    hd, heads = spec.head_dim, query_heads(spec, tp_size, rank)
    rep = _replicas(spec.num_heads, tp_size)
    if rep == 1:
        return range(heads.start * hd, heads.stop * hd)
    share = hd // rep
    first = heads.start * hd + (rank % rep) * share
    return range(first, first + share)


def _expert_split(weight: str, bias: bool, spec: DecoderSpec, tp_size: int, rank: int, moe_parallel: str
                  ) -> Split | None:
    if moe_parallel == "ep":
        per = spec.num_experts // tp_size
        return Split(0, rank * per, (rank + 1) * per, spec.num_experts)
    inter = spec.intermediate_size
    per = inter // tp_size
    if weight == "down_proj":  # [E, I, H] (NVFP4 [E, I/2, H], scale [E, I/16, H]); the bias [E, H] is replicated
        return None if bias else Split(1, rank * per, (rank + 1) * per, inter)
    # gate_up_proj [E, H, 2I] (NVFP4: [E, H/2, 2I], scale [E, H/16, 2I]) / its bias [E, 2I]: interleaved, so
    # features [a, b) are columns [2a, 2b)
    return Split(1 if bias else 2, 2 * rank * per, 2 * (rank + 1) * per, 2 * inter)


def routed_experts_of(spec: DecoderSpec, tp_size: int, rank: int, moe_parallel: str = "tp") -> range:
    """The routed experts (Qwen3 MoE) rank holds: all of them (a slice of each) under "tp", its own under "ep"."""
    if moe_parallel != "ep":
        return range(spec.routed_experts)
    per = spec.routed_experts // tp_size
    return range(rank * per, (rank + 1) * per)


def holds(name: str, spec: DecoderSpec, tp_size: int, rank: int, moe_parallel: str = "tp") -> bool:
    """Whether rank's file has tensor `name` at all: every tensor does, but the routed experts of other ranks under
    moe_parallel "ep"."""
    expert = _ROUTED_EXPERT.search(name) if spec.routed_experts else None
    return expert is None or int(expert.group(1)) in routed_experts_of(spec, tp_size, rank, moe_parallel)


def _linear_attention_split(module: str, leaf: str | None, spec: DecoderSpec, tp_size: int, rank: int
                            ) -> Split | None:
    """A Gated DeltaNet tensor's split: by key and value heads (every rank holds tp_size-th of each)."""
    if leaf not in (None, "weight", "weight_scale") or module == "norm":
        return None  # per-tensor scales, the gated norm: replicated
    nk, nv = spec.linear_num_key_heads * spec.linear_key_head_dim, spec.linear_num_value_heads
    values = nv * spec.linear_value_head_dim
    if module in ("in_proj_qkv", "conv1d"):
        return Split(0, rank, rank + 1, tp_size, parts=(nk, nk, values))
    if module == "out_proj":
        per = values // tp_size
        return Split(1, rank * per, (rank + 1) * per, values)
    full = values if module == "in_proj_z" else nv  # in_proj_a / in_proj_b / dt_bias / A_log: one row per head
    per = full // tp_size
    return Split(0, rank * per, (rank + 1) * per, full)


def _latent_attention_split(module: str, leaf: str, spec: DecoderSpec, tp_size: int, rank: int) -> Split | None:
    """A latent attention tensor's split: the per-head projections by heads, the latent path replicated."""
    if module not in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj") or leaf not in ("weight", "weight_scale"):
        return None  # (o_proj's bias is added by rank 0)
    per = spec.num_heads // tp_size
    rows = {"q_b_proj": spec.qk_nope_head_dim + spec.head_dim, "q_proj": spec.qk_nope_head_dim + spec.head_dim,
            "kv_b_proj": spec.qk_nope_head_dim + spec.v_head_dim, "o_proj": spec.v_head_dim}[module]
    return Split(1 if module == "o_proj" else 0, rank * per * rows, (rank + 1) * per * rows, spec.num_heads * rows)


def split_for(name: str, spec: DecoderSpec, tp_size: int, rank: int, moe_parallel: str = "tp") -> Split | None:
    """The slice of tensor `name` (HF / z-lab name) rank holds; None = replicated."""
    linear = _LINEAR_ATTN.search(name)
    if linear is not None:
        return _linear_attention_split(*linear.groups(), spec, tp_size, rank)
    latent = _LATENT_ATTN.search(name) if spec.is_mla else None
    if latent is not None:
        return _latent_attention_split(*latent.groups(), spec, tp_size, rank)
    if name in _VOCAB:
        per = padded_vocab(spec.vocab_size, tp_size) // tp_size
        return Split(0, rank * per, (rank + 1) * per, spec.vocab_size)
    if _SINKS.search(name):
        heads = query_heads(spec, tp_size, rank)
        return Split(0, heads.start, heads.stop, spec.num_heads)
    experts = _EXPERTS.search(name)
    if experts is not None:
        weight, suffix = experts.groups()
        if suffix in ("_weight_scale_2", "_input_scale"):
            return None
        return _expert_split(weight, suffix == "_bias", spec, tp_size, rank, moe_parallel)
    m = _LINEAR.search(name)
    if m is None:
        return None
    layer, module, leaf = m.groups()
    spec = spec.layer_spec(int(layer))  # (Gemma 4's full layers have their own head_dim and KV heads)
    if leaf not in ("weight", "bias", "weight_scale"):
        return None  # per-tensor scales: replicated
    hd, inter = spec.head_dim, spec.intermediate_size
    if ".experts." in module:  # Qwen3 MoE: each expert cut as a dense MLP of its own width, or whole under "ep"
        if moe_parallel == "ep":
            return None
        inter = spec.moe_intermediate_size
    elif ".shared_experts." in module:  # DeepSeek-V3: n_shared_experts experts as one MLP
        inter = spec.n_shared_experts * spec.moe_intermediate_size
    if module.endswith(("o_proj", "down_proj")):
        if leaf == "bias":
            return None
        if module.endswith("o_proj"):
            cols = o_proj_columns(spec, tp_size, rank)
            return Split(1, cols.start, cols.stop, spec.num_heads * hd)
        per = inter // tp_size
        return Split(1, rank * per, (rank + 1) * per, inter)
    if module.endswith("q_proj"):
        heads, rows = query_heads(spec, tp_size, rank), hd * (2 if spec.is_qwen3_5 else 1)  # (Qwen3.5: + its gate)
        return Split(0, heads.start * rows, heads.stop * rows, spec.num_heads * rows)
    if module.endswith(("k_proj", "v_proj")):
        heads = kv_heads(spec, tp_size, rank)
        return Split(0, heads.start * hd, heads.stop * hd, spec.num_kv_heads * hd)
    per = inter // tp_size  # gate_proj / up_proj
    return Split(0, rank * per, (rank + 1) * per, inter)


def shard_tensor(tensor: torch.Tensor, split: Split | None) -> torch.Tensor:
    """Rank's slice of `tensor` (packed / block-scaled tensors cut at the same logical range)."""
    if split is None or tensor.dim() <= split.dim:
        return tensor
    size = tensor.shape[split.dim]
    if split.parts:
        assert sum(split.parts) == size, (split, tensor.shape)
        pieces, offset = [], 0
        for part in split.parts:
            lo, hi = part * split.start // split.full, part * split.stop // split.full
            pieces.append(tensor.narrow(split.dim, offset + lo, hi - lo))
            offset += part
        return torch.cat(pieces, dim=split.dim)
    if split.dim == 0 and size == split.full and split.stop > size:  # a rank at the padded end of the vocabulary
        part = tensor[split.start: split.stop]
        pad = split.stop - split.start - part.shape[0]
        return torch.cat([part, part.new_zeros((pad, *part.shape[1:]))])
    factor = split.full // size
    assert factor * size == split.full and split.start % factor == 0 and split.stop % factor == 0, (split, tensor.shape)
    return tensor.narrow(split.dim, split.start // factor, (split.stop - split.start) // factor)


def check_tp(spec: DecoderSpec, tp_size: int, what: str, quantized: bool, moe_parallel: str = "tp") -> None:
    """Raise UserError (one sentence naming the field) when `spec` cannot be split over tp_size ranks."""

    def divisible(field: str, n: int) -> None:
        if n % tp_size and tp_size % n:
            raise UserError(f"{what}: {field} {n} is not divisible by tp_size {tp_size} (nor tp_size by it).")

    if spec.is_mla and spec.num_heads % tp_size:  # (each rank its own heads; a head is not shared)
        raise UserError(f"{what}: num_attention_heads {spec.num_heads} is not divisible by tp_size {tp_size}.")
    divisible("num_attention_heads", spec.num_heads)
    divisible("num_key_value_heads", spec.num_kv_heads)
    if spec.num_global_kv_heads:
        divisible("num_global_key_value_heads", spec.num_global_kv_heads)
    head_dims = {("head_dim", spec.head_dim)} | ({("global_head_dim", spec.global_head_dim)}
                                                  if spec.global_head_dim else set())
    for field, hd in sorted(head_dims):
        if spec.num_heads < tp_size and hd % _replicas(spec.num_heads, tp_size):
            raise UserError(f"{what}: {field} {hd} cannot be shared by the "
                            f"{_replicas(spec.num_heads, tp_size)} ranks of each of its {spec.num_heads} heads.")
    if spec.has_recurrent_state:
        for field, n in (("linear_num_key_heads", spec.linear_num_key_heads),
                         ("linear_num_value_heads", spec.linear_num_value_heads)):
            if n % tp_size:
                raise UserError(f"{what}: {field} {n} is not divisible by tp_size {tp_size}.")
    if spec.num_experts and moe_parallel == "ep":
        if spec.num_experts % tp_size:
            raise UserError(f"{what}: num_local_experts {spec.num_experts} is not divisible by tp_size {tp_size}, "
                            "so moe_parallel: ep cannot give every rank the same number of experts.")
    elif spec.intermediate_size % tp_size:
        raise UserError(f"{what}: intermediate_size {spec.intermediate_size} is not divisible by tp_size {tp_size}.")
    if spec.routed_experts and moe_parallel == "ep" and spec.routed_experts % tp_size:
        raise UserError(f"{what}: num_experts {spec.routed_experts} is not divisible by tp_size {tp_size}, so "
                        "moe_parallel: ep cannot give every rank the same number of experts.")
    if spec.n_shared_experts and spec.n_shared_experts * spec.moe_intermediate_size % tp_size:
        raise UserError(f"{what}: the shared experts' width (n_shared_experts x moe_intermediate_size) "
                        f"{spec.n_shared_experts * spec.moe_intermediate_size} is not divisible by tp_size {tp_size}.")
    if spec.routed_experts and moe_parallel != "ep" and spec.moe_intermediate_size % tp_size:
        raise UserError(f"{what}: moe_intermediate_size {spec.moe_intermediate_size} is not divisible by tp_size "
                        f"{tp_size}.")
    if quantized:
        cuts = [len(o_proj_columns(spec.layer_spec(i), tp_size, 0)) for i in range(spec.num_layers)]
        cut = next((c for c in cuts if c % ROW_ALIGN), cuts[0])  # (per layer type for Gemma 4)
        rows = [] if spec.is_mla else [("o_proj input columns per rank", cut)]  # (latent attention: unquantized)
        if not (spec.num_experts and moe_parallel == "ep"):  # (under "ep" every expert stays whole)
            rows.append(("intermediate_size / tp_size", spec.intermediate_size // tp_size))
        if spec.routed_experts and moe_parallel != "ep":
            rows.append(("moe_intermediate_size / tp_size", spec.moe_intermediate_size // tp_size))
        if spec.n_shared_experts:  # DeepSeek-V3's shared experts, cut like a dense MLP
            rows.append(("n_shared_experts x moe_intermediate_size / tp_size",
                         spec.n_shared_experts * spec.moe_intermediate_size // tp_size))
        if spec.has_recurrent_state:  # a Gated DeltaNet's out_proj: its value heads' columns
            rows.append(("linear_num_value_heads x linear_value_head_dim / tp_size",
                         spec.linear_num_value_heads * spec.linear_value_head_dim // tp_size))
        for field, n in rows:
            if n % ROW_ALIGN:
                experts = spec.num_experts and field.startswith("intermediate")
                hint = "; moe_parallel: ep keeps every expert whole" if experts else ""
                raise UserError(f"{what}: {field} is {n}, not a multiple of the quantization block {ROW_ALIGN}, "
                                f"so the row-parallel split at tp_size {tp_size} would cut a block{hint}.")
