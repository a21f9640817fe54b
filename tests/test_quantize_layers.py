"""The build's quantization a decoder layer at a time (engine/quantize_layers.py ModelOptLayers) against ModelOpt's
PTQ and export of the whole transformers model on the same prompts (engine/quantize_target.py quantize_target): every
tensor byte for byte, in each family the builder sends this way; Kimi K2.6's published INT4 experts quantized from
the values they stand for; the layer order the builder keeps, held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_deepseek_v3 import kimi_int4_directory
from trtllm_dflash.checkpoint.formats import load_target
from trtllm_dflash.engine.quantize_layers import ModelOptLayers
from trtllm_dflash.engine.quantize_target import LATENT_ATTENTION, quantize_target
from trtllm_dflash.train.random_pair import write_random_pair

pytest.importorskip("modelopt.torch.quantization")


def same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    as_bytes = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    return ours.dtype == theirs.dtype and torch.equal(as_bytes(ours), as_bytes(theirs))


def prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (1, n), generator=generator) for n in (9, 17, 5)]


def exclude(directory: Path) -> tuple[str, ...]:
    return LATENT_ATTENTION if load_target(directory).spec.is_mla else ()


def quantized_layer_tensors(whole: dict[str, torch.Tensor], layers: ModelOptLayers) -> dict[str, torch.Tensor]:
    """The whole export's tensors of the layers' modules that have a scale (quantized linears or experts)."""
    modules = {k.rsplit(".", 1)[0] for k in whole if k.startswith("model.layers.") and "scale" in k.rsplit(".", 1)[1]}
    return {k: v for k, v in whole.items() if k.rsplit(".", 1)[0] in modules}


def layers_equal_whole(directory: Path, fmt: str) -> int:
    """Walk the layers as the builder does (membership, then the tensors of that layer) and compare each tensor with
    the whole model's export; returns how many quantized tensors (with a scale) were compared."""
    whole = quantize_target(directory, fmt, prompts(), exclude(directory))
    layers = ModelOptLayers(load_target(directory), fmt, prompts(), exclude(directory))
    expected = quantized_layer_tensors(whole, layers)
    scales = 0
    for name in sorted((k for k in whole if k.startswith("model.layers.")), key=layers.layer_of):
        assert (name in layers) == (name in expected), name  # (the unquantized ones: the checkpoint's, as stored)
        if name in expected:
            assert same(layers[name], expected[name]), name
            scales += name.endswith("weight_scale")
    assert set(layers) == set(expected) and layers.done == load_target(directory).spec.num_layers - 1
    return scales


@pytest.mark.parametrize("family, fmt", [("qwen3", "nvfp4"), ("llama", "fp8"), ("qwen3_moe", "nvfp4"),
                                         ("qwen3_5", "fp8"), ("qwen3_5_moe", "nvfp4"), ("deepseek_v3", "nvfp4"),
                                         ("deepseek_v3", "fp8"), ("gemma4", "nvfp4")])
def test_a_layer_at_a_time_is_modelopts_export_of_the_whole_model(family, fmt, tmp_path):
    """Each family's tiny random target (4 layers: Qwen3.5's linear and full attention, Qwen3 MoE's and DeepSeek's
    dense and routed layers, DeepSeek's latent attention left unquantized, Gemma 4's sliding and full layers): every
    tensor ModelOpt exports for the layers, byte for byte."""
    write_random_pair(tmp_path, family, block_size=8, seed=0)
    scales = layers_equal_whole(tmp_path / "target", fmt)
    spec = load_target(tmp_path / "target").spec
    assert scales >= spec.num_layers, scales  # (at least a quantized linear a layer)
    if family == "deepseek_v3":  # the MLPs only: a dense one's 3 linears, a routed layer's experts' and shared expert's
        sparse = sum(map(spec.is_sparse, range(spec.num_layers)))
        assert sparse and scales == (spec.num_layers - sparse) * 3 + sparse * (spec.routed_experts + 1) * 3, scales


def test_kimi_int4_experts_are_quantized_from_their_values(tmp_path):
    """A Kimi K2.6 layout with INT4 routed experts (compressed-tensors pack-quantized) quantizes to what ModelOpt
    exports for a plain bfloat16 checkpoint holding the values the INT4 codes stand for: the checkpoint reader
    dequantizes the experts as it reads them, a layer at a time."""
    write_random_pair(tmp_path / "pair", "deepseek_v3", block_size=8, seed=0)
    kimi, dequantized = kimi_int4_directory(tmp_path / "pair", tmp_path / "kimi")
    plain = tmp_path / "plain"
    plain.mkdir()
    weights = load_file(str(tmp_path / "pair" / "target" / "model.safetensors"))
    weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    save_file(weights | dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})  # (as kimi's are)
    for f in (tmp_path / "pair" / "target").iterdir():
        if f.name != "model.safetensors":
            (plain / f.name).symlink_to(f)
    whole = quantize_target(plain, "nvfp4", prompts(), LATENT_ATTENTION)
    layers = ModelOptLayers(load_target(kimi), "nvfp4", prompts(), LATENT_ATTENTION)
    expected = quantized_layer_tensors(whole, layers)
    assert any(".mlp.experts.7.down_proj.weight_scale" in k for k in expected)
    for name in sorted(expected, key=layers.layer_of):
        assert name in layers and same(layers[name], expected[name]), name
    assert set(layers) == set(expected)


def test_layers_are_read_in_order(tmp_path):
    write_random_pair(tmp_path, "qwen3", block_size=8, seed=0)
    layers = ModelOptLayers(load_target(tmp_path / "target"), "nvfp4", prompts())
    started: list[int] = []
    layers.on_layer = started.append  # (the builder's progress bar names the layer)
    assert "model.embed_tokens.weight" not in layers and layers.done == -1  # (not a layer's: nothing computed)
    with pytest.raises(AssertionError, match="in order"):
        layers["model.layers.1.self_attn.q_proj.weight"]
    assert "model.layers.0.self_attn.q_proj.weight_scale" in layers and layers.done == 0 and started == [0]
    assert "model.layers.0.input_layernorm.weight" not in layers  # (not quantized: the checkpoint's, as stored)
