#!/usr/bin/env python3
"""One prepared check of trtllm-dflash on a machine with an NVIDIA GPU, in at most 8 minutes, in one command (what it
covers: docs/backends.md §What a CPU machine cannot show). On the GPU machine, from the repository root:

    python3 benchmarks/gpu_check.py --out gpu_check.json [--stages executor,decoder,kernel,timings,tensorrt]

No install step: the stages import this checkout's package. What that machine's Python lacks (pydantic and its
dependencies, a transformers within this project's pin, ...) comes as wheels that `benchmarks/gpu_wheels.sh` downloads
into gpu_wheels/ on a machine with a network; gpu_check installs them (pip --no-index --no-deps --target) into its own
temporary directory, ahead of the machine's site-packages, and changes nothing else there (--wheels DIR).

First a preflight (in the report's `preflight` section): the wheels installed, every module each stage imports
tried, transformers' version checked against this project's pin. A stage whose imports fail is skipped with the
reason. Stages (each in a child process of its own, stopped when it overruns its share of --budget-s):
  executor  the demo engine (built from build_configs/demo.yaml into a temporary directory, fp32) decodes held-out
            prompts as one batch on `cuda` and on the CPU, greedy, in `ar` and `dflash` mode: the tokens must be
            identical or differ only at near-ties (at the first differing position the two tokens' logits are
            within NEAR_TIE on both devices: another kernel's rounding, not a bug), and dflash must equal ar (greedy,
            sampled, and sampled with top-p on the GPU); each prompt decoded alone must equal it in the batch
  decoder   a random bf16 pair of Qwen3-8B layer shapes in the real Decoder loop: host syncs and host time per
            step, end-to-end tokens/s (AR, DFlash, DFlash with every draft forced correct), which SDPA kernels a
            verify pass launches, KVCache.read against context (1k / 8k / 32k), peak memory over a 4k-token prefill,
            and the TF32 settings
  kernel    the DFlashAccept CUDA kernel (plugins/dflash/) built with nvcc for this GPU: kernel_check.cu run as is
            and under compute-sanitizer (memcheck) where it is installed, and the kernel as a shared library driven
            from torch CUDA tensors against trtllm_dflash.speculative.core on random greedy / sampled / tied /
            non-finite cases, fp32/fp16/bf16; its time at batch 1, 8 and 32 against the same step in torch ops
  timings   AR step (1 token), verify pass (block) and draft pass at batch 1, 8, 32 and a ~1024-token context
            for a random bf16 pair of Qwen3-8B layer shapes (4 target layers, 1 draft layer), eager and
            replayed as CUDA graphs, and the speedup bound AL x t_ar / (t_verify + t_draft); eagerly, a
            draft tree's verify pass of 16 / 32 / 64 nodes (run --tree-budget) against the chain's verify pass
  tensorrt  only where `import tensorrt` works: the DFlashAccept plugin inside a TensorRT engine (needs
            TensorRT's headers, TENSORRT_ROOT), and the demo's ONNX graphs compiled into TensorRT plans by
            trtllm_dflash.compile.tensorrt_build (where this checkout has it), which then decode the held-out prompts
            with the TensorRT executor, eagerly and as CUDA graphs: the same tokens, dflash == ar, tokens/s

ONE JSON (--out) gets every stage's status (passed / failed with the error / skipped with the reason), the
machine, the preflight, the package versions and the numbers. It is written before each stage (that stage
`running`, the next ones `pending`) and after it, and on SIGTERM (the running stage stopped, failed with that
reason; the rest skipped): whatever ends the run, the report says how far it got.

Exit codes: 0 every stage that ran passed (the others skipped, each with its reason); 1 a stage failed or
overran its budget; 2 bad command line, or --out cannot be written; 3 no CUDA device is visible to torch:
nothing was checked, every stage is skipped with that reason in the JSON, and one line says so on stderr;
143 stopped by SIGTERM (the report says where).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "plugins" / "dflash"
PROMPTS = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"
SCHEMA = "trtllm_dflash.gpu_check/2"
STAGES = ("executor", "decoder", "kernel", "timings", "tensorrt")
STATUSES = ("passed", "failed", "skipped")
IN_PROGRESS = ("running", "pending")  # only in a report written while gpu_check runs
STAGE_BUDGET_S = {"executor": 80, "decoder": 80, "kernel": 150, "timings": 90, "tensorrt": 60}  # caps; --budget-s rules
PROBE_BUDGET_S = 60  # the machine probe (torch import, device properties, nvidia-smi, nvcc --version)
PREFLIGHT_BUDGET_S = 120  # installing the wheels (pip, offline) and importing what every stage imports
MIN_STAGE_S = 20  # a stage is not started with less than this left of --budget-s
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_CUDA, EXIT_TERMINATED = 0, 1, 2, 3, 128 + signal.SIGTERM
WHEELS = ROOT / "gpu_wheels"  # benchmarks/gpu_wheels.sh's default folder (.gitignore'd), used when it exists
# What each stage imports: a stage whose imports fail in the preflight is skipped with the reason.
STAGE_IMPORTS = {
    "executor": ("trtllm_dflash.config", "trtllm_dflash.engine.builder", "trtllm_dflash.runtime.runner"),
    "decoder": ("trtllm_dflash.runtime.decoding", "trtllm_dflash.runtime.executor", "trtllm_dflash.stats"),
    "kernel": ("trtllm_dflash.speculative.core",),
    "timings": ("trtllm_dflash.runtime.executor",),
    "tensorrt": ("trtllm_dflash.compile.tensorrt_build",),
}
# Stages that use transformers (tokenizers, the Decoder's stop strings): run only with a transformers inside the pin.
NEEDS_PINNED_TRANSFORMERS = ("executor", "decoder")
# At the first position where a GPU run and a CPU run chose different greedy tokens, a difference whose two tokens'
# logits are within this of each other on both devices is a near-tie (the fp32 demo's logits are of order 10: a
# relative 1e-4, far above fp32 rounding of the same sum, far below a wrong result).
NEAR_TIE = 1e-3
ACCEPTANCE_LENGTHS = (2, 3, 4, 5, 6, 8)  # ALs the speedup bound is tabulated for
QWEN3_8B_LAYERS = 36
MASK = 31_999  # mask_token_id of the kernel cases; any int32 works
DISTRIBUTIONS = ("torch", "transformers", "tokenizers", "safetensors", "pydantic", "PyYAML", "rich", "jinja2",
                 "numpy", "onnx", "onnxruntime", "onnxscript", "tensorrt", "trtllm-dflash")
# Random-pair shapes of the timings stage: Qwen3-8B's layer dimensions, and a tiny one for smoke tests.
PAIR_SHAPES = {
    "qwen3-8b": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_heads": 32,
                 "num_kv_heads": 8, "head_dim": 128},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 16},
}


@dataclass(frozen=True)
class Options:
    """What the stages run; each field is the command-line option of the same name."""

    num_prompts: int = 8  # executor: held-out prompts, decoded as one batch
    max_new_tokens: int = 128  # executor: output tokens per request
    context: int = 1024  # timings: positions already in every KV-cache slot
    batch_sizes: tuple[int, ...] = (1, 8, 32)  # timings
    repeats: int = 20  # timings: timed runs per number (median), after 3 warm-up runs
    target_layers: int = 4  # timings: decoder layers of the random target
    draft_layers: int = 1  # timings: layers of the random drafter
    block_size: int = 16  # timings, decoder: tokens per verify / draft pass
    tree_budgets: tuple[int, ...] = (16, 32, 64)  # timings: draft-tree verify passes of this many nodes (+ the anchor)
    shape: str = "qwen3-8b"  # timings, decoder: layer dimensions of the random pair (PAIR_SHAPES)
    decoder_requests: int = 8  # decoder: requests decoded as one batch
    decoder_new_tokens: int = 64  # decoder: output tokens per request
    prefill_tokens: int = 4096  # decoder: the prompt of the peak-memory prefill
    kv_contexts: tuple[int, ...] = (1024, 8192, 32768)  # decoder: KVCache.read's context lengths

    @classmethod
    def from_json(cls, raw: dict) -> "Options":
        return cls(**{**raw, "batch_sizes": tuple(raw["batch_sizes"]), "kv_contexts": tuple(raw["kv_contexts"])})


class Skip(Exception):
    """The stage cannot run here; the message is the reason."""


class CheckFailed(Exception):
    """The stage ran and a check did not hold; its results are recorded."""


# ---------------------------------------------------------------- pure helpers

def speedup_bound(acceptance_length: float, ar_ms: float, verify_ms: float, draft_ms: float) -> float:
    """AL x t_ar / (t_verify + t_draft): DFlash's speedup over AR if nothing but the passes cost time
    (runtime.compare.StepCosts.speedup_bound). Example: AL 4, t_ar 10, t_verify 12, t_draft 3 -> 2.67."""
    return acceptance_length * ar_ms / (verify_ms + draft_ms)


def bound_table(pass_ms: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """{batch: {"ar", "verify", "draft"} ms} -> {batch: {AL: bound}} for ACCEPTANCE_LENGTHS."""
    return {b: {str(al): round(speedup_bound(al, t["ar"], t["verify"], t["draft"]), 3) for al in ACCEPTANCE_LENGTHS}
            for b, t in pass_ms.items()}


def extrapolate_layers(pass_ms: dict[str, float], layer_ms: dict[str, float], layers: int, to_layers: int
                       ) -> dict[str, float]:
    """Target passes of a deeper model: t + (to_layers - layers) x t(one layer); the draft pass is unchanged.
    Example: ar 5 ms at 4 layers, 1 ms per layer -> 37 ms at 36 layers."""
    extra = to_layers - layers
    return {"ar": pass_ms["ar"] + extra * layer_ms["ar"], "verify": pass_ms["verify"] + extra * layer_ms["verify"],
            "draft": pass_ms["draft"]}


def nvcc_arch(major: int, minor: int) -> str:
    """nvcc's -arch for a compute capability: the arch-specific "a" target on Hopper and data-center
    Blackwell (as plugins/dflash/CMakeLists.txt builds), the plain one elsewhere. (9, 0) -> sm_90a."""
    return f"sm_{major}{minor}" + ("a" if (major, minor) in {(9, 0), (10, 0), (10, 3)} else "")


def one_line(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:limit]


def in_progress(status: str, **fields) -> dict:
    """A stage's record while gpu_check runs: `running` (with budget_s, pid, started_at_s) or `pending`."""
    return {"status": status, "error": None, "reason": None, "seconds": 0.0, "budget_s": None, "results": {}, **fields}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "error": None, "reason": reason, "seconds": 0.0, "budget_s": None, "results": {}}


