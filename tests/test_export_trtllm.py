"""`trtllm-dflash export trtllm`: the directory TensorRT-LLM's PyTorch backend loads.

TensorRT-LLM is not installed here, so the directory is checked against what TensorRT-LLM reads, as found in
its published source (and ModelOpt's, installed here):

- `speculative_config` fields: `DFlashDecodingConfig` (`decoding_type: Literal['DFlash']`, `max_draft_len`,
  `speculative_model`, `mask_token_id`, `target_layer_ids`), NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py
  as rendered in the API reference llm-api/reference/DFlashDecodingConfig.html (releases 1.3.0rc27 and
  1.4.0rc1), and docs/source/features/speculative-decoding.md at commit
  04c8822cc42ffd1f5b6270874e5b9a64a20e7a58 ("DFlash" section; YAML `speculative_config` with `decoding_type`).
- The drafter TensorRT-LLM builds from `speculative_model`: `dflash_config.mask_token_id`,
  `dflash_config.target_layer_ids`, `block_size`, the architecture resolved from `model_type` when
  `DFlashDraftModel` is not registered: tensorrt_llm/_torch/models/modeling_dflash.py at commit
  009d8fa431bd3de92245aab80f8b57dc70da1ac4; drafts at block positions 1..max_draft_len:
  tensorrt_llm/_torch/speculative/dflash.py (NVIDIA/TensorRT-LLM, commit 2fc4bbbc414379ffe56f44bce35ff22c02ff91c8).
- `draft_len_schedule` and how `speculative_model` is found: tensorrt_llm/llmapi/llm_args.py at commit
  0004396720054fd8e205cbf616f21f0b57c6b412 (`DecodingBaseConfig.validate_draft_len_schedule_and_sort`: keys >= 1,
  values >= 0 and <= max_draft_len, the smallest key maps to max_draft_len, an older copy also requires key 1;
  `TorchLlmArgs.validate_speculative_config`: `os.path.join(speculative_model, "config.json")` opened as given,
  i.e. relative to the working directory, and a schedule forces `cuda_graph_config.enable_padding`).
- `kv_cache_config.free_gpu_memory_fraction`, `cuda_graph_config.{batch_sizes, enable_padding}`: the API reference
  DecodeCudaGraphConfig.html (1.3.0rc27) and examples/llm_runtime.py (KvCacheConfig, CudaGraphConfig).
- Commands: tensorrt_llm/commands/serve.py at commit 00209af149e7774406881a37283dce303571eb11 (`trtllm-serve
  MODEL`, `--tp_size`, `--config` / `--extra_llm_api_options`), tensorrt_llm/commands/bench.py at commit
  0c9a37db1f06912c2109c13272029bd7a13cb248 (`--model`, `--model_path`) and
  tensorrt_llm/bench/benchmark/throughput.py at commit 000a01de66f0eab4ab05640711f0253f50f5209c (`throughput
  --backend --tp --dataset --extra_llm_api_options`).
- hf_quant_config.json and config.json `quantization_config`: compared here with what ModelOpt's own
  export_hf_checkpoint writes for the same target (modelopt installed in this environment).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from trtllm_dflash.checkpoint.formats import load_drafter
from trtllm_dflash.cli import main
from trtllm_dflash.config import BuildConfig
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.engine_dir import write_manifest
from trtllm_dflash.errors import UserError
from trtllm_dflash.export.draft_len import TOKEN_BUDGET, default_schedule, measured_schedule
from trtllm_dflash.export.trtllm import merge_shards
from trtllm_dflash.runtime.costs import PROFILE_VERSION, PassCosts, ProfileKey, engine_sha256, write_profile
from trtllm_dflash.models.quantized import dequantize_state_dict
from trtllm_dflash.models.shard import Split, shard_tensor, split_for
from trtllm_dflash.models.spec import DecoderSpec, hf_config_from_dict
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
FILES = {".trtllm-dflash", "README.md", "extra_llm_api_options.yaml", "drafter/config.json",
         "drafter/model.safetensors", "target/config.json", "target/model.safetensors",
         "target/generation_config.json"}


@pytest.fixture(scope="module", autouse=True)
def empty_cost_cache(tmp_path_factory):
    """No cost profile of the user's own runs may change the exported schedule: an empty cache for this module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRTLLM_DFLASH_CACHE_DIR", str(tmp_path_factory.mktemp("cost_cache")))
        yield


