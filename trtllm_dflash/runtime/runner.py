"""Engine directory -> ready-to-run Decoder (torch executor), and the batch `run` job."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trtllm_dflash.checkpoint.tokenizer import check_prompt_chars, load_tokenizer
from trtllm_dflash.config import Backend
from trtllm_dflash.engine_dir import TOKENIZER, EngineConfig, open_engine, rank_file
from trtllm_dflash.errors import Interrupted, UserError
from trtllm_dflash.inputs import decode_lines, loads, require_file, shown
from trtllm_dflash.outputs import atomic_file, check_output_files, is_user_os_error, reason, write_text_atomic
from trtllm_dflash.parallel.world import World, cuda_device_index
from trtllm_dflash.runtime.decoding import Decoder, Mode, Request, Result
from trtllm_dflash.runtime.executor import CudaGraphsError, Executor, TorchExecutor, engine_specs
from trtllm_dflash.runtime.kv_blocks import STATIC_KV, KVBudgetError, available_memory, is_fraction, resolve_budget
from trtllm_dflash.runtime.verify import AutoBlock, FixedBlock, PlainDecoding, TreeDrafting, VerifyPolicy
from trtllm_dflash.runtime.jsonl import Defaults, read_requests, result_record, summarize
from trtllm_dflash.runtime.lockstep import LockstepDriver, Rank0Chooses, follow
from trtllm_dflash.runtime.costs import cached_costs, measure, measure_and_cache, read_acceptance, write_acceptance
from trtllm_dflash.runtime.options import BlockSize, RunOptions
from trtllm_dflash.runtime.textstream import TextStream
from trtllm_dflash.speculative.core import request_seed
from trtllm_dflash.speculative.schedule import AcceptanceEstimate, AutoBlockSize
from trtllm_dflash.stats import acceptance_length_from_totals, mean_acceptance_length

TP_COMMANDS = ("run", "serve")  # the commands that run tensor-parallel engines under mpirun


@dataclass
class Engine:
    """A loaded engine (this rank's shard of it under tensor parallelism): config, tokenizer, torch executor."""

    config: EngineConfig
    tokenizer: object
    executor: TorchExecutor
    auto_block: AutoBlockSize | None = None  # with --block-size auto: pass costs + acceptance, for every decoder
    world: World = field(default_factory=World)  # this rank's place in a tensor-parallel job

    @classmethod
    def load(cls, root: Path, device: str = "cpu", block_size: BlockSize | None = None,
             world: World | None = None, command: str = "run", backend: Backend | None = None,
             plugin_library: Path | None = None, report: Callable[[str], None] = lambda line: None,
             threads: int | None = None, cuda_graphs: bool | None = None,
             kv_cache_memory: str | None = None, prefix_cache: bool = True, tree_budget: int | None = None,
             prefix_states: int | None = None) -> "Engine":
        """`block_size`: draft this many tokens per block (2 .. the trained block size); default: trained;
        "auto": each step chooses how many of the trained block's tokens to verify (the pass costs are measured
        here, or read from the cache: runtime/costs.py; `report` hears about it).
        `backend`: the executor (default: what the engine was compiled for); `plugin_library`: the TensorRT
        plugin library the plans were compiled with, if any. `threads`: CPU threads for this rank's passes (torch's
        and onnxruntime's; default: cpu_threads' choice on the CPU, torch's own elsewhere). `cuda_graphs`: the torch
        executor's decode passes as CUDA graphs (runtime/cuda_graphs.py; None: on where the device is CUDA, the
        target's passes can be captured there, models/moe.py experts_graph_problem, and tp_size is 1), or the tensorrt
        executor's decode-step plan calls (runtime/plan_graphs.py; None: on at tp_size 1); True is refused where they
        cannot run. `kv_cache_memory`: a paged KV cache of this size ('512MiB', '2GiB', bytes, or a fraction of the free
        memory such as '0.5') for the torch executor (runtime/kv_blocks.py; default: the engine's kv_cache_memory, else
        a static max_seq_len slot per request; 'static': the static slots whatever the engine says); for the compiled
        executors, whose rows are static, the rows' and their prefix pool's memory together (cache_rows.StaticRows);
        `prefix_cache`: with it, prompt blocks shared across requests by prefix (a paged cache's blocks; the compiled
        executors' static rows copy them from a pool: runtime/cache_rows.PrefixRows). `prefix_states`: how many of a
        hybrid target's recurrent states the prefix cache keeps (runtime/prefix_states.py; default: one per request
        slot), counted in kv_cache_memory.
        `tree_budget`: dflash steps verify a DDTree of that many draft nodes (speculative/tree.py; torch executor,
        targets without sliding windows or Gated DeltaNet layers).

        Under MPI (`world`), each rank verifies and reads only its own rank file, and `auto`'s costs are left to the
        caller (`prepare`: load_auto_block, whose passes are collective, once every rank has loaded). `command` names
        the CLI command in errors; commands other than run and serve have no tensor-parallel mode."""
        root, world = Path(root), world or World()
        cfg = open_engine(root, rank=world.rank)
        if threads or device == "cpu":
            torch.set_num_threads(threads or cpu_threads(root / rank_file(world.rank), world.size))
        auto = block_size == "auto"
        backend = backend or cfg.backend
        if auto:
            block_size = None
        if block_size is not None and not 2 <= block_size <= cfg.dflash.block_size:
            raise UserError(f"--block-size {block_size}: must be between 2 and the engine's trained block_size "
                            f"{cfg.dflash.block_size}.")
        tp = cfg.mapping.tp_size
        if tp > 1 and command not in TP_COMMANDS:
            raise UserError(f"{root}: `{command}` runs in one process and this engine is split for tp_size {tp}; "
                            f"build it with tp_size 1 for {command}, or use `mpirun -n {tp} trtllm-dflash run`.")
        if tp != world.size:
            how = f"mpirun -n {tp} trtllm-dflash run ..." if tp > 1 else "trtllm-dflash run ... (without mpirun)"
            raise UserError(f"{root}: the engine is split for tp_size {tp} but this run has {world.size} "
                            f"process{'es' if world.size > 1 else ''}; start it as `{how}`.")
        if cuda_graphs:
            _check_cuda_graphs(cfg, backend, device)
        if tree_budget is not None:
            check_tree(cfg, backend, tree_budget, auto)
            cuda_graphs = False
        if kv_cache_memory is None:  # the engine's default (its build config), if any
            kv_cache_memory = cfg.kv_cache_memory
        if kv_cache_memory is not None:
            kv_cache_memory = str(kv_cache_memory)
        if kv_cache_memory == STATIC_KV:
            kv_cache_memory = None
        if prefix_states is not None:
            check_prefix_states(cfg, backend, prefix_states, prefix_cache, kv_cache_memory)
        kv_bytes = _kv_budget(kv_cache_memory, device) if kv_cache_memory is not None else None
        try:
            if backend == "onnxruntime":
                from trtllm_dflash.runtime.onnxruntime_executor import OnnxRuntimeExecutor

                executor = OnnxRuntimeExecutor.from_engine(root, cfg, world.rank, block_size, threads=None,
                                                           device=device, tree_budget=tree_budget or 0,
                                                           prefix_cache=prefix_cache, kv_cache_memory=kv_bytes,
                                                           prefix_states=prefix_states)
            elif backend == "tensorrt":
                from trtllm_dflash.runtime.tensorrt_executor import TensorRTExecutor

                executor = TensorRTExecutor.from_engine(root, cfg, world.rank, block_size, plugin_library,
                                                        prefix_cache, kv_bytes, cuda_graphs, report, auto=auto,
                                                        prefix_states=prefix_states)
            else:
                executor = TorchExecutor.from_engine(root, cfg, world.rank, world.tp, device, block_size, cuda_graphs,
                                                     kv_bytes, prefix_cache, tree_budget or 0, prefix_states)
        except KVBudgetError as e:
            raise UserError(f"--kv-cache-memory {kv_cache_memory}: {e}.") from None
        except CudaGraphsError as e:  # (where the loaded target's passes cannot be captured)
            raise UserError(f"--cuda-graphs: {e}") from None
        if executor.num_slots < cfg.max_batch_size:  # (the compiled executors' static rows: cache_rows.StaticRows)
            report(f"--kv-cache-memory {kv_cache_memory}: {executor.num_slots} of the engine's {cfg.max_batch_size} "
                   "request rows (max_batch_size) fit; further requests wait for a free row.")
        engine = cls(cfg, load_tokenizer(root / TOKENIZER), executor, world=world)
        if auto and world.size == 1:  # (under tensor parallelism prepare does it, once every rank has loaded)
            engine.auto_block = load_auto_block(root, executor, backend, tree_budget or 0, world, report)
        return engine

    def decoder(self, mode: Mode, stop_token_ids: tuple[int, ...] = (), block_size: BlockSize | None = None
                ) -> Decoder:
        """A decoder that stops at the engine's EOS ids, `stop_token_ids` and requests' stop strings (found with the
        engine's tokenizer). `block_size` (dflash): tokens per block, up to the executor's, or "auto" on an engine
        loaded with it (default: what the engine was loaded with), so one loaded engine serves every policy.
        Decoders of one engine share its acceptance estimate (--block-size auto), so each starts from what the
        previous ones saw."""
        eos = [*self.config.eos_token_ids, *stop_token_ids]
        if mode == "ar":
            policy: VerifyPolicy = PlainDecoding()
        elif isinstance(block_size, str) and block_size.startswith("tree"):  # bench's treeN
            budget = int(block_size[4:])
            if budget > getattr(self.executor, "tree_budget", 0):
                raise UserError(f"{block_size}: this engine was loaded for trees of at most "
                                f"{getattr(self.executor, 'tree_budget', 0)} nodes.")
            policy = TreeDrafting(budget)
        elif block_size is None and getattr(self.executor, "tree_budget", 0) and self.auto_block is None:
            policy = TreeDrafting(self.executor.tree_budget)
        elif block_size == "auto" or (block_size is None and self.auto_block is not None):
            if self.auto_block is None:
                raise UserError("--block-size auto: this engine was loaded without it; load it with block_size 'auto'.")
            policy = AutoBlock(self.auto_block)
            if self.world.size > 1:  # every rank must verify the k that rank 0's timings chose
                policy = Rank0Chooses(policy, leader=self.world.rank == 0)
        else:
            k = block_size or self.executor.block_size
            if not 2 <= k <= self.executor.block_size:
                raise UserError(f"--block-size {k}: must be between 2 and the engine's trained block_size "
                                f"{self.executor.block_size}.")
            policy = FixedBlock(k)
        return Decoder(self.executor, policy, eos, self.tokenizer)


def load_auto_block(root: Path, executor: Executor, backend: str, tree_budget: int, world: World,
                    report: Callable[[str], None] = lambda line: None) -> AutoBlockSize:
    """--block-size auto's cost model and acceptance estimate for `executor`: the pass costs cached for this machine
    and backend, or measured now, and the acceptance the last run recorded. Under tensor parallelism every rank calls
    it, once all have loaded (the passes it may time are collective): rank 0 reads the cache; when it has to measure,
    every rank times the same passes with it; every rank gets rank 0's costs and prior, and only rank 0 records what
    the run accepts (the choices are rank 0's too: Rank0Chooses)."""
    positions = executor.block_size - 1
    # (the cached costs, if any, and the last run's rates, if any)
    costs, prior = world.from_rank0(lambda: (cached_costs(root, executor, backend, report=report)[0],
                                             read_acceptance(root, positions)))
    if costs is None:
        measured = measure_and_cache(root, executor, backend, report) if world.rank == 0 else measure(executor)
        costs = world.from_rank0(lambda: measured)
    record = (lambda rates: write_acceptance(root, rates)) if world.rank == 0 else None
    return AutoBlockSize(costs, executor.block_size, AcceptanceEstimate(positions, prior=prior), record=record,
                         tree_budget=tree_budget)


# --tree-budget's range: a tree of more nodes than this verifies more positions than any block drafts usefully
MAX_TREE_BUDGET = 1024


def check_tree(cfg: EngineConfig, backend: Backend, budget: int, auto: bool) -> None:
    """--tree-budget: one sentence where a tree cannot run (Engine.load, and `serve` before it writes the
    repository). The rings of an onnxruntime engine's sliding-window layers are checked when its executor loads."""
    if type(budget) is not int or not 1 <= budget <= MAX_TREE_BUDGET:
        raise UserError(f"--tree-budget {budget}: must be an integer from 1 to {MAX_TREE_BUDGET}.")
    if backend == "tensorrt":
        raise UserError("--tree-budget: the tensorrt executor does not verify draft trees yet; drop --tree-budget or "
                        "use --backend torch or onnxruntime.")
    target, _, params = engine_specs(cfg)
    if auto and budget >= params.block_size:
        raise UserError(f"a tree budget of {budget} (--tree-budget, bench's treeN) with --block-size auto: auto prices "
                        f"trees of at most block_size - 1 = {params.block_size - 1} nodes (a verify pass no longer than "
                        "the block whose costs it measured).")
    if params.dflash2 is not None:
        raise UserError("--tree-budget: this engine's drafter is DFlash2, whose candidate selector walks one chain of "
                        "drafts (a tree of it is not defined yet); drop --tree-budget.")
    if target.has_recurrent_state and backend != "torch":
        raise UserError(f"--tree-budget: this engine's {target.model_type} target has Gated DeltaNet layers, whose "
                        f"trees run on the torch executor only (each node's state follows its own path); use --backend "
                        f"torch, or drop --tree-budget.")


def check_prefix_states(cfg: EngineConfig, backend: Backend, count: int, prefix_cache: bool,
                        kv_cache_memory: str | None) -> None:
    """--prefix-states: one sentence where no recurrent state would be kept (Engine.load, and `serve` before it writes
    the repository)."""
    what = f"--prefix-states {count}"
    if type(count) is not int or count < 1:
        raise UserError(f"{what}: must be a positive integer.")
    target, _, _ = engine_specs(cfg)
    if not target.has_recurrent_state:
        raise UserError(f"{what}: this engine's {target.model_type} target has no recurrent states to keep (only "
                        "Gated DeltaNet layers, as Qwen3.5's, do); drop --prefix-states.")
    if not prefix_cache:
        raise UserError(f"{what}: the states are kept for prefix reuse, which --no-prefix-cache turns off; drop one.")
    if backend == "torch" and kv_cache_memory in (None, STATIC_KV):
        raise UserError(f"{what}: the torch executor reuses prefixes in its paged cache only; give --kv-cache-memory "
                        "SIZE too.")


def _kv_budget(text: str, device: str) -> int | Callable[[], int]:
    """--kv-cache-memory's bytes, or one sentence saying why not. A fraction ('0.9') is of the memory free once the
    weights are loaded (TensorRT-LLM's free_gpu_memory_fraction; the compiled executors: once their static rows are
    allocated too, for their prefix pool): its form is checked now, and the executor calls the function returned to
    read the free memory then."""
    def resolve() -> int:
        available = (torch.cuda.mem_get_info(torch.device(device))[0] if str(device).startswith("cuda")
                     else available_memory())
        try:
            return resolve_budget(text, available)
        except ValueError as e:
            raise UserError(f"--kv-cache-memory {text}: {e}.") from None

    bytes_now = resolve()  # (refused now if it is not a size or a fraction, or more than is free)
    return resolve if is_fraction(text) else bytes_now


def _check_cuda_graphs(cfg: EngineConfig, backend: Backend, device: str) -> None:
    """--cuda-graphs runs where the torch executor can capture its decode passes, or the tensorrt executor its plans'
    (which always run on a GPU)."""
    if backend == "onnxruntime":
        raise UserError("--cuda-graphs: the onnxruntime executor does not capture CUDA graphs; drop --cuda-graphs or "
                        "use --backend torch or tensorrt.")
    if backend == "tensorrt":  # (the plans' experts are in their dense form: no data-dependent shapes)
        if cfg.mapping.tp_size > 1:
            raise UserError(f"--cuda-graphs: the tensorrt executor does not capture its plans under tensor parallelism "
                            f"yet (this engine has tp_size {cfg.mapping.tp_size}: the plans' DistCollective layers "
                            "inside a capture were never tried); drop --cuda-graphs or use --backend torch.")
        return
    if not str(device).startswith("cuda"):
        raise UserError("--cuda-graphs needs --device cuda (CUDA graphs are a GPU feature; on the CPU the passes run "
                        "eagerly).")


# Below this many bytes of weights per rank, a CPU pass's matrix products are too small to share among threads:
# OpenMP's fork/join and spin-waits cost more than they save, and when other processes share the cores the threads
# wait on one another. Measured on the demo engine (36 MB, 2 cores; benchmarks/threads_under_load.py,
# benchmarks/results/threads_under_load.json): 1 thread gave 1.6x / 1.15x torch's default tokens/s for AR / DFlash
# on a quiet machine, 3.4x / 5.8x with two busy processes beside it. Larger models keep one thread per core (not
# measured here: our machines fit no model large enough to show where the crossover is).
SMALL_MODEL_BYTES = 256 * 2**20


def cpu_threads(rank_file_path: Path, ranks: int) -> int:
    """CPU threads for one rank's passes when none were asked for: 1 for a small model, else this process's CPUs
    shared out among the ranks of the job (ranks on one machine share its cores)."""
    if rank_file_path.stat().st_size < SMALL_MODEL_BYTES:
        return 1
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def _device(opts: RunOptions, world: World) -> str:
    if opts.device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible to torch on this machine.")
    return f"cuda:{cuda_device_index(world.local_rank, torch.cuda.device_count())}"


def prepare(engine_dir: Path, opts: RunOptions, world: World, input_path: Path | None = None,
            outputs: dict[str, Path | None] | None = None) -> tuple[Engine, Decoder]:
    """Every rank: load its shard and check the options; rank 0 also checks the input file and the
    `outputs` (option -> path) before anything is loaded. Errors are agreed on by all ranks."""

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def load() -> Engine:
        if world.rank == 0:
            if input_path is not None:
                require_file(input_path, "input file")
            check_output_files(outputs or {}, inputs=(engine_dir, input_path))
        engine = Engine.load(engine_dir, _device(opts, world), opts.block_size, world, backend=opts.backend,
                             report=report, threads=opts.threads, cuda_graphs=opts.cuda_graphs,
                             kv_cache_memory=opts.kv_cache_memory, prefix_cache=opts.prefix_cache,
                             tree_budget=opts.tree_budget, prefix_states=opts.prefix_states)
        bad = [t for t in opts.stop_token_ids if not 0 <= t < engine.executor.vocab_size]
        if bad:
            raise UserError(f"--stop-token-ids: {bad[0]} is outside the vocabulary 0..{engine.executor.vocab_size - 1}.")
        return engine

    engine = world.agree(load)
    if opts.block_size == "auto" and world.size > 1:  # (collective: once every rank has loaded)
        engine.auto_block = load_auto_block(engine_dir, engine.executor, opts.backend or engine.config.backend,
                                            opts.tree_budget or 0, world, report)
    return engine, engine.decoder(opts.mode, opts.stop_token_ids)


# What a result line must share with this run's request of the same id for --resume to keep it.
RESUME_KEYS = ("mode", "max_new_tokens", "temperature", "seed", "top_k", "top_p", "stop", "num_prompt_tokens")


@dataclass(frozen=True)
class Resumed:
    done: frozenset  # ids whose results are already in the file
    complete_bytes: int  # length of the file up to its last complete line (a crash can cut the last one short)


def resumable(output_path: Path, requests: list[Request], mode: str) -> Resumed:
    """Check, without changing it, that `output_path` holds only lines this very run would have written.

    Every complete line must be a result of one of `requests` made with the same settings (RESUME_KEYS),
    each id at most once; anything else is refused, so results of different runs never mix."""
    path = Path(output_path)
    if not path.is_file():
        return Resumed(frozenset(), 0)
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]  # everything up to the last complete line
    expected = {r.id: {"mode": mode, "max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
                       "seed": r.seed, "top_k": r.top_k, "top_p": r.top_p, "stop": list(r.stop),
                       "num_prompt_tokens": len(r.prompt_token_ids)} for r in requests}
    done = set()
    for line in decode_lines(complete):
        where = f"{path}:{line.number}"
        if line.text is None:
            raise UserError(f"{where}: {line.error}; cannot --resume from this file.")
        try:
            record = loads(line.text)
            rid = record["id"]
            settings = {k: record[k] for k in RESUME_KEYS}
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{where}: not a result line of `run`; cannot --resume from this file.") from None
        if rid not in expected:
            raise UserError(f"{where}: id {shown(rid)} is not a request of this input; cannot --resume from this file.")
        if rid in done:
            raise UserError(f"{where}: id {shown(rid)} appears twice; cannot --resume from this file.")
        changed = [k for k in RESUME_KEYS if settings[k] != expected[rid][k]]
        if changed:
            raise UserError(f"{where}: written with another {changed[0]} ({shown(settings[changed[0]])}, this run: "
                            f"{shown(expected[rid][changed[0]])}); resume with the same options, or use another --output.")
        done.add(rid)
    return Resumed(frozenset(done), len(complete))