def validate_report(report: dict, final: bool = True) -> list[str]:
    """Problems with a report's structure (empty when it is well formed); `final`: written at the end (no stage still
    running or pending)."""
    problems = [f"missing key {k!r}" for k in ("schema", "command", "started_at", "finished_at", "exit_code",
                                                "budget_s", "options", "environment", "machine", "preflight",
                                                "stages")
                if k not in report]
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, not {SCHEMA!r}")
    stages = report.get("stages", {})
    if list(stages) != list(STAGES):
        problems.append(f"stages are {list(stages)}, not {list(STAGES)}")
    for name, rec in stages.items():
        status = rec.get("status")
        if status not in STATUSES + (() if final else IN_PROGRESS):
            problems.append(f"{name}: status {status!r}")
        if status == "failed" and not rec.get("error"):
            problems.append(f"{name}: failed without an error")
        if status == "skipped" and not rec.get("reason"):
            problems.append(f"{name}: skipped without a reason")
        if not isinstance(rec.get("results"), dict) or not isinstance(rec.get("seconds"), (int, float)):
            problems.append(f"{name}: results must be an object and seconds a number")
    return problems


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def find_nvcc() -> Path | None:
    for candidate in (shutil.which("nvcc"), os.environ.get("CUDA_HOME") and Path(os.environ["CUDA_HOME"]) / "bin/nvcc",
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def find_sanitizer(nvcc: Path | None) -> Path | None:
    for candidate in ((nvcc.parent / "compute-sanitizer") if nvcc else None, shutil.which("compute-sanitizer")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def run_command(cmd: list, timeout: float) -> dict:
    """rc, seconds and the output's tail; rc None when it ran past `timeout` (it is killed)."""
    start = time.monotonic()
    try:
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=max(1.0, timeout))
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, f"timed out after {timeout:.0f} s; " + str(exc.stdout or "")[-2000:]
    return {"rc": rc, "seconds": round(time.monotonic() - start, 2), "output": out[-4000:]}


# ---------------------------------------------------------------- stage plumbing

class StageContext:
    """What a stage function gets: its options, the machine, a scratch directory and its results, which it
    saves as it goes (a stage stopped for overrunning keeps what it had measured)."""

    def __init__(self, name: str, options: Options, machine: dict, device: str, tmp: Path, budget_s: float,
                 path: Path | None = None):
        self.name, self.options, self.machine, self.device = name, options, machine, device
        self.tmp, self.budget_s, self.path = Path(tmp), budget_s, path
        self.results: dict = {}
        self.state = {"status": "failed", "error": "the stage's process ended before the stage finished",
                      "reason": None}
        self._start = time.monotonic()

    def save(self) -> None:
        if self.path is not None:
            write_json(self.path, {**self.state, "results": self.results})

    def log(self, message: str) -> None:
        print(f"gpu_check [{self.name} {time.monotonic() - self._start:5.1f}s] {message}", flush=True)

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self._start)


def worker_main(name: str, work: Path, budget_s: float) -> int:
    """A child process: run one stage and leave its record in WORK/NAME.json."""
    sys.path.insert(0, str(ROOT))  # this checkout's package, installed or not
    cfg = read_json(work / "options.json")
    tmp = work / f"{name}.tmp"
    tmp.mkdir(exist_ok=True)
    ctx = StageContext(name, Options.from_json(cfg["options"]), cfg.get("machine", {}), cfg.get("device", "cuda:0"),
                       tmp, budget_s, work / f"{name}.json")
    if ctx.device == "cpu" and name not in ("machine", "preflight"):
        import torch

        torch.set_num_threads(1)  # a CPU dry run: small passes, and threads fighting over busy cores run 10x slower
    ctx.save()
    try:
        {"machine": probe_machine, "preflight": preflight_imports, **STAGE_FUNCTIONS}[name](ctx)
        ctx.state.update(status="passed", error=None)
    except Skip as exc:
        ctx.state.update(status="skipped", error=None, reason=str(exc))
    except CheckFailed as exc:
        ctx.state.update(status="failed", error=str(exc))
    except Exception as exc:  # recorded in the report, with the traceback
        ctx.state.update(status="failed", error=one_line(exc), traceback=traceback.format_exc()[-6000:])
    ctx.save()
    if name not in ("machine", "preflight") and ctx.state["status"] != "passed":
        ctx.log(f"{ctx.state['status']}: {ctx.state['error'] or ctx.state['reason']}")
    return 0


def stop(proc: subprocess.Popen) -> None:
    """End the worker's process group (it and the compilers it started), politely first."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_worker(name: str, work: Path, budget_s: float, quiet: bool = False, on_start=None) -> dict:
    """Run stage `name` in a child process for at most `budget_s`; its record, whatever happened to it.
    `on_start(pid)` is called once the child runs."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--worker-dir", str(work),
           "--worker-budget-s", str(budget_s)]
    pipe = subprocess.PIPE if quiet else None
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if on_start is not None:
        on_start(proc.pid)
    timed_out = False
    try:
        _, err = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop(proc)
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:  # this process is being stopped (SIGTERM, Ctrl-C): the stage must not live on
            stop(proc)
    state = read_json(work / f"{name}.json")
    rec = {"status": state.get("status", "failed"), "error": state.get("error"), "reason": state.get("reason"),
           "seconds": round(time.monotonic() - start, 1), "budget_s": round(budget_s, 1),
           "results": state.get("results", {})}
    if "traceback" in state:
        rec["traceback"] = state["traceback"]
    if timed_out:
        rec.update(status="failed", reason=None, error=f"timed out: stopped after its budget of {budget_s:.0f} s; "
                                                       "results holds what it had measured")
    elif proc.returncode != 0 or not state:
        how = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        tail = " ".join((err or "").split()[-60:])
        rec.update(status="failed", reason=None, error=f"the stage's process died ({how}) before it finished"
                                                       + (f": {tail}" if tail else ""))
    return rec


def versions() -> dict[str, str | None]:
    found = {}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def no_cuda_reason(probe: dict) -> str | None:
    """Why nothing can run (one sentence), or None when a CUDA device is visible."""
    m = probe["results"]
    if probe["status"] != "passed":
        return f"no CUDA device is visible: the machine probe failed ({probe['error']})"
    if m.get("cuda_available"):
        return None
    build = ("a CPU-only build" if not m.get("torch_cuda")
             else f"built for CUDA {m['torch_cuda']}, but it sees no device")
    return f"no CUDA device is visible to torch (torch {m.get('torch')} is {build})"


# ---------------------------------------------------------------- preflight

class Terminated(Exception):
    """SIGTERM arrived: unwinds to check(), which records where the run stopped."""


def transformers_pin(pyproject: Path = ROOT / "pyproject.toml") -> str | None:
    """This project's transformers requirement (">=5.5,<5.15") from pyproject.toml, or None if it has none."""
    found = re.search(r'"transformers\s*([<>=!~][^"]*)"', pyproject.read_text(encoding="utf-8"))
    return found.group(1).replace(" ", "") if found else None


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: "5.17.0.dev0" -> (5, 17, 0)."""
    parts = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def within(version: str, requirement: str) -> bool:
    """Whether `version` meets a comma-separated requirement of >=, >, <=, <, ==, != clauses (what our pins use).
    Example: within("5.17.0", ">=5.5,<5.15") -> False."""
    ops = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b,
           "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
    have = version_tuple(version)
    for clause in filter(None, requirement.split(",")):
        op = next(o for o in (">=", "<=", "==", "!=", ">", "<") if clause.startswith(o))
        want = version_tuple(clause[len(op):])
        width = max(len(have), len(want))
        if not ops[op](have + (0,) * (width - len(have)), want + (0,) * (width - len(want))):
            return False
    return True


def preflight_imports(ctx: StageContext) -> None:
    """Worker: import every module a stage imports (in this process, with the wheels' directory on the path as the
    stages will have it); record each one's error, the versions, and transformers against the pin."""
    import importlib

    sys.path.insert(0, str(ROOT))
    r = ctx.results
    r["imports"] = {}
    for module in sorted({m for mods in STAGE_IMPORTS.values() for m in mods}):
        try:
            importlib.import_module(module)
            r["imports"][module] = "ok"
        except Exception as exc:  # ImportError, or a broken dependency: the reason a stage is skipped
            r["imports"][module] = one_line(exc, 300)
    r["versions"] = versions()
    pin, have = transformers_pin(), r["versions"].get("transformers")
    r["transformers"] = {"version": have, "pin": pin, "within_pin": bool(have and pin and within(have, pin))}


def preflight_skips(results: dict) -> dict[str, str]:
    """Stage -> why it cannot run, from the preflight's results (stages that can run are not listed)."""
    skips = {}
    for stage, modules in STAGE_IMPORTS.items():
        failed = [f"{m}: {results.get('imports', {}).get(m, 'not tried')}" for m in modules
                  if results.get("imports", {}).get(m) != "ok"]
        t = results.get("transformers", {})
        if stage in NEEDS_PINNED_TRANSFORMERS and not t.get("within_pin"):
            failed.append(f"transformers {t.get('version')} is outside this project's pin {t.get('pin')}")
        if failed:
            skips[stage] = ("preflight: " + "; ".join(failed) + " (carry the wheels of benchmarks/gpu_wheels.sh: "
                            "gpu_wheels/ or --wheels DIR)")[:1000]
    return skips


def install_wheels(wheels: Path, site: Path, timeout: float) -> dict:
    """pip install --no-index every wheel of `wheels` into `site` (a --target directory: nothing of the machine's
    Python changes), which must satisfy `wheels`/requirements.txt. The caller puts `site` first on PYTHONPATH.
    --no-deps: a --target install would otherwise want a wheel for every dependency, even one the machine has
    (gpu_wheels.sh leaves out numpy's); the preflight's imports then show whatever is really missing."""
    requirements = wheels / "requirements.txt"
    if not requirements.is_file():
        return {"dir": str(wheels), "installed": False, "reason": f"{requirements} is missing (benchmarks/gpu_wheels.sh "
                                                                  "writes it)"}
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", wheels, "--target", site,
           "--disable-pip-version-check", "--no-warn-script-location", "--quiet", "-r", requirements,
           *sorted(wheels.glob("*.whl"))]
    done = run_command(cmd, timeout)
    return {"dir": str(wheels), "requirements": requirements.read_text(encoding="utf-8").split(),
            "installed": done["rc"] == 0, "seconds": done["seconds"], "rc": done["rc"],
            "output": done["output"][-2000:], "site": str(site)}


# ---------------------------------------------------------------- the run

def check(args: argparse.Namespace) -> int:
    start = time.monotonic()

    def terminated(*_):
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)
    out: Path = args.out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, {"schema": SCHEMA, "note": "gpu_check is running"})
    except OSError as exc:
        print(f"gpu_check: error: cannot write the report {out}: {exc.strerror or exc}.", file=sys.stderr)
        return EXIT_USAGE
    options = Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)})
    report = {"schema": SCHEMA, "command": ["benchmarks/gpu_check.py", *args.argv],
              "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "finished_at": None, "wall_s": None, "exit_code": None, "budget_s": args.budget_s,
              "git_commit": git_commit(), "options": dataclasses.asdict(options), "environment": versions(),
              "machine": {}, "preflight": {}, "stages": {name: in_progress("pending") for name in STAGES}}
    device = "cpu" if args.device == "cpu" else "cuda:0"

    def finish(code: int) -> int:
        report.update(finished_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      wall_s=round(time.monotonic() - start, 1), exit_code=code)
        write_json(out, report)
        return code

    running: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        try:
            write_json(work / "options.json", {"options": dataclasses.asdict(options), "device": device})
            probe = run_worker("machine", work, min(PROBE_BUDGET_S, args.budget_s), quiet=True)
            report["machine"] = probe["results"]
            reason = None if args.device == "cpu" else no_cuda_reason(probe)
            if reason is not None:
                report["stages"] = {name: skipped(reason) for name in STAGES}
                report["preflight"] = {"skipped": reason}
                code = finish(EXIT_NO_CUDA)
                print(f"gpu_check: {reason}; every stage skipped; report written to {out}", file=sys.stderr)
                return code
            m = report["machine"]
            if args.device == "cpu":
                print(f"gpu_check: --device cpu: the stages' torch code on the CPU (torch {m.get('torch')}, Python "
                      f"{m.get('python')})", flush=True)
            else:
                print(f"gpu_check: {m['gpu']} (compute capability {m['compute_capability']}, {m['nvcc_arch']}), driver "
                      f"{m.get('driver')}, torch {m['torch']} + CUDA {m['torch_cuda']}, Python {m['python']}",
                      flush=True)
            report["preflight"] = preflight(args, work, start)
            skips = report["preflight"].get("skipped_stages", {})
            write_json(work / "options.json", {"options": dataclasses.asdict(options), "machine": m, "device": device})
            write_json(out, report)
            for name in STAGES:
                left = args.budget_s - (time.monotonic() - start) - 5
                if name not in args.stages:
                    report["stages"][name] = skipped("not selected with --stages")
                elif name in skips:
                    report["stages"][name] = skipped(skips[name])
                elif left < MIN_STAGE_S:
                    report["stages"][name] = skipped(f"--budget-s {args.budget_s:g} was spent before this stage")
                else:
                    budget = min(STAGE_BUDGET_S[name], left)
                    print(f"gpu_check: stage {name} (budget {budget:.0f} s)", flush=True)
                    running.update(name=name, work=work, began=time.monotonic(), budget=budget)
                    report["stages"][name] = in_progress("running", budget_s=round(budget, 1), pid=None,
                                                         started_at_s=round(time.monotonic() - start, 1))
                    write_json(out, report)  # before the stage: a run that dies in it still says where it was

                    def started(pid: int, name: str = name) -> None:
                        report["stages"][name]["pid"] = pid
                        write_json(out, report)

                    rec = report["stages"][name] = run_worker(name, work, budget, on_start=started)
                    running.clear()
                    detail = rec["error"] or rec["reason"]
                    print(f"gpu_check: stage {name}: {rec['status']} in {rec['seconds']:.1f} s"
                          + (f": {detail}" if detail else ""), flush=True)
                write_json(out, report)
        except Terminated:  # inside the temporary directory: the running stage's results are still there
            return stopped(report, running, finish, out)
    failed = [n for n, rec in report["stages"].items() if rec["status"] == "failed"]
    code = finish(EXIT_FAILED if failed else EXIT_OK)
    for line in summary(report):
        print(line, flush=True)
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'done'}; report written to {out} "
          f"({report['wall_s']:.0f} s)", flush=True)
    return code