def build(pair: Path, out: Path, tp: int = 1, **kw) -> Path:
    cfg = BuildConfig(target=pair / "target", drafter=pair / "drafter", output=out, dtype="float32", tp_size=tp,
                      max_batch_size=6, max_seq_len=512, **kw)
    return build_engine(cfg, progress=False)


def export(engine: Path, out: Path, *extra: str) -> Path:
    assert main(["export", "trtllm", str(engine), "--output", str(out), *extra]) == 0
    return out


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def resharded_equal_rank_files(export_dir: Path, engine: Path) -> None:
    """merge_shards is the exact inverse of the split: cutting the exported tensors again gives every rank file
    (the target, with a gpt-oss target's experts cut by the engine's moe_parallel, and an unquantized drafter)."""
    cfg = json.loads((engine / "config.json").read_text())
    tp, moe = cfg["mapping"]["tp_size"], cfg["build"]["moe_parallel"]
    exported = {"target": tensors(export_dir / "target" / "model.safetensors"),
                "drafter": tensors(export_dir / "drafter" / "model.safetensors")}
    if cfg["quantization"].get("drafter") == "quantized":
        del exported["drafter"]  # exported dequantized: checked against the engine by value instead
    for part, full in exported.items():
        spec = DecoderSpec.from_hf(hf_config_from_dict(cfg[part], part))
        for r in range(tp):
            rank = {k[len(part) + 1:]: v for k, v in tensors(engine / f"rank{r}.safetensors").items()
                    if k.startswith(part + ".")}
            assert rank.keys() == full.keys(), part
            for key, t in rank.items():
                assert same(shard_tensor(full[key], split_for(key, spec, tp, r, moe)), t), (part, r, key)


# ---------------------------------------------------------------------------------------------------------
# Pure: merging rank slices
# ---------------------------------------------------------------------------------------------------------


def assert_same_logits(engine, hf, ids: torch.Tensor) -> torch.Tensor:
    """The engine's target and the exported checkpoint loaded by transformers give the same logits for `ids`;
    returns transformers' logits."""
    target = engine.executor.target
    ours = target(ids[None], torch.arange(len(ids))[None], torch.tensor([0]), target.new_cache(1, 64)).logits
    with torch.no_grad():
        ref = hf(ids[None]).logits
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    return ref

def test_merge_shards_inverts_every_kind_of_split():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 8, generator=g)
    rows = [Split(0, 0, 3, 6), Split(0, 3, 6, 6)]
    assert torch.equal(merge_shards([shard_tensor(w, s) for s in rows], rows, "rows"), w)
    # NVFP4 packing: 2 inputs per byte, so logical columns [0, 8) of 16 are stored columns [0, 4).
    packed = torch.randint(0, 255, (4, 8), dtype=torch.uint8, generator=g)
    cols = [Split(1, 0, 8, 16), Split(1, 8, 16, 16)]
    assert torch.equal(merge_shards([shard_tensor(packed, s) for s in cols], cols, "packed"), packed)
    # The vocabulary (5 rows) padded to 8 over 4 ranks: ranks 2 and 3 hold a row and zero rows.
    vocab = [Split(0, 2 * r, 2 * r + 2, 5) for r in range(4)]
    parts = [shard_tensor(w[:5], s) for s in vocab]
    assert [p.shape[0] for p in parts] == [2, 2, 2, 2] and not parts[3].any()
    assert torch.equal(merge_shards(parts, vocab, "vocab"), w[:5])
    # One KV head shared by two ranks; a replicated norm.
    kv = [Split(0, 0, 3, 3), Split(0, 0, 3, 3)]
    assert torch.equal(merge_shards([w[:3], w[:3]], kv, "kv"), w[:3])
    assert torch.equal(merge_shards([w[0], w[0]], [None, None], "norm"), w[0])
    # Anything else is not one tensor cut in pieces.
    with pytest.raises(UserError, match="replicated tensor differs"):
        merge_shards([w[0], w[1]], [None, None], "norm")
    with pytest.raises(UserError, match="held by several ranks differs"):
        merge_shards([w[:3], w[3:]], kv, "kv")
    with pytest.raises(UserError, match="padding is not zero"):
        merge_shards(parts[:3] + [torch.ones_like(parts[3])], vocab, "vocab")


