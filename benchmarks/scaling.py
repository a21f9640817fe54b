"""Scaling figures: time per output token as the prompt grows, and as the DFlash block size varies (dflash vs ar).

    python benchmarks/scaling.py --engine engines/demo --lengths 128,256,512,1024,2048,4096 --block-sizes 4,8,16

Batch size 1, greedy, both modes on the same engine, alternating which goes first; TPOT is
trtllm-bench's time per output token after the first, (latency - TTFT) / (tokens - 1), averaged over
the prompts, median over repeats. Next to each point: the acceptance length and the speedup bound
AL x t_ar / (t_verify + t_draft) from the pass times at that context (runtime.compare.step_costs).

Long prompts are real code: a held-out prompt preceded by the held-out prompts before it, cut on the
left to the exact length, so every request still ends in a function to complete. A length that does
not fit the engine (prompt + --max-new-tokens > max_seq_len, itself <= the target's
max_position_embeddings, which `build` enforces) is replaced by the longest that fits, and the report
says so. Writes benchmarks/results/scaling.json and scaling.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch

from trtllm_dflash.bench.machine import describe, machine_info
from trtllm_dflash.runtime.compare import step_costs
from trtllm_dflash.runtime.decoding import Request, Result
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.stats import all_steps, mean_acceptance_length

ROOT = Path(__file__).resolve().parents[1]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def long_prompts(prompts: list[Request], length: int, count: int) -> list[Request]:
    """`count` requests of exactly `length` prompt tokens, each ending with one held-out prompt."""
    out = []
    for i in range(count):
        k = (len(prompts) - count + i) % len(prompts)  # the last prompts: the most context before them
        context: list[int] = []
        j = k
        while len(context) < length:
            context = prompts[j].prompt_token_ids + context
            j = (j - 1) % len(prompts)
        req = prompts[k]
        out.append(Request(id=f"{req.id}@{length}", prompt_token_ids=context[-length:],
                           max_new_tokens=req.max_new_tokens))
    return out


def _tpot_ms(results: list[Result]) -> float:
    values = [r.tpot_s for r in results if r.tpot_s is not None]
    return 1e3 * sum(values) / len(values)


def measure(engine: Engine, requests: list[Request], modes: tuple[str, ...], repeats: int) -> dict[str, dict]:
    """Per mode: median TPOT (ms) over repeats, mean acceptance length, output tokens; batch size 1."""
    tpots: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, list[Result]] = {}
    for mode in modes:  # warm-up at this shape
        list(engine.decoder(mode).generate(requests[:1]))
    for rep in range(repeats):
        results: dict[str, list[Result]] = {m: [] for m in modes}
        for i, req in enumerate(requests):
            order = modes if (rep + i) % 2 == 0 else modes[::-1]
            for mode in order:
                results[mode] += list(engine.decoder(mode).generate([req]))
        for mode in modes:
            tpots[mode].append(_tpot_ms(results[mode]))
            first.setdefault(mode, results[mode])
    out = {}
    for mode in modes:
        out[mode] = {"tpot_ms": round(statistics.median(tpots[mode]), 3),
                     "tpot_ms_per_repeat": [round(t, 3) for t in tpots[mode]],
                     "output_tokens": sum(len(r.output_token_ids) for r in first[mode]),
                     "acceptance_length": round(mean_acceptance_length(all_steps(first[mode])), 3)}
    if "ar" in out and "dflash" in out:
        out["dflash"]["outputs_identical_to_ar"] = all(
            a.output_token_ids == b.output_token_ids for a, b in zip(first["ar"], first["dflash"]))
    return out


def _point(engine: Engine, requests: list[Request], repeats: int, context_len: int) -> dict:
    modes = measure(engine, requests, ("ar", "dflash"), repeats)
    al = modes["dflash"]["acceptance_length"]
    costs = step_costs(engine.executor, context_len, context_rows=round(al))
    return {**modes,
            "measured_speedup": round(modes["ar"]["tpot_ms"] / modes["dflash"]["tpot_ms"], 3),
            "step_costs_ms": {"context_len": context_len, "ar": round(costs.ar_s * 1e3, 3),
                              "verify": round(costs.verify_s * 1e3, 3), "draft": round(costs.draft_s * 1e3, 3)},
            "speedup_bound": round(costs.speedup_bound(al), 3)}


def run(engine_dir: Path, prompts_path: Path, lengths: list[int], block_sizes: list[int], num_prompts: int,
        max_new_tokens: int, repeats: int, threads: int | None = None) -> dict:
    """`threads`: CPU threads (None: Engine.load's default)."""
    machine, started = machine_info(), datetime.datetime.now().isoformat(timespec="seconds")
    engine = Engine.load(engine_dir, threads=threads)
    cfg = engine.config
    defaults = Defaults(max_new_tokens, 0.0, 0, cfg.max_seq_len, engine.executor.vocab_size)
    prompts, errors = read_requests(prompts_path, engine.tokenizer, defaults)
    assert not errors, errors
    longest = cfg.max_seq_len - max_new_tokens
    fitted = sorted({min(n, longest) for n in lengths})
    skipped = [n for n in lengths if n > longest]
    target_limit = cfg.target.get("max_position_embeddings")
    report = {
        "date": started, "machine": machine,
        "engine": str(engine_dir), "prompts": str(prompts_path), "dtype": cfg.dtype, "batch_size": 1,
        "temperature": 0, "max_new_tokens": max_new_tokens, "num_prompts": num_prompts, "repeats": repeats,
        "max_seq_len": cfg.max_seq_len, "target_max_position_embeddings": target_limit,
        "requested_lengths": lengths,
        "length_note": None if not skipped else (
            f"prompt lengths {skipped} do not fit: the engine's max_seq_len is {cfg.max_seq_len} (the target's "
            f"max_position_embeddings is {target_limit}), so the longest prompt is {longest} tokens "
            f"+ {max_new_tokens} new"),
        "by_prompt_length": [], "by_block_size": [],
    }
    for n in fitted:
        row = {"prompt_len": n, **_point(engine, long_prompts(prompts, n, num_prompts), repeats,
                                          n + max_new_tokens // 2)}
        report["by_prompt_length"].append(row)
        print(f"prompt {n:5d}: ar {row['ar']['tpot_ms']:.2f} ms/token, dflash {row['dflash']['tpot_ms']:.2f} "
              f"(AL {row['dflash']['acceptance_length']:.2f}, speedup {row['measured_speedup']:.2f}x, "
              f"bound {row['speedup_bound']:.2f}x)", flush=True)
    natural = prompts[:num_prompts]
    context = int(sum(len(r.prompt_token_ids) for r in natural) / len(natural) + max_new_tokens / 2)
    for b in block_sizes:
        engine = Engine.load(engine_dir, block_size=b, threads=threads)
        row = {"block_size": b, **_point(engine, natural, repeats, context)}
        report["by_block_size"].append(row)
        print(f"block {b:3d}: ar {row['ar']['tpot_ms']:.2f} ms/token, dflash {row['dflash']['tpot_ms']:.2f} "
              f"(AL {row['dflash']['acceptance_length']:.2f}, speedup {row['measured_speedup']:.2f}x, "
              f"bound {row['speedup_bound']:.2f}x)", flush=True)
    return report


def markdown(report: dict) -> str:
    lines = [f"Batch size 1, greedy, {report['max_new_tokens']} new tokens, {report['num_prompts']} prompts per point, "
             f"medians of {report['repeats']} runs; TPOT = (latency - TTFT) / (tokens - 1); "
             f"{describe(report['machine'])}; {report['date']}", ""]
    if report["length_note"]:
        lines += [f"Note: {report['length_note']}.", ""]
    head = ("| AR TPOT (ms) | DFlash TPOT (ms) | AL | speedup | bound | AR step (ms) | verify pass (ms) | "
            "draft pass (ms) |")
    for key, label in (("by_prompt_length", "prompt tokens"), ("by_block_size", "block size")):
        lines += [f"| {label} {head}", "|---" * 9 + "|"]
        for row in report[key]:
            c = row["step_costs_ms"]
            first = row["prompt_len"] if key == "by_prompt_length" else row["block_size"]
            lines.append(f"| {first} | {row['ar']['tpot_ms']:.2f} | {row['dflash']['tpot_ms']:.2f} | "
                         f"{row['dflash']['acceptance_length']:.2f} | {row['measured_speedup']:.2f}x | "
                         f"{row['speedup_bound']:.2f}x | {c['ar']:.2f} | {c['verify']:.2f} | {c['draft']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from trtllm_dflash.bench.plot import require_matplotlib

    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = report["by_prompt_length"]
    x = [r["prompt_len"] for r in rows]
    for mode in ("ar", "dflash"):
        left.plot(x, [r[mode]["tpot_ms"] for r in rows], marker="o", label=mode)
    for r in rows:
        left.annotate(f"AL {r['dflash']['acceptance_length']:.2f}", (r["prompt_len"], r["dflash"]["tpot_ms"]),
                      textcoords="offset points", xytext=(0, -12), fontsize=7, ha="center")
    left.set_xscale("log", base=2)
    left.set_xticks(x, [str(n) for n in x])
    left.minorticks_off()
    left.set_xlabel("prompt length (tokens)")
    left.set_ylabel("time per output token, TPOT (ms)")
    left.set_title("TPOT vs prompt length (batch 1)" + (" - limited by max_seq_len" if report["length_note"] else ""))
    left.grid(alpha=0.3)
    left.legend()
    rows = report["by_block_size"]
    x = [r["block_size"] for r in rows]
    right.plot(x, [r["dflash"]["tpot_ms"] for r in rows], marker="o", label="dflash", color="C1")
    right.plot(x, [r["ar"]["tpot_ms"] for r in rows], marker="o", label="ar", color="C0")
    for r in rows:
        right.annotate(f"AL {r['dflash']['acceptance_length']:.2f}", (r["block_size"], r["dflash"]["tpot_ms"]),
                       textcoords="offset points", xytext=(0, -12), fontsize=7, ha="center")
    right.set_xticks(x)
    right.set_xlabel("DFlash block size")
    right.set_ylabel("time per output token, TPOT (ms)")
    right.set_title("TPOT vs block size (batch 1, held-out prompts)")
    right.set_ylim(bottom=0)
    left.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, default=ROOT / "engines" / "demo")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--lengths", type=_ints, default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--block-sizes", type=_ints, default=[4, 8, 16])
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per point")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "scaling.json")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "results" / "scaling.png")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.engine, args.prompts, args.lengths, args.block_sizes, args.num_prompts, args.max_new_tokens,
                 args.repeats, threads=args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.plot)
    print(markdown(report))


if __name__ == "__main__":
    main()
