"""Shared fixtures: tiny random pairs in the real formats, built into engines.

"Biased" pairs shift the target's lm_head row of one token along the mean direction of the models'
final hidden states, so the target emits that token often (but not always) and a random drafter
agrees with it often: verify steps then accept varied numbers of drafts (0 .. K), which exercises
every branch of acceptance and commit. Unbiased random pairs accept almost nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest
import torch
import yaml
from filelock import FileLock
from safetensors.torch import load_file, save_file

from trtllm_dflash.config import BuildConfig, load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"

BIAS_TOKEN = 100

# Under pytest-xdist the test processes fill the cores already: a build exports its graphs in its own process
# (engine/builder.py export_processes; with two per build the exporting tests took 1.40x their earlier time and
# the others 1.14x, CI at 169af0f: docs/testing.md).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("TRTLLM_DFLASH_EXPORT_PROCESSES", "1")


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the extended tier (docs/testing.md): tests that repeat, for one more model family "
                          "or engine kind, what the default run covers; CI leaves it out to stay under 45 minutes")


def pytest_collection_modifyitems(config, items):
    """Deselect the `extended` tier unless --extended is given (reported as deselected, never skipped)."""
    if config.getoption("--extended"):
        return
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]


@pytest.fixture(autouse=True)
def _torch_threads():
    """Engine.load sets this process's torch threads (runtime/runner.py cpu_threads: 1 for the tiny test models);
    each test gets the process's threads back, so builds and exports in later tests keep every core."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def load_script(path: Path, name: str) -> ModuleType:
    """Import a script that is not in a package (benchmarks/, docker/) as module `name`, registered in sys.modules
    (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def bias_target(pair_dir: Path, token: int = BIAS_TOKEN, share: float = 0.85) -> None:
    """Make `token` win at about `share` of the lm_head calls of a DFlash run (in place, HF format).

    Adding alpha * d to the token's lm_head row raises its logit by alpha * (h . d). With d the mean
    direction of the hidden states that reach lm_head (target and drafter alike), the token becomes
    likely for both models, so drafts of it get accepted.
    """
    engine = Engine.load(build(pair_dir, pair_dir / "unbiased-engine"))
    seen: list[torch.Tensor] = []
    hook = engine.executor.target.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0].flatten(0, -2)))
    g = torch.Generator().manual_seed(0)
    reqs = [Request(id=i, prompt_token_ids=torch.randint(4, engine.executor.vocab_size, (10,), generator=g).tolist(),
                    max_new_tokens=40) for i in range(8)]
    list(engine.decoder("dflash").generate(reqs))
    hook.remove()
    hidden = torch.cat(seen).float()
    lm_head = engine.executor.target.lm_head.weight.float()
    logits = hidden @ lm_head.T
    direction = hidden.mean(0) / hidden.mean(0).norm()
    others = logits.clone()
    others[:, token] = -torch.inf
    needed = (others.max(-1).values - logits[:, token]) / (hidden @ direction).clamp_min(1e-6)
    alpha = needed.quantile(share)
    path = pair_dir / "target" / "model.safetensors"
    sd = load_file(str(path))
    name = "model.embed_tokens.weight" if engine.executor.target.spec.tie_word_embeddings else "lm_head.weight"
    sd[name][token] += alpha * direction
    save_file(sd, str(path), metadata={"format": "pt"})


class CountingPrefill:
    """The executor, counting the target positions its prefill passes (those with last_index) compute: padded, in all
    (`prefill_tokens`), and each request's own, pass by pass (`computed`), with each pass's logits (`logits`); and the
    positions of each request's drafter-context passes of their own (`contexts`)."""

    def __init__(self, executor):
        self._executor, self.prefill_tokens, self.computed, self.contexts, self.logits = executor, 0, [], [], []

    def append_context(self, hidden, *args, **kwargs):
        """(records the positions of each pass of its own that gives the drafter features)"""
        self.contexts += [hidden.shape[1]] * hidden.shape[0]
        return self._executor.append_context(hidden, *args, **kwargs)

    def target_forward(self, token_ids, *args, last_index=None, **kwargs):
        out = self._executor.target_forward(token_ids, *args, last_index=last_index, **kwargs)
        if last_index is not None:
            self.prefill_tokens += token_ids.shape[0] * token_ids.shape[1]
            self.computed.append((last_index + 1).tolist())
            self.logits.append(out.logits)
        return out

    def __getattr__(self, name):
        return getattr(self._executor, name)


def family_requests(vocab_size: int) -> list[Request]:
    """The model-family tests' greedy requests: 5 of different lengths on 4 slots, so one joins mid-run."""
    g = torch.Generator().manual_seed(0)
    lengths, max_new = [3, 20, 9, 1, 14], [12, 20, 5, 16, 9]
    return [Request(id=i, prompt_token_ids=torch.randint(4, vocab_size, (n,), generator=g).tolist(), max_new_tokens=m)
            for i, (n, m) in enumerate(zip(lengths, max_new))]