def stopped(report: dict, running: dict, finish, out: Path) -> int:
    """SIGTERM: the running stage (its child already stopped by run_worker) failed with what it had measured, the
    stages after it skipped, the report finished."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut this short
    name = running.get("name")
    if name:
        state = read_json(running["work"] / f"{name}.json")  # gone if the temporary directory was removed first
        report["stages"][name] = {"status": "failed", "reason": None,
                                  "error": "stopped by SIGTERM while running; results holds what it had measured",
                                  "seconds": round(time.monotonic() - running["began"], 1),
                                  "budget_s": round(running["budget"], 1), "results": state.get("results", {})}
    for stage, rec in report["stages"].items():
        if rec.get("status") in IN_PROGRESS:
            report["stages"][stage] = skipped("gpu_check was stopped by SIGTERM before this stage")
    code = finish(EXIT_TERMINATED)
    print(f"gpu_check: stopped by SIGTERM{f' in stage {name}' if name else ''}; report written to {out}",
          file=sys.stderr, flush=True)
    return code


def preflight(args: argparse.Namespace, work: Path, start: float) -> dict:
    """Install the wheels (if any), then import what every stage imports in a child process with them: the report's
    `preflight` section, with `skipped_stages` (stage -> reason)."""
    record: dict = {}
    wheels = args.wheels if args.wheels is not None else (WHEELS if WHEELS.is_dir() else None)
    if wheels is None:
        record["wheels"] = {"installed": False, "reason": f"no --wheels and no {WHEELS.relative_to(ROOT)}/ (run "
                                                          "benchmarks/gpu_wheels.sh where there is a network)"}
    else:
        budget = max(10.0, min(PREFLIGHT_BUDGET_S, args.budget_s - (time.monotonic() - start)) - 30)
        record["wheels"] = install_wheels(Path(wheels), work / "site", budget)
        if record["wheels"]["installed"]:  # ahead of the machine's own site-packages, for every child from here on
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "site"),
                                                                     os.environ.get("PYTHONPATH")]))
    print(f"gpu_check: preflight: wheels {'installed' if record['wheels'].get('installed') else 'not installed'}"
          + (f" ({record['wheels'].get('reason') or record['wheels'].get('output', '')[-200:]})"
             if not record["wheels"].get("installed") else ""), flush=True)
    rec = run_worker("preflight", work, max(20.0, min(60.0, args.budget_s - (time.monotonic() - start) - 30)),
                     quiet=True)
    record.update(status=rec["status"], error=rec["error"], seconds=rec["seconds"], **rec["results"])
    if rec["status"] != "passed":
        record["skipped_stages"] = {name: f"preflight failed: {rec['error']}" for name in STAGES}
    else:
        record["skipped_stages"] = preflight_skips(rec["results"])
    for stage, reason in record["skipped_stages"].items():
        print(f"gpu_check: preflight: {stage} will be skipped: {reason[:300]}", flush=True)
    return record


def summary(report: dict) -> list[str]:
    """A few lines of the numbers that matter, for the console."""
    lines, stages = [], report["stages"]

    def row(ms: dict) -> str:
        return " ".join(f"{k} {ms[k]:.2f}" for k in ("ar", "verify", "draft") if k in ms)

    pre = report.get("preflight", {})
    if pre.get("skipped_stages"):
        lines.append("preflight: skipped " + "; ".join(f"{k} ({v[:120]})" for k, v in pre["skipped_stages"].items()))
    ex = stages["executor"]["results"].get("checks")
    if ex:
        lines.append("executor: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in ex.items())
                     + f"; AL {stages['executor']['results'].get('mean_acceptance_length')}")
    d = stages["decoder"]["results"]
    for mode, rec in d.get("host_and_syncs", {}).items():
        syncs = rec.get("syncs_per_step")
        prof = rec.get("profiled", {})
        lines.append(f"decoder {mode}: {syncs.get('median') if isinstance(syncs, dict) else 'n/a'} host syncs per "
                     f"step, host {prof.get('host_ms_per_step')} ms, GPU kernels {prof.get('gpu_kernel_ms_per_step')} "
                     f"ms, wall {rec.get('wall_ms_per_step')} ms per step")
    tp = d.get("throughput")
    if tp:
        lines.append(f"decoder tokens/s: ar {tp['ar']['tokens_per_s']}, dflash {tp['dflash']['tokens_per_s']} "
                     f"(AL {tp['dflash']['mean_acceptance_length']}), drafts forced correct "
                     f"{tp['dflash_drafts_forced_correct']['tokens_per_s']} "
                     f"(AL {tp['dflash_drafts_forced_correct']['mean_acceptance_length']}; the target's own acceptance "
                     f"took {tp['dflash_drafts_forced_correct'].get('real_acceptance_agreed', {}).get('fraction')} of "
                     f"them)")
    k = stages["kernel"]["results"]
    if k:
        lines.append(f"kernel: kernel_check rc {k.get('kernel_check', {}).get('rc')}; torch-driven cases "
                     f"{k.get('torch_cases', {}).get('mismatching_cases', 'not run')} mismatching")
        for b, rec in k.get("timing", {}).items():
            lines.append(f"kernel batch {b}, all accepted (us): {rec.get('kernel_all_accepted_us')}, torch ops "
                         f"{rec.get('torch_ops_all_accepted_us')}")
    t = stages["timings"]["results"]
    for b, ms in t.get("eager_ms", {}).items():
        g = t.get("graph_ms", {}).get(b, {})
        bound = t.get("speedup_bound", {}).get("eager", {}).get(b, {}).get("4")
        trees = t.get("tree_verify_ms", {}).get(b, {})
        lines.append(f"timings batch {b} (ms): eager {row(ms)}" + (f"; CUDA graphs {row(g)}" if g else "")
                     + (f"; speedup bound at AL 4: {bound}" if bound is not None else "")
                     + ("; tree verify " + ", ".join(f"{n} nodes {v:.2f}" for n, v in trees.items()) if trees else ""))
    return lines


# ---------------------------------------------------------------- machine probe

def probe_machine(ctx: StageContext) -> None:
    import torch

    r = ctx.results
    r.update(python=platform.python_version(), platform=platform.platform(), cpu_count=os.cpu_count(),
             torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if not r["cuda_available"]:
        return
    props = torch.cuda.get_device_properties(0)
    cap = (props.major, props.minor)
    r.update(device_count=torch.cuda.device_count(), gpu=props.name, compute_capability=f"{cap[0]}.{cap[1]}",
             nvcc_arch=nvcc_arch(*cap), gpu_memory_gib=round(props.total_memory / 2**30, 1),
             multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version(),
             fp8_tensor_cores=cap >= (8, 9), nvfp4_tensor_cores=cap >= (10, 0))
    smi = shutil.which("nvidia-smi")
    if smi:
        text = run_command([smi], 20)["output"]
        for key, label in (("driver", "Driver Version"), ("driver_max_cuda", "CUDA Version")):
            found = re.search(label + r":\s*([\d.]+)", text)
            r[key] = found.group(1) if found else None
    nvcc = find_nvcc()
    if nvcc:
        found = re.search(r"release ([\d.]+)", run_command([nvcc, "--version"], 20)["output"])
        r["nvcc"] = {"path": str(nvcc), "release": found.group(1) if found else None}


# ---------------------------------------------------------------- stage 1: the torch executor on cuda

def stage_executor(ctx: StageContext) -> None:
    from trtllm_dflash.config import load_build_config
    from trtllm_dflash.engine.builder import build_engine
    from trtllm_dflash.runtime.jsonl import Defaults, read_requests
    from trtllm_dflash.runtime.runner import Engine

    o, r = ctx.options, ctx.results
    started = time.monotonic()
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=ctx.tmp / "demo")
    engine_dir = build_engine(cfg.model_copy(update={"backend": "torch"}), progress=False)  # the torch executor's
    ctx.log(f"built the demo engine from build_configs/demo.yaml, backend torch ({time.monotonic() - started:.1f} s)")
    cpu = Engine.load(engine_dir, device="cpu")
    r["engine"] = {"dtype": cpu.config.dtype, "block_size": cpu.executor.block_size,
                   "max_batch_size": cpu.config.max_batch_size}

    def requests(temperature: float):
        defaults = Defaults(o.max_new_tokens, temperature, 0, cpu.config.max_seq_len, cpu.executor.vocab_size)
        found, errors = read_requests(PROMPTS, cpu.tokenizer, defaults)
        assert not errors, errors
        return found[: o.num_prompts]

    greedy = requests(0.0)
    r["requests"] = {"num_prompts": len(greedy), "max_new_tokens": o.max_new_tokens, "batched": True}
    runs = {("cpu", mode): decode(cpu, mode, greedy, "cpu") for mode in ("ar", "dflash")}
    ctx.log(f"cpu: ar {runs['cpu', 'ar']['seconds']} s, dflash {runs['cpu', 'dflash']['seconds']} s")

    gpu = Engine.load(engine_dir, device=ctx.device)
    off = off_device(gpu.executor, ctx.device)
    r["off_device_after_load"] = off  # tensors Engine.load(device=...) left elsewhere: a bug if not empty
    try:  # the executor as written, on one short request
        decode(gpu, "dflash", [dataclasses.replace(greedy[0], max_new_tokens=8)], ctx.device)
        r["runs_as_written"] = True
    except RuntimeError as exc:
        r.update(runs_as_written=False, as_written_error=one_line(exc))
        if not off:
            raise
        for module in (gpu.executor.target, gpu.executor.drafter):
            module.to(ctx.device)
        r["workaround"] = f"moved {', '.join(off)} to {ctx.device}, then ran every check below"
        ctx.log(f"the executor as written failed on {ctx.device} ({one_line(exc, 160)}); {r['workaround']}")
    ctx.save()
    for mode in ("ar", "dflash"):
        runs["gpu", mode] = decode(gpu, mode, greedy, ctx.device)
    sampled = requests(0.8)
    for mode in ("ar", "dflash"):
        runs["gpu_sampled", mode] = decode(gpu, mode, sampled, ctx.device)
    top_p = [dataclasses.replace(req, top_p=0.9) for req in sampled]  # the kept set's boundary in every step
    for mode in ("ar", "dflash"):
        runs["gpu_top_p", mode] = decode(gpu, mode, top_p, ctx.device)
    # a paged KV cache under the CUDA graphs (on by default here): the tables read inside each replay
    paged = Engine.load(engine_dir, device=ctx.device, kv_cache_memory="256MiB")
    runs["gpu_paged", "dflash"] = decode(paged, "dflash", greedy, ctx.device)
    r["paged_graphs_captured"] = paged.executor.graphs is not None and all(
        p.graph is not None for p in paged.executor.graphs.passes.values())
    alone: dict[str, list[int]] = {}  # each prompt decoded as a batch of one: batch invariance
    for req in greedy:
        alone.update(decode(gpu, "ar", [req], ctx.device)["tokens"])
    runs["gpu_alone", "ar"] = {"tokens": alone}
    r["runs"] = {f"{where} {mode}": {k: v for k, v in run.items() if k != "tokens"}
                 for (where, mode), run in runs.items() if where != "gpu_alone"}
    r["mean_acceptance_length"] = runs["gpu", "dflash"]["mean_acceptance_length"]
    # Across devices (and batch sizes), another kernel may round a near-tie the other way: classified by the logits
    # at the first differing position. Within one device and batch, dflash must equal ar exactly.
    pairs = {"greedy ar: gpu == cpu": (("gpu", "ar"), ("cpu", "ar"), True),
             "greedy dflash: gpu == cpu": (("gpu", "dflash"), ("cpu", "dflash"), True),
             "greedy ar on gpu: alone == in a batch": (("gpu_alone", "ar"), ("gpu", "ar"), True),
             "greedy on gpu: dflash == ar": (("gpu", "dflash"), ("gpu", "ar"), False),
             "greedy dflash on gpu: paged cache == static": (("gpu_paged", "dflash"), ("gpu", "dflash"), True),
             "sampled (T=0.8) on gpu: dflash == ar": (("gpu_sampled", "dflash"), ("gpu_sampled", "ar"), False),
             "sampled (T=0.8, top-p 0.9) on gpu: dflash == ar": (("gpu_top_p", "dflash"), ("gpu_top_p", "ar"), False)}
    engines = {"gpu": gpu, "gpu_alone": gpu, "gpu_paged": paged, "cpu": cpu}
    prompts = {str(req.id): req.prompt_token_ids for req in greedy}
    r["checks"], r["differences"] = {}, {}
    for label, (a, b, near_ties_allowed) in pairs.items():
        diffs = differences(runs[a]["tokens"], runs[b]["tokens"])
        if diffs and near_ties_allowed:
            for d in (d for d in diffs if d["a"] and d["b"]):  # both chose a token there (neither had stopped)
                common = runs[a]["tokens"][d["id"]][: d["first_difference_at"]]
                prefix = [*prompts[d["id"]], *common]
                d.update(classify_difference(next_token_logits(engines[a[0]], prefix),
                                             next_token_logits(engines[b[0]], prefix), d["a"][0], d["b"][0]))
        r["checks"][label] = all(near_ties_allowed and d.get("class") == "near-tie" for d in diffs)
        if diffs:
            r["differences"][label] = diffs[:5]
    ctx.save()
    if ctx.device.startswith("cuda"):  # (a CPU standing in for the GPU runs no graphs)
        r["checks"]["paged cache: its decode passes captured as CUDA graphs"] = r["paged_graphs_captured"]
    for family in ("qwen3_moe", "qwen3_5"):
        family_graphs(ctx, requests(0.0), family)
    problems = [label for label, ok in r["checks"].items() if not ok]
    if not r["runs_as_written"]:
        problems.insert(0, f"the executor as written fails on {ctx.device}: {r['as_written_error']}")
    if problems:
        raise CheckFailed("; ".join(problems))


def family_graphs(ctx: StageContext, greedy: list, family: str) -> None:
    """A tiny random `family` pair in bfloat16 (qwen3_moe: experts as grouped GEMMs, models/moe.py; qwen3_5: Gated
    DeltaNet states with a scratch slot), decoded with its passes captured (on by default where they can be: for
    experts, where torch's grouped GEMM keeps the routing on the device, SM 9.x / 10.x) and eagerly: the same tokens,
    and with graphs every pass captured. A failure is recorded as a failed check, not raised."""
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine
    from trtllm_dflash.models.moe import experts_graph_problem
    from trtllm_dflash.parallel.group import SINGLE
    from trtllm_dflash.runtime.executor import TorchExecutor
    from trtllm_dflash.runtime.runner import Engine
    from trtllm_dflash.train.random_pair import write_random_pair

    r = ctx.results.setdefault("graphs_of", {})[family] = {}
    try:
        pair = ctx.tmp / f"{family}_pair"
        write_random_pair(pair, family, block_size=8, seed=0)
        out = build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", output=ctx.tmp / family,
                                       dtype="bfloat16", max_batch_size=4, max_seq_len=512), force=True, progress=False)
        eager = Engine.load(out, device=ctx.device, cuda_graphs=False)
        r["graphs_problem"] = problem = experts_graph_problem(eager.executor.target)
        if ctx.device.startswith("cuda"):
            graphed = Engine.load(out, device=ctx.device)  # (graphs on by default where they can be captured)
        else:  # the CPU standing in for the GPU: the same static passes, eagerly
            graphed = dataclasses.replace(eager, executor=TorchExecutor.from_engine(
                out, eager.config, 0, SINGLE, "cpu", None, cuda_graphs=True))
        r["graphs_on"] = graphed.executor.graphs is not None
        vocab = eager.executor.vocab_size  # (the demo's prompts' ids, kept inside the tiny vocabulary)
        reqs = [dataclasses.replace(q, prompt_token_ids=[t % vocab for t in q.prompt_token_ids]) for q in greedy]
        for mode in ("ar", "dflash"):
            a, b = decode(graphed, mode, reqs, ctx.device), decode(eager, mode, reqs, ctx.device)
            r[mode] = {"graphs_s": a["seconds"], "eager_s": b["seconds"], "output_tokens": a["output_tokens"]}
            ctx.results["checks"][f"{family} target {mode}: graphs == eager"] = a["tokens"] == b["tokens"]
            if a["tokens"] != b["tokens"]:
                ctx.results["differences"][f"{family} {mode}"] = differences(a["tokens"], b["tokens"])[:5]
        if ctx.device.startswith("cuda") and problem is None:
            r["captured"] = all(p.graph is not None for p in graphed.executor.graphs.passes.values())
            ctx.results["checks"][f"{family} target: its decode passes captured as CUDA graphs"] = r["captured"]
        ctx.log(f"{family} target: graphs {'on' if r['graphs_on'] else 'off'} ({problem or 'capturable'})")
    except Exception as exc:  # (recorded: the demo's checks above stand either way)
        r["error"] = one_line(exc)
        ctx.results["checks"][f"{family} target: decoded with and without graphs"] = False
    ctx.save()


def decode(engine, mode: str, requests: list, device: str) -> dict:
    """Decode `requests` as one batch; tokens by request id, time and acceptance."""
    import torch

    from trtllm_dflash.stats import all_steps, mean_acceptance_length

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    results = list(engine.decoder(mode).generate(requests))
    sync()
    seconds = time.perf_counter() - start
    tokens = {str(res.request.id): res.output_token_ids for res in results}
    total = sum(len(t) for t in tokens.values())
    return {"tokens": tokens, "seconds": round(seconds, 3), "output_tokens": total,
            "tokens_per_s": round(total / seconds, 1),
            "mean_acceptance_length": round(mean_acceptance_length(all_steps(results)), 3)}


def differences(a: dict[str, list[int]], b: dict[str, list[int]]) -> list[dict]:
    """Requests whose tokens differ, with the first differing index and a few tokens from there."""
    out = []
    for rid in a:
        x, y = a[rid], b.get(rid, [])
        if x != y:
            i = next((j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            out.append({"id": rid, "first_difference_at": i, "a": x[i:i + 4], "b": y[i:i + 4]})
    return out


def next_token_logits(engine, token_ids: list[int]):
    """The engine's fp32 logits [V] (on the CPU) for the token after `token_ids`, from one prefill in slot 0 (run
    between decodes: no request holds a slot)."""
    import torch

    ex = engine.executor
    ids = torch.tensor([token_ids], device=ex.device)
    zero = torch.zeros(1, dtype=torch.long, device=ex.device)
    out = ex.target_forward(ids, zero, zero, capture=False, last_index=torch.tensor([len(token_ids) - 1],
                                                                                      device=ex.device))
    return out.logits[0, -1].float().cpu()


def classify_difference(logits_a, logits_b, token_a: int, token_b: int, tolerance: float = NEAR_TIE) -> dict:
    """Two greedy runs chose token_a and token_b at the same position after the same prefix (logits_a / logits_b:
    each run's logits there). A near-tie when, on both sides, the two tokens' logits are within `tolerance` of each
    other (another kernel's rounding can swap them); else a mismatch (a real difference). The top-2 margins go along.
    Example: a [5.0, 4.9996, 1.0] chose 0, b [4.9997, 5.0, 1.0] chose 1 -> near-tie (gaps 4e-4 and 3e-4)."""
    def margin(logits) -> float:
        top = logits.topk(2).values
        return float(top[0] - top[1])

    gap_a = float(logits_a[token_a] - logits_a[token_b])
    gap_b = float(logits_b[token_b] - logits_b[token_a])
    near = max(abs(gap_a), abs(gap_b)) <= tolerance
    return {"class": "near-tie" if near else "mismatch", "gap_a": round(gap_a, 7), "gap_b": round(gap_b, 7),
            "top2_margin_a": round(margin(logits_a), 7), "top2_margin_b": round(margin(logits_b), 7),
            "argmax_a": int(logits_a.argmax()), "argmax_b": int(logits_b.argmax()), "tolerance": tolerance}


def off_device(executor, device: str) -> list[str]:
    """Parameters and buffers of the executor's modules that are not on `device`."""
    import torch

    want = torch.device(device)
    found = []
    for prefix, module in (("target", executor.target), ("drafter", executor.drafter)):
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
                found.append(f"{prefix}.{name} ({t.device})")
    return found


# ---------------------------------------------------------------- stage 2: the Decoder loop (benchmarks/gpu_decoder.py)

def sibling(name: str):
    """benchmarks/NAME.py as a module (this script is not in a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stage_decoder(ctx: StageContext) -> None:
    import torch

    from trtllm_dflash.runtime.decoding import Decoder, Request
    from trtllm_dflash.runtime.executor import TorchExecutor

    gd = sibling("gpu_decoder")
    o, r = ctx.options, ctx.results
    dev = torch.device(ctx.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    r["tf32"] = gd.tf32_settings()
    started = time.monotonic()
    target, drafter = random_pair(o.shape, o.target_layers, o.draft_layers, o.block_size, dtype, dev)
    prompt_len = 128
    ex = TorchExecutor(target, drafter, num_slots=o.decoder_requests,
                       max_seq_len=max(o.prefill_tokens, prompt_len + o.decoder_new_tokens), block_size=o.block_size)
    r["config"] = {"shape": o.shape, "target_layers": o.target_layers, "draft_layers": o.draft_layers,
                   "block_size": o.block_size, "dtype": str(dtype).removeprefix("torch."), "requests": o.decoder_requests,
                   "prompt_tokens": prompt_len, "max_new_tokens": o.decoder_new_tokens}
    ctx.log(f"random pair of {o.shape} layer shapes on {dev} ({time.monotonic() - started:.1f} s)")
    g = torch.Generator().manual_seed(0)
    requests = [Request(id=i, prompt_token_ids=torch.randint(0, ex.vocab_size, (prompt_len,), generator=g).tolist(),
                        max_new_tokens=o.decoder_new_tokens) for i in range(o.decoder_requests)]
    r["host_and_syncs"] = {}
    for mode in ("ar", "dflash"):
        r["host_and_syncs"][mode] = gd.host_and_syncs(lambda mode=mode: Decoder.for_mode(ex, mode, ()), requests,
                                                      warmup_steps=2, steps=12, device=dev)
        ctx.log(f"{mode}: {r['host_and_syncs'][mode].get('syncs_per_step')} syncs per step; profiled "
                f"{r['host_and_syncs'][mode].get('profiled')}")
        ctx.save()
    r["throughput"] = gd.decoder_throughput(ex, requests, lambda e, mode: Decoder.for_mode(e, mode, ()), dev)
    ctx.log(f"throughput: {r['throughput']}")
    ctx.save()
    heads, kv_heads, hd = (PAIR_SHAPES[o.shape][k] for k in ("num_heads", "num_kv_heads", "head_dim"))
    batch, context = min(8, o.decoder_requests), 1024
    verify = pass_functions(ex, batch, min(context, ex.max_seq_len - o.block_size), static=False)["verify"]
    r["sdpa"] = gd.sdpa(verify, (batch, o.block_size, heads, hd), (batch, context + o.block_size, kv_heads, hd),
                        dtype, dev)
    ctx.log(f"sdpa: {r['sdpa']}")
    ctx.save()
    contexts = o.kv_contexts if dev.type == "cuda" else tuple(c for c in o.kv_contexts if c <= 2048)
    r["kv_read_ms"] = gd.kv_read_ms(contexts, (1, batch), kv_heads, hd, dtype, dev, repeats=10)
    ctx.log(f"KVCache.read: {r['kv_read_ms']}")
    ctx.save()
    r["prefill_peak_memory"] = [gd.prefill_peak_memory(ex, o.prefill_tokens, b, dev)
                                for b in sorted({1, o.decoder_requests})]
    ctx.log(f"prefill peak memory: {r['prefill_peak_memory']}")


# ---------------------------------------------------------------- stage 3: the DFlashAccept kernel

# A C ABI over launchDFlashAccept for ctypes: the kernel driven with torch's CUDA tensors and stream.
ACCEPT_SHIM = r"""
#include "dflash_accept_kernel.h"

extern "C" int dflash_accept_cuda(int batch, int blockSize, int vocab, int maskTokenId, int logitsType, int schedule,
    void const* draft, void const* logits, void const* temperature, void const* noise, void const* lengths,
    void* accepted, void* committed, void* nextBlock, void* nextPositions, void* newLengths, void* stream)
{
    trtllm_dflash::DFlashAcceptParams p{};
    p.draftTokens = static_cast<int32_t const*>(draft);
    p.targetLogits = logits;
    p.temperature = static_cast<float const*>(temperature);
    p.gumbelNoise = static_cast<float const*>(noise);
    p.contextLengths = static_cast<int32_t const*>(lengths);
    p.accepted = static_cast<int32_t*>(accepted);
    p.committedTokens = static_cast<int32_t*>(committed);
    p.nextBlock = static_cast<int32_t*>(nextBlock);
    p.nextPositions = static_cast<int32_t*>(nextPositions);
    p.newContextLengths = static_cast<int32_t*>(newLengths);
    p.batchSize = batch;
    p.blockSize = blockSize;
    p.vocabSize = vocab;
    p.maskTokenId = maskTokenId;
    p.logitsType = static_cast<trtllm_dflash::DFlashLogitsType>(logitsType);
    p.schedule = static_cast<trtllm_dflash::DFlashAcceptSchedule>(schedule);
    return static_cast<int>(trtllm_dflash::launchDFlashAccept(p, static_cast<cudaStream_t>(stream)));
}
"""
LOGITS_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
SCHEDULES = {"auto": 0, "rows_in_parallel": 1, "per_request": 2}  # DFlashAcceptSchedule
KINDS = ("greedy-ties", "sampled", "mixed", "non-finite")
OUTPUTS = ("accepted", "committed", "next_block", "next_positions", "new_lengths")


def accept_cases(large_vocab: int) -> list[tuple[str, int, int, int]]:
    """(kind, block_size, vocab, batch): every kind on small shapes, and two kinds at a real vocabulary."""
    shapes = [(2, 7, 128), (4, 33, 64), (8, 513, 32), (16, 64, 64), (16, 1000, 32), (5, 2, 64)]
    return [(k, s, v, b) for k in KINDS for s, v, b in shapes] + [(k, 16, large_vocab, 4) for k in KINDS[:2]]


def make_case(kind: str, batch: int, block_size: int, vocab: int, gen):
    """Logits [B, S, V] fp32, temperatures [B] and request seeds (as tests/test_dflash_plugin.py makes them)."""
    import torch

    from trtllm_dflash.speculative.core import request_seed

    shape = (batch, block_size, vocab)
    if kind == "greedy-ties":  # small integers: most rows have a tied maximum
        logits, temperature = torch.randint(-2, 3, shape, generator=gen).float(), torch.zeros(batch)
    elif kind == "sampled":
        logits = torch.randn(shape, generator=gen) * 3
        temperature = torch.rand(batch, generator=gen) * 2 + 0.05
    elif kind == "mixed":  # greedy (0 or negative) and sampled requests in one batch
        logits = torch.randn(shape, generator=gen) * 2
        temperature = torch.tensor([0.0, -1.0, 0.7, 1.0, 1.3])[torch.randint(0, 5, (batch,), generator=gen)]
    else:  # "non-finite": +inf ties, -inf, NaN
        special = torch.tensor([float("inf"), float("-inf"), float("nan")])
        where = torch.rand(shape, generator=gen) < 0.15
        pick = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), where.numel(), replacement=True, generator=gen)
        logits = torch.where(where, special[pick.view(shape)], torch.randn(shape, generator=gen))
        temperature = torch.where(torch.rand(batch, generator=gen) < 0.5, 0.0, 0.9)
    seeds = [request_seed(int(torch.randint(0, 1000, (1,), generator=gen)), f"r{i}") for i in range(batch)]
    return logits, temperature, seeds


def accept_reference(draft, target, starts, block_size: int) -> dict:
    """The plugin's five outputs from the target tokens [B, K+1], as Decoder._decode commits them."""
    import torch

    from trtllm_dflash.speculative.core import accepted_lengths, block_input, bonus_tokens

    accepted = accepted_lengths(draft, target)  # [B]
    bonus = bonus_tokens(target, accepted)  # [B]
    j = torch.arange(block_size)[None]
    drafts = torch.cat([draft, draft[:, :1]], dim=1)  # block_size columns; column K is never a draft
    committed = torch.where(j < accepted[:, None], drafts, torch.where(j == accepted[:, None], bonus[:, None], -1))
    new_lengths = starts + accepted + 1
    return {"accepted": accepted, "committed": committed, "next_block": block_input(bonus, MASK, block_size),
            "next_positions": new_lengths[:, None] + j, "new_lengths": new_lengths}


def check_accept_cases(launch, dtypes: tuple[str, ...], cases: list[tuple[str, int, int, int]], seed: int = 0) -> dict:
    """Every case through `launch(draft, logits, temperature, noise, starts, block_size) -> {OUTPUTS}` (or through
    each of a {name: launch} dict, each mismatch naming its launch) against sample_tokens + accept_reference on the
    CPU. Greedy rows get NaN noise: reading it would change them."""
    launches = launch if isinstance(launch, dict) else {None: launch}
    import torch

    from trtllm_dflash.speculative.core import Sampling, gumbel_noise, sample_tokens

    gen = torch.Generator().manual_seed(seed)
    requests, bad, seen = 0, [], {}
    for kind, block, vocab, batch in cases:
        logits32, temperature, seeds = make_case(kind, batch, block, vocab, gen)
        starts = torch.randint(0, 1 << 20, (batch,), generator=gen)
        positions = starts[:, None] + 1 + torch.arange(block)  # row j chooses the token at start + j + 1
        noise = torch.full((batch, block, vocab), float("nan"))
        for b in torch.nonzero(temperature > 0).flatten().tolist():
            for j in range(block):
                noise[b, j] = gumbel_noise(seeds[b], int(positions[b, j]), vocab)
        for dtype in dtypes:
            logits = logits32.to(getattr(torch, dtype))
            target = sample_tokens(logits.float(), Sampling.plain(temperature, seeds), positions)
            want_accept = torch.randint(0, block, (batch,), generator=gen)  # every accepted length 0..K occurs
            noise_draft = torch.randint(0, vocab, (batch, block - 1), generator=gen)
            miss = (target[:, :-1] + torch.randint(1, max(vocab, 2), (batch, block - 1), generator=gen)) % vocab
            j = torch.arange(block - 1)[None]
            draft = torch.where(j < want_accept[:, None], target[:, :-1],
                                torch.where(j == want_accept[:, None], miss, noise_draft))
            want = accept_reference(draft, target, starts, block)
            for launch_name, run in launches.items():
                got = run(draft, logits, temperature, noise, starts, block)
                wrong = [name for name in OUTPUTS if not torch.equal(got[name].long().cpu(), want[name])]
                if wrong:
                    bad.append({"kind": kind, "dtype": dtype, "block_size": block, "vocab": vocab, "outputs": wrong,
                                **({"launch": launch_name} if launch_name else {})})
                requests += batch
            seen.setdefault(block, set()).update(want["accepted"].tolist())
    return {"cases": len(cases) * len(dtypes) * len(launches), "requests": requests, "dtypes": list(dtypes),
            "mismatching_cases": len(bad), "mismatches": bad[:20],
            "accepted_lengths_seen": {str(k): sorted(v) for k, v in sorted(seen.items())}}


def cuda_accept_library(path: Path):
    import ctypes

    lib = ctypes.CDLL(str(path))
    fn = lib.dflash_accept_cuda
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 11
    return fn


def cuda_launcher(fn, device: str, schedule: str):
    """launch() for check_accept_cases: inputs to the GPU, one launch of the step (SCHEDULES) on torch's stream,
    outputs back."""
    import torch

    def launch(draft, logits, temperature, noise, starts, block_size):
        batch, vocab = logits.shape[0], logits.shape[-1]
        ins = [draft.to(device, torch.int32), logits.to(device), temperature.to(device, torch.float32),
               noise.to(device, torch.float32), starts.to(device, torch.int32)]
        ins = [t.contiguous() for t in ins]
        outs = {name: torch.full((batch, block_size) if name in ("committed", "next_block", "next_positions")
                                 else (batch,), -7, dtype=torch.int32, device=device) for name in OUTPUTS}
        status = fn(batch, block_size, vocab, MASK, LOGITS_TYPES[str(logits.dtype).removeprefix("torch.")],
                    SCHEDULES[schedule], *[t.data_ptr() for t in ins], *[t.data_ptr() for t in outs.values()],
                    torch.cuda.current_stream(device).cuda_stream)
        torch.cuda.synchronize(device)
        if status != 0:
            raise RuntimeError(f"launchDFlashAccept returned cudaError {status}")
        return {name: t.cpu() for name, t in outs.items()}

    return launch


def time_accept_kernel(fn, device: str, B: int = 32) -> dict:
    """Kernel time at batch B, block 16, vocabulary 151936, bf16 greedy, under each schedule (SCHEDULES): all
    drafts accepted (every row read) and the first rejected (one row per request where the schedule stops there),
    against the same step in torch ops on the GPU."""
    import torch

    from trtllm_dflash.speculative.core import accepted_lengths, block_input, bonus_tokens

    S, V = 16, 151936
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn((B, S, V), generator=gen, device=device, dtype=torch.bfloat16)
    temperature, noise = torch.zeros(B, device=device), torch.zeros((B, S, V), device=device)
    starts = torch.full((B,), 1000, dtype=torch.int32, device=device)
    target = logits.float().argmax(-1)
    outs = [torch.empty((B,) if i in (0, 4) else (B, S), dtype=torch.int32, device=device) for i in range(5)]
    stream = torch.cuda.current_stream(device).cuda_stream

    def event_us(call, n: int = 50) -> float:
        call()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(n):
            call()
        end.record()
        end.synchronize()
        return round(begin.elapsed_time(end) * 1e3 / n, 1)

    timings = {}
    for label, draft in (("all_accepted", target[:, :-1]), ("first_rejected", (target[:, :-1] + 1) % V)):
        draft32 = draft.to(torch.int32).contiguous()
        ptrs = [draft32.data_ptr(), logits.data_ptr(), temperature.data_ptr(), noise.data_ptr(), starts.data_ptr()]
        timings[f"kernel_{label}_us"] = {}
        for schedule, code in SCHEDULES.items():
            def call(code=code, ptrs=ptrs):
                return fn(B, S, V, MASK, 2, code, *ptrs, *[o.data_ptr() for o in outs], stream)

            status = call()
            torch.cuda.synchronize(device)
            if status != 0:
                raise RuntimeError(f"launchDFlashAccept ({schedule}) returned cudaError {status}")
            timings[f"accepted_{label}"] = sorted(set(outs[0].tolist()))  # [15] and [0]
            timings[f"kernel_{label}_us"][schedule] = event_us(call)

        def torch_step(draft=draft):
            t = logits.argmax(-1)
            bonus = bonus_tokens(t, accepted_lengths(draft, t))
            return block_input(bonus, MASK, S)

        timings[f"torch_ops_{label}_us"] = event_us(torch_step)
    return {"batch": B, "block_size": S, "vocab": V, "logits": "bfloat16", **timings}


def stage_kernel(ctx: StageContext) -> None:
    r = ctx.results
    if not ctx.device.startswith("cuda"):
        raise Skip("the kernel runs on a CUDA device (--device cpu)")
    nvcc = find_nvcc()
    if nvcc is None:
        raise Skip("nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    arch = ctx.machine["nvcc_arch"]
    shim = ctx.tmp / "dflash_accept_ctypes.cu"
    shim.write_text(ACCEPT_SHIM)
    common = [nvcc, "-std=c++17", "-O2", f"-arch={arch}", "-I", PLUGIN_DIR]
    builds = {"kernel_check": [*common, PLUGIN_DIR / "kernel_check.cu", PLUGIN_DIR / "dflash_accept_kernel.cu",
                               "-o", ctx.tmp / "dflash_kernel_check"],
              "ctypes_library": [*common, "-shared", "-Xcompiler", "-fPIC", shim,
                                 PLUGIN_DIR / "dflash_accept_kernel.cu", "-o", ctx.tmp / "libdflash_accept_cuda.so"]}
    procs = {name: subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in builds.items()}  # both at once
    r.update(nvcc=str(nvcc), arch=arch, compile={})
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(10.0, ctx.remaining() - 30))
        except subprocess.TimeoutExpired:
            proc.kill()
            out = "timed out: " + proc.communicate()[0]
        r["compile"][name] = {"rc": proc.returncode, "output": out[-3000:]}
    ctx.log(f"compiled for {arch}: " + ", ".join(f"{n} rc {c['rc']}" for n, c in r["compile"].items()))
    ctx.save()
    problems = [f"{name} did not compile" for name, c in r["compile"].items() if c["rc"] != 0]
    if r["compile"]["kernel_check"]["rc"] == 0:
        run = r["kernel_check"] = run_command([ctx.tmp / "dflash_kernel_check"], min(120.0, ctx.remaining() - 20))
        run["lines"] = run.pop("output").splitlines()[-40:]
        ctx.log(f"kernel_check exit code {run['rc']} ({run['seconds']} s): {run['lines'][-1] if run['lines'] else ''}")
        if run["rc"] != 0:
            problems.append(f"kernel_check exited with {run['rc']}")
        ctx.save()
        sanitizer = find_sanitizer(nvcc)
        if sanitizer is None:
            r["compute_sanitizer"] = {"skipped": "compute-sanitizer was not found next to nvcc nor on PATH"}
        else:  # memcheck: out-of-bounds and misaligned accesses of the kernel, on every kernel_check case
            san = r["compute_sanitizer"] = run_command(
                [sanitizer, "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "20",
                 ctx.tmp / "dflash_kernel_check"], max(10.0, min(90.0, ctx.remaining() - 45)))
            san["lines"] = san.pop("output").splitlines()[-30:]
            ctx.log(f"compute-sanitizer memcheck exit code {san['rc']} ({san['seconds']} s)")
            if san["rc"] not in (0, None):
                problems.append(f"compute-sanitizer memcheck exited with {san['rc']}")
        ctx.save()
    if r["compile"]["ctypes_library"]["rc"] == 0:
        fn = cuda_accept_library(ctx.tmp / "libdflash_accept_cuda.so")
        launches = {name: cuda_launcher(fn, ctx.device, name) for name in ("rows_in_parallel", "per_request")}
        cases = r["torch_cases"] = check_accept_cases(launches, tuple(LOGITS_TYPES), accept_cases(151936))
        ctx.log(f"torch-driven cases: {cases['mismatching_cases']} of {cases['cases']} mismatching "
                f"({cases['requests']} requests)")
        if cases["mismatching_cases"]:
            problems.append(f"{cases['mismatching_cases']} torch-driven cases differ from speculative/core.py")
        ctx.save()
        r["timing"] = {}
        for batch in (1, 8, 32, 128):  # rows in parallel up to about 33 on an H100 (132 SMs x 4 blocks), then not
            r["timing"][str(batch)] = time_accept_kernel(fn, ctx.device, batch)
            ctx.log(f"timing at batch {batch}: {r['timing'][str(batch)]}")
            ctx.save()
    if problems:
        raise CheckFailed("; ".join(problems))


# ---------------------------------------------------------------- stage 4: pass timings, eager and CUDA graphs

def random_pair(shape: str, target_layers: int, draft_layers: int, block_size: int, dtype, device, seed: int = 0):
    """A TargetModel and a DFlashDrafter of `shape`'s layer dimensions with random weights (N(0, 0.02), norms
    1), made directly on `device`. Feature layers: the first min(5, target_layers) (Qwen3-8B's drafter has 5)."""
    import torch

    from trtllm_dflash.models.drafter import DFlashDrafter
    from trtllm_dflash.models.spec import DecoderSpec, DFlashParams
    from trtllm_dflash.models.target import TargetModel

    dims = PAIR_SHAPES[shape]
    common = dict(model_type="qwen3", rms_norm_eps=1e-6, qk_norm=True, attention_bias=False, mlp_bias=False,
                  tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=40960,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **dims)
    target_spec = DecoderSpec(num_layers=target_layers, **common)
    draft_spec = DecoderSpec(num_layers=draft_layers, **common)
    params = DFlashParams(block_size, dims["vocab_size"] - 1, tuple(range(min(5, target_layers))))
    gen = torch.Generator(device=device).manual_seed(seed)

    def weights(module) -> dict:
        return {name: torch.ones(t.shape, dtype=dtype, device=device) if name.endswith("norm.weight")
                else torch.randn(t.shape, generator=gen, dtype=dtype, device=device).mul_(0.02)
                for name, t in module.state_dict().items()}

    with torch.device("meta"):
        target_meta, drafter_meta = TargetModel(target_spec), DFlashDrafter(draft_spec, params)
    # .to(device) also moves the RoPE tables, which from_state_dict leaves on the CPU.
    target = TargetModel.from_state_dict(target_spec, weights(target_meta)).to(device)
    drafter = DFlashDrafter.from_state_dict(draft_spec, params, weights(drafter_meta)).to(device)
    return target, drafter


def static_target_pass(ex, token_ids, positions, slots, kv_len: int, capture: bool):
    """TargetModel.forward through TorchExecutor.target_forward, with the attended length `kv_len` given by the
    caller instead of int(positions.max()) + 1 (a device-to-host copy, which CUDA-graph capture forbids). Same
    modules, same calls, same order: the outputs equal the executor's (checked)."""
    import torch

    t = ex.target
    x = t.embed(token_ids)
    cos, sin = t.rotary["all"](positions, x.dtype)  # Qwen3 layers: one RoPE for all (models/target.py)
    mask = torch.arange(kv_len, device=x.device)[None, None, :] <= positions[:, :, None]  # [B, T, kv_len]
    layers = ex.drafter.params.target_layer_ids if capture else ()
    captured = {}
    for i, layer in enumerate(t.model.layers):
        x = layer(x, cos, sin, ex.target_cache, i, slots, positions, mask)
        if i in layers:
            captured[i] = x
    x = t.model.norm(x)
    if t.spec.num_layers - 1 in layers:
        captured[t.spec.num_layers - 1] = x
    hidden = torch.cat([captured[i] for i in layers], dim=-1) if layers else None
    return t.logits(x), hidden


def static_draft_pass(ex, anchors, starts, slots, kv_len: int):
    """TorchExecutor.draft (DFlashDrafter.forward + lm_head argmax) with the context length `kv_len` given by
    the caller instead of int(starts.max()); otherwise the same calls, without the context rows a DFlash step
    also adds in this pass (a K/V projection and cache write of a few rows per layer)."""
    import torch

    from trtllm_dflash.models.layers import apply_rotary, attend
    from trtllm_dflash.speculative.core import block_input

    d, block = ex.drafter, ex.block_size
    positions = starts[:, None] + torch.arange(block, device=anchors.device)
    x = ex.target.embed(block_input(anchors, d.params.mask_token_id, block))
    cos, sin = d.rotary(positions, x.dtype)
    visible = torch.arange(kv_len, device=x.device)[None, :] < starts[:, None]  # [B, kv_len]
    mask = torch.cat([visible, visible.new_ones(x.shape[0], block)], dim=1)[:, None, :].expand(-1, block, -1)
    for i, layer in enumerate(d.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rotary(attn.query(h), cos, sin)
        k_blk, v_blk = attn.key_value(h)
        k_ctx, v_ctx = ex.draft_cache.read(i, slots, kv_len)
        k = torch.cat([k_ctx, apply_rotary(k_blk, cos, sin)], dim=1)
        v = torch.cat([v_ctx, v_blk], dim=1)
        x = x + attn.output(attend(q, k, v, mask))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return ex.target.logits(d.norm(x)[:, 1:]).argmax(dim=-1)


def pass_functions(ex, batch: int, context: int, static: bool) -> dict:
    """The three passes at `batch` rows, every row's anchor at position `context`: the executor's calls, or
    the static-length ones (inputs are fixed tensors, as CUDA-graph replay needs)."""
    import torch

    dev, block = ex.device, ex.block_size
    gen = torch.Generator(device=dev).manual_seed(batch)
    ids = torch.randint(0, ex.vocab_size, (batch, block), generator=gen, device=dev)
    ar_ids, anchors = ids[:, :1].contiguous(), ids[:, 0].contiguous()
    starts = torch.full((batch,), context, dtype=torch.long, device=dev)
    slots = torch.arange(batch, device=dev)
    if not static:
        return {"ar": lambda: ex.target_forward(ar_ids, starts, slots, capture=False),
                "verify": lambda: ex.target_forward(ids, starts, slots, capture=True),
                "draft": lambda: ex.draft(anchors, starts, slots)}
    pos1, pos_block = starts[:, None] + torch.arange(1, device=dev), starts[:, None] + torch.arange(block, device=dev)
    return {"ar": lambda: static_target_pass(ex, ar_ids, pos1, slots, context + 1, False),
            "verify": lambda: static_target_pass(ex, ids, pos_block, slots, context + block, True),
            "draft": lambda: static_draft_pass(ex, anchors, starts, slots, context)}


def tensors_of(out) -> list:
    """The tensors of a pass's output (StepOutput, a tuple, or a tensor), in a fixed order."""
    if hasattr(out, "logits"):
        out = (out.logits, out.hidden)
    return [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]


def same_outputs(a, b) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(tensors_of(a), tensors_of(b), strict=True))


def median_ms(fn, device, repeats: int, warmup: int = 3) -> float:
    """Median wall time of fn() to the device's completion (host overhead included, which graphs remove)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        sync()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(samples), 4)


def capture_graph(fn, device):
    """fn() captured as a CUDA graph after warm-up on a side stream (torch.cuda.graphs' recipe)."""
    import torch

    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    return graph, out


def tree_pass(ex, batch: int, context: int, nodes: int):
    """TorchExecutor.verify_tree over `batch` draft trees of `nodes` nodes and their anchors at `context`: trees built
    as `run --tree-budget` builds them (speculative/tree.py), from random candidates with random log-probabilities
    (the cost depends on the node count, not on the tree's shape)."""
    import torch

    from trtllm_dflash.speculative.tree import ancestor_mask, build_trees

    dev, positions, k = ex.device, ex.block_size - 1, 8  # (run's 8 candidates per draft position)
    gen = torch.Generator().manual_seed(nodes)
    lps = torch.rand(batch, positions, k, generator=gen).log().sort(dim=-1, descending=True).values
    cands = torch.randint(0, ex.vocab_size, (batch, positions, k), generator=gen)
    trees = build_trees([0] * batch, cands.tolist(), lps.tolist(), nodes)
    tokens, depths = torch.tensor(trees.tokens, device=dev), torch.tensor(trees.depths, device=dev)
    mask = ancestor_mask(torch.tensor(trees.parents, device=dev))
    starts, slots = torch.full((batch,), context, device=dev), torch.arange(batch, device=dev)
    return lambda: ex.verify_tree(tokens, depths, mask, starts, slots, capture=True)


def layer_ms(ex, batch: int, context: int, tokens: int, repeats: int) -> float:
    """One target decoder layer over `tokens` new tokens per row at `context` (for depth extrapolation)."""
    import torch

    dev, t = ex.device, ex.target
    positions = torch.full((batch, 1), context, device=dev) + torch.arange(tokens, device=dev)
    x = torch.randn((batch, tokens, t.spec.hidden_size), device=dev, dtype=t.lm_head.weight.dtype)
    cos, sin = t.rotary["all"](positions, x.dtype)  # Qwen3 layers: one RoPE for all (models/target.py)
    mask = torch.arange(context + tokens, device=dev)[None, None, :] <= positions[:, :, None]
    slots = torch.arange(batch, device=dev)
    return median_ms(lambda: t.model.layers[0](x, cos, sin, ex.target_cache, 0, slots, positions, mask), dev, repeats)


def stage_timings(ctx: StageContext) -> None:
    import torch

    from trtllm_dflash.runtime.executor import TorchExecutor

    o, r = ctx.options, ctx.results
    dev = torch.device(ctx.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    started = time.monotonic()
    target, drafter = random_pair(o.shape, o.target_layers, o.draft_layers, o.block_size, dtype, dev)
    ex = TorchExecutor(target, drafter, num_slots=max(o.batch_sizes), max_seq_len=o.context + o.block_size,
                       block_size=o.block_size, tree_budget=max(o.tree_budgets, default=0))
    params = sum(p.numel() for m in (target, drafter) for p in m.parameters())
    r["config"] = {"shape": o.shape, **PAIR_SHAPES[o.shape], "target_layers": o.target_layers,
                   "draft_layers": o.draft_layers, "target_layer_ids": list(drafter.params.target_layer_ids),
                   "block_size": o.block_size, "context": o.context, "dtype": str(dtype).removeprefix("torch."),
                   "parameters_billions": round(params / 1e9, 3), "repeats": o.repeats,
                   "kv_cache": "random weights; cache contents do not change the cost"}
    r["fp8"] = ("not measured: the torch executor dequantizes FP8 weights to the compute dtype "
                "(models/quantized.py), so no FP8 GEMM would run")
    r["nvfp4"] = "not measured: NVFP4 GEMMs need Blackwell (sm_100); " + (
        "this GPU has none" if not ctx.machine.get("nvfp4_tensor_cores") else "and the executor emulates NVFP4 too")
    ctx.log(f"random pair of {o.shape} shapes ({r['config']['parameters_billions']} B parameters, "
            f"{r['config']['dtype']}) on {dev} in {time.monotonic() - started:.1f} s")
    eager: dict[str, dict[str, float]] = {}
    layers: dict[str, dict[str, float]] = {}
    r["eager_ms"], r["layer_ms"] = eager, layers
    for batch in o.batch_sizes:
        fns = pass_functions(ex, batch, o.context, static=False)
        eager[str(batch)] = {name: median_ms(fn, dev, o.repeats) for name, fn in fns.items()}
        layers[str(batch)] = {"ar": layer_ms(ex, batch, o.context, 1, o.repeats),
                              "verify": layer_ms(ex, batch, o.context, o.block_size, o.repeats)}
        ctx.log(f"eager, batch {batch}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in eager[str(batch)].items()))
        if o.tree_budgets:
            trees = r.setdefault("tree_verify_ms", {})
            trees[str(batch)] = {str(n): median_ms(tree_pass(ex, batch, o.context, n), dev, o.repeats)
                                 for n in o.tree_budgets}
            ctx.log(f"eager tree verify, batch {batch}: " + ", ".join(
                f"{n} nodes {ms:.3f} ms" for n, ms in trees[str(batch)].items()))
        ctx.save()
    r["speedup_bound"] = {"eager": bound_table(eager)}
    deep = {b: extrapolate_layers(eager[b], layers[b], o.target_layers, QWEN3_8B_LAYERS) for b in eager}
    r[f"eager_ms_extrapolated_{QWEN3_8B_LAYERS}_layers"] = {b: {k: round(v, 3) for k, v in t.items()}
                                                            for b, t in deep.items()}
    r["speedup_bound"][f"eager_extrapolated_{QWEN3_8B_LAYERS}_layers"] = bound_table(deep)
    ctx.save()
    if dev.type != "cuda":
        r["cuda_graphs"] = {"skipped": "CUDA graphs need a CUDA device"}
        return
    graphs_ms: dict[str, dict[str, float]] = {}
    r["graph_ms"] = graphs_ms
    checks = r["static_length_variant"] = {"equals_executor": {}, "replay_equals_eager": {}}
    for batch in o.batch_sizes:
        b = str(batch)
        executor_fns = pass_functions(ex, batch, o.context, static=False)
        static_fns = pass_functions(ex, batch, o.context, static=True)
        graphs_ms[b], checks["equals_executor"][b], checks["replay_equals_eager"][b] = {}, {}, {}
        for name, fn in static_fns.items():
            with torch.inference_mode():
                eager_out = fn()
                checks["equals_executor"][b][name] = same_outputs(eager_out, executor_fns[name]())
            try:
                graph, graph_out = capture_graph(fn, dev)
            except Exception as exc:  # recorded; what follows would run on a CUDA context in an unknown state
                r["graph_capture_error"] = {"batch": batch, "pass": name, "error": one_line(exc)}
                ctx.save()
                raise CheckFailed(f"the static-length {name} pass at batch {batch} could not be captured as a "
                                  f"CUDA graph: {one_line(exc)}") from None
            graph.replay()
            torch.cuda.synchronize(dev)
            checks["replay_equals_eager"][b][name] = same_outputs(graph_out, eager_out)
            graphs_ms[b][name] = median_ms(graph.replay, dev, o.repeats)
            del graph, graph_out, eager_out
        torch.cuda.empty_cache()
        r["speedup_bound"]["cuda_graphs"] = bound_table({k: v for k, v in graphs_ms.items() if len(v) == 3})
        ctx.log(f"CUDA graphs, batch {batch}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in graphs_ms[b].items()))
        ctx.save()
    # Last, because a failed capture can leave the CUDA context unusable for what would follow.
    as_written = r["cuda_graphs_executor_as_written"] = {}
    for name, fn in pass_functions(ex, 1, o.context, static=False).items():
        try:
            capture_graph(fn, dev)
            as_written[name] = {"captured": True}
        except Exception as exc:  # the finding itself: why the executor as written cannot be captured
            cause = exc.__cause__ or exc.__context__
            as_written[name] = {"captured": False, "error": one_line(exc),
                                "cause": one_line(cause) if cause is not None else None}
        ctx.save()
    try:
        torch.cuda.synchronize(dev)
        as_written["cuda_usable_afterwards"] = float(torch.ones(4, device=dev).sum()) == 4.0
    except RuntimeError as exc:
        as_written["cuda_usable_afterwards"] = False
        as_written["error_afterwards"] = one_line(exc)
    ctx.log("capture of the executor as written: " + ", ".join(
        f"{k} {'captured' if v['captured'] else 'not captured'}" for k, v in as_written.items() if isinstance(v, dict)))


# ---------------------------------------------------------------- stage 5: TensorRT

def tensorrt_headers(trt) -> Path | None:
    roots = [os.environ.get("TENSORRT_ROOT", ""), os.environ.get("TensorRT_ROOT", "")]
    candidates = [Path(r) / "include" for r in roots if r] + [
        Path(os.environ.get("TensorRT_INCLUDE_DIR", "/nonexistent")), Path(trt.__file__).parent / "include",
        Path("/usr/include/x86_64-linux-gnu"), Path("/usr/include/aarch64-linux-gnu"),
        Path("/usr/local/tensorrt/include"), Path("/usr/include")]
    return next((c for c in candidates if (c / "NvInfer.h").is_file()), None)


def trt_network(trt, builder):
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return builder.create_network(flags)


def tensorrt_plugin(ctx: StageContext, trt, logger) -> dict:
    """libtrtllm_dflash_plugins.so built here, loaded into TensorRT's registry, one DFlashAccept layer in an
    engine, run on the GPU against speculative/core.py."""
    import numpy as np
    import torch

    include, nvcc = tensorrt_headers(trt), find_nvcc()
    if include is None:
        raise Skip("TensorRT's C++ headers (NvInfer.h) were not found: set TENSORRT_ROOT to a directory with "
                   "include/NvInfer.h")
    if nvcc is None:
        raise Skip("nvcc was not found")
    lib = ctx.tmp / "libtrtllm_dflash_plugins.so"
    sources = [PLUGIN_DIR / f for f in ("dflash_accept_kernel.cu", "dflash_accept_plugin.cpp",
                                        "dflash_accept_creator.cpp")]
    built = run_command([nvcc, "-std=c++17", "-O2", f"-arch={ctx.machine['nvcc_arch']}", "-shared", "-Xcompiler",
                         "-fPIC", "-isystem", include, "-I", PLUGIN_DIR, *sources, "-o", lib], ctx.remaining() - 30)
    rec = {"headers": str(include), "compile": built}
    if built["rc"] != 0:
        return {"status": "failed", "error": "the plugin library did not compile", **rec}
    from trtllm_dflash.compile.tensorrt_build import load_plugin_library

    load_plugin_library(trt, lib)  # once per process: a second load_library of it would fail
    creator = trt.get_plugin_registry().get_creator("DFlashAccept", "1", "trtllm_dflash")
    if creator is None:
        return {"status": "failed", "error": "DFlashAccept/1/trtllm_dflash is not in the registry after loading", **rec}
    B, S, V = 64, 16, 1000
    builder = trt.Builder(logger)
    network = trt_network(trt, builder)
    specs = [("draft_tokens", trt.int32, (B, S - 1)), ("target_logits", trt.float32, (B, S, V)),
             ("temperature", trt.float32, (B,)), ("gumbel_noise", trt.float32, (B, S, V)),
             ("context_lengths", trt.int32, (B,))]
    inputs = [network.add_input(name, dtype, shape) for name, dtype, shape in specs]
    fields = trt.PluginFieldCollection([
        trt.PluginField("block_size", np.array([S], dtype=np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("mask_token_id", np.array([MASK], dtype=np.int32), trt.PluginFieldType.INT32)])
    plugin = creator.create_plugin("dflash_accept", fields, trt.TensorRTPhase.BUILD)
    layer = network.add_plugin_v3(inputs, [], plugin)
    out_names = ("accepted", "committed_tokens", "next_block", "next_positions", "new_context_lengths")
    for i, name in enumerate(out_names):
        layer.get_output(i).name = name
        network.mark_output(layer.get_output(i))
    blob = builder.build_serialized_network(network, builder.create_builder_config())
    if blob is None:
        return {"status": "failed", "error": "build_serialized_network returned None", **rec}
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    context = engine.create_execution_context()

    def launch(draft, logits, temperature, noise, starts, block_size):
        ins = [draft.int(), logits.float(), temperature.float(), noise.float(), starts.int()]
        bound = {name: t.to(ctx.device).contiguous() for (name, _, _), t in zip(specs, ins, strict=True)}
        outs = {name: torch.full(tuple(engine.get_tensor_shape(name)), -7, dtype=torch.int32, device=ctx.device)
                for name in out_names}
        for name, t in {**bound, **outs}.items():
            context.set_tensor_address(name, t.data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream(ctx.device).cuda_stream):
            raise RuntimeError("execute_async_v3 returned False")
        torch.cuda.synchronize(ctx.device)
        return {ours: outs[theirs].cpu() for ours, theirs in zip(OUTPUTS, out_names, strict=True)}

    cases = check_accept_cases(launch, ("float32",), [(kind, S, V, B) for kind in KINDS])
    ok = cases["mismatching_cases"] == 0
    return {"status": "passed" if ok else "failed", "error": None if ok else "engine outputs differ", **rec,
            "cases": cases}


def tensorrt_plans(ctx: StageContext, trt, logger) -> dict:
    """The demo engine's ONNX graphs (built with backend onnxruntime) compiled into TensorRT plans on this GPU by
    the project's own `trtllm-dflash compile` path, where this checkout has one."""
    try:
        from trtllm_dflash.compile.tensorrt_build import compile_engine
    except ImportError as exc:
        raise Skip(f"this checkout has no TensorRT build path (trtllm_dflash.compile.tensorrt_build: {exc})") from None
    try:
        import onnxruntime  # noqa: F401 - `backend: onnxruntime` builds export and check the graphs with these
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise Skip(f"an engine with ONNX graphs needs the onnx extra (pip install 'trtllm-dflash[onnx]'): {exc}"
                   ) from None
    from trtllm_dflash.config import load_build_config
    from trtllm_dflash.engine.builder import build_engine

    started = time.monotonic()
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=ctx.tmp / "demo_onnx")
    engine_dir = build_engine(cfg.model_copy(update={"backend": "onnxruntime"}), progress=False)
    ctx.log(f"built the demo engine with backend onnxruntime ({time.monotonic() - started:.1f} s)")
    lines: list[str] = []
    started = time.monotonic()
    plans = compile_engine(engine_dir, report=lambda line: (lines.append(line), ctx.log(line)))
    compiled = {"plans": [p.name for p in plans], "report": lines,
                "compile_seconds": round(time.monotonic() - started, 1)}
    ctx.results["plans"] = {"status": "running", **compiled}
    ctx.save()
    return {"status": "passed", "error": None, **compiled, "decode": tensorrt_decode(ctx, engine_dir)}


def tensorrt_decode(ctx: StageContext, engine_dir: Path) -> dict:
    """The compiled plans decode the held-out prompts as one batch with the TensorRT executor, each plan call run
    eagerly and replayed as CUDA graphs (runtime/plan_graphs.py), ar and dflash, greedy: graphs must give the eager
    tokens (the same kernels), and dflash must equal ar on each. Tokens/s of each, the graphs' second run (the first
    one captures)."""
    from trtllm_dflash.runtime.jsonl import Defaults, read_requests
    from trtllm_dflash.runtime.runner import Engine

    o, reports, out = ctx.options, [], {}
    engines = {"eager": Engine.load(engine_dir, backend="tensorrt", cuda_graphs=False),
               "graphs": Engine.load(engine_dir, backend="tensorrt", cuda_graphs=True, report=reports.append)}
    defaults = Defaults(o.max_new_tokens, 0.0, 0, engines["eager"].config.max_seq_len,
                        engines["eager"].executor.vocab_size)
    requests, errors = read_requests(PROMPTS, engines["eager"].tokenizer, defaults)
    assert not errors, errors
    requests = requests[: o.num_prompts]
    runs = {}
    for mode in ("ar", "dflash"):
        for name, engine in engines.items():
            runs[name, mode] = decode(engine, mode, requests, "cuda")
            if name == "graphs":  # again, over the captured graphs
                again = decode(engine, mode, requests, "cuda")
                out[f"graphs {mode}: replays == captures"] = differences(again["tokens"], runs[name, mode]["tokens"])
                runs[name, mode] = again
            ctx.log(f"tensorrt {name} {mode}: {runs[name, mode]['tokens_per_s']} tokens/s")
    out["runs"] = {f"{name} {mode}": {k: v for k, v in run.items() if k != "tokens"}
                   for (name, mode), run in runs.items()}
    out["not_captured"] = reports  # plans whose enqueue TensorRT refused under capture (they ran eagerly)
    out["graphs"] = len(engines["graphs"].executor._graphs.calls)
    for mode in ("ar", "dflash"):
        out[f"{mode}: graphs == eager"] = differences(runs["graphs", mode]["tokens"], runs["eager", mode]["tokens"])
    for name in engines:
        out[f"{name}: dflash == ar"] = differences(runs[name, "dflash"]["tokens"], runs[name, "ar"]["tokens"])
    failed = [check for check, found in out.items() if check.count("==") and found]
    if failed:
        raise CheckFailed(f"tensorrt decode: {', '.join(failed)} differ: {[out[c][0] for c in failed]}")
    return out


def stage_tensorrt(ctx: StageContext) -> None:
    try:
        import tensorrt as trt
    except Exception as exc:  # ImportError, or a wheel whose native libraries do not load
        raise Skip(f"`import tensorrt` failed ({one_line(exc, 200)})") from None
    from trtllm_dflash.compile.tensorrt_build import process_logger

    r = ctx.results
    r["tensorrt"] = trt.__version__
    logger = process_logger(trt)  # the one logger of this process, as compile_engine's builders get
    for name, part in (("plugin", tensorrt_plugin), ("plans", tensorrt_plans)):
        try:
            r[name] = part(ctx, trt, logger)
        except Skip as exc:
            r[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # recorded per part; the other part still runs
            r[name] = {"status": "failed", "error": one_line(exc), "traceback": traceback.format_exc()[-4000:]}
        ctx.log(f"{name}: {r[name]['status']}")
        ctx.save()
    parts = [r["plugin"], r["plans"]]
    if any(p["status"] == "failed" for p in parts):
        raise CheckFailed("; ".join(f"{n}: {p['error']}" for n, p in zip(("plugin", "plans"), parts, strict=True)
                                    if p["status"] == "failed"))
    if all(p["status"] == "skipped" for p in parts):
        raise Skip("; ".join(p["reason"] for p in parts))


STAGE_FUNCTIONS = {"executor": stage_executor, "decoder": stage_decoder, "kernel": stage_kernel,
                   "timings": stage_timings, "tensorrt": stage_tensorrt}


# ---------------------------------------------------------------- command line

def parse_args(argv: list[str]) -> argparse.Namespace:
    def stage_list(text: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        unknown = [n for n in names if n not in STAGES]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown stage {unknown[0] if unknown else '(none)'}; "
                                             f"stages: {','.join(STAGES)}")
        return names

    def positive(kind):
        def parse(text: str):
            value = kind(text)
            if not value > 0:
                raise argparse.ArgumentTypeError(f"must be positive, got {text}")
            return value
        return parse

    def int_list(text: str) -> tuple[int, ...]:
        return tuple(positive(int)(x) for x in text.split(","))

    d = Options()
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0],
                                epilog="Exit codes: 0 passed, 1 a stage failed, 2 usage, 3 no CUDA device visible, 143 SIGTERM.")
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report (default: gpu_check.json)")
    p.add_argument("--stages", type=stage_list, default=STAGES,
                   help=f"comma-separated stages to run (default: {','.join(STAGES)})")
    p.add_argument("--budget-s", type=positive(float), default=480.0,
                   help="total seconds for every stage together (default: 480)")
    p.add_argument("--num-prompts", type=positive(int), default=d.num_prompts,
                   help=f"executor (default: {d.num_prompts})")
    p.add_argument("--max-new-tokens", type=positive(int), default=d.max_new_tokens,
                   help=f"executor (default: {d.max_new_tokens})")
    p.add_argument("--context", type=positive(int), default=d.context, help=f"timings (default: {d.context})")
    p.add_argument("--batch-sizes", type=int_list, default=d.batch_sizes,
                   help=f"timings (default: {','.join(map(str, d.batch_sizes))})")
    p.add_argument("--repeats", type=positive(int), default=d.repeats, help=f"timings (default: {d.repeats})")
    p.add_argument("--target-layers", type=positive(int), default=d.target_layers,
                   help=f"timings (default: {d.target_layers})")
    p.add_argument("--draft-layers", type=positive(int), default=d.draft_layers,
                   help=f"timings (default: {d.draft_layers})")
    p.add_argument("--block-size", type=positive(int), default=d.block_size, help=f"timings (default: {d.block_size})")
    p.add_argument("--tree-budgets", type=int_list, default=d.tree_budgets,
                   help=f"timings: draft trees' nodes (default: {','.join(map(str, d.tree_budgets))})")
    p.add_argument("--shape", choices=sorted(PAIR_SHAPES), default=d.shape,
                   help=f"timings, decoder (default: {d.shape})")
    p.add_argument("--decoder-requests", type=positive(int), default=d.decoder_requests,
                   help=f"decoder (default: {d.decoder_requests})")
    p.add_argument("--decoder-new-tokens", type=positive(int), default=d.decoder_new_tokens,
                   help=f"decoder (default: {d.decoder_new_tokens})")
    p.add_argument("--prefill-tokens", type=positive(int), default=d.prefill_tokens,
                   help=f"decoder: the peak-memory prefill (default: {d.prefill_tokens})")
    p.add_argument("--kv-contexts", type=int_list, default=d.kv_contexts,
                   help=f"decoder: KVCache.read contexts (default: {','.join(map(str, d.kv_contexts))})")
    p.add_argument("--wheels", type=Path, default=None,
                   help=f"wheels to install first, offline, into a temporary directory (benchmarks/gpu_wheels.sh DIR; "
                        f"default: {WHEELS.relative_to(ROOT)}/ if it exists)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: run the stages' torch code on the CPU (a dry run of the script where there is no GPU; "
                        "the kernel and TensorRT stages skip) (default: cuda)")
    p.add_argument("--worker", choices=("machine", "preflight", *STAGES), help=argparse.SUPPRESS)
    p.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-budget-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker and args.block_size < 2:
        p.error("--block-size must be at least 2")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker_main(args.worker, args.worker_dir, args.worker_budget_s)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
