"""The benchmark loop: for every mode, block size and concurrency, warm up, then time repeated closed-loop runs.

Concurrency C is a closed loop: at most C requests are submitted and unfinished at any time, and a new
one is submitted as soon as one finishes (trtllm-bench's `--concurrency`). C is bounded by the engine's
KV-cache slots (`max_batch_size`), so every submitted request decodes at once and none waits in a queue, unless a
paged KV cache (`--kv-cache-memory`) runs short of blocks: then some wait or are preempted (recomputed later), and each
point reports the most requests that were in flight (`peak_requests_in_flight`) and the preemptions of its worst run
(`preemptions_per_run`).

DFlash runs at each block size on the same engine directory, one engine load (a phase) per block size.
AR runs in every phase, back to back with that phase's DFlash runs, in alternating order, so a slow
drift of the machine hits both alike: a DFlash point's `speedup_vs_ar` divides by the AR runs of its
own phase (a shared machine can be 20% faster in one phase than in the next, more than the effects
measured). The AR point reported is the median over all phases' runs.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from trtllm_dflash.bench.datasets import (Conversations, Dataset, load_dataset, prompt_token_ids, read_system_prompt,
                                          to_requests)
from trtllm_dflash.bench.machine import machine_info
from trtllm_dflash.bench.metrics import TimedRun, summarize_runs
from trtllm_dflash.bench.options import BenchOptions
from trtllm_dflash.engine_dir import read_engine_config
from trtllm_dflash.errors import UserError
from trtllm_dflash.runtime.compare import step_costs
from trtllm_dflash.runtime.costs import PassCosts
from trtllm_dflash.runtime.decoding import Decoder, Mode, Request, Result
from trtllm_dflash.runtime.runner import Engine


def closed_loop(decoder: Decoder, requests: list[Request], concurrency: int,
                follow_up: Callable[[Result], Request | None] | None = None) -> TimedRun:
    """Run `requests` keeping at most `concurrency` submitted and unfinished; submit the next as one finishes: the
    finished one's `follow_up` if it has one (a conversation's next turn keeps its place), else the next request."""
    waiting = deque(requests)
    results = []
    peak, preemptions = 0, decoder.preemptions
    start = time.perf_counter()
    for _ in range(min(concurrency, len(waiting))):
        decoder.submit(waiting.popleft())
    while decoder.has_work:
        for update in decoder.step():
            if update.result is not None:
                results.append(update.result)
                after = follow_up(update.result) if follow_up is not None else None
                if after is not None:
                    decoder.submit(after)
                elif waiting:
                    decoder.submit(waiting.popleft())
        assert decoder.num_active <= concurrency
        peak = max(peak, decoder.num_active)
    return TimedRun(results, time.perf_counter() - start, peak, decoder.preemptions - preemptions)


def default_concurrency(max_batch_size: int, num_requests: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the engine's slots and the number of requests."""
    limit = min(max_batch_size, num_requests)
    return tuple(2 ** i for i in range(limit.bit_length()) if 2 ** i <= limit)


def _check_concurrency(concurrency: tuple[int, ...], max_batch_size: int, num_requests: int) -> None:
    for c in concurrency:
        if c > max_batch_size:
            raise UserError(f"--concurrency {c}: exceeds the engine's max_batch_size {max_batch_size} (KV-cache "
                            f"slots); rebuild the engine with a larger max_batch_size.")
        if c > num_requests:
            raise UserError(f"--concurrency {c}: more than the {num_requests} requests to run (see --num-requests).")


def _same_tokens(a: TimedRun, b: TimedRun) -> bool:
    tokens = {r.request.id: r.output_token_ids for r in a.results}
    return len(a.results) == len(b.results) and all(tokens.get(r.request.id) == r.output_token_ids for r in b.results)


def _check_block_sizes(engine_dir: Path, block_sizes: tuple[int | str | None, ...]) -> None:
    """Refuse a fixed block size the engine cannot run before Engine.load, which verifies every file's checksum
    and, with "auto" in the list, measures the pass costs (minutes). An unreadable config is left to Engine.load,
    which says what is wrong with the directory."""
    try:
        trained = read_engine_config(Path(engine_dir)).dflash.block_size
    except (UserError, OSError):
        return
    for k in block_sizes:
        if isinstance(k, int) and not 2 <= k <= trained:
            raise UserError(f"--block-sizes {k}: must be between 2 and the engine's trained block_size {trained}.")


