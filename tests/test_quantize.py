"""NVFP4 / FP8 quantization: hand-made values, bit-exact agreement with ModelOpt, and a tiny Qwen3
calibrated and exported on CPU through `trtllm_dflash.quantize.modelopt_cpu`.

ModelOpt-dependent tests skip when nvidia-modelopt is not installed.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from trtllm_dflash.quantize.fp8 import FP8Weight, dequantize_fp8, fake_quant_fp8_activation, quantize_fp8_weight
from trtllm_dflash.quantize.modelopt_cpu import read_quantized_linear
from trtllm_dflash.quantize.nvfp4 import (
    NVFP4Weight,
    decode_e2m1,
    dequantize_nvfp4,
    encode_e2m1,
    fake_quant_nvfp4_activation,
    pack_nibbles,
    quantize_nvfp4_weight,
    unpack_nibbles,
)

E2M1_ROW = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
# Projections that read the same input: ModelOpt's NVFP4 export gives them one weight_scale_2.
FUSED_GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def random_weight(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian weight with the awkward cases: an all-zero block, a tiny block (its FP8 scale would
    underflow without clamping) and an outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.02
    w[0, :16] = 0
    w[-1, -16:] *= 1e-6
    w[out_features // 2, 3] = 0.5
    return w.to(dtype)


def modelopt_dequantize(q: NVFP4Weight, dtype: torch.dtype) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt = NVFP4QTensor(torch.Size(q.shape), dtype, q.weight)
    return qt.dequantize(dtype=dtype, scale=q.weight_scale, double_scale=q.weight_scale_2, block_sizes={-1: 16})


# ---------------------------------------------------------------------------------------------------
# NVFP4: hand-made values


def test_e2m1_pack_unpack_hand_made():
    codes = encode_e2m1(torch.tensor(E2M1_ROW))
    # -0.0 has no sign bit set (the sign follows x < 0), like ModelOpt's _cast_fp4.
    assert codes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]
    packed = pack_nibbles(codes)
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE]
    assert torch.equal(unpack_nibbles(packed), codes)
    assert decode_e2m1(unpack_nibbles(packed)).tolist() == E2M1_ROW


def test_e2m1_rounding_is_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e9, -0.1, -2.6])
    assert decode_e2m1(encode_e2m1(x)).tolist() == [0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 6, -0.0, -3]


def test_nvfp4_weight_hand_made_block():
    # amax 6 -> weight_scale_2 = 6/2688, weight_scale = 448: the block's effective scale is exactly 1.
    w = torch.tensor([E2M1_ROW, [6, 3, -1.5, 0.2] + [0] * 12])
    q = quantize_nvfp4_weight(w)
    assert q.weight.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE], [0x57, 0x0B, 0, 0, 0, 0, 0, 0]]
    assert q.weight_scale.float().tolist() == [[448.0], [448.0]]
    assert q.weight_scale_2.item() == pytest.approx(6 / 2688)
    expected = w.clone()
    expected[1, 3] = 0  # 0.2 < 0.25
    assert torch.equal(dequantize_nvfp4(q, torch.float32), expected)


def test_nvfp4_dequant_error_is_within_one_block_step():
    """|w - deq(w)| <= s for every element, s = the block's effective scale: the E2M1 grid step is at most 2
    (between 4 and 6). s ~ block_amax / 6 within FP8's 2^-4 relative rounding, except for all-zero blocks
    (s = weight_scale_2) and blocks whose scale is clamped up to FP8's smallest subnormal 2^-9."""
    w = random_weight(64, 128, torch.float32)
    q = quantize_nvfp4_weight(w)
    err = (dequantize_nvfp4(q, torch.float32) - w).abs().reshape(64, -1, 16)
    step = (q.weight_scale.float() * q.weight_scale_2).unsqueeze(-1)
    block_amax = w.abs().reshape(64, -1, 16).amax(-1, keepdim=True)
    assert (err <= step).all()
    normal = (q.weight_scale.float().unsqueeze(-1) >= 2**-6) & (block_amax > 0)
    assert normal.sum() == normal.numel() - 2  # the zero block and the tiny block
    assert (step <= block_amax / 6 * (1 + 2**-4))[normal].all()


