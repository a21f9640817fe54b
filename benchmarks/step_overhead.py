"""Per-token host overhead of the decode step: step wall time minus the time of the executor's passes, two checkouts
of trtllm-dflash side by side (issue 28: "before and after").

    python benchmarks/step_overhead.py --before /tmp/before --engine engines/demo --engine-before /tmp/demo-old \\
        --backends torch,onnxruntime --rounds 3

Each (checkout, backend, mode) runs in a fresh process of its own (the checkout first on sys.path), in rounds whose
order alternates, batch 1 (`--batch`), 1 thread, greedy, the same held-out prompts. A process wraps its executor's
passes (target_forward, draft, append_context, accept) with timers and times every Decoder.step; it reports per token:
wall time, pass time and their difference, the host overhead (the Decoder's Python, staging, sampling and
commit, plus everything an executor does around its kernels: binding, slicing, copying). The medians over rounds go
to benchmarks/results/step_overhead.json with the load average at each run.

`--before` is a checkout of an earlier commit (`git worktree add /tmp/before <commit>`), or any source tree of
trtllm-dflash (a `git archive` with one change reverted); its engine may need to be built by that checkout
(`--engine-before`) when the engine format changed in between. `--batch N` decodes the prompts N at a time (submitted
together; the step that admits them holds their prefills and is not counted), `--kv-cache-memory SIZE` on a paged KV
cache of that size (torch executor, as `run --kv-cache-memory`), on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time
import torch
torch.set_num_threads(1)
from pathlib import Path
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine

engine_dir, backend, mode, prompts_path, num_prompts, max_new_tokens, batch, kv_cache_memory = sys.argv[1:9]
paged = {"kv_cache_memory": kv_cache_memory} if kv_cache_memory else {}
try:
    engine = Engine.load(Path(engine_dir), backend=backend, threads=1, **paged)
except TypeError:  # a checkout before Engine.load took threads
    engine = Engine.load(Path(engine_dir), backend=backend, **paged)
ex = engine.executor
passes = [0.0]
for name in ("target_forward", "draft", "append_context", "accept"):
    real = getattr(ex, name)
    def timed(*args, _real=real, **kwargs):
        t = time.perf_counter()
        try:
            return _real(*args, **kwargs)
        finally:
            passes[0] += time.perf_counter() - t
    setattr(ex, name, timed)
prompts = [json.loads(line)["prompt"] for line in open(prompts_path) if line.strip()][: int(num_prompts)]
requests = [Request(i, engine.tokenizer(p)["input_ids"], int(max_new_tokens)) for i, p in enumerate(prompts)]
decoder = engine.decoder(mode)
for _ in decoder.generate(requests[:1]):  # warm-up
    pass
wall, pass_s, tokens, steps = 0.0, 0.0, 0, 0
batch = int(batch)
for i in range(0, len(requests), batch):
    for request in requests[i:i + batch]:
        decoder.submit(request)
    first = True  # the step that admits the requests holds their prefills: not a decode step
    while decoder.has_work:
        before, t = passes[0], time.perf_counter()
        updates = decoder.step()
        elapsed = time.perf_counter() - t
        if not first:
            wall += elapsed
            pass_s += passes[0] - before
            steps += 1
            tokens += sum(len(u.new_token_ids) for u in updates)
        first = False
print(json.dumps({"wall_s": wall, "pass_s": pass_s, "tokens": tokens, "steps": steps}))
'''


def one_run(checkout: Path, engine: Path, backend: str, mode: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, str(engine), backend, mode, str(args.prompts),
                          str(args.num_prompts), str(args.max_new_tokens), str(args.batch), args.kv_cache_memory or ""],
                         env=env, capture_output=True, text=True, cwd=checkout, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{checkout} {backend} {mode}: {out.stderr.strip().splitlines()[-3:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {**r, "load_before": round(load, 2),
            "ms_per_token": 1e3 * r["wall_s"] / r["tokens"],
            "pass_ms_per_token": 1e3 * r["pass_s"] / r["tokens"],
            "host_ms_per_token": 1e3 * (r["wall_s"] - r["pass_s"]) / r["tokens"],
            "host_ms_per_step": 1e3 * (r["wall_s"] - r["pass_s"]) / r["steps"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the earlier commit")
    p.add_argument("--engine", type=Path, default=ROOT / "engines" / "demo", help="built by this checkout")
    p.add_argument("--engine-before", type=Path, help="built by the earlier checkout (default: --engine)")
    p.add_argument("--backends", default="torch,onnxruntime")
    p.add_argument("--modes", default="ar,dflash")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="requests decoded at once")
    p.add_argument("--kv-cache-memory", metavar="SIZE", help="a paged KV cache of SIZE for the torch executor "
                   "(default: the static slots)")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "step_overhead.json")
    a = p.parse_args()
    sides = {"before": (a.before.resolve(), (a.engine_before or a.engine).resolve()), "after": (ROOT, a.engine.resolve())}
    cells = [(side, backend, mode) for backend in a.backends.split(",") for mode in a.modes.split(",")
             for side in sides]
    samples: dict[tuple, list[dict]] = {c: [] for c in cells}
    started = time.time()
    for r in range(a.rounds):
        for cell in (cells if r % 2 == 0 else cells[::-1]):
            side, backend, mode = cell
            samples[cell].append(one_run(*sides[side], backend, mode, a))
            print(f"round {r + 1} {side} {backend} {mode}: {samples[cell][-1]['ms_per_token']:.2f} ms/token, host "
                  f"{samples[cell][-1]['host_ms_per_token']:.2f}", file=sys.stderr, flush=True)
    rows = []
    for cell in cells:
        side, backend, mode = cell
        med = {k: round(statistics.median(s[k] for s in samples[cell]), 3)
               for k in ("ms_per_token", "pass_ms_per_token", "host_ms_per_token", "host_ms_per_step")}
        rows.append({"side": side, "backend": backend, "mode": mode, **med, "samples": samples[cell]})
    before_rev = subprocess.run(["git", "-C", str(a.before), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or str(a.before)  # a source tree without git
    after_rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                               text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "before": before_rev, "after": after_rev,
              "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "threads": 1,
              "batch": a.batch, "kv_cache_memory": a.kv_cache_memory,
              "cpus": len(os.sched_getaffinity(0)), "minutes": round((time.time() - started) / 60, 1), "rows": rows}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(report, indent=1) + "\n")
    print("| backend | mode | side | ms / token | passes ms / token | host ms / token | host ms / step |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['backend']} | {row['mode']} | {row['side']} | {row['ms_per_token']:.2f} | "
              f"{row['pass_ms_per_token']:.2f} | {row['host_ms_per_token']:.2f} | {row['host_ms_per_step']:.2f} |")


if __name__ == "__main__":
    main()
