"""gpt-oss targets built with `quantization: nvfp4 | fp8`: the attention linears and the fused experts in ModelOpt's
exported layout, equal tensor for tensor to ModelOpt's PTQ + export of the whole model, dequantized exactly by the
torch executor, lossless DFlash, tensor / expert parallelism under mpiexec, bad inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import MPIEXEC, ROOT
from tests.conftest import write_family_config as write_config
from tests.test_gpt_oss import cli_build, requests
from tests.test_quantize import modelopt_dequantize
from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine.quantize_target import calibration_batches, quantize_target
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.models.quantized import ActivationQuant
from trtllm_dflash.quantize.experts import EXPERT_WEIGHTS, dequantize_experts, read_quantized_experts
from trtllm_dflash.runtime.decoding import Decoder
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.random_pair import write_random_pair

pytestmark = pytest.mark.slow

pytest.importorskip("modelopt.torch.quantization")

CALIBRATION = {"calibration_samples": 4, "calibration_max_tokens": 24}
EXPERTS = "target.model.layers.{}.mlp.experts.{}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def pair(gpt_oss_pair) -> Path:
    """tests/conftest.py's tiny gpt-oss: 4 layers (sliding and full), 4 experts (top 2), hidden 64, I 128."""
    return gpt_oss_pair


@pytest.fixture(scope="module", params=["nvfp4", "fp8"])
def quantized(request, pair, tmp_path_factory) -> tuple[str, Path]:
    fmt, tmp = request.param, tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    # the FP8 engine also gets ONNX graphs (onnxruntime runs FP8 Q/DQ; NVFP4 graphs: test_tensor_parallel_graphs.py)
    backend = {"backend": "onnxruntime"} if fmt == "fp8" else {}
    return fmt, cli_build(tmp, pair, "tp1", quantization=fmt, **CALIBRATION, **backend)


def test_engine_holds_what_modelopt_exports_for_the_whole_model(quantized, pair):
    """The layer-by-layer calibration and packing == ModelOpt's mtq.quantize + export_hf_checkpoint of the whole
    transformers model on the same prompts: every quantized tensor byte for byte, experts included."""
    fmt, engine = quantized
    batches = calibration_batches(load_tokenizer(pair / "target"), None, CALIBRATION["calibration_samples"],
                                  CALIBRATION["calibration_max_tokens"])  # (the build's default prompts)
    reference = quantize_target(pair / "target", fmt, batches)
    stored = load_file(str(engine / rank_file(0)))
    quantized_names = [k for k, v in reference.items() if v.dtype in (torch.uint8, torch.float8_e4m3fn)
                       or "scale" in k]
    assert len(quantized_names) == 4 * (4 + 2) * (4 if fmt == "nvfp4" else 3)  # layers x (q/k/v/o, 2 experts) x tensors
    for name in quantized_names:
        ours, theirs = stored["target." + name], reference[name]
        assert ours.dtype == theirs.dtype and torch.equal(as_bytes(ours), as_bytes(theirs)), name
    cfg = json.loads((engine / "config.json").read_text())["quantization"]
    assert cfg["quant_algo"] == fmt.upper() and len(cfg["quantized_modules"]) == 4 * 6
    assert "target.model.layers.3.mlp.experts.down_proj" in cfg["quantized_modules"]
    for name in ("model.layers.0.mlp.router.weight", "model.layers.0.self_attn.sinks",
                 "model.layers.0.mlp.experts.down_proj_bias", "lm_head.weight"):
        assert stored["target." + name].dtype == torch.float32, name


def test_experts_are_dequantized_exactly_and_their_inputs_quantized(quantized):
    fmt, engine_dir = quantized
    stored = load_file(str(engine_dir / rank_file(0)))
    experts = Engine.load(engine_dir, backend="torch").executor.target.model.layers[1].mlp.experts
    for p in EXPERT_WEIGHTS:
        q = read_quantized_experts(stored, EXPERTS.format(1, p))
        assert q.fmt == fmt and q.input_scale is not None
        w = dequantize_experts(q, torch.float32)
        assert torch.equal(getattr(experts, p), w)
        for e in range(w.shape[0]):  # expert e is the linear w[e].T, as ModelOpt's own dequantization reads it
            want = (modelopt_dequantize(q.expert(e), torch.float32) if fmt == "nvfp4"
                    else q.weight[e].float() * q.weight_scale)
            assert torch.equal(w[e].T if fmt == "nvfp4" else w[e], want)
        quant = getattr(experts, f"{p}_input")
        assert isinstance(quant, ActivationQuant) and quant.fmt == fmt and torch.equal(quant.input_scale, q.input_scale)


def test_stored_experts_of_an_export_dequantize_to_the_executors_experts(quantized, tmp_path):
    """What an ONNX graph of quantized experts holds (the stored FP8 / NVFP4 experts; NVFP4 re-laid as [E, N, K/2]
    for ONNX's FLOAT4E2M1 packing) dequantizes, through the graph's own dequantize op, to exactly the experts the
    torch executor runs; without them the export is refused before anything is written."""
    from trtllm_dflash.compile.onnx_export import export_engine_graphs, keep_stored_weights

    fmt, engine_dir = quantized
    target = Engine.load(engine_dir, backend="torch").executor.target
    stored = load_file(str(engine_dir / rank_file(0)))
    state = {k.removeprefix("target."): v for k, v in stored.items()}
    keep_stored_weights(target, {k: v for k, v in state.items() if ".mlp.experts." not in k})  # the linears only
    with pytest.raises(ValueError, match=r"target\.model\.layers\.0\.mlp\.experts\.gate_up_proj: quantized experts "
                                         r"are exported only with their stored weights"):
        export_engine_graphs(target, None, tmp_path)
    assert not list(tmp_path.iterdir())
    assert keep_stored_weights(target, state) == 4 * 6  # q/k/v/o and the two expert projections per layer
    for layer in target.model.layers:
        experts = layer.mlp.experts
        assert experts.stored_formats == {p: fmt for p in EXPERT_WEIGHTS}
        for p in EXPERT_WEIGHTS:
            assert torch.equal(experts.weight(p).to(getattr(experts, p).dtype), getattr(experts, p)), p


