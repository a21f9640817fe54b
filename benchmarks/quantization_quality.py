"""Quality of quantized demo engines: greedy agreement with the unquantized target and acceptance length.

    python benchmarks/quantization_quality.py --num-prompts 16 --max-new-tokens 64

Builds the demo pair with quantization none / fp8 / nvfp4, the quantized ones also with the drafter
quantized (`quantize_drafter`; ModelOpt on the CPU, calibrated on the default stdlib code set), runs
greedy DFlash on held-out prompts, and reports for each: the share of output tokens equal to the
unquantized engine's (position by position until the first difference, and overall), the mean
acceptance length, and whether DFlash equals AR on that same engine. Writes
benchmarks/results/quantization_quality.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch

from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.stats import all_steps, mean_acceptance_length

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "build_configs" / "demo.yaml")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "quantization_quality.json")
    args = p.parse_args()
    outputs, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for quant, drafter in (("none", False), ("fp8", False), ("fp8", True), ("nvfp4", False), ("nvfp4", True)):
            name = quant + (" + drafter" if drafter else "")
            cfg = load_build_config(args.config, output=Path(tmp) / name.replace(" + ", "_")).model_copy(
                update={"quantization": quant, "quantize_drafter": drafter})
            engine = Engine.load(build_engine(cfg, progress=False))
            defaults = Defaults(args.max_new_tokens, 0.0, 0, engine.config.max_seq_len, engine.executor.vocab_size)
            requests, errors = read_requests(args.prompts, engine.tokenizer, defaults)
            assert not errors, errors
            requests = requests[: args.num_prompts]
            dflash = {r.request.id: r for r in engine.decoder("dflash").generate(requests)}
            ar = {r.request.id: r for r in engine.decoder("ar").generate(requests)}
            outputs[name] = {i: r.output_token_ids for i, r in dflash.items()}
            al = mean_acceptance_length(all_steps(dflash.values()))
            row = {"quantization": name, "mean_acceptance_length": round(al, 3),
                   "dflash_equals_ar": all(dflash[i].output_token_ids == ar[i].output_token_ids for i in dflash)}
            if quant != "none":
                ref, out = outputs["none"], outputs[name]
                prefix = [next((k for k, (a, b) in enumerate(zip(out[i], ref[i])) if a != b),
                               min(len(ref[i]), len(out[i]))) for i in ref]
                same = sum(sum(a == b for a, b in zip(out[i], ref[i])) for i in ref)
                row |= {"identical_outputs": sum(out[i] == ref[i] for i in ref) / len(ref),
                        "mean_agreeing_prefix_tokens": round(sum(prefix) / len(prefix), 2),
                        "token_agreement": round(same / sum(len(ref[i]) for i in ref), 3)}
            rows.append(row)
            print(row, flush=True)
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "results": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
