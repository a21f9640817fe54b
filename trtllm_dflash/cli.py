"""`trtllm-dflash`: each subcommand parses its arguments, then makes one library call."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from trtllm_dflash import __version__
from trtllm_dflash.errors import UserError

EXIT_USER_ERROR = 2  # bad config / checkpoint / engine: nothing was produced
EXIT_BAD_LINES = 1  # `run` finished, but some input lines were rejected


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
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
    out = build_engine(cfg, force=args.force, progress=sys.stderr.isatty(), source=str(args.config))
    print(f"engine written to {out}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from trtllm_dflash.runtime.runner import run_jsonl

    bad = run_jsonl(args.engine_dir, args.input, args.output, args.mode, args.max_new_tokens,
                    args.temperature, args.seed, args.summary, args.threads)
    return EXIT_BAD_LINES if bad else 0


def cmd_make_random_pair(args: argparse.Namespace) -> int:
    from trtllm_dflash.checkpoint.synthetic import write_random_pair

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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-dflash", description="DFlash speculative decoding engines.")
    p.add_argument("--version", action="version", version=f"trtllm-dflash {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an engine directory from a target + DFlash drafter pair")
    b.add_argument("config", type=Path, help="build config YAML (see build_configs/)")
    b.add_argument("--output", type=Path, help="engine directory (overrides the config's `output`)")
    b.add_argument("--force", action="store_true", help="replace an existing engine directory")
    b.set_defaults(func=cmd_build)

    r = sub.add_parser("run", help="batch inference over a JSONL file of requests")
    r.add_argument("engine_dir", type=Path)
    r.add_argument("--input", type=Path, required=True, help="JSONL: {id, prompt | messages | prompt_token_ids}")
    r.add_argument("--output", type=Path, required=True, help="JSONL results, one line per finished request")
    r.add_argument("--mode", choices=("dflash", "ar"), default="dflash",
                   help="dflash: speculative decoding; ar: plain autoregressive decoding (default: dflash)")
    r.add_argument("--max-new-tokens", type=_positive_int, default=256, help="default per request (256)")
    r.add_argument("--temperature", type=_non_negative_float, default=0.0, help="default per request (0: greedy)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    r.add_argument("--summary", type=Path, help="write the run summary JSON here")
    r.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")
    r.set_defaults(func=cmd_run)

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
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
