"""ONNX graphs of one DFlash step (one rank of tp 1..8), exported from the torch modules themselves.

`export_engine_graphs(target, drafter, out_dir)` traces TargetModel.forward, DFlashDrafter.append_context
and DFlashDrafter.forward with their caches replaced by graph inputs (onnx_ops.GraphKVCache), and writes

    target_step.onnx      prefill, verify and AR: one target pass
    drafter_context.onnx  the drafter's context K/V of many committed positions (DFlashDrafter.append_context)
    drafter_draft.onnx    the context K/V of the positions the last step committed, then one block draft ->
                          greedy draft tokens (DFlashDrafter.forward + target lm_head): one drafter pass a step
    weights.onnx.data     the initializers of all three, each stored once (4 KiB aligned)
    accept.onnx           the acceptance step in plain ops, accept_plugin.onnx the same as one DFlashAccept
                          node for TensorRT (compile/accept_graph.py)

The modules may be one rank's shard (`target.tp`): their collectives become TensorRT DistCollective nodes
(onnx_ops.py) and every graph records `rank` and `tp_size` in its metadata. FP8 linears whose stored weights
were given back (`keep_stored_weights`) become FP8 initializers with Q/DQ nodes, NVFP4 linears FLOAT4E2M1
initializers with TensorRT's FP4 dynamic-quantize node (onnx_ops.py: graphs for TensorRT only).

RoPE, attention and the cache writes are ONNX's own RotaryEmbedding (23), Attention (23) and TensorScatter
(24), the ops TensorRT parses into its native rotary, attention and KV-cache-update layers
(docs/backends.md §Facts found); the rest is plain MatMul / elementwise ops. The dimensions batch, seq, ctx,
block, keys and max_len are dynamic; kv_heads, head_dim, vocab and hidden are the model's. Every size inside a
graph comes from an input's shape, none from an input's values (no data-dependent shapes): the attended length is
the length of `key_positions`, chosen by the executor (a bucket), so a TensorRT plan's shapes are known before it
runs.

## I/O contract (dtype = the modules' dtype, float32 or bfloat16; L = layers of that model)

target_step.onnx
    in   token_ids    int64  [batch, seq]
         positions    int64  [batch, seq]     start_b + arange(seq), start_b + seq <= max_len
         key_positions int64 [keys]           arange(keys): the keys attended, max_b(start_b) + seq <= keys <= max_len
                             (keys past a row's own positions are masked: any such keys give the same values)
         past_key_i   dtype  [batch, kv_heads, max_len, head_dim]   i = 0 .. L-1, each followed by
         past_value_i dtype  [batch, kv_heads, max_len, head_dim]   (inputs: past_key_0, past_value_0, ...)
    out  logits       float32 [batch, seq, vocab]
         hidden       dtype  [batch, seq, n_feat * hidden]   outputs of the drafter's target_layer_ids
                             (TargetOutput.hidden; only when exported with a drafter)
         present_key_i, present_value_i   same shapes as past_*: past with positions start_b .. start_b+seq-1
                             of row b overwritten
drafter_context.onnx
    in   target_hidden dtype [batch, ctx, n_feat * hidden]   captured features (target_step's hidden)
         positions    int64  [batch, ctx]     start_b + arange(ctx)
         past_key_i, past_value_i    the drafter's caches, i = 0 .. drafter layers - 1
    out  present_key_i, present_value_i
drafter_candidates.onnx (engines built for onnxruntime: draft trees, speculative/tree.py)
    in   as drafter_draft's, and candidates int64 [k] (any values: its length is k, the tokens kept per position)
    out  candidate_ids int64 [batch, block - 1, k], candidate_logprobs float32 [batch, block - 1, k]: the k most
                             likely drafts per position, best first, and their log-probabilities (top_candidates)
         present_key_i, present_value_i   as drafter_draft's
target_decode.onnx (engines built for onnxruntime, targets with plain grouped-query attention: attends_in_place)
    in   token_ids    int64  [batch, 1]
         positions    int64  [batch, 1]       start_b: each row attends to its positions 0 .. start_b
         past_key_i, past_value_i   the target's caches
    out  logits, hidden, present_key_i, present_value_i   as target_step's. Each layer's cache write and attention
                             are one com.microsoft.GroupQueryAttention node (onnx_ops.attend_in_place), which reads
                             the bound cache where it lies: no Slice copies the attended prefix first
target_step.onnx of a target with Gated DeltaNet layers (Qwen3.5; RecurrentTargetStep)
    in   token_ids, positions, key_positions   as above
         kept         int64  [batch]          tokens of the row's last pass before this pass's start (replayed already)
         valid        int64  [batch]          real tokens per row (a batched prefill's padding after them)
         past_key_i, past_value_i   of the attention layers only (i their layer numbers)
         past_conv_j  dtype  [batch, K - 1 + depth, conv channels]   j = each Gated DeltaNet layer's number, each
         past_state_j float32 [batch, value heads, key_head_dim, value_head_dim]  followed by the next layer's
    out  logits, hidden, present_key_i, present_value_i   as above
         present_conv_j, present_state_j, present_delta_k_j [batch, depth, heads, dk], present_delta_v_j
                             [.., dv], present_delta_g_j float32 [batch, depth, heads], present_delta_beta_j: what
                             resumes the layer at any position of this pass (RecurrentStates; depth static: the block)
target_decode.onnx of the same targets, for onnxruntime (RecurrentTargetDecode)
    in   token_ids, positions   as target_decode's; kept as target_step's (the one token is valid)
         past_key_i, past_value_i, past_conv_j, past_state_j   as target_step's
    out  logits, hidden, present_key_i, present_value_i   as target_decode's (GroupQueryAttention in place)
         present_conv_j, present_state_j   the conv inputs and state after the token (a one-token pass advances
                             the state: no delta_*); the gated delta rule's step is plain ops, no Scan
target_token.onnx of the same targets, for TensorRT (RecurrentTargetToken: engines built for tensorrt)
    in   token_ids, positions   as target_decode's; key_positions as target_step's; kept as target_decode's
         past_key_i, past_value_i, past_conv_j, past_state_j   as target_step's
    out  logits, hidden, present_key_i, present_value_i   as target_step's (a KV-cache update and attention over
                             key_positions)
         present_conv_j, present_state_j   as target_decode's: the token's step of the gated delta rule in plain ops,
                             so the plan has no TensorRT loop (target_step's chunked recurrence is one per layer)
target_replay.onnx (the same targets; TargetReplay)
    in   kept         int64  [batch]          as above
         steps        int64  [steps]          0 .. n - 1, n = max(kept) (1 .. depth)
         past_state_j, past_delta_k_j, past_delta_v_j, past_delta_g_j, past_delta_beta_j
    out  present_state_j   the state advanced over the row's first `kept` delta_* (bound in place; the executor runs
                             this graph before a target_step whose rows keep tokens, docs/models.md §Recurrent state)
target_tree.onnx (engines built for onnxruntime)
    in   token_ids    int64  [batch, nodes]   a draft tree per row, node 0 the anchor
         positions    int64  [batch, nodes]   start_b + depth: the nodes' RoPE positions (node t is cached at start_b + t)
         tree         bool   [batch, nodes, nodes]   ancestor mask: node t sees node u iff tree[b, t, u]
         key_positions int64 [keys]           as target_step's (keys >= max_b(start_b) + nodes)
         past_key_i, past_value_i   the target's caches
    out  logits, hidden, present_key_i, present_value_i   as target_step's
drafter_draft.onnx
    in   block_ids    int64  [batch, block]   [anchor, MASK, ...] (speculative.core.block_input), block >= 2
         positions    int64  [batch, block]   start_b + arange(block); the context is positions < start_b
         context_hidden dtype [batch, ctx, n_feat * hidden]   features of positions the context does not hold yet
                             (those the last step committed), written into the caches before the block attends;
                             rows at or after start_b are padding (masked, overwritten later)
         context_positions int64 [batch, ctx]  context_start_b + arange(ctx)
         key_positions int64 [keys]           arange(keys): the context keys attended, max_b(start_b) <= keys <= max_len
         past_key_i, past_value_i    the drafter's caches, i = 0 .. drafter layers - 1
    out  draft_tokens int64  [batch, block - 1]   argmax of the target's lm_head on the drafter's hidden states
                             (a DFlash2 drafter: its candidate selector's walk; block is then the trained block_size,
                             static, and no drafter_candidates / target_tree graphs are exported)
         present_key_i, present_value_i   the caches with the context rows written (the block's are not)

Cache invariant (as TorchExecutor's): row b's positions < start_b hold its request's K/V; positions at or
after start_b are masked and overwritten before they become visible, so rejected drafts need no clean-up.

## Binding the caches (what an executor does)
The executor owns, per layer, one buffer [num_slots, kv_heads, max_len, head_dim] for K and one for V, of
the target and of the drafter. A step over slots r0 .. r0+batch-1 binds `past_key_i` AND `present_key_i`
to the same memory: the buffer's rows r0 .. r0+batch-1, a contiguous block (axis 0 is outermost), at
`data_ptr + r0 * row_bytes` (onnxruntime: `IOBinding.bind_input` / `bind_output` with that pointer and shape
[batch, ...]). onnxruntime then writes the new positions in place and copies nothing else (measured below:
the step time does not depend on max_len). Row b of token_ids / positions is slot r0 + b.

## Batches that are a subset of the slots (continuous batching)
TensorScatter's batch axis is the cache's axis 0, so a step's rows are a run of cache rows. Options tried
for running `batch` active requests of an 8-slot engine (onnxruntime 1.32 CPU EP, one thread, the demo
model: 6 layers, hidden 256, vocab 4096; max_len 2064, context start 512; median ms per target_step):

    option                                              T=1 B=1  T=1 B=8  T=16 B=1  T=16 B=8
    bind the run of rows in place (chosen)                 1.28     5.06      3.69     23.68
      the same run starting at row 7 of 8                  1.42        -      3.63         -
    run all 8 slots whatever the active count          = the B=8 column: 5.06 and 23.68
    copy the rows to a staging cache and back
      (index_select / index_copy_ around the call)         3.82    24.22      5.87     40.04
    slots [B] input, full [8, ...] caches, written with
      ScatterND and read with GatherND in the graph       30.06    34.87     25.55     55.06
    torch eager (TorchExecutor.target_forward)            10.66    13.05      9.24     34.77

The bound step does not depend on max_len (600 / 2064 / 8256: 1.24 / 1.32 / 1.19 ms at T=1 B=1): the
cache write is in place. It grows with the attended length (start 64 / 512 / 2000: 0.92 / 1.32 / 2.39 ms
at B=1, 4.7 / 13.8 ms at B=8 for 512 / 2000), as the graph reads positions < max(positions) + 1 only (measured
before the length became key_positions' length, which executors round up to 16 keys: the same reads).
The drafter, same conditions: drafter_context 0.16 / 1.07 ms for 16 positions at B=1 / 8 (torch 0.53 /
1.58); drafter_draft 2.08 / 15.3 ms for a block of 16 (torch TorchExecutor.draft 5.59 / 26.4).

Chosen: bind the run of rows. The executor keeps its requests in physical rows 0 .. n-1 (its own map
from the Decoder's slot numbers), sorts each batch by row and puts the outputs back in the batch's order;
when a request ends it moves the request of the last row into the freed row (one copy of one slot's
caches per finished request, instead of two per step). New requests take the rows after the running ones,
so a prefill batch is a run too. A batch with a gap (a request that finished at its own prefill, released
after the step) runs the covering run with the gap as a padding row: any token ids at positions
0 .. T-1; that row is free and nothing in it is read later.

## Embedding and lm_head in the drafter graph
drafter_draft includes the target's embedding (Gather of block_ids) and lm_head + ArgMax, so a draft is one
call that returns int64 tokens instead of [batch, block-1, vocab] logits. The tensors are stored once on
disk: all graphs share weights.onnx.data and identical initializers (by content) point at the same bytes.
Each onnxruntime session still loads its own copy into memory.

## Export mechanics and limits
The models take the attended length as `kv_len`, here key_positions' symbolic length (without it they compute
`int(positions.max())`, which only dynamo's strict tracing captures, as a data-dependent size). Under dynamo `torch.onnx.is_in_onnx_export()` reads False and the
`torch.onnx.ops` wrappers are skipped, so models/layers.py keys its ONNX branches on
`torch.compiler.is_exporting()` and calls the ops `torch.ops.onnx.*` themselves. TensorScatter, which
torch.onnx.ops lacks, is a custom op with an onnxscript translation (onnx_ops.py). Exporting twice gives
byte-identical files (node stack traces, which hold file paths, are dropped).
gpt-oss: the attention sinks are an extra zero key with the sink as its additive mask, the experts an exported
form without data-dependent shapes (docs/backends.md §gpt-oss in the graphs). Logits come for every column
(no `last_index`: a prefill pays lm_head for the whole prompt); bfloat16 graphs export and pass the
checker, but onnxruntime's CPU EP has no bfloat16 MatMul / Mul kernels (they are for TensorRT / GPU EPs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import torch
import torch._dynamo
import torch.onnx.ops  # noqa: F401  (registers torch.ops.onnx.*, used by models/layers.py under export)
from torch import nn
from torch.export import Dim

from trtllm_dflash.compile.accept_graph import export_accept_graph, plugin_accept_graph
from trtllm_dflash.compile.onnx_ops import (
    MOE_DOMAIN,
    MOE_OP,
    TRANSLATIONS,
    TRT_MOE_DOMAIN,
    TRT_MOE_OP,
    GraphKVCache,
    GraphOneTokenStates,
    GraphRecurrentStates,
)
from trtllm_dflash.engine_dir import (
    EXPERTS_OP_KEY,
    ONE_TOKEN_ADVANCES_KEY,
    RING_PASS_KEY,
    RING_WRITE_KEY,
    TREE_WINDOWS_KEY,
)
from trtllm_dflash.models.drafter import DFlashDrafter
from trtllm_dflash.models.linear_attention import (READ_KINDS, REPLAY_KINDS, STATE_KINDS, RecurrentStates,
                                                  chunk_scanned)
from trtllm_dflash.models.moe import Experts, ExpertsOp, experts_as_one_op
from trtllm_dflash.models.quantized import ActivationQuant, QuantizedInput
from trtllm_dflash.quantize.experts import EXPERT_WEIGHTS, read_quantized_experts
from trtllm_dflash.quantize.modelopt_cpu import read_quantized_linear
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.kv_blocks import BLOCK_TOKENS

OPSET = 24  # TensorScatter; Attention and RotaryEmbedding are opset 23
WEIGHTS_FILE = "weights.onnx.data"
TARGET_STEP, DRAFTER_CONTEXT, DRAFTER_DRAFT = "target_step", "drafter_context", "drafter_draft"
TARGET_TREE, DRAFTER_CANDIDATES = "target_tree", "drafter_candidates"
TARGET_DECODE = "target_decode"
TARGET_TOKEN = "target_token"
TARGET_REPLAY = "target_replay"
ACCEPT, ACCEPT_PLUGIN = "accept", "accept_plugin"
PART_ORDER = "order.json"  # in a part of a rank's graphs (export_engine_graphs' `claim`): the rank's graph order
_EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay inside the .onnx
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a Python object's address in a node's namespace
_ALIGN = 4096  # external tensors start on page boundaries, so a runtime can map them


def cache_names(layers: int | Sequence[int], kind: str) -> list[str]:
    """Graph names of the caches in binding order: past_key_0, past_value_0, past_key_1, ... (kind past|present) of
    layers 0 .. layers - 1, or of the layers numbered `layers` (a hybrid model's attention layers)."""
    numbers = range(layers) if isinstance(layers, int) else layers
    return [f"{kind}_{kv}_{i}" for i in numbers for kv in ("key", "value")]


def state_names(layers: Sequence[int], kind: str, kinds: Sequence[str] = STATE_KINDS) -> list[str]:
    """Graph names of the Gated DeltaNet layers' states in binding order (RecurrentStates.named): past_conv_0,
    past_state_0, past_delta_k_0, ... of the layers numbered `layers` (kind past|present), `kinds` of each."""
    return [f"{kind}_{what}_{i}" for i in layers for what in kinds]


class TargetStep(nn.Module):
    """target_step.onnx: TargetModel.forward over the bound cache rows."""

    def __init__(self, target: TargetModel, capture_layers: tuple[int, ...], rings: Sequence[int] = (),
                 rewrite_rings: bool = False):
        """`rings`: the sliding-window layers whose caches are rings; `rewrite_rings`: written as TensorRT can
        (GraphKVCache)."""
        super().__init__()
        self.target, self.capture_layers, self.rings = target, capture_layers, tuple(rings)
        self.rewrite_rings = rewrite_rings

    def forward(self, token_ids, positions, key_positions, past: list[torch.Tensor]):
        cache = GraphKVCache(past, rings=self.rings, rewrite_rings=self.rewrite_rings)
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        out = self.target(token_ids, positions, rows, cache, self.capture_layers, kv_len=key_positions.shape[0])
        hidden = (out.hidden,) if self.capture_layers else ()
        return (out.logits, *hidden, *cache.present())


class RecurrentTargetStep(TargetStep):
    """target_step.onnx of a target with Gated DeltaNet layers (Qwen3.5): TargetStep, its attention layers' caches
    first, then each Gated DeltaNet layer's states (onnx_ops.GraphRecurrentStates: conv and state read and written,
    delta_* written), and the executor's `kept` and `valid` per row. `depth`: the most tokens a pass keeps."""

    def __init__(self, target: TargetModel, capture_layers: tuple[int, ...], depth: int):
        super().__init__(target, capture_layers)
        self.depth = depth

    def forward(self, token_ids, positions, key_positions, kept, valid, past: list[torch.Tensor],
                states: list[torch.Tensor]):
        cache = GraphKVCache(past, layers=self.target.spec.attention_layers)
        recurrent = GraphRecurrentStates(states, kept, valid, self.target.spec.linear_conv_kernel, self.depth)
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        out = self.target(token_ids, positions, rows, cache, self.capture_layers, kv_len=key_positions.shape[0],
                          states=recurrent)
        hidden = (out.hidden,) if self.capture_layers else ()
        return (out.logits, *hidden, *cache.present(), *recurrent.present())


class TargetReplay(nn.Module):
    """target_replay.onnx (targets with Gated DeltaNet layers), run before a target_step whose rows keep tokens of
    their last pass: each layer's state advanced over the first `kept` tokens of the row's last pass (its delta_*),
    the replay RecurrentStates.read makes, over `steps` (0 .. n - 1, n the most tokens any row keeps; the other rows'
    extra steps have g = beta = 0, which leave a state exactly as it was) in chunks (`chunk_scanned`: one Scan step
    for a replay of up to 16 tokens). The state is written
    in place (present_state_i bound to past_state_i's memory: it is computed from every read of it)."""

    def forward(self, kept, steps, past: list[torch.Tensor]):
        keep = (steps[None, :] < kept[:, None])[..., None]  # [B, n, 1]
        states = []
        for i in range(0, len(past), len(REPLAY_KINDS)):
            state, *deltas = past[i:i + len(REPLAY_KINDS)]
            # (the first n positions by index: a slice :n would make the export assume n != depth)
            k, v, g, beta = (x.index_select(1, steps) for x in deltas)
            states.append(chunk_scanned(None, k, v, g * keep, beta * keep, state)[1])
        return tuple(states)


class TargetDecode(nn.Module):
    """target_decode.onnx (engines built for onnxruntime): TargetModel.forward over one token per row, each layer's
    cache write and attention one GroupQueryAttention node over the bound cache rows (onnx_ops.attend_in_place)."""

    def __init__(self, target: TargetModel, capture_layers: tuple[int, ...]):
        super().__init__()
        self.target, self.capture_layers = target, capture_layers

    def forward(self, token_ids, positions, past: list[torch.Tensor]):
        cache = GraphKVCache(past, in_place=True)
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        # (kv_len: the masks it sizes are not used by the in-place attention)
        out = self.target(token_ids, positions, rows, cache, self.capture_layers, kv_len=1)
        hidden = (out.hidden,) if self.capture_layers else ()
        return (out.logits, *hidden, *cache.present())


class RecurrentTargetDecode(TargetDecode):
    """target_decode.onnx of a target with Gated DeltaNet layers (Qwen3.5): TargetDecode, its attention layers' caches
    first, then each Gated DeltaNet layer's conv and state, read and written (onnx_ops.GraphOneTokenStates: the token's
    step of the gated delta rule, no Scan), and the executor's `kept` per row. `depth`: the conv buffers' kept
    tokens."""

    def __init__(self, target: TargetModel, capture_layers: tuple[int, ...], depth: int):
        super().__init__(target, capture_layers)
        self.depth = depth

    def forward(self, token_ids, positions, kept, past: list[torch.Tensor], states: list[torch.Tensor]):
        cache = GraphKVCache(past, in_place=True, layers=self.target.spec.attention_layers)
        return self._one_token(token_ids, positions, kept, cache, states, kv_len=1)

    def _one_token(self, token_ids, positions, kept, cache: GraphKVCache, states: list[torch.Tensor], kv_len: int):
        """The target over one token per row with these caches, its Gated DeltaNet states advanced by one step."""
        recurrent = GraphOneTokenStates(states, kept, self.target.spec.linear_conv_kernel, self.depth)
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        out = self.target(token_ids, positions, rows, cache, self.capture_layers, kv_len=kv_len, states=recurrent)
        hidden = (out.hidden,) if self.capture_layers else ()
        return (out.logits, *hidden, *cache.present(), *recurrent.present())


class RecurrentTargetToken(RecurrentTargetDecode):
    """target_token.onnx (Qwen3.5 targets of engines built for TensorRT): RecurrentTargetDecode's one token per row and
    one-token states, with target_step's caches (a KV-cache update, attention over `key_positions`): TensorRT parses
    neither GroupQueryAttention nor a loop-free recurrence otherwise."""

    def forward(self, token_ids, positions, key_positions, kept, past: list[torch.Tensor],
                states: list[torch.Tensor]):
        cache = GraphKVCache(past, layers=self.target.spec.attention_layers)
        return self._one_token(token_ids, positions, kept, cache, states, kv_len=key_positions.shape[0])


def ring_pass_tokens(target: TargetModel, drafter: DFlashDrafter | None) -> int | None:
    """The most positions per row a pass of an onnxruntime engine may write when `target`'s sliding-window layers keep
    rings (of the window plus this many positions): a verify block, or the window (rounded up to a block of the paged
    cache) if longer, which longer prefills are cut into; None: no sliding-window layers."""
    window = target.spec.sliding_window
    if not window:
        return None
    return max(drafter.params.block_size if drafter is not None else 1, -(-window // BLOCK_TOKENS) * BLOCK_TOKENS)


def attends_in_place(target: TargetModel) -> bool:
    """Whether target_decode.onnx can run `target`: every attention layer plain grouped-query attention over one cache,
    at the default scale (no sinks, sliding windows or latent attention); a hybrid target's Gated DeltaNet layers
    (RecurrentTargetDecode) too."""
    spec = target.spec
    return (not spec.sliding_window and not spec.is_mla and not spec.is_gemma4
            and all(layer.self_attn.sinks is None and layer.self_attn.scale is None
                    for layer in target.model.layers if layer.self_attn is not None))


class DrafterContext(nn.Module):
    """drafter_context.onnx: DFlashDrafter.append_context over the bound cache rows."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, target_hidden, positions, past: list[torch.Tensor]):
        cache = GraphKVCache(past)
        rows = torch.arange(target_hidden.shape[0], device=target_hidden.device)
        self.drafter.append_context(target_hidden, positions, rows, cache)
        return tuple(cache.present())


class DrafterDraft(nn.Module):
    """drafter_draft.onnx: TorchExecutor.draft's drafter pass (the new context rows first written into the cache) +
    greedy tokens, for given block ids."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter):
        super().__init__()
        self.target, self.drafter = target, drafter  # `target` as in TargetStep: the embedding keeps its name

    def forward(self, block_ids, positions, context_hidden, context_positions, key_positions,
                past: list[torch.Tensor]):
        cache = GraphKVCache(past)
        rows = torch.arange(block_ids.shape[0], device=block_ids.device)
        hidden = self.drafter(self.target.embed(block_ids), positions, positions[:, 0], rows, cache,
                              context_hidden, context_positions, kv_len=key_positions.shape[0])
        if self.drafter.candidate_selector is not None:  # DFlash2: the selector's walk (the block is static)
            return (self.drafter.greedy_tokens(hidden[:, 1:], self.target.logits, block_ids[:, 0]),
                    *cache.present())
        # lm_head over the whole block, then drop row 0: any op on the [B, block - 1, ...] slice makes
        # torch.export assume block - 1 != 1, and block 2 (one draft token) is a valid run-time block size.
        return (self.target.logits(hidden).argmax(dim=-1)[:, 1:], *cache.present())


class TargetTree(nn.Module):
    """target_tree.onnx: TorchExecutor.verify_tree's pass (TargetModel.forward with a draft tree's ancestor mask),
    over target_step's caches (`rings`: its sliding-window layers', as TargetStep's)."""

    def __init__(self, target: TargetModel, capture_layers: tuple[int, ...], rings: Sequence[int] = ()):
        super().__init__()
        self.target, self.capture_layers, self.rings = target, capture_layers, tuple(rings)

    def forward(self, token_ids, positions, tree, key_positions, past: list[torch.Tensor]):
        cache = GraphKVCache(past, rings=self.rings)
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        out = self.target(token_ids, positions, rows, cache, self.capture_layers, kv_len=key_positions.shape[0],
                          tree=tree)
        return (out.logits, out.hidden, *cache.present())


class DrafterCandidates(nn.Module):
    """drafter_candidates.onnx: TorchExecutor.draft_candidates' drafter pass (as drafter_draft's) + the `k` best
    tokens per draft position and their log-probabilities, k the length of the `candidates` input."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter):
        super().__init__()
        self.target, self.drafter = target, drafter

    def forward(self, block_ids, positions, context_hidden, context_positions, key_positions, candidates,
                past: list[torch.Tensor]):
        cache = GraphKVCache(past)
        rows = torch.arange(block_ids.shape[0], device=block_ids.device)
        hidden = self.drafter(self.target.embed(block_ids), positions, positions[:, 0], rows, cache,
                              context_hidden, context_positions, kv_len=key_positions.shape[0])
        ids, logprobs = self.drafter.top_candidates(hidden, self.target.logits, candidates.shape[0])
        return (ids[:, 1:], logprobs[:, 1:], *cache.present())  # (row 0 dropped last, as drafter_draft's)


@dataclass(frozen=True)
class _Graph:
    name: str
    module: nn.Module
    args: tuple  # sample inputs: shapes only matter, every dimension below is dynamic
    dynamic_shapes: tuple
    input_names: list[str]
    output_names: list[str]
    axis_names: dict[tuple[str, int], str]  # (input name, axis) -> ONNX dimension name


def _caches(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int, max_len: int,
            v_head_dim: int | None = None):
    """Sample past_key_0, past_value_0, ... (`v_head_dim`: V's head size where it differs from K's)."""
    widths = (head_dim, head_dim if v_head_dim is None else v_head_dim)
    return [torch.zeros(batch, kv_heads, max_len, widths[i % 2], dtype=dtype) for i in range(2 * num_layers)]


def _graphs(target: TargetModel, drafter: DFlashDrafter | None, trees: bool = False,
            in_place: bool = False, rings: bool = False, token_step: bool = False,
            rewrite_rings: bool = False) -> list[_Graph]:
    """The graphs to export, with their sample inputs and dynamic dimensions (`trees`: the draft trees' too;
    `in_place`: target_decode too; `rings`: target_step's sliding-window layers keep rings, GraphKVCache, written as
    TensorRT can with `rewrite_rings`; `token_step`: a Qwen3.5 target's target_token too)."""
    batch, max_len = Dim("batch", min=1), Dim("max_len", min=2)
    b, n = 3, 24  # sample batch and max_len (sample sizes all differ, so no two dimensions get unified)
    cache_axes = {0: batch, 2: max_len}

    def names(layers: int | list[int]) -> dict[tuple[str, int], str]:
        return {(c, a): d for c in cache_names(layers, "past") for a, d in ((0, "batch"), (2, "max_len"))}

    spec = target.spec
    attention = spec.attention_layers  # (a hybrid model's: not all)
    heads, k_dims, v_dims = target.kv_layout()  # (every attention layer's alike in the targets the graphs export)
    a, dtype = attention[0], target.lm_head.weight.dtype
    t_past = _caches(len(attention), heads[a], k_dims[a], dtype, b, n, v_dims[a])
    capture = drafter.params.target_layer_ids if drafter is not None else ()
    seq, keys = Dim("seq", min=1), Dim("keys", min=1)
    step_ids = (torch.zeros(b, 5, dtype=torch.long), torch.arange(5).expand(b, 5).contiguous(), torch.arange(11))
    step_axes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: keys})
    step_outputs = ["logits", *(["hidden"] if capture else []), *cache_names(attention, "present")]
    step_names = {("token_ids", 0): "batch", ("token_ids", 1): "seq", ("key_positions", 0): "keys",
                  **names(attention)}
    if not spec.has_recurrent_state:
        ringed = [i for i in attention if rings and spec.is_sliding(i)]
        ring, r = Dim("ring", min=2), 19  # (sample length: differs from every other)
        past, axes = list(t_past), [cache_axes] * len(t_past)
        for j in (2 * attention.index(i) + kv for i in ringed for kv in (0, 1)):
            past[j], axes[j] = past[j][:, :, :r].clone(), {0: batch, 2: ring}
        graphs = [_Graph(TARGET_STEP, TargetStep(target, capture, ringed, rewrite_rings), (*step_ids, past),
                         (*step_axes, axes),
                         ["token_ids", "positions", "key_positions", *cache_names(attention, "past")], step_outputs,
                         {**step_names, **{(c, 2): "ring" for c in cache_names(ringed, "past")}})]
    else:  # Qwen3.5: the Gated DeltaNet layers' states, and the replay graph that resumes them
        linear = list(target.linear_index)
        depth = drafter.params.block_size if drafter is not None else 2  # (the executors' depth: a verify block)
        states = RecurrentStates.of(spec, target.tp.size, b, depth, dtype)
        read, replayed = ([buf for _, buf in states.named(linear, kinds)] for kinds in (READ_KINDS, REPLAY_KINDS))
        kept = torch.tensor([0, 2, 1])
        graphs = [_Graph(
            TARGET_STEP, RecurrentTargetStep(target, capture, depth),
            (*step_ids, kept, torch.tensor([5, 3, 5]), t_past, read),
            (*step_axes, {0: batch}, {0: batch}, [cache_axes] * len(t_past), [{0: batch}] * len(read)),
            ["token_ids", "positions", "key_positions", "kept", "valid", *cache_names(attention, "past"),
             *state_names(linear, "past", READ_KINDS)],
            [*step_outputs, *state_names(linear, "present")],
            {**step_names, **{(name, 0): "batch" for name in state_names(linear, "past", READ_KINDS)}},
        ), _Graph(
            TARGET_REPLAY, TargetReplay(),
            (kept, torch.arange(2), replayed),
            ({0: batch}, {0: Dim("steps", min=1, max=depth)}, [{0: batch}] * len(replayed)),
            ["kept", "steps", *state_names(linear, "past", REPLAY_KINDS)],
            state_names(linear, "present", ("state",)),
            {("kept", 0): "batch", ("steps", 0): "steps",
             **{(name, 0): "batch" for name in state_names(linear, "past", REPLAY_KINDS)}},
        )]
    if in_place and not spec.has_recurrent_state:
        graphs.append(_Graph(
            TARGET_DECODE, TargetDecode(target, capture),
            (torch.zeros(b, 1, dtype=torch.long), torch.tensor([[4], [6], [9]]), t_past),
            ({0: batch}, {0: batch}, [cache_axes] * len(t_past)),
            ["token_ids", "positions", *cache_names(attention, "past")], step_outputs,
            {("token_ids", 0): "batch", **names(attention)},
        ))
    elif in_place:  # Qwen3.5: conv and state read and written, no delta_*
        graphs.append(_Graph(
            TARGET_DECODE, RecurrentTargetDecode(target, capture, depth),
            (torch.zeros(b, 1, dtype=torch.long), torch.tensor([[4], [6], [9]]), kept, t_past, read),
            ({0: batch}, {0: batch}, {0: batch}, [cache_axes] * len(t_past), [{0: batch}] * len(read)),
            ["token_ids", "positions", "kept", *cache_names(attention, "past"),
             *state_names(linear, "past", READ_KINDS)],
            [*step_outputs, *state_names(linear, "present", READ_KINDS)],
            {("token_ids", 0): "batch", **names(attention),
             **{(name, 0): "batch" for name in state_names(linear, "past", READ_KINDS)}},
        ))
    elif token_step and spec.has_recurrent_state:  # TensorRT's one-token pass: no loop (RecurrentTargetToken)
        graphs.append(_Graph(
            TARGET_TOKEN, RecurrentTargetToken(target, capture, depth),
            (torch.zeros(b, 1, dtype=torch.long), torch.tensor([[4], [6], [9]]), torch.arange(11), kept, t_past, read),
            ({0: batch}, {0: batch}, {0: keys}, {0: batch}, [cache_axes] * len(t_past), [{0: batch}] * len(read)),
            ["token_ids", "positions", "key_positions", "kept", *cache_names(attention, "past"),
             *state_names(linear, "past", READ_KINDS)],
            [*step_outputs, *state_names(linear, "present", READ_KINDS)],
            {("token_ids", 0): "batch", ("key_positions", 0): "keys", **names(attention),
             **{(name, 0): "batch" for name in state_names(linear, "past", READ_KINDS)}},
        ))
    if drafter is None:
        return graphs

    d_layers, d_attn = drafter.spec.num_layers, drafter.layers[0].self_attn
    d_past = _caches(d_layers, d_attn.num_kv_heads, d_attn.head_dim, drafter.norm.weight.dtype, b, n)
    features = len(drafter.params.target_layer_ids) * target.spec.hidden_size
    ctx, block = Dim("ctx", min=1), Dim("block", min=2)
    graphs.append(_Graph(
        DRAFTER_CONTEXT, DrafterContext(drafter),
        (torch.zeros(b, 6, features, dtype=drafter.norm.weight.dtype), torch.arange(6).expand(b, 6).contiguous(),
         d_past),
        ({0: batch, 1: ctx}, {0: batch, 1: ctx}, [cache_axes] * len(d_past)),
        ["target_hidden", "positions", *cache_names(d_layers, "past")],
        cache_names(d_layers, "present"),
        {("target_hidden", 0): "batch", ("target_hidden", 1): "ctx", **names(d_layers)},
    ))
    starts = torch.tensor([4, 6, 9])
    context_starts = starts - torch.tensor([2, 1, 4])  # 2, 1 and 4 new positions, padded to 5 rows
    # A DFlash2 drafter's walk runs once per draft position: its graph has the trained block, static.
    dflash2 = drafter.params.dflash2 is not None
    width, block_axis = (drafter.params.block_size, {0: batch}) if dflash2 else (7, {0: batch, 1: block})
    graphs.append(_Graph(
        DRAFTER_DRAFT, DrafterDraft(target, drafter),
        (torch.zeros(b, width, dtype=torch.long), starts[:, None] + torch.arange(width),
         torch.zeros(b, 5, features, dtype=drafter.norm.weight.dtype), context_starts[:, None] + torch.arange(5),
         torch.arange(13), d_past),
        (block_axis, block_axis, {0: batch, 1: ctx}, {0: batch, 1: ctx}, {0: keys},
         [cache_axes] * len(d_past)),
        ["block_ids", "positions", "context_hidden", "context_positions", "key_positions",
         *cache_names(d_layers, "past")],
        ["draft_tokens", *cache_names(d_layers, "present")],
        {("block_ids", 0): "batch", **({} if dflash2 else {("block_ids", 1): "block"}), ("context_hidden", 1): "ctx",
         ("key_positions", 0): "keys", **names(d_layers)},
    ))
    # (a DFlash2 drafter's walk is one chain, and a recurrent state follows one sequence: no trees)
    if not trees or dflash2 or spec.has_recurrent_state:
        return graphs
    # Draft trees (speculative/tree.py): the drafter's candidates, and a target pass over the trees' nodes
    nodes, k = Dim("nodes", min=2), Dim("candidates", min=1)
    graphs.append(_Graph(
        DRAFTER_CANDIDATES, DrafterCandidates(target, drafter),
        (torch.zeros(b, 7, dtype=torch.long), starts[:, None] + torch.arange(7),
         torch.zeros(b, 5, features, dtype=drafter.norm.weight.dtype), context_starts[:, None] + torch.arange(5),
         torch.arange(13), torch.arange(4), d_past),
        ({0: batch, 1: block}, {0: batch, 1: block}, {0: batch, 1: ctx}, {0: batch, 1: ctx}, {0: keys}, {0: k},
         [cache_axes] * len(d_past)),
        ["block_ids", "positions", "context_hidden", "context_positions", "key_positions", "candidates",
         *cache_names(d_layers, "past")],
        ["candidate_ids", "candidate_logprobs", *cache_names(d_layers, "present")],
        {("block_ids", 0): "batch", ("block_ids", 1): "block", ("context_hidden", 1): "ctx",
         ("key_positions", 0): "keys", ("candidates", 0): "candidates", **names(d_layers)},
    ))
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]] * b)  # a tree of 6 nodes: 0 -> (1, 2), 1 -> 3, 2 -> 4, 3 -> 5
    tree = torch.eye(6, dtype=torch.bool).expand(b, 6, 6).clone()
    for node, parent in ((1, 0), (2, 0), (3, 1), (4, 2), (5, 3)):
        tree[:, node] |= tree[:, parent]
    graphs.append(_Graph(  # (over target_step's caches: `past`, its rings included)
        TARGET_TREE, TargetTree(target, capture, ringed),
        (torch.zeros(b, 6, dtype=torch.long), starts[:, None] + depths, tree, torch.arange(17), past),
        ({0: batch, 1: nodes}, {0: batch, 1: nodes}, {0: batch, 1: nodes, 2: nodes}, {0: keys}, axes),
        ["token_ids", "positions", "tree", "key_positions", *cache_names(attention, "past")],
        ["logits", "hidden", *cache_names(attention, "present")],
        {("token_ids", 0): "batch", ("token_ids", 1): "nodes", ("key_positions", 0): "keys",
         **names(attention), **{(c, 2): "ring" for c in cache_names(ringed, "past")}},
    ))
    return graphs


