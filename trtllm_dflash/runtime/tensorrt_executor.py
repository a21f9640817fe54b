"""The TensorRT executor: an engine's compiled plans (compile/tensorrt_build.py) run by TensorRT on a CUDA GPU.

Same contract as the torch executor (runtime/executor.py) and the same cache binding as the onnxruntime
executor (runtime/onnxruntime_executor.py), whose row bookkeeping it reuses: per layer one K and one V
buffer [num_slots, kv_heads, cache_length, head_dim] owned here as torch CUDA tensors; the requests held sit in
rows 0 .. n-1; a call covers a contiguous run of rows and binds each past_* input AND its present_* output to
the run's first row (`set_tensor_address`), so TensorRT's KV-cache-update layers write the new positions in
place (its IKVCacheUpdateLayer requires input and output to share memory; `from_engine` checks the plans alias
them). Inputs and outputs are torch tensors too; outputs are allocated per call by torch's caching allocator.
Sliding-window layers of plans compiled from graphs with rings (engines built since 2026-12-05) keep `window_ring`
positions per row, not cache_length: the plan rewrites the whole ring through its one linear update (onnx_ops.
ring_rewrite; docs/backends.md §Windowed layers in rings).

A Qwen3.5 target's Gated DeltaNet layers keep their states (models/linear_attention.RecurrentStates) in rows beside the
caches. TensorRT aliases an output with an input only in a KV-cache update, so a state a plan reads and writes (conv
and state in target_step, the state in target_replay) is written to a buffer of its own and copied back into the rows
after the plan, on the same stream; the delta_* that target_step writes and does not read go straight into the rows.
Before each target pass the target_replay plan advances the states over each row's kept tokens (all `depth` steps:
no host read of how many any row keeps), unless no row's last pass kept any (the host knows: prompts, plain steps).
One token per row (plain steps) runs the target_token plan where the engine has it (built for tensorrt since
2026-12-05): the token's step of the gated delta rule in plain ops, no TensorRT loop, conv and state read and written.

Streams: the plans run on this executor's own CUDA stream (TensorRT advises against the default stream), after
the caller's pending work, and the caller's stream waits for them before it reads an output.

Memory: a prefill runs in passes of at most `pass_tokens` positions per row (compile/tensorrt_build.py's profile
maximum), so a pass's fp32 logits and each plan's scratch are sized for that, not for max_seq_len; the four plans
run one after another on one stream and share one scratch buffer (USER_MANAGED contexts).

Shapes: every size a plan uses comes from its inputs' shapes, none from their values: the attended length is the
length of `key_positions` (0 .. keys - 1), a bucket of KV_BUCKET keys chosen on the host (executor.attended_keys)
within the profile's `keys` range.

CUDA graphs (`cuda_graphs`, on by default at tp_size 1): the decode step's plan calls (target_step or target_token over
at most a verify block per row, target_replay, drafter_draft, accept) are captured once per distinct call, each with a
context of its own over static buffers, and replayed (runtime/plan_graphs.py); their attended lengths then come in
the coarser buckets of the torch executor's graphs (cuda_graphs.length_bucket) so that a long answer needs few
captures. Prompts and the drafter's context passes run eagerly. Nothing here has run on a GPU.

Tensor parallelism: rank r runs onnx/rank{r}'s plans, whose DistCollective layers (all-reduce of the row-parallel
outputs, all-gather of the vocabulary shards) run over the NCCL communicator of the torch.distributed process
group that parallel/world.py starts under MPI (`cpu:gloo,cuda:nccl`; under a gloo-only group, an NCCL group of the
same ranks made here), on the GPU of the rank's local rank: `set_communicator` on every execution context, given
the ncclComm_t in a PyCapsule (TensorRT's binding takes a `void*`, which pybind11 accepts only as a capsule), after
one all-reduce has made NCCL start the communicator (torch starts it lazily; until then its address is 0).
Unverified: no machine of ours has run it (no TensorRT, no second GPU).

Only `from_engine` touches TensorRT and CUDA; the class itself takes execution contexts, so its bindings are
tested on the CPU with contexts that run the same graphs in onnxruntime (tests/test_tensorrt_build.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from trtllm_dflash.compile.tensorrt_build import (
    ACCEPT,
    PLANS_DIR,
    PLANS_INFO,
    REPLAY,
    STATE_OUTPUTS,
    TOKEN,
    engine_plans,
    file_sha256,
    import_tensorrt,
    load_plugin_library,
    plan_file,
    process_logger,
    require_gpu,
)
from trtllm_dflash.engine_dir import ONE_TOKEN_ADVANCES_KEY, EngineConfig, check_graph_inputs
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import read_json_object
from trtllm_dflash.models.linear_attention import READ_KINDS, REPLAY_KINDS, STATE_KINDS, RecurrentPass, RecurrentStates
from trtllm_dflash.parallel.world import cuda_device_index, local_rank
from trtllm_dflash.runtime.cache_rows import LayerCaches, RowRun, StaticRows, batch_order, row_address
from trtllm_dflash.runtime.cuda_graphs import length_bucket
from trtllm_dflash.runtime.executor import (DraftContext, HostRows, StepOutput, attended_keys, engine_specs,
                                            logits_at_last, on_stream)
from trtllm_dflash.runtime.plan_graphs import PlanGraphs, PlanKey, StateCopies
from trtllm_dflash.speculative.core import AcceptPlanInputs, block_input, block_positions

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
        shape, address = (run.rows, *buf.shape[1:]), row_address(buf, run.first)  # (a latent attention V: 0 wide)
        _ok(context.set_input_shape(f"past_{name}", shape), f"past_{name} of shape {shape}")
        _ok(context.set_tensor_address(f"past_{name}", address), f"the address of past_{name}")
        if write:
            _ok(context.set_tensor_address(f"present_{name}", address), f"the address of present_{name}")


class TensorRTExecutor(StaticRows):
    """Target + drafter plans: three execution contexts over caches this executor owns."""

    def __init__(self, contexts: Mapping[str, ExecutionContext], cfg: EngineConfig, block_size: int | None,
                 device: torch.device | str, cache_length: int, owners: tuple = (), accept_plugin: bool = False,
                 pass_tokens: int | None = None, prefix_cache: bool = True,
                 kv_cache_memory: int | Callable[[], int] | None = None, one_token_advances: bool = True,
                 new_context: Callable[[str], ExecutionContext] | None = None, cuda_graphs: bool = False,
                 report: Callable[[str], None] = lambda line: None, window_ring: int | None = None,
                 prefix_states: int | None = None):
        """`contexts`: plan name (PLANS) -> execution context; `cache_length`: the plans' cache positions per
        row; `owners`: the TensorRT objects the contexts depend on (runtime, engines, scratch, communicator),
        kept alive here; `accept_plugin`: the accept plan is the DFlashAccept plugin's (int32 tensors) rather than
        plain ops'; `pass_tokens`: the most positions per row a target_step or drafter_context call may take (the
        plans' profile; None: no limit); `prefix_cache`: prompt blocks copied between requests with the same prefix
        (cache_rows.PrefixRows; with recurrent states, up to a kept state: runtime/prefix_states.py, `prefix_states` of
        them, default one per row); `kv_cache_memory`: the caches' and the prefix pool's bytes, or a function giving the
        pool's (StaticRows._keep_rows); `one_token_advances`: the target plan's
        one-token passes leave the Gated DeltaNet layers' states after their token (RecurrentStates; False: plans of
        graphs exported before 2026-12-05); `cuda_graphs`: the decode step's plan calls captured as CUDA graphs (on a
        CPU: run over the same static buffers), each on a context of its own from `new_context(plan)`
        (runtime/plan_graphs.py); `report` hears of a plan that could not be captured. `window_ring`: the positions
        per row of the sliding-window layers' rings (plans of graphs exported with rings: compile's info; their passes
        write at most `pass_tokens` positions per row, which the ring's length allows for)."""
        target, drafter, params = engine_specs(cfg)
        if cache_length < cfg.max_seq_len + params.block_size:
            raise ValueError(f"cache_length {cache_length} < max_seq_len + block_size")
        dtype = getattr(torch, cfg.dtype)
        self.device = torch.device(device)
        self.num_slots, self.vocab_size, self.max_seq_len = cfg.max_batch_size, target.vocab_size, cfg.max_seq_len
        self.block_size = block_size or params.block_size
        self.mask_token_id = params.mask_token_id
        self._features, self._dtype = len(params.target_layer_ids) * target.hidden_size, dtype
        self._cache_length = cache_length
        heads, k_dim, v_dim = target.cache_head()  # (a latent attention target's: one head of its latent, no V)

        self.window_ring = window_ring  # (None: every layer keeps cache_length positions)
        lengths = [window_ring if window_ring and target.is_sliding(i) else cache_length
                   for i in target.attention_layers]

        def rows(n: int):
            caches = (LayerCaches.zeros(target.attention_layers, n, heads, lengths, k_dim, dtype, self.device, v_dim),
                      LayerCaches.zeros(drafter.num_layers, n, drafter.num_kv_heads, cache_length, drafter.head_dim,
                                        dtype, self.device))
            # Gated DeltaNet layers' states per row (Qwen3.5), resuming passes of up to a verify block
            return caches, RecurrentStates.of(target, cfg.mapping.tp_size, n, params.block_size, dtype, self.device,
                                              one_token_advances)

        # (max_batch_size rows, or as many as --kv-cache-memory holds)
        self.num_slots, ((self._target, self._drafter), self._states) = self._allocate_rows(
            rows, cfg.max_batch_size, kv_cache_memory, prefix_cache, cache_length, prefix_states)
        self._linear = target.linear_layers
        # slot -> cache row, and the prefix pool (runtime/cache_rows.py StaticRows)
        self._keep_rows((self._target, self._drafter), self._states, cache_length, prefix_cache,
                        target.sliding_window if window_ring else 0, kv_cache_memory, prefix_states)
        self._contexts = dict(contexts)
        self._accept_ints = torch.int32 if accept_plugin else torch.int64
        if accept_plugin and self.block_size != params.block_size:
            raise UserError(f"--block-size {self.block_size}: the plans' DFlashAccept plugin was built for the "
                            f"drafter's block of {params.block_size} tokens; run without --block-size, or compile "
                            "without --plugin-library.")
        self._pass_tokens = pass_tokens or cfg.max_seq_len + params.block_size
        self._owners = owners  # released after the contexts (attribute order); a tuple frees its last item first
        # cpu: only for contexts that are not TensorRT's (the tests' onnxruntime stand-ins); they get stream 0.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if cuda_graphs and new_context is None:
            raise ValueError("cuda_graphs needs new_context: each captured call has an execution context of its own")
        self._graphs = (PlanGraphs(new_context, self._stream, capture=self.device.type == "cuda", report=report)
                        if cuda_graphs else None)

    @classmethod
    def from_engine(cls, root: Path, cfg: EngineConfig, rank: int, block_size: int | None,
                    plugin_library: Path | None = None, prefix_cache: bool = True,
                    kv_cache_memory: int | Callable[[], int] | None = None, cuda_graphs: bool | None = None,
                    report: Callable[[str], None] = lambda line: None, auto: bool = False,
                    prefix_states: int | None = None) -> "TensorRTExecutor":
        """Rank `rank`'s plans of a verified engine directory, deserialized on the current CUDA device (under
        tp > 1, inside the torch.distributed NCCL group of the MPI ranks). `cuda_graphs`: the decode step's plan
        calls as CUDA graphs (None: at tp_size 1); `auto`: for --block-size auto, whose steps verify every length
        up to the block (the accept plan in plain ops takes them all; the DFlashAccept plugin's, one block)."""
        root = Path(root)
        info_path = root / PLANS_DIR / PLANS_INFO
        plans = engine_plans(cfg, root)
        missing = [p for p in (*(plan_file(root, rank, g) for g in plans), info_path) if not p.is_file()]
        if missing:
            raise UserError(f"{root}: the engine has no TensorRT plans ({missing[0]} is missing); run "
                            f"`trtllm-dflash compile {root}` on the GPU machine first.")
        info = read_json_object(info_path, "TensorRT plan info")
        if auto and info.get("plugin_library"):
            raise UserError(f"--block-size auto: {root}'s plans take their accept step from the DFlashAccept plugin, "
                            f"built for blocks of {cfg.dflash.block_size} tokens, and auto verifies shorter ones too; "
                            f"give no --block-size, or run `trtllm-dflash compile {root}` without --plugin-library.")
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
        if cfg.mapping.tp_size > 1:  # the GPU of this rank's local rank (parallel/world.py does the same for nccl)
            local = local_rank()
            torch.cuda.set_device(cuda_device_index(rank if local is None else local, torch.cuda.device_count()))
        device = torch.device("cuda", torch.cuda.current_device())
        capability = "{}.{}".format(*torch.cuda.get_device_capability(device))
        if capability != info.get("compute_capability"):
            raise UserError(f"{root}: the plans were built for compute capability {info.get('compute_capability')} "
                            f"({info.get('device')}) and this GPU is {capability}; run `trtllm-dflash compile {root}` "
                            "on this machine.")
        logger = process_logger(trt)
        runtime = trt.Runtime(logger)
        if plugin_library is not None:
            load_plugin_library(trt, plugin_library)
        plugin = bool(info.get("plugin_library"))
        engines = {}
        for graph in plans:
            path = plan_file(root, rank, graph)
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise UserError(f"{path}: TensorRT could not load this plan; run `trtllm-dflash compile {root}` again.")
            if graph in ("target_step", "drafter_draft"):
                check_graph_inputs(graph, [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)], path)
            _check_plan(trt, engine, path, int(info["cache_length"]), bound_dtypes(cfg, graph, plugin), root,
                        ring_caches(cfg, info.get("window_ring")) if graph == "target_step" else None)
            engines[graph] = engine
        # The plans run one at a time on one stream: one scratch buffer, as large as the largest plan's, serves all.
        scratch_bytes = max(int(e.device_memory_size_v2) for e in engines.values())
        scratch = torch.empty(max(scratch_bytes, 1), dtype=torch.uint8, device=device)
        communicator = None
        if cfg.mapping.tp_size > 1:  # a collective, which every rank reaches only if its plans loaded
            communicator = nccl_communicator(device)

        def new_context(graph: str):
            context = engines[graph].create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            context.set_device_memory(scratch.data_ptr(), scratch_bytes)
            if communicator is not None:
                _ok(context.set_communicator(communicator.capsule), f"the NCCL communicator of {graph}")
            return context

        shapes = info.get("shapes", {})
        return cls({graph: new_context(graph) for graph in engines}, cfg, block_size, device,
                   int(info["cache_length"]), owners=(logger, runtime, engines, scratch, communicator),
                   accept_plugin=plugin, pass_tokens=int(shapes["seq"][2]) if "seq" in shapes else None,
                   prefix_cache=prefix_cache, kv_cache_memory=kv_cache_memory,
                   one_token_advances=bool(info.get(ONE_TOKEN_ADVANCES_KEY)), new_context=new_context,
                   cuda_graphs=cfg.mapping.tp_size == 1 if cuda_graphs is None else cuda_graphs, report=report,
                   window_ring=info.get("window_ring"), prefix_states=prefix_states)

    # ------------------------------------------------------------------------------------------------
    # The Executor contract
    # ------------------------------------------------------------------------------------------------

    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None) -> StepOutput:
        """token_ids [B, T] at positions starts + arange(T); logits [B, T, V] (or [B, 1, V] at `last_index`).

        T > pass_tokens (a prefill) runs in passes of pass_tokens positions; with `last_index`, only the logits at
        last_index are kept from each pass (a pass's logits [B, pass, V] are the most ever held)."""
        runs = self._rows.runs_of(slots if rows is None else rows.slots)
        self._rings_wrote(starts, slots, rows, token_ids.shape[1])
        with on_stream(self._stream, self.device):
            positions = starts[:, None] + torch.arange(token_ids.shape[1], device=self.device)
            last = last_index.to(self.device) if last_index is not None else None
            outs = [self._target_run(run, run.take(token_ids), run.take(positions),
                                     run.take(last) if last is not None else None, capture, rows, starts)
                    for run in runs]
            logits = batch_order(runs, [o[0] for o in outs])
            hidden = batch_order(runs, [o[1] for o in outs]) if capture else None
        return StepOutput(logits, hidden)

    def _target_run(self, run: RowRun, token_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor | None,
                    capture: bool, host: HostRows | None, starts: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One run of rows, in passes of at most pass_tokens columns: (logits [rows, T or 1, V], hidden or None).
        Pass c0 .. c1 - 1 attends to the keys before max(start) + c1 (`host` / `starts`: the whole batch's)."""
        rows, T = token_ids.shape
        if last is None and T > self._pass_tokens:
            raise ValueError(f"{T} positions without last_index: a pass takes at most {self._pass_tokens}")
        picked = hidden = None
        graphed = last is None and T <= self.block_size  # a decode or verify pass (a prompt's run eagerly)
        # one token per row of a Qwen3.5 target: its loop-free plan, the states read and written (no delta_*)
        plan = TOKEN if T == 1 and self._states is not None and TOKEN in self._contexts else "target_step"
        if capture:
            hidden = torch.empty((rows, T, self._features), dtype=self._dtype, device=self.device)
        for c0 in range(0, T, self._pass_tokens):
            c1 = min(T, c0 + self._pass_tokens)
            logits = torch.empty((rows, c1 - c0, self.vocab_size), dtype=torch.float32, device=self.device)
            part = torch.empty((rows, c1 - c0, self._features), dtype=self._dtype, device=self.device)
            inputs = {"token_ids": token_ids[:, c0:c1].contiguous(), "positions": positions[:, c0:c1].contiguous(),
                      "key_positions": self._key_positions(host, starts, c1, graphed)}
            step = None
            if self._states is not None:  # this pass's real tokens per row: those before last + 1 (or all)
                real = (last + 1 - c0 if last is not None else torch.full_like(positions[:, 0], T - c0))
                step = self._resume(run, inputs["positions"][:, 0].contiguous(), c1 - c0, real.clamp(0, c1 - c0),
                                    graphed)
                inputs |= {"kept": step.kept} if plan == TOKEN else {"kept": step.kept, "valid": step.valid}
            self._execute(plan, inputs, {"logits": logits, "hidden": part}, self._target, run, write=True,
                          states=step is not None, graphed=graphed)
            if step is not None:
                self._states.end(step, run.range)
            if hidden is not None:
                hidden[:, c0:c1] = part
            if last is None:
                picked = logits  # one pass: T <= pass_tokens
                continue
            picked = logits_at_last(logits, last, c0, picked)  # each row's, from the pass that holds it
        return picked, hidden

    def _resume(self, run: RowRun, starts: torch.Tensor, tokens: int, valid: torch.Tensor, graphed: bool
                ) -> RecurrentPass:
        """Before a target pass over the run's rows (a Gated DeltaNet target): the pass's view of the states, and the
        target_replay plan run over the whole verify block (no host read of how many tokens any row keeps: the steps
        past a row's `kept` leave its state as it was), its states written to a buffer of their own, then copied back
        into the rows (TensorRT aliases an output with an input only in a KV-cache update). Not run where the host
        knows that no row's last pass kept its inputs (RecurrentStates.may_replay: after prompts and plain steps)."""
        rows = torch.arange(run.first, run.first + run.rows, device=self.device)
        step = self._states.begin(rows, starts, tokens, valid)
        if self._states.may_replay(run.range):
            self._execute(REPLAY, {"kept": step.kept, "steps": torch.arange(self._states.depth, device=self.device)},
                          {}, None, run, write=False, states=True, graphed=graphed)
        return step

    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None) -> torch.Tensor:
        """Greedy drafts [B, num_drafts] (argmax of the target's lm_head inside the plan, over the whole block), after
        writing `context` into the drafter's caches."""
        runs = self._rows.runs_of(slots if rows is None else rows.slots)
        with on_stream(self._stream, self.device):
            width = width or self.block_size
            block = block_input(anchors, self.mask_token_id, width)
            positions = starts[:, None] + torch.arange(width, device=self.device)
            if context is None:
                context = DraftContext.padding(starts, self._features, self._dtype)
            inputs = {"block_ids": block, "positions": positions, "context_hidden": context.hidden,
                      "context_positions": context.positions()}
            keys = self._key_positions(rows, starts, 0, graphed=True)  # the context keys: before each start
            drafts = []
            for run in runs:
                out = torch.empty((run.rows, width - 1), dtype=torch.int64, device=self.device)
                run_inputs = {name: run.take(t.to(self.device)) for name, t in inputs.items()}
                self._execute("drafter_draft", {**run_inputs, "key_positions": keys},
                              {"draft_tokens": out}, self._drafter, run, write=True, graphed=True)
                drafts.append(out)
            drafts = batch_order(runs, drafts)[:, :num_drafts]
        return drafts

    def append_context(self, hidden, starts, slots, rows=None) -> None:
        """The drafter's context K/V of hidden [B, C, F] at positions starts + arange(C), written in place, in passes
        of at most pass_tokens positions."""
        with on_stream(self._stream, self.device):
            positions = starts[:, None] + torch.arange(hidden.shape[1], device=self.device)
            for run in self._rows.runs_of(slots if rows is None else rows.slots):
                run_hidden, run_positions = run.take(hidden), run.take(positions)
                for c0 in range(0, hidden.shape[1], self._pass_tokens):
                    c1 = min(hidden.shape[1], c0 + self._pass_tokens)
                    self._execute("drafter_context", {"target_hidden": run_hidden[:, c0:c1].contiguous(),
                                                      "positions": run_positions[:, c0:c1].contiguous()},
                                  {}, self._drafter, run, write=True)

    def accept(self, draft, logits, sampling, starts) -> tuple[torch.Tensor, torch.Tensor]:
        """The accept plan (the DFlashAccept plugin, or the same step in plain ops) on the device; the top-k /
        top-p truncation, the Gumbel noise and the sampled rows' scores are made here, as
        speculative.core.sample_tokens makes them (AcceptPlanInputs: what TensorRT may fuse is then exact)."""
        ints = self._accept_ints
        B, K = draft.shape
        with on_stream(self._stream, self.device):
            plan = AcceptPlanInputs.make(logits, sampling, block_positions(starts, K + 1))
            outputs = {"accepted": torch.empty(B, dtype=ints, device=self.device),
                       "committed_tokens": torch.empty(B, K + 1, dtype=ints, device=self.device),
                       "next_block": torch.empty(B, K + 1, dtype=ints, device=self.device),
                       "next_positions": torch.empty(B, K + 1, dtype=ints, device=self.device),
                       "new_context_lengths": torch.empty(B, dtype=ints, device=self.device)}
            self._execute(ACCEPT, {"draft_tokens": draft.to(ints).contiguous(), "target_logits": plan.scores,
                                   "temperature": plan.temperature, "gumbel_noise": plan.noise,
                                   "context_lengths": starts.to(ints).contiguous()}, outputs, None, None, write=False,
                          graphed=True)
        return outputs["accepted"].long(), outputs["next_block"][:, 0].long()

    def _key_positions(self, rows: HostRows | None, starts: torch.Tensor, tokens: int, graphed: bool) -> torch.Tensor:
        """The plans' `key_positions` input, 0 .. keys - 1: its length is the pass's attended length (a bucket,
        executor.attended_keys; a call made a CUDA graph: cuda_graphs.length_bucket's coarser one, a capture each)
        within the profile's keys range; no plan reads a size from its data."""
        keys = attended_keys(rows, starts, tokens, self._cache_length)
        if graphed and self._graphs is not None:
            keys = length_bucket(keys, self._cache_length)
        return torch.arange(keys, device=self.device)

    # ------------------------------------------------------------------------------------------------

    def _execute(self, graph: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
                 caches: LayerCaches | None, run: RowRun | None, write: bool, states: bool = False,
                 graphed: bool = False) -> None:
        """Run plan `graph`: `inputs` and `outputs` bound where they lie, `caches` rows of `run` in place (past_*, and
        with `write` present_*), and with `states` the run's rows of the Gated DeltaNet states (_state_io); with
        `graphed` and CUDA graphs on, as a replay over static buffers instead (runtime/plan_graphs.py)."""
        copies = self._state_io(graph, run, inputs, outputs) if states else []

        def bind(context: ExecutionContext, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
            self._bind(context, graph, inputs, outputs, caches, run, write)

        if graphed and self._graphs is not None:
            key = PlanKey.of(graph, inputs, outputs, run.range if caches is not None or states else None)
            self._graphs.run(key, inputs, outputs, bind, copies)
            return
        context = self._contexts[graph]
        bind(context, inputs, outputs)
        _ok(context.execute_async_v3(self._stream.cuda_stream if self._stream is not None else 0), f"to run {graph}")
        for rows, name in copies:  # (on the same stream, after the plan)
            rows.copy_(outputs[name])

    def _bind(self, context: ExecutionContext, graph: str, inputs: dict[str, torch.Tensor],
              outputs: dict[str, torch.Tensor], caches: LayerCaches | None, run: RowRun | None, write: bool) -> None:
        """Set the shapes and addresses of a call of plan `graph` on `context`."""
        for name, tensor in inputs.items():
            shape = tuple(tensor.shape)
            _ok(context.set_input_shape(name, shape), f"{graph} input {name} of shape {shape}")
            _ok(context.set_tensor_address(name, tensor.data_ptr()), f"the address of {graph} input {name}")
        if caches is not None:
            _bind_caches(context, caches, run, write)
        for name, tensor in outputs.items():
            _ok(context.set_tensor_address(name, tensor.data_ptr()), f"the address of {graph} output {name}")

    def _state_io(self, graph: str, run: RowRun, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]
                  ) -> StateCopies:
        """Add the run's rows of the states to `inputs` / `outputs` of target_step (reads conv and state, writes all
        six: delta_* into the rows, which it does not read), target_token (reads and writes conv and state) or
        target_replay (reads state and delta_*, writes the state). A state that the plan reads and writes goes to a
        new buffer; returns (rows, output name) pairs to copy back once it ran."""
        rows = slice(run.first, run.first + run.rows)
        read = REPLAY_KINDS if graph == REPLAY else READ_KINDS
        written = {"target_step": STATE_KINDS, TOKEN: READ_KINDS}.get(graph, ("state",))
        copies = []
        for name, buf in self._states.named(self._linear, read):
            inputs[f"past_{name}"] = buf[rows]
        for name, buf in self._states.named(self._linear, written):
            if name.split("_")[0] in READ_KINDS:  # read too: a buffer of its own, copied back
                outputs[f"present_{name}"] = torch.empty_like(buf[rows])
                copies.append((buf[rows], f"present_{name}"))
            else:
                outputs[f"present_{name}"] = buf[rows]
        return copies



def pointer_capsule(address: int) -> object:
    """A PyCapsule holding `address` as a `void*`: what a pybind11 binding of a `void*` parameter accepts (it refuses
    an int with TypeError), such as TensorRT's IExecutionContext.set_communicator (python/src/infer/pyCore.cpp binds
    setCommunicator(void*) directly). Unnamed: pybind11 reads any capsule's pointer under the capsule's own name."""
    if not address:
        raise ValueError("a null pointer")
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new(address, None, None)


class NcclCommunicator:
    """The ncclComm_t of a torch.distributed NCCL group on one GPU, as TensorRT's set_communicator takes it. Holds the
    group: the communicator must outlive the execution contexts (NvInferRuntime.h)."""

    def __init__(self, group: Any, address: int):
        self.group, self.address = group, address
        self.capsule = pointer_capsule(address)


def communicator_address(read: Any, start: Any) -> int:
    """The communicator's address from `read()` (ProcessGroupNCCL._comm_ptr: 0 until NCCL has started the
    communicator of the current device, which torch does at the group's first collective), after `start()` (one
    collective) if it was 0; a UserError if it is still 0."""
    address = int(read())
    if address == 0:
        start()
        address = int(read())
    if address == 0:
        raise UserError(f"{COMMAND} with tp_size > 1: torch's NCCL process group has no communicator on this GPU even "
                        "after an all-reduce (ProcessGroupNCCL._comm_ptr is 0).")
    return address


def nccl_communicator(device: torch.device) -> NcclCommunicator:
    """The NCCL communicator of the torch.distributed group on `device` (the current CUDA device): the default
    group's CUDA backend when it is NCCL (parallel/world.py's `cpu:gloo,cuda:nccl`), else an NCCL group of all
    ranks made here (a run with --device cpu has a gloo-only group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UserError(f"{COMMAND} with tp_size > 1 runs under MPI: start it as `mpirun -n TP trtllm-dflash run ...`.")
    group = dist.group.WORLD
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # "No backend type associated with device type cuda"
        backend = None
    if type(backend).__name__ != "ProcessGroupNCCL":
        group = dist.new_group(backend="nccl")
        backend = group._get_backend(device)
    comm_ptr = getattr(backend, "_comm_ptr", None)
    if comm_ptr is None:
        raise UserError(f"{COMMAND} with tp_size > 1 needs torch's NCCL process group to expose its communicator "
                        f"(ProcessGroupNCCL._comm_ptr); this torch {torch.__version__} does not.")

    def start() -> None:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        torch.cuda.synchronize(device)

    return NcclCommunicator(group, communicator_address(comm_ptr, start))


# TensorRT DataType names -> the torch dtype a buffer of that type is bound as.
_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
                 "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool,
                 "FP8": torch.float8_e4m3fn}


def bound_dtypes(cfg: EngineConfig, graph: str, accept_plugin: bool) -> dict[str, torch.dtype]:
    """Tensor name -> the dtype this executor binds for it, for every input and output of plan `graph`."""
    target, drafter, _ = engine_specs(cfg)
    dtype, ids = getattr(torch, cfg.dtype), torch.int64

    def caches(layers: int | list[int]) -> dict[str, torch.dtype]:
        numbers = range(layers) if isinstance(layers, int) else layers
        return {f"{io}_{kind}_{i}": dtype for i in numbers for kind in ("key", "value") for io in ("past", "present")}

    linear = target.linear_layers
    # a Gated DeltaNet layer's states: the conv inputs and delta_* in the model's dtype, the state and delta_g fp32
    states = {f"{kind}_{i}": torch.float32 if kind in ("state", "delta_g") else dtype for i in linear
              for kind in STATE_KINDS}
    if graph == REPLAY:
        return {"kept": ids, "steps": ids, **{f"past_{n}": t for n, t in states.items() if n.split("_")[0] != "conv"},
                **{f"present_{n}": t for n, t in states.items() if n.startswith("state_")}}
    if graph in ("target_step", TOKEN):
        read = {n: t for n, t in states.items() if n.split("_")[0] in READ_KINDS}
        if graph == TOKEN:  # (one token: conv and state read and written, no delta_*, every token valid)
            recurrent = {"kept": ids, **{f"present_{n}": t for n, t in read.items()},
                         **{f"past_{n}": t for n, t in read.items()}}
        else:
            recurrent = {"kept": ids, "valid": ids, **{f"present_{n}": t for n, t in states.items()},
                         **{f"past_{n}": t for n, t in read.items()}} if linear else {}
        return {"token_ids": ids, "positions": ids, "key_positions": ids, "logits": torch.float32, "hidden": dtype,
                **caches(target.attention_layers), **recurrent}
    if graph == "drafter_context":
        return {"target_hidden": dtype, "positions": ids, **caches(drafter.num_layers)}
    if graph == "drafter_draft":
        return {"block_ids": ids, "positions": ids, "context_hidden": dtype, "context_positions": ids, "key_positions": ids,
                "draft_tokens": ids, **caches(drafter.num_layers)}
    ints = torch.int32 if accept_plugin else torch.int64
    return {"draft_tokens": ints, "target_logits": torch.float32, "temperature": torch.float32,
            "gumbel_noise": torch.float32, "context_lengths": ints, "accepted": ints, "committed_tokens": ints,
            "next_block": ints, "next_positions": ints, "new_context_lengths": ints}


def ring_caches(cfg: EngineConfig, window_ring: int | None) -> dict[str, int]:
    """target_step's cache tensors that are rings (its sliding-window layers', compiled with `window_ring` positions)
    -> that length; none without rings."""
    target, _, _ = engine_specs(cfg)
    return {f"past_{kv}_{i}": window_ring for i in target.attention_layers if window_ring and target.is_sliding(i)
            for kv in ("key", "value")}


def _check_plan(trt: Any, engine, path: Path, cache_length: int, dtypes: Mapping[str, torch.dtype] | None = None,
                root: Path | None = None, rings: Mapping[str, int] | None = None) -> None:
    """The plan's caches have `cache_length` positions (the caches named in `rings`, a sliding-window layer's: their
    ring's), each present_* output is TensorRT's in-place update of its past_* input (the executor binds both to one
    buffer), and its tensors are those the executor binds, of the dtypes it binds them as (`dtypes`: bound_dtypes): a
    buffer of another dtype would be read as garbage, silently."""
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    for name in names:
        length = (rings or {}).get(name, cache_length)
        if name.startswith(("past_key_", "past_value_")) and engine.get_tensor_shape(name)[2] != length:
            raise RuntimeError(f"{path}: {name} has {engine.get_tensor_shape(name)[2]} positions, not the "
                               f"{length} of {PLANS_INFO}")
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT and name.startswith("present_") and \
                not name.startswith(STATE_OUTPUTS) and engine.get_tensor_shape(name)[-1] != 0:
            # (a recurrent state's: a buffer of its own, copied back; a latent attention V holds no bytes)
            past = name.replace("present_", "past_", 1)
            if engine.get_aliased_input_tensor(name) != past:
                raise RuntimeError(f"{path}: output {name} is not aliased to input {past} in this plan; binding both "
                                   "to one cache buffer would be wrong")
    if dtypes is None:
        return
    again = f"run `trtllm-dflash compile {root}` again" if root is not None else "compile the engine again"
    unknown = [n for n in names if n not in dtypes]
    missing = [n for n in dtypes if n not in names]
    if unknown or missing:
        what = f"has a tensor {unknown[0]}" if unknown else f"has no tensor {missing[0]}"
        raise UserError(f"{path}: this plan {what}, which {COMMAND} does not bind that way; {again}.")
    for name in names:
        kind = engine.get_tensor_dtype(name).name
        if _TORCH_DTYPES.get(kind) != dtypes[name]:
            bound = str(dtypes[name]).removeprefix("torch.")
            raise UserError(f"{path}: {name} is {kind} in this plan and {COMMAND} binds it as {bound}; {again}.")
