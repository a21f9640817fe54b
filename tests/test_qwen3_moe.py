"""Qwen3 MoE targets (Qwen3-30B-A3B's family): our decoder == transformers' Qwen3MoeForCausalLM, greedy DFlash == AR
== HF generate(), sampled DFlash == AR, tensor parallelism under mpiexec == one process, the published config, and the
build options not supported yet refused in one sentence.

The tiny target (train/random_pair.py) has 8 experts of half the dense width (top 2, renormalized), layer 1 dense
(mlp_only_layers) and a router whose weights spread the tokens over the experts.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import (
    assert_dflash_equals_ar_equals_generate,
    assert_dflash_equals_ar_greedy_and_sampled,
    assert_mpiexec_run_equals_one_process,
    build,
    write_family_config,
)
from tests.conftest import family_requests as requests
from trtllm_dflash.checkpoint.formats import load_target, target_tensor_shapes
from trtllm_dflash.cli import main
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.models.moe import SparseMoE
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
PROMPT_LENGTHS = (7, 19, 12)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_moe_pair")
    write_random_pair(root, "qwen3_moe", block_size=8, seed=0)
    return root


def ours_and_hf(target: Path) -> tuple[TargetModel, torch.nn.Module]:
    ckpt = load_target(target)
    ours = TargetModel.from_state_dict(ckpt.spec, {n: ckpt.tensors.get(n).float() for n in ckpt.tensors.names()})
    return ours, AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


def test_the_checkpoint_is_what_transformers_writes(pair):
    """Experts stored one by one (as the published checkpoints), a router per sparse layer, layer 1 dense."""
    ckpt = load_target(pair / "target")
    spec = ckpt.spec
    assert (spec.routed_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.norm_topk_prob,
            spec.dense_layers) == (8, 2, 64, True, (1,))
    assert set(ckpt.tensors.names()) == set(target_tensor_shapes(spec))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in ckpt.tensors.names()
    assert "model.layers.1.mlp.gate_proj.weight" in ckpt.tensors.names()
    ours, _ = ours_and_hf(pair / "target")
    assert isinstance(ours.model.layers[0].mlp, SparseMoE) and not isinstance(ours.model.layers[1].mlp, SparseMoE)


def test_batched_prefill_logits_and_hidden_states_equal_hf(pair):
    ours, hf = ours_and_hf(pair / "target")
    spec = ours.spec
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, spec.vocab_size, (n,), generator=g) for n in PROMPT_LENGTHS]
    T, layers, H = max(PROMPT_LENGTHS), tuple(range(spec.num_layers)), spec.hidden_size
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    out = ours(tokens, torch.arange(T).expand(len(prompts), T), torch.tensor([2, 0, 1]), ours.new_cache(3, 64), layers)
    routed = set()
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(p[None], output_hidden_states=True)
        n = len(p)
        torch.testing.assert_close(out.logits[row, :n], ref.logits[0], atol=2e-5, rtol=1e-4)
        for k, layer in enumerate(layers):
            torch.testing.assert_close(out.hidden[row, :n, k * H:(k + 1) * H], ref.hidden_states[layer + 1][0],
                                       atol=1e-4, rtol=1e-4)
        routed |= set(ours.model.layers[0].mlp.route(ref.hidden_states[0][0])[1].flatten().tolist())
    assert len(routed) >= 6  # the tokens are spread over the experts


def test_exported_form_equals_the_routed_loop(pair):
    """SparseMoE's exported form (every expert over every token, weighted by its routing weight or 0) equals the
    routed loop, and two ranks' partial sums add up to it, each expert cut in two ("tp") or whole ("ep")."""
    from trtllm_dflash.models import moe
    from trtllm_dflash.models.shard import holds, shard_tensor, split_for
    from trtllm_dflash.parallel.group import TPGroup

    ckpt = load_target(pair / "target")
    spec, prefix = ckpt.spec, "model.layers.2.mlp."
    state = {n.removeprefix(prefix): ckpt.tensors.get(n).float() for n in ckpt.tensors.names() if n.startswith(prefix)}
    x = torch.randn(3, 5, spec.hidden_size, generator=torch.Generator().manual_seed(0))

    def block(tp: TPGroup, parallel: str = "tp") -> SparseMoE:
        m = SparseMoE(spec, tp, parallel)
        m.load_state_dict({k: shard_tensor(v, split_for(prefix + k, spec, tp.size, tp.rank, parallel))
                           for k, v in state.items() if holds(prefix + k, spec, tp.size, tp.rank, parallel)})
        return m

    full = block(TPGroup())
    ref = full(x)
    exporting = moe.exporting
    try:
        moe.exporting = lambda: True
        torch.testing.assert_close(full(x), ref, atol=1e-5, rtol=1e-5)
    finally:
        moe.exporting = exporting
    flat = x.flatten(0, 1)
    halves = [block(TPGroup(rank, 2)) for rank in range(2)]
    assert halves[0].experts["3"].gate_proj.weight.shape == (spec.moe_intermediate_size // 2, spec.hidden_size)
    torch.testing.assert_close(sum(h.partial(flat) for h in halves).view_as(x), ref, atol=1e-5, rtol=1e-5)
    owners = [block(TPGroup(rank, 2), "ep") for rank in range(2)]  # experts 0-3 and 4-7, whole
    assert [list(o.experts) for o in owners] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    torch.testing.assert_close(sum(o.partial(flat) for o in owners).view_as(x), ref, atol=1e-5, rtol=1e-5)


def test_the_moe_ops_torch_form_equals_both_families_experts(pair):
    """compile/onnx_ops.py `moe` (com.microsoft.MoE in plain torch, the form the graphs' node computes; onnxruntime's
    kernel is checked against the torch executor end to end below) with each family's arguments as the modules pass
    them: Qwen3 MoE's gate / up rows interleaved, no limit; gpt-oss's own layout, alpha 1.702, beta 1, limit 7."""
    from trtllm_dflash.compile.onnx_ops import moe as moe_op
    from trtllm_dflash.models import moe

    ckpt = load_target(pair / "target")
    spec, prefix = ckpt.spec, "model.layers.0.mlp."
    block = SparseMoE(spec)
    block.load_state_dict({n.removeprefix(prefix): ckpt.tensors.get(n).float() for n in ckpt.tensors.names()
                           if n.startswith(prefix)})
    flat = torch.randn(11, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    fc1 = torch.stack([torch.stack([e.gate_proj.weight, e.up_proj.weight], 1).flatten(0, 1)
                       for e in block.experts.values()])
    fc2 = torch.stack([e.down_proj.weight for e in block.experts.values()])
    got = moe_op(flat, block.gate(flat), fc1, None, fc2, None, 2, True, 1.0, 0.0, float("inf"))
    torch.testing.assert_close(got, block.partial(flat), atol=1e-5, rtol=1e-5)

    gpt = moe.MoEMLP(dataclasses.replace(spec, model_type="gpt_oss", routed_experts=0, num_experts=4,
                                         intermediate_size=32))
    with torch.no_grad():
        for param in gpt.parameters():
            param.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    ex, router = gpt.experts, gpt.router
    got = moe_op(flat, torch.nn.functional.linear(flat, router.weight, router.bias), ex.gate_up_proj.transpose(1, 2),
                 ex.gate_up_proj_bias, ex.down_proj.transpose(1, 2), ex.down_proj_bias, 2, True, moe.ALPHA, 1.0,
                 moe.LIMIT)
    torch.testing.assert_close(got, gpt(flat[None])[0], atol=1e-4, rtol=1e-5)


def test_tensorrts_moe_node_and_its_dense_form_equal_both_families_experts(pair, tmp_path):
    """compile/onnx_ops.py `trt_moe` (TensorRT's TRT_MoE node in plain torch) with each family's arguments as the
    modules pass them (Qwen3 MoE's stacked, transposed linears; gpt-oss's interleaved gate_up taken apart, its biases,
    alpha 1.702, beta 1, limit 7), and each module exported with the node, the node rewritten into plain ops as
    compile does off Blackwell (`dense_experts`), run by onnxruntime: all equal the modules' routed loops."""
    import warnings

    import onnx
    import onnxruntime as ort

    from trtllm_dflash.compile.onnx_ops import TRANSLATIONS, dense_experts
    from trtllm_dflash.models import moe

    ckpt = load_target(pair / "target")
    spec, prefix = ckpt.spec, "model.layers.0.mlp."
    qwen = SparseMoE(spec)
    qwen.load_state_dict({n.removeprefix(prefix): ckpt.tensors.get(n).float() for n in ckpt.tensors.names()
                          if n.startswith(prefix)})
    gpt = moe.MoEMLP(dataclasses.replace(spec, model_type="gpt_oss", routed_experts=0, num_experts=4,
                                         intermediate_size=32))
    with torch.no_grad():
        for param in gpt.parameters():
            param.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    x = torch.randn(3, 5, spec.hidden_size, generator=torch.Generator().manual_seed(2))  # (the node: [B, S, H])
    exporting = moe.exporting
    for name, module in (("qwen3_moe", qwen), ("gpt_oss", gpt)):
        expected = module(x)
        try:
            moe.exporting, module.export_experts_op = (lambda: True), "tensorrt"
            torch.testing.assert_close(module(x), expected, atol=1e-4, rtol=1e-5)  # the op's torch form
        finally:
            moe.exporting = exporting
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                program = torch.export.export(module, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1),
                                                                               1: torch.export.Dim("tokens", min=1)},))
                graph = torch.onnx.export(program, dynamo=True, opset_version=24, custom_translation_table=TRANSLATIONS,
                                          input_names=["x"], output_names=["y"], optimize=True, verbose=False)
        finally:
            module.export_experts_op = None
        graph.save(str(tmp_path / f"{name}.onnx"))
        model = onnx.load(str(tmp_path / f"{name}.onnx"))
        assert [n.op_type for n in model.graph.node if n.domain == "trt"] == ["TRT_MoE"], name
        assert dense_experts(model) == 1 and not [n for n in model.graph.node if n.domain == "trt"]
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.extended  # the MoE node: test_deepseek_v3's and test_qwen3_5's (Qwen3.5 MoE) onnxruntime tests
def test_onnxruntime_runs_the_experts_as_one_op(pair, tmp_path):
    """backend onnxruntime: each sparse layer's experts are one com.microsoft.MoE node (the dense layer stays plain
    ops), and the onnxruntime executor gives the torch executor's tokens, dflash and ar, greedy and sampled."""
    import onnx

    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine
    from trtllm_dflash.engine_dir import graph_dir

    engine_dir = build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32",
                                          max_batch_size=4, max_seq_len=256, backend="onnxruntime",
                                          output=tmp_path / "engine"), progress=False)
    graph = onnx.load(str(graph_dir(engine_dir, 0) / "target_step.onnx"), load_external_data=False)
    assert sum(n.op_type == "MoE" and n.domain == "com.microsoft" for n in graph.graph.node) == 3  # layers 0, 2, 3
    ort, torch_engine = Engine.load(engine_dir), Engine.load(engine_dir, backend="torch")
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    reqs = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.8 if r.id % 2 else 0.0, seed=r.id)
            for r in requests(ort.executor.vocab_size)]
    for mode in ("dflash", "ar"):
        expected = {r.request.id: r.output_token_ids for r in torch_engine.decoder(mode).generate(reqs)}
        assert {r.request.id: r.output_token_ids for r in ort.decoder(mode).generate(reqs)} == expected, mode


