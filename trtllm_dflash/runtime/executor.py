"""The Executor contract and its torch implementation.

The seam between the algorithm (runtime/decoding.py) and the hardware: given a batch's token ids,
start positions and cache slots, run the target (and the drafter) and return logits, captured
hidden states or draft tokens. The torch executor is the reference; a TensorRT executor binds the
same tensors to an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file

from trtllm_dflash.engine_dir import DRAFTER_PREFIX, TARGET_PREFIX, EngineConfig, rank_file
from trtllm_dflash.models.drafter import DFlashDrafter
from trtllm_dflash.models.layers import KVCache
from trtllm_dflash.models.moe import experts_graph_problem
from trtllm_dflash.models.quantized import dequantize_state_dict, quantize_inputs
from trtllm_dflash.models.spec import DecoderSpec, DFlash2Params, DFlashParams, hf_config_from_dict
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.parallel.group import TPGroup
from trtllm_dflash.runtime.cuda_graphs import StaticPasses
from trtllm_dflash.runtime.kv_blocks import (
    BLOCK_TOKENS,
    BlockTables,
    CacheShape,
    PagedKVCache,
    blocks_for,
    plan_blocks,
    prefix_hashes,
    window_pool,
)
from trtllm_dflash.runtime.prefix_states import KeepsPrefixStates, PrefixStates
from trtllm_dflash.speculative.core import Sampling, block_input, verify_block


def engine_specs(cfg: EngineConfig) -> tuple[DecoderSpec, DecoderSpec, DFlashParams]:
    """The target, drafter and DFlash parameters an engine config describes."""
    target = DecoderSpec.from_hf(hf_config_from_dict(cfg.target, "engine target"))
    drafter = DecoderSpec.from_hf(hf_config_from_dict(cfg.drafter, "engine drafter"))
    d = cfg.dflash
    dflash2 = None if d.dflash2 is None else DFlash2Params(**d.dflash2.model_dump())
    return target, drafter, DFlashParams(d.block_size, d.mask_token_id, tuple(d.target_layer_ids), dflash2)


class CudaGraphsError(ValueError):
    """CUDA graphs were asked for a target whose passes cannot be captured (the reason, in words)."""


@dataclass(frozen=True)
class StepOutput:
    """What a target pass returns, whatever runs it."""

    logits: torch.Tensor  # [B, T, vocab] float32 (T = 1 with `last_index`)
    hidden: torch.Tensor | None  # [B, T, len(target_layer_ids) * hidden_size] with `capture`, else None


@dataclass(frozen=True)
class DraftContext:
    """Target features that a draft pass adds to the drafter's context before it drafts (Executor.draft).

    Row b holds features of positions starts[b] .. starts[b] + C - 1. A request with fewer new positions than C is
    padded at the end: its padding rows fall at or after its block's start, where the drafter's cache is masked
    and later overwritten. C may exceed a request's own count by at most the drafter's block_size: a slot's caches
    hold that many positions past max_seq_len."""

    hidden: torch.Tensor  # [B, C, len(target_layer_ids) * hidden_size]
    starts: torch.Tensor  # [B] int64

    @classmethod
    def padding(cls, starts: torch.Tensor, features: int, dtype: torch.dtype) -> "DraftContext":
        """One row of zeros per request at its block's first position, for a draft graph when a step has no context
        to add: the graphs take at least one row (a dimension of 0 is not one every runtime accepts), and the
        drafter's mask hides that position until the next step's context overwrites it."""
        return cls(torch.zeros(starts.shape[0], 1, features, dtype=dtype, device=starts.device), starts)

    def positions(self) -> torch.Tensor:
        """[B, C] absolute position of each row."""
        return self.starts[:, None] + torch.arange(self.hidden.shape[1], device=self.starts.device)


@dataclass(frozen=True)
class HostRows:
    """What the host already knows about a pass's rows (the Decoder's own bookkeeping), handed to an executor with the
    device tensors so that it never reads them back: on a GPU every such read waits for the queue to drain.

    Row b is request slot slots[b], its tokens at positions starts[b] .. starts[b] + T - 1 (T: the pass's tokens per
    row; for a draft pass with context, the context's rows start earlier, see DraftContext)."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]

    def attended(self, tokens: int) -> int:
        """Keys the longest row attends to in a pass of `tokens` per row: positions 0 .. max(start) + tokens - 1."""
        return max(self.starts) + tokens

    def slot_run(self) -> slice | None:
        """The slots as one slice when they are consecutive and increasing (a cache can then be read as a view), else
        None."""
        first = self.slots[0]
        return slice(first, first + len(self.slots)) if self.slots == tuple(range(first, first + len(self.slots))) \
            else None


class Executor(Protocol):
    """Runs the target and the drafter over per-slot KV caches; everything the Decoder relies on.

    Token ids, starts and slots are int64 tensors on `device`. A slot's caches hold positions
    0 .. max_seq_len + block_size - 1; positions at or after a slot's current start are garbage until
    written and are never attended to, so rejected drafts need no clean-up.
    """

    device: torch.device
    num_slots: int  # KV-cache slots: requests decoded at once
    vocab_size: int
    max_seq_len: int  # prompt + output tokens a slot holds
    block_size: int  # tokens per DFlash block at run time (1 without a drafter)
    # positions per prompt block shared by prefix (`reserve`); None: the executor shares no prefix
    prefix_block_tokens: int | None
    # whether prefix reuse also keeps recurrent states at checkpoints (a hybrid target's): then where a waiting prompt
    # leaves a prompt being prefilled is worth a checkpoint of the latter
    resumes_states: bool

    def target_forward(self, token_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
                       capture: bool, last_index: torch.Tensor | None = None, rows: HostRows | None = None
                       ) -> StepOutput:
        """token_ids [B, T] at positions starts[:, None] + arange(T), written into the slots' caches. `rows`: the
        same starts and slots as the host knows them (None: the executor may read the tensors)."""
        ...

    def draft(self, anchors: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
              num_drafts: int | None = None, context: DraftContext | None = None,
              rows: HostRows | None = None, width: int | None = None) -> torch.Tensor:
        """Greedy drafts [B, num_drafts] (default width - 1) for the block [anchor, MASK...] of `width` positions
        (default block_size; at most the drafter's trained block) at starts + arange(width). The drafter always runs
        over the whole block; only the first num_drafts drafts are read out (an executor may save the lm_head of the
        others). With `context`, the same drafter pass first adds those features to the drafter's context (each
        request's positions up to its start)."""
        ...

    def append_context(self, hidden: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
                       rows: HostRows | None = None) -> None:
        """Give the drafter captured target features hidden [B, C, F] at positions starts + arange(C), in a pass
        of their own (many positions: a prompt, or what plain AR steps held back)."""
        ...

    def accept(self, draft: torch.Tensor, logits: torch.Tensor, sampling: Sampling,
               starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance step of a verify pass: (accepted [B], bonus [B]), exactly speculative.core.verify_block
        (the target's greedy or sampled token per row, the longest matching prefix of the draft)."""
        ...

    def reserve(self, slot: int, tokens: list[int], share: str | None = None, headroom: int = 0,
                waiting: Sequence[int] = ()) -> int | None:
        """Before a request takes `slot` to prefill `tokens` (a prompt; a preempted request's prompt and the tokens it
        had committed but the last): whether the caches can hold those positions and the first step's writes past them,
        taking them if so (a paged cache's blocks, leaving `headroom` blocks free for the running requests and, for
        requests to be admitted after it, the blocks of each of `waiting` positions); None: not now (it waits for a
        release). Returns how many of the first positions are already in the caches (a shared prefix
        whose blocks were published with the same `share`, what they hold: runtime/kv_blocks.py), which its prefill
        skips; `share` None: no sharing. Static caches: always 0."""
        ...

    def extend(self, slot: int, start: int) -> bool:
        """Before a step of the request in `slot` whose anchor is at `start`: whether the caches hold every position the
        step can write (a paged cache takes the blocks it needs; False: none free, someone must be preempted).
        Static caches: always."""
        ...

    def publish(self, slot: int) -> None:
        """The request in `slot` has prefilled its prompt: its full prompt blocks may be shared (see reserve)."""
        ...

    def checkpoints(self, slot: int) -> tuple[int, ...]:
        """Positions (multiples of prefix_block_tokens, inside the prefill of the request just reserved in `slot`)
        where a prefill pass should end so that `checkpoint` keeps the target's recurrent states there for later
        requests with the same prefix: a hybrid target's prefix reuse (runtime/prefix_states.py). () for the others."""
        ...

    def checkpoint(self, slot: int, position: int) -> None:
        """A prefill pass of the request in `slot` has just ended at `position` (a multiple of prefix_block_tokens past
        what it found cached): keep its recurrent states there, if the executor keeps any (`resumes_states`)."""
        ...

    def release(self, slot: int) -> None:
        """The request in `slot` is done; the slot will be reused from position 0."""
        ...


# Attended lengths of eager passes are rounded up to a multiple of this. A pass then attends to masked keys up to the
# bucket's end (the masks come from positions on the device, so no value changes) and reads them as views of the
# cache. 16, not 64: an eager pass needs no fixed shapes (the CUDA graphs have their own, coarser buckets:
# runtime/cuda_graphs.py), and on the demo engine's CPU passes rounding 65 keys up to 128 cost 4-7% at batch 8 where
# multiples of 16 cost nothing measurable (benchmarks/kv_in_place.py); 16 keeps the additive mask's last dimension
# aligned as CUDA's memory-efficient SDPA wants it (it pads the mask to a multiple of 8 or 16 otherwise).
KV_BUCKET = 16


def cache_shape(model: TargetModel | DFlashDrafter) -> CacheShape:
    """What one position costs in `model`'s KV caches (per-layer heads and head sizes: Gemma 4's differ)."""
    if isinstance(model, TargetModel):
        heads, head_dim, v_head_dim = model.kv_layout()
        return CacheShape(model.spec.num_layers, heads, head_dim, model.lm_head.weight.element_size(), v_head_dim)
    attn = [layer.self_attn for layer in model.layers]
    return CacheShape(len(attn), [a.num_kv_heads for a in attn], [a.head_dim for a in attn],
                      model.norm.weight.element_size())


def attended_keys(rows: HostRows | None, starts: torch.Tensor | None, tokens: int, capacity: int) -> int:
    """The keys a pass over `tokens` per row attends to (positions 0 .. max(start) + tokens - 1), rounded up to a
    multiple of KV_BUCKET and at most the cache's `capacity`: from what the host knows (`rows`), else read from
    `starts` (one host read). The compiled executors give it to their graphs as the length of `key_positions`."""
    exact = rows.attended(tokens) if rows is not None else int(starts.max()) + tokens
    return min(-(-max(exact, 1) // KV_BUCKET) * KV_BUCKET, capacity)


@contextmanager
def on_stream(stream: torch.cuda.Stream | None, device: torch.device) -> Iterator[None]:
    """The compiled executors' passes on their own CUDA `stream` (their sessions' or plans' stream) with the torch ops
    around them, after the caller's pending work; the caller's stream then waits for them, so it reads their outputs
    only once written. No stream (CPU): nothing."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


def logits_at_last(logits: torch.Tensor, last_index: torch.Tensor, first: int,
                   picked: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill run in passes (the compiled executors): `logits` [B, T, V] of the pass over columns first ..
    first + T - 1 -> [B, 1, V], each row's logits at its last_index [B] where this pass holds it, else `picked`'s (the
    earlier passes'). No host read: a where, not an index."""
    here = (last_index >= first) & (last_index < first + logits.shape[1])
    column = (last_index - first).clamp(0, logits.shape[1] - 1)
    found = logits.gather(1, column[:, None, None].expand(-1, 1, logits.shape[2]))
    return found if picked is None else torch.where(here[:, None, None], found, picked)


class TorchExecutor(KeepsPrefixStates):
    """Target + drafter as torch modules, with static per-slot KV caches for both."""

    @classmethod
    def from_engine(cls, root: Path, cfg: EngineConfig, rank: int, tp: TPGroup, device: str,
                    block_size: int | None, cuda_graphs: bool | None = None,
                    kv_cache_memory: int | Callable[[], int] | None = None,
                    prefix_cache: bool = True, tree_budget: int = 0,
                    prefix_states: int | None = None) -> "TorchExecutor":
        """This rank's shard of a verified engine directory, dequantized for the torch modules."""
        target_spec, drafter_spec, params = engine_specs(cfg)
        weights = load_file(str(Path(root) / rank_file(rank)), device=device)
        split = {p: {k[len(p):]: v for k, v in weights.items() if k.startswith(p)}
                 for p in (TARGET_PREFIX, DRAFTER_PREFIX)}
        dtype = getattr(torch, cfg.dtype)
        target_state, quantized_inputs = dequantize_state_dict(split[TARGET_PREFIX], dtype)
        target = TargetModel.from_state_dict(target_spec, target_state, tp)
        quantize_inputs(target, quantized_inputs)
        drafter_state, drafter_inputs = dequantize_state_dict(split[DRAFTER_PREFIX], dtype)
        drafter = DFlashDrafter.from_state_dict(drafter_spec, params, drafter_state, tp, cfg.dflash.draft_vocab_size)
        quantize_inputs(drafter, drafter_inputs)
        # The weights were loaded onto `device`; the RoPE tables (buffers made at construction) follow them.
        return cls(target.to(device), drafter.to(device), cfg.max_batch_size, cfg.max_seq_len, block_size,
                   cuda_graphs, kv_cache_memory, prefix_cache, tree_budget, prefix_states)

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, num_slots: int, max_seq_len: int,
                 block_size: int | None = None, cuda_graphs: bool | None = None,
                 kv_cache_memory: int | Callable[[], int] | None = None,
                 prefix_cache: bool = True, tree_budget: int = 0, prefix_states: int | None = None):
        """`cuda_graphs`: decode passes (the target's decode and verify passes, the drafter's passes) at bucketed
        shapes over static buffers, captured as CUDA graphs (runtime/cuda_graphs.py); default: on where the device is
        CUDA, the target's passes can be captured there (experts only as grouped GEMMs that read nothing on the host:
        models/moe.py experts_graph_problem) and no tensor parallelism (True turns them on there: every rank pads
        alike; NCCL collectives inside a capture never run); True where they cannot be captured: CudaGraphsError. True
        on a CPU runs the same static passes eagerly (what the tests check; no faster). `kv_cache_memory` (bytes, or a
        function giving them, called once the models are on the device: a fraction of the memory then free): a paged KV
        cache of that size for target and drafter (runtime/kv_blocks.py: blocks taken as requests grow) instead of a
        max_seq_len slot per request. `prefix_cache`: with a paged cache, prompt blocks shared
        across requests with the same prefix, and a hybrid target's recurrent states kept at checkpoints for them:
        `prefix_states` of them (None: one per slot). `tree_budget`: the most draft nodes a tree step verifies (its pass
        writes that many positions and the anchor's), 0: chains only."""
        self.target, self.drafter = target, drafter
        # Tokens per block at run time: the trained block size, or fewer (a shorter block of the same drafter).
        self.block_size = block_size or (drafter.params.block_size if drafter is not None else 1)
        self.num_slots, self.vocab_size, self.max_seq_len = num_slots, target.spec.vocab_size, max_seq_len
        # A verify pass writes block_size positions from the last committed one (a tree's pass: its nodes and anchor).
        margin = max(drafter.params.block_size if drafter is not None else 1, tree_budget + 1)
        self.tree_budget = tree_budget
        self.device = target.lm_head.weight.device
        problem = experts_graph_problem(target)
        if cuda_graphs and problem:
            raise CudaGraphsError(f"not for this {target.spec.model_type} target: {problem}; run it without them.")
        graphs = (self.device.type == "cuda" and problem is None and target.tp.size == 1
                  if cuda_graphs is None else cuda_graphs)
        self._margin = margin
        self.prefix_cache, self._kept_states = prefix_cache, prefix_states or num_slots
        # The Gated DeltaNet layers' states per slot, kept for each position of a pass of up to a verify block (with
        # graphs, and a scratch slot for the padding rows, as the caches below)
        self.target_states = target.new_states(num_slots + 1 if graphs else num_slots, margin)
        # ... and, with a paged cache sharing prefixes, kept at prompt positions (`checkpoint`) for later requests: a
        # state after a prefix is one matrix per layer, which its blocks alone cannot resume
        self.prefix_states: PrefixStates | None = None
        self.kv_blocks: BlockTables | None = None
        self.window_blocks: BlockTables | None = None  # a paged cache's sliding-window layers' tables (rings)
        # With graphs the caches have one more slot, after the requests': the padding rows' scratch (a paged cache's:
        # a row of its tables that no request holds).
        if kv_cache_memory is not None:
            budget = kv_cache_memory() if callable(kv_cache_memory) else kv_cache_memory
            self._paged(budget, num_slots, max_seq_len + margin, scratch=graphs)
        else:
            cache_slots = num_slots + 1 if graphs else num_slots
            self.target_cache = target.new_cache(cache_slots, max_seq_len + margin)
            self.draft_cache = drafter.new_cache(cache_slots, max_seq_len + margin) if drafter is not None else None
        self.graphs = StaticPasses(self._fresh_rows(self._target_pass), self._fresh_rows(self._draft_pass), num_slots,
                                   num_slots, max_seq_len + margin, self.device, capture=self.device.type == "cuda",
                                   views=self.kv_blocks is None) if graphs else None
        self._graph_tokens = margin  # target passes of at most this many tokens per row run as graphs

    def _paged(self, budget: int, num_slots: int, max_positions: int, scratch: bool) -> None:
        """Paged caches of `budget` bytes: the target's sliding-window layers (if any) in rings of their own
        (window_pool), every other layer of target and drafter in blocks of the rest; `scratch`: their tables have
        the static passes' scratch slot."""
        spec, dtype = self.target.spec, self.target.lm_head.weight.dtype
        target, shapes = cache_shape(self.target), [cache_shape(m) for m in (self.target, self.drafter) if m is not None]
        sliding = [i for i in range(spec.num_layers) if spec.is_sliding(i)]
        reserved = 0
        if sliding:
            window_blocks, reserved = window_pool(spec.sliding_window, self._margin, num_slots, max_positions,
                                                  target.of_layers(sliding))
            self.window_blocks = BlockTables(window_blocks, num_slots, max_positions, BLOCK_TOKENS, self.device,
                                             window=spec.sliding_window, scratch=scratch)
            shapes[0] = target.of_layers([i for i in range(spec.num_layers) if i not in sliding])
        reserved_for = "the sliding-window layers'"
        if self.target_states is not None:  # allocated per slot, outside the blocks (and no model has both)
            reserved, reserved_for = reserved + self.target_states.nbytes, "the Gated DeltaNet layers' states"
            if self.prefix_cache:  # (one per slot unless --prefix-states says)
                self.prefix_states = PrefixStates(self.target_states, self._kept_states)
                reserved += self.prefix_states.nbytes
                reserved_for += f", {num_slots} slots' and {self._kept_states} kept for prefix reuse,"
        blocks = plan_blocks(budget, shapes, max_positions, reserved=reserved, reserved_for=reserved_for)
        self.kv_blocks = BlockTables(blocks, num_slots, max_positions, BLOCK_TOKENS, self.device, scratch=scratch)
        layer_tables = [self.window_blocks if i in sliding else self.kv_blocks for i in range(spec.num_layers)]
        self.target_cache = PagedKVCache(self.kv_blocks, target, dtype, self.device, layer_tables)
        self.draft_cache = PagedKVCache(self.kv_blocks, shapes[-1], dtype, self.device) if self.drafter else None

    def _fresh_rows(self, run_pass: Callable) -> Callable:
        """`run_pass` for the static passes: a paged cache's rows computed inside each (PagedKVCache.forget_rows)."""
        def run(*args):
            for cache in (self.target_cache, self.draft_cache):
                if isinstance(cache, PagedKVCache):
                    cache.forget_rows()
            return run_pass(*args)

        return run

    @property
    def _tables(self) -> list[BlockTables]:
        return [t for t in (self.kv_blocks, self.window_blocks) if t is not None]

    @torch.inference_mode()
    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None) -> StepOutput:
        """Run the target on token_ids [B, T] at positions starts[:, None] + arange(T).

        With `capture`, also return the outputs of the drafter's target_layer_ids [B, T, n_feat * H].
        """
        T = token_ids.shape[1]
        if self.graphs is not None and rows is not None and last_index is None and T <= self._graph_tokens:
            return StepOutput(*self.graphs.target(token_ids, starts, slots, capture, rows.slots, rows.attended(T)))
        kv_len, run = self._attended(rows, T, self.target_cache)
        return StepOutput(*self._target_pass(token_ids, starts, slots, capture, kv_len, run, last_index,
                                             self._window_key(rows)))

    def _target_pass(self, token_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, capture: bool,
                     kv_len: int | None, run: slice | None, last_index: torch.Tensor | None = None,
                     window_key: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, hidden) of one target pass attending `kv_len` keys (None: read from the positions), the caches
        read as views of `run` (None: by index), sliding layers from position `window_key` on."""
        positions = starts[:, None] + torch.arange(token_ids.shape[1], device=self.device)
        layers = self.drafter.params.target_layer_ids if capture else ()
        out = self.target(token_ids, positions, slots, self.target_cache, layers, last_index, kv_len, run,
                          window_key, self.target_states)
        return out.logits, out.hidden

    def _window_key(self, rows: HostRows | None) -> int:
        """The first key a sliding layer's query of this pass can see (the earliest row's start - window + 1), rounded
        down to a multiple of KV_BUCKET; 0 without sliding layers or without `rows`. Its reads and masks start there:
        the window's keys, not the whole context's."""
        window = self.target.spec.sliding_window
        if window is None or rows is None:
            return 0
        return max(0, min(rows.starts) - window + 1) // KV_BUCKET * KV_BUCKET

    @torch.inference_mode()
    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None) -> torch.Tensor:
        """Greedy drafts [B, num_drafts] for the block after each anchor (at position `starts`), as target
        token ids (a drafter with a pruned vocabulary maps its own through d2t), after adding `context` to the
        drafter's cache in the same pass. The lm_head runs over the num_drafts positions read out only: with a
        small verify length it is most of a small drafter's pass."""
        assert self.drafter is not None
        width = width or self.block_size
        n = width - 1 if num_drafts is None else num_drafts
        context_hidden, context_starts = (None, None) if context is None else (context.hidden, context.starts)
        if self.graphs is not None and rows is not None:
            return self.graphs.draft(anchors, starts, slots, n, width, context_hidden, context_starts, rows.slots,
                                     rows.attended(0))
        kv_len, run = self._attended(rows, 0, self.draft_cache)  # the context keys: positions before each start
        return self._draft_pass(anchors, starts, slots, n, width, context_hidden, context_starts, kv_len, run)

    def _draft_pass(self, anchors: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, num_drafts: int,
                    width: int, context_hidden: torch.Tensor | None, context_starts: torch.Tensor | None,
                    kv_len: int | None, run: slice | None) -> torch.Tensor:
        """Drafts [B, num_drafts] of one drafter pass over blocks of `width`, attending `kv_len` context keys (None:
        read from the starts), its cache read as views of `run` (None: by index)."""
        hidden = self._draft_hidden(anchors, starts, slots, width, context_hidden, context_starts, kv_len, run)
        return self.drafter.greedy_tokens(hidden[:, 1:num_drafts + 1], self.target.logits, anchors)

    def _draft_hidden(self, anchors: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, width: int,
                      context_hidden: torch.Tensor | None, context_starts: torch.Tensor | None, kv_len: int | None,
                      run: slice | None) -> torch.Tensor:
        """The drafter's final-normed hidden states [B, width, hidden] of the blocks [anchor, MASK, ...], after adding
        the context features to its cache."""
        block = block_input(anchors, self.drafter.params.mask_token_id, width)
        positions = starts[:, None] + torch.arange(width, device=self.device)
        context_positions = None if context_hidden is None else DraftContext(context_hidden, context_starts).positions()
        return self.drafter(self.target.embed(block), positions, starts, slots, self.draft_cache, context_hidden,
                            context_positions, kv_len, run)

    @torch.inference_mode()
    def draft_candidates(self, anchors, starts, slots, k: int, context=None, rows=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """For tree drafting: one drafter pass over the trained block (after adding `context`, as `draft`), and per
        draft position its k best tokens and their log-probabilities, best first: [B, block - 1, k] each."""
        assert self.drafter is not None
        kv_len, run = self._attended(rows, 0, self.draft_cache)
        context_hidden, context_starts = (None, None) if context is None else (context.hidden, context.starts)
        hidden = self._draft_hidden(anchors, starts, slots, self.drafter.params.block_size, context_hidden,
                                    context_starts, kv_len, run)
        return self.drafter.top_candidates(hidden[:, 1:], self.target.logits, k)

    @torch.inference_mode()
    def verify_tree(self, token_ids: torch.Tensor, depths: torch.Tensor, tree: torch.Tensor, starts: torch.Tensor,
                    slots: torch.Tensor, capture: bool, rows: HostRows | None = None) -> StepOutput:
        """One target pass over draft trees (speculative/tree.py): token_ids, depths [B, N] (node 0 the anchor), tree
        [B, N, N] their ancestor mask; node t is cached at starts + t until `keep_path` moves the accepted ones."""
        kv_len, run = self._attended(rows, token_ids.shape[1], self.target_cache)
        layers = self.drafter.params.target_layer_ids if capture else ()
        out = self.target(token_ids, starts[:, None] + depths, slots, self.target_cache, layers, kv_len=kv_len,
                          run=run, window_key=self._window_key(rows), states=self.target_states, tree=tree)
        return StepOutput(out.logits, out.hidden)

    @torch.inference_mode()
    def keep_path(self, slots: torch.Tensor, starts: torch.Tensor, nodes: torch.Tensor) -> None:
        """After a tree's verify pass: the accepted nodes [B, n] (node 0 first; rows padded with 0) move from their
        cache positions starts + node to starts + their depth 0 .. n - 1, where the next pass expects them."""
        src = starts[:, None] + nodes
        dst = starts[:, None] + torch.arange(nodes.shape[1], device=nodes.device)
        dst = torch.where(nodes > 0, dst, src)  # (padding: node 0 onto itself)
        for layer in self.target.spec.attention_layers:
            self.target_cache.move(layer, slots, src, dst)
        if self.target_states is not None:  # (Gated DeltaNet layers: the nodes' kept inputs, into the path's order)
            self.target_states.keep_path(slots, nodes)

    @torch.inference_mode()
    def append_context(self, hidden, starts, slots, rows=None) -> None:
        """Add captured target features hidden [B, C, F] at positions starts[:, None] + arange(C)."""
        assert self.drafter is not None
        positions = starts[:, None] + torch.arange(hidden.shape[1], device=self.device)
        self.drafter.append_context(hidden, positions, slots, self.draft_cache)

    def accept(self, draft, logits, sampling, starts) -> tuple[torch.Tensor, torch.Tensor]:
        return verify_block(draft, logits, sampling, starts)

    def _attended(self, rows: HostRows | None, tokens: int, cache: KVCache) -> tuple[int | None, slice | None]:
        """The keys a pass over `tokens` per row attends to, rounded up to a multiple of KV_BUCKET (at most the cache's
        capacity), and the slots as one run, from what the host knows; (None, None) without `rows` (the model then
        reads the length from the positions)."""
        if rows is None:
            return None, None
        return attended_keys(rows, None, tokens, cache.capacity), rows.slot_run()

    @property
    def prefix_block_tokens(self) -> int | None:
        return BLOCK_TOKENS if self.kv_blocks is not None and self.prefix_cache else None

    def reserve(self, slot: int, tokens: list[int], share: str | None = None, headroom: int = 0,
                waiting: Sequence[int] = ()) -> int | None:
        """Paged: take the blocks of `tokens` and of the first step's writes past them (a verify block), if that many
        and `headroom` more are free beside the blocks of `waiting` positions each; the first blocks (all but the last
        token, whose logits a prefill may need) are shared with earlier requests where published. Static: always,
        nothing shared."""
        if self.kv_blocks is None:
            return 0
        share = share if self.prefix_cache else None
        hashes = prefix_hashes(tokens[:-1], share) if share is not None else []
        positions = len(tokens) + self._margin
        found = min(t.hit_count(hashes) for t in self._tables)  # the rings need the window before the first uncached
        # a hybrid target resumes its states only where they were kept: up to there, the rest is computed again
        hits = found if self.prefix_states is None else self.prefix_states.boundary(hashes, found)
        tables = [(t, headroom + sum(blocks_for(n + self._margin, t.block_tokens) for n in waiting))
                  for t in self._tables]
        if not all(t.can_reserve(positions, hashes, room, hits) for t, room in tables):
            return None
        cached = min(t.reserve(slot, positions, hashes, room, hits) for t, room in tables)
        if self.prefix_states is not None and hashes:
            self.prefix_states.admit(slot, slot, hashes, found, cached)
        return cached

    def extend(self, slot: int, start: int) -> bool:
        """Paged: the blocks of positions up to a verify block past `start`; the rings give back the blocks before the
        window of `start` first. Static: always there."""
        if self.window_blocks is not None:
            self.window_blocks.trim(slot, start - self.window_blocks.window + 1)
        return all(t.extend(slot, start + self._margin) for t in self._tables)

    def publish(self, slot: int) -> None:
        for t in self._tables:
            t.publish(slot)

    def release(self, slot: int) -> None:
        """Paged: the slot's blocks go back to the free list. Static: nothing to do (stale cache rows past a slot's
        start are masked, and overwritten when it is reused)."""
        if self.prefix_states is not None:
            self.prefix_states.release(slot)
        for t in self._tables:
            t.release(slot)
