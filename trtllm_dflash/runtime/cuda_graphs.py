"""Static-shape decode passes for the torch executor, replayed as CUDA graphs on CUDA (issue 28, item 4).

A CUDA graph replays fixed kernels on fixed addresses, so a pass is made static first:
- its rows are padded up to a batch bucket (`batch_bucket`); a padding row reads token 0 at position 0 and writes
  its K/V into the caches' scratch slot (the slot after the last real one; a paged cache's: a table row that is all
  trash block, kv_blocks.BlockTables), so it touches no request; its outputs are dropped;
- its attended length is rounded up to a length bucket (`length_bucket`); the models build their masks on the device
  from the positions, so keys past a row's own positions are masked and the bucket changes no value;
- its inputs are copied into static buffers made once per graph, and its outputs into static buffers shared by
  the graphs of one output shape (the graphs share one memory pool; every output is copied out before the next
  replay, so no graph's result is overwritten while someone holds it);
- over a paged KV cache (runtime/kv_blocks.py), the rows of each slot's positions are gathered through the block
  tables, a device tensor the host updates in place as blocks are taken and given back: a replay reads the tables
  as they are then. The caches are read by index, never as views (a view is of the blocks one slot held at capture),
  and the rows are computed inside each pass (PagedKVCache.forget_rows), not remembered from an earlier one.

One graph per `PassKey` (kind, batch bucket, length bucket, tokens, ...), made the first time a pass of that key
runs: the pass runs twice eagerly (warm-up: cuBLAS handles, lazy initialisation; every write repeats the same
values), then is captured and replayed. The slots read as views of the caches when the pass's slots are
0 .. rows - 1 (the Decoder's normal case), else by index.

On a CPU the same padded static passes run eagerly (`capture=False`): that is what the tests check (buckets,
padding, copy-in and copy-out, the same tokens). The capture itself (`_capture`) has never run on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

# Attended-length buckets of the graphs: 64, 128, 256, 512, then multiples of 512. Coarser than the eager path's
# multiples of 64 (executor.KV_BUCKET) because each length is a graph to capture and keep (per batch bucket and
# pass kind): 11 lengths cover a 4k context where multiples of 64 would be 64. Short contexts may attend to 2x their
# keys, which costs little there (the weights dominate); past 512 keys a pass attends to < 2x, past 1024 < 1.5x.
GRAPH_LENGTH_STEP = 512

# target: a decode pass of the target (1 token, or a verify block, per row); draft: a drafter pass. Prefill and the
# drafter's own context passes run eagerly: compute-bound, and each of their lengths would need a graph.
PassKind = Literal["target", "draft"]


def batch_bucket(rows: int, num_slots: int) -> int:
    """The smallest power of two >= rows, at most num_slots (which is also a bucket): 3 of 8 -> 4, 5 of 6 -> 6."""
    assert 1 <= rows <= num_slots, (rows, num_slots)
    return min(1 << (rows - 1).bit_length(), num_slots)


def length_bucket(keys: int, capacity: int) -> int:
    """The graphs' attended length for `keys` keys: 64 * 2^k up to GRAPH_LENGTH_STEP, then multiples of it, at most
    the cache's capacity. Examples (capacity 4112): 0 -> 64, 65 -> 128, 300 -> 512, 513 -> 1024, 1100 -> 1536."""
    if keys <= GRAPH_LENGTH_STEP:
        bucket = max(64, 1 << max(keys - 1, 0).bit_length())
    else:
        bucket = -(-keys // GRAPH_LENGTH_STEP) * GRAPH_LENGTH_STEP
    return min(bucket, capacity)


@dataclass(frozen=True)
class PassKey:
    """What fixes a pass's kernels and shapes: one graph each."""

    kind: PassKind
    batch: int  # rows, a batch bucket
    length: int  # keys attended, a length bucket
    tokens: int  # target: tokens per row; draft: the block's width
    views: bool  # the slots are 0 .. batch - 1: caches read as views (else by index)
    capture: bool = False  # target: also the captured hidden states
    drafts: int = 0  # draft: drafts read out per row
    context: int = 0  # draft: context rows per request (0: none)


# The eager passes the graphs are made of (TorchExecutor's own): static input buffers in, outputs returned.
TargetPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, int, "slice | None"],
                      tuple[torch.Tensor, "torch.Tensor | None"]]