def test_greedy_dflash_equals_ar_equals_hf_generate_and_sampled_dflash_equals_ar(pair, tmp_path):
    engine = Engine.load(build(pair, tmp_path / "engine", max_batch_size=4))
    hf = AutoModelForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()
    reqs = requests(engine.executor.vocab_size)
    assert_dflash_equals_ar_equals_generate(engine, hf, reqs)
    sampled = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.9, top_k=50, seed=11 + r.id)
               for r in reqs]
    tokens = {mode: {r.request.id: r.output_token_ids for r in Decoder.for_mode(engine.executor, mode, ()).generate(sampled)}
              for mode in ("dflash", "ar")}
    assert tokens["dflash"] == tokens["ar"]


# --- tensor parallelism, bad build options ---------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
@pytest.mark.parametrize("moe_parallel", ["tp", "ep"])
def test_tp_under_mpiexec_equals_one_process(pair, tmp_path, moe_parallel):
    """2 ranks: every expert cut by intermediate features ("tp": rank files exact slices) or whole on its own rank
    ("ep": rank 0 has experts 0-3, rank 1 4-7), the router replicated; the tokens of one process."""
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", pair)), "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", pair, tp_size=2, moe_parallel=moe_parallel)),
                 "--output", str(two)]) == 0
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    if moe_parallel == "tp":
        for name, dim in (("target.model.layers.0.mlp.experts.5.gate_proj.weight", 0),
                          ("target.model.layers.0.mlp.experts.5.down_proj.weight", 1)):
            assert torch.equal(torch.cat([r[name] for r in ranks], dim=dim), full[name])
    else:
        held = [{n.split(".")[6] for n in r if ".mlp.experts." in n} for r in ranks]
        assert held == [{"0", "1", "2", "3"}, {"4", "5", "6", "7"}]
        name = "target.model.layers.0.mlp.experts.5.down_proj.weight"
        assert torch.equal(ranks[1][name], full[name])
    router = "target.model.layers.0.mlp.gate.weight"
    assert torch.equal(ranks[1][router], full[router])

    assert_mpiexec_run_equals_one_process(one, two, tmp_path)


