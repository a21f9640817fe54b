"""Baselines side by side at batch size 1: HF transformers generate(), HF prompt-lookup decoding, our AR and DFlash.

    python benchmarks/baselines.py --engine engines/demo --num-prompts 16 --repeats 3

All four decode the same held-out prompts greedily with the same target weights in the same process:
transformers' `generate()` (plain greedy AR) and its prompt-lookup assisted generation
(`prompt_lookup_num_tokens`, n-gram drafts copied from the prompt, verified by the target) on the HF
directory the engine was built from, loaded in the engine's dtype; our `ar` and `dflash` modes on the
engine. Each prompt runs every method once per repeat, in an order that rotates from prompt to prompt;
times are medians over repeats of the summed per-prompt times (prefill included, as in `compare`).
Writes benchmarks/results/baselines.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trtllm_dflash.bench.machine import describe, machine_info
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("hf_generate", "hf_prompt_lookup", "ar", "dflash")


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def decoders(engine: Engine, hf_model, prompt_lookup_num_tokens: int) -> dict[str, Callable[[Request], list[int]]]:
    """Method name -> a function that decodes one request greedily and returns its output tokens."""
    eos = list(engine.config.eos_token_ids)

    def hf(request: Request, **extra) -> list[int]:
        ids = torch.tensor([request.prompt_token_ids])
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_new_tokens,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **extra)
        return out[0, ids.shape[1]:].tolist()

    def ours(mode: str) -> Callable[[Request], list[int]]:
        return lambda request: next(iter(engine.decoder(mode).generate([request]))).output_token_ids

    return {
        "hf_generate": hf,
        "hf_prompt_lookup": lambda r: hf(r, prompt_lookup_num_tokens=prompt_lookup_num_tokens),
        "ar": ours("ar"),
        "dflash": ours("dflash"),
    }


def run(engine_dir: Path, target_dir: Path, prompts: Path, num_prompts: int, max_new_tokens: int, repeats: int,
        prompt_lookup_num_tokens: int = 10, block_size: int | str | None = None, backend: str | None = None,
        threads: int | None = None) -> dict:
    """`block_size`: our dflash's (an integer, "auto", or None: the engine's); `backend`: our executor (None: what
    the engine was compiled for); `threads`: CPU threads (None: Engine.load's default)."""
    machine, started = machine_info(), datetime.datetime.now().isoformat(timespec="seconds")
    engine = Engine.load(engine_dir, block_size=block_size, backend=backend, threads=threads)
    hf_model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, engine.config.dtype)).eval()
    defaults = Defaults(max_new_tokens, 0.0, 0, engine.config.max_seq_len, engine.executor.vocab_size)
    requests, errors = read_requests(prompts, engine.tokenizer, defaults)
    assert not errors, errors
    requests = requests[:num_prompts]
    decode = decoders(engine, hf_model, prompt_lookup_num_tokens)
    for name, fn in decode.items():  # warm-up
        fn(requests[0])
    seconds = {m: [0.0] * repeats for m in METHODS}
    outputs: dict[str, list[list[int]]] = {m: [] for m in METHODS}
    for rep in range(repeats):
        for i, request in enumerate(requests):
            shift = (rep + i) % len(METHODS)
            for method in METHODS[shift:] + METHODS[:shift]:
                start = time.perf_counter()
                tokens = decode[method](request)
                seconds[method][rep] += time.perf_counter() - start
                if rep == 0:
                    outputs[method].append(tokens)
    reference = outputs["ar"]
    methods = {}
    for m in METHODS:
        tokens = sum(len(o) for o in outputs[m])
        agreeing = sum(sum(1 for a, b in zip(o, ref) if a == b) for o, ref in zip(outputs[m], reference))
        median_s = statistics.median(seconds[m])
        methods[m] = {
            "seconds": round(median_s, 4),
            "seconds_per_repeat": [round(s, 4) for s in seconds[m]],
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / median_s, 2),
            "outputs_identical_to_ar": outputs[m] == reference,
            "tokens_agreeing_with_ar": round(agreeing / max(1, sum(len(r) for r in reference)), 4),
        }
    hf_tps = methods["hf_generate"]["tokens_per_s"]
    for m in METHODS:
        methods[m]["speedup_vs_hf_generate"] = round(methods[m]["tokens_per_s"] / hf_tps, 3)
        methods[m]["speedup_vs_ar"] = round(methods[m]["tokens_per_s"] / methods["ar"]["tokens_per_s"], 3)
    return {
        "date": started, "machine": machine,
        "engine": _rel(engine_dir), "target": _rel(target_dir), "prompts": _rel(prompts),
        "dtype": engine.config.dtype, "num_prompts": len(requests), "max_new_tokens": max_new_tokens,
        "repeats": repeats, "batch_size": 1, "temperature": 0,
        "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
        "block_size": "auto" if block_size == "auto" else engine.executor.block_size,
        "methods": methods,
    }


LABELS = {"hf_generate": "HF transformers generate() (greedy AR)",
          "hf_prompt_lookup": "HF prompt-lookup decoding",
          "ar": "trtllm-dflash ar", "dflash": "trtllm-dflash dflash"}


def markdown(report: dict) -> str:
    lines = [f"{report['num_prompts']} held-out prompts, batch size 1, greedy, {report['max_new_tokens']} new tokens, "
             f"{report['dtype']}, medians of {report['repeats']} runs; prompt lookup with "
             f"{report['prompt_lookup_num_tokens']} tokens; DFlash block {report['block_size']}; "
             f"{describe(report['machine'])}; {report['date']}", "",
             "| method | output tokens | seconds | tokens/s | vs HF generate() | vs our ar | "
             "tokens agreeing with our ar |",
             "|---|---|---|---|---|---|---|"]
    for m, row in report["methods"].items():
        lines.append(f"| {LABELS[m]} | {row['output_tokens']} | {row['seconds']:.2f} | {row['tokens_per_s']:.1f} | "
                     f"{row['speedup_vs_hf_generate']:.2f}x | {row['speedup_vs_ar']:.2f}x | "
                     f"{100 * row['tokens_agreeing_with_ar']:.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, default=ROOT / "engines" / "demo")
    p.add_argument("--target", type=Path, default=ROOT / "trtllm_dflash" / "assets" / "demo" / "target",
                   help="the HF directory the engine's target was built from")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    p.add_argument("--threads", type=int)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "baselines.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.engine, args.target, args.prompts, args.num_prompts, args.max_new_tokens, args.repeats,
                 args.prompt_lookup_num_tokens, threads=args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
