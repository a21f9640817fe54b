"""A paged KV cache for the torch executor (issue 29): fixed-size blocks of positions, per-request block tables,
a memory budget, blocks taken as requests grow (preemption when none is free), prompt blocks shared across requests
by prefix, and sliding-window layers in rings of blocks.

Layout: per layer one K and one V tensor [(num_blocks + 1) * block_tokens, kv_heads, head_dim] (the last block is a
trash block, BlockTables); position p of the request
in slot s lives at row `table[s, p // block_tokens] * block_tokens + p % block_tokens`. A request holds only the
blocks its positions need, so a 200-token request costs 200 positions of memory, not a max_seq_len slot; freed blocks
are reused at once.

Blocks on demand: a request is admitted when the free blocks cover its prompt and the first step's writes past it
(a verify block), and takes more as it decodes (`extend`, before each step). When a running request needs a block
and none is free, the scheduler preempts the request that arrived last (runtime/decoding.py): its blocks return, and
it waits at the head of the queue to be recomputed (its prompt and the tokens it had committed prefilled again, its
prompt blocks often still cached) and go on with the same tokens.

`PagedKVCache` has KVCache's interface (models/layers.py), so the models run on it unchanged: writes scatter into the
rows of the slots' blocks; reads are views for one request whose blocks are consecutive, else gather positions
0 .. length - 1 of each slot (a copy, where the static cache of a run of slots is read as views).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16  # positions per block (vLLM's default block size; TensorRT-LLM's tokens_per_block defaults to 32)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as '512MiB', '2GiB', '1.5GB' or a plain byte count; ValueError on anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise ValueError(f"{text!r} is not a size (examples: 512MiB, 2GiB, 1.5GB, 1048576)")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if size <= 0:
        raise ValueError(f"{text!r}: a KV-cache size must be positive")
    return size


@dataclass(frozen=True)
class CacheShape:
    """What one position costs in a model's caches: every layer's K and V."""

    layers: int
    kv_heads: list[int]  # per layer
    head_dim: list[int]  # per layer
    element_bytes: int
    v_head_dim: list[int] | None = None  # per layer where V's differs from K's (a latent attention layer: 0)

    @property
    def v_dims(self) -> list[int]:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def position_bytes(self) -> int:
        return self.element_bytes * sum(h * (d + v) for h, d, v in zip(self.kv_heads, self.head_dim, self.v_dims))

    def of_layers(self, layers: list[int]) -> "CacheShape":
        return CacheShape(len(layers), [self.kv_heads[i] for i in layers], [self.head_dim[i] for i in layers],
                          self.element_bytes, None if self.v_head_dim is None else [self.v_head_dim[i] for i in layers])


def blocks_for(positions: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return -(-positions // block_tokens)


def prefix_hashes(tokens: list[int], salt: str, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """One chained hash per full block of `tokens`: block j's covers tokens 0 .. (j + 1) * block_tokens - 1 and `salt`
    (what the blocks hold: the target's K/V alone, or the drafter's context too), so equal hashes mean equal
    prefixes with the same caches written."""
    hashes, h = [], hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for j in range(len(tokens) // block_tokens):
        chunk = tokens[j * block_tokens:(j + 1) * block_tokens]
        h = hashlib.blake2b(h + b"".join(t.to_bytes(8, "little", signed=True) for t in chunk), digest_size=16).digest()
        hashes.append(h)
    return hashes


class BlockTables:
    """Which blocks each slot holds, the free blocks, the prompt blocks shared by prefix, and the tables as a device
    tensor [num_slots, max_blocks] for the caches' index arithmetic.

    Block `num_blocks` (one past the last) is a trash block that no request holds: every table entry without a block
    of its own points at it, so a write past a request's reservation (a shorter prompt's padding in a batched
    prefill) lands there and never in another request's block, and a read past it (a length bucket) reads garbage
    that the masks exclude.

    Prefix reuse: a request's full prompt blocks are published under their prefix_hashes once its prefill has written
    them (`publish`); a later request whose first blocks have those hashes holds the same blocks (reference counted)
    and skips their prefill. Its own writes all land at or after its first uncached position, so a shared block is
    never written again. A published block that no request holds stays cached until a reservation needs it: it is
    then unpublished and reused, the least recently released first, and of one request's blocks the last first (as
    vLLM's allocator does), so an evicted prefix loses its tail, not the head that every hit needs.

    `window` (sliding-window layers, whose query at position p sees keys p - window + 1 .. p): the tables of those
    layers alone. A request gives back the blocks that fell out of its window as it advances (`trim`), so it holds
    about window + a verify block of positions, whatever its length: a ring of blocks. A prefix hit needs only the
    blocks of the window before the first uncached position (`hit_count`); those before it stay unheld (trash).

    `scratch` (static passes, runtime/cuda_graphs.py): the table has one more row, slot `num_slots`, that no request
    ever holds: every entry of it is the trash block, so the padding rows of a padded pass read and write only
    there."""

    def __init__(self, num_blocks: int, num_slots: int, max_positions: int, block_tokens: int,
                 device: torch.device | str, window: int | None = None, scratch: bool = False):
        self.num_blocks, self.block_tokens, self.window = num_blocks, block_tokens, window
        self.max_blocks = blocks_for(max_positions, block_tokens)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest first
        self._held: dict[int, list[int | None]] = {}  # slot -> its blocks by index; None: given back (`trim`)
        self._hashes: dict[int, list[bytes]] = {}  # slot -> its prompt's block hashes (published after its prefill)
        self._first: dict[int, int | None] = {}  # slot -> its first block when its blocks are consecutive, else None
        self._refs: dict[int, int] = {}  # block -> requests holding it
        self._by_hash: dict[bytes, int] = {}  # published blocks
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # published blocks nobody holds, least recent first
        self.trash = num_blocks
        self.table = torch.full((num_slots + scratch, self.max_blocks), self.trash, dtype=torch.int64, device=device)
        self.peak_used = 0
        self.version = 0  # changes whenever a table does
        self.prefix_blocks_looked_up = self.prefix_blocks_hit = 0

    @property
    def free(self) -> int:
        """Blocks a reservation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Published prefix blocks (held or idle)."""
        return len(self._by_hash)

    def _kept_from(self, cached_blocks: int) -> int:
        """The first block a request whose first `cached_blocks` blocks are cached needs: 0, or with a window the block
        of the first key its first uncached position sees."""
        if self.window is None:
            return 0
        return max(0, cached_blocks * self.block_tokens - self.window + 1) // self.block_tokens

    def hit_count(self, hashes: list[bytes], limit: int | None = None) -> int:
        """How many of the first blocks of a prompt with block `hashes` a reservation would find cached (at most
        `limit`): the longest published prefix, or with a window the most blocks n whose window blocks
        _kept_from(n) .. n - 1 are all published."""
        n = len(hashes) if limit is None else min(limit, len(hashes))
        if self.window is None:
            return next((j for j, h in enumerate(hashes[:n]) if h not in self._by_hash), n)
        while n and not all(h in self._by_hash for h in hashes[self._kept_from(n):n]):
            n -= 1
        return n

    def _plan(self, positions: int, hashes: list[bytes], limit: int | None) -> tuple[list[int], int, int]:
        """(cached blocks taken, index of the first, new blocks) of a reservation."""
        n = self.hit_count(hashes, limit)
        first = self._kept_from(n)
        return [self._by_hash[h] for h in hashes[first:n]], first, blocks_for(positions, self.block_tokens) - n

    def can_reserve(self, positions: int, hashes: list[bytes] = (), headroom: int = 0, limit: int | None = None
                    ) -> bool:
        hits, _, new = self._plan(positions, list(hashes), limit)
        revived = sum(1 for b in hits if b in self._idle)
        return new + headroom <= self.free - revived

    def reserve(self, slot: int, positions: int, hashes: list[bytes] = (), headroom: int = 0,
                limit: int | None = None) -> int | None:
        """Give `slot` (which holds nothing) the blocks of positions 0 .. positions - 1: the published ones its prompt
        hashes find first (at most `limit`), new ones after. Returns the positions found cached, or None (nothing
        taken) when fewer than those blocks and `headroom` more are free (blocks left for the running requests to grow
        into)."""
        assert slot not in self._held, slot
        hashes = list(hashes)
        if not self.can_reserve(positions, hashes, headroom, limit):
            return None
        hits, first, new = self._plan(positions, hashes, limit)
        self.prefix_blocks_looked_up += len(hashes)
        self.prefix_blocks_hit += first + len(hits)
        for b in hits:
            self._idle.pop(b, None)
        blocks = hits + [self._take() for _ in range(new)]
        for b in blocks:
            self._refs[b] = self._refs.get(b, 0) + 1
        self._held[slot], self._hashes[slot] = [None] * first + blocks, hashes
        consecutive = first == 0 and blocks == list(range(blocks[0], blocks[0] + len(blocks)))
        self._first[slot] = blocks[0] if consecutive else None
        self.table[slot, first:first + len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        self.version += 1
        self.peak_used = max(self.peak_used, self.used)
        return (first + len(hits)) * self.block_tokens

    def trim(self, slot: int, position: int) -> None:
        """Give back the slot's blocks wholly before `position` (sliding-window layers: keys no query of the request
        will see again); published ones stay cached."""
        held = self._held[slot]
        end = min(position // self.block_tokens, len(held))
        gone = [j for j in range(end) if held[j] is not None]
        if not gone:
            return
        for j in reversed(gone):  # as release: the later blocks of a cached prefix are the first taken back
            self._drop(held[j])
            held[j] = None
        self._first[slot] = None
        self.table[slot, :end] = self.trash
        self.version += 1

    def held(self, slot: int) -> int:
        """Blocks the slot holds."""
        return sum(b is not None for b in self._held.get(slot, []))

    def extend(self, slot: int, positions: int) -> bool:
        """Make `slot` hold the blocks of positions 0 .. positions - 1 (at most the table's width), taking new ones
        after those it holds; False (nothing taken) when too few are free."""
        held = self._held[slot]
        need = min(blocks_for(positions, self.block_tokens), self.max_blocks) - len(held)
        if need <= 0:
            return True
        if need > self.free:
            return False
        new = [self._take() for _ in range(need)]
        for b in new:
            self._refs[b] = 1
        first = self._first[slot]
        if first is not None and new != list(range(first + len(held), first + len(held) + need)):
            self._first[slot] = None
        self.table[slot, len(held):len(held) + need] = torch.tensor(new, dtype=torch.int64)
        held += new
        self.version += 1
        self.peak_used = max(self.peak_used, self.used)
        return True

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._idle.popitem(last=False)  # the least recently released cached block
        del self._by_hash[self._hash_of.pop(block)]
        return block

    def publish(self, slot: int) -> None:
        """The slot's prompt blocks are written: make them findable by their hashes (those not published already)."""
        for h, block in zip(self._hashes.get(slot, []), self._held.get(slot, [])):
            if block is not None and h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h], self._hash_of[block] = block, h

    def release(self, slot: int) -> None:
        """Return the slot's blocks: unpublished ones to the free list (reused at once), published ones nobody else
        holds to the cached pool."""
        self._hashes.pop(slot, None)
        self._first.pop(slot, None)
        for block in reversed(self._held.pop(slot, [])):  # a prefix's last blocks are the first taken back
            if block is not None:
                self._drop(block)
        self.table[slot] = self.trash
        self.version += 1

    def _drop(self, block: int) -> None:
        """One holder fewer: a block nobody holds goes to the cached pool if published, else to the free list."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            del self._refs[block]
            if block in self._hash_of:
                self._idle[block] = None
            else:
                bisect.insort(self._free, block, key=lambda b: -b)  # kept descending: pop() gives the lowest

    def first_row(self, slot: int, length: int) -> int | None:
        """The cache row of `slot`'s position 0 when its positions 0 .. length - 1 are consecutive rows (its blocks are
        consecutive; past its last block the rows belong to others or to no one: masked), else None."""
        first = self._first.get(slot)
        if first is None or (first + blocks_for(length, self.block_tokens)) > self.num_blocks + 1:
            return None
        return first * self.block_tokens

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache rows of positions [B, T] of slots [B]: table[slot, p // block] * block + p % block."""
        blocks = self.table[slots[:, None], positions // self.block_tokens]
        return blocks * self.block_tokens + positions % self.block_tokens


class PagedKVCache:
    """KVCache's interface over blocks (models/layers.py): one [(num_blocks + 1) * block_tokens, kv_heads, head_dim] K
    and V per layer, addressed through its layer's tables: `tables` (shared by the target's and the drafter's caches:
    the same positions), or per layer where some layers have tables of their own (`layer_tables`: sliding-window
    layers' rings)."""

    in_place, ring = False, None  # (as KVCache's)

    def __init__(self, tables: BlockTables, shape: CacheShape, dtype: torch.dtype, device: torch.device | str,
                 layer_tables: list[BlockTables] | None = None):
        self.tables = tables
        self.layer_tables = layer_tables or [tables] * shape.layers
        # per tables, for writes and for reads: (slots, positions or length, tables.version, rows): every layer of a
        # pass asks alike
        self._rows: dict[tuple[int, bool], tuple] = {}
        self.k, self.v = [], []
        for t, h, d, v in zip(self.layer_tables, shape.kv_heads, shape.head_dim, shape.v_dims):
            rows = (t.num_blocks + 1) * t.block_tokens  # + the trash block
            self.k.append(torch.zeros(rows, h, d, dtype=dtype, device=device))
            self.v.append(torch.zeros(rows, h, v, dtype=dtype, device=device))
        self.capacity = tables.max_blocks * tables.block_tokens

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        # slots: [B]; positions: [B, T]; k, v: [B, T, kv_heads, hd]
        rows = self._rows_of(self.layer_tables[layer], slots, positions)
        self.k[layer][rows] = k
        self.v[layer][rows] = v

    def move(self, layer: int, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the slots' entries at positions src [B, n] to positions dst [B, n] (all read before any is written)."""
        tables = self.layer_tables[layer]
        src_rows, dst_rows = self._rows_of(tables, slots, src), self._rows_of(tables, slots, dst)
        self.k[layer][dst_rows] = self.k[layer][src_rows]
        self.v[layer][dst_rows] = self.v[layer][src_rows]

    def read(self, layer: int, slots: torch.Tensor, length: int, run: slice | None = None, first: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, length - first, kv_heads, hd] of the slots' positions first .. length - 1: views when the batch is
        one slot (`run`, known on the host) whose blocks are consecutive, else gathered (a copy)."""
        tables = self.layer_tables[layer]
        if run is not None and run.stop - run.start == 1:
            row = tables.first_row(run.start, length)
            if row is not None:
                return self.k[layer][None, row + first:row + length], self.v[layer][None, row + first:row + length]
        rows = self._rows_of(tables, slots, length)[:, first:]
        return self.k[layer][rows], self.v[layer][rows]

    def forget_rows(self) -> None:
        """Compute the next pass's rows afresh: a static pass (runtime/cuda_graphs.py) keeps its slots tensor while it
        copies new values into it, and a CUDA graph's capture must compute the rows inside the graph."""
        self._rows.clear()

    def _rows_of(self, tables: BlockTables, slots: torch.Tensor, where: torch.Tensor | int) -> torch.Tensor:
        """The rows of `where` (positions [B, T], or a length: positions 0 .. length - 1) of `slots`, computed once per
        tables for the layers of a pass: the same tensors (kept alive here, so identity is safe) or the same length
        again."""
        key = (id(tables), isinstance(where, int))  # a pass's writes (positions) and reads (a length) alternate
        cached_slots, cached_where, version, rows = self._rows.get(key, (None, None, -1, None))
        same_where = where is cached_where or (isinstance(where, int) and isinstance(cached_where, int)
                                               and where == cached_where)
        if slots is cached_slots and same_where and version == tables.version:
            return rows
        positions = where if isinstance(where, torch.Tensor) else \
            torch.arange(where, device=slots.device).expand(slots.shape[0], where)
        rows = tables.rows(slots, positions)
        self._rows[key] = (slots, where, tables.version, rows)
        return rows


STATIC_KV = "static"  # --kv-cache-memory static: a max_seq_len slot per request, whatever the engine's default


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def check_budget_syntax(text: str) -> None:
    """--kv-cache-memory's form alone (the machine that runs it judges the amount): UserError in one sentence."""
    from trtllm_dflash.errors import UserError

    if text == STATIC_KV:
        return
    try:
        resolve_budget(text, available=2**62)
    except ValueError as e:
        raise UserError(f"--kv-cache-memory {text}: {e}.") from None


def is_fraction(text: str) -> bool:
    """A --kv-cache-memory value that is a fraction of the free memory ('0.5'), not a size."""
    text = str(text).strip()
    try:
        float(text)
    except ValueError:
        return False
    return "." in text and not text[-1:].isalpha()


def resolve_budget(text: str, available: int) -> int:
    """Bytes of a --kv-cache-memory value: a size ('512MiB', '2GiB', a byte count) or a fraction of the `available`
    memory ('0.5': half of it; TensorRT-LLM's free_gpu_memory_fraction). ValueError, with the reason, when it is not
    one, not positive, or more than is available."""
    text = str(text).strip()
    fraction = float(text) if is_fraction(text) else None
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError("a fraction of the free memory must be in (0, 1]")
        return int(fraction * available)
    size = parse_size(text)
    if size > available:
        raise ValueError(f"more than the {format_size(available)} of memory this machine has free")
    return size


class KVBudgetError(ValueError):
    """A KV-cache budget too small for the engine (plan_blocks)."""


def available_memory() -> int:
    """Bytes of memory this machine can give without swapping (/proc/meminfo's MemAvailable; else free pages)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_blocks(budget: int, shapes: list[CacheShape], max_positions: int, block_tokens: int = BLOCK_TOKENS,
                reserved: int = 0, reserved_for: str = "the sliding-window layers'") -> int:
    """The blocks `budget` bytes, less `reserved` (`reserved_for`: the sliding-window layers' rings, window_pool; the
    Gated DeltaNet layers' states) hold for caches of `shapes` (one block = block_tokens positions of every one), less
    the trash block; KVBudgetError when that is fewer than one request of `max_positions` needs."""
    per_block = block_tokens * sum(shape.position_bytes() for shape in shapes)
    blocks = (budget - reserved) // per_block - 1
    need = blocks_for(max_positions, block_tokens)
    if blocks < need:
        held = max(blocks, 0)
        rings = f" after {reserved_for} {format_size(reserved)}" if reserved else ""
        raise KVBudgetError(f"it holds {held} KV block{'' if held == 1 else 's'} of {block_tokens} positions "
                            f"({format_size(per_block)} each){rings} and one request of the engine's max_seq_len needs "
                            f"{need}; give at least {format_size(reserved + (need + 1) * per_block)}")
    return blocks


def window_pool(window: int, margin: int, num_slots: int, max_positions: int, shape: CacheShape,
                block_tokens: int = BLOCK_TOKENS) -> tuple[int, int]:
    """(blocks, bytes) of the sliding-window layers' own tables: every slot's ring (the blocks of window - 1 keys
    before a verify block of `margin` and the block itself, unaligned) and one request's whole prompt, which a prefill
    writes before its first step gives back what fell out of the window. Sized so that rings never make a request wait;
    the rest of the budget goes to the full layers."""
    blocks = num_slots * (blocks_for(window - 1 + margin, block_tokens) + 1) + blocks_for(max_positions, block_tokens)
    return blocks, (blocks + 1) * block_tokens * shape.position_bytes()
