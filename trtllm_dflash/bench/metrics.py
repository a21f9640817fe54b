"""One configuration's timed runs -> trtllm-bench's metrics (medians over the repeated runs).

Names and units follow trtllm-bench's report_json (tensorrt_llm/bench/dataclasses/reporting.py):

    performance.request_throughput_req_s         Request Throughput (req/sec) = requests / total latency
    performance.system_output_throughput_tok_s   Total Output Throughput (tokens/sec) = output tokens / total latency
    performance.total_latency_ms                 first submission -> last token of the run
    streaming_metrics.token_output_speed_tok_s   Per User Output Speed (tps/user): mean over requests of 1 / TPOT
    streaming_metrics.{ttft,tpot}_percentiles    [TTFT] / [TPOT] minimum/maximum/average/p50/p90/p95/p99, ms
    decoding_stats.*_percentiles                 per-request draft tokens, accepted drafts, draft acceptance rate, AL

One difference, on purpose: an acceptance length counts verify steps only (tokens committed per verify
step = accepted drafts + 1, as the DFlash paper and `run` report it); trtllm-bench also counts the
prefill iteration, which lowers its AL slightly for short outputs. The conventions (AL 1.0 without a verify
step, the percentile method) are trtllm_dflash.stats'.

Times are medians over repeats; the throughputs are derived from the median total latency, so
`system_output_throughput_tok_s == output tokens / total_latency_ms * 1e3` holds exactly. Greedy
decoding with the same schedule produces the same tokens in every repeat, so token counts and
acceptance come from the first repeat.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from trtllm_dflash.runtime.decoding import Result
from trtllm_dflash.runtime.jsonl import summarize
from trtllm_dflash.stats import (accepted_tokens, all_steps, draft_acceptance_rate, drafted_tokens,
                                 mean_acceptance_length, percentiles)


@dataclass(frozen=True)
class TimedRun:
    results: list[Result]  # in completion order
    wall_s: float  # first submission -> last token
    peak_in_flight: int = 0  # the most requests decoding at once (fewer than the concurrency when KV memory ran out)
    preemptions: int = 0  # requests whose KV blocks were taken back for others (recomputed later; runtime/decoding.py)


def _median_block(blocks: list[dict | None]) -> dict | None:
    """Key-wise median of percentile blocks from repeated runs."""
    if any(b is None for b in blocks):
        return None
    return {k: round(statistics.median(b[k] for b in blocks), 3) for k in blocks[0]}


def decoding_stats(results: list[Result], block_size: int) -> dict:
    """DFlash acceptance over all verify steps of the run, plus trtllm-bench's per-request percentile blocks.

    `block_size`: the run's block (with --block-size auto, the largest k it could choose); a verify step of k
    tokens drafts k - 1, and `verify_length_distribution` gives the share of decoding steps at each k."""
    steps = all_steps(results)
    verified = [r for r in results if r.acceptance_lengths]  # requests that reached a verify step
    drafted = [drafted_tokens(r, block_size) for r in verified]
    accepted = [accepted_tokens(r) for r in verified]
    summary = summarize("dflash", results, 1.0, block_size)
    lengths = Counter(k for r in results for k in r.verify_lengths)
    return {
        "mode": "DFlash",
        "max_draft_len": block_size - 1,
        "num_verify_steps": len(steps),
        "acceptance_length": round(mean_acceptance_length(steps), 4),
        "draft_acceptance_rate": _round(draft_acceptance_rate(sum(accepted), sum(drafted)), 4),
        # position k = 1 .. block_size-1: share of verify steps (with a k-th draft) whose k-th draft was accepted
        "acceptance_rate_per_position": summary["acceptance_rate_per_position"],
        # k -> share of decoding steps that verified k tokens per request (k = 1: a plain AR step)
        "verify_length_distribution": {k: round(n / lengths.total(), 4) for k, n in sorted(lengths.items())},
        "num_decoding_steps": lengths.total(),
        # tokens committed per decoding step after the prefill (which commits each request's first token)
        "tokens_per_decoding_step": round(sum(len(r.output_token_ids) - 1 for r in results) / lengths.total(), 4)
        if lengths.total() else None,
        "num_draft_tokens_percentiles": percentiles(drafted),
        "num_accepted_draft_tokens_percentiles": percentiles(accepted),
        "draft_acceptance_rate_percentiles": percentiles([a / d for a, d in zip(accepted, drafted)]),
        "acceptance_length_percentiles": percentiles([mean_acceptance_length(r.acceptance_lengths) for r in verified]),
    }


def per_category(results: list[Result], categories: Mapping[str | int, str]) -> dict:
    """Per dataset category: requests, output tokens and (DFlash) acceptance length over its verify steps."""
    out: dict[str, dict] = {}
    for category in sorted(set(categories.values())):
        rs = [r for r in results if categories.get(r.request.id) == category]
        out[category] = {"num_requests": len(rs), "num_output_tokens": sum(len(r.output_token_ids) for r in rs),
                         "acceptance_length": round(mean_acceptance_length(all_steps(rs)), 4)}
    return out


def _round(x: float | None, ndigits: int) -> float | None:
    return None if x is None else round(x, ndigits)


def _per_user_speed(results: list[Result]) -> float | None:
    speeds = [1 / r.tpot_s for r in results if r.tpot_s]
    return sum(speeds) / len(speeds) if speeds else None


def summarize_runs(mode: str, block_size: int | str | None, concurrency: int, runs: list[TimedRun],
                   categories: Mapping[str | int, str], max_block: int | None = None) -> dict:
    """One point of the benchmark (mode, block size, concurrency) from its repeated runs.

    `block_size` "auto" (--block-size auto) needs `max_block`, the largest verify length it could choose."""
    max_block = max_block or (block_size if isinstance(block_size, int) else None)
    first = runs[0].results
    num_out = sum(len(r.output_token_ids) for r in first)
    # Same greedy requests, same schedule: every repeat must commit the same tokens.
    assert all(sum(len(r.output_token_ids) for r in run.results) == num_out for run in runs), "repeats differ"
    wall = statistics.median(run.wall_s for run in runs)
    timing = [summarize(mode, run.results, run.wall_s, max_block or 1) for run in runs]
    speed = [_per_user_speed(run.results) for run in runs]
    ttft, tpot = _median_block([t["ttft_ms"] for t in timing]), _median_block([t["tpot_ms"] for t in timing])
    latency = _median_block([t["request_latency_ms"] for t in timing])
    point = {
        "mode": mode,
        "block_size": block_size,
        "concurrency": concurrency,
        "repeats": len(runs),
        "request_info": {
            "num_requests": len(first),
            "peak_requests_in_flight": max(run.peak_in_flight for run in runs),
            "preemptions_per_run": max(run.preemptions for run in runs),
            "avg_input_length": round(sum(len(r.request.prompt_token_ids) for r in first) / len(first), 2),
            "avg_output_length": round(num_out / len(first), 2),
        },
        "performance": {
            "num_output_tokens": num_out,
            "total_latency_ms": round(wall * 1e3, 3),
            "total_latency_ms_per_repeat": [round(run.wall_s * 1e3, 3) for run in runs],
            "avg_request_latency_ms": latency["average"],
            "request_throughput_req_s": round(len(first) / wall, 4),
            "system_output_throughput_tok_s": round(num_out / wall, 3),
            "request_latency_percentiles_ms": latency,
        },
        "streaming_metrics": {
            "token_output_speed_tok_s": None if None in speed else round(statistics.median(speed), 3),
            "avg_ttft_ms": ttft["average"],
            "avg_tpot_ms": None if tpot is None else tpot["average"],
            "ttft_percentiles": ttft,
            "tpot_percentiles": tpot,
        },
        "decoding_stats": decoding_stats(first, max_block) if mode == "dflash" else None,
    }
    if categories:
        point["per_category"] = per_category(first, categories)
    return point
