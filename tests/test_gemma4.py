"""Gemma 4 text targets: our decoder == transformers' Gemma4ForCausalLM (and the text part of a multimodal
Gemma4ForConditionalGeneration directory), greedy DFlash == AR == HF generate(), tensor parallelism under mpiexec ==
one process, NVFP4 / FP8 through ModelOpt, the published 31B config, bad inputs.

The tiny target (train/random_pair.py) alternates sliding (window 4) and full layers; full layers have twice the
head_dim, one KV head and V = K (attention_k_eq_v) and the proportional RoPE; logits are soft-capped at 2.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration

from tests.conftest import (
    assert_dflash_equals_ar_equals_generate,
    assert_dflash_equals_ar_greedy_and_sampled,
    assert_mpiexec_run_equals_one_process,
    build,
    write_family_config,
)
from tests.conftest import family_requests as requests
from trtllm_dflash.checkpoint.formats import load_pair, load_target, target_tensor_shapes
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.shard import check_tp
from trtllm_dflash.models.spec import DecoderSpec, hf_config_from_dict
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
PROMPT_LENGTHS = (7, 19, 12)  # longer than the sliding window of 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gemma4_pair")
    write_random_pair(root, "gemma4", block_size=8, seed=0)
    return root


@pytest.fixture(scope="module")
def multimodal_pair(pair, tmp_path_factory) -> Path:
    """The same text model saved as transformers saves a multimodal Gemma 4 directory (Gemma4ForConditionalGeneration,
    text weights under `model.language_model.`, here with a small vision tower whose weights are not read)."""
    root = tmp_path_factory.mktemp("gemma4_multimodal")
    text = json.loads((pair / "target" / "config.json").read_text())
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "position_embedding_size": 64}
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=None))
    causal = AutoModelForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32)
    missing, unexpected = hf.model.language_model.load_state_dict(causal.model.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    hf.config.architectures = ["Gemma4ForConditionalGeneration"]
    hf.save_pretrained(str(root / "target"))
    for f in (pair / "target").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, root / "target" / f.name)
    shutil.copytree(pair / "drafter", root / "drafter")
    return root


def ours_and_hf(target: Path) -> tuple[TargetModel, torch.nn.Module]:
    ckpt = load_target(target)
    ours = TargetModel.from_state_dict(ckpt.spec, {n: ckpt.tensors.get(n).float() for n in ckpt.tensors.names()})
    return ours, AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", ["causal_lm", "multimodal"])
def test_batched_prefill_logits_and_hidden_states_equal_hf(pair, multimodal_pair, layout):
    target = (pair if layout == "causal_lm" else multimodal_pair) / "target"
    ours, hf = ours_and_hf(target)
    spec = ours.spec
    assert spec.is_gemma4 and spec.attention_k_eq_v and spec.layer_spec(1).head_dim == 2 * spec.head_dim
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, spec.vocab_size, (n,), generator=g) for n in PROMPT_LENGTHS]
    T, layers, H = max(PROMPT_LENGTHS), tuple(range(spec.num_layers)), spec.hidden_size
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    out = ours(tokens, torch.arange(T).expand(len(prompts), T), torch.tensor([2, 0, 1]), ours.new_cache(3, 64), layers)
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(p[None], output_hidden_states=True)
        n = len(p)
        # (text-only in the multimodal model: its hidden_states are the language model's)
        torch.testing.assert_close(out.logits[row, :n], ref.logits[0], atol=2e-5, rtol=1e-4)
        assert ref.logits.abs().max() > 1.0  # the soft cap at 2 bends these logits
        for k, layer in enumerate(layers):
            torch.testing.assert_close(out.hidden[row, :n, k * H:(k + 1) * H], ref.hidden_states[layer + 1][0],
                                       atol=2e-5, rtol=1e-4)


def test_incremental_decoding_with_cache_equals_full_forward(pair):
    """Blocks of 3 and single tokens at per-request positions: the window slides across cached positions, and
    sliding and full layers keep caches of different shapes."""
    ours, hf = ours_and_hf(pair / "target")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, ours.spec.vocab_size, (n + 7,), generator=g) for n in PROMPT_LENGTHS]
    cache, slots, T = ours.new_cache(3, 64), torch.tensor([1, 2, 0]), max(PROMPT_LENGTHS)
    assert cache.k[0].shape[-2:] == (2, 16) and cache.k[1].shape[-2:] == (1, 32)
    tokens = torch.zeros(3, T, dtype=torch.long)
    for row, n in enumerate(PROMPT_LENGTHS):
        tokens[row, :n] = seqs[row][:n]
    ours(tokens, torch.arange(T).expand(3, T), slots, cache)
    starts, got = torch.tensor(PROMPT_LENGTHS), [[] for _ in seqs]
    for width in (3, 1, 3):
        pos = starts[:, None] + torch.arange(width)
        logits = ours(torch.stack([seqs[r][pos[r]] for r in range(3)]), pos, slots, cache).logits
        for row in range(3):
            got[row].append(logits[row])
        starts = starts + width
    for row, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(s[None]).logits[0]
        n = PROMPT_LENGTHS[row]
        torch.testing.assert_close(torch.cat(got[row]), ref[n:n + 7], atol=2e-5, rtol=1e-4)


def test_greedy_dflash_equals_ar_equals_hf_generate(pair, tmp_path):
    engine = Engine.load(build(pair, tmp_path / "engine", max_batch_size=4))
    assert engine.executor.drafter.spec.input_embedding_scale == 8.0  # sqrt(hidden), from dflash_config
    hf = AutoModelForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()
    reqs = requests(engine.executor.vocab_size)
    assert_dflash_equals_ar_equals_generate(engine, hf, reqs)


def test_drafter_scales_its_block_embeddings(pair):
    """dflash_config.input_embedding_scale multiplies the target's raw embedding rows (the z-lab reference's
    `_raw_input_embeddings`); the target's own sqrt(hidden) is applied inside its forward only."""
    target, drafter = load_pair(pair / "target", pair / "drafter")
    assert drafter.spec.input_embedding_scale == 8.0 and target.spec.embed_scale == 8.0
    assert DecoderSpec.from_hf(hf_config_from_dict(drafter.spec.to_hf_dict(), "round trip")) == drafter.spec


