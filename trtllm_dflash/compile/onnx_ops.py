"""Custom ops of the exported graphs: the KV-cache write (ONNX TensorScatter), the tensor-parallel
collectives (TensorRT's DistCollective), and experts as one node (onnxruntime's com.microsoft.MoE, TensorRT's
TRT_MoE).

## KV cache: ONNX TensorScatter writes into caches that are graph inputs

The models read and write their caches only through `KVCache.write` / `KVCache.read` (models/layers.py).
`GraphKVCache` has the same two methods over per-layer tensors `[batch, kv_heads, max_len, head_dim]` that
are graph inputs; each write returns a new tensor (the graph output "present"), which the runtime binds to
the input's own buffer, so the write happens in place:

    past_key_i [batch, kv_heads, max_len, hd] --TensorScatter(update [batch, kv_heads, T, hd],
                                                  write_indices [batch], axis=2)--> present_key_i

TensorScatter (ONNX opset 24) writes update[b] at positions write_indices[b] .. + T - 1 of row b; its batch
axis is the cache's axis 0, so row b of the cache belongs to row b of the step (see onnx_export.py for how
an executor binds the rows of its slots). TensorRT parses it into its KV-cache update layer
(docs/backends.md §Facts found).

`tensor_scatter` is a torch custom op with a real eager implementation (so the export wrappers also run
in plain torch) and an onnxscript translation for the exporter (TRANSLATIONS).

## Collectives: TensorRT's DistCollective (tp > 1)
A rank's graph sums its row-parallel partial outputs and gathers its vocabulary shard of the logits with
one `DistCollective` node each (domain `trt`, the node polygraphy's multi-device sharding emits, which
TensorRT's ONNX parser (10.16+) turns into an IDistCollectiveLayer over NCCL):

    DistCollective(x, collective_operation="all_reduce", reduce_op="sum", root=-1,
                   group_size=tp, groups=[0 .. tp-1])
    Transpose(last axis first) -> DistCollective(collective_operation="all_gather", reduce_op="none", ...)
                               -> Transpose(back)        all_gather concatenates along axis 0

Found with TensorRT-RTX 1.7.1's parser (tests/test_tensorrt_build.py): the default ONNX domain fails
onnx.checker ("No Op registered for DistCollective"), any other domain parses; root must be -1 and
reduce_op "none" for these two operations; `groups` lists the ranks (or is empty with group_size 0). The
parser leaves the layer's `num_ranks` at 1, which sizes an all_gather's output: compile/tensorrt_build.py
sets it to the graph's group_size after parsing. onnxruntime cannot run these nodes: tp > 1 graphs are for
TensorRT only.

## Experts: onnxruntime's com.microsoft.MoE (graphs for onnxruntime only)
A mixture-of-experts MLP whose rank holds every expert (gpt-oss under `moe_parallel: tp`, Qwen3 MoE), unquantized,
is one `MoE` node in graphs exported for onnxruntime: router logits in, the top k experts run on their tokens only
(onnxruntime's CPU kernel routes; the softmax over all logits, the top k, renormalized with
normalize_routing_weights). Its CPU kernel takes the interleaved SwiGLU only (swiglu_fusion=1: gate and up rows
alternating in fc1 [E, 2I, H]): gpt-oss's own layout, and Qwen3 MoE's gate/up rows interleaved at export;

    swiglu = G * sigmoid(alpha * G) * (L + beta),  G = min(g, limit), L = clamp(l, -limit, limit)

gpt-oss: alpha 1.702, beta 1, limit 7 and biases; Qwen3 MoE: alpha 1, beta 0, no limit (silu(g) * l), no biases.
Found here (onnxruntime 1.32, fp32): equal to models/moe.py within 1.5e-7 of the outputs' scale for both;
swiglu_fusion=2 is refused on the CPU ("CPU MoE only supports interleaved SwiGLU format"). TensorRT cannot parse
the node: compile refuses graphs that hold it (metadata `experts_op`).

## Experts: TensorRT's TRT_MoE (IMoELayer; graphs for TensorRT)
The same MLPs in graphs for TensorRT are one `trt::TRT_MoE` node (`trt_moe`): the routing in plain ops before it, the
chosen experts and their weights in, gate / up / down weights as three [E, H, I] / [E, H, I] / [E, I, H] tensors, the
SwiGLU's limit / alpha / beta as attributes (docs/backends.md §gpt-oss in the graphs). IMoELayer builds on SM 10.x /
11.x only, so compile keeps the node there and elsewhere rewrites it into plain ops first (`dense_experts`, the same
computation as trt_moe's torch form).

## FP8 linears: QuantizeLinear / DequantizeLinear (ONNX's own, float8e4m3fn)
An FP8 engine's linear keeps ModelOpt's stored format in the graph: its weight is a FLOAT8E4M3FN initializer
read through DequantizeLinear(weight, weight_scale), its input goes through QuantizeLinear(x, input_scale,
saturating) + DequantizeLinear, both in float32 (as models/quantized.py emulates them), and the MatMul
follows. This is the Q/DQ pattern TensorRT fuses into FP8 GEMMs (on GPUs with FP8: SM89+); onnxruntime's
CPU kernels run the same nodes exactly.

## NVFP4 linears: ModelOpt's ONNX form (TensorRT only)
The weight is a FLOAT4E2M1 initializer (the checkpoint's packed bytes as they are: ONNX packs element 2i in
the low nibble, as ModelOpt does) read through DequantizeLinear(weight, DequantizeLinear(weight_scale [FP8,
one per 16-block], weight_scale_2), block_size=16); the input goes through TensorRT's
`trt::TRT_FP4DynamicQuantize(x, input_scale, block_size=16)` (per-block FP8 scales computed at run time,
as models/quantized.py emulates) and two DequantizeLinear nodes, in float16 for float32 engines (TensorRT's
strongly typed FP4 Q/DQ take 16-bit inputs; ModelOpt's exporter casts the same way). TensorRT-RTX parses the
node into its DYNAMIC_QUANTIZE layer; onnxruntime has no kernel for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from onnx import TensorProto
from onnx.defs import OpSchema
import onnx_ir as ir
from onnxscript import values
from onnxscript.onnx_opset import opset24

from trtllm_dflash.models.linear_attention import READ_KINDS, RecurrentPass, chunk_scanned, token_by_token
from trtllm_dflash.models.moe import swiglu
from trtllm_dflash.quantize.fp8 import fake_quant_fp8_activation
from trtllm_dflash.quantize.nvfp4 import BLOCK_SIZE as NVFP4_BLOCK
from trtllm_dflash.quantize.nvfp4 import NVFP4Weight, dequantize_nvfp4, fake_quant_nvfp4_activation

TENSOR_SCATTER_OPSET = 24
FLOAT, FLOAT16, FLOAT8E4M3FN = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.FLOAT8E4M3FN
COLLECTIVE_DOMAIN, COLLECTIVE_OP = "trt", "DistCollective"  # TensorRT's own nodes (domain "trt")
FP4_QUANTIZE_OP = "TRT_FP4DynamicQuantize"


def _dist_collective_schema() -> OpSchema:
    """The node's signature, for the exporter's graph builder (onnx registers no schema for it)."""
    attr = OpSchema.Attribute
    return OpSchema(
        COLLECTIVE_OP, COLLECTIVE_DOMAIN, 1, doc="TensorRT's DistCollective (IDistCollectiveLayer)",
        inputs=[OpSchema.FormalParameter("input", "T")], outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[attr("collective_operation", OpSchema.AttrType.STRING, ""),
                    attr("reduce_op", OpSchema.AttrType.STRING, ""),
                    attr("root", OpSchema.AttrType.INT, ""), attr("group_size", OpSchema.AttrType.INT, ""),
                    attr("groups", OpSchema.AttrType.INTS, "")],
    )


_dist_collective = values.Op(values.Opset(COLLECTIVE_DOMAIN, 1), COLLECTIVE_OP, _dist_collective_schema())


@torch.library.custom_op("dflash_onnx::tensor_scatter", mutates_args=())
def tensor_scatter(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor, circular: bool = False
                   ) -> torch.Tensor:
    """ONNX TensorScatter(axis=2): cache [B, H, L, D], update [B, H, T, D] written at write_indices [B] on; mode
    "linear", or "circular" (a ring of L positions: position p at p % L)."""
    assert cache.ndim == 4 and update.shape[:2] == cache.shape[:2] and write_indices.shape == cache.shape[:1]
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]  # [B, 1]
    cols = write_indices[:, None] + torch.arange(update.shape[2], device=cache.device)  # [B, T]
    out = cache.clone()
    out[rows, :, cols % cache.shape[2] if circular else cols] = update.transpose(1, 2)  # indexed view: [B, T, H, D]
    return out


@tensor_scatter.register_fake
def _(cache, update, write_indices, circular=False):
    return torch.empty_like(cache)


def _tensor_scatter_onnx(cache, update, write_indices, circular: bool = False):
    return opset24.TensorScatter(cache, update, write_indices, axis=2, mode="circular" if circular else "linear")


@torch.library.custom_op("dflash_onnx::ring_rewrite", mutates_args=())
def ring_rewrite(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """A ring's circular write (tensor_scatter with `circular`: position p at p % L), exported as TensorRT can write it
    in place: its KV-cache update writes linearly only, so the graph computes the whole ring (each entry j the update's
    token (j - write_indices[b]) mod L where that is < T, else the entry as it was) and writes it at 0. Same result."""
    return tensor_scatter(cache, update, write_indices, True)


@ring_rewrite.register_fake
def _(cache, update, write_indices):
    return torch.empty_like(cache)


def _ring_rewrite_onnx(cache, update, write_indices):
    ring = opset24.Shape(cache, start=2, end=3)  # [1] (static in a plan: TensorRT's caches are)
    tokens = opset24.Shape(update, start=2, end=3)
    zero, one = opset24.Constant(value_int=0), opset24.Constant(value_int=1)
    entries = opset24.Range(zero, opset24.Squeeze(ring), one)  # [L]
    offset = opset24.Mod(opset24.Sub(opset24.Unsqueeze(entries, zero), opset24.Unsqueeze(write_indices, one)),
                         ring)  # [B, L]: (j - start) mod L, non-negative (integer Mod takes the divisor's sign)
    axes = opset24.Constant(value_ints=[1, 3])
    token = opset24.Expand(opset24.Unsqueeze(opset24.Min(offset, opset24.Sub(tokens, one)), axes),
                           opset24.Shape(cache))  # [B, H, L, D]: the update's token for each entry (clamped)
    written = opset24.Unsqueeze(opset24.Less(offset, tokens), axes)  # [B, 1, L, 1]
    whole = opset24.Where(written, opset24.GatherElements(update, token, axis=2), cache)
    return opset24.TensorScatter(cache, whole, opset24.Mul(write_indices, zero), axis=2, mode="linear")


GQA_DOMAIN, GQA_OP = "com.microsoft", "GroupQueryAttention"


@torch.library.custom_op("dflash_onnx::attend_in_place", mutates_args=())
def attend_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_key: torch.Tensor,
                    past_value: torch.Tensor, starts: torch.Tensor, heads: int, kv_heads: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """onnxruntime's GroupQueryAttention for passes of one token per row, the caches read and written where they lie:
    q [B, 1, heads * D], k / v [B, 1, kv_heads * D] (roped), caches [B, kv_heads, L, D], starts [B] (each row's
    position). Row b's k / v go to position starts[b], and its query attends to positions 0 .. starts[b] (scale
    D ** -0.5; query head h reads KV head h // (heads / kv_heads)). Returns (out [B, 1, heads * D], present_key,
    present_value)."""
    b, d = q.shape[0], past_key.shape[3]
    rows = torch.arange(b, device=q.device)
    keys, values = past_key.clone(), past_value.clone()
    keys[rows, :, starts] = k.view(b, kv_heads, d)
    values[rows, :, starts] = v.view(b, kv_heads, d)
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] <= starts[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(q.view(b, 1, heads, d).transpose(1, 2), keys, values,
                                         attn_mask=visible[:, None, None], enable_gqa=True)  # [B, heads, 1, D]
    return out.transpose(1, 2).flatten(2), keys, values


@attend_in_place.register_fake
def _(q, k, v, past_key, past_value, starts, heads, kv_heads):
    return torch.empty_like(q), torch.empty_like(past_key), torch.empty_like(past_value)


def _gqa_schema() -> OpSchema:
    attr, param = OpSchema.Attribute, OpSchema.FormalParameter
    return OpSchema(
        GQA_OP, GQA_DOMAIN, 1, doc="onnxruntime's grouped query attention over a KV cache",
        inputs=[param("query", "T"), param("key", "T"), param("value", "T"), param("past_key", "T"),
                param("past_value", "T"), param("seqlens_k", "M"), param("total_sequence_length", "M")],
        outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("M", ["tensor(int32)"], "")],
        attributes=[attr("num_heads", OpSchema.AttrType.INT, ""), attr("kv_num_heads", OpSchema.AttrType.INT, "")],
    )


_gqa = values.Op(values.Opset(GQA_DOMAIN, 1), GQA_OP, _gqa_schema())


def _attend_in_place_onnx(q, k, v, past_key, past_value, starts, heads: int, kv_heads: int):
    # seqlens_k is each row's total length - 1 (its start); total_sequence_length a scalar, the longest total. With
    # past and present bound to one buffer, the kernel writes the new K / V in place and reads the rest where it lies.
    seqlens = opset24.Cast(starts, to=TensorProto.INT32)
    total = opset24.Cast(opset24.Add(opset24.ReduceMax(starts, keepdims=0), opset24.Constant(value_int=1)),
                         to=TensorProto.INT32)
    return _gqa(q, k, v, past_key, past_value, seqlens, total, num_heads=heads, kv_num_heads=kv_heads, _num_outputs=3)


def _group(group_size: int) -> dict:
    return {"root": -1, "group_size": group_size, "groups": list(range(group_size))}


def _run_collective(x: torch.Tensor, group_size: int, gather: bool) -> torch.Tensor:
    """Eager form (the export wrappers also run in plain torch): torch.distributed over `group_size` ranks."""
    if group_size == 1:
        return x.clone()
    if not (dist.is_initialized() and dist.get_world_size() == group_size):
        raise RuntimeError(f"a collective over {group_size} ranks needs torch.distributed with that world size")
    if not gather:
        out = x.clone()
        dist.all_reduce(out)
        return out
    parts = [torch.empty_like(x) for _ in range(group_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


@torch.library.custom_op("dflash_onnx::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum of x over the `group_size` ranks (the row-parallel projections, the vocab-parallel embedding)."""
    return _run_collective(x, group_size, gather=False)


