"""Mixture-of-experts MLPs: gpt-oss's (`MoEMLP`, numerically as transformers' `GptOssMLP`: router +
`GptOssExperts`) and Qwen3 MoE's (`SparseMoE`, at the end).

gpt-oss:

Per token x [hidden]:

    logits = router.weight @ x + router.bias                        [num_experts]
    top, idx = topk(logits, k); w = softmax(top)                    softmax over the k chosen experts only
    for each chosen expert e (weight w_e):
        gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]        [2 * I], gate / up interleaved: 0::2 / 1::2
        gate = min(gate, 7); up = clamp(up, -7, 7)
        h = (up + 1) * gate * sigmoid(1.702 * gate)                 [I]
        out += w_e * (h @ down_proj[e] + down_proj_bias[e])         [hidden]

Parallelism (`moe_parallel`): "tp" gives every rank a contiguous slice of every expert's intermediate
features (the interleaved gate/up columns 2i, 2i+1 stay together); "ep" gives every rank whole experts.
Either way each rank adds its partial sums and the ranks' outputs are all-reduced; the router is replicated.
Under "tp" the down_proj bias is added by rank 0 only, as the dense row-parallel biases are.

Quantized experts (models/quantized.py) quantize x before routing and h of every expert, each with one scale.

Eagerly (the torch executor) both families run their routed experts as two grouped GEMMs (`routed_grouped`): the
(token, expert) pairs sorted by expert, each expert's rows multiplied by its weights in one call
(`torch.nn.functional.grouped_mm`), the pairs' outputs put back in order and summed per token. No shape depends on the
routing and nothing is read back to the host, so the pass can be captured in a CUDA graph where torch's grouped GEMM
kernel runs (`grouped_gemm_problem`); quantized experts quantize each row's input with its expert's scale. Experts
that cannot be grouped (quantized gate and up inputs at different scales, rows not 16-byte aligned, a dtype grouped_mm
does not take) run expert by expert over the tokens routed to it (`routed_loop`), as transformers does: its
`torch.where` reads the routing on the host.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.models.layers import MLP, exporting
from trtllm_dflash.models.shard import routed_experts_of
from trtllm_dflash.models.spec import DecoderSpec
from trtllm_dflash.parallel.group import SINGLE, TPGroup
from trtllm_dflash.quantize.fp8 import fake_quant_fp8_activation
from trtllm_dflash.quantize.nvfp4 import fake_quant_nvfp4_activation

if TYPE_CHECKING:
    from trtllm_dflash.quantize.experts import QuantizedExperts

MoEParallel = Literal["tp", "ep"]

# transformers' GptOssExperts constants (not read from config.json there either)
ALPHA = 1.702
LIMIT = 7.0

# torch.nn.functional.grouped_mm where torch has it (2.13 does), else the op it calls
_GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm


def grouped_gemm_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the grouped experts could not be captured in a CUDA graph on `device` in `dtype`, or None. torch's
    grouped GEMM reads the group offsets on the device only in its CUTLASS kernel, bfloat16 on SM 9.x / 10.x
    (aten/src/ATen/native/cuda/GroupedBlas.cpp); elsewhere it copies them to the host and loops over the groups. Read
    from torch's source, not run on a GPU here; builds for CUDA >= 13.3 add a cuBLASLt path this check does not know
    (it may refuse a capture they could take)."""
    if device.type != "cuda":
        return None
    if dtype != torch.bfloat16:
        return (f"torch's grouped GEMM for the experts reads its group sizes on the host in {str(dtype)[6:]} (its "
                "device-side kernel is bfloat16 only): build the engine with dtype bfloat16")
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (f"torch's grouped GEMM for the experts reads its group sizes on the host on SM {major}.{minor} (its "
                "device-side kernel runs on SM 9.x and 10.x)")
    return None


