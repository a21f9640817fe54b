"""The TensorRT executor: an engine's compiled plans (compile/tensorrt_build.py) run by TensorRT on a CUDA GPU.

Same contract as the torch executor (runtime/executor.py) and the same cache binding as the onnxruntime
executor (runtime/onnxruntime_executor.py), whose row bookkeeping it reuses: per layer one K and one V
buffer [num_slots, kv_heads, cache_length, head_dim] owned here as torch CUDA tensors; the requests held sit in
rows 0 .. n-1; a call covers a contiguous run of rows and binds each past_* input AND its present_* output to
the run's first row (`set_tensor_address`), so TensorRT's KV-cache-update layers write the new positions in
place (its IKVCacheUpdateLayer requires input and output to share memory; `from_engine` checks the plans alias
them). Inputs and outputs are torch tensors too; outputs are allocated per call by torch's caching allocator.

Streams: the plans run on this executor's own CUDA stream (TensorRT advises against the default stream), after
the caller's pending work, and the caller's stream waits for them before it reads an output.

Not done: CUDA graphs. The graphs read only positions < max(positions) + 1 of a cache (a size that depends on
the data), and every call binds the cache at the address of its run's first row, so one captured graph would
serve only one (batch, length, first row) and only if TensorRT can capture that data-dependent shape at all.
A static attended length (the whole cache) and steps over all slots would make a capture per (T = 1, block)
possible; that is a change of the exported graphs.

Tensor parallelism: rank r runs onnx/rank{r}'s plans, whose DistCollective layers (all-reduce of the row-parallel
outputs, all-gather of the vocabulary shards) run over the NCCL communicator of the torch.distributed process
group that runtime/world.py starts under MPI (nccl on CUDA): `set_communicator` on every execution context.
Unverified: no machine of ours has run it (no TensorRT, no second GPU).

Only `from_engine` touches TensorRT and CUDA; the class itself takes execution contexts, so its bindings are
tested on the CPU with contexts that run the same graphs in onnxruntime (tests/test_tensorrt_build.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from trtllm_dflash.compile.tensorrt_build import (
    ACCEPT,
    PLANS,
    PLANS_DIR,
    PLANS_INFO,
    file_sha256,
    import_tensorrt,
    plan_file,
    require_gpu,
)
from trtllm_dflash.engine_dir import EngineConfig, check_draft_graph_inputs
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import read_json_object
from trtllm_dflash.runtime.cache_rows import CacheRows, LayerCaches, RowRun
from trtllm_dflash.runtime.executor import DraftContext, StepOutput, engine_specs
from trtllm_dflash.speculative.core import acceptance_inputs, block_input, block_positions

COMMAND = "--backend tensorrt"


class ExecutionContext(Protocol):
    """What this executor uses of a `tensorrt.IExecutionContext`."""

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool: ...

    def set_tensor_address(self, name: str, memory: int) -> bool: ...

    def execute_async_v3(self, stream_handle: int) -> bool: ...


def _ok(done: bool, what: str) -> None:
    if not done:
        raise RuntimeError(f"TensorRT refused {what} (its log says why)")


def _bind_caches(context: ExecutionContext, caches: LayerCaches, run: RowRun, write: bool) -> None:
    """Bind rows run.first .. run.first + run.rows - 1 of every cache as past_* (and, with `write`, present_*)."""
    for name, buf in caches.named():
        shape, address = (run.rows, *buf.shape[1:]), buf[run.first].data_ptr()
        _ok(context.set_input_shape(f"past_{name}", shape), f"past_{name} of shape {shape}")
        _ok(context.set_tensor_address(f"past_{name}", address), f"the address of past_{name}")
        if write:
            _ok(context.set_tensor_address(f"present_{name}", address), f"the address of present_{name}")


class TensorRTExecutor:
    """Target + drafter plans: three execution contexts over caches this executor owns."""

    def __init__(self, contexts: Mapping[str, ExecutionContext], cfg: EngineConfig, block_size: int | None,
                 device: torch.device | str, cache_length: int, owners: tuple = (), accept_plugin: bool = False):
        """`contexts`: plan name (PLANS) -> execution context; `cache_length`: the plans' cache positions per
        row; `owners`: the TensorRT objects the contexts depend on (runtime, engines), kept alive here;
        `accept_plugin`: the accept plan is the DFlashAccept plugin's (int32 tensors) rather than plain ops'."""
        target, drafter, params = engine_specs(cfg)
        if cache_length < cfg.max_seq_len + params.block_size:
            raise ValueError(f"cache_length {cache_length} < max_seq_len + block_size")
        dtype = getattr(torch, cfg.dtype)
        self.device = torch.device(device)
        self.num_slots, self.vocab_size, self.max_seq_len = cfg.max_batch_size, target.vocab_size, cfg.max_seq_len
        self.block_size = block_size or params.block_size
        self.mask_token_id = params.mask_token_id
        self._features, self._dtype = len(params.target_layer_ids) * target.hidden_size, dtype
        self._target = LayerCaches.zeros(target.num_layers, self.num_slots, target.num_kv_heads, cache_length,
                                         target.head_dim, dtype, self.device)
        self._drafter = LayerCaches.zeros(drafter.num_layers, self.num_slots, drafter.num_kv_heads, cache_length,
                                          drafter.head_dim, dtype, self.device)
        self._rows = CacheRows((self._target, self._drafter))  # slot -> cache row (runtime/cache_rows.py)
        self._contexts = dict(contexts)
        self._accept_ints = torch.int32 if accept_plugin else torch.int64
        if accept_plugin and self.block_size != params.block_size:
            raise UserError(f"--block-size {self.block_size}: the plans' DFlashAccept plugin was built for the "
                            f"drafter's block of {params.block_size} tokens; run without --block-size, or compile "
                            "without --plugin-library.")
        self._owners = owners  # released after the contexts (attribute order); a tuple frees its last item first
        # cpu: only for contexts that are not TensorRT's (the tests' onnxruntime stand-ins); they get stream 0.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def from_engine(cls, root: Path, cfg: EngineConfig, rank: int, block_size: int | None,
                    plugin_library: Path | None = None) -> "TensorRTExecutor":
        """Rank `rank`'s plans of a verified engine directory, deserialized on the current CUDA device (under
        tp > 1, inside the torch.distributed NCCL group of the MPI ranks)."""
        root = Path(root)
        info_path = root / PLANS_DIR / PLANS_INFO
        missing = [p for p in (*(plan_file(root, rank, g) for g in PLANS), info_path) if not p.is_file()]
        if missing:
            raise UserError(f"{root}: the engine has no TensorRT plans ({missing[0]} is missing); run "
                            f"`trtllm-dflash compile {root}` on the GPU machine first.")
        info = read_json_object(info_path, "TensorRT plan info")
        if plugin_library is None and info.get("plugin_library"):
            raise UserError(f"{root}: the plans were built with the plugin library {info['plugin_library']}; "
                            "pass its path with --plugin-library.")
        if plugin_library is not None and not Path(plugin_library).is_file():
            raise UserError(f"--plugin-library {plugin_library}: no such file.")
        if plugin_library is not None and info.get("plugin_library_sha256") not in (None, file_sha256(plugin_library)):
            raise UserError(f"--plugin-library {plugin_library}: this is another build of the plugin library than "
                            f"the plans were compiled with ({info.get('plugin_library')}); pass that one, or run "
                            f"`trtllm-dflash compile {root} --plugin-library {plugin_library}` again.")
        if info.get("tp_size", 1) != cfg.mapping.tp_size:
            raise UserError(f"{root}: the plans were compiled for tp_size {info.get('tp_size', 1)} and the engine is "
                            f"split for tp_size {cfg.mapping.tp_size}; run `trtllm-dflash compile {root}` again.")
        trt = import_tensorrt(COMMAND)
        if trt.__version__ != info.get("tensorrt_version"):
            raise UserError(f"{root}: the plans were built with TensorRT {info.get('tensorrt_version')} and this is "
                            f"TensorRT {trt.__version__}; run `trtllm-dflash compile {root}` again.")
        require_gpu(COMMAND)

        # ---- CUDA from here on ----
        device = torch.device("cuda", torch.cuda.current_device())
        capability = "{}.{}".format(*torch.cuda.get_device_capability(device))
        if capability != info.get("compute_capability"):
            raise UserError(f"{root}: the plans were built for compute capability {info.get('compute_capability')} "
                            f"({info.get('device')}) and this GPU is {capability}; run `trtllm-dflash compile {root}` "
                            "on this machine.")
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        if plugin_library is not None:
            runtime.get_plugin_registry().load_library(str(plugin_library))
        engines, contexts = {}, {}
        for graph in PLANS:
            path = plan_file(root, rank, graph)
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise UserError(f"{path}: TensorRT could not load this plan; run `trtllm-dflash compile {root}` again.")
            _check_plan(trt, engine, path, int(info["cache_length"]))
            if graph == "drafter_draft":
                check_draft_graph_inputs([engine.get_tensor_name(i) for i in range(engine.num_io_tensors)], path)
            engines[graph], contexts[graph] = engine, engine.create_execution_context()
            if cfg.mapping.tp_size > 1:
                _ok(contexts[graph].set_communicator(nccl_communicator(device)), f"the NCCL communicator of {graph}")
        return cls(contexts, cfg, block_size, device, int(info["cache_length"]), owners=(logger, runtime, engines),
                   accept_plugin=bool(info.get("plugin_library")))

    # ------------------------------------------------------------------------------------------------
    # The Executor contract
    # ------------------------------------------------------------------------------------------------

    def target_forward(self, token_ids, starts, slots, capture, last_index=None) -> StepOutput:
        """token_ids [B, T] at positions starts + arange(T); logits [B, T, V] (or [B, 1, V] at `last_index`)."""
        run = self._rows.run_of(slots)
        T = token_ids.shape[1]
        with self._on_own_stream():
            steps = torch.arange(T, device=self.device)
            logits = torch.empty((run.rows, T, self.vocab_size), dtype=torch.float32, device=self.device)
            hidden = torch.empty((run.rows, T, self._features), dtype=self._dtype, device=self.device)
            self._execute("target_step", {"token_ids": run.spread(token_ids, 0),
                                          "positions": run.spread(starts[:, None] + steps, steps)},
                          {"logits": logits, "hidden": hidden}, self._target, run, write=True)
            rows = run.batch_rows.to(self.device)
            logits, hidden = logits[rows], hidden[rows]
            if last_index is not None:
                logits = logits[torch.arange(logits.shape[0], device=self.device), last_index][:, None]
        return StepOutput(logits, hidden if capture else None)

    def draft(self, anchors, starts, slots, num_drafts=None, context=None) -> torch.Tensor:
        """Greedy drafts [B, num_drafts] (argmax of the target's lm_head inside the plan, over the whole block), after
        writing `context` into the drafter's caches."""
        run = self._rows.run_of(slots)
        with self._on_own_stream():
            steps = torch.arange(self.block_size, device=self.device)
            block = block_input(anchors, self.mask_token_id, self.block_size)
            if context is None:
                context = DraftContext.padding(starts, self._features, self._dtype)
            context_steps = torch.arange(context.hidden.shape[1], device=self.device)
            drafts = torch.empty((run.rows, self.block_size - 1), dtype=torch.int64, device=self.device)
            self._execute("drafter_draft", {"block_ids": run.spread(block, self.mask_token_id),
                                            "positions": run.spread(starts[:, None] + steps, steps),
                                            "context_hidden": run.spread(context.hidden, 0),
                                            "context_positions": run.spread(context.positions(), context_steps)},
                          {"draft_tokens": drafts}, self._drafter, run, write=True)
            drafts = drafts[run.batch_rows.to(self.device), :num_drafts]
        return drafts

    def append_context(self, hidden, starts, slots) -> None:
        """The drafter's context K/V of hidden [B, C, F] at positions starts + arange(C), written in place."""
        run = self._rows.run_of(slots)
        with self._on_own_stream():
            steps = torch.arange(hidden.shape[1], device=self.device)
            self._execute("drafter_context", {"target_hidden": run.spread(hidden, 0),
                                              "positions": run.spread(starts[:, None] + steps, steps)},
                          {}, self._drafter, run, write=True)

    def accept(self, draft, logits, sampling, starts) -> tuple[torch.Tensor, torch.Tensor]:
        """The accept plan (the DFlashAccept plugin, or the same step in plain ops) on the device; the top-k /
        top-p truncation and the Gumbel noise of sampled rows are made as speculative.core.sample_tokens makes
        them (greedy rows: zeros)."""
        ints = self._accept_ints
        B, K = draft.shape
        with self._on_own_stream():
            logits, noise = acceptance_inputs(logits, sampling, block_positions(starts, K + 1))
            outputs = {"accepted": torch.empty(B, dtype=ints, device=self.device),
                       "committed_tokens": torch.empty(B, K + 1, dtype=ints, device=self.device),
                       "next_block": torch.empty(B, K + 1, dtype=ints, device=self.device),
                       "next_positions": torch.empty(B, K + 1, dtype=ints, device=self.device),
                       "new_context_lengths": torch.empty(B, dtype=ints, device=self.device)}
            self._execute(ACCEPT, {"draft_tokens": draft.to(ints).contiguous(), "target_logits": logits.contiguous(),
                                   "temperature": sampling.temperature.contiguous(), "gumbel_noise": noise,
                                   "context_lengths": starts.to(ints).contiguous()}, outputs, None, None, write=False)
        return outputs["accepted"].long(), outputs["next_block"][:, 0].long()

    def release(self, slot: int) -> None:
        self._rows.release(slot)

    # ------------------------------------------------------------------------------------------------

    def _execute(self, graph: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
                 caches: LayerCaches | None, run: RowRun | None, write: bool) -> None:
        context = self._contexts[graph]
        for name, tensor in inputs.items():
            shape = tuple(tensor.shape)
            _ok(context.set_input_shape(name, shape), f"{graph} input {name} of shape {shape}")
            _ok(context.set_tensor_address(name, tensor.data_ptr()), f"the address of {graph} input {name}")
        if caches is not None:
            _bind_caches(context, caches, run, write)
        for name, tensor in outputs.items():
            _ok(context.set_tensor_address(name, tensor.data_ptr()), f"the address of {graph} output {name}")
        _ok(context.execute_async_v3(self._stream.cuda_stream if self._stream is not None else 0), f"to run {graph}")

    @contextmanager
    def _on_own_stream(self) -> Iterator[None]:
        """Run the plans and the torch ops around them on this executor's stream, after the caller's pending
        work; the caller's stream then waits for them, so it reads outputs only once they are written."""
        if self._stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            yield
        caller.wait_stream(self._stream)


def nccl_communicator(device: torch.device) -> int:
    """The ncclComm_t (as an integer) of the default torch.distributed group on `device` (runtime/world.py
    starts it with the nccl backend on CUDA): what TensorRT's DistCollective layers communicate over."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UserError(f"{COMMAND} with tp_size > 1 runs under MPI: start it as `mpirun -n TP trtllm-dflash run ...`.")
    backend = dist.group.WORLD._get_backend(device)
    comm_ptr = getattr(backend, "_comm_ptr", None)
    if comm_ptr is None:
        raise UserError(f"{COMMAND} with tp_size > 1 needs torch's NCCL process group to expose its communicator "
                        f"(ProcessGroupNCCL._comm_ptr); this torch {torch.__version__} does not.")
    return int(comm_ptr())


def _check_plan(trt: Any, engine, path: Path, cache_length: int) -> None:
    """The plan's caches have `cache_length` positions, and each present_* output is TensorRT's in-place update
    of its past_* input (the executor binds both to one buffer)."""
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if name.startswith("past_") and engine.get_tensor_shape(name)[2] != cache_length:
            raise RuntimeError(f"{path}: {name} has {engine.get_tensor_shape(name)[2]} positions, not the "
                               f"{cache_length} of {PLANS_INFO}")
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT and name.startswith("present_"):
            past = name.replace("present_", "past_", 1)
            if engine.get_aliased_input_tensor(name) != past:
                raise RuntimeError(f"{path}: output {name} is not aliased to input {past} in this plan; binding both "
                                   "to one cache buffer would be wrong")
