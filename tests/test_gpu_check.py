"""benchmarks/gpu_check.py where there is no GPU (CI): its refusal, its pure helpers, and the torch code of its
stages run on the CPU (the CUDA kernel, CUDA graphs and TensorRT need a GPU machine; see the script)."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import importlib.util
import json
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
    assert list(report["stages"]) == ["executor", "kernel", "timings", "tensorrt"]
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
            "options": {}, "environment": {}, "machine": {}, "stages": {name: dict(stage) for name in gc.STAGES}}


@pytest.mark.parametrize("change, problem", [
    (lambda r: r["stages"]["kernel"].update(status="failed"), "kernel: failed without an error"),
    (lambda r: r["stages"]["timings"].update(status="skipped"), "timings: skipped without a reason"),
    (lambda r: r["stages"]["executor"].update(status="ok"), "executor: status 'ok'"),
    (lambda r: r["stages"].pop("tensorrt"), "stages are"),
    (lambda r: r.pop("machine"), "missing key 'machine'"),
], ids=["failed-no-error", "skipped-no-reason", "bad-status", "missing-stage", "missing-key"])
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
    options = gc.Options(shape="tiny", context=16, batch_sizes=(1, 2), repeats=1, target_layers=2, block_size=4)
    ctx = gc.StageContext("timings", options, {}, "cpu", tmp_path, 60, tmp_path / "timings.json")
    gc.stage_timings(ctx)
    r = ctx.results
    assert r["config"]["target_layer_ids"] == [0, 1] and r["config"]["dtype"] == "float32"
    for table in (r["eager_ms"], r["eager_ms_extrapolated_36_layers"]):
        assert {b: sorted(t) for b, t in table.items()} == {b: ["ar", "draft", "verify"] for b in ("1", "2")}
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
    assert r["runs"]["gpu dflash"]["output_tokens"] == 12 and r["mean_acceptance_length"] >= 1


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


@pytest.mark.skipif(gc.find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
def test_kernel_shim_compiles(tmp_path):
    shim = tmp_path / "dflash_accept_ctypes.cu"
    shim.write_text(gc.ACCEPT_SHIM)
    built = gc.run_command([gc.find_nvcc(), "-std=c++17", "-O2", "-arch=sm_90a", "-I", gc.PLUGIN_DIR, "-c", shim,
                            "-o", tmp_path / "shim.o"], 120)
    assert built["rc"] == 0, built["output"]