def experts_graph_problem(model: nn.Module) -> str | None:
    """Why `model`'s routed experts could not run in a captured CUDA graph on its device, or None (no experts, or
    every MLP of experts runs as grouped GEMMs that read nothing on the host there)."""
    moes = [m for m in model.modules() if isinstance(m, (MoEMLP, SparseMoE))]
    for m in moes:
        stacked = m.stacked() if isinstance(m, SparseMoE) else None
        if isinstance(m, SparseMoE) and stacked is None:
            return ("its experts cannot share grouped GEMMs (quantized gate and up inputs at different scales, or "
                    "linears of different kinds), so they run one expert at a time, reading the routing on the host")
        weights = stacked.operands() if stacked is not None else (m.experts.gate_up_proj, m.experts.down_proj)
        if not groupable(*weights):
            return ("its experts' weights are not in a dtype or 16-byte aligned layout that a grouped GEMM takes, so "
                    "they run one expert at a time")
    if not moes:
        return None
    weight = next(p for p in moes[0].parameters() if p.is_floating_point())
    return grouped_gemm_problem(weight.device, weight.dtype)


def groupable(*tensors: torch.Tensor) -> bool:
    """Whether grouped_mm takes these operands: float32, bfloat16 or float16, every stride but the unit one and the
    start 16-byte aligned."""
    return all(t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1) for t in tensors)


# A quantized input of grouped experts: (rows [R, K], each row's local expert [R]) -> the rows quantize-dequantized
RowQuant = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def routed_grouped(flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, first: int, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                   gate_up_input: RowQuant | None = None, down_input: RowQuant | None = None) -> torch.Tensor:
    """This rank's routed experts over `flat` [N, hidden] as two grouped GEMMs: sum over the k chosen experts e of
    weights[n, slot] * (down_input(activation(gate_up_input(x) @ gate_up[e] + gate_up_bias[e])) @ down[e] +
    down_bias[e]), for the experts first .. first + E - 1 (the others' pairs add 0). gate_up [E, hidden, G], down
    [E, I, hidden] (x @ W layouts, views welcome); `weights` [N, k] (flat's dtype or float32, each product cast to
    flat's dtype as the loop does); `idx` [N, k] global expert ids; the inputs' quantizers (None: none) see each row's
    expert. Every shape is fixed by N and k; the sums over k are in slot order."""
    n, k = idx.shape
    count = gate_up.shape[0]
    expert = idx.flatten() - first
    local = (expert >= 0) & (expert < count)
    expert = torch.where(local, expert, count)  # other ranks' experts sort last, past every group
    order = torch.argsort(expert, stable=True)
    expert, local = expert.index_select(0, order), local.index_select(0, order)
    ends = torch.searchsorted(expert, torch.arange(count, device=expert.device), right=True).to(torch.int32)
    which = expert.clamp(max=count - 1)  # (the rows past the groups are dropped below)
    x = flat.index_select(0, order // k)
    h = _GROUPED_MM(x if gate_up_input is None else gate_up_input(x, which), gate_up, offs=ends)
    if gate_up_bias is not None:
        h = h + gate_up_bias.index_select(0, which)
    h = activation(h)
    y = _GROUPED_MM(h if down_input is None else down_input(h, which), down, offs=ends)
    if down_bias is not None:
        y = y + down_bias.index_select(0, which)
    y = torch.where(local[:, None], y * weights.flatten().index_select(0, order)[:, None], 0).to(flat.dtype)
    return torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1).sum(1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float, beta: float) -> torch.Tensor:
    """G * sigmoid(alpha * G) * (U + beta), G = min(gate, limit), U = clamp(up, -limit, limit) (limit inf: no clamp):
    gpt-oss's clamped, shifted SwiGLU (limit 7, alpha 1.702, beta 1), or silu(gate) * up (inf, 1, 0), as the experts'
    ops parametrize it (compile/onnx_ops.py moe, trt_moe)."""
    if math.isfinite(limit):
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + beta)