# ---------------------------------------------------------------------------------------------------------
# The demo engine: loads in transformers with our logits, the drafter as the engine holds it
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from trtllm_dflash.config import load_build_config

    tmp = tmp_path_factory.mktemp("demo_export")
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=tmp / "engine")
    engine = build_engine(cfg.model_copy(update={"backend": "torch"}), progress=False)  # no graphs needed
    return engine, export(engine, tmp / "trtllm")


def test_every_file_is_there(demo):
    engine, out = demo
    tokenizer = {f"target/{p.name}" for p in (engine / "tokenizer").iterdir()}
    assert set(files(out)) == FILES | tokenizer
    assert json.loads((out / ".trtllm-dflash").read_text())["kind"] == "trtllm export"
    assert not (out / "target" / "hf_quant_config.json").exists()


def test_yaml_has_exactly_the_documented_fields(demo):
    engine, out = demo
    cfg = json.loads((engine / "config.json").read_text())
    options = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())
    assert options == {
        "tensor_parallel_size": 1,
        "max_batch_size": cfg["max_batch_size"],
        "max_seq_len": cfg["max_seq_len"],
        "kv_cache_config": {"free_gpu_memory_fraction": 0.8},
        "cuda_graph_config": {"batch_sizes": [1, 2, 4, 8], "enable_padding": True},
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": cfg["dflash"]["block_size"] - 1,
                               # no cost profile, 8 slots x 16 tokens within the default budget: one key
                               "draft_len_schedule": {1: cfg["dflash"]["block_size"] - 1},
                               "speculative_model": str((out / "drafter").resolve()),
                               "mask_token_id": cfg["dflash"]["mask_token_id"],
                               "target_layer_ids": cfg["dflash"]["target_layer_ids"]},
    }
    types = {k: type(v) for k, v in options["speculative_config"].items()}
    assert types == {"decoding_type": str, "max_draft_len": int, "draft_len_schedule": dict, "speculative_model": str,
                     "mask_token_id": int, "target_layer_ids": list}
    root = out.resolve()
    readme = (out / "README.md").read_text()
    assert (f"trtllm-serve {root}/target --backend pytorch --tp_size 1 --extra_llm_api_options "
            f"{root}/extra_llm_api_options.yaml") in readme
    assert (f"trtllm-bench --model {root}/target --model_path {root}/target throughput --backend pytorch --tp 1 "
            f"--dataset DATASET.jsonl --extra_llm_api_options {root}/extra_llm_api_options.yaml") in readme


def trtllm_finds_the_drafter(options_yaml: Path) -> dict:
    """What TensorRT-LLM does with the YAML in the working directory it runs in (TorchLlmArgs.validate_speculative_config
    at the commit in the module docstring): `os.path.join(speculative_model, "config.json")`, read if it exists, for
    dflash_config.target_layer_ids / mask_token_id; a path that does not exist is later taken for a hub model id."""
    spec = yaml.safe_load(options_yaml.read_text())["speculative_config"]
    path = os.path.join(spec["speculative_model"], "config.json")
    assert os.path.exists(path), f"TensorRT-LLM would look for a hub model named {spec['speculative_model']!r}"
    with open(path) as f:
        return json.load(f)["dflash_config"]


