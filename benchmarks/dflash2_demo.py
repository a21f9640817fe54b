"""DFlash2 against DFlash on the demo pair with the same training budget (issue 31): does the demo get a DFlash2 drafter?

    python benchmarks/dflash2_demo.py --work /tmp/dflash2_demo --steps 400 --prompts 600 --rounds 3

Both drafters continue the shipped demo drafter (`train-drafter --init-from`) for --steps steps on the same data (the
demo target's own responses to --prompts drafter-training prompts of train/demo_data.py, generated once and given to
both runs), with the same seed and settings, so both see the same batches: one stays DFlash, the other becomes DFlash2
(its convolutions start as the identity, its selector afresh: the reference's defaults, 2 taps, groups of 16, rank
256, top 16). A DFlash2 drafter from scratch would need the demo drafter's whole budget (37 min of training steps)
twice over; continuing isolates what the architecture adds for the same extra steps.

Then the shipped drafter and both continued ones, as engines of the demo target (`--backend`: torch, or onnxruntime as
the demo builds; 1 thread, greedy), decode the
held-out prompts (`benchmarks/prompts/heldout_code.jsonl`, never trained on) at batch 1 (one request after another)
and batch 8 (all at once); the engines alternate within every round, medians over rounds: acceptance length (all
committed tokens over all steps), tokens/s, and whether the tokens are plain decoding's.
Results: benchmarks/results/dflash2_demo.json (torch), dflash2_demo_onnxruntime.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from trtllm_dflash.outputs import write_marker
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trtllm_dflash" / "assets" / "demo"
# The shipped drafter's own training settings (trtllm_dflash/assets/demo/README.md), but for the steps and lr.
SETTINGS = ["--block-size", "16", "--num-layers", "2", "--target-layer-ids", "1", "5", "9", "13", "--batch-size", "8",
            "--anchors", "32", "--cache-features", "--seed", "0"]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "trtllm_dflash.cli", *args], check=True)


def train(work: Path, name: str, arch: str, steps: int, lr: float, prompts: Path) -> Path:
    """Continue the demo drafter as `arch` into work/name; the second run reuses the first's responses."""
    out = work / name
    if (out / "model.safetensors").exists():
        return out
    first = work / "dflash"
    if name != "dflash" and (first / "train_data.jsonl").exists():
        out.mkdir(parents=True, exist_ok=True)
        write_marker(out, "drafter")  # (a train-drafter output, which it resumes from: here, with its data)
        shutil.copy(first / "train_data.jsonl", out / "train_data.jsonl")
    began = time.perf_counter()
    cli("train-drafter", "--target", str(DEMO / "target"), "--data", str(prompts), "--output", str(out),
        "--init-from", str(DEMO / "drafter"), "--arch", arch, "--steps", str(steps), "--lr", str(lr),
        "--eval-every", str(steps), "--save-every", str(steps), *SETTINGS)
    (out / "wall_seconds.txt").write_text(f"{time.perf_counter() - began:.1f}\n")
    return out


def engine_dir(work: Path, name: str, drafter: Path, backend: str) -> Path:
    out = work / f"engine-{backend}-{name}"
    if (out / "config.json").exists():
        return out
    config = work / f"build-{backend}-{name}.yaml"
    config.write_text(json.dumps({"target": str(DEMO / "target"), "drafter": str(drafter), "output": str(out),
                                  "dtype": "float32", "backend": backend, "max_batch_size": 8, "max_seq_len": 2048}))
    cli("build", str(config), "--force")
    return out


