"""The onnxruntime executor: an engine's ONNX graphs (compile/onnx_export.py) run by onnxruntime.

Same contract as the torch executor (runtime/executor.py), same tokens. The KV caches are torch tensors
[num_slots, kv_heads, max_len, head_dim] per layer that this executor owns; every graph call binds a
cache's input and output to the same memory (IOBinding), so onnxruntime's TensorScatter writes the new
positions in place and no cache is ever copied by a step.

TensorScatter's batch axis is the cache's axis 0, so a call covers a contiguous run of cache rows. The
Decoder hands out slots in any order; this executor keeps the requests it holds in rows 0 .. n-1
(`_rows`: slot -> row) and, when a request ends, moves the request of the last row into the freed row
(one copy of one request's caches per finished request, not per step). A call's batch is sorted by row
and widened to the run of rows it covers; a row of that run outside the batch belongs to a request that
has already finished (its slot is released at the end of the Decoder's step), so it is fed padding at
position 0 and its output is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trtllm_dflash.engine_dir import EngineConfig, graph_dir
from trtllm_dflash.errors import UserError
from trtllm_dflash.runtime.executor import StepOutput, engine_specs
from trtllm_dflash.speculative.core import block_input

GRAPHS = ("target_step.onnx", "drafter_context.onnx", "drafter_draft.onnx")


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise UserError("--backend onnxruntime needs onnxruntime: pip install 'trtllm-dflash[onnx]'.") from None
    return onnxruntime


@dataclass
class _Caches:
    """One model's per-layer K and V buffers, [num_slots, kv_heads, max_len, head_dim] each."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def zeros(cls, layers: int, num_slots: int, kv_heads: int, max_len: int, head_dim: int,
              dtype: torch.dtype) -> "_Caches":
        def new() -> torch.Tensor:
            return torch.zeros(num_slots, kv_heads, max_len, head_dim, dtype=dtype)

        return cls([new() for _ in range(layers)], [new() for _ in range(layers)])

    def bind(self, binding, first_row: int, rows: int, outputs: bool) -> None:
        """Bind rows first_row .. first_row + rows - 1 as past_* (and, with `outputs`, present_*) in place."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for name, buf in ((f"key_{i}", k), (f"value_{i}", v)):
                shape = (rows, *buf.shape[1:])
                ptr = buf[first_row].data_ptr()
                element = _NUMPY[buf.dtype]
                binding.bind_input(f"past_{name}", "cpu", 0, element, shape, ptr)
                if outputs:
                    binding.bind_output(f"present_{name}", "cpu", 0, element, shape, ptr)

    def move_row(self, src: int, dst: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[dst].copy_(buf[src])


_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}


def _bind_output(binding, name: str, tensor: torch.Tensor) -> None:
    binding.bind_output(name, "cpu", 0, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())


class OnnxRuntimeExecutor:
    """Target + drafter graphs in three onnxruntime sessions (CPU execution provider; CUDA when present)."""

    def __init__(self, graphs: Path, cfg: EngineConfig, block_size: int | None, threads: int | None):
        ort = _onnxruntime()
        target, drafter, params = engine_specs(cfg)
        dtype = getattr(torch, cfg.dtype)
        if dtype not in _NUMPY:
            raise UserError(f"--backend onnxruntime runs float32 / float16 engines; this one is {cfg.dtype}.")
        self.device = torch.device("cpu")
        self.num_slots, self.vocab_size, self.max_seq_len = cfg.max_batch_size, target.vocab_size, cfg.max_seq_len
        self.block_size = block_size or params.block_size
        self.mask_token_id = params.mask_token_id
        self._dtype = dtype
        self._hidden_features = len(params.target_layer_ids) * target.hidden_size
        max_len = cfg.max_seq_len + params.block_size  # as the torch executor: a verify writes a block past the end
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        # onnxruntime's threads spin after each run by default, and torch's threads (which sample and index the
        # outputs right after) then fight them for the cores: 2-3 ms lost per step on a 2-core machine.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # CPU only for now: the caches are CPU tensors bound in place (a CUDA execution provider would need
        # them on the device, which nothing here can test).
        self._sessions = {name: ort.InferenceSession(str(graphs / name), options, providers=["CPUExecutionProvider"])
                          for name in GRAPHS}
        self._target = _Caches.zeros(target.num_layers, self.num_slots, target.num_kv_heads, max_len,
                                     target.head_dim, dtype)
        self._drafter = _Caches.zeros(drafter.num_layers, self.num_slots, drafter.num_kv_heads, max_len,
                                      drafter.head_dim, dtype)
        self._rows: dict[int, int] = {}  # slot -> cache row; rows 0 .. len - 1 are in use

    @classmethod
    def from_engine(cls, root: Path, cfg: EngineConfig, rank: int, block_size: int | None,
                    threads: int | None) -> "OnnxRuntimeExecutor":
        graphs = graph_dir(Path(root), rank)
        missing = [name for name in GRAPHS if not (graphs / name).is_file()]
        if missing:
            raise UserError(f"{root}: the engine has no ONNX graphs ({graphs / missing[0]} is missing); build it "
                            "with `backend: onnxruntime` to run it with --backend onnxruntime.")
        return cls(graphs, cfg, block_size, threads)

    # ------------------------------------------------------------------------------------------------
    # The Executor contract
    # ------------------------------------------------------------------------------------------------

    def target_forward(self, token_ids, starts, slots, capture, last_index=None) -> StepOutput:
        """token_ids [B, T] at positions starts + arange(T); logits [B, T, V] (or [B, 1, V] at `last_index`)."""
        run = self._run_of(slots)
        T = token_ids.shape[1]
        ids = run.spread(token_ids, 0)
        positions = run.spread(starts[:, None] + torch.arange(T), torch.arange(T))
        binding = self._session("target_step.onnx").io_binding()
        binding.bind_cpu_input("token_ids", ids)
        binding.bind_cpu_input("positions", positions)
        # Outputs go straight into torch tensors (asking onnxruntime for its own copies costs more than the step).
        logits = torch.empty(run.rows, T, self.vocab_size, dtype=torch.float32)
        hidden = torch.empty(run.rows, T, self._hidden_features, dtype=self._dtype)
        _bind_output(binding, "logits", logits)
        _bind_output(binding, "hidden", hidden)
        self._target.bind(binding, run.first, run.rows, outputs=True)
        self._session("target_step.onnx").run_with_iobinding(binding)
        logits, hidden = logits[run.batch_rows], hidden[run.batch_rows]
        if last_index is not None:
            logits = logits[torch.arange(logits.shape[0]), last_index][:, None]
        return StepOutput(logits, hidden if capture else None)

    def draft(self, anchors, starts, slots) -> torch.Tensor:
        """Greedy drafts [B, block_size - 1] (argmax of the target's lm_head inside the graph)."""
        run = self._run_of(slots)
        block = block_input(anchors, self.mask_token_id, self.block_size)
        positions = starts[:, None] + torch.arange(self.block_size)
        binding = self._session("drafter_draft.onnx").io_binding()
        binding.bind_cpu_input("block_ids", run.spread(block, self.mask_token_id))
        binding.bind_cpu_input("positions", run.spread(positions, torch.arange(self.block_size)))
        self._drafter.bind(binding, run.first, run.rows, outputs=False)
        drafts = torch.empty(run.rows, self.block_size - 1, dtype=torch.int64)
        _bind_output(binding, "draft_tokens", drafts)
        self._session("drafter_draft.onnx").run_with_iobinding(binding)
        return drafts[run.batch_rows]

    def append_context(self, hidden, starts, slots) -> None:
        """The drafter's context K/V of hidden [B, C, F] at positions starts + arange(C), written in place."""
        run = self._run_of(slots)
        C = hidden.shape[1]
        binding = self._session("drafter_context.onnx").io_binding()
        binding.bind_cpu_input("target_hidden", run.spread(hidden, 0))
        binding.bind_cpu_input("positions", run.spread(starts[:, None] + torch.arange(C), torch.arange(C)))
        self._drafter.bind(binding, run.first, run.rows, outputs=True)
        self._session("drafter_context.onnx").run_with_iobinding(binding)

    def release(self, slot: int) -> None:
        """Keep the rows in use contiguous: the last row's request moves into the freed row."""
        row = self._rows.pop(slot, None)
        if row is None:
            return
        last = len(self._rows)
        if row != last:
            moved = next(s for s, r in self._rows.items() if r == last)
            self._target.move_row(last, row)
            self._drafter.move_row(last, row)
            self._rows[moved] = row

    # ------------------------------------------------------------------------------------------------

    def _session(self, name: str):
        return self._sessions[name]

    def _run_of(self, slots: torch.Tensor) -> "_RowRun":
        rows = []
        for slot in slots.tolist():
            if slot not in self._rows:  # a new request: the next free row
                self._rows[slot] = len(self._rows)
            rows.append(self._rows[slot])
        return _RowRun(rows)


class _RowRun:
    """The contiguous run of cache rows a batch covers, and where each batch row sits in it.

    Example: rows [3, 1] -> first 1, rows 3 (1, 2, 3); batch row 0 is run row 2, batch row 1 is run row 0;
    run row 1 is padding."""

    def __init__(self, rows: list[int]):
        self.first = min(rows)
        self.rows = max(rows) - self.first + 1
        self.batch_rows = torch.tensor([r - self.first for r in rows])  # run row of each batch row

    def spread(self, batch: torch.Tensor, pad) -> np.ndarray:
        """[B, ...] -> [rows, ...]: padding rows hold `pad` (a number, or a tensor broadcast to a row)."""
        out = batch.new_empty((self.rows, *batch.shape[1:]))
        out[:] = pad
        out[self.batch_rows] = batch
        return np.ascontiguousarray(out.numpy())

