"""onnxruntime engines whose sliding-window layers keep rings against full-length caches, side by side (issue 29).

    git worktree add /tmp/before 83c4b3d        # the last commit whose onnxruntime engines keep full-length caches
    python benchmarks/window_rings.py --before /tmp/before --rounds 3

A random gpt-oss-shaped pair (8 layers alternating sliding / full, window 128 as gpt-oss's, hidden 192, 4 experts of
which 2 per token, drafter of 2 layers, block 8) is built twice with `backend: onnxruntime`, max_seq_len 2048, 8 slots:
by this checkout (sliding layers in rings of 128 + 128 positions) and by `--before` (every layer max_seq_len + 8
positions). Both engines run under this checkout's runtime (which runs the older engine as it always has), in fresh
processes, 1 thread, rounds interleaved (their order alternating), medians: time to first token of one 1536-token prompt
(a prefill: the ring engine runs it in 12 passes of 128), and decoding tokens/s of 8 such prompts at batch 1 (one after
another) and 8 concurrent, plain (ar) and DFlash, greedy, 64 new tokens. Every run's tokens must equal the first run's.
Writes benchmarks/results/window_rings.json with the KV-cache bytes of each engine (the executor's rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW, PROMPT, NEW = 128, 1536, 64

BUILD = r'''
import json, sys
from pathlib import Path
from trtllm_dflash.config import BuildConfig
from trtllm_dflash.engine.builder import build_engine
pair, out = Path(sys.argv[1]), Path(sys.argv[2])
build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32", max_batch_size=8,
                         max_seq_len=2048, backend="onnxruntime", output=out), progress=False)
'''

CHILD = r'''
import json, sys, time
import torch
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine
a = json.loads(sys.argv[1])
engine = Engine.load(a["engine"], backend="onnxruntime", threads=1)
torch.set_num_threads(1)
ex = engine.executor
kv_bytes = sum(b.untyped_storage().nbytes() for c in (ex._target, ex._drafter) for _, b in c.named())
out = {"kv_cache_bytes": kv_bytes, "window_ring": getattr(ex, "window_ring", None), "runs": {}}
prompts = a["prompts"]
for mode in ("ar", "dflash"):
    decoder = engine.decoder(mode)
    list(decoder.generate([Request("warm-up", prompts[0][:64], 4)]))
    t = time.perf_counter()
    list(decoder.generate([Request("ttft", prompts[0], 1)]))
    ttft = time.perf_counter() - t
    for batch in (1, 8):
        reqs = [Request(i, p, a["new"]) for i, p in enumerate(prompts)]
        t = time.perf_counter()
        res = ([r for q in reqs for r in decoder.generate([q])] if batch == 1 else list(decoder.generate(reqs)))
        seconds = time.perf_counter() - t
        res.sort(key=lambda r: r.request.id)
        out["runs"][f"{mode} {batch}"] = {"seconds": seconds, "ttft_s": ttft,
                                          "tokens": [r.output_token_ids for r in res]}
print(json.dumps(out))
'''


def child(code: str, args: list[str], pythonpath: Path) -> str:
    """Run `code` with `args` in a fresh process importing trtllm_dflash from the checkout `pythonpath`: its stdout."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
    # (cwd too: the build's `python -m` rank exports put their working directory first on sys.path)
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=pythonpath, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        sys.exit(f"a child failed:\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout whose onnxruntime engines keep full caches")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "window_rings.json")
    a = ap.parse_args()
    import torch

    from trtllm_dflash.train.random_pair import write_random_pair

    started, load = time.time(), " ".join(Path("/proc/loadavg").read_text().split()[:3])
    with tempfile.TemporaryDirectory() as tmp:
        pair = Path(tmp) / "pair"
        write_random_pair(pair, "gpt_oss", hidden_size=192, num_layers=8, head_dim=64, intermediate_size=256, seed=0)
        config = json.loads((pair / "target" / "config.json").read_text())
        (pair / "target" / "config.json").write_text(json.dumps(config | {"sliding_window": WINDOW}))
        engines = {"rings": Path(tmp) / "rings", "full": Path(tmp) / "full"}
        for name, checkout in (("rings", ROOT), ("full", a.before.resolve())):
            child(BUILD, [str(pair), str(engines[name])], checkout)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 500, (PROMPT,), generator=g).tolist() for _ in range(8)]
        samples: dict[tuple[str, str], list[dict]] = {}
        facts, reference, same = {}, {}, True
        for r in range(a.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                got = json.loads(child(CHILD, [json.dumps({"engine": str(engines[name]), "prompts": prompts,
                                                           "new": NEW})], ROOT))
                facts[name] = {"kv_cache_bytes": got["kv_cache_bytes"], "window_ring": got["window_ring"]}
                if (got["window_ring"] is None) != (name == "full"):
                    sys.exit(f"the {name} engine has window_ring {got['window_ring']}: --before must be a checkout "
                             "from before the rings (83c4b3d)")
                for key, run in got["runs"].items():
                    same &= reference.setdefault(key, run["tokens"]) == run["tokens"]
                    samples.setdefault((name, key), []).append(run)
                print(f"round {r} {name}: " + ", ".join(f"{k} {len(v['tokens']) * NEW / v['seconds']:.1f} tok/s"
                                                      for k, v in got["runs"].items()), file=sys.stderr, flush=True)
    rows = []
    for (name, key), runs in samples.items():
        rows.append({"engine": name, "policy": key.split()[0], "batch": int(key.split()[1]),
                     "tok_s": round(statistics.median(len(x["tokens"]) * NEW / x["seconds"] for x in runs), 1),
                     "ttft_ms": round(1000 * statistics.median(x["ttft_s"] for x in runs), 1),
                     "samples_tok_s": [round(len(x["tokens"]) * NEW / x["seconds"], 1) for x in runs]})
    ratio = {f"{row['policy']} {row['batch']}": round(row["tok_s"] / next(
        f["tok_s"] for f in rows if f["engine"] == "full" and (f["policy"], f["batch"]) == (row["policy"], row["batch"])),
        3) for row in rows if row["engine"] == "rings"}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "minutes": round((time.time() - started) / 60, 1),
              "load_at_start": load, "threads": 1, "rounds": a.rounds, "window": WINDOW, "prompt_tokens": PROMPT,
              "new_tokens": NEW, "tokens_identical": same, "engines": facts, "rings_over_full_tok_s": ratio,
              "rows": rows}
    a.output.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("tokens_identical", "engines", "rings_over_full_tok_s")}, indent=1))


if __name__ == "__main__":
    main()