def test_fp8_experts_in_onnxruntime_give_the_torch_executors_tokens(quantized):
    """The FP8 engine's graphs (FP8 expert initializers, Q/DQ of the experts' inputs) in the onnxruntime executor:
    the torch executor's tokens and acceptance, dflash and ar, greedy and sampled."""
    fmt, engine_dir = quantized
    if fmt != "fp8":
        pytest.skip("onnxruntime has no kernel for TensorRT's FP4 quantize node (NVFP4 graphs: TensorRT-RTX builds "
                    "them in tests/test_tensor_parallel_graphs.py)")
    ort, reference = Engine.load(engine_dir), Engine.load(engine_dir, backend="torch")
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    reqs = requests(reference.executor.vocab_size)
    for mode in ("dflash", "ar"):
        expected = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                    for r in reference.decoder(mode).generate(reqs)}
        assert {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                for r in ort.decoder(mode).generate(reqs)} == expected, mode


def test_quantized_engine_is_lossless_against_itself(quantized):
    fmt, engine_dir = quantized
    engine = Engine.load(engine_dir, backend="torch")
    reqs = requests(engine.executor.vocab_size)
    dflash = {r.request.id: r.output_token_ids for r in Decoder.for_mode(engine.executor, "dflash", ()).generate(reqs)}
    ar = {r.request.id: r.output_token_ids for r in Decoder.for_mode(engine.executor, "ar", ()).generate(reqs)}
    assert dflash == ar and len({t for out in ar.values() for t in out}) > 10


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
@pytest.mark.parametrize("moe_parallel", ["tp", "ep"])
def test_nvfp4_tp2_rank_files_are_slices_and_mpiexec_equals_one_process(pair, tmp_path, moe_parallel):
    one = cli_build(tmp_path, pair, "tp1", quantization="nvfp4", **CALIBRATION)
    two = cli_build(tmp_path, pair, "tp2", quantization="nvfp4", tp_size=2, moe_parallel=moe_parallel, **CALIBRATION)
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    # NVFP4 experts: gate_up_proj [E, H/2, 2I] and its scale [E, H/16, 2I] cut along 2I; down_proj [E, I/2, H] and
    # its scale [E, I/16, H] along the packed I (ep: both along E); the global scales replicated.
    cut = {"gate_up_proj": 2, "down_proj": 1} if moe_parallel == "tp" else {"gate_up_proj": 0, "down_proj": 0}
    for layer in range(4):
        for p in EXPERT_WEIGHTS:
            name = EXPERTS.format(layer, p)
            for key in (name, name + "_weight_scale"):
                parts = [r[key] for r in ranks]
                assert parts[0].shape[cut[p]] * 2 == full[key].shape[cut[p]]
                assert torch.equal(as_bytes(torch.cat(parts, cut[p])), as_bytes(full[key])), key
            for key in (name + "_weight_scale_2", name + "_input_scale"):
                assert all(torch.equal(r[key], full[key]) for r in ranks), key

    lines = [{"id": i, "prompt_token_ids": list(range(5 + i, 12 + 5 * i)), "max_new_tokens": 6 + 2 * i}
             for i in range(4)]
    prompts, ref, out = tmp_path / "in.jsonl", tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["run", str(one), "--input", str(prompts), "--output", str(ref)]) == 0
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "trtllm_dflash.cli", "run", str(two), "--input", str(prompts),
           "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr

    def tokens(path: Path) -> dict:
        return {r["id"]: r["output_token_ids"] for r in map(json.loads, path.read_text().splitlines())}

    assert tokens(out) == tokens(ref) and len(tokens(ref)) == 4


def test_intermediate_split_that_cuts_an_nvfp4_block_is_one_sentence(tmp_path, capsys):
    """intermediate_size 96 at tp 4: 24 rows of down_proj per rank, not a multiple of NVFP4's 16-value block."""
    write_random_pair(tmp_path / "pair", "gpt_oss", intermediate_size=96, num_layers=2, block_size=4)
    capsys.readouterr()  # (transformers' save progress bar)
    config = write_config(tmp_path / "b.yaml", tmp_path / "pair", quantization="nvfp4", tp_size=4)
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert str(config) in err and len(err.splitlines()) == 1, err
    assert ("intermediate_size / tp_size is 24, not a multiple of the quantization block 16, so the row-parallel "
            "split at tp_size 4 would cut a block; moe_parallel: ep keeps every expert whole.") in err
    assert not (tmp_path / "e").exists()
    # whole experts per rank (moe_parallel: ep) cut no block
    config = write_config(tmp_path / "ep.yaml", tmp_path / "pair", quantization="nvfp4", tp_size=2,
                          moe_parallel="ep", calibration_samples=2, calibration_max_tokens=8)
    assert main(["build", str(config), "--output", str(tmp_path / "ep")]) == 0
