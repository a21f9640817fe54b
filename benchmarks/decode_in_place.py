"""One-token target passes on onnxruntime with and without target_decode.onnx, side by side (issue 28).

    python benchmarks/decode_in_place.py --engine /tmp/peers/demo --rounds 3

`--engine`: the demo built with `backend: onnxruntime` by this trtllm-dflash (it has target_decode.onnx: each layer's
cache write and attention one GroupQueryAttention node reading the cache in place). "without" is a copy of that engine
(hard links) minus target_decode.onnx, which the executor then runs through target_step (a Slice of each layer's
attended prefix, then Attention), as engines built before it do. Same prompts as benchmarks/peers_cpu.py (the first 8
held-out code prompts, tokenized by the demo tokenizer), 64 new tokens, greedy, 1 thread, a fresh process per (round,
form, policy), loading and one warm-up request untimed; batch 1 (one request after another) and 8 concurrent; plain
decoding (`ar`) and DFlash with `--block-size auto`; rounds interleave the two forms (their order alternates), medians.
Each run has a cache directory of its own (TRTLLM_DFLASH_CACHE_DIR): auto measures its pass costs at warm-up and starts
from the flat acceptance prior, in both forms alike. Every run's token ids must equal the first run's. Writes
benchmarks/results/decode_in_place.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_cpu import DEMO, OURS, ROOT  # noqa: E402 (our rows' child script: load, warm up, time batch 1 and 8)

def without_decode_graph(engine: Path, out: Path) -> Path:
    """A hard-linked copy of `engine` without target_decode.onnx, its manifest rewritten."""
    from trtllm_dflash.engine_dir import graph_dir, write_manifest

    copy = out / "without"
    shutil.copytree(engine, copy, copy_function=os.link)
    (graph_dir(copy, 0) / "target_decode.onnx").unlink()
    (copy / "manifest.json").unlink()  # (a hard link to the engine's own: write a new file, not through the link)
    write_manifest(copy)
    return copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("/tmp/peers/demo"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "decode_in_place.json")
    a = ap.parse_args()
    from trtllm_dflash.engine_dir import graph_dir

    if not (graph_dir(a.engine, 0) / "target_decode.onnx").is_file():
        sys.exit(f"{a.engine} has no target_decode.onnx: .venv/bin/trtllm-dflash build build_configs/demo.yaml "
                 f"--output {a.engine} --force")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO / "target"))
    prompts_file = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"
    texts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines() if line.strip()][:8]
    prompts = [tok(t)["input_ids"] for t in texts]
    policies = {"ar": ("ar", None), "dflash auto": ("dflash", "auto")}
    samples: dict[tuple[str, str, int], list[float]] = {}
    reference: dict[tuple[str, int], list] = {}
    same = True
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    started = time.time()
    with tempfile.TemporaryDirectory(dir=a.engine.parent) as tmp:
        forms = {"with target_decode": a.engine, "without (target_step)": without_decode_graph(a.engine, Path(tmp))}
        for r in range(a.rounds):
            order = list(forms.items()) if r % 2 == 0 else list(forms.items())[::-1]
            for policy, (mode, block) in policies.items():
                for form, engine in order:
                    args = {"engine": str(engine), "backend": "onnxruntime", "threads": 1, "mode": mode,
                            "block": block, "prompts": prompts, "max_new": a.max_new_tokens,
                            "batches": [1, 8] if r % 2 == 0 else [8, 1]}
                    # a cache directory of its own: every run measures its pass costs (untimed, at warm-up) and
                    # starts from the flat acceptance prior, so no form inherits what an earlier run learned
                    cache = Path(tmp) / f"cache-{r}-{policy}-{form}".replace(" ", "_")
                    out = subprocess.run([sys.executable, "-c", OURS, json.dumps(args)], capture_output=True,
                                         text=True, check=True, env={**os.environ, "TRTLLM_DFLASH_CACHE_DIR": str(cache)})
                    for batch, run in json.loads(out.stdout.strip().splitlines()[-1])["runs"].items():
                        tokens = sum(map(len, run["tokens"]))
                        samples.setdefault((policy, form, int(batch)), []).append(tokens / run["seconds"])
                        same &= reference.setdefault((policy, int(batch)), run["tokens"]) == run["tokens"]
                    print(f"round {r + 1} {policy} {form}: " + ", ".join(
                        f"b{k} {v[-1]:.1f} tok/s" for (p, f, k), v in samples.items() if (p, f) == (policy, form)),
                        file=sys.stderr, flush=True)
    rows = []
    for policy in policies:
        for batch in (1, 8):
            tok_s = {form: statistics.median(samples[(policy, form, batch)]) for form in forms}
            with_, without = tok_s.values()
            rows.append({"policy": policy, "batch": batch, **{f"{k} tok/s": round(v, 1) for k, v in tok_s.items()},
                         "ratio": round(with_ / without, 2),
                         "runs": {k: [round(x, 1) for x in samples[(policy, k, batch)]] for k in forms}})
            print(f"| {policy} | {batch} | {with_:.1f} | {without:.1f} | {with_ / without:.2f}x |")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "engine": str(a.engine), "rounds": a.rounds, "threads": 1,
              "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "load_before": load,
              "load_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
              "minutes": round((time.time() - started) / 60, 1), "tokens_identical": same, "rows": rows}
    a.output.write_text(json.dumps(report, indent=1) + "\n")
    if not same:
        sys.exit("the two forms' tokens differ")


if __name__ == "__main__":
    main()