def test_global_amax_is_shared_and_must_cover_the_weight():
    w = random_weight(32, 64, torch.bfloat16)
    q = quantize_nvfp4_weight(w, global_amax=torch.tensor(2.0))
    assert q.weight_scale_2.item() == pytest.approx(2.0 / 2688)
    with pytest.raises(AssertionError, match="below this weight's amax"):
        quantize_nvfp4_weight(w, global_amax=torch.tensor(0.01))


def test_fake_quant_activation_hand_made():
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([1.0, 0.3, -0.1])  # docstring example: scale 1/6
    x[1, :16] = 1e-8  # block scale below ModelOpt's 1e-5 floor: the block becomes zeros
    x[1, 16] = 2.0  # above the calibrated amax 1: clipped to 6 * fp8(448) / 2688 = 1
    y = fake_quant_nvfp4_activation(x, torch.tensor(1 / 2688))
    torch.testing.assert_close(y[0, :3], torch.tensor([1.0, 1 / 3, -1 / 12]))
    assert (y[0, 3:] == 0).all() and (y[1, :16] == 0).all()
    assert y[1, 16].item() == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------
# NVFP4: bit-exact against ModelOpt's NVFP4QTensor (runs on CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(16, 16), (64, 48), (3, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("shared_amax", [False, True], ids=["own-amax", "shared-amax"])
def test_nvfp4_matches_modelopt_nvfp4qtensor(shape, dtype, shared_amax):
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = random_weight(*shape, dtype)
    global_amax = torch.tensor(0.75) if shared_amax else None
    ours = quantize_nvfp4_weight(w, global_amax)
    scale_2 = None if global_amax is None else global_amax / (6 * 448)
    qt, weight_scale, weight_scale_2 = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=scale_2)
    assert torch.equal(ours.weight, qt._quantized_data)
    assert torch.equal(ours.weight_scale.view(torch.uint8), weight_scale.view(torch.uint8))
    assert torch.equal(ours.weight_scale_2, weight_scale_2)
    expected = qt.dequantize(dtype=dtype, scale=weight_scale, double_scale=weight_scale_2, block_sizes={-1: 16})
    assert torch.equal(dequantize_nvfp4(ours, dtype), expected)


def test_e2m1_encoding_matches_modelopt_cast_fp4():
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(4096, generator=g) * 3, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0])])
    assert torch.equal(encode_e2m1(x), NVFP4QTensor._cast_fp4(x.clone()))


@pytest.mark.parametrize("amax_factor", [1.0, 0.5], ids=["calibrated", "clipping"])
def test_cpu_shim_matches_modelopt_reference(amax_factor):
    """ModelOpt's own TensorQuantizer (dynamic NVFP4) fails on CPU; inside the shim it equals
    NVFP4QTensor quantize + dequantize with global scale amax / (6 * 448)."""
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from trtllm_dflash.quantize.modelopt_cpu import cpu_nvfp4_fake_quant

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 64, generator=g) * 2).to(torch.bfloat16)
    x[0, 0, :16] = 0
    cfg = QuantizerAttributeConfig(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)})
    quantizer = TensorQuantizer(cfg, amax=(x.abs().amax().float() * amax_factor).item())
    with pytest.raises(AssertionError, match="amax must be a CUDA tensor"):
        quantizer(x)
    with cpu_nvfp4_fake_quant():
        y = quantizer(x)
    scale_2 = quantizer.amax.float() / (6 * 448)
    qt, weight_scale, weight_scale_2 = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=scale_2)
    expected = qt.dequantize(dtype=x.dtype, scale=weight_scale, double_scale=weight_scale_2, block_sizes={-1: 16})
    assert y.dtype == x.dtype and torch.equal(y, expected)
    assert torch.equal(y, fake_quant_nvfp4_activation(x, scale_2))


# ---------------------------------------------------------------------------------------------------
# FP8