def bench(engine_dir: Path, dataset_path: Path, opts: BenchOptions,
          progress: Callable[[str], None] = lambda line: None) -> dict:
    """Run the whole benchmark and return the report (see benchmarks/README.md for its fields)."""
    dataset = load_dataset(dataset_path)
    system = read_system_prompt(opts.system_prompt) if opts.system_prompt is not None else None
    if opts.multi_turn:
        Conversations.check(dataset)
    machine, started = machine_info(), datetime.datetime.now().isoformat(timespec="seconds")
    # Duplicates would only repeat points; AR alone needs no block size. One loaded engine serves every block size
    # (each a decoder of its own); with "auto" among them, the engine is loaded with it (its pass costs measured).
    block_sizes = tuple(dict.fromkeys(opts.block_sizes or (None,))) if "dflash" in opts.modes else (None,)
    trees = [int(b[4:]) for b in block_sizes if isinstance(b, str) and b.startswith("tree")]  # treeN: DDTree
    _check_block_sizes(engine_dir, block_sizes)
    engine = Engine.load(engine_dir, block_size="auto" if "auto" in block_sizes else None, command="bench",
                         backend=opts.backend, report=progress, threads=opts.threads,
                         kv_cache_memory=opts.kv_cache_memory, prefix_cache=opts.prefix_cache,
                         tree_budget=max(trees) if trees else None, prefix_states=opts.prefix_states)
    cfg = engine.config
    requests = to_requests(dataset, engine.tokenizer, opts.max_new_tokens, cfg.max_seq_len, opts.num_requests, system)
    conversations = (Conversations(dataset, engine.tokenizer, opts.max_new_tokens, cfg.max_seq_len, system)
                     if opts.multi_turn else None)
    follow_up = conversations.follow_up if conversations is not None else None
    categories = conversations.categories if conversations is not None else dataset.categories  # grows with turns
    timed_runs = 0
    concurrency = tuple(sorted(set(opts.concurrency or default_concurrency(cfg.max_batch_size, len(requests)))))
    _check_concurrency(concurrency, cfg.max_batch_size, len(requests))
    warmup = requests[: opts.warmup]
    context_len = int(sum(len(r.prompt_token_ids) for r in requests) / len(requests) + opts.max_new_tokens / 2)

    points, bounds = [], []
    cost_profile = None  # with auto: the measured step costs it chose from
    ar_all: dict[int, list[TimedRun]] = {c: [] for c in concurrency}  # every phase's AR runs, for the AR point
    for block_size in block_sizes:
        b: int | str = block_size or engine.executor.block_size
        engine.decoder("dflash", block_size=b)  # a block size the engine cannot run is refused before any run
        configs: list[tuple[Mode, int | None]] = []
        if "ar" in opts.modes:
            configs.append(("ar", None))
        if "dflash" in opts.modes:
            configs.append(("dflash", b))
        for mode, _ in configs:
            if warmup:
                closed_loop(engine.decoder(mode, block_size=b), warmup, min(len(warmup), max(concurrency)))
        runs: dict[tuple[Mode, int], list[TimedRun]] = {(m, c): [] for m, _ in configs for c in concurrency}
        costs = engine.auto_block.costs if b == "auto" else None
        for rep in range(opts.repeats):
            for c in concurrency:
                for mode, _ in (configs if rep % 2 == 0 else configs[::-1]):
                    run = closed_loop(engine.decoder(mode, block_size=b), requests, c, follow_up)
                    runs[mode, c].append(run)
                    timed_runs += 1
                    name = mode if mode == "ar" else f"dflash {_label(b)}"
                    progress(f"repeat {rep + 1}/{opts.repeats}: {name} C={c}: "
                             f"{run.wall_s:.2f} s")
        for c in concurrency:
            ar_all[c] += runs.get(("ar", c), [])
            if "dflash" in opts.modes:
                points.append(_dflash_point(b, c, runs, categories, _longest_step(engine, b)))
                progress(_progress_line(points[-1]))
        if "dflash" in opts.modes and isinstance(b, int):  # (the bound models chains of a fixed block)
            bounds.append(_speedup_bound(engine, context_len, points, b))
        if costs is not None:
            cost_profile = {"context_len": context_len, "step_ms": _step_costs_ms(costs, concurrency, context_len)}
    if "ar" in opts.modes:
        ar_points = [summarize_runs("ar", None, c, ar_all[c], categories) for c in concurrency]
        for p in ar_points:
            progress(_progress_line(p))
        points = ar_points + points
    return {
        "date": started,
        "machine": machine,
        "engine": str(engine_dir),
        "dataset": str(dataset_path),
        "dataset_format": dataset.format,
        "num_requests": len(requests),
        "workload": {  # what the requests share (docs/bench.md "Shared-prefix workloads")
            "system_prompt": None if opts.system_prompt is None else str(opts.system_prompt),
            "system_prompt_tokens": None if system is None else _system_tokens(engine, dataset, system),
            "multi_turn": opts.multi_turn,
            # conversations that ended before their last turn, which would not have fit max_seq_len (per run)
            "conversations_cut_per_run": (None if conversations is None else
                                          round(conversations.cut / max(timed_runs, 1), 2)),
        },
        "max_new_tokens": opts.max_new_tokens,
        "temperature": 0.0,
        "warmup": opts.warmup,
        "repeats": opts.repeats,
        "concurrency": list(concurrency),
        "modes": list(opts.modes),
        "max_batch_size": cfg.max_batch_size,
        "dtype": cfg.dtype,
        "backend": opts.backend or cfg.backend,  # the executor that ran (README "Backends")
        "points": points,
        "speedup_bound": bounds,
        "auto_step_costs": cost_profile,
        "kv_cache": _kv_cache_report(engine),
    }