@contextmanager
def open_results(output_path: Path, resumed: Resumed | None) -> Iterator[TextIO]:
    """Where results are written line by line, flushed as they finish.

    A new file is written in place (an interrupted run leaves its finished lines for --resume); an
    existing file is appended to when resuming (after dropping a line cut short), and otherwise replaced
    atomically when the run ends, so a failed run never destroys the previous results."""
    path = Path(output_path)
    if resumed is None and path.exists():
        try:
            with atomic_file(path) as out:
                yield out
        except KeyboardInterrupt:
            raise Interrupted(f"{path} is left as it was (results are replaced only when a run completes)") from None
        return
    try:
        if resumed is not None and path.exists():
            if path.stat().st_size != resumed.complete_bytes:
                os.truncate(path, resumed.complete_bytes)
            mode = "a"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            mode = "w"
        with path.open(mode, encoding="utf-8") as out:
            yield out
    except OSError as exc:
        if not is_user_os_error(exc):
            raise
        raise UserError(f"{path}: {reason(exc)} while writing results; the lines written so far are kept (fix it, "
                        "then run again with --resume).") from None
    except KeyboardInterrupt:
        raise Interrupted(f"the results finished so far are in {path} (run again with --resume to finish)") from None


def run_jsonl(engine_dir: Path, input_path: Path, output_path: Path, summary_path: Path | None,
              opts: RunOptions, world: World | None = None) -> int:
    """The `run` command: returns the number of bad input lines (reported on stderr). Every rank calls it."""
    world = world or World()
    engine, decoder = prepare(engine_dir, opts, world, input_path, {"--output": output_path, "--summary": summary_path})
    if world.rank != 0:
        follow(decoder)
        return 0
    driver = LockstepDriver(decoder) if world.size > 1 else decoder
    try:
        return _run_rank0(engine, driver, input_path, output_path, summary_path, opts)
    finally:
        if world.size > 1:
            driver.close()