# (anchors, starts, slots, num_drafts, width, context hidden, context starts, kv_len, run) -> drafts
DraftPass = Callable[..., torch.Tensor]


class _StaticPass:
    """One key's static input buffers (padding rows already filled), its output buffers and, on CUDA, its graph."""

    def __init__(self, inputs: dict[str, torch.Tensor], padding: dict[str, int | float],
                 run: Callable[[], tuple[torch.Tensor, ...]], outputs: tuple[torch.Tensor, ...]):
        self.inputs, self.padding, self.run, self.outputs = inputs, padding, run, outputs
        self.graph: torch.cuda.CUDAGraph | None = None

    def copy_in(self, values: dict[str, torch.Tensor]) -> None:
        """Rows [:n] from `values`, rows [n:] back to padding (a smaller batch of the same bucket may follow a larger
        one)."""
        for name, value in values.items():
            buf, n = self.inputs[name], value.shape[0]
            buf[:n].copy_(value)
            buf[n:].fill_(self.padding[name])

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._write(self.run())

    def _write(self, results: tuple[torch.Tensor, ...]) -> None:
        for buf, result in zip(self.outputs, results):
            buf.copy_(result)


class StaticPasses:
    """The executor's decode passes at bucketed shapes over static buffers: captured CUDA graphs (`capture`) or, on a
    CPU, the same padded passes run eagerly. `scratch_slot`: a cache slot no request owns (the padding rows').
    `views`: a run of slots 0 .. n - 1 reads the caches as views (a static cache's slots); False: always by index (a
    paged cache, whose views would be of the blocks one slot held at capture)."""

    def __init__(self, target_pass: TargetPass, draft_pass: DraftPass, num_slots: int, scratch_slot: int,
                 capacity: int, device: torch.device, capture: bool, views: bool = True):
        self.target_pass, self.draft_pass = target_pass, draft_pass
        self.num_slots, self.scratch_slot, self.capacity = num_slots, scratch_slot, capacity
        self.device, self.capture, self.views = device, capture, views
        self.passes: dict[PassKey, _StaticPass] = {}
        self._outputs: dict[tuple, torch.Tensor] = {}  # output buffers by (name, shape, dtype), shared by graphs
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def _views(self, slots: tuple[int, ...]) -> bool:
        """The slots are 0 .. n - 1 in order: the padded batch's caches are slots 0 .. bucket - 1, read as views."""
        return self.views and slots == tuple(range(len(slots)))

    def target(self, token_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, capture: bool,
               slots_host: tuple[int, ...], keys: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [B, T, vocab], hidden [B, T, F] or None) of a target pass of token_ids [B, T] attending `keys`
        keys (the host's count), copied out of the static buffers."""
        rows, tokens = token_ids.shape
        key = PassKey("target", batch_bucket(rows, self.num_slots), length_bucket(keys, self.capacity), tokens,
                      self._views(slots_host), capture)
        p = self.passes.get(key) or self._make_target(key, token_ids.dtype)
        p.copy_in({"token_ids": token_ids, "starts": starts, "slots": slots})
        p.replay()
        logits = p.outputs[0][:rows].clone()
        return logits, (p.outputs[1][:rows].clone() if capture else None)

    def draft(self, anchors: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, num_drafts: int, width: int,
              context_hidden: torch.Tensor | None, context_starts: torch.Tensor | None,
              slots_host: tuple[int, ...], keys: int) -> torch.Tensor:
        """Drafts [B, num_drafts] of a draft pass (context: [B, C, F] at context_starts + arange(C), or None)."""
        rows = anchors.shape[0]
        key = PassKey("draft", batch_bucket(rows, self.num_slots), length_bucket(keys, self.capacity), width,
                      self._views(slots_host), drafts=num_drafts,
                      context=0 if context_hidden is None else context_hidden.shape[1])
        p = self.passes.get(key) or self._make_draft(key, context_hidden)
        values = {"anchors": anchors, "starts": starts, "slots": slots}
        if context_hidden is not None:
            values.update(context_hidden=context_hidden, context_starts=context_starts)
        p.copy_in(values)
        p.replay()
        return p.outputs[0][:rows].clone()

    def _make_target(self, key: PassKey, id_dtype: torch.dtype) -> _StaticPass:
        b, dev = key.batch, self.device
        inputs = {"token_ids": torch.zeros(b, key.tokens, dtype=id_dtype, device=dev),
                  "starts": torch.zeros(b, dtype=torch.int64, device=dev),
                  "slots": torch.full((b,), self.scratch_slot, dtype=torch.int64, device=dev)}
        run = slice(0, b) if key.views else None

        def run_pass() -> tuple[torch.Tensor, ...]:
            logits, hidden = self.target_pass(inputs["token_ids"], inputs["starts"], inputs["slots"], key.capture,
                                              key.length, run)
            return (logits,) if hidden is None else (logits, hidden)

        return self._make(key, inputs, {"token_ids": 0, "starts": 0, "slots": self.scratch_slot}, run_pass)

    def _make_draft(self, key: PassKey, context_hidden: torch.Tensor | None) -> _StaticPass:
        b, dev = key.batch, self.device
        inputs = {"anchors": torch.zeros(b, dtype=torch.int64, device=dev),
                  "starts": torch.zeros(b, dtype=torch.int64, device=dev),
                  "slots": torch.full((b,), self.scratch_slot, dtype=torch.int64, device=dev)}
        padding: dict[str, int | float] = {"anchors": 0, "starts": 0, "slots": self.scratch_slot}
        if context_hidden is not None:
            inputs["context_hidden"] = torch.zeros(b, *context_hidden.shape[1:], dtype=context_hidden.dtype,
                                                   device=dev)
            inputs["context_starts"] = torch.zeros(b, dtype=torch.int64, device=dev)
            padding.update(context_hidden=0.0, context_starts=0)
        run = slice(0, b) if key.views else None

        def run_pass() -> tuple[torch.Tensor, ...]:
            return (self.draft_pass(inputs["anchors"], inputs["starts"], inputs["slots"], key.drafts, key.tokens,
                                    inputs.get("context_hidden"), inputs.get("context_starts"), key.length, run),)

        return self._make(key, inputs, padding, run_pass)

    def _make(self, key: PassKey, inputs: dict[str, torch.Tensor], padding: dict[str, int | float],
              run_pass: Callable[[], tuple[torch.Tensor, ...]]) -> _StaticPass:
        """The static pass of `key`: output buffers shaped from one eager run (its writes repeat on every replay), then
        captured on CUDA."""
        first = run_pass()
        outputs = tuple(self._output(key, i, r) for i, r in enumerate(first))
        p = _StaticPass(inputs, padding, run_pass, outputs)
        if self.capture:
            p.graph = _capture(p, self._pool)
        self.passes[key] = p
        return p

    def _output(self, key: PassKey, index: int, like: torch.Tensor) -> torch.Tensor:
        """An output buffer shared by every graph with outputs of this shape (e.g. the logits of one batch bucket
        and tokens at every length bucket): replays run one at a time and each is copied out at once."""
        name = (key.kind, index, tuple(like.shape), like.dtype)
        if name not in self._outputs:
            self._outputs[name] = torch.empty_like(like)
        return self._outputs[name]


def _capture(p: _StaticPass, pool) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream, then capture the pass writing into its output buffers. Never run on a GPU."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            p._write(p.run())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        p._write(p.run())
    return graph