@all_reduce.register_fake
def _(x, group_size):
    return torch.empty_like(x)


@torch.library.custom_op("dflash_onnx::all_gather_last", mutates_args=())
def all_gather_last(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Every rank's x concatenated along the last axis in rank order (the vocab-parallel logits)."""
    return _run_collective(x, group_size, gather=True)


@all_gather_last.register_fake
def _(x, group_size):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * group_size))


def _all_reduce_onnx(x, group_size: int):
    return _dist_collective(x, collective_operation="all_reduce", reduce_op="sum", **_group(group_size))


def _all_gather_last_onnx(x, group_size: int):
    rank = len(x.shape)
    first = [rank - 1, *range(rank - 1)]  # the gathered (last) axis first: all_gather concatenates axis 0
    back = [*range(1, rank), 0]
    gathered = _dist_collective(opset24.Transpose(x, perm=first), collective_operation="all_gather",
                                   reduce_op="none", **_group(group_size))
    return opset24.Transpose(gathered, perm=back)


@torch.library.custom_op("dflash_onnx::fp8_qdq", mutates_args=())
def fp8_qdq(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """FP8 activation quantize-dequantize (quantize/fp8.py's fake_quant_fp8_activation), in x's dtype."""
    return fake_quant_fp8_activation(x, input_scale)


@fp8_qdq.register_fake
def _(x, input_scale):
    return torch.empty_like(x)


@torch.library.custom_op("dflash_onnx::fp8_dequantize", mutates_args=())
def fp8_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """An FP8 weight [out, in] as float32 (quantize/fp8.py's dequantize_fp8)."""
    return weight.float() * weight_scale.float()


@fp8_dequantize.register_fake
def _(weight, weight_scale):
    return torch.empty(weight.shape, dtype=torch.float32, device=weight.device)


def _fp8_qdq_onnx(x, input_scale):
    q = opset24.QuantizeLinear(opset24.Cast(x, to=FLOAT), input_scale, output_dtype=FLOAT8E4M3FN, saturate=1)
    return opset24.CastLike(opset24.DequantizeLinear(q, input_scale), x)


def _fp8_dequantize_onnx(weight, weight_scale):
    return opset24.DequantizeLinear(weight, weight_scale)


@torch.library.custom_op("dflash_onnx::nvfp4_qdq", mutates_args=())
def nvfp4_qdq(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation quantize-dequantize (quantize/nvfp4.py's fake_quant_nvfp4_activation), in x's dtype."""
    return fake_quant_nvfp4_activation(x, input_scale).to(x.dtype)


@nvfp4_qdq.register_fake
def _(x, input_scale):
    return torch.empty_like(x)


@torch.library.custom_op("dflash_onnx::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """An NVFP4 weight (packed float4_e2m1fn_x2 [..., out, in/2]: a linear, or experts [E, N, K/2]) as float32
    [..., out, in] (quantize/nvfp4.py)."""
    *lead, out, half = weight.shape
    q = NVFP4Weight(weight.view(torch.uint8).reshape(-1, half), weight_scale.reshape(-1, weight_scale.shape[-1]),
                    weight_scale_2.reshape(()))
    return dequantize_nvfp4(q, torch.float32).reshape(*lead, out, 2 * half)


@nvfp4_dequantize.register_fake
def _(weight, weight_scale, weight_scale_2):
    return torch.empty((*weight.shape[:-1], 2 * weight.shape[-1]), dtype=torch.float32, device=weight.device)


def _fp4_dynamic_quantize_schema() -> OpSchema:
    attr = OpSchema.Attribute
    return OpSchema(
        FP4_QUANTIZE_OP, COLLECTIVE_DOMAIN, 1, doc="TensorRT's NVFP4 dynamic block quantization",
        inputs=[OpSchema.FormalParameter("x", "T"), OpSchema.FormalParameter("scale", "tensor(float)")],
        outputs=[OpSchema.FormalParameter("y", "tensor(float4e2m1)"),
                 OpSchema.FormalParameter("y_scale", "tensor(float8e4m3fn)")],
        type_constraints=[("T", ["tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[attr("axis", OpSchema.AttrType.INT, ""), attr("block_size", OpSchema.AttrType.INT, ""),
                    attr("scale_type", OpSchema.AttrType.INT, "")],
    )


_fp4_dynamic_quantize = values.Op(values.Opset(COLLECTIVE_DOMAIN, 1), FP4_QUANTIZE_OP, _fp4_dynamic_quantize_schema())


def _nvfp4_qdq_onnx(x, input_scale):
    # 16-bit Q/DQ: float32 inputs are cast to float16 (bfloat16 / float16 stay)
    low = x if x.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else opset24.Cast(x, to=FLOAT16)
    x4, block_scales = _fp4_dynamic_quantize(low, input_scale, axis=-1, block_size=NVFP4_BLOCK,
                                             scale_type=FLOAT8E4M3FN, _num_outputs=2)
    scales = opset24.CastLike(opset24.DequantizeLinear(block_scales, input_scale), low)
    return opset24.CastLike(opset24.DequantizeLinear(x4, scales, axis=-1, block_size=NVFP4_BLOCK), x)


def _nvfp4_dequantize_onnx(weight, weight_scale, weight_scale_2):
    scales = opset24.DequantizeLinear(weight_scale, weight_scale_2)
    return opset24.DequantizeLinear(weight, scales, axis=-1, block_size=NVFP4_BLOCK)


MOE_DOMAIN, MOE_OP = "com.microsoft", "MoE"


@torch.library.custom_op("dflash_onnx::moe", mutates_args=())
def moe(x: torch.Tensor, router_logits: torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None,
        fc2: torch.Tensor, fc2_bias: torch.Tensor | None, k: int, normalize: bool, alpha: float, beta: float,
        limit: float) -> torch.Tensor:
    """com.microsoft.MoE with an interleaved SwiGLU, in plain torch (every expert over every token): x [N, H],
    router_logits [N, E], fc1 [E, 2I, H] (gate / up rows alternating), fc1_bias [E, 2I], fc2 [E, H, I], fc2_bias
    [E, H]; limit inf: no clamp."""
    top, idx = torch.topk(torch.softmax(router_logits.float(), dim=-1), k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    gate_up = torch.einsum("nh,efh->enf", x, fc1) + (0 if fc1_bias is None else fc1_bias[:, None])
    y = torch.einsum("eni,ehi->enh", swiglu(gate_up[..., ::2], gate_up[..., 1::2], limit, alpha, beta), fc2)
    if fc2_bias is not None:
        y = y + fc2_bias[:, None]
    combine = torch.zeros_like(router_logits, dtype=torch.float32).scatter(1, idx, top)  # [N, E]
    return (y * combine.T[:, :, None].to(y.dtype)).sum(0).to(x.dtype)


@moe.register_fake
def _(x, router_logits, fc1, fc1_bias, fc2, fc2_bias, k, normalize, alpha, beta, limit):
    return torch.empty_like(x)


def _moe_schema() -> OpSchema:
    attr, optional = OpSchema.Attribute, OpSchema.FormalParameterOption.Optional
    param = OpSchema.FormalParameter
    return OpSchema(
        MOE_OP, MOE_DOMAIN, 1, doc="onnxruntime's mixture of experts",
        inputs=[param("input", "T"), param("router_probs", "T"), param("fc1_experts_weights", "T"),
                param("fc1_experts_bias", "T", param_option=optional), param("fc2_experts_weights", "T"),
                param("fc2_experts_bias", "T", param_option=optional)],
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[attr("k", OpSchema.AttrType.INT, ""), attr("activation_type", OpSchema.AttrType.STRING, ""),
                    attr("swiglu_fusion", OpSchema.AttrType.INT, ""),
                    attr("activation_alpha", OpSchema.AttrType.FLOAT, ""),
                    attr("activation_beta", OpSchema.AttrType.FLOAT, ""),
                    attr("swiglu_limit", OpSchema.AttrType.FLOAT, ""),
                    attr("normalize_routing_weights", OpSchema.AttrType.INT, "")],
    )


_moe = values.Op(values.Opset(MOE_DOMAIN, 1), MOE_OP, _moe_schema())


def _moe_onnx(x, router_logits, fc1, fc1_bias, fc2, fc2_bias, k: int, normalize: bool, alpha: float, beta: float,
              limit: float):
    limits = {"swiglu_limit": limit} if math.isfinite(limit) else {}
    return _moe(x, router_logits, fc1, fc1_bias, fc2, fc2_bias, k=k, activation_type="swiglu", swiglu_fusion=1,
                activation_alpha=alpha, activation_beta=beta, normalize_routing_weights=int(normalize), **limits)


TRT_MOE_DOMAIN, TRT_MOE_OP = COLLECTIVE_DOMAIN, "TRT_MoE"  # TensorRT's IMoELayer (any domain parses; "trt" as ours)
ROUTED_EXPERTS_SM_MAJORS = (10, 11)  # where IMoELayer builds (NvInfer.h: Blackwell and Thor; SM 12.x not supported)


@torch.library.custom_op("dflash_onnx::trt_moe", mutates_args=())
def trt_moe(x: torch.Tensor, experts: torch.Tensor, scores: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
            down: torch.Tensor, gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None,
            down_bias: torch.Tensor | None, limit: float, alpha: float, beta: float) -> torch.Tensor:
    """TensorRT's TRT_MoE node (IMoELayer, as NvInfer.h defines it) in plain torch, in the dense form `dense_experts`
    rewrites it into where IMoELayer cannot build: x [B, S, H] (the layer takes rank 3 only; its kernels are meant for
    S <= 16, so a step's rows are its batch), the chosen experts [B, S, K] and their scores [B, S, K] (the routing,
    done before the node), gate / up [E, H, I] and down [E, I, H] (`x @ W`), biases [E, I], [E, I], [E, H] (all or
    none). Per token: sum over its chosen e of score_e * (swiglu(x @ gate_e + b, x @ up_e + b) @ down_e + b),
    swiglu(g, u) = G * sigmoid(alpha * G) * (U + beta), G = min(g, limit), U = clamp(u, -limit, limit)."""
    flat = x.flatten(0, 1)
    g, u = flat @ gate, flat @ up  # [E, N, I]
    if gate_bias is not None:
        g, u = g + gate_bias[:, None], u + up_bias[:, None]
    y = swiglu(g, u, limit, alpha, beta) @ down  # [E, N, H]
    if down_bias is not None:
        y = y + down_bias[:, None]
    chosen = experts.flatten(0, 1)[:, :, None] == torch.arange(gate.shape[0], device=x.device)  # [N, K, E]
    combine = (chosen.to(scores.dtype) * scores.flatten(0, 1)[:, :, None]).sum(1)  # [N, E]
    return (y * combine.T[:, :, None].to(y.dtype)).sum(0).to(x.dtype).view_as(x)


@trt_moe.register_fake
def _(x, experts, scores, gate, up, down, gate_bias, up_bias, down_bias, limit, alpha, beta):
    return torch.empty_like(x)


def _trt_moe_schema() -> OpSchema:
    attr, optional = OpSchema.Attribute, OpSchema.FormalParameterOption.Optional
    param = OpSchema.FormalParameter
    return OpSchema(
        TRT_MOE_OP, TRT_MOE_DOMAIN, 1, doc="TensorRT's mixture of experts (IMoELayer)",
        inputs=[param("hidden_states", "T"), param("selected_experts", "I"), param("scores", "T"),
                param("fc_gate_weights", "T"), param("fc_up_weights", "T"), param("fc_down_weights", "T"),
                param("fc_gate_bias", "T", param_option=optional), param("fc_up_bias", "T", param_option=optional),
                param("fc_down_bias", "T", param_option=optional)],
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("I", ["tensor(int32)", "tensor(int64)"], "")],
        attributes=[attr("activation_type", OpSchema.AttrType.INT, ""),
                    attr("swiglu_limit", OpSchema.AttrType.FLOAT, ""),
                    attr("swiglu_alpha", OpSchema.AttrType.FLOAT, ""),
                    attr("swiglu_beta", OpSchema.AttrType.FLOAT, "")],
    )


_trt_moe_node = values.Op(values.Opset(TRT_MOE_DOMAIN, 1), TRT_MOE_OP, _trt_moe_schema())
MOE_ACT_SILU = 1  # nvinfer1::MoEActType::kSILU (0 is no activation; a string attribute is read as 0, silently)


def _trt_moe_onnx(x, experts, scores, gate, up, down, gate_bias, up_bias, down_bias, limit: float, alpha: float,
                  beta: float):
    limits = {"swiglu_limit": float(limit)} if math.isfinite(limit) else {}
    return _trt_moe_node(x, experts, opset24.CastLike(scores, x), gate, up, down, gate_bias, up_bias, down_bias,
                         activation_type=MOE_ACT_SILU, swiglu_alpha=float(alpha), swiglu_beta=float(beta), **limits)


def dense_experts(model) -> int:
    """Rewrite every TRT_MoE node of `model` (an onnx.ModelProto, changed in place) into the same computation in
    plain ONNX ops (trt_moe's dense form: every expert over every token, weighted 0 where not chosen), for a GPU
    where IMoELayer does not build and for onnxruntime. Returns how many nodes it rewrote."""
    from onnx import helper

    nodes, rewritten = [], 0
    for node in model.graph.node:
        if (node.domain, node.op_type) != (TRT_MOE_DOMAIN, TRT_MOE_OP):
            nodes.append(node)
            continue
        rewritten += 1
        x, experts, scores, gate, up, down, *biases = (*node.input, "", "", "")[:9]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        limit = attrs.get("swiglu_limit", math.inf)
        name = f"{node.name or TRT_MOE_OP}_dense{rewritten}"
        made = iter(range(10_000))

        def op(op_type: str, *inputs: str, **attributes) -> str:
            out = f"{name}/{op_type}_{next(made)}"
            nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attributes))
            return out

        def const(value, like: str) -> str:  # a scalar of `like`'s dtype
            return op("CastLike", op("Constant", value_float=float(value)), like)

        def ints(*values: int) -> str:
            return op("Constant", value_ints=list(values))

        # [1, B, S, H] @ [E, 1, H, I] -> [E, B, S, I]; biases [E, I] -> [E, 1, 1, I]
        tokens = op("Unsqueeze", x, ints(0))
        g, u = op("MatMul", tokens, op("Unsqueeze", gate, ints(1))), op("MatMul", tokens, op("Unsqueeze", up, ints(1)))
        if biases[0]:
            g = op("Add", g, op("Unsqueeze", biases[0], ints(1, 2)))
            u = op("Add", u, op("Unsqueeze", biases[1], ints(1, 2)))
        if math.isfinite(limit):
            g = op("Min", g, const(limit, x))
            u = op("Max", op("Min", u, const(limit, x)), const(-limit, x))
        swiglu = op("Mul", op("Mul", g, op("Sigmoid", op("Mul", g, const(attrs.get("swiglu_alpha", 1.0), x)))),
                    op("Add", u, const(attrs.get("swiglu_beta", 0.0), x)))
        y = op("MatMul", swiglu, op("Unsqueeze", down, ints(1)))  # [E, B, S, H]
        if biases[2]:
            y = op("Add", y, op("Unsqueeze", biases[2], ints(1, 2)))
        count = op("Squeeze", op("Shape", gate, start=0, end=1), ints(0))  # E, a scalar
        ids = op("Range", op("Constant", value_int=0), count, op("Constant", value_int=1))  # [E]
        chosen = op("Equal", op("Unsqueeze", op("Cast", experts, to=TensorProto.INT64), ints(-1)), ids)  # [B, S, K, E]
        weighted = op("Mul", op("CastLike", chosen, scores), op("Unsqueeze", scores, ints(-1)))
        combine = op("Transpose", op("ReduceSum", weighted, ints(2), keepdims=0), perm=[2, 0, 1])  # [E, B, S]
        combine = op("CastLike", op("Unsqueeze", combine, ints(-1)), y)  # [E, B, S, 1]
        nodes.append(helper.make_node("ReduceSum", [op("Mul", y, combine), ints(0)], list(node.output),
                                      name=f"{name}/output", keepdims=0))  # [B, S, H]
    if rewritten:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return rewritten


# custom_translation_table for torch.onnx.export
TRANSLATIONS = {
    torch.ops.dflash_onnx.nvfp4_qdq.default: _nvfp4_qdq_onnx,
    torch.ops.dflash_onnx.nvfp4_dequantize.default: _nvfp4_dequantize_onnx,
    torch.ops.dflash_onnx.fp8_qdq.default: _fp8_qdq_onnx,
    torch.ops.dflash_onnx.fp8_dequantize.default: _fp8_dequantize_onnx,
    torch.ops.dflash_onnx.tensor_scatter.default: _tensor_scatter_onnx,
    torch.ops.dflash_onnx.ring_rewrite.default: _ring_rewrite_onnx,
    torch.ops.dflash_onnx.attend_in_place.default: _attend_in_place_onnx,
    torch.ops.dflash_onnx.all_reduce.default: _all_reduce_onnx,
    torch.ops.dflash_onnx.all_gather_last.default: _all_gather_last_onnx,
    torch.ops.dflash_onnx.moe.default: _moe_onnx,
    torch.ops.dflash_onnx.trt_moe.default: _trt_moe_onnx,
}


class GraphKVCache:
    """Stands in for `KVCache` while a graph is traced: per-layer caches [batch, kv_heads, max_len, head_dim].

    Row b of every cache is row b of the step's batch: the `slots` the models pass are ignored. Writes
    cover positions[b, 0] .. positions[b, 0] + T - 1, so each row's positions must be consecutive (they
    are: start + arange(T)).

    Rings (`rings`, target_step.onnx): a sliding-window layer's caches hold `ring` positions, not max_len: position p
    lies at p % ring (TensorScatter's circular mode for onnxruntime; `rewrite_rings` for TensorRT, whose KV-cache update
    writes linearly only: the whole ring computed and written at 0, ring_rewrite), and the layer attends over the whole
    ring, masked by the position each entry holds (TargetModel.forward). The executor sizes a ring as the window plus
    the most positions a pass writes, and passes never write more (docs/backends.md §Windowed layers in rings).
    """

    def __init__(self, past: list[torch.Tensor], in_place: bool = False, layers: list[int] | None = None,
                 rings: Sequence[int] = (), rewrite_rings: bool = False):
        """past: [k_0, v_0, k_1, v_1, ...], of the layers numbered `layers` (None: every layer, 0, 1, ...; a hybrid
        model's attention layers only). `in_place` (target_decode.onnx, one token per row): each layer's write and
        attention are one GroupQueryAttention node (write_and_attend) that reads and writes the cache where it lies.
        `rings`: the layers whose caches are rings; `rewrite_rings`: written as TensorRT can (ring_rewrite)."""
        layers = range(len(past) // 2) if layers is None else layers
        self.keys, self.values = dict(zip(layers, past[0::2])), dict(zip(layers, past[1::2]))
        self.in_place = in_place
        self._rings = frozenset(rings)
        self._rewrite_rings = rewrite_rings

    @property
    def ring(self) -> torch.SymInt | int | None:
        """The rings' length (the graph's `ring` dimension), None without rings."""
        return self.keys[min(self._rings)].shape[2] if self._rings else None

    def write_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
        """`in_place` graphs: q [B, 1, heads, D], k / v [B, 1, kv_heads, D] (roped) at positions [B, 1] -> the
        attention output [B, 1, heads * D], the caches updated (attend_in_place)."""
        out, self.keys[layer], self.values[layer] = attend_in_place(
            q.flatten(2), k.flatten(2), v.flatten(2), self.keys[layer], self.values[layer], positions[:, 0], q.shape[2],
            k.shape[2])
        return out

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        # positions: [B, T]; k, v: [B, T, kv_heads, hd]
        start = positions[:, 0]
        ring = layer in self._rings
        if ring and self._rewrite_rings:
            self.keys[layer] = ring_rewrite(self.keys[layer], k.transpose(1, 2), start)
            self.values[layer] = ring_rewrite(self.values[layer], v.transpose(1, 2), start)
            return
        self.keys[layer] = tensor_scatter(self.keys[layer], k.transpose(1, 2), start, ring)
        if v.shape[-1]:  # (a latent attention layer's V is zero-wide: nothing to write, and TensorRT-RTX 1.7's
            # builder fails on a KV-cache update of zero width: "MyelinCheckException ... is_update_tensor()")
            self.values[layer] = tensor_scatter(self.values[layer], v.transpose(1, 2), start, ring)

    def read(self, layer: int, slots: torch.Tensor, length: int, run: slice | None = None, first: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [B, length - first, kv_heads, hd]; the bound rows are the batch's own (`run` is KVCache.read's)
        torch._check(length <= self.keys[layer].shape[2])
        return (self.keys[layer][:, :, first:length].transpose(1, 2),
                self.values[layer][:, :, first:length].transpose(1, 2))

    def present(self) -> list[torch.Tensor]:
        """[k_0, v_0, k_1, v_1, ...] after the writes."""
        return [t for kv in zip(self.keys.values(), self.values.values()) for t in kv]


class GraphRecurrentStates:
    """Stands in for `RecurrentStates` (models/linear_attention.py) while target_step.onnx is traced: per Gated DeltaNet
    layer the bound rows of its six buffers (STATE_KINDS: conv inputs [batch, K - 1 + depth, C], state [batch, H, dk,
    dv], the pass's delta_k / delta_v / delta_g / delta_beta [batch, depth, ...]: outputs only), and two inputs made
    by the executor, which keeps where each row's kept tokens begin: `kept` [batch] (the last pass's tokens before
    this pass's start) and `valid` [batch] (real tokens per row).

    The replay of the kept tokens is not in this graph: target_replay.onnx ran it before (TargetReplay), so each
    row's `state` already holds the state after them, and this graph only writes the delta_* (no past_delta_*
    inputs). Binding present_conv / present_state to the memory of past_conv / past_state is then safe: each is
    computed from every read of its buffer. (One graph that replayed and wrote the delta_* would not be: nothing
    orders the replay's reads of a delta_* buffer before its write, which does not depend on them.)"""

    def __init__(self, past: list[torch.Tensor], kept: torch.Tensor, valid: torch.Tensor, kernel: int, depth: int):
        """past: [conv, state] of the first layer, then of the second, ... (READ_KINDS); `depth`: the most tokens a
        pass keeps (the delta_* buffers' length)."""
        self.buffers = [list(past[i:i + len(READ_KINDS)]) for i in range(0, len(past), len(READ_KINDS))]
        self.kept, self.valid, self.kernel, self.depth = kept, valid, kernel, depth

    def begin(self, slots: torch.Tensor, starts: torch.Tensor, tokens, valid: torch.Tensor) -> RecurrentPass:
        """RecurrentStates.begin with the graph's `kept` and `valid`; whether the pass keeps its inputs (2 <= tokens
        <= depth: a one-token pass advances the state, as RecurrentStates' with one_token_advances) a tensor, since
        `tokens` is the graph's dynamic length."""
        n = starts.new_ones(tokens).sum()
        keep_all = (n <= self.depth) & (n > 1)
        return RecurrentPass(slots, starts, self.kept, (starts > 0).to(torch.float32)[:, None], self.valid, tokens,
                             keep_all)

    def end(self, step: RecurrentPass) -> None:
        pass  # the executor keeps where each row's kept tokens begin

    def read(self, layer: int, step: RecurrentPass) -> tuple[torch.Tensor, torch.Tensor]:
        """RecurrentStates.read without the replay (done by target_replay.onnx)."""
        conv, state = self.buffers[layer][:2]
        rows = step.kept[:, None] + torch.arange(self.kernel - 1, device=conv.device)  # [B, K - 1]
        before = conv.gather(1, rows[:, :, None].expand(-1, -1, conv.shape[2]))
        return before * step.fresh[:, :, None].to(conv.dtype), state * step.fresh[:, :, None, None]

    def recur(self, step: RecurrentPass, q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
        """RecurrentStates.recur as one Scan over the pass's chunks of 16 tokens, prompts and verify blocks alike
        (`chunk_scanned`: where the torch executor runs a verify block token by token and a prompt in chunks of 64
        solved row by row, so the values may differ from the torch executor's in the last bits)."""
        out, final = chunk_scanned(q, k, v, g, beta, state)
        return out, torch.where(step.keep_all, state, final)

    def write(self, layer: int, step: RecurrentPass, inputs: torch.Tensor, state: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """RecurrentStates.write: a pass that keeps its inputs writes them at the start of each buffer; a longer one
        (a prompt) the K - 1 conv inputs before each row's end. What lies past them is never read (the next pass
        reads at most the kept tokens and the K - 1 conv inputs before them), so each buffer is written whole, padded
        with zeros, without reading it: the delta_* are written here and read by target_replay only."""
        conv = self.buffers[layer][0]
        head = self.kernel - 1
        rows = step.valid[:, None] + torch.arange(head, device=inputs.device)  # the K - 1 before each row's end
        last = inputs.gather(1, rows[:, :, None].expand(-1, -1, inputs.shape[2]))
        conv = torch.where(step.keep_all, _padded(inputs, conv.shape[1]), _padded(last, conv.shape[1]))
        self.buffers[layer] = [conv, state, *(_padded(new, self.depth) for new in (k, v, g, beta))]

    def present(self) -> list[torch.Tensor]:
        """STATE_KINDS' buffers of the first layer, then of the second, ... after the pass."""
        return [t for layer in self.buffers for t in layer]


class GraphOneTokenStates(GraphRecurrentStates):
    """GraphRecurrentStates for target_decode.onnx of a hybrid target, one token per row: the token's step of the gated
    delta rule as plain ops (no Scan), and, since a one-token pass advances the state (RecurrentStates'
    one_token_advances: no later pass replays its token), only conv and state read and written (bound in place), no
    delta_*. Its rows' kept tokens were replayed by target_replay.onnx before, as for target_step."""

    def __init__(self, past: list[torch.Tensor], kept: torch.Tensor, kernel: int, depth: int):
        super().__init__(past, kept, None, kernel, depth)

    def begin(self, slots: torch.Tensor, starts: torch.Tensor, tokens, valid: torch.Tensor) -> RecurrentPass:
        return RecurrentPass(slots, starts, self.kept, (starts > 0).to(torch.float32)[:, None], valid, tokens, False)

    def recur(self, step: RecurrentPass, q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
        return token_by_token(q, k, v, g, beta, state)  # (one token: one step)

    def write(self, layer: int, step: RecurrentPass, inputs: torch.Tensor, state: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """The K - 1 conv inputs up to the token (inputs: the K - 1 read, then the token's) at the buffer's start, the
        state after the token."""
        conv = self.buffers[layer][0]
        self.buffers[layer] = [_padded(inputs[:, 1:], conv.shape[1]), state]


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, T, ...] as [B, length, ...]: its first `length` positions, zeros after its end (T any)."""
    pad = x.new_zeros(x.shape[0], length, *x.shape[2:])
    return torch.cat([x, pad], dim=1)[:, :length]