def assert_dflash_equals_ar_equals_generate(engine: Engine, hf, reqs: list[Request]) -> None:
    """Greedy: the engine's dflash and ar tokens are transformers' `hf.generate()`'s for every request, and varied
    (not one token repeated)."""
    from trtllm_dflash.runtime.decoding import Decoder

    dflash = {r.request.id: r for r in Decoder.for_mode(engine.executor, "dflash", ()).generate(reqs)}
    ar = {r.request.id: r for r in Decoder.for_mode(engine.executor, "ar", ()).generate(reqs)}
    for req in reqs:
        ids = torch.tensor([req.prompt_token_ids])
        want = hf.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
        assert dflash[req.id].output_token_ids == ar[req.id].output_token_ids == want, req.id
    assert len({t for r in ar.values() for t in r.output_token_ids}) > 10  # varied tokens, not one repeated


def assert_dflash_equals_ar_greedy_and_sampled(engine: Engine) -> None:
    """Lossless against itself: the family requests' dflash tokens == ar's, greedy and sampled (temperature 0.9)."""
    reqs = family_requests(engine.executor.vocab_size)
    sampled = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.9, seed=5 + r.id) for r in reqs]
    for batch in (reqs, sampled):
        tokens = {mode: {r.request.id: r.output_token_ids for r in engine.decoder(mode).generate(batch)}
                  for mode in ("dflash", "ar")}
        assert tokens["dflash"] == tokens["ar"]


def write_family_config(path: Path, pair: Path, **fields) -> Path:
    """A build config of a random pair at float32, 4 slots, 256 positions (and `fields`)."""
    cfg = {"target": str(pair / "target"), "drafter": str(pair / "drafter"), "dtype": "float32",
           "max_batch_size": 4, "max_seq_len": 256, **fields}
    path.write_text(yaml.safe_dump(cfg))
    return path


# The tensor-parallel family tests' requests (`run` JSONL lines): 5 prompts of different lengths
TP_LINES = [{"id": i, "prompt_token_ids": list(range(5 + i, 12 + 5 * i)), "max_new_tokens": 6 + 2 * i}
            for i in range(5)]


def assert_mpiexec_run_equals_one_process(one: Path, split: Path, tmp_path: Path, *run_args: str, ranks: int = 2,
                                          lines: list[dict] = TP_LINES,
                                          fields: tuple[str, ...] = ("output_token_ids",)) -> None:
    """`run` of the split engine under `mpiexec -n ranks` gives the tokens (the output lines' `fields`) of `run` of the
    one-rank engine, for every line (`run_args` passed to both)."""
    from trtllm_dflash.cli import main

    prompts, ref, out = tmp_path / "in.jsonl", tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["run", str(one), "--input", str(prompts), "--output", str(ref), *run_args]) == 0
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "trtllm_dflash.cli", "run", str(split), "--input",
           str(prompts), "--output", str(out), *run_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr

    def tokens(path: Path) -> dict:
        return {r["id"]: [r[f] for f in fields] for r in map(json.loads, path.read_text().splitlines())}

    assert tokens(out) == tokens(ref) and len(tokens(ref)) == len(lines)


def built_once(tmp_path_factory, name: str, make: Callable[[Path], Path]) -> Path:
    """`make(directory)`'s result (a path inside `directory`), made once per test run: alone, in a new temporary
    directory; under pytest-xdist (`-n 2`, the README's test command), once for all workers, by the first worker to
    ask, under a file lock that the others wait on. For the engines several modules need (a minute or two of export
    each), which would otherwise be built once in every worker."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent / name  # (the run's directory, above every worker's own)
    done = root / ".built"
    with FileLock(f"{root}.lock"):
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)  # (a worker that failed half-way)
            root.mkdir()
            done.write_text(str(make(root).relative_to(root)))
    return root / done.read_text()


def build(pair_dir: Path, out: Path, dtype: str = "float32", max_batch_size: int = 8,
          max_seq_len: int = 512) -> Path:
    cfg = BuildConfig(target=pair_dir / "target", drafter=pair_dir / "drafter", output=out, dtype=dtype,
                      max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return build_engine(cfg, force=True, progress=False)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_pair")
    write_random_pair(root, "qwen3", block_size=8)
    return root


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory) -> Path:
    """Llama-3 family with llama3 RoPE scaling, tied embeddings and a sharded, indexed checkpoint."""
    root = tmp_path_factory.mktemp("llama_pair")
    write_random_pair(root, "llama", block_size=8, tie_word_embeddings=True, shard=True, seed=1)
    return root


@pytest.fixture(scope="session")
def biased_pairs(tmp_path_factory) -> dict[int, Path]:
    """Biased qwen3 pairs for block sizes 2, 8 and 16 (same target weights, drafters per block size)."""
    pairs = {}
    for block in (8, 2, 16):
        root = tmp_path_factory.mktemp(f"biased_b{block}")
        write_random_pair(root, "qwen3", block_size=block, seed=2)
        if block == 8:
            bias_target(root)
        else:  # the one biased target, shared by all three
            shutil.copy(pairs[8] / "target" / "model.safetensors", root / "target" / "model.safetensors")
        pairs[block] = root
    return pairs


@pytest.fixture(scope="module")
def one_torch_thread():
    """Eager torch with 2 threads on a busy 2-core machine runs many times slower (ENVIRONMENT.md): a module's tests
    with `pytestmark = pytest.mark.usefixtures("one_torch_thread")` run on 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def biased_ort_engine(biased_pairs, tmp_path_factory) -> Path:
    """The biased block-8 pair built with `backend: onnxruntime` (4 slots, max_seq_len 512: a 300-token prompt is two
    of a TensorRT plan's passes of 256), shared by tests/test_tensorrt_build.py and
    tests/test_drafts_across_executors.py (its export takes ~1 min)."""
    pytest.importorskip("onnxruntime")
    pair = biased_pairs[8]

    def make(root: Path) -> Path:
        cfg = BuildConfig(target=pair / "target", drafter=pair / "drafter", output=root / "engine", dtype="float32",
                          max_batch_size=4, max_seq_len=512, backend="onnxruntime")
        return build_engine(cfg, progress=False)

    return built_once(tmp_path_factory, "biased_ort", make)