def test_fp8_hand_made_and_round_trip():
    q = quantize_fp8_weight(torch.tensor([[448.0, -1.0, 0.3]]))
    assert q.weight_scale.item() == 1.0 and q.weight.dtype == torch.float8_e4m3fn
    assert dequantize_fp8(q, torch.float32).tolist() == [[448.0, -1.0, 0.3125]]

    w = random_weight(32, 64, torch.bfloat16)
    w[0, :16] = 0.01  # undo the zero block: FP8 is per tensor
    q = quantize_fp8_weight(w)
    assert q.weight_scale.item() == pytest.approx(w.abs().amax().item() / 448)
    back = dequantize_fp8(q, torch.float32)
    normal = w.float().abs() >= 2**-6 * q.weight_scale  # E4M3 normal range: relative error <= 2^-4
    assert ((back - w.float()).abs() <= 2**-4 * w.float().abs())[normal].all()
    assert torch.equal(dequantize_fp8(quantize_fp8_weight(back), torch.float32), back)  # idempotent


def test_fp8_activation_matches_modelopt_fp8_eager():
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.tensor_quant import fp8_eager

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 64, generator=g) * 3).to(torch.bfloat16)
    amax = torch.tensor(448.0 / 64)  # 448 / amax is a power of two: both formulas are exact
    assert torch.equal(fake_quant_fp8_activation(x, amax / 448), fp8_eager(x, amax))
    amax = torch.tensor(5.3)
    torch.testing.assert_close(fake_quant_fp8_activation(x, amax / 448), fp8_eager(x, amax), rtol=2**-4, atol=0)


def test_read_quantized_linear_formats():
    w = random_weight(32, 64, torch.bfloat16)
    nv = quantize_nvfp4_weight(w)
    tensors = {"a.weight": nv.weight, "a.weight_scale": nv.weight_scale,
               "a.weight_scale_2": nv.weight_scale_2.reshape(1), "a.input_scale": torch.tensor([0.01]), "b.weight": w}
    fp = quantize_fp8_weight(w)
    tensors |= {"c.weight": fp.weight, "c.weight_scale": fp.weight_scale, "d.weight": w.to(torch.int8),
                "d.weight_scale": torch.ones(32)}
    a = read_quantized_linear(tensors, "a")
    assert isinstance(a, NVFP4Weight) and a.weight_scale_2.ndim == 0 and a.input_scale.item() == pytest.approx(0.01)
    assert torch.equal(dequantize_nvfp4(a), dequantize_nvfp4(nv))
    assert read_quantized_linear(tensors, "b") is None
    c = read_quantized_linear(tensors, "c")
    assert isinstance(c, FP8Weight) and c.input_scale is None
    with pytest.raises(ValueError, match="unsupported"):
        read_quantized_linear(tensors, "d")
    with pytest.raises(KeyError):
        read_quantized_linear(tensors, "e")


# ---------------------------------------------------------------------------------------------------
# A tiny Qwen3 through ModelOpt on CPU


def tiny_qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def calibration_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]


@pytest.fixture(scope="module")
def calibrated_nvfp4():
    """(calibrated model, original bf16 weights by name)."""
    pytest.importorskip("modelopt")
    from trtllm_dflash.quantize.modelopt_cpu import calibrate

    model = tiny_qwen3()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    calibrate(model, "nvfp4", calibration_batches())
    return model, original


@pytest.fixture(scope="module")
def exported_nvfp4(calibrated_nvfp4, tmp_path_factory):
    """(export dir, exported tensors, original bf16 weights)."""
    from trtllm_dflash.quantize.modelopt_cpu import export_unified

    model, original = calibrated_nvfp4
    out = tmp_path_factory.mktemp("nvfp4")
    export_unified(copy.deepcopy(model), out)  # export packs weights in place: keep the fixture usable
    return out, load_file(str(out / "model.safetensors")), original