def test_yaml_and_commands_work_from_another_working_directory(demo, tmp_path, monkeypatch):
    engine, out = demo
    cfg = json.loads((engine / "config.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # neither the export nor its parent
    dflash = trtllm_finds_the_drafter(out.resolve() / "extra_llm_api_options.yaml")
    assert dflash["target_layer_ids"] == cfg["dflash"]["target_layer_ids"]
    assert dflash["mask_token_id"] == cfg["dflash"]["mask_token_id"]
    # Every path in the README's commands exists from here too (DATASET.jsonl is the user's).
    for command in [line for line in (out / "README.md").read_text().splitlines() if line.startswith("trtllm-")]:
        paths = [w for w in command.split() if "/" in w]
        assert paths and all(os.path.isabs(w) and os.path.exists(w) for w in paths), command


def trtllm_schedule_errors(schedule: dict, max_draft_len: int) -> list[str]:
    """TensorRT-LLM's DecodingBaseConfig.validate_draft_len_schedule_and_sort (both stored copies: the smallest key
    maps to max_draft_len; the older one requires key 1), restated here independently of export/draft_len.py."""
    errors = [f"key {b}" for b in schedule if not (isinstance(b, int) and b >= 1)]
    errors += [f"value {d}" for d in schedule.values() if not (isinstance(d, int) and 0 <= d <= max_draft_len)]
    if 1 not in schedule:
        errors.append("no key 1")
    if schedule and schedule[min(schedule)] != max_draft_len:
        errors.append("smallest key does not map to max_draft_len")
    return errors


def test_default_schedule_keeps_the_verified_tokens_within_the_budget():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    schedule = default_schedule(16, sizes)
    assert schedule == {1: 15, 32: 7, 64: 3, 128: 1, 256: 0}
    assert trtllm_schedule_errors(schedule, 15) == []
    for b in sizes:  # TensorRT-LLM's lookup: the value of the largest key <= batch
        draft_len = schedule[max(k for k in schedule if k <= b)]
        assert b * (draft_len + 1) <= max(TOKEN_BUDGET, b) and (draft_len == 15 or b * (draft_len + 2) > TOKEN_BUDGET)
    assert default_schedule(8, [1, 2, 4]) == {1: 7}


def costs_where_verify_grows_with_batch_tokens(block: int, batches=(1, 2, 4, 8, 16, 32)) -> PassCosts:
    """A hand-made profile: a target pass costs 1 ms up to 32 tokens over the batch, then 1 ms per 32 more; the
    drafter pass 0.3 ms per request; acceptance and context hand-over nearly free."""
    tokens = tuple(t for t in (1, 2, 4, 8, 16) if t <= block) + ((block,) if block > 16 else ())
    target = tuple(tuple(max(1.0, b * t / 32) * 1e-3 for t in tokens) for b in batches)
    draft = tuple(tuple(0.3e-3 * b for _ in tokens) for b in batches)
    small = tuple(tuple(1e-6 for _ in tokens) for _ in batches)
    return PassCosts(tuple(batches), tokens, (64, 512), (target, target), (draft, draft), small, small)


def test_measured_schedule_shortens_the_blocks_where_verifying_costs():
    costs = costs_where_verify_grows_with_batch_tokens(16)
    at_least = [0.8 ** j for j in range(1, 16)]
    schedule = measured_schedule(costs, at_least, 16, [1, 2, 4, 8, 16, 32], 512)
    assert trtllm_schedule_errors(schedule, schedule[1]) == []
    lengths = [schedule[max(k for k in schedule if k <= b)] for b in (1, 2, 4, 8, 16, 32)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1], schedule
    # Cheap verification everywhere: the longest block at every batch size, one key.
    one_ms = tuple(tuple(1e-3 for _ in costs.tokens) for _ in costs.batches)
    flat = PassCosts(costs.batches, costs.tokens, costs.contexts, (one_ms, one_ms), (one_ms, one_ms), costs.context_s,
                     costs.accept_s)
    assert measured_schedule(flat, at_least, 16, [1, 2, 4, 8, 16, 32], 512) == {1: 15}


def test_export_uses_the_engines_cached_cost_profile(pair, tmp_path, monkeypatch):
    engine = build(pair, tmp_path / "engine")
    cfg = json.loads((engine / "config.json").read_text())
    block = cfg["dflash"]["block_size"]
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    without = yaml.safe_load((export(engine, tmp_path / "a") / "extra_llm_api_options.yaml").read_text())
    costs = costs_where_verify_grows_with_batch_tokens(block, batches=(1, 2, 4, 6))
    key = ProfileKey(PROFILE_VERSION, engine_sha256(engine), "torch", "test CPU", 1, block, 6)
    sha = engine_sha256(engine)
    write_profile(tmp_path / "cache" / "cost_profiles" / f"{sha[:16]}-torch.json", key, costs)
    out = export(engine, tmp_path / "b")
    spec = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())["speculative_config"]
    at_least = [0.6 ** j for j in range(1, block)]  # no acceptance record: the chooser's prior
    want = measured_schedule(costs, at_least, block, [1, 2, 4, 6], 512)
    assert spec["draft_len_schedule"] == want != without["speculative_config"]["draft_len_schedule"]
    assert spec["max_draft_len"] == want[1] and trtllm_schedule_errors(want, spec["max_draft_len"]) == []
    assert "cost profile (torch backend on test CPU, 1 thread, context 512" in (out / "extra_llm_api_options.yaml").read_text()


def test_target_loads_in_transformers_with_our_logits(demo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtllm_dflash.runtime.runner import Engine

    engine_dir, out = demo
    hf = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(str(out / "target"))
    ids = torch.tensor(tokenizer("def fibonacci(n):\n    ")["input_ids"])
    engine = Engine.load(engine_dir)
    assert_same_logits(engine, hf, ids)
    assert hf.generation_config.eos_token_id in (engine.config.eos_token_ids, engine.config.eos_token_ids[0])


def test_drafter_is_the_engines_in_the_z_lab_format(demo):
    engine, out = demo
    drafter = load_drafter(out / "drafter")
    cfg = json.loads((engine / "config.json").read_text())
    assert drafter.hf_config["architectures"] == ["DFlashDraftModel"]
    assert drafter.params.block_size == cfg["dflash"]["block_size"]
    assert list(drafter.params.target_layer_ids) == cfg["dflash"]["target_layer_ids"]
    assert drafter.params.mask_token_id == cfg["dflash"]["mask_token_id"]
    rank = tensors(engine / "rank0.safetensors")
    exported = load_file(str(out / "drafter" / "model.safetensors"))
    assert exported.keys() == {k[len("drafter."):] for k in rank if k.startswith("drafter.")}
    assert all(same(v, rank["drafter." + k]) for k, v in exported.items())


# ---------------------------------------------------------------------------------------------------------
# Tensor parallelism, determinism, --force
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export_pair")
    write_random_pair(root, "qwen3", seed=5)
    return root


def test_tp2_exports_the_tp1_target_and_re_export_is_byte_identical(pair, tmp_path):
    one, two = build(pair, tmp_path / "tp1"), build(pair, tmp_path / "tp2", tp=2)
    a, b = export(one, tmp_path / "a"), export(two, tmp_path / "b")
    for name in ("target/model.safetensors", "drafter/model.safetensors", "drafter/config.json",
                 "target/config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    resharded_equal_rank_files(b, two)
    first = files(b)
    assert export(two, b, "--force") == b and files(b) == first  # --force replaces an export, same bytes
    # Elsewhere, only the absolute paths in the YAML and the README differ.
    elsewhere = {k: v.replace(str((tmp_path / "c").resolve()).encode(), str(b.resolve()).encode())
                 for k, v in files(export(two, tmp_path / "c")).items()}
    assert elsewhere == first


# ---------------------------------------------------------------------------------------------------------
# NVFP4: ModelOpt's unified format, as ModelOpt writes it
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nvfp4(pair, tmp_path_factory):
    pytest.importorskip("modelopt.torch.quantization")
    tmp = tmp_path_factory.mktemp("nvfp4_export")
    q = dict(quantization="nvfp4", quantize_drafter=True, calibration_samples=4, calibration_max_tokens=32)
    one, two = build(pair, tmp / "tp1", **q), build(pair, tmp / "tp2", tp=2, **q)
    return one, two, export(one, tmp / "a"), export(two, tmp / "b")


def modelopt_export(target: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from trtllm_dflash.quantize.modelopt_cpu import calibrate, export_unified

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16).eval()
    calibrate(model, "nvfp4", [torch.arange(4, 20)[None]])
    export_unified(model, out)
    return out


@pytest.mark.slow
def test_nvfp4_configs_are_modelopts(nvfp4, pair, tmp_path):
    _, _, a, _ = nvfp4
    theirs = modelopt_export(pair / "target", tmp_path / "modelopt")
    assert (a / "target" / "hf_quant_config.json").read_text() == (theirs / "hf_quant_config.json").read_text()
    ours_cfg = json.loads((a / "target" / "config.json").read_text())
    their_cfg = json.loads((theirs / "config.json").read_text())
    assert ours_cfg["quantization_config"] == their_cfg["quantization_config"]
    assert list(ours_cfg)[-1] == list(their_cfg)[-1] == "quantization_config"
    # The same tensor names, and the quantized ones with ModelOpt's dtypes and shapes.
    ours, their = tensors(a / "target" / "model.safetensors"), tensors(theirs / "model.safetensors")
    assert ours.keys() == their.keys()
    for k, t in their.items():
        if t.dtype != torch.bfloat16:
            assert (ours[k].dtype, ours[k].shape) == (t.dtype, t.shape), k


@pytest.mark.slow
def test_nvfp4_tensors_read_back_equal_the_engines(nvfp4):
    from trtllm_dflash.quantize.modelopt_cpu import read_quantized_linear
    from trtllm_dflash.quantize.nvfp4 import NVFP4Weight

    one, two, a, b = nvfp4
    engine = tensors(one / "rank0.safetensors")
    exported = tensors(a / "target" / "model.safetensors")
    cfg = json.loads((one / "config.json").read_text())
    modules = [m[len("target."):] for m in cfg["quantization"]["quantized_modules"] if m.startswith("target.")]
    assert len(modules) == 7 * cfg["target"]["num_hidden_layers"]
    for m in modules:
        ours, theirs = read_quantized_linear(exported, m), read_quantized_linear(engine, "target." + m)
        assert isinstance(ours, NVFP4Weight) and isinstance(theirs, NVFP4Weight)
        for field in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            assert same(getattr(ours, field), getattr(theirs, field)), (m, field)
    assert all(same(v, engine["target." + k]) for k, v in exported.items())
    # tp 2: the same bytes (the packed row-parallel splits merge back exactly).
    assert (a / "target" / "model.safetensors").read_bytes() == (b / "target" / "model.safetensors").read_bytes()
    resharded_equal_rank_files(b, two)


@pytest.mark.slow
def test_quantized_drafter_is_exported_dequantized(nvfp4):
    one, _, a, b = nvfp4
    rank = {k[len("drafter."):]: v for k, v in tensors(one / "rank0.safetensors").items() if k.startswith("drafter.")}
    assert any(k.endswith(".weight_scale") for k in rank)
    plain, _ = dequantize_state_dict(rank, torch.float32)
    exported = load_file(str(a / "drafter" / "model.safetensors"))
    assert exported.keys() == plain.keys() and all(same(v, plain[k]) for k, v in exported.items())
    assert (a / "drafter" / "model.safetensors").read_bytes() == (b / "drafter" / "model.safetensors").read_bytes()
    assert "written dequantized" in (a / "README.md").read_text()
    assert not (a / "drafter" / "hf_quant_config.json").exists()


# ---------------------------------------------------------------------------------------------------------
# gpt-oss (mixture of experts): transformers' GptOssForCausalLM layout, experts merged back from tp and ep splits
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_pair, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{"tp1" | "tp2" (experts by intermediate features) | "ep2" (whole experts): (engine, export)}."""
    tmp = tmp_path_factory.mktemp("gpt_oss_export")
    out = {}
    for name, tp, moe in (("tp1", 1, "tp"), ("tp2", 2, "tp"), ("ep2", 2, "ep")):
        engine = build(gpt_oss_pair, tmp / name, tp=tp, moe_parallel=moe)
        out[name] = engine, export(engine, tmp / f"{name}_trtllm")
    return out


def test_gpt_oss_target_loads_in_transformers_with_our_logits(gpt_oss):
    from transformers import AutoModelForCausalLM

    from trtllm_dflash.runtime.runner import Engine

    engine_dir, out = gpt_oss["tp1"]
    hf = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    # transformers' own names and shapes: the fused experts [E, H, 2I] / [E, I, H] with biases, router, sinks
    exported = tensors(out / "target" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 256)
    ids = torch.tensor([5, 17, 3, 99, 250, 7, 42, 11, 300, 8, 64, 2, 77, 19])  # longer than the sliding window 4
    engine = Engine.load(engine_dir)
    ref = assert_same_logits(engine, hf, ids)
    assert ref.std() > 0.1  # (logits that say something: the random weights are large enough)


def test_gpt_oss_tp2_and_ep2_export_the_tp1_bytes(gpt_oss):
    _, a = gpt_oss["tp1"]
    for name in ("tp2", "ep2"):
        engine, b = gpt_oss[name]
        for f in ("target/model.safetensors", "target/config.json", "drafter/model.safetensors",
                  "drafter/config.json"):
            assert (a / f).read_bytes() == (b / f).read_bytes(), (name, f)
        resharded_equal_rank_files(b, engine)
    yaml_of = {n: yaml.safe_load((gpt_oss[n][1] / "extra_llm_api_options.yaml").read_text()) for n in gpt_oss}
    moe = {n: (o["tensor_parallel_size"], o["moe_tensor_parallel_size"], o["moe_expert_parallel_size"])
           for n, o in yaml_of.items()}
    assert moe == {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "ep2": (2, 1, 2)}
    assert "moe_expert_parallel_size" not in (gpt_oss["tp1"][1] / "README.md").read_text()
    assert "(moe_parallel: ep)" in (gpt_oss["ep2"][1] / "README.md").read_text()


def test_gpt_oss_engine_with_experts_not_split_as_recorded_is_refused(gpt_oss, tmp_path, capsys):
    engine, _ = gpt_oss["ep2"]
    copy = Path(shutil.copytree(engine, tmp_path / "e"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["build"]["moe_parallel"] = "tp"
    (copy / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_manifest(copy)
    assert main(["export", "trtllm", str(copy), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "rank 0 holds 2 of 4 experts, which is not moe_parallel: tp at tp_size 2" in err, err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def gpt_oss_nvfp4(gpt_oss_pair, tmp_path_factory):
    pytest.importorskip("modelopt.torch.quantization")
    tmp = tmp_path_factory.mktemp("gpt_oss_nvfp4_export")
    q = dict(quantization="nvfp4", calibration_samples=2, calibration_max_tokens=16)
    one = build(gpt_oss_pair, tmp / "tp1", **q)
    # tp 2 both ways: packed down_proj rows and their block scales by intermediate features (tp), whole experts (ep)
    twos = [build(gpt_oss_pair, tmp / moe, tp=2, moe_parallel=moe, **q) for moe in ("tp", "ep")]
    return one, twos, export(one, tmp / "a"), [export(two, tmp / f"b_{two.name}") for two in twos]


@pytest.mark.slow
def test_gpt_oss_nvfp4_exports_the_engines_tensors_with_modelopts_configs(gpt_oss_nvfp4, gpt_oss_pair, tmp_path):
    one, twos, a, bs = gpt_oss_nvfp4
    # every tensor as the engine holds it: ModelOpt's fused experts (uint8 [E, H/2, 2I], e4m3 scales [E, H/16, 2I],
    # scalar global scales), q/k/v/o in the unified format, the rest unquantized
    engine = tensors(one / "rank0.safetensors")
    exported = tensors(a / "target" / "model.safetensors")
    assert exported.keys() == {k[len("target."):] for k in engine if k.startswith("target.")}
    assert all(same(v, engine["target." + k]) for k, v in exported.items())
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.uint8
    for two, b in zip(twos, bs):
        for f in ("target/model.safetensors", "target/config.json", "target/hf_quant_config.json"):
            assert (a / f).read_bytes() == (b / f).read_bytes(), (two.name, f)
        resharded_equal_rank_files(b, two)
    # the configs and the tensor names / quantized dtypes and shapes of ModelOpt's own export of the same model
    theirs = modelopt_export(gpt_oss_pair / "target", tmp_path / "modelopt")
    assert (a / "target" / "hf_quant_config.json").read_text() == (theirs / "hf_quant_config.json").read_text()
    assert "model.layers.3.mlp.router" in json.loads((theirs / "hf_quant_config.json").read_text())[
        "quantization"]["exclude_modules"]
    ours_cfg = json.loads((a / "target" / "config.json").read_text())
    their_cfg = json.loads((theirs / "config.json").read_text())
    assert ours_cfg["quantization_config"] == their_cfg["quantization_config"]
    assert list(ours_cfg)[-1] == "quantization_config"
    their = tensors(theirs / "model.safetensors")
    assert exported.keys() == their.keys()
    for k, t in their.items():
        if t.dtype != torch.bfloat16:
            assert (exported[k].dtype, exported[k].shape) == (t.dtype, t.shape), k


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: one sentence, exit 2, nothing written
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_engine(pair, tmp_path_factory) -> Path:
    return build(pair, tmp_path_factory.mktemp("bad_inputs") / "engine")


def relabel(engine: Path, dest: Path, model_type: str) -> Path:
    """A copy of `engine` whose target claims another family, with a manifest that matches (not tampered)."""
    shutil.copytree(engine, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["target"]["model_type"] = model_type
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_manifest(dest)
    return dest


def tampered(engine: Path, dest: Path) -> Path:
    shutil.copytree(engine, dest)
    with (dest / "rank0.safetensors").open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    return dest


def occupied(d: Path) -> Path:
    d.mkdir()
    (d / "notes.txt").write_text("mine\n")
    return d


CASES = {
    "tampered engine": (lambda e, t: (tampered(e, t / "e"), t / "out", ()), "does not match manifest.json"),
    "non-empty output": (lambda e, t: (e, occupied(t / "out"), ()), "is not empty and was not written by"),
    "--force on a foreign directory": (lambda e, t: (e, occupied(t / "out"), ("--force",)),
                                       "--force only replaces a directory that trtllm-dflash wrote"),
    "output inside the engine": (lambda e, t: (e, e / "trtllm", ()), "lies inside the input directory"),
    "output is the engine": (lambda e, t: (e, e, ()), "is the input directory"),
    "unsupported family": (lambda e, t: (relabel(e, t / "e", "mistral"), t / "out", ()),
                           "target model_type 'mistral' is not supported by TensorRT-LLM's DFlash export"),
    "Gemma 4 target": (lambda e, t: (relabel(e, t / "e", "gemma4_text"), t / "out", ()),
                       "target model_type 'gemma4_text' is not supported by TensorRT-LLM's DFlash export"),
    "an engine of another kind at the output": (lambda e, t: (e, Path(shutil.copytree(e, t / "other")), ()),
                                                "holds a trtllm-dflash engine, not a trtllm export"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_inputs_are_one_sentence_and_write_nothing(case, small_engine, tmp_path, capsys):
    make, message = CASES[case]
    engine, out, extra = make(small_engine, tmp_path)
    before = {d: files(d) for d in (engine, out) if d.exists()}
    listing = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export", "trtllm", str(engine), "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
    assert {d: files(d) for d in (engine, out) if d.exists()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no temporary directory left behind


def test_help_does_not_import_torch():
    code = ("import sys\nfrom trtllm_dflash.cli import main\n"
            "for argv in (['export', '--help'], ['export', 'trtllm', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as exc:\n        assert exc.code == 0, argv\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stderr
