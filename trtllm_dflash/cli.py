"""`trtllm-dflash`: each subcommand parses its arguments, then makes one library call."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from trtllm_dflash import __version__
from trtllm_dflash.errors import UserError
from trtllm_dflash.parallel.world import AgreedError
from trtllm_dflash.runtime.runner import RunOptions

EXIT_USER_ERROR = 2  # bad config / checkpoint / engine: nothing was produced
EXIT_BAD_LINES = 1  # `run` finished, but some input lines were rejected


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def cmd_build(args: argparse.Namespace) -> int:
    from trtllm_dflash.config import load_build_config
    from trtllm_dflash.engine.builder import build_engine

    cfg = load_build_config(args.config, output=args.output)
    out = build_engine(cfg, force=args.force, progress=sys.stderr.isatty(), source=str(args.config),
                       report=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"engine written to {out}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from trtllm_dflash.parallel.world import init_world
    from trtllm_dflash.runtime.runner import run_jsonl, stream

    if args.stream is None and (args.input is None or args.output is None):
        raise UserError("run needs --input and --output (or --stream PROMPT for interactive use).")
    if args.stream is not None and (args.input or args.output or args.resume):
        raise UserError("--stream prints to the terminal; it does not take --input, --output or --resume.")
    opts = RunOptions(args.mode, args.max_new_tokens, args.temperature, args.seed, tuple(args.stop_token_ids),
                      args.threads, args.block_size, args.device, args.resume, args.progress)
    world = init_world("nccl" if args.device == "cuda" else "gloo")
    try:
        if args.stream is not None:
            code = stream(args.engine_dir, args.stream, opts, world)
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


def cmd_inspect(args: argparse.Namespace) -> int:
    from trtllm_dflash.engine.inspect import inspect_engine

    inspect_engine(args.engine_dir)
    return 0


def cmd_make_random_pair(args: argparse.Namespace) -> int:
    from trtllm_dflash.train.random_pair import write_random_pair

    if args.output.exists() and not args.output.is_dir():
        raise UserError(f"{args.output}: output path exists and is not a directory.")
    if args.output.exists() and any(args.output.iterdir()):
        if not args.force:
            raise UserError(f"{args.output}: output directory exists and is not empty (use --force to replace it).")
        for sub in ("target", "drafter"):
            shutil.rmtree(args.output / sub, ignore_errors=True)
    target, drafter = write_random_pair(args.output, args.family, block_size=args.block_size, seed=args.seed)
    print(f"random target written to {target}, drafter to {drafter}", file=sys.stderr)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from trtllm_dflash.train.drafter import TrainConfig, train_drafter

    fields = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__}
    fields["target_layer_ids"] = tuple(args.target_layer_ids) if args.target_layer_ids else None
    state = train_drafter(args.target, args.data, args.output, TrainConfig(**fields), progress=sys.stderr.isatty())
    last = state.evals[-1]["acceptance_length"] if state.evals else None
    print(f"drafter written to {args.output} after {state.step} steps; final loss {state.losses[-1]:.4f}, "
          f"held-out acceptance length {last}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from trtllm_dflash.bench.report import bench_command
    from trtllm_dflash.bench.runner import BenchOptions

    opts = BenchOptions(args.concurrency, args.modes, args.block_sizes, args.num_requests, args.max_new_tokens,
                        args.warmup, args.repeats, args.threads)
    bench_command(args.engine_dir, args.dataset, opts, args.report_json, args.plot)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from trtllm_dflash.runtime.report import compare_and_print

    compare_and_print(args.engine_dir, args.input, args.num_prompts, args.max_new_tokens, args.show,
                      args.repeats, args.threads, args.block_size)
    return 0


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1..65535, got {text}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from trtllm_dflash.serve import Endpoints, ServeConfig, serve
    from trtllm_dflash.serve.tensor_parallel import check_launch, serve_under_mpi

    cfg = ServeConfig(engine_dir=str(args.engine_dir.absolute()), mode=args.mode, block_size=args.block_size,
                      max_batch_size=args.max_batch_size, max_new_tokens=args.max_new_tokens, seed=args.seed,
                      threads=args.threads)
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
    s = sub.add_parser("serve", help="write a Triton model repository for an engine (and start tritonserver on it)",
                       description="Writes MODEL_REPO/NAME (config.pbtxt, 1/model.py for Triton's Python backend, "
                                   "1/serve.json); with --launch, starts tritonserver on it and runs until stopped.")
    s.add_argument("engine_dir", type=Path)
    s.add_argument("--model-repo", type=Path, required=True, help="Triton model repository directory to write")
    s.add_argument("--model-name", default="trtllm_dflash", help="model name in the repository (default: %(default)s)")
    s.add_argument("--force", action="store_true", help="replace a non-empty --model-repo")
    s.add_argument("--no-streaming", action="store_true",
                   help="a non-decoupled model: one response per request, for Triton's plain infer over HTTP and "
                        "gRPC (default: decoupled, streaming over gRPC streams and HTTP generate_stream)")
    s.add_argument("--mode", choices=("dflash", "ar"), default=d.mode, help=f"decoding mode (default: {d.mode})")
    s.add_argument("--block-size", type=int, help="tokens per block, 2 .. the engine's (default: the engine's)")
    s.add_argument("--max-batch-size", type=_positive_int,
                   help="requests decoded together, up to the engine's (default: the engine's)")
    s.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens,
                   help=f"when a request has no sampling_param_max_tokens (default: {d.max_new_tokens})")
    s.add_argument("--seed", type=_non_negative_int, default=d.seed,
                   help=f"when a request has no sampling_param_seed (default: {d.seed})")
    s.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")
    s.add_argument("--launch", action="store_true", help="start tritonserver on the repository")
    s.add_argument("--host", default=e.host, help=f"address the endpoints bind to (default: {e.host})")
    s.add_argument("--http-port", type=_port, default=e.http_port, help=f"default: {e.http_port}")
    s.add_argument("--grpc-port", type=_port, default=e.grpc_port, help=f"default: {e.grpc_port}")
    s.add_argument("--metrics-port", type=_port, default=e.metrics_port, help=f"default: {e.metrics_port}")
    s.set_defaults(func=cmd_serve)
def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
    return values


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(text.split(","))
    bad = [m for m in modes if m not in ("ar", "dflash")]
    if bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"must be ar, dflash or ar,dflash, got {text!r}")
    return modes


def _add_bench(sub) -> None:
    from trtllm_dflash.bench.runner import BenchOptions

    d = BenchOptions()
    b = sub.add_parser("bench", help="throughput / latency / acceptance benchmark with trtllm-bench's metrics",
                       description="Closed-loop benchmark of an engine on a dataset (SPEED-Bench JSONL, "
                                   "{id, prompt} or {prompt} JSONL): for every mode, block size and concurrency, "
                                   "warm-up, then repeated timed runs; prints markdown tables of the medians.")
    b.add_argument("engine_dir", type=Path)
    b.add_argument("--dataset", type=Path, required=True, help="JSONL: SPEED-Bench records, {id, prompt} or {prompt}")
    b.add_argument("--concurrency", type=_int_list, metavar="C,C,...",
                   help="requests in flight (closed loop), each <= the engine's max_batch_size "
                        "(default: 1,2,4,... up to max_batch_size)")
    b.add_argument("--modes", type=_modes, default=d.modes, metavar="ar,dflash", help="default: ar,dflash")
    b.add_argument("--block-sizes", type=_int_list, metavar="B,B,...",
                   help="DFlash block sizes, 2 .. the engine's (default: the engine's)")
    b.add_argument("--num-requests", type=_positive_int, help="the first N prompts of the dataset (default: all)")
    b.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens,
                   help=f"per request (default {d.max_new_tokens})")
    b.add_argument("--warmup", type=_non_negative_int, default=d.warmup,
                   help=f"warm-up requests per mode (default {d.warmup})")
    b.add_argument("--repeats", type=_positive_int, default=d.repeats,
                   help=f"timed runs per point; medians are reported (default {d.repeats})")
    b.add_argument("--report-json", type=Path, help="write the full report (trtllm-bench field names) here")
    b.add_argument("--plot", type=Path, help="write a PNG: per-user vs total throughput, acceptance per position")
    b.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    b.set_defaults(func=cmd_bench)


def _add_train_drafter(sub) -> None:
    from trtllm_dflash.train.drafter import TrainConfig

    d = TrainConfig()
    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a target on your own prompts",
                       description="Train a DFlash drafter (published recipe) on the target's own responses to "
                                   "DATA's prompts; resumes from OUTPUT/checkpoint if present.")
    t.add_argument("--target", type=Path, required=True, help="HF target directory (needs a <|MASK|> token)")
    t.add_argument("--data", type=Path, required=True, help="JSONL prompts, as for `run`")
    t.add_argument("--output", type=Path, required=True, help="drafter directory (z-lab format) + checkpoint/")
    t.add_argument("--block-size", type=int, default=d.block_size)
    t.add_argument("--num-layers", type=_positive_int, default=d.num_layers)
    t.add_argument("--target-layer-ids", type=int, nargs="+", help="default: the reference's spacing")
    t.add_argument("--steps", type=_positive_int, default=d.steps)
    t.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="sequences per step")
    t.add_argument("--anchors", type=_positive_int, default=d.anchors, help="blocks per sequence per step")
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
    t.add_argument("--gamma", type=float, default=d.gamma, help="loss decay (default 7 for block 16)")
    t.add_argument("--response-tokens", type=_positive_int, default=d.response_tokens)
    t.add_argument("--held-out", type=_positive_int, default=d.held_out, help="prompts for the acceptance estimate")
    t.add_argument("--eval-every", type=_positive_int, default=d.eval_every)
    t.add_argument("--save-every", type=_positive_int, default=d.save_every)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=d.dtype)
    t.set_defaults(func=cmd_train_drafter)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-dflash", description="DFlash speculative decoding engines.")
    p.add_argument("--version", action="version", version=f"trtllm-dflash {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an engine directory from a target + DFlash drafter pair")
    b.add_argument("config", type=Path, help="build config YAML (see build_configs/)")
    b.add_argument("--output", type=Path, help="engine directory (overrides the config's `output`)")
    b.add_argument("--force", action="store_true", help="replace an existing engine directory")
    b.set_defaults(func=cmd_build)

    i = sub.add_parser("inspect", help="summarise an engine directory and verify every file against its manifest")
    i.add_argument("engine_dir", type=Path)
    i.set_defaults(func=cmd_inspect)

    ro = RunOptions()
    r = sub.add_parser("run", help="batch inference over a JSONL file of requests")
    r.add_argument("engine_dir", type=Path)
    r.add_argument("--input", type=Path, help="JSONL: {id, prompt | messages | prompt_token_ids}")
    r.add_argument("--output", type=Path, help="JSONL results, one line per finished request, flushed as it finishes")
    r.add_argument("--resume", action="store_true",
                   help="keep the requests already in --output (from an interrupted run) and run only the others")
    r.add_argument("--stream", metavar="PROMPT",
                   help="interactive: print the completion of PROMPT as tokens are committed ('-': prompts from "
                        "stdin, one per line)")
    r.add_argument("--mode", choices=("dflash", "ar"), default=ro.mode,
                   help=f"dflash: speculative decoding; ar: plain autoregressive decoding (default: {ro.mode})")
    r.add_argument("--max-new-tokens", type=_positive_int, default=ro.max_new_tokens,
                   help=f"default per request ({ro.max_new_tokens})")
    r.add_argument("--temperature", type=_non_negative_float, default=ro.temperature,
                   help=f"default per request ({ro.temperature}: greedy)")
    r.add_argument("--seed", type=int, default=ro.seed, help=f"sampling seed ({ro.seed})")
    r.add_argument("--stop-token-ids", type=int, nargs="+", default=[], metavar="ID",
                   help="token ids that end a request, in addition to the engine's EOS ids")
    r.add_argument("--summary", type=Path, help="write the run summary JSON here")
    r.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")
    r.add_argument("--block-size", type=int, help="tokens per block, 2 .. the engine's (default: the engine's)")
    r.add_argument("--device", choices=("cpu", "cuda"), default=ro.device,
                   help="cuda: rank r runs on GPU r %% device_count, collectives over nccl (default: cpu)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="live progress on stderr (default: only when stderr is a terminal)")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("compare", help="DFlash vs autoregressive on the same engine: completions, acceptance, speedup",
                       description="Runs the first prompts of INPUT one at a time (batch size 1, greedy) in both "
                                   "modes, side by side, and prints completions, the mean acceptance length, the "
                                   "DFlash/AR speedup and whether the outputs are identical.")
    c.add_argument("engine_dir", type=Path)
    c.add_argument("--input", type=Path, required=True, help="JSONL prompts, as for `run`")
    c.add_argument("--num-prompts", type=_positive_int, default=8)
    c.add_argument("--max-new-tokens", type=_positive_int, default=128)
    c.add_argument("--show", type=int, default=3, help="completions to print")
    c.add_argument("--repeats", type=_positive_int, default=1, help="timed repetitions (medians)")
    c.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    c.add_argument("--block-size", type=int, help="tokens per block, 2 .. the engine's (default: the engine's)")
    c.set_defaults(func=cmd_compare)

    _add_serve(sub)
    _add_bench(sub)
    _add_train_drafter(sub)

    m = sub.add_parser("make-random-pair",
                       help="write a tiny random target (HF) + drafter (z-lab) pair, for pipeline smoke tests")
    m.add_argument("output", type=Path)
    m.add_argument("--family", choices=("qwen3", "llama"), default="qwen3")
    m.add_argument("--block-size", type=int, default=8)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true", help="replace target/ and drafter/ in OUTPUT")
    m.set_defaults(func=cmd_make_random_pair)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        if not getattr(exc, "quiet", False):  # an error all MPI ranks share is printed by rank 0 only
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
