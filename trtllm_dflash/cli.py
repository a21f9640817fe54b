"""`trtllm-dflash`: each subcommand parses its arguments, then makes one library call.

Nothing here imports torch or transformers at module level: `--help` and `--version` answer at once,
and each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading
from pathlib import Path

from trtllm_dflash import __version__
from trtllm_dflash.errors import Interrupted, UserError
from trtllm_dflash.inputs import argv_text, shown
from trtllm_dflash.outputs import is_user_os_error, reason, release_outputs, user_os_error
from trtllm_dflash.runtime.options import MAX_TEMPERATURE, RunOptions, check_tree_options

EXIT_USER_ERROR = 2  # bad config / checkpoint / engine / path: nothing was produced
EXIT_BAD_LINES = 1  # `run` finished, but some input lines were rejected
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports a command that SIGINT ended: 128 + 2
MAX_SEED = 2**63 - 1


def _int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be an integer from {low} to {high}, got {text}" if high is not None
                else f"must be an integer >= {low}, got {text}")
        return value

    return parse


_positive_int = _int_in(1)
_non_negative_int = _int_in(0)
_seed = _int_in(0, MAX_SEED)
_port = _int_in(1, 65535)


def _threads(text: str) -> int:
    """Torch CPU threads: 1 .. the CPUs this process may use (far more threads crash torch's thread pool)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return _int_in(1, cpus)(text)


def _temperature(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 <= value <= MAX_TEMPERATURE):
        raise argparse.ArgumentTypeError(f"must be a number from 0 to {MAX_TEMPERATURE:g}, got {text}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default in one format, `(default: X)`; help strings of options whose
    default is computed (None) say it in the same words themselves."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("(default:" in text or not action.option_strings or default is None or default is False
                or default == argparse.SUPPRESS
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        value = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)
        return f"{text} (default: {value.replace('%', '%%')})".strip()


def cmd_build(args: argparse.Namespace) -> int:
    from trtllm_dflash.config import load_build_config
    from trtllm_dflash.engine.builder import build_engine

    cfg = load_build_config(args.config, output=args.output)
    out = build_engine(cfg, force=args.force, progress=sys.stderr.isatty(), config_file=args.config,
                       report=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"engine written to {out}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from trtllm_dflash.parallel.world import AgreedError, init_world
    from trtllm_dflash.runtime.runner import run_jsonl, stream

    if args.stream is None and (args.input is None or args.output is None):
        raise UserError("run needs --input and --output (or --stream PROMPT for interactive use).")
    if args.stream is not None and (args.input or args.output or args.resume):
        raise UserError("--stream prints to the terminal; it does not take --input, --output or --resume.")
    if args.stream is not None and not argv_text(args.stream, "--stream").strip():
        raise UserError("--stream: the prompt is empty; give the text to complete, or - to read prompts from stdin.")
    opts = RunOptions(args.mode, args.max_new_tokens, args.temperature, args.seed, tuple(args.stop_token_ids),
                      args.threads, args.block_size, args.device, args.resume, args.progress, args.backend,
                      args.cuda_graphs, args.kv_cache_memory, args.prefix_cache, args.tree_budget, args.prefix_states)
    check_tree_options(args.tree_budget, args.mode, args.block_size)
    world = init_world("nccl" if args.device == "cuda" else "gloo")
    try:
        if args.stream is not None:
            code = EXIT_BAD_LINES if stream(args.engine_dir, args.stream, opts, world) else 0
        else:
            code = EXIT_BAD_LINES if run_jsonl(args.engine_dir, args.input, args.output, args.summary, opts, world) else 0
        world.close()
        return code
    except UserError as exc:
        if world.size > 1 and not isinstance(exc, AgreedError):
            world.abort(str(exc), EXIT_USER_ERROR)  # one rank failed alone: end them all
        raise
    except Exception as exc:
        if world.size > 1:  # never leave the other ranks waiting on a collective
            world.abort(f"{type(exc).__name__}: {exc}")
        raise


def cmd_compile(args: argparse.Namespace) -> int:
    from trtllm_dflash.compile.tensorrt_build import compile_engine
    from trtllm_dflash.outputs import check_output_dir

    # compile rewrites ENGINE_DIR (a new directory renamed over it): the output-path rule, ENGINE_DIR as the output
    check_output_dir(args.engine_dir, "engine", "ENGINE_DIR", inputs=(args.plugin_library,), force=True)
    plans = compile_engine(args.engine_dir, args.plugin_library,
                           report=lambda line: print(line, file=sys.stderr, flush=True), experts=args.experts)
    print(f"{len(plans)} TensorRT plans added to {args.engine_dir}", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from trtllm_dflash.engine.inspect import inspect_engine

    inspect_engine(args.engine_dir)
    return 0


def cmd_export_trtllm(args: argparse.Namespace) -> int:
    from trtllm_dflash.export.trtllm import export_trtllm

    out = export_trtllm(args.engine_dir, args.output, args.force,
                        report=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"TensorRT-LLM directory written to {out} (commands: {out / 'README.md'})", file=sys.stderr)
    return 0


def cmd_make_random_pair(args: argparse.Namespace) -> int:
    from trtllm_dflash.outputs import atomic_directory
    from trtllm_dflash.train.random_pair import write_random_pair

    with atomic_directory(args.output, "random pair", args.force) as tmp:
        write_random_pair(tmp, args.family, block_size=args.block_size, seed=args.seed,
                          dflash2=args.drafter_arch == "dflash2")
    print(f"random target written to {args.output / 'target'}, drafter to {args.output / 'drafter'}", file=sys.stderr)
    return 0


def cmd_convert_drafter(args: argparse.Namespace) -> int:
    from trtllm_dflash.checkpoint.speculators import convert_to_speculators

    if args.vocab_text and args.prune_vocab is None:
        raise UserError("--vocab-text chooses the tokens --prune-vocab keeps; give --prune-vocab N too.")
    size = convert_to_speculators(args.drafter, args.target, args.output, args.prune_vocab, args.vocab_text,
                                  args.force)
    print(f"{args.to} drafter written to {args.output} (draft_vocab_size {size})", file=sys.stderr)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from trtllm_dflash.train.config import TrainConfig
    from trtllm_dflash.train.drafter import train_drafter

    fields = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__}
    fields["target_layer_ids"] = tuple(args.target_layer_ids) if args.target_layer_ids else None
    try:
        state = train_drafter(args.target, args.data, args.output, TrainConfig(**fields), progress=sys.stderr.isatty())
    except KeyboardInterrupt:
        raise Interrupted(f"what {args.output} holds so far (the target's responses once generated, the last "
                          "checkpoint) is kept, and the same command resumes from it") from None
    except OSError as exc:
        if not is_user_os_error(exc):
            raise
        raise UserError(f"--output {args.output}: {reason(exc)} while writing {exc.filename or 'it'}; what it holds "
                        "so far is kept, and the same command resumes from it once that is fixed.") from None
    last = state.evals[-1]["acceptance_length"] if state.evals else None
    print(f"drafter written to {args.output} after {state.step} steps; final loss {state.losses[-1]:.4f}, "
          f"held-out acceptance length {last}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from trtllm_dflash.bench.options import BenchOptions
    from trtllm_dflash.bench.report import bench_command, profile_command

    if args.profile:
        profile_command(args.engine_dir, args.threads, args.backend)
        return 0
    if args.dataset is None:
        raise UserError("bench needs --dataset (or --profile to only measure the pass costs).")
    opts = BenchOptions(args.concurrency, args.modes, args.block_sizes, args.num_requests, args.max_new_tokens,
                        args.warmup, args.repeats, args.threads, args.backend, args.kv_cache_memory,
                        args.prefix_cache, args.system_prompt, args.multi_turn, args.prefix_states)
    bench_command(args.engine_dir, args.dataset, opts, args.report_json, args.plot)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from trtllm_dflash.runtime.report import compare_and_print

    check_tree_options(args.tree_budget, "dflash", args.block_size)
    compare_and_print(args.engine_dir, args.input, args.num_prompts, args.max_new_tokens, args.show,
                      args.repeats, args.threads, args.block_size, args.backend, args.tree_budget)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from trtllm_dflash.serve import Endpoints, ServeConfig, serve
    from trtllm_dflash.serve.tensor_parallel import check_launch, serve_under_mpi

    cfg = ServeConfig(engine_dir=str(args.engine_dir.absolute()), mode=args.mode, block_size=args.block_size,
                      max_batch_size=args.max_batch_size, max_new_tokens=args.max_new_tokens, seed=args.seed,
                      threads=args.threads, backend=args.backend, kv_cache_memory=args.kv_cache_memory,
                      prefix_cache=args.prefix_cache, tree_budget=args.tree_budget, prefix_states=args.prefix_states)
    endpoints = Endpoints(args.host, args.http_port, args.grpc_port, args.metrics_port) if args.launch else None

    engine = check_launch(cfg, args.launch)

    def serve_here() -> int:
        return serve(args.model_repo, args.model_name, cfg, engine, not args.no_streaming, args.force, endpoints)

    if engine.mapping.tp_size > 1:  # under `mpirun -n N`: rank 0 serves, the others follow
        return serve_under_mpi(cfg, serve_here)
    return serve_here()


def _add_serve(sub) -> None:
    from trtllm_dflash.serve.launch import Endpoints
    from trtllm_dflash.serve.repository import ServeConfig

    d, e = ServeConfig(engine_dir=""), Endpoints()
    s = sub.add_parser("serve", formatter_class=_HelpFormatter,
                       help="write a Triton model repository for an engine (and start tritonserver on it)",
                       description="Writes MODEL_REPO/NAME (config.pbtxt, 1/model.py for Triton's Python backend, "
                                   "1/serve.json); with --launch, starts tritonserver on it and runs until stopped.")
    s.add_argument("engine_dir", type=Path)
    s.add_argument("--model-repo", type=Path, required=True,
                   help="Triton model repository directory to write (new, empty, or written by serve before)")
    s.add_argument("--model-name", default="trtllm_dflash", help="model name in the repository")
    s.add_argument("--force", action="store_true", help="replace a --model-repo that trtllm-dflash serve wrote")
    s.add_argument("--no-streaming", action="store_true",
                   help="a non-decoupled model: one response per request, for Triton's plain infer over HTTP and "
                        "gRPC (default: decoupled, streaming over gRPC streams and HTTP generate_stream)")
    s.add_argument("--mode", choices=("dflash", "ar"), default=d.mode, help="decoding mode")
    s.add_argument("--block-size", type=_block_size, help=BLOCK_SIZE_HELP)
    s.add_argument("--max-batch-size", type=_positive_int,
                   help="requests decoded together, up to the engine's (default: the engine's)")
    s.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens,
                   help="when a request has no sampling_param_max_tokens")
    s.add_argument("--seed", type=_seed, default=d.seed, help="when a request has no sampling_param_seed")
    s.add_argument("--threads", type=_threads, help="CPU threads, up to the CPUs (default: 1 for a model under 256 MB a rank, else the CPUs "
                   "shared among the ranks)")
    s.add_argument("--kv-cache-memory", metavar="SIZE", help=KV_CACHE_MEMORY_HELP)
    s.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True, help=PREFIX_CACHE_HELP)
    s.add_argument("--prefix-states", type=_positive_int, metavar="N", help=PREFIX_STATES_HELP)
    s.add_argument("--tree-budget", type=_int_in(1, 1024), metavar="N", help=TREE_BUDGET_HELP)
    _add_backend(s)
    s.add_argument("--launch", action="store_true", help="start tritonserver on the repository")
    s.add_argument("--host", default=e.host, help="address the endpoints bind to")
    s.add_argument("--http-port", type=_port, default=e.http_port, help="HTTP endpoint")
    s.add_argument("--grpc-port", type=_port, default=e.grpc_port, help="gRPC endpoint")
    s.add_argument("--metrics-port", type=_port, default=e.metrics_port, help="Prometheus metrics endpoint")
    s.set_defaults(func=cmd_serve)


def _add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("torch", "onnxruntime", "tensorrt"),
                   help="executor: torch (any engine), onnxruntime (engines with ONNX graphs) or tensorrt (engines "
                        "compiled with `trtllm-dflash compile`, on a GPU) (default: what the engine was built for)")


KV_CACHE_MEMORY_HELP = ("a paged KV cache of this size for target and drafter (512MiB, 2GiB, bytes, or a fraction of the "
                        "memory free once the weights are loaded, such as 0.5): requests take blocks of 16 positions "
                        "as they grow, and when none is free the latest one is preempted and recomputed later (torch "
                        "executor); onnxruntime and tensorrt keep a static row per request (max_batch_size rows, or "
                        "as many as SIZE holds beside one prefix block) and give the rest to their prefix pool; "
                        "static: a max_seq_len slot per request (default: the engine's build config kv_cache_memory, "
                        "else static)")
PREFIX_CACHE_HELP = ("a request whose prompt starts with the full 16-position blocks of an earlier request's prompt "
                     "skips their prefill: a paged cache (--kv-cache-memory) shares the blocks, the onnxruntime and "
                     "tensorrt executors copy them into the request's row from a pool (one row's size, or what "
                     "--kv-cache-memory leaves; with --block-size auto once the drafter holds the prompt; a Qwen3.5 "
                     "target up to a block after which its recurrent states are kept: --prefix-states)")
PREFIX_STATES_HELP = ("Qwen3.5 (Gated DeltaNet) targets: how many recurrent states the prefix cache keeps at prompt "
                      "block boundaries, least recently used evicted first, counted in --kv-cache-memory (default: one "
                      "per request slot); more keep more conversations' next turns from recomputing their prompt")
BLOCK_SIZE_HELP = ("tokens per block, 2 .. the engine's, or auto: each step verifies the k in 1 .. the engine's block "
                   "that maximises expected tokens/s, from pass costs measured once and cached (default: the engine's)")


def _block_size(text: str) -> int | str:
    """--block-size: an integer (checked against the engine when it loads) or `auto`."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {shown(text)}") from None


def _block_sizes(text: str) -> tuple[int | str, ...]:
    """--block-sizes: comma-separated integers, auto and / or treeN (a DDTree of N nodes), e.g. 4,8,16,tree32."""
    trees = [re.fullmatch(r"tree(\d+)", x) for x in text.split(",")]
    if any(t is not None and not 1 <= int(t[1]) <= 1024 for t in trees):
        raise argparse.ArgumentTypeError(f"a tree has 1 to 1024 nodes, got {shown(text)}")
    values = tuple(f"tree{int(t[1])}" if t is not None else _block_size(x) for t, x in zip(trees, text.split(",")))
    if any(isinstance(v, int) and v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive integers, auto or treeN (N from 1 to 1024), got "
                                         f"{shown(text)}")
    return values


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {shown(text)}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive integers, got {shown(text)}")
    return values


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(text.split(","))
    bad = [m for m in modes if m not in ("ar", "dflash")]
    if bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"must be ar, dflash or ar,dflash, got {shown(text)}")
    return modes


def _add_bench(sub) -> None:
    from trtllm_dflash.bench.options import BenchOptions

    d = BenchOptions()
    b = sub.add_parser("bench", formatter_class=_HelpFormatter,
                       help="throughput / latency / acceptance benchmark with trtllm-bench's metrics",
                       description="Closed-loop benchmark of an engine on a dataset (SPEED-Bench JSONL, "
                                   "{id, prompt} or {prompt} JSONL): for every mode, block size and concurrency, "
                                   "warm-up, then repeated timed runs; prints markdown tables of the medians.")
    b.add_argument("engine_dir", type=Path)
    b.add_argument("--dataset", type=Path, help="JSONL: SPEED-Bench records, {id, prompt} or {prompt} (default: none; "
                                                "needed unless --profile)")
    b.add_argument("--profile", action="store_true",
                   help="only measure the engine's pass costs for --block-size auto (again, even if cached), store "
                        "them where run, compare, bench and serve find them, and print them")
    b.add_argument("--concurrency", type=_int_list, metavar="C,C,...",
                   help="requests in flight (closed loop), each <= the engine's max_batch_size "
                        "(default: 1,2,4,... up to max_batch_size)")
    b.add_argument("--modes", type=_modes, default=d.modes, metavar="ar,dflash", help="decoding modes to run")
    b.add_argument("--block-sizes", type=_block_sizes, metavar="B,B,...",
                   help="DFlash block sizes, 2 .. the engine's, auto and / or treeN: a DDTree of N draft nodes a step "
                        "(run --tree-budget N; not with auto) (e.g. 4,8,16,tree16,tree32) (default: the engine's)")
    b.add_argument("--num-requests", type=_positive_int,
                   help="the first N prompts of the dataset (default: all)")
    b.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens, help="per request")
    b.add_argument("--warmup", type=_non_negative_int, default=d.warmup, help="warm-up requests per mode")
    b.add_argument("--repeats", type=_positive_int, default=d.repeats,
                   help="timed runs per point; medians are reported")
    b.add_argument("--report-json", type=Path,
                   help="write the full report (trtllm-bench field names) here (default: not written)")
    b.add_argument("--plot", type=Path,
                   help="write a PNG: per-user vs total throughput, acceptance per position (default: not written)")
    b.add_argument("--threads", type=_threads, help="CPU threads, up to the CPUs (default: 1 for a model under 256 MB a rank, else the CPUs "
                   "shared among the ranks)")
    b.add_argument("--kv-cache-memory", metavar="SIZE", help=KV_CACHE_MEMORY_HELP)
    b.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True, help=PREFIX_CACHE_HELP)
    b.add_argument("--prefix-states", type=_positive_int, metavar="N", help=PREFIX_STATES_HELP)
    b.add_argument("--system-prompt", type=Path, metavar="FILE",
                   help="a shared prefix: this text file's contents begin every request (the chat's system message "
                        "for SPEED-Bench records, text before the prompt otherwise) (default: none)")
    b.add_argument("--multi-turn", action="store_true",
                   help="SPEED-Bench records: run every turn of each conversation, each sent with the engine's own "
                        "answers to the turns before it (default: the first turn only)")
    _add_backend(b)
    b.set_defaults(func=cmd_bench)


def _add_train_drafter(sub) -> None:
    from trtllm_dflash.train.config import TrainConfig

    d = TrainConfig()
    t = sub.add_parser("train-drafter", formatter_class=_HelpFormatter,
                       help="train a DFlash drafter for a target on your own prompts",
                       description="Train a DFlash drafter (published recipe) on the target's own responses to "
                                   "DATA's prompts; resumes from OUTPUT/checkpoint if present.")
    t.add_argument("--target", type=Path, required=True, help="HF target directory (needs a <|MASK|> token)")
    t.add_argument("--data", type=Path, required=True, help="JSONL prompts, as for `run`")
    t.add_argument("--output", type=Path, required=True,
                   help="drafter directory (z-lab format) + checkpoint/: new, empty, or an earlier run's to resume")
    t.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    t.add_argument("--num-layers", type=_positive_int, default=d.num_layers, help="drafter layers")
    t.add_argument("--target-layer-ids", type=int, nargs="+",
                   help="target layers whose hidden states condition the drafter (default: the reference's spacing)")
    t.add_argument("--steps", type=_positive_int, default=d.steps, help="optimizer steps")
    t.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="sequences per step")
    t.add_argument("--anchors", type=_positive_int, default=d.anchors, help="blocks per sequence per step")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate, in (0, 1]")
    t.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio, help="share of steps warming up, in [0, 1]")
    t.add_argument("--gamma", type=float, help="loss decay over block positions, > 0 (default: 7 for block 16, "
                                               "block_size / 2 - 1 in general)")
    t.add_argument("--response-tokens", type=_positive_int, default=d.response_tokens,
                   help="length of the target's own responses")
    t.add_argument("--held-out", type=_positive_int, default=d.held_out, help="prompts for the acceptance estimate")
    t.add_argument("--eval-every", type=_positive_int, default=d.eval_every, help="steps between acceptance estimates")
    t.add_argument("--save-every", type=_positive_int, default=d.save_every, help="steps between checkpoints")
    t.add_argument("--seed", type=_seed, default=d.seed, help="sampling seed")
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=d.dtype,
                   help="dtype of the written drafter")
    t.add_argument("--arch", choices=("dflash", "dflash2"), default=d.arch,
                   help="dflash2: a convolution around each sublayer and a candidate selector over the top 16 drafts "
                        "per position (the reference's DFlash2 defaults: 2 taps, groups of 16 channels, rank 256)")
    t.add_argument("--init-from", metavar="DRAFTER_DIR",
                   help="start from this drafter's weights (same target, --block-size, --num-layers and "
                        "--target-layer-ids); with --arch dflash2 from a DFlash drafter, the convolutions start as "
                        "the identity and the selector afresh (default: random initialization)")
    t.add_argument("--cache-features", action="store_true",
                   help="compute the target's features of every training sequence once and keep them in memory "
                        "(4 x len(target_layer_ids) x hidden_size bytes per token) instead of running the target "
                        "every step: steps cost the drafter's pass only")
    t.set_defaults(func=cmd_train_drafter)


def _add_export(sub) -> None:
    e = sub.add_parser("export", help="write an engine in another runtime's format",
                       description="Writes an engine directory in the format another runtime loads as-is.")
    formats = e.add_subparsers(dest="format", required=True)
    t = formats.add_parser("trtllm", formatter_class=_HelpFormatter,
                           help="a directory TensorRT-LLM's PyTorch backend (trtllm-serve, trtllm-bench) loads",
                           description="Writes OUTPUT/target (HF checkpoint, ModelOpt unified format if quantized), "
                                       "OUTPUT/drafter (z-lab DFlash drafter), OUTPUT/extra_llm_api_options.yaml "
                                       "(decoding_type: DFlash) and OUTPUT/README.md with the commands.")
    t.add_argument("engine_dir", type=Path)
    t.add_argument("--output", type=Path, required=True,
                   help="directory to write (new, empty, or written by export trtllm before, with --force)")
    t.add_argument("--force", action="store_true", help="replace an OUTPUT that export trtllm wrote")
    t.set_defaults(func=cmd_export_trtllm)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-dflash", description="DFlash speculative decoding engines.")
    p.add_argument("--version", action="version", version=f"trtllm-dflash {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", formatter_class=_HelpFormatter,
                       help="build an engine directory from a target + DFlash drafter pair")
    b.add_argument("config", type=Path, help="build config YAML (see build_configs/)")
    b.add_argument("--output", type=Path, help="engine directory (default: the config's `output`)")
    b.add_argument("--force", action="store_true", help="replace an engine directory that trtllm-dflash built")
    b.set_defaults(func=cmd_build)

    k = sub.add_parser("compile", formatter_class=_HelpFormatter,
                       help="build TensorRT plans from an engine's ONNX graphs, on the GPU machine that will run them",
                       description="Builds every rank's graphs (an engine built with backend: onnxruntime or "
                                   "tensorrt) into TensorRT plans with the TensorRT of this machine, for its GPU, and "
                                   "adds them to the engine directory (atomically, manifest rewritten).")
    k.add_argument("engine_dir", type=Path)
    k.add_argument("--plugin-library", type=Path,
                   help="libtrtllm_dflash_plugins.so (plugins/dflash) to load while building (default: none)")
    k.add_argument("--experts", choices=("auto", "routed", "dense"), default="auto",
                   help="a mixture-of-experts engine's experts: TensorRT's routed IMoELayer (builds on SM 10.x / 11.x "
                        "only), or every expert over every token; auto: routed where it builds (default: auto)")
    k.set_defaults(func=cmd_compile)

    i = sub.add_parser("inspect", formatter_class=_HelpFormatter,
                       help="summarise an engine directory and verify every file against its manifest")
    i.add_argument("engine_dir", type=Path)
    i.set_defaults(func=cmd_inspect)

    ro = RunOptions()
    r = sub.add_parser("run", formatter_class=_HelpFormatter, help="batch inference over a JSONL file of requests")
    r.add_argument("engine_dir", type=Path)
    r.add_argument("--input", type=Path, help="JSONL: {id, prompt | messages | prompt_token_ids} (default: none; "
                                              "needed unless --stream)")
    r.add_argument("--output", type=Path,
                   help="JSONL results, one line per finished request, flushed as it finishes; an existing file "
                        "is replaced when the run completes (default: none; needed unless --stream)")
    r.add_argument("--resume", action="store_true",
                   help="keep the requests already in --output (from an interrupted run) and run only the others")
    r.add_argument("--stream", metavar="PROMPT",
                   help="interactive: print the completion of PROMPT as tokens are committed ('-': prompts from "
                        "stdin, one per line) (default: off)")
    r.add_argument("--mode", choices=("dflash", "ar"), default=ro.mode,
                   help="dflash: speculative decoding; ar: plain autoregressive decoding")
    r.add_argument("--max-new-tokens", type=_positive_int, default=ro.max_new_tokens,
                   help="per request, unless its line sets max_new_tokens")
    r.add_argument("--temperature", type=_temperature, default=ro.temperature,
                   help="per request, unless its line sets temperature; 0 is greedy")
    r.add_argument("--seed", type=_seed, default=ro.seed, help="sampling seed")
    r.add_argument("--stop-token-ids", type=int, nargs="+", default=[], metavar="ID",
                   help="token ids that end a request, in addition to the engine's EOS ids (default: none)")
    r.add_argument("--summary", type=Path, help="write the run summary JSON here (default: not written)")
    r.add_argument("--threads", type=_threads, help="CPU threads, up to the CPUs (default: 1 for a model under 256 MB a rank, else the CPUs "
                   "shared among the ranks)")
    r.add_argument("--block-size", type=_block_size, help=BLOCK_SIZE_HELP)
    r.add_argument("--device", choices=("cpu", "cuda"), default=ro.device,
                   help="cuda: each rank runs on the GPU of its local rank on its node, collectives over nccl")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="live progress on stderr (default: only when stderr is a terminal)")
    r.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=ro.cuda_graphs,
                   help="torch executor on --device cuda: decode passes padded to batch and length buckets and replayed "
                        "as CUDA graphs; tensorrt executor: each distinct decode-step plan call captured once and "
                        "replayed; never run on a GPU by this project yet (default: on at tp_size 1, for torch on "
                        "--device cuda where its passes can be captured: a target with experts in bfloat16 on SM 9.x / "
                        "10.x only; under tensor parallelism, torch only, when asked)")
    r.add_argument("--kv-cache-memory", metavar="SIZE", help=KV_CACHE_MEMORY_HELP)
    r.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True, help=PREFIX_CACHE_HELP)
    r.add_argument("--prefix-states", type=_positive_int, metavar="N", help=PREFIX_STATES_HELP)
    r.add_argument("--tree-budget", type=_int_in(1, 1024), metavar="N", help=TREE_BUDGET_HELP)
    _add_backend(r)
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("compare", formatter_class=_HelpFormatter,
                       help="DFlash vs autoregressive on the same engine: completions, acceptance, speedup",
                       description="Runs the first prompts of INPUT one at a time (batch size 1, greedy) in both "
                                   "modes, side by side, and prints completions, the mean acceptance length, the "
                                   "DFlash/AR speedup and whether the outputs are identical.")
    c.add_argument("engine_dir", type=Path)
    c.add_argument("--input", type=Path, required=True, help="JSONL prompts, as for `run`")
    c.add_argument("--num-prompts", type=_positive_int, default=8, help="prompts to run")
    c.add_argument("--max-new-tokens", type=_positive_int, default=128, help="per prompt")
    c.add_argument("--show", type=_non_negative_int, default=3, help="completions to print")
    c.add_argument("--repeats", type=_positive_int, default=1, help="timed repetitions (medians)")
    c.add_argument("--threads", type=_threads, help="CPU threads, up to the CPUs (default: 1 for a model under 256 MB a rank, else the CPUs "
                   "shared among the ranks)")
    c.add_argument("--block-size", type=_block_size, help=BLOCK_SIZE_HELP)
    c.add_argument("--tree-budget", type=_int_in(1, 1024), metavar="N", help=TREE_BUDGET_HELP)
    _add_backend(c)
    c.set_defaults(func=cmd_compare)

    _add_serve(sub)
    _add_bench(sub)
    _add_train_drafter(sub)
    _add_export(sub)

    v = sub.add_parser("convert-drafter", formatter_class=_HelpFormatter,
                       help="write a z-lab drafter in vLLM's speculators format, optionally with a pruned vocabulary",
                       description="Copies the drafter's weights, adds the target's embedding and lm_head rows as "
                                   "speculators' DFlash converter does, and with --prune-vocab N keeps only N "
                                   "tokens (the drafter then has its own lm_head and d2t / t2d maps).")
    v.add_argument("drafter", type=Path, help="z-lab DFlash drafter directory")
    v.add_argument("output", type=Path, help="new drafter directory")
    v.add_argument("--target", type=Path, required=True, help="the drafter's target (HF checkpoint directory)")
    v.add_argument("--to", choices=("speculators",), default="speculators", help="output format")
    v.add_argument("--prune-vocab", type=_positive_int, metavar="N",
                   help="keep the N tokens most frequent in --vocab-text (default: the whole vocabulary)")
    v.add_argument("--vocab-text", type=Path, nargs="+", default=[], metavar="FILE",
                   help="text files whose token counts choose the kept tokens (ties and the rest: lowest ids) "
                        "(default: none: the N lowest ids)")
    v.add_argument("--force", action="store_true", help="replace an OUTPUT that convert-drafter wrote")
    v.set_defaults(func=cmd_convert_drafter)

    m = sub.add_parser("make-random-pair", formatter_class=_HelpFormatter,
                       help="write a tiny random target (HF) + drafter (z-lab) pair, for pipeline smoke tests")
    m.add_argument("output", type=Path)
    m.add_argument("--family", choices=("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "llama",
                                         "gpt_oss", "gemma4"), default="qwen3",
                   help="target architecture")
    m.add_argument("--block-size", type=_int_in(2, 64), default=8, help="the drafter's block size")
    m.add_argument("--drafter-arch", choices=("dflash", "dflash2"), default="dflash",
                   help="a DFlash drafter, or a DFlash2 one (convolutions + candidate selector)")
    m.add_argument("--seed", type=_seed, default=0, help="weight seed")
    m.add_argument("--force", action="store_true", help="replace an OUTPUT that make-random-pair wrote")
    m.set_defaults(func=cmd_make_random_pair)
    return p


class _SigintSeen:
    """Python's SIGINT handler (KeyboardInterrupt), remembering that it ran: a KeyboardInterrupt raised while a
    library's native code calls back into Python can come out of it as another exception (safetensors' get_tensor:
    a ValueError about an UntypedStorage), which is still the user's Ctrl-C."""

    def __init__(self):
        self.seen = False

    def __call__(self, signum, frame):
        self.seen = True
        signal.default_int_handler(signum, frame)


TREE_BUDGET_HELP = ("DDTree: every dflash step verifies a tree of the N most likely draft paths' nodes, built from "
                    "the drafter's 8 best tokens per position, instead of one chain; torch and onnxruntime backends "
                    "(Qwen3.5 targets: torch) (default: a chain)")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sigint = _SigintSeen()
    previous = signal.signal(signal.SIGINT, sigint) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return args.func(args)
    except KeyboardInterrupt as exc:
        left = exc.left if isinstance(exc, Interrupted) else "nothing was written"
        print(f"error: interrupted (Ctrl-C); {left}.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UserError as exc:
        if not getattr(exc, "quiet", False):  # an error all MPI ranks share is printed by rank 0 only
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:  # the file system's answer (permissions, space, ...) is the user's to fix, not a bug
        error = user_os_error(exc)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception:
        if not sigint.seen:
            raise
        # (run and train-drafter keep what they finished, as their own Ctrl-C message says; the others write atomically)
        left = "what was finished so far is kept" if args.func in (cmd_run, cmd_train_drafter) else \
            "nothing was written"
        print(f"error: interrupted (Ctrl-C); {left}.", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        release_outputs()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
