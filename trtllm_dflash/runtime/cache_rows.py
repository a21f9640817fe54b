"""KV caches kept in contiguous rows, for the executors that run compiled graphs (onnxruntime, TensorRT).

The graphs write their caches with TensorScatter, whose batch axis is the cache's axis 0: a call covers a
contiguous run of cache rows, bound in place (the cache input and output at the same address). The
Decoder hands out slots in any order, so `CacheRows` keeps the requests an executor holds in rows
0 .. n-1 (slot -> row) and, when a request ends, moves the request of the last row into the freed row
(one copy of one request's caches per finished request, not per step).

A call writes every row it binds, so a call never binds a row outside its batch: the batch's rows are cut into
runs of consecutive rows (`runs_of`), one graph call each. Almost every batch is one run (every running request);
one with a gap is, for instance, the drafter's context flushed for some requests only (`--block-size auto`): rows
0 and 2 of three running requests are two runs, and row 1's caches are left as they were. (Feeding row 1
padding, as an earlier version did, wrote padding K/V at positions 0.. of a running request's drafter cache:
the tokens stayed right and its acceptance dropped.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trtllm_dflash.models.linear_attention import RecurrentStates
from trtllm_dflash.runtime.kv_blocks import BLOCK_TOKENS, KVBudgetError, format_size, prefix_hashes
from trtllm_dflash.runtime.prefix_states import KeepsPrefixStates, PrefixStates

if TYPE_CHECKING:
    from trtllm_dflash.runtime.executor import HostRows


@dataclass
class LayerCaches:
    """One model's per-layer K and V buffers, [num_slots, kv_heads, length, head_dim] each, of the layers numbered
    `layer_ids` (None: 0, 1, ...; a hybrid model's attention layers only)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    layer_ids: list[int] | None = None

    @classmethod
    def zeros(cls, layers: int | list[int], num_slots: int, kv_heads: int, length: int | Sequence[int], head_dim: int,
              dtype: torch.dtype, device: torch.device | str = "cpu", v_head_dim: int | None = None) -> "LayerCaches":
        """`layers`: how many (numbered 0 ..), or their numbers. `length`: positions per row, or per layer (rings of
        sliding-window layers are shorter). `v_head_dim`: V's head size where it differs from K's (0: a latent
        attention layer, which keeps no V)."""
        def new(width: int, positions: int) -> torch.Tensor:
            # (no V: a zero-width view of a one-wide buffer, whose address is a real one: onnxruntime refuses to bind
            # a null pointer, even to no bytes)
            return torch.zeros(num_slots, kv_heads, positions, max(width, 1), dtype=dtype, device=device)[..., :width]

        ids = None if isinstance(layers, int) else list(layers)
        count = layers if ids is None else len(ids)
        lengths = [length] * count if isinstance(length, int) else list(length)
        v_width = head_dim if v_head_dim is None else v_head_dim
        return cls([new(head_dim, n) for n in lengths], [new(v_width, n) for n in lengths], ids)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """("key_0", K_0), ("value_0", V_0), ...: the suffixes of the graphs' past_* / present_* names."""
        ids = range(len(self.keys)) if self.layer_ids is None else self.layer_ids
        return [(f"{kind}_{i}", buf) for i, pair in zip(ids, zip(self.keys, self.values))
                for kind, buf in zip(("key", "value"), pair)]

    def move_row(self, src: int, dst: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[dst].copy_(buf[src])


def row_address(buf: torch.Tensor, row: int) -> int:
    """The address of row `row` of a cache buffer, from its storage: a latent attention layer's V is zero-width, and
    torch gives an empty tensor the address 0, which onnxruntime refuses to bind (LayerCaches gives its storage one
    real element per row)."""
    return buf.untyped_storage().data_ptr() + (buf.storage_offset() + row * buf.stride(0)) * buf.element_size()


class RowRun:
    """Consecutive cache rows first .. first + rows - 1, and the batch rows that fill them, in row order.

    Example: a batch whose requests sit in rows [3, 1, 2] is one run: first 1, rows 3, batch_index [1, 2, 0]
    (run row 0 is batch row 1, ...)."""

    def __init__(self, first: int, batch_index: list[int]):
        self.first, self.rows = first, len(batch_index)
        self.batch_index = torch.tensor(batch_index)  # batch row of each run row
        self.in_order = batch_index == list(range(self.rows))  # run row i is batch row i

    @property
    def range(self) -> range:
        """The cache rows, as the host knows them."""
        return range(self.first, self.first + self.rows)

    def take(self, batch: torch.Tensor) -> torch.Tensor:
        """[B, ...] -> this run's rows [rows, ...], in row order, contiguous, on batch's device (the batch itself when
        it is this run in order: the usual case, no copy)."""
        if self.in_order and batch.shape[0] == self.rows:
            return batch.contiguous()
        return batch.index_select(0, self.batch_index.to(batch.device)).contiguous()


def row_runs(rows: Sequence[int]) -> list[RowRun]:
    """The runs of consecutive rows that cache rows `rows` (one per batch row, all distinct) make, by first row.
    Example: [2, 0, 4, 3] -> run of rows 0 (batch row 1), and run of rows 2, 3, 4 (batch rows 0, 3, 2)."""
    assert len(set(rows)) == len(rows), rows
    order = sorted(range(len(rows)), key=rows.__getitem__)
    runs: list[tuple[int, list[int]]] = []
    for i in order:
        if runs and rows[i] == runs[-1][0] + len(runs[-1][1]):
            runs[-1][1].append(i)
        else:
            runs.append((rows[i], [i]))
    return [RowRun(first, index) for first, index in runs]


def batch_order(runs: Sequence[RowRun], outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The runs' outputs ([run.rows, ...] each, in the order of `runs`) as one tensor in batch order [B, ...]."""
    if len(runs) == 1 and runs[0].in_order:
        return outputs[0]
    out = outputs[0] if len(outputs) == 1 else torch.cat(list(outputs))
    order = torch.cat([r.batch_index for r in runs])  # the batch row of each row of `out`
    position = torch.empty_like(order)
    position[order] = torch.arange(len(order))  # the row of `out` that holds each batch row
    return out.index_select(0, position.to(out.device))


class CacheRows:
    """slot -> cache row for every cache in `caches` (KV caches, and a hybrid target's recurrent states, whose slots
    are rows too), rows 0 .. n-1 in use."""

    def __init__(self, caches: Sequence[LayerCaches | RecurrentStates]):
        self._caches = tuple(caches)
        self._row: dict[int, int] = {}

    @property
    def in_use(self) -> int:
        return len(self._row)

    def rows_of(self, slots: torch.Tensor | Sequence[int]) -> list[int]:
        """The cache row of each slot; a slot seen for the first time (a new request) takes the next free row. Give
        the slots as the host knows them (HostRows.slots) where it can: a tensor is read back from its device."""
        rows = []
        for slot in slots.tolist() if isinstance(slots, torch.Tensor) else slots:
            if slot not in self._row:
                self._row[slot] = len(self._row)
            rows.append(self._row[slot])
        return rows

    def runs_of(self, slots: torch.Tensor | Sequence[int]) -> list[RowRun]:
        """The batch's runs of consecutive rows (row_runs): one graph call each, none binding a row of another request."""
        return row_runs(self.rows_of(slots))

    def release(self, slot: int) -> None:
        """Keep the rows in use contiguous: the last row's request moves into the freed row."""
        row = self._row.pop(slot, None)
        if row is None:
            return
        last = len(self._row)
        if row != last:
            moved = next(s for s, r in self._row.items() if r == last)
            for caches in self._caches:
                caches.move_row(last, row)
            self._row[moved] = row


class PrefixRows:
    """Prefix reuse for caches kept in rows (the compiled executors' Executor.reserve / publish / release).

    When a request's prefill has written its prompt (`publish`), its full prompt blocks of BLOCK_TOKENS positions are
    copied, from every cache given (the target's and the drafter's), into a pool under their prefix_hashes
    (runtime/kv_blocks.py: a block's hash covers every token before it and what the caches hold, `share`); a later
    request whose prompt starts with published blocks gets them copied into its own row (`reserve`), and its prefill
    skips those positions. Copies, where the torch executor's paged cache shares blocks: the rows stay contiguous for
    the graphs (a paged read costs onnxruntime more than it saves: docs/backends.md), and no block is ever held by
    a request, so the pool drops its least recently used block whenever it needs room.

    The pool holds `num_blocks` blocks (the executors: one request row's worth, max_seq_len positions and a block, or
    what --kv-cache-memory leaves beside the rows: StaticRows._keep_rows); a longer published prefix keeps its first
    num_blocks blocks.

    Rings (buffers shorter than the longest: sliding-window layers that keep the `window` and a pass, position p at
    p % length): a ring holds only the last positions its row wrote (`wrote`), so a block's rings' part is published
    from the first of its positions the ring still holds, and a request takes a prefix of n blocks only if the pool
    holds the rings' part of the window before position n * block_tokens: its prefill's first queries attend to it.
    The rings' part of those blocks only is copied into the row (no query of the request sees an earlier position,
    and the other positions of those blocks land where only the prefill's later writes or masked entries lie)."""

    def __init__(self, caches: Sequence[LayerCaches], rows: CacheRows, num_blocks: int,
                 block_tokens: int = BLOCK_TOKENS, window: int = 0):
        self._buffers = [buf for c in caches for _, buf in c.named()]
        self._rows, self.num_blocks, self.block_tokens = rows, num_blocks, block_tokens
        self._pool = [torch.empty((num_blocks, buf.shape[1], block_tokens, buf.shape[3]), dtype=buf.dtype,
                                  device=buf.device) for buf in self._buffers]
        longest = max(buf.shape[2] for buf in self._buffers)
        self._ring = [buf.shape[2] if buf.shape[2] < longest else None for buf in self._buffers]  # its length
        self.window = window if any(self._ring) else 0
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> pool block, least recently used first
        self._free = list(range(num_blocks))
        self._ring_from: dict[int, int] = {}  # pool block -> the first of its positions whose rings' part it holds
        self._prompts: dict[int, list[bytes]] = {}  # slot -> its prompt's block hashes, until published
        self._last: dict[int, int] = {}  # slot -> the last position its target pass wrote (rings only)
        self.prefix_blocks_looked_up = self.prefix_blocks_hit = 0

    @property
    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in self._pool)

    def wrote(self, slots: Sequence[int], last: Sequence[int]) -> None:
        """A target pass wrote the slots' rows up to positions `last` (rings: what they hold now)."""
        if self.window:
            self._last.update(zip(slots, last))

    def _window_start(self, blocks: int) -> int:
        """The first position (not block) whose rings' part a prefix of `blocks` blocks needs."""
        return max(0, blocks * self.block_tokens - self.window) if self.window else blocks * self.block_tokens

    def _has_window(self, found: list[int]) -> bool:
        """Whether pool blocks `found` (a prefix's) hold the rings' part of the window before the prefix's end."""
        start, size = self._window_start(len(found)), self.block_tokens
        return all(j * size + self._ring_from.get(block, size) <= max(start, j * size)
                   for j, block in enumerate(found) if (j + 1) * size > start)

    def reserve(self, slot: int, tokens: list[int], share: str | None, states: PrefixStates | None = None) -> int:
        """Copy the published blocks `tokens` starts with into the slot's row; returns how many positions they cover.
        The last token is never taken from the pool (a prefill needs its logits); `share` None: nothing shared.
        `states` (a target with recurrent states): only the blocks up to the last one after which it keeps a state,
        which it gives the row (PrefixStates.admit)."""
        if share is None:
            return 0
        hashes = self._prompts[slot] = prefix_hashes(tokens[:-1], share, self.block_tokens)
        row = self._rows.rows_of([slot])[0]
        found = []
        for h in hashes:
            if h not in self._blocks:
                break
            found.append(self._blocks[h])
        hit = len(found)
        while hit and not self._has_window(found[:hit]):
            hit -= 1  # (rings: the window before the first computed position must be there)
        cached_blocks = hit
        if states is not None:
            hit = states.boundary(hashes, hit)
        for h in hashes[:hit]:
            self._blocks.move_to_end(h)
        self._copy(row, list(range(hit)), found[:hit], into_row=True, rings=False)
        windowed = [j for j in range(hit) if (j + 1) * self.block_tokens > self._window_start(hit)]
        self._copy(row, windowed, [found[j] for j in windowed], into_row=True, others=False)
        self.prefix_blocks_looked_up += len(hashes)
        self.prefix_blocks_hit += hit
        if states is not None:
            states.admit(slot, row, hashes, cached_blocks, hit * self.block_tokens)
        return hit * self.block_tokens

    def publish(self, slot: int) -> None:
        """The slot's prompt is written: copy its full blocks the pool lacks into it (at most num_blocks: a longer
        prefix's first blocks, which a later prompt must hit first)."""
        row = self._rows.rows_of([slot])[0]
        # the rings hold positions last - length + 1 .. last
        first = self._last.get(slot, 0) - min((n for n in self._ring if n), default=0) + 1 if self.window else 0
        new: list[tuple[int, int]] = []  # (prompt block j, pool block) of the blocks the pool lacked
        rings: list[tuple[int, int]] = []  # (j, pool block) of blocks whose rings' part the row holds more of
        for j, h in enumerate(self._prompts.pop(slot, [])[: self.num_blocks]):
            held = min(max(first - j * self.block_tokens, 0), self.block_tokens)  # the first position the rings hold
            block = self._blocks.get(h)
            if block is not None:
                self._blocks.move_to_end(h)
                if held < self._ring_from.get(block, self.block_tokens):  # more of the rings' part than the pool's
                    rings.append((j, block))
                    self._ring_from[block] = held
                continue
            block = self._free.pop() if self._free else self._blocks.popitem(last=False)[1]
            self._blocks[h] = block
            new.append((j, block))
            self._ring_from[block] = held
        # (a block evicted above for a later one of this prompt is not one of its earlier new blocks: those were
        # made most recently used)
        self._copy(row, [j for j, _ in new], [b for _, b in new], into_row=False)
        self._copy(row, [j for j, _ in rings], [b for _, b in rings], into_row=False, others=False)

    def release(self, slot: int) -> None:
        self._prompts.pop(slot, None)
        self._last.pop(slot, None)

    def _copy(self, row: int, js: list[int], blocks: list[int], into_row: bool, rings: bool = True,
              others: bool = True) -> None:
        """The positions of prompt blocks `js` of `row` (block j: j * block_tokens .. (j + 1) * block_tokens - 1),
        from or to pool blocks `blocks`, one copy per buffer: of the rings (where they lie in them) with `rings`, of
        the other buffers with `others`. (A copy per block and buffer took 6.4 ms to publish 30 blocks of the demo
        engine's 36 buffers on onnxruntime's CPU rows, this 2.0 ms: benchmarks/prefix_pool.py.)"""
        if not js:
            return
        size, n = self.block_tokens, len(js)
        consecutive = js == list(range(js[0], js[0] + n))
        positions = (torch.tensor(js)[:, None] * size + torch.arange(size)).reshape(-1)
        index = torch.tensor(blocks)
        for buf, pool, ring in zip(self._buffers, self._pool, self._ring):
            if not (rings if ring else others):
                continue
            if ring is None and consecutive:
                where = slice(js[0] * size, (js[0] + n) * size)
            else:
                where = (positions if ring is None else positions % ring).to(buf.device)
            heads, dim = buf.shape[1], buf.shape[3]
            if into_row and isinstance(where, slice):  # pool [n, heads, size, dim] -> a view of the row's positions
                buf[row, :, where].unflatten(1, (n, size)).copy_(pool[index.to(pool.device)].transpose(0, 1))
            elif into_row:
                buf[row, :, where] = pool[index.to(pool.device)].transpose(0, 1).reshape(heads, n * size, dim)
            else:
                blocks_of_row = buf[row, :, where].reshape(heads, n, size, dim).transpose(0, 1)
                pool.index_copy_(0, index.to(pool.device), blocks_of_row)


def _bytes(caches: Sequence[LayerCaches], states: RecurrentStates | None) -> int:
    """What the caches' (and states') buffers hold, in bytes."""
    return sum(buf.untyped_storage().nbytes() for c in caches for _, buf in c.named()) + (
        states.nbytes if states is not None else 0)


def _block_bytes(caches: Sequence[LayerCaches]) -> int:
    """Bytes of one prefix block (BLOCK_TOKENS positions of every cache of one row)."""
    return sum(buf.shape[1] * BLOCK_TOKENS * buf.shape[3] * buf.element_size() for c in caches for _, buf in c.named())


Rows = tuple[tuple[LayerCaches, ...], RecurrentStates | None]


class StaticRows(KeepsPrefixStates):
    """The Executor contract's memory methods for the executors that keep one static cache row per request (onnxruntime,
    TensorRT): every row holds max_seq_len positions, so a request is admitted while a row is free and never extended;
    its first positions may be copied from published prompt blocks (`prefix_rows`). `_allocate_rows` makes the rows,
    as many as a --kv-cache-memory budget holds, and `_keep_rows` sets up their bookkeeping."""

    _rows: CacheRows
    prefix_rows: PrefixRows | None
    prefix_states: PrefixStates | None  # a hybrid target's recurrent states kept for prefix reuse

    @staticmethod
    def _allocate_rows(make: Callable[[int], Rows], max_rows: int, budget: int | Callable[[], int] | None,
                       prefix_cache: bool, cache_length: int, kept_states: int | None = None) -> tuple[int, Rows]:
        """The rows `make(n)` allocates (the caches and recurrent states of n rows): max_rows of them, or, under a
        `budget` in bytes that cannot hold them all, as many as it holds beside one prefix block (the least pool
        _keep_rows accepts; with `prefix_cache` only) and a target's recurrent states kept for prefix reuse
        (PrefixStates: `kept_states` of them, or one per row). Returns (rows, what make gave). KVBudgetError, in
        words, where not even one row fits. A fraction of the free memory (a function) is of what the rows leave: they
        are all allocated."""
        if budget is None or callable(budget):
            return max_rows, make(max_rows)
        caches, states = make(1)
        kept = PrefixStates.bytes_each(states) if prefix_cache and states is not None else 0
        row, fixed = _bytes(caches, states) + (0 if kept_states else kept), kept * (kept_states or 0)
        if budget >= max_rows * row + fixed:
            return max_rows, make(max_rows)
        block = _block_bytes(caches) if prefix_cache else 0
        rows = (budget - block - fixed) // row
        if rows < 1:
            pool, fix = (" and one prefix block", "; give more, or add --no-prefix-cache") if block else ("", "")
            states_too = f" beside {kept_states} kept recurrent states' {format_size(fixed)}" if fixed else ""
            raise KVBudgetError(f"smaller than one static row{pool}, {format_size(row + block)} (a row holds "
                                f"{cache_length} positions of every layer){states_too}{fix}")
        return rows, make(rows)

    def _keep_rows(self, caches: tuple[LayerCaches, ...], states: RecurrentStates | None, cache_length: int,
                   prefix_cache: bool, window: int = 0, budget: int | Callable[[], int] | None = None,
                   kept_states: int | None = None) -> None:
        """Rows for `caches` (and a hybrid target's recurrent `states`); prompt blocks copied between requests with
        `prefix_cache`, and a hybrid target's states kept at checkpoints for them (`kept_states`, default one per row:
        PrefixStates, whose state after a prefix is one matrix, not blocks). `window`: the sliding window of the layers
        whose caches are rings (shorter buffers).

        The prefix pool holds one row's worth of blocks, or what `budget` leaves (--kv-cache-memory): bytes for the
        rows (and states) and the pool together, or a function giving the bytes the pool may take (a fraction of the
        memory free once the rows are allocated). KVBudgetError, in words, when no block would fit."""
        self._rows = CacheRows(caches + ((states,) if states is not None else ()))
        self.prefix_rows, self.prefix_states = None, None
        self.rows_bytes = _bytes(caches, states)
        if not prefix_cache:
            return
        if states is not None:
            self.prefix_states = PrefixStates(states, kept_states or states.kept_from.shape[0])
        block = _block_bytes(caches)
        if budget is None:
            blocks = max(1, cache_length // BLOCK_TOKENS)
        else:
            kept = self.prefix_states.nbytes if self.prefix_states is not None else 0
            spare = budget() if callable(budget) else budget - self.rows_bytes - kept
            blocks = spare // block
            if blocks < 1:
                kept_too = " and the recurrent states kept for them" if kept else ""
                raise KVBudgetError(f"leaves {format_size(spare)} beside the static rows'{kept_too} "
                                    f"{format_size(self.rows_bytes + kept)}, less than one prefix block's "
                                    f"{format_size(block)}; give more, or add --no-prefix-cache")
        self.prefix_rows = PrefixRows(caches, self._rows, blocks, window=window)

    def _rings_wrote(self, starts: torch.Tensor, slots: torch.Tensor, rows: HostRows | None, tokens: int) -> None:
        """Before a target pass of `tokens` positions per row: what the rows' rings hold after it, for the prefix pool
        (PrefixRows.wrote), from the host's starts where the caller has them (`rows`). Nothing without rings."""
        if self.prefix_rows is None or not self.prefix_rows.window:
            return
        first = rows.starts if rows is not None else starts.tolist()
        self.prefix_rows.wrote(rows.slots if rows is not None else slots.tolist(), [s + tokens - 1 for s in first])

    @property
    def prefix_block_tokens(self) -> int | None:
        return self.prefix_rows.block_tokens if self.prefix_rows is not None else None

    def reserve(self, slot: int, tokens: list[int], share: str | None = None, headroom: int = 0,
                waiting: Sequence[int] = ()) -> int | None:
        return self.prefix_rows.reserve(slot, tokens, share, self.prefix_states) if self.prefix_rows is not None else 0

    def extend(self, slot: int, start: int) -> bool:
        return True

    def _state_row(self, slot: int) -> int:  # (KeepsPrefixStates)
        return self._rows.rows_of([slot])[0]

    def publish(self, slot: int) -> None:
        if self.prefix_rows is not None:
            self.prefix_rows.publish(slot)

    def release(self, slot: int) -> None:
        if self.prefix_rows is not None:
            self.prefix_rows.release(slot)
        if self.prefix_states is not None:
            self.prefix_states.release(slot)
        self._rows.release(slot)