def _run_rank0(engine: Engine, driver, input_path: Path, output_path: Path, summary_path: Path | None,
               opts: RunOptions) -> int:
    cfg = engine.config
    defaults = Defaults(opts.max_new_tokens, opts.temperature, opts.seed, cfg.max_seq_len, engine.executor.vocab_size)
    requests, errors = read_requests(input_path, engine.tokenizer, defaults)
    for err in errors:
        print(f"{input_path}:{err.line}: {err.message}; line skipped.", file=sys.stderr)
    output_path = Path(output_path)
    if not requests:  # every line bad: a run of nothing must not replace earlier results with an empty file
        lines = "its one line is not" if len(errors) == 1 else f"none of its {len(errors)} lines is"
        raise UserError(f"{input_path}: {lines} a valid request (reported above); {output_path} is left as it was.")
    resumed = resumable(output_path, requests, opts.mode) if opts.resume else None
    done = resumed.done if resumed else frozenset()
    todo = [r for r in requests if r.id not in done]
    if done:
        print(f"--resume: {len(requests) - len(todo)} of {len(requests)} requests already in {output_path}; "
              f"running {len(todo)}.", file=sys.stderr)
    results: list[Result] = []
    show = sys.stderr.isatty() if opts.progress is None else opts.progress
    start = time.perf_counter()
    with open_results(output_path, resumed) as out, RunProgress(len(todo), show) as progress:
        for result in driver.generate(todo):
            results.append(result)
            out.write(json.dumps(result_record(result, engine.tokenizer, opts.mode)) + "\n")
            out.flush()
            progress.update(result, time.perf_counter() - start)
    wall = time.perf_counter() - start
    mode = opts.mode
    summary = summarize(mode, results, wall, engine.executor.block_size)
    summary["num_failed"] = len(errors)
    summary["num_skipped_resumed"] = len(requests) - len(todo)
    preemptions = getattr(driver, "decoder", driver).preemptions
    summary["num_preemptions"] = preemptions  # requests whose KV blocks were taken back (runtime/decoding.py)
    if summary_path is not None:
        write_text_atomic(Path(summary_path), json.dumps(summary, indent=2) + "\n")
    short = (f"; {preemptions} preemption{'' if preemptions == 1 else 's'} (requests recomputed when the KV cache ran "
             f"out of blocks: a larger --kv-cache-memory avoids them)") if preemptions else ""
    print(f"{mode}: {summary['num_requests']} requests, {summary['num_output_tokens']} output tokens in "
          f"{wall:.2f} s ({summary['output_tokens_per_s']} tokens/s), mean acceptance length "
          f"{summary['mean_acceptance_length']:.2f}{short}; results in {output_path}", file=sys.stderr)
    return len(errors)