def _system_tokens(engine: Engine, dataset: Dataset, system: str) -> int:
    """The tokens the system prompt adds to a request (the first prompt with it less the first without)."""
    first = dataset.prompts[0]
    return (len(prompt_token_ids(dataset, first, engine.tokenizer, system)) -
            len(prompt_token_ids(dataset, first, engine.tokenizer)))


def _kv_cache_report(engine: Engine) -> dict:
    """The KV cache the runs had: a paged cache's blocks (total, peak in use over every run, free at the end, prefix
    lookups; the sliding-window layers' rings apart), or the static slots (the compiled executors': their bytes, their
    prefix pool's blocks, bytes and lookups, and the positions per slot of onnxruntime's rings)."""
    tables = getattr(engine.executor, "kv_blocks", None)
    if tables is None:
        report = {"layout": "static", "slots": engine.config.max_batch_size}
        rows_bytes = getattr(engine.executor, "rows_bytes", None)  # the compiled executors' (cache_rows.StaticRows)
        if rows_bytes is not None:
            report["rows_bytes"] = rows_bytes
        ring = getattr(engine.executor, "window_ring", None)  # onnxruntime's sliding-window layers' rings
        if ring is not None:
            report["window_ring_positions"] = ring
        pool = getattr(engine.executor, "prefix_rows", None)  # the compiled executors' copied prompt blocks
        if pool is not None:
            looked_up = pool.prefix_blocks_looked_up
            report |= {"prefix_cache": True, "block_tokens": pool.block_tokens, "prefix_pool_blocks": pool.num_blocks,
                       "prefix_pool_bytes": pool.nbytes, "prefix_blocks_looked_up": looked_up,
                       "prefix_hit_rate": round(pool.prefix_blocks_hit / looked_up, 4) if looked_up else None}
        return report | _kept_states(engine.executor)
    looked_up = tables.prefix_blocks_looked_up
    report = {"layout": "paged", "block_tokens": tables.block_tokens, "blocks": tables.num_blocks,
              "peak_blocks_used": tables.peak_used, "blocks_free_at_end": tables.free,
              "prefix_cache": engine.executor.prefix_cache, "prefix_blocks_looked_up": looked_up,
              "prefix_hit_rate": round(tables.prefix_blocks_hit / looked_up, 4) if looked_up else None}
    rings = getattr(engine.executor, "window_blocks", None)
    if rings is not None:  # the sliding-window layers' own blocks
        report |= {"window_blocks": rings.num_blocks, "window_peak_blocks_used": rings.peak_used}
    return report | _kept_states(engine.executor)