@pytest.fixture(scope="session")
def dflash2_pair(biased_pairs, tmp_path_factory) -> Path:
    """The biased block-8 target with a random DFlash2 drafter (convolutions and selector far from the identity)."""
    root = tmp_path_factory.mktemp("dflash2_pair")
    write_random_pair(root, "qwen3", block_size=8, seed=2, dflash2=True)
    shutil.copy(biased_pairs[8] / "target" / "model.safetensors", root / "target" / "model.safetensors")
    return root


@pytest.fixture(scope="session")
def biased_engines(biased_pairs, tmp_path_factory) -> dict[int, Engine]:
    out = tmp_path_factory.mktemp("biased_engines")
    return {b: Engine.load(build(p, out / f"b{b}", max_batch_size=4)) for b, p in biased_pairs.items()}


@pytest.fixture(scope="session")
def peaky_pair(biased_pairs, tmp_path_factory):
    """The biased pair with lm_head x20: random-init logits are nearly flat, trained LMs' are not.

    Drafts (argmax) are unchanged; at temperature 1 the target now has a few likely tokens per position.
    """
    root = tmp_path_factory.mktemp("peaky")
    shutil.copytree(biased_pairs[8], root, dirs_exist_ok=True)
    path = root / "target" / "model.safetensors"
    sd = load_file(str(path))
    sd["lm_head.weight"] *= 20
    save_file(sd, str(path), metadata={"format": "pt"})
    return root


@pytest.fixture(scope="session")
def wide_engine(peaky_pair) -> Engine:
    """The peaky pair's engine with 128 slots (sampling tests decode thousands of requests)."""
    return Engine.load(build(peaky_pair, peaky_pair / "wide-engine", max_batch_size=128))


@pytest.fixture(scope="session")
def qwen3_engine_dir(qwen3_pair, tmp_path_factory) -> Path:
    return build(qwen3_pair, tmp_path_factory.mktemp("qwen3_engine") / "engine")


@pytest.fixture(scope="session")
def gpt_oss_pair(tmp_path_factory) -> Path:
    """A tiny gpt-oss target (4 experts, top 2; sinks; sliding window 4 / full layers) and its random drafter."""
    root = tmp_path_factory.mktemp("gpt_oss_pair")
    write_random_pair(root, "gpt_oss", block_size=8, seed=0)
    return root


@pytest.fixture(scope="session")
def ort_engine_dir(request, tmp_path_factory):
    """family ("qwen3", "llama", "gpt_oss") -> that random pair built with `backend: onnxruntime` (its ONNX graphs
    exported, 30-60 s each), built on first use and shared by every test module."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        pytest.importorskip("onnxruntime")
        if family not in built:
            pair = request.getfixturevalue(f"{family}_pair")

            def make(root: Path) -> Path:
                cfg = BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32", max_batch_size=4,
                                  max_seq_len=256, backend="onnxruntime", output=root / "engine")
                return build_engine(cfg, progress=False)

            built[family] = built_once(tmp_path_factory, f"ort_{family}", make)
        return built[family]

    return get


@pytest.fixture(scope="session")
def gpt_oss_ort_engine(ort_engine_dir) -> Path:
    return ort_engine_dir("gpt_oss")


@pytest.fixture(scope="session")
def demo_ort_engine(tmp_path_factory) -> Path:
    """build_configs/demo.yaml with `backend: onnxruntime` (float32 graphs, 4 slots): the demo's compiled form, shared
    by tests/test_demo.py (its graphs, TensorRT-RTX plans) and tests/test_serve_onnxruntime.py (served by Triton)."""
    pytest.importorskip("onnxruntime")

    def make(root: Path) -> Path:
        cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=root / "engine")
        return build_engine(cfg.model_copy(update={"backend": "onnxruntime", "max_batch_size": 4}), progress=False)

    return built_once(tmp_path_factory, "demo_ort", make)