def gated_activation(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] interleaved gate/up -> [..., I]: the clamped, shifted SwiGLU of gpt-oss."""
    return swiglu(gate_up[..., ::2], gate_up[..., 1::2], LIMIT, ALPHA, 1.0)


def local_experts(spec: DecoderSpec, size: int, rank: int, parallel: MoEParallel) -> range:
    """The experts rank holds (all of them under "tp")."""
    if parallel == "tp":
        return range(spec.num_experts)
    per = spec.num_experts // size
    return range(rank * per, (rank + 1) * per)


class Router(nn.Module):
    """HF `mlp.router`: a linear with bias over the experts, top-k, softmax over the k logits."""

    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, spec.hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, hidden] -> weights [N, k] (x's dtype), expert ids [N, k]
        top, idx = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), idx


class Experts(nn.Module):
    """HF `mlp.experts` tensors (this rank's experts and intermediate slice), stored as HF stores them:
    gate_up_proj [E, hidden, 2 * I] (x @ W), down_proj [E, I, hidden]."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup, parallel: MoEParallel):
        super().__init__()
        experts = local_experts(spec, tp.size, tp.rank, parallel)
        inter = spec.intermediate_size // (tp.size if parallel == "tp" else 1)
        e, h = len(experts), spec.hidden_size
        self.first = experts.start
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(e, inter, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        # Under "tp" every rank holds every expert's full down_proj bias, but it must be added once in the sum.
        self.adds_down_bias = parallel == "ep" or tp.rank == 0
        # The projections' input quantization when the experts are quantized (models/quantized.py)
        self.gate_up_proj_input: nn.Module = nn.Identity()
        self.down_proj_input: nn.Module = nn.Identity()
        # Set for an ONNX export of quantized experts only (keep_stored): the weights as stored, per projection
        self.stored_formats: dict[str, str] = {}  # projection -> "nvfp4" | "fp8"; tensors: <projection>_stored_*

    def keep_stored(self, projection: str, q: "QuantizedExperts") -> None:
        """Hold projection's stored FP8 / NVFP4 experts (the values of the dequantized parameter) for an export.
        NVFP4 experts are packed along K ([E, K/2, N]); ONNX packs FLOAT4E2M1 along the innermost axis, so they are
        held as the linears they are, [E, N, K/2] with scales [E, N, K/16] (QuantizedExperts.expert's layout)."""
        if q.fmt == "nvfp4":
            tensors = (q.weight.transpose(1, 2).contiguous().view(torch.float4_e2m1fn_x2),
                       q.weight_scale.transpose(1, 2).contiguous(), q.weight_scale_2.float())
        else:
            tensors = (q.weight.contiguous(), q.weight_scale.float(), None)
        for suffix, tensor in zip(("weight", "scale", "scale_2"), tensors):
            self.register_buffer(f"{projection}_stored_{suffix}", tensor, persistent=False)  # graph initializers
        self.stored_formats[projection] = q.fmt

    def weight(self, projection: str) -> torch.Tensor:
        """[E, K, N] of `projection`: the parameter, or under export the stored experts dequantized in the graph."""
        fmt = self.stored_formats.get(projection)
        if fmt is None:
            return getattr(self, projection)
        w, scale, scale_2 = (getattr(self, f"{projection}_stored_{s}") for s in ("weight", "scale", "scale_2"))
        ops = torch.ops.dflash_onnx
        if fmt == "nvfp4":
            return ops.nvfp4_dequantize(w, scale, scale_2).transpose(1, 2)
        return ops.fp8_dequantize(w, scale)


ExpertsOp = Literal["onnxruntime", "tensorrt"]  # com.microsoft.MoE / TensorRT's TRT_MoE (compile/onnx_ops.py)


def experts_as_one_op(module: nn.Module) -> bool:
    """Whether `module` (an MLP of experts) can be exported as one node, onnxruntime's com.microsoft.MoE or TensorRT's
    TRT_MoE (compile/onnx_ops.py `moe`, `trt_moe`): its rank holds every expert, unquantized (a quantized expert's
    linears are QuantizedInput wrappers, models/quantized.py, whose inputs the node would not quantize)."""
    if isinstance(module, SparseMoE):
        return len(module.experts) == module.gate.out_features and all(
            isinstance(p, nn.Linear) for e in module.experts.values() for p in (e.gate_proj, e.up_proj, e.down_proj))
    if isinstance(module, MoEMLP):
        ex = module.experts
        quantized = ex.stored_formats or not all(isinstance(getattr(ex, f"{p}_input"), nn.Identity)
                                                 for p in ("gate_up_proj", "down_proj"))
        return ex.gate_up_proj.shape[0] == module.router.weight.shape[0] and not quantized
    return False


class MoEMLP(nn.Module):
    """HF `mlp` of a gpt-oss layer: `router` and `experts`."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE, parallel: MoEParallel = "tp"):
        super().__init__()
        self.tp = tp
        self.router = Router(spec)
        self.experts = Experts(spec, tp, parallel)
        self.export_experts_op: ExpertsOp | None = None  # set for an export (compile/onnx_export.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, hidden] -> [B, T, hidden]
        flat = x.flatten(0, -2)
        if exporting() and self.export_experts_op == "tensorrt":  # TRT_MoE: the routing before it, gate/up apart
            weights, idx = self.router(flat)
            ex = self.experts
            down_bias = ex.down_proj_bias if ex.adds_down_bias else torch.zeros_like(ex.down_proj_bias)
            rows = (*x.shape[:-1], idx.shape[-1])  # x's own [batch, tokens] (IMoELayer's kernels are for <= 16 tokens)
            y = torch.ops.dflash_onnx.trt_moe(
                x, idx.view(rows), weights.view(rows), ex.gate_up_proj[..., ::2], ex.gate_up_proj[..., 1::2],
                ex.down_proj, ex.gate_up_proj_bias[:, ::2], ex.gate_up_proj_bias[:, 1::2], down_bias, LIMIT, ALPHA, 1.0)
            return self.tp.all_reduce(y)
        if exporting() and self.export_experts_op == "onnxruntime":  # com.microsoft.MoE (interleaved gate/up)
            ex, router = self.experts, self.router
            y = torch.ops.dflash_onnx.moe(
                flat, F.linear(flat, router.weight, router.bias), ex.gate_up_proj.transpose(1, 2), ex.gate_up_proj_bias,
                ex.down_proj.transpose(1, 2), ex.down_proj_bias if ex.adds_down_bias else None, router.top_k, True,
                ALPHA, 1.0, LIMIT)
            return self.tp.all_reduce(y).view_as(x)
        weights, idx = self.router(flat)
        if exporting():
            return self.tp.all_reduce(self._every_expert(flat, weights, idx)).view_as(x)
        ex = self.experts
        quantized_flat = ex.gate_up_proj_input(flat)  # (identity unless the experts are quantized)
        if groupable(quantized_flat, ex.gate_up_proj, ex.down_proj):
            out = routed_grouped(quantized_flat, weights, idx, ex.first, ex.gate_up_proj, ex.down_proj,
                                 gated_activation, ex.gate_up_proj_bias,
                                 ex.down_proj_bias if ex.adds_down_bias else None,
                                 down_input=lambda h, _: ex.down_proj_input(h))  # (one scale for every expert)
            return self.tp.all_reduce(out).view_as(x)
        return self.tp.all_reduce(self.routed_loop(quantized_flat, weights, idx)).view_as(x)

    def routed_loop(self, quantized_flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """transformers' form: expert by expert over the tokens routed to it, in expert order (so the k contributions
        are added in its order). Reads the routing on the host (torch.where)."""
        ex = self.experts
        out = torch.zeros_like(quantized_flat)
        for local in range(ex.gate_up_proj.shape[0]):
            token, slot = torch.where(idx == ex.first + local)
            if token.numel() == 0:
                continue
            h = gated_activation(quantized_flat[token] @ ex.gate_up_proj[local] + ex.gate_up_proj_bias[local])
            y = ex.down_proj_input(h) @ ex.down_proj[local]
            if ex.adds_down_bias:
                y = y + ex.down_proj_bias[local]
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def _every_expert(self, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The exported form (no data-dependent shapes): every local expert over every token, the outputs summed
        with each token's routing weight of that expert (0 where it was not chosen). The same result as the loop
        above, at num_experts / top_k times its multiply-adds: see docs/backends.md §gpt-oss in the graphs."""
        ex = self.experts
        local = ex.first + torch.arange(ex.gate_up_proj.shape[0], device=flat.device)  # [E]
        combine = ((idx[:, :, None] == local).to(weights.dtype) * weights[:, :, None]).sum(1)  # [N, E]
        gate_up, down = ex.weight("gate_up_proj").to(flat.dtype), ex.weight("down_proj").to(flat.dtype)
        h = gated_activation(ex.gate_up_proj_input(flat) @ gate_up + ex.gate_up_proj_bias[:, None])
        y = ex.down_proj_input(h) @ down  # [E, N, hidden]
        if ex.adds_down_bias:
            y = y + ex.down_proj_bias[:, None]
        return (y * combine.T[:, :, None].to(y.dtype)).sum(0).to(flat.dtype)


class SparseMoE(nn.Module):
    """Qwen3 MoE's sparse MLP, numerically as transformers' `Qwen3MoeSparseMoeBlock` (and Qwen3.5 MoE's, which adds
    sigmoid(shared_expert_gate(x)) * shared_expert(x)), and DeepSeek-V3's / Kimi K2's (`DeepseekV3MoE`: another router,
    and shared_experts(x) added). Per token x:

        p = softmax(gate.weight @ x) in float32                  [num_experts], over every expert
        top, idx = topk(p, k); top /= sum(top) if norm_topk_prob; weights in x's dtype
        out = sum over the chosen e of weight_e * down_e(silu(gate_e(x)) * up_e(x))

    DeepSeek-V3's router (`DeepseekV3TopkRouter`, all in float32): s = sigmoid(gate.weight @ x); the experts form
    n_group groups, a group scores the sum of its top 2 of s + gate.e_score_correction_bias, and only the topk_group
    best groups' experts may be chosen, by the top k of s + bias; their weights are s (without the bias) renormalized
    and times routed_scaling_factor.

    The experts are `MLP`s of moe_intermediate_size named as stored (`experts.{e}.gate_proj` ...). Under tensor
    parallelism (`parallel`, models/shard.py) each rank holds either a slice of every expert, cut like a dense MLP
    ("tp": gate/up by intermediate features, down by rows), or its own experts whole ("ep"); either way the ranks'
    partial sums are all-reduced once for all experts, and the router (`gate`) is replicated."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE, parallel: MoEParallel = "tp"):
        super().__init__()
        self.tp, self.top_k, self.norm_topk_prob = tp, spec.num_experts_per_tok, spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.routed_experts, bias=False)
        self.groups, self.top_groups, self.scaling = spec.n_group, spec.topk_group, spec.routed_scaling_factor
        if self.groups:  # DeepSeek-V3: a bias for choosing only (stored with the router)
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(spec.routed_experts))
        expert = dataclasses.replace(spec, intermediate_size=spec.moe_intermediate_size, mlp_bias=False)
        cut = tp if parallel == "tp" else SINGLE
        self.experts = nn.ModuleDict({str(e): MLP(expert, cut)
                                      for e in routed_experts_of(spec, tp.size, tp.rank, parallel)})
        if spec.shared_expert:  # Qwen3.5 MoE: cut like a dense MLP whatever `parallel` says; its gate replicated
            self.shared_expert = MLP(dataclasses.replace(spec, mlp_bias=False), tp)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
        if spec.n_shared_experts:  # DeepSeek-V3: n of moe_intermediate_size as one MLP, added without a gate
            width = spec.n_shared_experts * spec.moe_intermediate_size
            self.shared_experts = MLP(dataclasses.replace(spec, intermediate_size=width, mlp_bias=False), tp)
        else:
            self.shared_experts = None
        self.export_experts_op: ExpertsOp | None = None  # set for an export (compile/onnx_export.py)
        self._stack: StackedExperts | bool | None = None  # (`stacked`; False: they cannot be)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, hidden] -> routing weights [N, k] (flat's dtype; DeepSeek-V3's: float32), expert ids [N, k]."""
        if self.groups:
            return self._route_groups(flat)
        logits = self.gate(flat)
        top, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), idx

    def _route_groups(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(flat.float(), self.gate.weight.float()))  # [N, E]
        choice = scores + self.gate.e_score_correction_bias
        grouped = choice.view(flat.shape[0], self.groups, -1)
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(dim=-1), self.top_groups, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1.0).bool()  # [N, groups]
        choice = choice.masked_fill(~allowed[..., None].expand_as(grouped).reshape_as(choice), float("-inf"))
        idx = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, hidden] -> [B, T, hidden]
        return self.tp.all_reduce(self.partial(x.flatten(0, -2))).view_as(x)

    def partial(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> this rank's share of the output [N, hidden], before the all-reduce (with Qwen3.5 MoE's shared
        expert, added after the routed ones as transformers does)."""
        routed = self._routed(flat)
        if self.shared_experts is not None:
            return routed + self.shared_experts.partial(flat)
        if self.shared_expert is None:
            return routed
        return routed + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert.partial(flat)

    def _routed(self, flat: torch.Tensor) -> torch.Tensor:
        if exporting() and self.export_experts_op == "tensorrt":  # TRT_MoE, the routing (any form) before it
            weights, idx = self.route(flat)
            experts = self.experts.values()
            gate, up, down = (torch.stack([getattr(e, name).weight.T for e in experts])
                              for name in ("gate_proj", "up_proj", "down_proj"))
            # The tokens as one row [1, N, hidden] (the node takes rank 3; passing x's own [batch, tokens] rows would
            # suit IMoELayer's kernels better, but torch.export finds no shape guard for this module's reshapes then)
            k = idx.shape[-1]
            return torch.ops.dflash_onnx.trt_moe(flat[None], idx.view(1, -1, k), weights.view(1, -1, k), gate, up, down,
                                                 None, None, None, math.inf, 1.0, 0.0)[0]
        if exporting() and self.export_experts_op == "onnxruntime":  # com.microsoft.MoE: gate/up rows interleaved
            fc1 = torch.stack([torch.stack([e.gate_proj.weight, e.up_proj.weight], 1).flatten(0, 1)
                               for e in self.experts.values()])
            fc2 = torch.stack([e.down_proj.weight for e in self.experts.values()])
            if not self.groups:  # the node's own routing: softmax, top k, renormalized
                return torch.ops.dflash_onnx.moe(flat, self.gate(flat), fc1, None, fc2, None, self.top_k,
                                                 self.norm_topk_prob, 1.0, 0.0, math.inf)
            # DeepSeek-V3's group routing, in plain ops before the node: the node is given log(weight) for the chosen
            # experts and -inf for the others, so its softmax + top k picks the same experts with weights w / sum(w);
            # the output times sum(w) is the weighted sum (every output is linear in its weights).
            weights, idx = self.route(flat)
            logits = weights.new_full((flat.shape[0], self.gate.out_features), -math.inf).scatter(1, idx, weights.log())
            out = torch.ops.dflash_onnx.moe(flat, logits.to(flat.dtype), fc1, None, fc2, None, self.top_k, True,
                                            1.0, 0.0, math.inf)
            return out * weights.sum(dim=-1, keepdim=True).to(out.dtype)
        weights, idx = self.route(flat)
        out = torch.zeros_like(flat)
        if exporting():  # every expert over every token, weighted 0 where not chosen (no data-dependent shapes)
            for e, expert in self.experts.items():  # (in the weights' dtype, then flat's, as below: DeepSeek-V3's
                # weights are float32, and a float32 sum would carry into a 16-bit engine's next layer)
                out = out + (expert.partial(flat) * (weights * (idx == int(e))).sum(-1, keepdim=True)).to(out.dtype)
            return out
        stacked = self.stacked()
        gate_up, down = stacked.operands() if stacked is not None else (None, None)
        if stacked is not None and groupable(flat, gate_up, down):
            gate_up_input, down_input = stacked.input_quantizers()
            act, width = next(iter(self.experts.values())).act, down.shape[1]
            return routed_grouped(flat, weights, idx, int(next(iter(self.experts))), gate_up, down,
                                  lambda h: act(h[:, :width]) * h[:, width:], gate_up_input=gate_up_input,
                                  down_input=down_input)
        # Expert by expert over the tokens routed to it, in expert order, as transformers adds them.
        for e, expert in self.experts.items():
            token, slot = torch.where(idx == int(e))
            if token.numel():
                out.index_add_(0, token, (expert.partial(flat[token]) * weights[token, slot, None]).to(out.dtype))
        return out

    def stacked(self) -> StackedExperts | None:
        """This rank's experts for `routed_grouped` (StackedExperts), or None where they cannot be stacked: their
        linears of different kinds, or quantized (models/quantized.py QuantizedInput, wrapped at load, before any pass)
        with gate and up inputs at different scales (ModelOpt calibrates both on the same input). The first call
        stacks the weights and makes every expert's linears views of the stacks, so the weights stay in memory once;
        a later call restacks if the module was moved (`.to`) since."""
        first = next(iter(self.experts.values()))
        if self._stack is False or (self._stack is not None and self._stack.fmt == getattr(first.gate_proj, "fmt", None)
                                    and self._stack.gate_up.data_ptr() == _linear(first.gate_proj).weight.data_ptr()):
            return self._stack or None
        experts = list(self.experts.values())
        wrappers = [p for e in experts for p in (e.gate_proj, e.up_proj, e.down_proj)]
        kinds = {(type(p), getattr(p, "fmt", None)) for p in wrappers}
        fmt = next(iter(kinds))[1]
        if len(kinds) != 1 or not all(type(_linear(p)) is nn.Linear for p in wrappers) or (
                fmt is not None and not all(torch.equal(e.gate_proj.input_scale, e.up_proj.input_scale)
                                            for e in experts)):
            self._stack = False  # (decided once: the wrappers and their scales are set at load)
            return None
        width = _linear(first.gate_proj).out_features
        # (the stacks of the kind the weights are: inference tensors for a model made in inference mode only)
        with torch.inference_mode(_linear(first.gate_proj).weight.is_inference()), torch.no_grad():
            linears = [[_linear(p) for p in (e.gate_proj, e.up_proj, e.down_proj)] for e in experts]
            gate_up = torch.stack([torch.cat([gate.weight, up.weight]) for gate, up, _ in linears])  # [E, 2I, hidden]
            down = torch.stack([d.weight for _, _, d in linears])  # [E, hidden, I]
            for (gate, up, d), gu, dw in zip(linears, gate_up, down):
                gate.weight.data, up.weight.data, d.weight.data = gu[:width], gu[width:], dw
            scales = (None, None) if fmt is None else (
                torch.stack([e.gate_proj.input_scale.float().reshape(()) for e in experts]),
                torch.stack([e.down_proj.input_scale.float().reshape(()) for e in experts]))
        self._stack = StackedExperts(gate_up, down, fmt, *scales)
        return self._stack


def _linear(module: nn.Module) -> nn.Module:
    """The linear itself, inside a quantized input's wrapper (models/quantized.py QuantizedInput) or not."""
    return getattr(module, "linear", module)


@dataclasses.dataclass(frozen=True)
class StackedExperts:
    """One rank's experts of a `SparseMoE` stacked for grouped GEMMs: the [E, 2I, hidden] gate-then-up and [E, hidden,
    I] down weights (the experts' linears are views of them), and, for quantized experts, their format and each
    expert's input scales [E] (gate and up share one)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    fmt: str | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [E, hidden, 2I] and down [E, I, hidden], as the x @ W views grouped_mm takes."""
        return self.gate_up.transpose(1, 2), self.down.transpose(1, 2)

    def input_quantizers(self) -> tuple[RowQuant | None, RowQuant | None]:
        """(gate/up input, down input) quantizers for routed_grouped: each row with its expert's scale."""
        if self.fmt is None:
            return None, None
        quant = fake_quant_nvfp4_activation if self.fmt == "nvfp4" else fake_quant_fp8_activation

        def by_expert(scales: torch.Tensor) -> RowQuant:
            return lambda rows, expert: quant(rows, scales.index_select(0, expert)).to(rows.dtype)
        return by_expert(self.gate_up_scale), by_expert(self.down_scale)