# --- tensor parallelism -----------------------------------------------------------------------------------


def cli_build(tmp: Path, pair: Path, name: str, **fields) -> Path:
    config = write_family_config(tmp / f"{name}.yaml", pair, **fields)
    assert main(["build", str(config), "--output", str(tmp / name)]) == 0
    return tmp / name


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
def test_tp2_under_mpiexec_equals_one_process(multimodal_pair, tmp_path):
    """From the multimodal directory: sliding layers split their 2 KV heads, full layers replicate their one KV head
    (global_head_dim 32 per head); rank files are exact slices, and the tokens equal one process's."""
    one, two = cli_build(tmp_path, multimodal_pair, "tp1"), cli_build(tmp_path, multimodal_pair, "tp2", tp_size=2)
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    assert not any("vision" in name for name in full)
    for layer, kv_rows in ((0, 16), (1, 32)):  # sliding: 1 of 2 KV heads x 16; full: the one KV head x 32, replicated
        q, k = (f"target.model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qk")
        assert torch.equal(torch.cat([r[q] for r in ranks]), full[q])
        assert all(r[k].shape[0] == kv_rows for r in ranks)
    assert torch.equal(ranks[1]["target.model.layers.1.self_attn.k_proj.weight"],
                       full["target.model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(ranks[1]["target.model.layers.1.layer_scalar"], full["target.model.layers.1.layer_scalar"])

    assert_mpiexec_run_equals_one_process(one, two, tmp_path)


# --- bad inputs: one sentence, non-zero exit, nothing written ----------------------------------------------


@pytest.mark.parametrize("change, message", [
    ({"hidden_size_per_layer_input": 8}, "hidden_size_per_layer_input 8 asks for per-layer input embeddings"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers 2 asks for KV sharing across layers"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
     "enable_moe_block True asks for mixture-of-experts blocks"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all' asks for bidirectional attention"),
], ids=["per-layer-inputs", "kv-sharing", "moe", "bidirectional"])
def test_parts_outside_the_dense_text_model_are_refused(pair, tmp_path, capsys, change, message):
    bad = tmp_path / "bad"
    shutil.copytree(pair, bad)
    path = bad / "target" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    config = write_family_config(tmp_path / "b.yaml", bad)
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert f"{path}: {message}" in err and "only the dense Gemma 4 text model" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "e").exists()


def test_build_options_a_gemma4_target_cannot_take(pair, tmp_path, capsys):
    """backend onnxruntime (the onnx extra may be missing: either sentence is fine, one of them is given)."""
    config = write_family_config(tmp_path / "b.yaml", pair, backend="onnxruntime")
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert str(config) in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "e").exists()


# --- quantization --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_nvfp4_and_fp8_through_modelopt_are_stored_as_exported_cut_exactly_and_lossless(multimodal_pair, tmp_path):
    """quantization nvfp4 (and fp8) from the multimodal directory: ModelOpt quantizes every attention and MLP linear of
    the text model (a full layer's k_proj, which is also its V, included; norms, layer_scalar and the embedding not),
    a decoder layer at a time (byte for byte ModelOpt's export of the whole model: tests/test_quantize_layers.py); a tp
    2 build cuts q_proj's packed rows and block scales, gives every rank a full layer's one KV head whole, and decoding
    is lossless against itself (greedy and sampled dflash == ar)."""
    pytest.importorskip("modelopt.torch.quantization")
    calibration = {"calibration_samples": 4, "calibration_max_tokens": 24}
    one = cli_build(tmp_path, multimodal_pair, "nvfp4", quantization="nvfp4", **calibration)
    two = cli_build(tmp_path, multimodal_pair, "nvfp4_tp2", quantization="nvfp4", tp_size=2, **calibration)
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    prefix = "target.model.layers.1."  # (a full layer: V = K)
    assert {k.removeprefix(prefix): v.dtype for k, v in full.items() if k.startswith(prefix + "self_attn.k_proj")} == {
        "self_attn.k_proj.weight": torch.uint8, "self_attn.k_proj.weight_scale": torch.float8_e4m3fn,
        "self_attn.k_proj.weight_scale_2": torch.float32, "self_attn.k_proj.input_scale": torch.float32}
    assert f"{prefix}self_attn.v_proj.weight" not in full
    for name in ("layer_scalar", "input_layernorm.weight", "self_attn.k_norm.weight"):
        assert full[prefix + name].dtype == torch.float32, name
    for leaf in ("weight", "weight_scale"):
        q, k = (f"{prefix}self_attn.{p}_proj.{leaf}" for p in "qk")
        assert torch.equal(torch.cat([r[q].view(torch.uint8) for r in ranks]), full[q].view(torch.uint8))
        assert all(torch.equal(r[k].view(torch.uint8), full[k].view(torch.uint8)) for r in ranks)
    fp8 = cli_build(tmp_path, multimodal_pair, "fp8", quantization="fp8", **calibration)
    assert load_file(str(fp8 / rank_file(0)))[f"{prefix}mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    for engine in (Engine.load(one), Engine.load(fp8)):
        assert_dflash_equals_ar_greedy_and_sampled(engine)


# --- the published 31B config (no download) ---------------------------------------------------------------

# google/gemma-4-31B-it config.json, reconstructed from second-hand reports (model cards of conversions: 60 layers,
# hidden 5376, 32 heads, 16 KV heads x 256 on sliding layers, 4 global KV heads x 512 with attention_k_eq_v on full
# layers, window 1024 in a 5:1 pattern, soft cap 30, tied embeddings, no per-layer inputs / KV sharing / MoE); the
# RoPE values are transformers' Gemma 4 defaults.
GEMMA4_31B_CONFIG = {
    "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "tie_word_embeddings": True,
    "text_config": {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
        "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
        "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 1024, "final_logit_softcapping": 30.0,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10, "hidden_size_per_layer_input": 0,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1000000.0}},
    },
    "vision_config": {"model_type": "gemma4_vision"},
}


def test_published_31b_config_parses_and_splits_eight_ways():
    spec = DecoderSpec.from_hf(hf_config_from_dict(GEMMA4_31B_CONFIG, "gemma-4-31B-it"))
    assert (spec.num_layers, spec.sliding_window, spec.final_logit_softcapping) == (60, 1024, 30.0)
    full = spec.layer_spec(5)
    assert (full.head_dim, full.num_kv_heads, full.attention_k_eq_v) == (512, 4, True)
    assert (spec.layer_spec(0).head_dim, spec.layer_spec(0).num_kv_heads) == (256, 16)
    inv_freq, _ = spec.rope_inv_freq("full_attention")
    assert inv_freq.shape == (256,) and int((inv_freq > 0).sum()) == 64  # a quarter of the 512 dims rotated
    assert spec.rope_inv_freq("sliding_attention")[0].shape == (128,)
    assert DecoderSpec.from_hf(hf_config_from_dict(spec.to_hf_dict(), "round trip")) == spec
    shapes = target_tensor_shapes(spec)
    # embed + final norm, per layer 4 norms, q/k/o (+ v on the 50 sliding layers), q/k norms, 3 MLP, layer_scalar
    assert len(shapes) == 2 + 60 * 13 + 50 and "lm_head.weight" not in shapes
    assert shapes["model.layers.5.self_attn.q_proj.weight"] == (32 * 512, 5376)
    assert "model.layers.5.self_attn.v_proj.weight" not in shapes
    for tp in (2, 4, 8):
        check_tp(spec, tp, "gemma-4-31B", quantized=False)
    with pytest.raises(UserError, match="gemma-4-31B: num_global_key_value_heads 3 is not divisible by tp_size 2"):
        check_tp(replace(spec, num_global_kv_heads=3), 2, "gemma-4-31B", quantized=False)