def _kept_states(executor) -> dict:
    """A hybrid target's recurrent states kept for prefix reuse (runtime/prefix_states.py): how many fit, their bytes,
    how many were kept and how many requests resumed from one; nothing for other targets."""
    states = getattr(executor, "prefix_states", None)
    if states is None:
        return {}
    return {"kept_states": states.capacity, "kept_states_bytes": states.nbytes, "states_kept": states.kept,
            "requests_resumed": states.resumed}


def _dflash_point(b: int | str, c: int, runs: dict[tuple[Mode, int], list[TimedRun]],
                  categories: dict, max_block: int) -> dict:
    """The DFlash point at concurrency c, compared with the AR runs of its own phase (if AR ran)."""
    point = summarize_runs("dflash", b, c, runs["dflash", c], categories, max_block)
    if runs.get(("ar", c)):
        ar = summarize_runs("ar", None, c, runs["ar", c], categories)
        ar_tps, ar_tpot = ar["performance"]["system_output_throughput_tok_s"], ar["streaming_metrics"]["avg_tpot_ms"]
        point["ar_same_phase_tok_s"] = ar_tps
        point["speedup_vs_ar"] = round(point["performance"]["system_output_throughput_tok_s"] / ar_tps, 3)
        # The decode steps alone (TPOT leaves out the prefill, which both modes share): what the bound models.
        tpot = point["streaming_metrics"]["avg_tpot_ms"]
        point["tpot_speedup_vs_ar"] = None if not (tpot and ar_tpot) else round(ar_tpot / tpot, 3)
        point["outputs_identical_to_ar"] = _same_tokens(runs["ar", c][0], runs["dflash", c][0])
    return point


def _label(block_size: int | str) -> str:
    return block_size if isinstance(block_size, str) else f"b{block_size}"


def _longest_step(engine: Engine, block_size: int | str) -> int:
    """The most tokens a step of this point verifies: the block, auto's largest, a tree's nodes and anchor."""
    if isinstance(block_size, int):
        return block_size
    return engine.executor.block_size if block_size == "auto" else int(block_size[4:]) + 1


def _step_costs_ms(costs: PassCosts, concurrency: tuple[int, ...], context_len: int) -> dict:
    """Concurrency -> [cost of a step verifying k = 1 .. block_size tokens per request, ms] at the mean context."""
    top = costs.tokens[-1]
    return {c: [round(costs.step_seconds(c, context_len, k) * 1e3, 3) for k in range(1, top + 1)]
            for c in concurrency}


def _speedup_bound(engine: Engine, context_len: int, points: list[dict], block_size: int) -> dict:
    """Batch-1 bound AL x t_ar / (t_verify + t_draft) next to the speedup measured at concurrency 1."""
    dflash = [p for p in points if p["mode"] == "dflash" and p["block_size"] == block_size]
    al = dflash[0]["decoding_stats"]["acceptance_length"]  # same tokens at every concurrency
    costs = step_costs(engine.executor, context_len, context_rows=round(al or 1), block=block_size)
    at_1 = next((p for p in dflash if p["concurrency"] == 1), None)
    return {
        "block_size": block_size,
        "context_len": context_len,
        "step_costs_ms": {"ar": round(costs.ar_s * 1e3, 3), "verify": round(costs.verify_s * 1e3, 3),
                          "draft": round(costs.draft_s * 1e3, 3)},
        "acceptance_length": al,
        "speedup_bound": None if al is None else round(costs.speedup_bound(al), 3),
        "measured_speedup": None if at_1 is None else at_1.get("speedup_vs_ar"),
        "measured_tpot_speedup": None if at_1 is None else at_1.get("tpot_speedup_vs_ar"),
    }


def _progress_line(p: dict) -> str:
    name = p["mode"] if p["block_size"] is None else f"{p['mode']} {_label(p['block_size'])}"
    al = (p["decoding_stats"] or {}).get("acceptance_length")
    return (f"{name:>10} C={p['concurrency']:<3} {p['performance']['system_output_throughput_tok_s']:8.1f} tokens/s, "
            f"{p['streaming_metrics']['token_output_speed_tok_s'] or 0:7.1f} tps/user"
            + ("" if al is None else f", AL {al:.2f}"))