# --- quantized (ModelOpt): per-expert NVFP4 / FP8 linears -------------------------------------------------

CALIBRATION = {"calibration_samples": 4, "calibration_max_tokens": 24}


@pytest.mark.slow
@pytest.mark.extended  # experts through ModelOpt: test_deepseek_v3's, test_gpt_oss_quantized's, test_quantize_layers'
def test_quantized_experts_are_modelopts_and_lossless(pair, tmp_path):
    """NVFP4: ModelOpt quantizes every expert's linears (each its own scales; the router stays unquantized), the
    engine holds them as ModelOpt exports them, cut exactly for 2 ranks, and decodes losslessly against itself (greedy
    and sampled dflash == ar). FP8 on onnxruntime (the experts then stay in the dense form with their Q/DQ nodes):
    the torch executor's tokens."""
    pytest.importorskip("modelopt.torch.quantization")
    one, two = tmp_path / "nvfp4", tmp_path / "nvfp4_tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", pair, quantization="nvfp4", **CALIBRATION)),
                 "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", pair, quantization="nvfp4", tp_size=2,
                                                  **CALIBRATION)), "--output", str(two)]) == 0
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    expert = "target.model.layers.2.mlp.experts.6"
    h, m = 64, 64
    assert {k.removeprefix(expert): (tuple(v.shape), v.dtype) for k, v in full.items() if k.startswith(expert + ".")} == {
        f".{p}.{leaf}": shape for p in ("gate_proj", "up_proj", "down_proj") for leaf, shape in (
            ("weight", ((m, h // 2) if p != "down_proj" else (h, m // 2), torch.uint8)),
            ("weight_scale", ((m, h // 16) if p != "down_proj" else (h, m // 16), torch.float8_e4m3fn)),
            ("weight_scale_2", ((), torch.float32)), ("input_scale", ((), torch.float32)))}
    assert full["target.model.layers.2.mlp.gate.weight"].dtype == torch.float32  # the router: not quantized
    for leaf, dim in (("gate_proj.weight", 0), ("gate_proj.weight_scale", 0), ("down_proj.weight", 1),
                      ("down_proj.weight_scale", 1)):
        name = f"{expert}.{leaf}"
        assert torch.equal(torch.cat([r[name].view(torch.uint8) for r in ranks], dim=dim), full[name].view(torch.uint8))
    assert torch.equal(ranks[1][f"{expert}.down_proj.input_scale"], full[f"{expert}.down_proj.input_scale"])

    engine = Engine.load(one)
    from tests.test_quantize import modelopt_dequantize
    from trtllm_dflash.quantize.nvfp4 import NVFP4Weight

    stored = NVFP4Weight(*(full[f"{expert}.up_proj.{leaf}"] for leaf in ("weight", "weight_scale", "weight_scale_2")))
    loaded = engine.executor.target.model.layers[2].mlp.experts["6"].up_proj  # a QuantizedInput: input quantized too
    assert loaded.fmt == "nvfp4" and torch.equal(loaded.linear.weight, modelopt_dequantize(stored, torch.float32))
    assert_dflash_equals_ar_greedy_and_sampled(engine)

    fp8 = tmp_path / "fp8"
    assert main(["build", str(write_family_config(tmp_path / "3.yaml", pair, quantization="fp8", backend="onnxruntime",
                                                  **CALIBRATION)), "--output", str(fp8)]) == 0
    ort, torch_engine = Engine.load(fp8), Engine.load(fp8, backend="torch")
    sampled = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.9, seed=5 + r.id)
               for r in requests(engine.executor.vocab_size)]
    for mode in ("dflash", "ar"):
        expected = {r.request.id: r.output_token_ids for r in torch_engine.decoder(mode).generate(sampled)}
        assert {r.request.id: r.output_token_ids for r in ort.decoder(mode).generate(sampled)} == expected, mode


@pytest.mark.slow
@pytest.mark.extended  # experts in TensorRT graphs: test_deepseek_v3's and test_gpt_oss' TensorRT-RTX tests
def test_tensorrt_rtx_parses_the_dense_experts_and_builds_plans(pair, tmp_path):
    """backend tensorrt: the graphs keep the experts' dense form (no com.microsoft.MoE, which TensorRT cannot parse);
    TensorRT-RTX (on the CPU) parses the target step into one native attention per layer, the routers' TopK in the 3
    sparse layers, and builds plans for SM89 and SM120."""
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed (the tensorrt-rtx extra)")
    import onnx

    from trtllm_dflash.compile.tensorrt_build import GRAPHS, build_plan, cache_length, engine_shapes, layer_types, \
        parse_graph
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config

    engine_dir = build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32",
                                          max_batch_size=4, max_seq_len=256, backend="tensorrt",
                                          output=tmp_path / "engine"), progress=False)
    path = graph_dir(engine_dir, 0) / "target_step.onnx"
    assert not any(n.op_type == "MoE" for n in onnx.load(str(path), load_external_data=False).graph.node)
    cfg = read_engine_config(engine_dir)
    types_ = layer_types(parse_graph(rtx, path, static_dims={"max_len": cache_length(cfg)}).network)
    assert (types_["ATTENTION_OUTPUT"], types_["KV_CACHE_UPDATE"], types_["TOPK"]) == (4, 8, 3), types_
    for graph in GRAPHS:
        plan = build_plan(rtx, graph_dir(engine_dir, 0) / f"{graph}.onnx", dtype_note=cfg.dtype,
                          shapes=engine_shapes(cfg), targets=["SM89", "SM120"])
        assert len(plan) > 100_000, graph


# --- the published config (no download) ------------------------------------------------------------------

QWEN3_30B_A3B_CONFIG = {  # Qwen/Qwen3-30B-A3B config.json, as published (keys transformers does not read included)
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_config_parses_and_splits_eight_ways():
    from dataclasses import replace

    from trtllm_dflash.errors import UserError
    from trtllm_dflash.models.shard import check_tp
    from trtllm_dflash.models.spec import DecoderSpec, hf_config_from_dict

    spec = DecoderSpec.from_hf(hf_config_from_dict(QWEN3_30B_A3B_CONFIG, "Qwen3-30B-A3B"))
    assert (spec.routed_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.dense_layers) == (
        128, 8, 768, ())
    assert spec.qk_norm and spec.has_experts and not spec.num_experts
    assert DecoderSpec.from_hf(hf_config_from_dict(spec.to_hf_dict(), "round trip")) == spec
    # per layer: 2 norms, q/k/v/o, q/k norms, the router, 128 x 3 expert weights
    assert len(target_tensor_shapes(spec)) == 3 + 48 * (2 + 4 + 2 + 1 + 128 * 3)
    for tp in (2, 4, 8):
        check_tp(spec, tp, "Qwen3-30B-A3B", quantized=False)
    for tp in (2, 4, 8):
        check_tp(spec, tp, "Qwen3-30B-A3B", quantized=True, moe_parallel="ep")
    with pytest.raises(UserError, match=r"^odd: moe_intermediate_size 100 is not divisible by tp_size 8\.$"):
        check_tp(replace(spec, moe_intermediate_size=100), 8, "odd", quantized=False)
    with pytest.raises(UserError, match=r"^odd: num_experts 100 is not divisible by tp_size 8, so moe_parallel: ep "):
        check_tp(replace(spec, routed_experts=100), 8, "odd", quantized=False, moe_parallel="ep")
    with pytest.raises(UserError, match=r"^odd: moe_intermediate_size / tp_size is 25, not a multiple of the "
                                        r"quantization block 16, so the row-parallel split at tp_size 8 would cut"):
        check_tp(replace(spec, moe_intermediate_size=200), 8, "odd", quantized=True)
    check_tp(replace(spec, moe_intermediate_size=200), 8, "odd", quantized=True, moe_parallel="ep")  # experts whole