def _check_exportable(model: nn.Module, what: str) -> None:
    for name, module in model.named_modules():
        if isinstance(module, QuantizedInput) and module.stored_weight is None:
            raise ValueError(f"{what}.{name}: {module.fmt} linears are exported only with their stored weight "
                             "(keep_stored_weights)")
        if isinstance(module, Experts):
            for projection in EXPERT_WEIGHTS:
                quantized = isinstance(getattr(module, f"{projection}_input"), ActivationQuant)
                if quantized and projection not in module.stored_formats:
                    raise ValueError(f"{what}.{name}.{projection}: quantized experts are exported only with their "
                                     "stored weights (keep_stored_weights)")


def keep_stored_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> int:
    """Give every QuantizedInput of `model` its stored weight, and every quantized experts projection its stored
    experts, from `state` (the model's own tensors in ModelOpt's unified format, HF names), so its graph holds
    FP8 / NVFP4 weights and Q/DQ nodes; returns how many."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantizedInput):
            q = read_quantized_linear(state, name)
            assert q is not None, name
            module.keep_stored_weight(q)
            count += 1
        elif isinstance(module, Experts):
            for projection in EXPERT_WEIGHTS:
                experts = read_quantized_experts(state, f"{name}.{projection}")
                if experts is not None:
                    module.keep_stored(projection, experts)
                    count += 1
    return count


def _to_onnx(graph: _Graph) -> ir.Model:
    # Strict (dynamo) tracing turns the models' int(positions.max()) into a data-dependent size.
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        program = torch.export.export(graph.module, graph.args, dynamic_shapes=graph.dynamic_shapes, strict=True)
    # (onnx_ir warns, once per node, that a Scan's empty axes lists default to INTS, which is their type: not the
    # user's business, so not printed during a build)
    quiet = logging.getLogger("onnx_ir._convenience")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        onnx_program = torch.onnx.export(
            program, dynamo=True, opset_version=OPSET, custom_translation_table=TRANSLATIONS,
            input_names=graph.input_names, output_names=graph.output_names, optimize=True, verbose=False,
        )
    finally:
        quiet.setLevel(level)
    inputs = {v.name: v for v in onnx_program.model.graph.inputs}
    onnx_program.rename_axes({inputs[name].shape[axis]: dim for (name, axis), dim in graph.axis_names.items()})
    model = onnx_program.model
    model.producer_name, model.producer_version = "trtllm-dflash", None
    for node in model.graph:  # keep the module path of each node, drop the tracer's stack traces (file paths)
        for key in [k for k in node.metadata_props if k != "namespace"]:
            del node.metadata_props[key]
        if "namespace" in node.metadata_props:  # ("<function sym_min at 0x7f..>": the same graph in every process)
            node.metadata_props["namespace"] = _ADDRESS.sub("", node.metadata_props["namespace"])
    model.graph.name = graph.name
    return model


def _save_sharing_weights(models: dict[str, ir.Model], out_dir: Path) -> list[Path]:
    """Write `<name>.onnx` for each model and one WEIGHTS_FILE with each distinct initializer once."""
    offsets: dict[bytes, int] = {}  # sha256 of the bytes -> offset in WEIGHTS_FILE
    paths = []
    with open(out_dir / WEIGHTS_FILE, "wb") as data:
        for name, model in models.items():
            for value in model.graph.initializers.values():
                tensor = value.const_value
                if tensor.nbytes < _EXTERNAL_MIN_BYTES:
                    continue
                raw = tensor.tobytes()
                key = hashlib.sha256(raw).digest()
                if key not in offsets:
                    data.write(b"\0" * (-data.tell() % _ALIGN))
                    offsets[key] = data.tell()
                    data.write(raw)
                value.const_value = ir.ExternalTensor(WEIGHTS_FILE, offsets[key], len(raw), tensor.dtype,
                                                      shape=tensor.shape, name=value.name, base_dir=out_dir)
            paths.append(out_dir / f"{name}.onnx")
            ir.save(model, paths[-1])
    return [*paths, out_dir / WEIGHTS_FILE]


def _claim_order(graph: _Graph) -> tuple[bool, bool]:
    """Processes sharing a rank's graphs claim the target's first (they trace its many layers; the one-token
    target_decode, about half of target_step's time, last among them), then the drafter's: on the demo pair,
    target_step 61 s, target_tree 59, target_decode 31, drafter_draft 19, drafter_candidates 17, drafter_context 6."""
    return not graph.name.startswith("target"), graph.name == TARGET_DECODE


def claim_file(claims: Path) -> Callable[[str], bool]:
    """A claim on a graph between processes: the first to create `claims/<name>` exports it."""
    def claim(name: str) -> bool:
        try:
            os.close(os.open(claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True
    return claim


def export_engine_graphs(target: TargetModel, drafter: DFlashDrafter | None, out_dir: Path,
                         experts_op: ExpertsOp | None = None, trees: bool = False, in_place: bool = False,
                         rings: bool = False, token_step: bool = False, rewrite_rings: bool = False,
                         claim: Callable[[str], bool] | None = None) -> list[Path]:
    """Export target_step (and, with a drafter, drafter_context and drafter_draft; with `trees` too,
    drafter_candidates and target_tree) into `out_dir`.

    Returns the written files: the .onnx graphs, then their shared external data. Without a drafter,
    target_step has no `hidden` output (plain autoregressive engines). `experts_op`: every MLP of experts that can be
    (experts_as_one_op) is one node, onnxruntime's com.microsoft.MoE ("onnxruntime") or TensorRT's TRT_MoE
    ("tensorrt": compile builds it into IMoELayer on Blackwell and rewrites it into the dense form elsewhere,
    onnx_ops.dense_experts), recorded in the graphs' metadata as `experts_op`; otherwise (None) the experts' dense
    form (docs/backends.md §gpt-oss in the graphs). `in_place` (graphs for onnxruntime): target_decode too, where the
    target can run it (attends_in_place). `rings`: target_step's
    sliding-window layers keep rings of the window + ring_pass_tokens positions (GraphKVCache), recorded in its metadata
    as `window_ring_pass`, written in TensorScatter's circular mode, or with `rewrite_rings` (graphs for TensorRT, whose
    KV-cache update writes linearly only) the whole ring through one linear update (metadata `window_ring_write`:
    "rewrite"). `token_step` (graphs for TensorRT): a Qwen3.5 target's target_token too (one token per row without a
    loop). `claim` (several processes exporting one rank's graphs, each into an `out_dir` of its own: engine/builder.py
    export_graphs): only the graphs that `claim(name)` grants, asked just before each is exported, in _claim_order;
    `out_dir` then also holds PART_ORDER, for merge_graph_parts.
    """
    _check_exportable(target, "target")
    if drafter is not None:
        _check_exportable(drafter, "drafter")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    one_op = [m for m in target.modules() if experts_op and experts_as_one_op(m)]
    try:
        for m in one_op:
            m.export_experts_op = experts_op
        ring_pass = ring_pass_tokens(target, drafter) if rings else None
        graphs = _graphs(target, drafter, trees, in_place and attends_in_place(target), ring_pass is not None,
                         token_step, rewrite_rings)
        exported = {g.name: _to_onnx(g) for g in sorted(graphs, key=_claim_order) if claim is None or claim(g.name)}
        models = {g.name: exported[g.name] for g in graphs if g.name in exported}  # (in _graphs' order)
    finally:
        for m in one_op:
            m.export_experts_op = None
    for model in models.values():  # which rank of which split: checked by compile before TensorRT reads it
        model.metadata_props.update({"rank": str(target.tp.rank), "tp_size": str(target.tp.size)})
        if one_op:
            model.metadata_props[EXPERTS_OP_KEY] = (f"{MOE_DOMAIN}.{MOE_OP}" if experts_op == "onnxruntime"
                                                    else f"{TRT_MOE_DOMAIN}.{TRT_MOE_OP}")
    step = models.get(TARGET_STEP)
    if ring_pass is not None and step is not None:
        step.metadata_props[RING_PASS_KEY] = str(ring_pass)
        if rewrite_rings:
            step.metadata_props[RING_WRITE_KEY] = "rewrite"
    if target.spec.has_recurrent_state and step is not None:  # (GraphRecurrentStates.begin)
        step.metadata_props[ONE_TOKEN_ADVANCES_KEY] = "1"
    tree = models.get(TARGET_TREE)
    if target.spec.sliding_window and tree is not None:  # (TargetModel.forward: visible_keys)
        tree.metadata_props[TREE_WINDOWS_KEY] = "1"
    written = _save_sharing_weights(models, out_dir)
    # the acceptance step, in its plain-op and its plugin form (compile/accept_graph.py)
    if drafter is not None and (claim is None or claim(ACCEPT)):
        p = drafter.params
        written += [export_accept_graph(out_dir / f"{ACCEPT}.onnx", p.mask_token_id),
                    plugin_accept_graph(out_dir / f"{ACCEPT_PLUGIN}.onnx", p.mask_token_id, p.block_size)]
    if claim is not None:
        (out_dir / PART_ORDER).write_text(json.dumps([g.name for g in graphs]))
    return written


def merge_graph_parts(parts: Sequence[Path], out_dir: Path) -> list[Path]:
    """One rank's graphs, exported in `parts` by several processes (export_engine_graphs' `claim`), written into
    `out_dir` as one process writes them: the graphs in their order, one WEIGHTS_FILE holding each distinct
    initializer once, then the acceptance steps. Returns the written files."""
    order = json.loads((parts[0] / PART_ORDER).read_text())
    where = {path.stem: path for part in parts for path in part.glob("*.onnx")}
    missing = [name for name in order if name not in where]
    if missing:
        raise RuntimeError(f"no export process wrote graph {missing[0]}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    written = _save_sharing_weights({name: ir.load(where[name]) for name in order}, out_dir)
    for name in (ACCEPT, ACCEPT_PLUGIN):
        if name in where:
            written.append(Path(out_dir) / f"{name}.onnx")
            os.replace(where[name], written[-1])
    return written
