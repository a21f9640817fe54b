"""The onnxruntime executor: an engine's ONNX graphs (compile/onnx_export.py) run by onnxruntime.

Same contract as the torch executor (runtime/executor.py), same tokens. The KV caches are torch tensors
[num_slots, kv_heads, max_len, head_dim] per layer that this executor owns; every graph call binds a
cache's input and output to the same memory (IOBinding), so onnxruntime's TensorScatter writes the new
positions in place and no cache is ever copied by a step. Which rows a call binds: runtime/cache_rows.py. The
bindings of a graph's caches are made once per run of rows and kept (`_binding`); a call binds only its own inputs
and outputs. target_step's attention reads a Slice of each cache (a copy of the attended prefix); one-token passes
run target_decode.onnx where the engine has it (on the CPU), whose GroupQueryAttention nodes read the caches in place.
A Qwen3.5 target's Gated DeltaNet layers keep their states (models/linear_attention.RecurrentStates) in rows beside the
caches, bound the same way; target_replay.onnx resumes a row's states at its next pass's start before target_step runs
(docs/models.md §Recurrent state).

On a `cuda` device (onnxruntime-gpu; written, never run: no GPU here) the sessions run on this executor's own CUDA
stream (the CUDA execution provider's `user_compute_stream`), and so do the torch ops that make their inputs and
read their outputs; the stream first waits for the caller's pending work, and the caller's stream waits for it
before it reads an output. Without that, onnxruntime's kernels ran on a stream of its own, which could read an
input that torch was still writing on the caller's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from trtllm_dflash.engine_dir import (
    ONE_TOKEN_ADVANCES_KEY,
    RING_PASS_KEY,
    TREE_WINDOWS_KEY,
    EngineConfig,
    check_graph_inputs,
    graph_dir,
)
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.linear_attention import READ_KINDS, REPLAY_KINDS, RecurrentStates
from trtllm_dflash.runtime.cache_rows import LayerCaches, RowRun, StaticRows, batch_order, row_address
from trtllm_dflash.runtime.executor import (DraftContext, HostRows, StepOutput, attended_keys, engine_specs,
                                            logits_at_last, on_stream)
from trtllm_dflash.speculative.core import AcceptPlanInputs, block_input, block_positions

GRAPHS = ("target_step.onnx", "drafter_context.onnx", "drafter_draft.onnx", "accept.onnx")
TREE_GRAPHS = ("target_tree.onnx", "drafter_candidates.onnx")  # loaded for draft trees (tree_budget) only
# One-token target passes (plain decoding steps, a DFlash step's plain steps): each layer's write and attention one
# GroupQueryAttention node reading the cache in place (compile/onnx_export.py TargetDecode); exported where the target
# allows it and by trtllm-dflash since 2026-12-04 (else target_step runs them)
DECODE_GRAPH = "target_decode.onnx"
# Targets with Gated DeltaNet layers (Qwen3.5): each layer's state advanced over the tokens its row keeps of its last
# pass, before the next target_step (compile/onnx_export.py TargetReplay)
REPLAY_GRAPH = "target_replay.onnx"


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise UserError("--backend onnxruntime needs onnxruntime: pip install 'trtllm-dflash[onnx]'.") from None
    return onnxruntime


_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}


def _where(tensor: torch.Tensor) -> tuple[str, int]:
    """onnxruntime's (device type, device id) of a torch tensor's memory."""
    return ("cuda", tensor.device.index or 0) if tensor.is_cuda else ("cpu", 0)


def _bind_input(binding, name: str, tensor: torch.Tensor) -> None:
    """Bind a contiguous torch tensor as an input where it lies (the caller keeps it alive until the run)."""
    assert tensor.is_contiguous(), name
    binding.bind_input(name, *_where(tensor), _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())


def _bind_output(binding, name: str, tensor: torch.Tensor) -> None:
    binding.bind_output(name, *_where(tensor), _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())


def _bind_rows(binding, name: str, buf: torch.Tensor, run: RowRun, past: bool, present: bool) -> None:
    """Bind rows run.first .. run.first + run.rows - 1 of `buf` as past_<name> and / or present_<name>, in place."""
    ptr = row_address(buf, run.first)  # (not data_ptr(): a latent attention layer's V is zero-width)
    shape, element = (run.rows, *buf.shape[1:]), _NUMPY[buf.dtype]
    if past:
        binding.bind_input(f"past_{name}", *_where(buf), element, shape, ptr)
    if present:
        binding.bind_output(f"present_{name}", *_where(buf), element, shape, ptr)


def cuda_provider(device: torch.device, stream: int) -> tuple[str, dict[str, str]]:
    """The CUDA execution provider on `device`, running on the CUDA stream whose handle is `stream` (torch's
    `Stream.cuda_stream`; 0: a stream of onnxruntime's own), so that its kernels are ordered with the torch ops on
    that stream. (onnxruntime makes every option value a string.)"""
    options = {"device_id": str(device.index or 0)}
    if stream:
        options.update(user_compute_stream=str(stream), has_user_compute_stream="1")
    return ("CUDAExecutionProvider", options)


def providers(ort, device: torch.device, stream: int = 0) -> list:
    """The execution providers for `device`: the CPU's, or CUDA's (onnxruntime-gpu) on `cuda:i` and `stream`."""
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise UserError(f"--backend onnxruntime --device {device} needs onnxruntime's CUDA execution provider, and "
                        f"this onnxruntime has {', '.join(ort.get_available_providers())}: pip install onnxruntime-gpu "
                        "(instead of onnxruntime).")
    return [cuda_provider(device, stream), "CPUExecutionProvider"]


class OnnxRuntimeExecutor(StaticRows):
    """Target + drafter + acceptance graphs in onnxruntime sessions: the CPU execution provider, or CUDA's on a
    `cuda` device (onnxruntime-gpu; written, never run: no GPU here), with the caches on that device."""

    def __init__(self, graphs: Path, cfg: EngineConfig, block_size: int | None, threads: int | None,
                 device: torch.device | str = "cpu", tree_budget: int = 0, prefix_cache: bool = True,
                 kv_cache_memory: int | Callable[[], int] | None = None, prefix_states: int | None = None):
        """`tree_budget`: the most draft nodes a tree step verifies (target_tree.onnx, drafter_candidates.onnx; its
        nodes are written past a request's positions, so the caches hold that many more); 0: no trees.
        `prefix_cache`: prompt blocks copied between requests with the same prefix (cache_rows.PrefixRows;
        with a hybrid target, up to a block after which its recurrent states are kept: runtime/prefix_states.py;
        `prefix_states` of them, default one per row). `kv_cache_memory`: the caches' and the prefix pool's bytes, or a
        function giving the pool's (StaticRows._keep_rows)."""
        ort = _onnxruntime()
        if cfg.quantization.get("quant_algo") == "NVFP4":
            raise UserError("--backend onnxruntime cannot run NVFP4 graphs (TensorRT's FP4 quantize node); use "
                            "--backend torch, or --backend tensorrt on a GPU.")
        target, drafter, params = engine_specs(cfg)
        dtype = getattr(torch, cfg.dtype)
        if dtype not in _NUMPY:
            raise UserError(f"--backend onnxruntime runs float32 / float16 engines; this one is {cfg.dtype}.")
        self.device = torch.device(device)
        self.num_slots, self.vocab_size, self.max_seq_len = cfg.max_batch_size, target.vocab_size, cfg.max_seq_len
        self.block_size = block_size or params.block_size
        self.trained_block = params.block_size
        # A DFlash2 drafter's graph walks its selector over the trained block, whose length is static in it
        self._whole_block = params.dflash2 is not None
        self.mask_token_id = params.mask_token_id
        self.tree_budget = tree_budget
        self._dtype = dtype
        self._hidden_features = len(params.target_layer_ids) * target.hidden_size
        # as the torch executor: a verify writes a block (or a tree's nodes) past the end
        max_len = cfg.max_seq_len + max(params.block_size, tree_budget + 1)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        # onnxruntime's threads spin after each run by default, and torch's threads (which sample and index the
        # outputs right after) then fight them for the cores: 2-3 ms lost per step on a 2-core machine.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # Every input, output and cache is a torch tensor on self.device, bound where it lies (IOBinding).
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        stream = self._stream.cuda_stream if self._stream is not None else 0
        # (on the CPU only: onnxruntime's CUDA GroupQueryAttention takes float16 / bfloat16, and these engines are
        # float32; on CUDA the node would fall back to the CPU, copying the caches each call)
        optional = (DECODE_GRAPH,) if (graphs / DECODE_GRAPH).is_file() and self.device.type == "cpu" else ()
        optional += (REPLAY_GRAPH,) if target.has_recurrent_state else ()
        self._sessions = {name: ort.InferenceSession(str(graphs / name), options,
                                                     providers=providers(ort, self.device, stream))
                          for name in GRAPHS + (TREE_GRAPHS if tree_budget else ()) + optional}
        for graph in ("target_step", "drafter_draft"):
            inputs = [i.name for i in self._sessions[f"{graph}.onnx"].get_inputs()]
            check_graph_inputs(graph, inputs, graphs / f"{graph}.onnx")
        self._cache_length = max_len
        # Engines built since 2026-12-04: the sliding-window layers' caches are rings of the window + pass_tokens
        # positions, and no pass writes more positions per row than that (longer prefills run in passes)
        metadata = self._sessions["target_step.onnx"].get_modelmeta().custom_metadata_map
        ring_pass = metadata.get(RING_PASS_KEY)
        self._pass_tokens = int(ring_pass) if ring_pass else None
        window = target.sliding_window if ring_pass else 0
        # positions per row of those layers; an engine shorter than the ring keeps them whole (no position wraps in a
        # ring of max_len, and entries not yet written come out negative, so the same mask holds)
        self.window_ring = min(window + self._pass_tokens, max_len) if window else None
        if tree_budget and target.sliding_window:
            self._check_tree_windows(graphs / "target_tree.onnx", target.model_type)
        lengths = [self.window_ring if window and target.is_sliding(i) else max_len for i in target.attention_layers]
        heads, k_dim, v_dim = target.cache_head()  # (a latent attention target's: one head of its latent, no V)

        def rows(n: int):
            caches = (LayerCaches.zeros(target.attention_layers, n, heads, lengths, k_dim, dtype, self.device, v_dim),
                      LayerCaches.zeros(drafter.num_layers, n, drafter.num_kv_heads, max_len, drafter.head_dim, dtype,
                                        self.device))
            # Gated DeltaNet layers' states per row, resuming passes of up to a verify block (as the torch executor's)
            return caches, RecurrentStates.of(target, 1, n, params.block_size, dtype, self.device,
                                              one_token_advances=ONE_TOKEN_ADVANCES_KEY in metadata)

        # (max_batch_size rows, or as many as --kv-cache-memory holds)
        self.num_slots, ((self._target, self._drafter), self._states) = self._allocate_rows(
            rows, cfg.max_batch_size, kv_cache_memory, prefix_cache, max_len, prefix_states)
        self._linear = target.linear_layers
        self._keep_rows((self._target, self._drafter), self._states, max_len, prefix_cache, window,  # (StaticRows)
                        kv_cache_memory, prefix_states)
        self._bindings: dict[tuple[str, int, int], object] = {}  # (graph, first row, rows) -> IOBinding (_binding)

    def _check_tree_windows(self, graph: Path, model_type: str) -> None:
        """A tree pass over sliding-window layers: a graph whose windows follow the tree, and nodes that fit the rings
        (a ring holds the window + _pass_tokens positions, and a tree pass writes its nodes and its anchor)."""
        if TREE_WINDOWS_KEY not in self._sessions[graph.name].get_modelmeta().custom_metadata_map:
            raise UserError(f"{graph}: this {model_type} engine's tree graph was exported by an earlier trtllm-dflash, "
                            "whose sliding-window layers ignored the tree; build it again with `trtllm-dflash build "
                            "CONFIG --force` to run --tree-budget.")
        wraps = self.window_ring is not None and self.window_ring < self._cache_length
        if wraps and self.tree_budget + 1 > self._pass_tokens:
            raise UserError(f"--tree-budget {self.tree_budget}: this engine's sliding-window layers keep the last "
                            f"{self.window_ring} positions, room for trees of at most {self._pass_tokens - 1} nodes "
                            f"beside their window on onnxruntime; use --tree-budget {self._pass_tokens - 1} or less.")

    @classmethod
    def from_engine(cls, root: Path, cfg: EngineConfig, rank: int, block_size: int | None,
                    threads: int | None, device: str = "cpu", tree_budget: int = 0, prefix_cache: bool = True,
                    kv_cache_memory: int | Callable[[], int] | None = None,
                    prefix_states: int | None = None) -> "OnnxRuntimeExecutor":
        graphs = graph_dir(Path(root), rank)
        recurrent = engine_specs(cfg)[0].has_recurrent_state
        missing = [name for name in GRAPHS + ((REPLAY_GRAPH,) if recurrent else ()) if not (graphs / name).is_file()]
        if missing:
            raise UserError(f"{root}: the engine has no ONNX graphs ({graphs / missing[0]} is missing); build it "
                            "with `backend: onnxruntime` to run it with --backend onnxruntime.")
        missing = [name for name in TREE_GRAPHS if tree_budget and not (graphs / name).is_file()]
        if missing:
            raise UserError(f"{root}: --tree-budget needs {graphs / missing[0]}, which engines built by an earlier "
                            "trtllm-dflash lack; build it again with `trtllm-dflash build CONFIG --force`.")
        return cls(graphs, cfg, block_size, threads, device, tree_budget, prefix_cache, kv_cache_memory, prefix_states)

    # ------------------------------------------------------------------------------------------------
    # The Executor contract
    # ------------------------------------------------------------------------------------------------

    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None) -> StepOutput:
        """token_ids [B, T] at positions starts + arange(T); logits [B, T, V] (or [B, 1, V] at `last_index`).

        With rings (pass_tokens), a longer pass (a prefill, with `last_index`) runs in passes of pass_tokens."""
        T = token_ids.shape[1]
        if self._pass_tokens is not None and T > self._pass_tokens:
            return self._in_passes(token_ids, starts, slots, capture, last_index, rows)
        runs = self._rows.runs_of(slots if rows is None else rows.slots)
        self._rings_wrote(starts, slots, rows, T)
        with on_stream(self._stream, self.device):
            positions = starts[:, None] + torch.arange(T, device=self.device)
            # one token per row: the in-place graph (no key_positions: each row attends up to its own position)
            keys = None if T == 1 and DECODE_GRAPH in self._sessions else self._key_positions(rows, starts, T)
            valid = None if self._states is None else (
                last_index + 1 if last_index is not None else torch.full_like(starts, T))
            outs = [self._target_run(run, run.take(token_ids), run.take(positions), keys,
                                     None if valid is None else run.take(valid)) for run in runs]
            logits = batch_order(runs, [o[0] for o in outs])
            hidden = batch_order(runs, [o[1] for o in outs]) if capture else None
            if last_index is not None:
                logits = logits[torch.arange(logits.shape[0], device=self.device), last_index][:, None]
        return StepOutput(logits, hidden)

    def _in_passes(self, token_ids, starts, slots, capture, last_index, rows) -> StepOutput:
        """target_forward over columns c0 .. c0 + pass_tokens - 1, one pass after another: the logits at last_index
        (kept from the pass that holds each row's), the hidden states of every column."""
        if last_index is None:
            raise ValueError(f"{token_ids.shape[1]} positions without last_index: a pass takes at most "
                             f"{self._pass_tokens}")
        picked, hidden = None, []
        for c0 in range(0, token_ids.shape[1], self._pass_tokens):
            part = token_ids[:, c0:c0 + self._pass_tokens]
            shifted = HostRows(rows.slots, tuple(s + c0 for s in rows.starts)) if rows is not None else None
            out = self.target_forward(part, starts + c0, slots, capture, rows=shifted)
            picked = logits_at_last(out.logits, last_index, c0, picked)
            hidden.append(out.hidden)
        return StepOutput(picked, torch.cat(hidden, dim=1) if capture else None)

    def _target_run(self, run: RowRun, token_ids: torch.Tensor, positions: torch.Tensor,
                    key_positions: torch.Tensor | None, valid: torch.Tensor | None = None):
        """target_step over the run's rows, or target_decode without `key_positions`. A target with Gated DeltaNet
        layers (Qwen3.5): `valid` real tokens per row; target_replay first resumes each row's states at its start."""
        T = token_ids.shape[1]
        graph = "target_step.onnx" if key_positions is not None else DECODE_GRAPH
        binding = self._binding(graph, run, self._target)
        _bind_input(binding, "token_ids", token_ids)
        _bind_input(binding, "positions", positions)
        if key_positions is not None:
            _bind_input(binding, "key_positions", key_positions)
        step = None
        if self._states is not None:
            rows = torch.arange(run.first, run.first + run.rows, device=self.device)
            step = self._states.begin(rows, positions[:, 0].contiguous(), T, valid)
            if self._states.may_replay(run.range):
                self._replay(run, step.kept)
            _bind_input(binding, "kept", step.kept)
            if graph != DECODE_GRAPH:  # (target_decode has no such input: its one token is valid)
                _bind_input(binding, "valid", valid)
        # Outputs go straight into torch tensors (asking onnxruntime for its own copies costs more than the step).
        logits = torch.empty(run.rows, T, self.vocab_size, dtype=torch.float32, device=self.device)
        hidden = torch.empty(run.rows, T, self._hidden_features, dtype=self._dtype, device=self.device)
        _bind_output(binding, "logits", logits)
        _bind_output(binding, "hidden", hidden)
        self._sessions[graph].run_with_iobinding(binding)
        if step is not None:
            self._states.end(step, run.range)
        return logits, hidden

    def _replay(self, run: RowRun, kept: torch.Tensor) -> None:
        """target_replay.onnx over the run's rows: each Gated DeltaNet layer's state advanced over the `kept` [rows]
        first tokens of the row's last pass (none: nothing to run)."""
        steps = int(kept.max())
        if steps == 0:
            return
        binding = self._binding(REPLAY_GRAPH, run)
        arange = torch.arange(steps, device=self.device)  # (alive until the run)
        _bind_input(binding, "kept", kept)
        _bind_input(binding, "steps", arange)
        self._sessions[REPLAY_GRAPH].run_with_iobinding(binding)

    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None) -> torch.Tensor:
        """Greedy drafts [B, num_drafts] (argmax of the target's lm_head inside the graph, which reads out the
        whole block: the graph has one block length), after writing `context` into the drafter's caches. A DFlash2
        drafter's graph drafts its trained block whatever `width` asks (its walk's length is static): a shorter
        verify length reads its first drafts, as --block-size auto does."""
        requested = width or self.block_size
        num_drafts = requested - 1 if num_drafts is None else num_drafts
        width = self.trained_block if self._whole_block else requested
        drafts, = self._drafter_pass("drafter_draft.onnx", anchors, starts, slots, width, context, rows, {},
                                     {"draft_tokens": ((width - 1,), torch.int64)})
        return drafts[:, :num_drafts]

    def draft_candidates(self, anchors, starts, slots, k: int, context=None, rows=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """For tree drafting (drafter_candidates.onnx): one drafter pass over the trained block, as `draft`'s, and per
        draft position its k best tokens and their log-probabilities, best first: [B, block - 1, k] each."""
        drafts = self.trained_block - 1
        ids, logprobs = self._drafter_pass(
            "drafter_candidates.onnx", anchors, starts, slots, self.trained_block, context, rows,
            {"candidates": torch.arange(k, device=self.device)},  # (its length is k)
            {"candidate_ids": ((drafts, k), torch.int64), "candidate_logprobs": ((drafts, k), torch.float32)})
        return ids, logprobs

    def _drafter_pass(self, graph: str, anchors, starts, slots, width: int, context, rows, extra: dict,
                      outputs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """One run of a drafter graph (drafter_draft / drafter_candidates) over blocks [anchor, MASK, ...] of `width`
        at each start, `context` first written into the drafter's caches: its `outputs` (name -> per-row shape and
        dtype) in the batch's order. `extra`: inputs given whole to every run."""
        runs = self._rows.runs_of(slots if rows is None else rows.slots)
        with on_stream(self._stream, self.device):
            if context is None:
                context = DraftContext.padding(starts, self._hidden_features, self._dtype)
            per_row = {"block_ids": block_input(anchors, self.mask_token_id, width),
                       "positions": starts[:, None] + torch.arange(width, device=self.device),
                       "context_hidden": context.hidden, "context_positions": context.positions()}
            whole = {"key_positions": self._key_positions(rows, starts, 0), **extra}  # keys: positions before each start
            results: dict[str, list[torch.Tensor]] = {name: [] for name in outputs}
            for run in runs:
                binding = self._binding(graph, run, self._drafter)
                inputs = {name: run.take(tensor.to(self.device)) for name, tensor in per_row.items()}  # alive until run
                for name, tensor in {**inputs, **whole}.items():
                    _bind_input(binding, name, tensor)
                for name, (shape, dtype) in outputs.items():
                    results[name].append(torch.empty(run.rows, *shape, dtype=dtype, device=self.device))
                    _bind_output(binding, name, results[name][-1])
                self._sessions[graph].run_with_iobinding(binding)
            return [batch_order(runs, results[name]) for name in outputs]

    def verify_tree(self, token_ids, depths, tree, starts, slots, capture, rows=None) -> StepOutput:
        """One target pass over draft trees (target_tree.onnx): node t of row b at RoPE position starts + depths[b, t],
        cached at starts + t, seeing the keys before its start and the nodes `tree` [B, N, N] allows."""
        runs = self._rows.runs_of(slots if rows is None else rows.slots)
        N = token_ids.shape[1]
        with on_stream(self._stream, self.device):
            positions = starts[:, None] + depths
            keys = self._key_positions(rows, starts, N)
            logits, hidden = [], []
            for run in runs:
                binding = self._binding("target_tree.onnx", run, self._target)
                inputs = {"token_ids": run.take(token_ids), "positions": run.take(positions), "tree": run.take(tree)}
                for name, tensor in inputs.items():
                    _bind_input(binding, name, tensor)
                _bind_input(binding, "key_positions", keys)
                logits.append(torch.empty(run.rows, N, self.vocab_size, dtype=torch.float32, device=self.device))
                hidden.append(torch.empty(run.rows, N, self._hidden_features, dtype=self._dtype, device=self.device))
                _bind_output(binding, "logits", logits[-1])
                _bind_output(binding, "hidden", hidden[-1])
                self._sessions["target_tree.onnx"].run_with_iobinding(binding)
        return StepOutput(batch_order(runs, logits), batch_order(runs, hidden) if capture else None)

    def keep_path(self, slots: torch.Tensor, starts: torch.Tensor, nodes: torch.Tensor) -> None:
        """After a tree's verify pass: the accepted nodes [B, n] (node 0 first; rows padded with 0) move in the
        target's caches from positions starts + node to starts + 0 .. n - 1 (TorchExecutor.keep_path's contract)."""
        with on_stream(self._stream, self.device):
            rows = torch.tensor(self._rows.rows_of(slots), device=self.device)[:, None]
            src = starts[:, None] + nodes
            dst = torch.where(nodes > 0, starts[:, None] + torch.arange(nodes.shape[1], device=self.device), src)
            for _, buf in self._target.named():  # (a ring holds position p at p % its length; others: at p)
                length = buf.shape[2]
                buf[rows, :, dst % length] = buf[rows, :, src % length]  # (the right side is gathered first: a copy)

    def append_context(self, hidden, starts, slots, rows=None) -> None:
        """The drafter's context K/V of hidden [B, C, F] at positions starts + arange(C), written in place."""
        with on_stream(self._stream, self.device):
            positions = starts[:, None] + torch.arange(hidden.shape[1], device=self.device)
            for run in self._rows.runs_of(slots if rows is None else rows.slots):
                binding = self._binding("drafter_context.onnx", run, self._drafter)
                inputs = {"target_hidden": run.take(hidden), "positions": run.take(positions)}  # alive until the run
                for name, tensor in inputs.items():
                    _bind_input(binding, name, tensor)
                self._sessions["drafter_context.onnx"].run_with_iobinding(binding)

    def accept(self, draft, logits, sampling, starts) -> tuple[torch.Tensor, torch.Tensor]:
        """accept.onnx (compile/accept_graph.py): the target's tokens, the accepted drafts and the bonus token.

        The top-k / top-p truncation, the Gumbel noise and the sampled rows' scores are made here
        (speculative.core.AcceptPlanInputs), as speculative.core.sample_tokens makes them."""
        with on_stream(self._stream, self.device):
            plan = AcceptPlanInputs.make(logits, sampling, block_positions(starts, logits.shape[1]))
            binding = self._sessions["accept.onnx"].io_binding()
            inputs = {"draft_tokens": draft, "target_logits": plan.scores, "temperature": plan.temperature,
                      "gumbel_noise": plan.noise, "context_lengths": starts}
            inputs = {name: value.to(self.device).contiguous() for name, value in inputs.items()}
            for name, tensor in inputs.items():
                _bind_input(binding, name, tensor)
            accepted = torch.empty(draft.shape[0], dtype=torch.int64, device=self.device)
            next_block = torch.empty(draft.shape[0], draft.shape[1] + 1, dtype=torch.int64, device=self.device)
            _bind_output(binding, "accepted", accepted)
            _bind_output(binding, "next_block", next_block)
            for name in ("committed_tokens", "next_positions", "new_context_lengths"):
                binding.bind_output(name, _where(accepted)[0], _where(accepted)[1])
            self._sessions["accept.onnx"].run_with_iobinding(binding)
        return accepted, next_block[:, 0]  # next_block = [bonus, MASK, ...]

    def _binding(self, graph: str, run: RowRun, caches: LayerCaches | None = None):
        """`graph`'s IOBinding with `caches` of rows run.first .. run.first + run.rows - 1 bound in place (past_* and
        present_* at the same address; a hybrid target's states too: `_in_place`), made the first time these rows run
        and kept: binding 4 x layers caches was a good part of a small pass's host time. Every call binds its other
        inputs and outputs again (a binding replaces the one of the same name), so nothing of an earlier call is read.
        The caches never move: rows are moved by copying (CacheRows.release), not by reallocating."""
        key = (graph, run.first, run.rows)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self._sessions[graph].io_binding()
            for name, buf, past, present in self._in_place(graph, caches):
                _bind_rows(binding, name, buf, run, past, present)
        return binding

    def _in_place(self, graph: str, caches: LayerCaches | None) -> list[tuple[str, torch.Tensor, bool, bool]]:
        """(name, buffer, read, written) of what `graph` binds in place: its caches, read and written, and a hybrid
        target's Gated DeltaNet states: target_step reads conv and state and writes all six, target_replay reads the
        state and the delta_* and writes the state, target_decode reads and writes conv and state."""
        bound = [(name, buf, True, True) for name, buf in caches.named()] if caches is not None else []
        if self._states is not None and graph == DECODE_GRAPH:
            bound += [(name, buf, True, True) for name, buf in self._states.named(self._linear, READ_KINDS)]
        elif self._states is not None and graph == REPLAY_GRAPH:
            bound += [(name, buf, True, name.startswith("state_"))
                      for name, buf in self._states.named(self._linear, REPLAY_KINDS)]
        elif self._states is not None and graph == "target_step.onnx":
            read = {name for name, _ in self._states.named(self._linear, READ_KINDS)}
            bound += [(name, buf, name in read, True) for name, buf in self._states.named(self._linear)]
        return bound

    def _key_positions(self, rows, starts: torch.Tensor, tokens: int) -> torch.Tensor:
        """The graphs' `key_positions` input, 0 .. keys - 1: its length is the pass's attended length (a bucket,
        executor.attended_keys), so no graph reads a size from its data."""
        return torch.arange(attended_keys(rows, starts, tokens, self._cache_length), device=self.device)

