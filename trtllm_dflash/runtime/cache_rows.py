"""KV caches kept in contiguous rows, for the executors that run compiled graphs (onnxruntime, TensorRT).

The graphs write their caches with TensorScatter, whose batch axis is the cache's axis 0: a call covers a
contiguous run of cache rows, bound in place (the cache input and output at the same address). The
Decoder hands out slots in any order, so `CacheRows` keeps the requests an executor holds in rows
0 .. n-1 (slot -> row) and, when a request ends, moves the request of the last row into the freed row
(one copy of one request's caches per finished request, not per step). A call's batch is widened to the
run of rows it covers; a row of that run outside the batch belongs to a request that has already
finished (its slot is released at the end of the Decoder's step), so it is fed padding at position 0
and its output is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class LayerCaches:
    """One model's per-layer K and V buffers, [num_slots, kv_heads, length, head_dim] each."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def zeros(cls, layers: int, num_slots: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "LayerCaches":
        def new() -> torch.Tensor:
            return torch.zeros(num_slots, kv_heads, length, head_dim, dtype=dtype, device=device)

        return cls([new() for _ in range(layers)], [new() for _ in range(layers)])

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """("key_0", K_0), ("value_0", V_0), ...: the suffixes of the graphs' past_* / present_* names."""
        return [(f"{kind}_{i}", buf) for i, pair in enumerate(zip(self.keys, self.values))
                for kind, buf in zip(("key", "value"), pair)]

    def move_row(self, src: int, dst: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[dst].copy_(buf[src])


class RowRun:
    """The contiguous run of cache rows a batch covers, and where each batch row sits in it.

    Example: rows [3, 1] -> first 1, rows 3 (1, 2, 3); batch row 0 is run row 2, batch row 1 is run row 0;
    run row 1 is padding."""

    def __init__(self, rows: list[int]):
        self.first = min(rows)
        self.rows = max(rows) - self.first + 1
        self.batch_rows = torch.tensor([r - self.first for r in rows])  # run row of each batch row

    def spread(self, batch: torch.Tensor, pad) -> torch.Tensor:
        """[B, ...] -> [rows, ...] on batch's device: padding rows hold `pad` (a number, or a row to broadcast)."""
        out = batch.new_empty((self.rows, *batch.shape[1:]))
        out[:] = pad
        out[self.batch_rows.to(batch.device)] = batch
        return out.contiguous()


class CacheRows:
    """slot -> cache row for every cache in `caches`, rows 0 .. n-1 in use."""

    def __init__(self, caches: Sequence[LayerCaches]):
        self._caches = tuple(caches)
        self._row: dict[int, int] = {}

    @property
    def in_use(self) -> int:
        return len(self._row)

    def run_of(self, slots: torch.Tensor) -> RowRun:
        """The batch's run of rows; a slot seen for the first time (a new request) takes the next free row."""
        rows = []
        for slot in slots.tolist():
            if slot not in self._row:
                self._row[slot] = len(self._row)
            rows.append(self._row[slot])
        return RowRun(rows)

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
