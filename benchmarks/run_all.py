"""The whole benchmark report in one command: throughput vs concurrency, baselines, scaling; JSON + PNGs + markdown.

    python benchmarks/run_all.py            # about 25 minutes on a 2-core CPU (the current demo pair)
    python benchmarks/run_all.py --quick    # a small version of every part (about 2 minutes), for checking

1. builds engines/demo-bench from build_configs/demo_bench.yaml (the demo pair with 32 KV-cache slots);
2. `trtllm-dflash bench` on the held-out code prompts: ar and dflash (block 16), concurrency 1..32
   -> bench.json, bench.png;
3. benchmarks/baselines.py: HF generate(), HF prompt lookup, our ar and dflash at batch size 1
   -> baselines.json;
4. benchmarks/scaling.py: TPOT vs prompt length (128 .. the engine's limit) and vs block size (4, 8, 16)
   -> scaling.json, scaling.png;
5. REPORT.md with every table, the figures, the machine (CPU, cores, torch threads), the date, the
   commit and how long each part took. All files go to --output-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import baselines
import scaling
from trtllm_dflash.bench.machine import describe, machine_info
from trtllm_dflash.bench.plot import plot_report
from trtllm_dflash.bench.report import markdown as bench_markdown
from trtllm_dflash.bench.runner import BenchOptions, bench
from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"
TARGET = ROOT / "trtllm_dflash" / "assets" / "demo" / "target"

FULL = {
    "bench": BenchOptions(concurrency=(1, 2, 4, 8, 16, 32), modes=("ar", "dflash"), num_requests=32,
                          max_new_tokens=128, warmup=2, repeats=3),
    "baselines": {"num_prompts": 16, "max_new_tokens": 128, "repeats": 3},
    "scaling": {"lengths": [128, 256, 512, 1024, 2048, 4096], "block_sizes": [4, 8, 16], "num_prompts": 4,
                "max_new_tokens": 128, "repeats": 3},
}
QUICK = {
    "bench": BenchOptions(concurrency=(1, 2, 4), modes=("ar", "dflash"), num_requests=4, max_new_tokens=32,
                          warmup=1, repeats=1),
    "baselines": {"num_prompts": 2, "max_new_tokens": 32, "repeats": 1},
    "scaling": {"lengths": [128, 4096], "block_sizes": [4, 16], "num_prompts": 1, "max_new_tokens": 32,
                "repeats": 1},
}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def timed(label: str, seconds: dict[str, float], fn):
    print(f"== {label}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    result = fn()
    seconds[label] = round(time.perf_counter() - start, 1)
    print(f"== {label}: {seconds[label]:.0f} s", file=sys.stderr, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small version of every part, to check the pipeline")
    p.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--engine-config", type=Path, default=ROOT / "build_configs" / "demo_bench.yaml")
    p.add_argument("--threads", type=int, help="CPU threads (default: Engine.load's: 1 for the demo)")
    args = p.parse_args()
    plan = QUICK if args.quick else FULL
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    started, machine = datetime.datetime.now().isoformat(timespec="seconds"), machine_info()

    cfg = load_build_config(args.engine_config)
    engine = timed("build", seconds, lambda: build_engine(cfg, force=True, progress=False,
                                                          config_file=Path(args.engine_config)))

    def run_bench() -> dict:
        opts = dataclasses.replace(plan["bench"], threads=args.threads)
        report = bench(engine, PROMPTS, opts, progress=lambda line: print(line, file=sys.stderr, flush=True))
        report["engine"], report["dataset"] = _rel(engine), _rel(PROMPTS)
        (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_report(report, out / "bench.png")
        return report

    bench_report = timed("bench", seconds, run_bench)

    def run_baselines() -> dict:
        report = baselines.run(engine, TARGET, PROMPTS, **plan["baselines"], threads=args.threads)
        (out / "baselines.json").write_text(json.dumps(report, indent=2) + "\n")
        return report

    baseline_report = timed("baselines", seconds, run_baselines)

    def run_scaling() -> dict:
        report = scaling.run(engine, PROMPTS, **plan["scaling"], threads=args.threads)
        report["engine"], report["prompts"] = _rel(engine), _rel(PROMPTS)
        (out / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
        scaling.plot(report, out / "scaling.png")
        return report

    scaling_report = timed("scaling", seconds, run_scaling)

    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    report_md = "\n".join([
        "# trtllm-dflash benchmark report",
        "",
        f"- command: `{command}` (commit {git_commit()})",
        f"- date: {started}",
        f"- machine: {describe(machine)}",
        f"- engine: `{_rel(engine)}` "
        f"(from `{args.engine_config.name}`: the demo pair, {bench_report['dtype']}, "
        f"max_batch_size {bench_report['max_batch_size']})",
        "- time per part (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
        + f"; total {sum(seconds.values()):.0f}",
        "",
        "## 1. Throughput vs concurrency (`trtllm-dflash bench`)",
        "",
        bench_markdown(bench_report),
        "![per-user vs total throughput; acceptance per block position](bench.png)",
        "",
        "## 2. Baselines at batch size 1",
        "",
        baselines.markdown(baseline_report),
        "## 3. Scaling: prompt length and block size",
        "",
        scaling.markdown(scaling_report),
        "![TPOT vs prompt length and block size](scaling.png)",
        "",
    ])
    (out / "REPORT.md").write_text(report_md)
    print(report_md)
    print(f"report written to {out / 'REPORT.md'} ({sum(seconds.values()):.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
