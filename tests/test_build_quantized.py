"""`build` with `quantization: nvfp4 | fp8` (ModelOpt on the CPU) and `run` on the quantized engine."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_cli_build import build_fails, pair, write_config  # noqa: F401  (pair is a fixture)
from tests.test_lossless import requests, run
from trtllm_dflash.cli import main
from trtllm_dflash.quantize.modelopt_cpu import read_quantized_linear
from trtllm_dflash.quantize.nvfp4 import NVFP4Weight, dequantize_nvfp4
from trtllm_dflash.runtime.runner import Engine

pytestmark = pytest.mark.slow

pytest.importorskip("modelopt.torch.quantization")

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module", params=["nvfp4", "fp8"])
def quantized(request, biased_pairs, tmp_path_factory):
    fmt = request.param
    out = tmp_path_factory.mktemp(f"q_{fmt}")
    config = out / "build.yaml"
    pair_dir = biased_pairs[8]
    config.write_text(f"target: {pair_dir / 'target'}\ndrafter: {pair_dir / 'drafter'}\noutput: engine\n"
                      f"dtype: float32\nquantization: {fmt}\ncalibration_samples: 8\nmax_seq_len: 512\nmax_batch_size: 4\n")
    assert main(["build", str(config)]) == 0
    return fmt, out / "engine"


def test_engine_stores_the_unified_format(quantized):
    fmt, engine = quantized
    cfg = json.loads((engine / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == fmt.upper() and cfg["quantization"]["drafter"] == "unquantized"
    t = load_file(str(engine / "rank0.safetensors"))
    n_layers = cfg["target"]["num_hidden_layers"]
    assert len(cfg["quantization"]["quantized_modules"]) == n_layers * len(LINEARS)
    for i in range(n_layers):
        for lin in LINEARS:
            p = f"target.model.layers.{i}.{lin}"
            q = read_quantized_linear(t, p)
            assert q is not None and q.input_scale is not None, p
            if fmt == "nvfp4":
                assert isinstance(q, NVFP4Weight) and q.weight.dtype == torch.uint8
                out_f, in_f = q.shape
                assert q.weight_scale.shape == (out_f, in_f // 16) and q.weight_scale.dtype == torch.float8_e4m3fn
            else:
                assert q.weight.dtype == torch.float8_e4m3fn
    for name in ("target.model.embed_tokens.weight", "target.lm_head.weight", "target.model.norm.weight"):
        assert t[name].dtype == torch.float32 and f"{name[:-7]}.weight_scale" not in t
    assert all(v.dtype == torch.float32 for k, v in t.items() if k.startswith("drafter."))


def test_nvfp4_weights_stay_close_to_the_original(quantized, biased_pairs):
    fmt, engine = quantized
    if fmt != "nvfp4":
        pytest.skip("NVFP4 only")
    t = load_file(str(engine / "rank0.safetensors"))
    original = load_file(str(biased_pairs[8] / "target" / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    w = original[f"{name}.weight"].float()
    deq = dequantize_nvfp4(read_quantized_linear(t, f"target.{name}"), torch.float32)
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0.0 < rel < 0.15, rel  # 4-bit weights: a real but bounded error


def test_quantized_engine_is_lossless_against_itself(quantized):
    fmt, engine_dir = quantized
    engine = Engine.load(engine_dir)
    reqs = requests(engine.executor.vocab_size)
    dflash, ar = run(engine, "dflash", reqs), run(engine, "ar", reqs)
    assert all(dflash[r.id].output_token_ids == ar[r.id].output_token_ids for r in reqs)


def test_quantization_bad_inputs(pair, capsys):  # noqa: F811
    build_fails(pair, capsys, "build.yaml", "quantize_drafter: true needs quantization nvfp4 or fp8",
                config=write_config(pair, quantize_drafter=True))
    build_fails(pair, capsys, "nope.jsonl", "does not exist",
                config=write_config(pair, quantization="fp8", calibration="nope.jsonl"))


DRAFT_LINEARS = LINEARS + ("fc",)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_quantize_drafter(fmt, biased_pairs, tmp_path):
    """quantize_drafter: the drafter's linears (fc included) in the unified format, calibrated by ModelOpt during
    DFlash decoding; NVFP4 q/k/v and gate/up share global scales; the engine stays lossless and drafts still
    get accepted."""
    pair_dir = biased_pairs[8]
    config = tmp_path / "build.yaml"
    config.write_text(f"target: {pair_dir / 'target'}\ndrafter: {pair_dir / 'drafter'}\noutput: engine\n"
                      f"dtype: float32\nquantization: {fmt}\nquantize_drafter: true\ncalibration_samples: 8\n"
                      "max_seq_len: 512\nmax_batch_size: 4\n")
    assert main(["build", str(config)]) == 0
    engine_dir = tmp_path / "engine"
    cfg = json.loads((engine_dir / "config.json").read_text())["quantization"]
    t = load_file(str(engine_dir / "rank0.safetensors"))
    n_draft = 2
    drafter_modules = [m for m in cfg["quantized_modules"] if m.startswith("drafter.")]
    assert cfg["drafter"] == "quantized" and len(drafter_modules) == n_draft * len(LINEARS) + 1
    for i in range(n_draft):
        qs = {lin: read_quantized_linear(t, f"drafter.layers.{i}.{lin}") for lin in LINEARS}
        assert all(q is not None and q.input_scale is not None and q.input_scale > 0 for q in qs.values())
        if fmt == "nvfp4":
            for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
                assert len({float(qs[g].weight_scale_2) for g in group}) == 1, group
                assert len({float(qs[g].input_scale) for g in group}) == 1, group
            assert qs["self_attn.o_proj"].weight.dtype == torch.uint8
        else:
            assert qs["self_attn.o_proj"].weight.dtype == torch.float8_e4m3fn
    assert read_quantized_linear(t, "drafter.fc") is not None
    assert t["drafter.norm.weight"].dtype == torch.float32

    engine = Engine.load(engine_dir)
    reqs = requests(engine.executor.vocab_size)
    dflash, ar = run(engine, "dflash", reqs), run(engine, "ar", reqs)
    assert all(dflash[r.id].output_token_ids == ar[r.id].output_token_ids for r in reqs)
    steps = [n for r in dflash.values() for n in r.acceptance_lengths]
    assert sum(steps) / len(steps) > 1.5
