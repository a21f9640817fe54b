"""`trtllm-dflash bench`: run the benchmark, print markdown tables, write the JSON report and the PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trtllm_dflash.bench.machine import describe
from trtllm_dflash.config import Backend
from trtllm_dflash.bench.options import BenchOptions
from trtllm_dflash.bench.runner import bench
from trtllm_dflash.outputs import check_output_files, write_text_atomic


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _block(block_size: int | str) -> str:
    return "auto" if block_size == "auto" else f"b{block_size}"


def _name(point: dict) -> str:
    return point["mode"] if point["block_size"] is None else f"{point['mode']} {_block(point['block_size'])}"


def performance_table(report: dict) -> list[str]:
    lines = ["| mode | concurrency | Request Throughput (req/sec) | Total Output Throughput (tokens/sec) | "
             "Per User Output Speed (tps/user) | TTFT P50 (ms) | TPOT P50 (ms) | TPOT P99 (ms) | AL | "
             "draft acceptance rate | speedup vs ar | identical to ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in report["points"]:
        perf, stream, dec = p["performance"], p["streaming_metrics"], p["decoding_stats"] or {}
        tpot = stream["tpot_percentiles"] or {}
        identical, speedup = p.get("outputs_identical_to_ar"), p.get("speedup_vs_ar")
        lines.append(
            f"| {_name(p)} | {p['concurrency']} | {_num(perf['request_throughput_req_s'], 2)} | "
            f"{_num(perf['system_output_throughput_tok_s'])} | {_num(stream['token_output_speed_tok_s'])} | "
            f"{_num(stream['ttft_percentiles']['p50'], 2)} | {_num(tpot.get('p50'), 2)} | {_num(tpot.get('p99'), 2)} | "
            f"{_num(dec.get('acceptance_length', 1.0 if p['mode'] == 'ar' else None), 2)} | "
            f"{_num(dec.get('draft_acceptance_rate'), 3)} | "
            f"{_times(speedup)} | "
            f"{'-' if identical is None else ('yes' if identical else 'NO')} |")
    return lines


def bound_table(report: dict) -> list[str]:
    lines = ["| block size | context | AR step (ms) | verify pass (ms) | draft pass (ms) | AL | "
             "bound AL x t_ar / (t_verify + t_draft) | measured speedup (concurrency 1) | "
             "measured TPOT speedup (decode steps only) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b in report["speedup_bound"]:
        c = b["step_costs_ms"]
        lines.append(f"| {b['block_size']} | {b['context_len']} | {c['ar']:.2f} | {c['verify']:.2f} | "
                     f"{c['draft']:.2f} | {_num(b['acceptance_length'], 2)} | "
                     f"{_times(b['speedup_bound'])} | {_times(b['measured_speedup'])} | "
                     f"{_times(b.get('measured_tpot_speedup'))} |")
    return lines


def _acceptance_by_block(report: dict) -> dict[int, dict]:
    """Block size -> decoding_stats of its first DFlash point (acceptance does not depend on concurrency)."""
    out: dict[int, dict] = {}
    for p in report["points"]:
        if p["mode"] == "dflash" and p["block_size"] not in out:
            out[p["block_size"]] = p
    return out


def position_table(report: dict) -> list[str]:
    by_block = _acceptance_by_block(report)
    if not by_block:
        return []
    cells = [p["decoding_stats"]["acceptance_rate_per_position"] for p in by_block.values()]
    lines = ["| block position | " + " | ".join(_block(b) for b in by_block) + " |",
             "|---|" + "---|" * len(by_block)]
    for k in range(1, max(len(c) for c in cells) + 1):
        lines.append(f"| {k} | " + " | ".join(_num(c[k - 1], 3) if k <= len(c) else "" for c in cells) + " |")
    return lines


def category_table(report: dict) -> list[str]:
    by_block = _acceptance_by_block(report)
    if not by_block or "per_category" not in next(iter(by_block.values())):
        return []
    categories = next(iter(by_block.values()))["per_category"]
    lines = ["| category | requests | " + " | ".join(f"AL {_block(b)}" for b in by_block) + " |",
             "|---|---|" + "---|" * len(by_block)]
    for cat, info in categories.items():
        lines.append(f"| {cat} | {info['num_requests']} | "
                     + " | ".join(_num(p["per_category"][cat]["acceptance_length"], 2) for p in by_block.values())
                     + " |")
    return lines


def verify_length_table(report: dict) -> list[str]:
    """--block-size auto: the share of decoding steps at each verify length k, per concurrency (k = 1: AR steps)."""
    auto = [p for p in report["points"] if p["block_size"] == "auto"]
    if not auto:
        return []
    top = auto[0]["decoding_stats"]["max_draft_len"] + 1
    lines = ["| concurrency | " + " | ".join(f"k={k}" for k in range(1, top + 1)) + " | mean k | tokens per step |",
             "|---|" + "---|" * (top + 2)]
    for p in auto:
        dist = {int(k): v for k, v in p["decoding_stats"]["verify_length_distribution"].items()}
        mean_k = sum(k * v for k, v in dist.items())
        steps = p["decoding_stats"]["tokens_per_decoding_step"] or 0.0
        lines.append(f"| {p['concurrency']} | " + " | ".join(_num(dist.get(k), 2) if dist.get(k) else ""
                                                             for k in range(1, top + 1))
                     + f" | {mean_k:.2f} | {steps:.2f} |")
    return lines


def markdown(report: dict) -> str:
    """The whole report as markdown: performance by mode and concurrency, bound, acceptance by position / category."""
    head = (f"`trtllm-dflash bench` {report['engine']} on {report['dataset']} ({report['dataset_format']}): "
            f"{report['num_requests']} requests, up to {report['max_new_tokens']} new tokens, greedy, "
            f"{report['dtype']}, {report.get('backend', 'torch')} executor; medians of {report['repeats']} runs after {report['warmup']} warm-up requests; "
            f"{describe(report['machine'])}; {report['date']}")
    parts = [head, "", *performance_table(report)]
    if report["speedup_bound"]:
        parts += ["", "Speedup bound at batch size 1 (pass times at the mean context):", "", *bound_table(report)]
    lengths = verify_length_table(report)
    if lengths:
        parts += ["", "--block-size auto: share of decoding steps verifying k tokens per request (k = 1: plain AR "
                  "steps), by concurrency:", "", *lengths]
    positions = position_table(report)
    if positions:
        parts += ["", "Acceptance rate per block position (share of verify steps whose k-th draft was accepted):",
                  "", *positions]
    categories = category_table(report)
    if categories:
        parts += ["", "Acceptance length per category:", "", *categories]
    return "\n".join(parts) + "\n"


def profile_command(engine_dir: Path, threads: int | None, backend: Backend | None) -> None:
    """`bench --profile`: measure the pass costs again, cache them for --block-size auto, print the step costs."""
    from trtllm_dflash.runtime.costs import costs_table, load_or_measure
    from trtllm_dflash.runtime.runner import Engine

    engine = Engine.load(engine_dir, command="bench", backend=backend, threads=threads)
    costs, path = load_or_measure(engine_dir, engine.executor, backend or engine.config.backend, remeasure=True,
                                  report=lambda line: print(line, file=sys.stderr, flush=True))
    for c in costs.contexts:
        print("\n".join(costs_table(costs, c)) + "\n")
    print(f"cost profile written to {path}", file=sys.stderr)


def bench_command(engine_dir: Path, dataset: Path, opts: BenchOptions, report_json: Path | None,
                  plot: Path | None) -> dict:
    """`trtllm-dflash bench`: progress on stderr, markdown on stdout, optional JSON report and PNG."""
    inputs = (engine_dir, dataset) + ((opts.system_prompt,) if opts.system_prompt is not None else ())
    check_output_files({"--report-json": report_json, "--plot": plot}, inputs=inputs)
    if plot is not None:
        from trtllm_dflash.bench.plot import require_matplotlib

        require_matplotlib()  # fail before the benchmark, not after it
    report = bench(engine_dir, dataset, opts, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown(report))
    if report_json is not None:
        write_text_atomic(Path(report_json), json.dumps(report, indent=2) + "\n")
    if plot is not None:
        from trtllm_dflash.bench.plot import plot_report

        plot_report(report, Path(plot))
    return report