def test_nvfp4_export_layout(exported_nvfp4):
    out, tensors, _ = exported_nvfp4
    for layer in range(2):
        for name in LINEARS:
            p = f"model.layers.{layer}.{name}"
            out_features, in_features = tensors[f"{p}.weight"].shape[0], tensors[f"{p}.weight"].shape[1] * 2
            assert tensors[f"{p}.weight"].dtype == torch.uint8
            assert tensors[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn
            assert tuple(tensors[f"{p}.weight_scale"].shape) == (out_features, in_features // 16)
            for scalar in ("weight_scale_2", "input_scale"):
                assert tensors[f"{p}.{scalar}"].dtype == torch.float32 and tensors[f"{p}.{scalar}"].ndim == 0
            assert isinstance(read_quantized_linear(tensors, p), NVFP4Weight)
    for p in ("lm_head", "model.embed_tokens"):
        assert tensors[f"{p}.weight"].dtype == torch.bfloat16
        assert not [k for k in tensors if k.startswith(p + ".") and "scale" in k]
    assert read_quantized_linear(tensors, "lm_head") is None
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert set(quant["exclude_modules"]) == {"lm_head", "model.embed_tokens"}
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"


def test_nvfp4_export_dequantizes_like_modelopt_and_close_to_original(exported_nvfp4):
    _, tensors, original = exported_nvfp4
    for layer in range(2):
        for name in LINEARS:
            p = f"model.layers.{layer}.{name}"
            q = read_quantized_linear(tensors, p)
            ours = dequantize_nvfp4(q, torch.bfloat16)
            assert torch.equal(ours, modelopt_dequantize(q, torch.bfloat16)), p
            w = original[f"{p}.weight"].float()
            # 0.095-0.100 measured on these Gaussian weights (NVFP4 RMS error ~ 10% of RMS weight).
            assert (ours.float() - w).norm() / w.norm() < 0.12, p


def test_nvfp4_export_equals_our_quantizer_with_group_amax(exported_nvfp4):
    """ModelOpt gives q/k/v and gate/up one weight_scale_2 (their max amax); with that global_amax our
    quantizer reproduces every exported byte."""
    _, tensors, original = exported_nvfp4
    for layer in range(2):
        for group in FUSED_GROUPS:
            weights = [original[f"model.layers.{layer}.{name}.weight"] for name in group]
            global_amax = torch.stack([w.abs().amax() for w in weights]).amax()
            for name, w in zip(group, weights):
                exported = read_quantized_linear(tensors, f"model.layers.{layer}.{name}")
                ours = quantize_nvfp4_weight(w, global_amax)
                assert torch.equal(ours.weight, exported.weight), name
                assert torch.equal(ours.weight_scale.view(torch.uint8), exported.weight_scale.view(torch.uint8)), name
                assert torch.equal(ours.weight_scale_2, exported.weight_scale_2), name


def test_nvfp4_fake_quant_forward_on_cpu(calibrated_nvfp4):
    """After calibration the model only runs inside the shim; one QuantLinear's output equals our
    emulation (fake-quantized input and weight, each with its calibrated amax)."""
    from trtllm_dflash.quantize.modelopt_cpu import cpu_nvfp4_fake_quant

    model, original = calibrated_nvfp4
    ids = calibration_batches()[0]
    with pytest.raises(AssertionError, match="amax must be a CUDA tensor"):
        model(input_ids=ids)
    o_proj = model.model.layers[1].self_attn.o_proj
    seen = []
    hook = o_proj.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    with torch.no_grad(), cpu_nvfp4_fake_quant():
        logits = model(input_ids=ids).logits
    hook.remove()
    x, y = seen[0]
    x_q = fake_quant_nvfp4_activation(x, o_proj.input_quantizer.amax.float() / (6 * 448))
    w_q = fake_quant_nvfp4_activation(o_proj.weight, o_proj.weight_quantizer.amax.float() / (6 * 448))
    assert torch.equal(y, torch.nn.functional.linear(x_q, w_q))

    reference = tiny_qwen3()
    reference.load_state_dict(original)
    with torch.no_grad():
        ref_logits = reference(input_ids=ids).logits.float()
    assert torch.isfinite(logits).all()
    assert (logits.float() - ref_logits).norm() / ref_logits.norm() < 0.3


def test_fp8_export_equals_our_quantizer(tmp_path):
    pytest.importorskip("modelopt")
    from trtllm_dflash.quantize.modelopt_cpu import calibrate, export_unified

    model = tiny_qwen3()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    calibrate(model, "fp8", calibration_batches())
    export_unified(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for layer in range(2):
        for name in LINEARS:
            p = f"model.layers.{layer}.{name}"
            exported = read_quantized_linear(tensors, p)
            assert isinstance(exported, FP8Weight) and exported.input_scale is not None
            ours = quantize_fp8_weight(original[f"{p}.weight"])  # FP8 export keeps per-module scales
            assert torch.equal(ours.weight.view(torch.uint8), exported.weight.view(torch.uint8)), p
            assert torch.equal(ours.weight_scale, exported.weight_scale), p
    assert read_quantized_linear(tensors, "lm_head") is None
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