def decode(engine: Engine, mode: str, requests: list[Request]) -> dict:
    start = time.perf_counter()
    results = list(engine.decoder(mode).generate(requests))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(r.output_token_ids) for r in results),
            "steps": sum(len(r.acceptance_lengths) for r in results),
            "committed": sum(sum(r.acceptance_lengths) for r in results),
            "outputs": {r.request.id: r.output_token_ids for r in results}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash2_demo"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--prompts", type=int, default=600, help="drafter-training prompts (the shipped drafter: 3000)")
    ap.add_argument("--num-prompts", type=int, default=16, help="held-out prompts decoded")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", choices=("torch", "onnxruntime"), default="torch",
                    help="the engines' executor (onnxruntime: each engine's graphs exported first, ~1 min each)")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    args.output = args.output or ROOT / "benchmarks" / "results" / (
        "dflash2_demo.json" if args.backend == "torch" else f"dflash2_demo_{args.backend}.json")
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = args.work / "drafter_prompts.jsonl"
    if not prompts.exists():
        subprocess.run([sys.executable, "-m", "trtllm_dflash.train.demo_data", "--held-out",
                        str(args.work / "unused_held_out.jsonl"), "--train", str(prompts), "--train-count",
                        str(args.prompts), "--seed", "1"], check=True)
    load_before = load()
    drafters = {"shipped DFlash": DEMO / "drafter",
                "DFlash +steps": train(args.work, "dflash", "dflash", args.steps, args.lr, prompts),
                "DFlash2 +steps": train(args.work, "dflash2", "dflash2", args.steps, args.lr, prompts)}
    training = {name: json.loads((path / "training.json").read_text())["state"]
                for name, path in drafters.items() if name != "shipped DFlash"}
    engines = {name: Engine.load(engine_dir(args.work, str(i), path, args.backend), threads=1)
               for i, (name, path) in enumerate(drafters.items())}
    any_engine = next(iter(engines.values()))
    texts = [json.loads(line)["prompt"] for line in open(ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
             if line.strip()][: args.num_prompts]
    requests = [Request(i, any_engine.tokenizer(t)["input_ids"], args.max_new_tokens) for i, t in enumerate(texts)]
    with torch.inference_mode():
        plain = decode(any_engine, "ar", requests)["outputs"]
        for engine in engines.values():  # warm-up
            decode(engine, "dflash", requests[:1])
        runs: dict[str, dict[str, list[dict]]] = {s: {n: [] for n in engines} for s in ("batch 1", "batch 8")}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                alone = [decode(engines[name], "dflash", [req]) for req in requests]
                runs["batch 1"][name].append({k: sum(a[k] for a in alone) for k in ("seconds", "tokens", "steps",
                                                                                    "committed")}
                                             | {"outputs": {k: v for a in alone for k, v in a["outputs"].items()}})
                runs["batch 8"][name].append(decode(engines[name], "dflash", requests))
                b1, b8 = runs["batch 1"][name][-1], runs["batch 8"][name][-1]
                print(f"round {r + 1} {name}: batch 1 {b1['tokens'] / b1['seconds']:.1f} tok/s (acceptance "
                      f"{b1['committed'] / b1['steps']:.2f}), batch 8 {b8['tokens'] / b8['seconds']:.1f} tok/s",
                      flush=True)
    table = {setting: {name: {"tokens_per_s": round(statistics.median(x["tokens"] / x["seconds"] for x in rs), 1),
                              "acceptance_length": round(statistics.median(x["committed"] / x["steps"] for x in rs),
                                                         3),
                              "same_tokens_as_plain": all(x["outputs"] == plain for x in rs)}
                       for name, rs in by_engine.items()}
             for setting, by_engine in runs.items()}
    report = {"backend": args.backend, "steps": args.steps, "lr": args.lr, "training_prompts": args.prompts, "settings": SETTINGS,
              "threads": 1, "prompts": len(requests), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "load_before": load_before, "load_after": load(),
              "training": {name: {"seconds_of_steps": round(t["seconds"], 1),
                                  "loss_first_20": round(statistics.mean(t["losses"][:20]), 4),
                                  "loss_last_20": round(statistics.mean(t["losses"][-20:]), 4),
                                  "held_out_acceptance": t["evals"][-1]["acceptance_length"] if t["evals"] else None}
                           for name, t in training.items()},
              "results": table}
    print(json.dumps(report, indent=1))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