class RunProgress:
    """Live `requests done/total, output tokens/s, mean acceptance length` on stderr (rich), when shown."""

    def __init__(self, total: int, show: bool):
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                             console=Console(stderr=True), disable=not show, transient=True)
        self._task = self._bar.add_task("requests", total=total, stats="")
        self._tokens = self._steps = self._committed = 0

    def update(self, result: Result, elapsed: float) -> None:
        self._tokens += len(result.output_token_ids)
        self._steps += len(result.acceptance_lengths)
        self._committed += sum(result.acceptance_lengths)
        # No AL on the live line before the first verify step (in ar mode: never)
        al = f", AL {acceptance_length_from_totals(self._committed, self._steps):.2f}" if self._steps else ""
        self._bar.update(self._task, advance=1, stats=f"{self._tokens / max(elapsed, 1e-9):.1f} tok/s{al}")

    def __enter__(self) -> "RunProgress":
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)


def stream(engine_dir: Path, prompt: str, opts: RunOptions, world: World | None = None,
           out: TextIO | None = None) -> int:
    """`run --stream PROMPT`: print each completion's text as its tokens are committed.

    PROMPT '-' reads prompts from stdin, one per line, and streams them one after another; a line that
    is not valid UTF-8 is reported and skipped. Returns the number of skipped lines."""
    out, world = out or sys.stdout, world or World()
    engine, decoder = prepare(engine_dir, opts, world)
    if world.rank != 0:
        follow(decoder)
        return 0
    driver = LockstepDriver(decoder) if world.size > 1 else decoder
    tok = engine.tokenizer
    bad_lines = []

    def stdin_prompts() -> Iterator[str]:
        for number, raw in enumerate(sys.stdin.buffer, start=1):  # line by line: prompts are typed as we go
            for line in decode_lines(raw.removesuffix(b"\n")):
                if line.text is None:
                    print(f"<stdin>:{number}: {line.error}; line skipped.", file=sys.stderr, flush=True)
                    bad_lines.append(number)
                else:
                    yield line.text

    prompts = stdin_prompts() if prompt == "-" else iter([prompt])
    try:
        for n, text in enumerate(p for p in prompts if p.strip()):
            try:
                check_prompt_chars(tok, len(text), engine.config.max_seq_len, "the prompt")
            except ValueError as exc:
                raise UserError(f"--stream: {exc}.") from None
            ids = tok(text)["input_ids"]
            request = Request(n, ids, opts.max_new_tokens, opts.temperature, request_seed(opts.seed, str(n)))
            try:
                driver.submit(request)
            except ValueError as exc:
                raise UserError(str(exc) + ".") from None
            text_out = TextStream(tok)
            while driver.has_work:
                for update in driver.step():
                    out.write(text_out.push(update.new_token_ids))
                    out.flush()
                    if update.result is not None:
                        r = update.result
                        al = mean_acceptance_length(r.acceptance_lengths)
                        out.write(text_out.finish() + "\n")
                        print(f"[{len(r.output_token_ids)} tokens, {r.finish_reason}, TTFT {r.ttft_s * 1e3:.0f} ms, "
                              f"TPOT {(r.tpot_s or 0) * 1e3:.1f} ms, mean acceptance length {al:.2f}]", file=sys.stderr)
    finally:
        if world.size > 1:
            driver.close()
    return len(bad_lines)
