"""DeepSeek-V3 / Kimi K2 targets (multi-head latent attention + group-routed experts with a shared expert): our decoder
== transformers' DeepseekV3ForCausalLM, the KV cache holding one latent per position, greedy DFlash == AR == HF
generate(), sampled DFlash == AR, a Kimi K2.5 / K2.6 multimodal directory as published, paged caches with preemption,
tensor parallelism (heads; experts tp or ep) under mpiexec == one process, the published shapes, and the build options
not supported yet refused in one sentence.

The tiny target (train/random_pair.py) has latent attention (q rank 48, latent 32 + 8 roped dims, 16 + 16 dims per
head, YaRN with interleaved pairs), layer 0 dense and layers 1-3 with 8 routed experts in 4 groups (2 eligible, top 2)
and a shared expert.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config

from tests.conftest import (
    assert_dflash_equals_ar_equals_generate,
    assert_dflash_equals_ar_greedy_and_sampled,
    assert_mpiexec_run_equals_one_process,
    build,
    write_family_config,
)
from tests.conftest import family_requests as requests
from trtllm_dflash.checkpoint.formats import load_target, target_tensor_shapes
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.mla import LatentAttention
from trtllm_dflash.models.shard import check_tp
from trtllm_dflash.models.spec import DecoderSpec, hf_config_from_dict
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.executor import cache_shape
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
PROMPT_LENGTHS = (7, 19, 12)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deepseek_v3_pair")
    write_random_pair(root, "deepseek_v3", block_size=8, seed=0)
    return root


@pytest.fixture(scope="module")
def hf(pair):
    return AutoModelForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(pair, tmp_path_factory) -> Engine:
    return Engine.load(build(pair, tmp_path_factory.mktemp("deepseek_v3_engine") / "engine", max_batch_size=4))


def ours(target: Path) -> TargetModel:
    ckpt = load_target(target)
    return TargetModel.from_state_dict(ckpt.spec, {n: ckpt.tensors.get(n).float() for n in ckpt.tensors.names()})


def test_the_checkpoint_and_the_latent_cache(pair):
    """What transformers writes (experts one by one, the router's choice bias), read whole; the KV cache holds one
    vector of kv_lora_rank + qk_rope_head_dim per position and layer, no V: 40 values against the 4 heads' K and V
    (4 x (24 + 16)) that attention over expanded heads would cache."""
    ckpt = load_target(pair / "target")
    spec = ckpt.spec
    assert spec.is_mla and (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.head_dim,
                            spec.v_head_dim, spec.rope_interleave) == (48, 32, 16, 8, 16, True)
    assert (spec.routed_experts, spec.n_group, spec.topk_group, spec.num_experts_per_tok, spec.routed_scaling_factor,
            spec.n_shared_experts, spec.dense_layers) == (8, 4, 2, 2, 2.5, 1, (0,))
    assert set(ckpt.tensors.names()) == set(target_tensor_shapes(spec))
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in ckpt.tensors.names()
    model = ours(pair / "target")
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in model.model.layers)
    assert model.kv_layout() == ([1] * 4, [40] * 4, [0] * 4)
    assert cache_shape(model).position_bytes() == 4 * 40 * 4  # fp32, 4 layers
    cache = model.new_cache(2, 32)
    assert cache.k[0].shape == (2, 32, 1, 40) and cache.v[0].numel() == 0


def test_batched_prefill_and_next_blocks_equal_hf(pair, hf):
    """Prompts of different lengths in one padded prefill, then a block of 8 per row: logits and every layer's hidden
    states == transformers (fp32); the routing is spread over the experts, within the 2 eligible groups a token."""
    model = ours(pair / "target")
    spec, H = model.spec, model.spec.hidden_size
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, spec.vocab_size, (n + 8,), generator=g) for n in PROMPT_LENGTHS]
    with torch.no_grad():
        ref = [hf(s[None], output_hidden_states=True) for s in seqs]
    B, T, layers = len(seqs), max(PROMPT_LENGTHS), tuple(range(spec.num_layers))
    tokens = torch.zeros(B, T, dtype=torch.long)
    for row, n in enumerate(PROMPT_LENGTHS):
        tokens[row, :n] = seqs[row][:n]
    slots, cache = torch.tensor([2, 0, 1]), model.new_cache(3, 64)
    out = model(tokens, torch.arange(T).expand(B, T), slots, cache, layers)
    for row, n in enumerate(PROMPT_LENGTHS):
        torch.testing.assert_close(out.logits[row, :n], ref[row].logits[0, :n], atol=2e-5, rtol=1e-4)
        for k, layer in enumerate(layers):
            torch.testing.assert_close(out.hidden[row, :n, k * H:(k + 1) * H], ref[row].hidden_states[layer + 1][0, :n],
                                       atol=1e-4, rtol=1e-4)
    starts = torch.tensor(PROMPT_LENGTHS)
    block = torch.stack([s[n:n + 8] for s, n in zip(seqs, PROMPT_LENGTHS)])
    out = model(block, starts[:, None] + torch.arange(8), slots, cache)
    for row, n in enumerate(PROMPT_LENGTHS):
        torch.testing.assert_close(out.logits[row], ref[row].logits[0, n:n + 8], atol=2e-5, rtol=1e-4)
    moe = model.model.layers[1].mlp
    _, idx = moe.route(torch.randn(64, H, generator=g))  # (RMS-normed inputs, as post_attention_layernorm's)
    assert len(set(idx.flatten().tolist())) >= 6
    assert all(len({e // 2 for e in row}) <= 2 for row in idx.tolist())  # 4 groups of 2 experts, 2 groups eligible


def test_greedy_dflash_equals_ar_equals_hf_generate_and_sampled_dflash_equals_ar(engine, hf):
    reqs = requests(engine.executor.vocab_size)
    assert_dflash_equals_ar_equals_generate(engine, hf, reqs)
    sampled = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.9, top_k=50, seed=11 + r.id)
               for r in reqs]
    tokens = {mode: {r.request.id: r.output_token_ids for r in engine.decoder(mode).generate(sampled)}
              for mode in ("dflash", "ar")}
    assert tokens["dflash"] == tokens["ar"]


def test_paged_latent_cache_with_preemption_gives_the_static_tokens(engine, pair, tmp_path):
    short = build(pair, tmp_path / "engine", max_batch_size=4, max_seq_len=64)
    per_block = 16 * (4 * 40 * 4 + cache_shape(engine.executor.drafter).position_bytes())
    paged = Engine.load(short, kv_cache_memory=str(6 * per_block))  # 5 blocks: one request of 64 + a block
    reqs = [Request(r.id, r.prompt_token_ids, 40) for r in requests(engine.executor.vocab_size)]
    for mode in ("dflash", "ar"):
        want = {r.request.id: r.output_token_ids for r in engine.decoder(mode).generate(reqs)}
        decoder = paged.decoder(mode)
        assert {r.request.id: r.output_token_ids for r in decoder.generate(reqs)} == want, mode
        assert decoder.preemptions > 0, mode


def kimi_directory(pair: Path, out: Path) -> Path:
    """The tiny target laid out as Kimi K2.5 / K2.6 are published (Kimi_K25ForConditionalGeneration): a kimi_k25
    config whose text_config says kimi_k2, the text weights under `language_model.model.` and
    `language_model.lm_head.`, a vision tower's tensors beside them."""
    shutil.copytree(pair / "target", out)
    text = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text | {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]},
        "vision_config": {"model_type": "kimi_k25_vision"}, "tie_word_embeddings": False}))
    weights = load_file(str(out / "model.safetensors"))
    renamed = {("language_model." + k): v for k, v in weights.items()}
    renamed["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_kimi_k2_multimodal_directory_reads_as_its_text_model(pair, engine, tmp_path):
    kimi = kimi_directory(pair, tmp_path / "kimi")
    ckpt = load_target(kimi)
    assert ckpt.spec == load_target(pair / "target").spec
    assert not any(n.startswith("vision") for n in ckpt.tensors.names())
    kimi_pair = tmp_path / "pair"
    kimi_pair.mkdir()
    (kimi_pair / "target").symlink_to(kimi)
    (kimi_pair / "drafter").symlink_to(pair / "drafter")
    other = Engine.load(build(kimi_pair, tmp_path / "engine", max_batch_size=4))
    reqs = requests(engine.executor.vocab_size)
    assert {r.request.id: r.output_token_ids for r in other.decoder("dflash").generate(reqs)} == \
        {r.request.id: r.output_token_ids for r in engine.decoder("dflash").generate(reqs)}


# --- tensor parallelism, bad build options, the published shapes ----------------------------------------------


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
@pytest.mark.parametrize("moe_parallel", ["tp", "ep"])
def test_tp_under_mpiexec_equals_one_process(pair, tmp_path, moe_parallel):
    """2 ranks of 2 heads each (q_b_proj / kv_b_proj rows, o_proj columns; the latent path on both), the experts cut
    ("tp") or whole on their rank ("ep"), the shared expert cut: rank files exact slices, the tokens of one process."""
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", pair)), "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", pair, tp_size=2, moe_parallel=moe_parallel)),
                 "--output", str(two)]) == 0
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    prefix = "target.model.layers.1."
    cut = [("self_attn.q_b_proj.weight", 0), ("self_attn.kv_b_proj.weight", 0), ("self_attn.o_proj.weight", 1),
           ("mlp.shared_experts.gate_proj.weight", 0), ("mlp.shared_experts.down_proj.weight", 1)]
    if moe_parallel == "tp":
        cut += [("mlp.experts.5.up_proj.weight", 0), ("mlp.experts.5.down_proj.weight", 1)]
    else:
        assert [{n.split(".")[6] for n in r if ".layers.1.mlp.experts." in n} for r in ranks] == [
            {"0", "1", "2", "3"}, {"4", "5", "6", "7"}]
    for name, dim in cut:
        assert torch.equal(torch.cat([r[prefix + name] for r in ranks], dim=dim), full[prefix + name]), name
    for name in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                 "mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
        assert torch.equal(ranks[1][prefix + name], full[prefix + name]), name

    assert_mpiexec_run_equals_one_process(one, two, tmp_path)


def test_group_routed_experts_as_one_op_equal_the_routed_loop(pair):
    """The form exported for onnxruntime (compile/onnx_ops.py `moe`, com.microsoft.MoE in plain torch): DeepSeek's
    group routing in plain ops, the node given log(weight) for the chosen experts (-inf elsewhere) and its output
    scaled back by the weights' sum (routed_scaling_factor 2.5 here: without that scale it would be 2.5x off)."""
    import trtllm_dflash.compile.onnx_ops  # noqa: F401 (registers torch.ops.dflash_onnx.moe)
    from trtllm_dflash.models import moe

    ckpt = load_target(pair / "target")
    spec, prefix = ckpt.spec, "model.layers.2.mlp."
    block = moe.SparseMoE(spec)
    block.load_state_dict({n.removeprefix(prefix): ckpt.tensors.get(n).float() for n in ckpt.tensors.names()
                           if n.startswith(prefix)})
    flat = torch.randn(13, spec.hidden_size, generator=torch.Generator().manual_seed(4))
    expected = block.partial(flat)
    assert block.groups and block.scaling != 1.0
    exporting = moe.exporting
    try:
        moe.exporting, block.export_experts_op = (lambda: True), "onnxruntime"
        torch.testing.assert_close(block.partial(flat), expected, atol=1e-5, rtol=1e-5)
    finally:
        moe.exporting, block.export_experts_op = exporting, None


def biased_engine(pair: Path, tmp_path: Path, backend: str) -> Path:
    """An engine of a copy of the pair whose target is biased (tests/conftest.py: drafts accepted and rejected)."""
    from tests.conftest import bias_target
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine

    biased = tmp_path / "pair"
    shutil.copytree(pair, biased)
    bias_target(biased)
    return build_engine(BuildConfig(target=biased / "target", drafter=biased / "drafter", dtype="float32",
                                    max_batch_size=4, max_seq_len=256, backend=backend, output=tmp_path / "engine"),
                        progress=False)


@pytest.mark.slow
def test_onnxruntime_runs_latent_attention_and_the_experts_as_one_op(pair, tmp_path):
    """backend onnxruntime: the graphs cache the latent (one KV head of latent + roped key, and a zero-width V), every
    sparse layer's experts are one com.microsoft.MoE node with the group routing before it, and the onnxruntime
    executor gives the torch executor's tokens and acceptance lengths: dflash (drafts accepted and rejected: a biased
    target), ar and draft trees, greedy and sampled."""
    import onnx

    from trtllm_dflash.engine_dir import graph_dir
    from trtllm_dflash.runtime.decoding import Decoder
    from trtllm_dflash.runtime.verify import TreeDrafting

    engine_dir = biased_engine(pair, tmp_path, "onnxruntime")
    graph = onnx.load(str(graph_dir(engine_dir, 0) / "target_step.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "MoE" and n.domain == "com.microsoft" for n in graph.node) == 3  # layers 1-3
    caches = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert caches["past_key_0"] == ["batch", 1, "max_len", 32 + 8] and caches["past_value_0"][3] == 0
    ort, eager = (Engine.load(engine_dir, backend=b, tree_budget=12) for b in ("onnxruntime", "torch"))
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    reqs = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.8 if r.id % 2 else 0.0, seed=r.id)
            for r in requests(ort.executor.vocab_size)]
    for mode in ("dflash", "ar"):
        got, expected = ({r.request.id: (r.output_token_ids, r.acceptance_lengths)
                          for r in e.decoder(mode).generate(reqs)} for e in (ort, eager))
        assert got == expected, mode
        if mode == "dflash":
            steps = [n for _, lengths in got.values() for n in lengths]
            assert max(steps) > 2 and min(steps) == 1, steps  # drafts accepted and rejected
    trees = [{r.request.id: (r.output_token_ids, r.acceptance_lengths)
              for r in Decoder(e.executor, TreeDrafting(12), e.config.eos_token_ids).generate(reqs)}
             for e in (ort, eager)]
    assert trees[0] == trees[1]


@pytest.mark.slow
def test_tensorrt_executor_binds_the_latent_cache_and_its_plans_build(pair, tmp_path):
    """backend tensorrt: the graphs in TensorRT's form (dense experts) keep the latent cache with a zero-wide V passed
    through (no KV-cache update of zero width: TensorRT-RTX's builder fails on one); the TensorRT executor, its
    execution contexts stood in for by onnxruntime over exactly the memory it binds (tests/tensorrt_standin.py), gives
    the torch executor's tokens and acceptance lengths, dflash (drafts accepted and rejected) and ar, greedy and
    sampled, in one pass per prompt and in passes of 16; what it binds is each plan's graph I/O; and TensorRT-RTX
    builds the target step (one KV-cache update per layer, of the latent) into a plan."""
    import onnx

    from tests.tensorrt_standin import standin_executor
    from trtllm_dflash.compile.tensorrt_build import build_plan, cache_length, engine_shapes, layer_types, parse_graph
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config
    from trtllm_dflash.runtime.decoding import Decoder
    from trtllm_dflash.runtime.tensorrt_executor import bound_dtypes

    engine_dir = biased_engine(pair, tmp_path, "tensorrt")
    eager = Engine.load(engine_dir, backend="torch")
    reqs = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.8 if r.id % 2 else 0.0, seed=r.id)
            for r in requests(eager.executor.vocab_size)]
    for mode in ("dflash", "ar"):
        expected = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                    for r in eager.decoder(mode).generate(reqs)}
        if mode == "dflash":
            steps = [n for _, lengths in expected.values() for n in lengths]
            assert max(steps) > 2 and min(steps) == 1, steps  # drafts accepted and rejected
        for pass_tokens in (None, 16):  # (the 19-token prompt in two passes)
            executor = standin_executor(engine_dir, pass_tokens=pass_tokens)
            got = {r.request.id: (r.output_token_ids, r.acceptance_lengths) for r in
                   Decoder(executor, eager.decoder(mode).policy, eager.config.eos_token_ids).generate(reqs)}
            assert got == expected, (mode, pass_tokens)
    cfg = read_engine_config(engine_dir)
    model = onnx.load(str(graph_dir(engine_dir, 0) / "target_step.onnx"), load_external_data=False).graph
    onnx_types = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.INT64: torch.int64}
    assert bound_dtypes(cfg, "target_step", False) == {v.name: onnx_types[v.type.tensor_type.elem_type]
                                                       for v in (*model.input, *model.output)}
    assert [(n.op_type, list(n.input)) for n in model.node if "present_value_0" in n.output] == \
        [("Identity", ["past_value_0"])]  # (the zero-wide V passed through)
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed")
    path = graph_dir(engine_dir, 0) / "target_step.onnx"
    types = layer_types(parse_graph(rtx, path, static_dims={"max_len": cache_length(cfg)}).network)
    assert types["KV_CACHE_UPDATE"] == 4 and types["ATTENTION_OUTPUT"] == 4, types
    assert len(build_plan(rtx, path, dtype_note=cfg.dtype, shapes=engine_shapes(cfg), targets=["SM89"])) > 100_000


@pytest.mark.slow
@pytest.mark.extended  # rank graphs' collectives in TensorRT: test_tensor_parallel_graphs'; ep ranks: the mpiexec test
def test_tensorrt_rank_graphs_of_a_tp_2_ep_engine_build(pair, tmp_path):
    """backend tensorrt, tp 2 with the experts split by ep: each rank's target step parses into one KV-cache update
    (the latent's) and one attention per layer, its all-reduces and all-gather into DistCollective layers, and
    TensorRT-RTX builds it into a plan (SM89)."""
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed")
    from trtllm_dflash.compile.tensorrt_build import build_plan, cache_length, engine_shapes, layer_types, parse_graph
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config

    engine_dir = build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32",
                                          max_batch_size=4, max_seq_len=256, backend="tensorrt", tp_size=2,
                                          moe_parallel="ep", output=tmp_path / "engine"), progress=False)
    cfg = read_engine_config(engine_dir)
    for rank in range(2):
        path = graph_dir(engine_dir, rank) / "target_step.onnx"
        types = layer_types(parse_graph(rtx, path, static_dims={"max_len": cache_length(cfg)}).network)
        # all-reduces: the embedding's, and per layer o_proj's and the MLP's; the logits' vocabulary all-gather
        assert (types["KV_CACHE_UPDATE"], types["ATTENTION_OUTPUT"], types["DIST_COLLECTIVE"]) == (4, 4, 10), types
        assert len(build_plan(rtx, path, dtype_note=cfg.dtype, shapes=engine_shapes(cfg), targets=["SM89"])) > 100_000


@pytest.mark.parametrize("fields, message", [
    ({"tp_size": 8}, "num_attention_heads 4 is not divisible by tp_size 8."),
])
def test_unsupported_build_options_are_one_sentence(pair, tmp_path, capsys, fields, message):
    out = tmp_path / "engine"
    assert main(["build", str(write_family_config(tmp_path / "b.yaml", pair, **fields)), "--output", str(out)]) == \
        EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt, target, quantize_layer", [  # (FP8 graphs in TensorRT: test_onnxruntime_backend's too)
    pytest.param("fp8", "SM89", "QUANTIZE", marks=pytest.mark.extended), ("nvfp4", "SM120", "DYNAMIC_QUANTIZE")])
def test_quantized_bfloat16_tensorrt_graphs_build(pair, tmp_path, fmt, target, quantize_layer):
    """backend tensorrt with ModelOpt FP8 / NVFP4 at bfloat16: the target step parses into one KV-cache update (of the
    latent) and one attention per layer beside the format's quantize layers, and TensorRT-RTX builds it into a plan for
    a GPU with the format's tensor cores (SM89 for FP8; NVFP4 needs FP4's: SM120)."""
    pytest.importorskip("modelopt.torch.quantization")
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed")
    from trtllm_dflash.compile.tensorrt_build import build_plan, cache_length, engine_shapes, layer_types, parse_graph
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config

    config = write_family_config(tmp_path / "build.yaml", pair, quantization=fmt, dtype="bfloat16", backend="tensorrt",
                                 calibration_samples=4, calibration_max_tokens=24)
    assert main(["build", str(config), "--output", str(tmp_path / "engine")]) == 0
    cfg = read_engine_config(tmp_path / "engine")
    path = graph_dir(tmp_path / "engine", 0) / "target_step.onnx"
    types = layer_types(parse_graph(rtx, path, static_dims={"max_len": cache_length(cfg)}).network)
    assert (types["KV_CACHE_UPDATE"], types["ATTENTION_OUTPUT"]) == (4, 4) and types[quantize_layer] > 0, types
    assert len(build_plan(rtx, path, dtype_note=cfg.dtype, shapes=engine_shapes(cfg), targets=[target])) > 100_000


@pytest.mark.slow
def test_nvfp4_through_modelopt_quantizes_the_experts_and_is_lossless(pair, tmp_path):
    """quantization nvfp4: ModelOpt quantizes the dense MLP, every routed expert and the shared experts (the latent
    attention and the router stay in the compute dtype), the engine holds them as exported, a tp 2 / ep build gives
    each rank its experts whole and cuts the shared experts' packed weights exactly, and decoding is lossless against
    itself (greedy and sampled dflash == ar)."""
    pytest.importorskip("modelopt.torch.quantization")
    calibration = {"calibration_samples": 4, "calibration_max_tokens": 24}
    one, two = tmp_path / "nvfp4", tmp_path / "nvfp4_tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", pair, quantization="nvfp4", **calibration)),
                 "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", pair, quantization="nvfp4", tp_size=2,
                                                  moe_parallel="ep", **calibration)), "--output", str(two)]) == 0
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    layer = "target.model.layers.2."
    for name in ("mlp.experts.6.up_proj.weight", "mlp.shared_experts.down_proj.weight", "mlp.up_proj.weight"):
        name = (layer if "experts" in name else "target.model.layers.0.") + name
        assert full[name].dtype == torch.uint8, name
    for name in ("self_attn.kv_b_proj.weight", "self_attn.q_a_proj.weight", "mlp.gate.weight"):
        assert full[layer + name].dtype == torch.float32, name
    assert torch.equal(ranks[1][layer + "mlp.experts.6.up_proj.weight"], full[layer + "mlp.experts.6.up_proj.weight"])
    for leaf, dim in (("weight", 1), ("weight_scale", 1)):
        name = f"{layer}mlp.shared_experts.down_proj.{leaf}"
        assert torch.equal(torch.cat([r[name].view(torch.uint8) for r in ranks], dim=dim), full[name].view(torch.uint8))
    engine = Engine.load(one)
    assert_dflash_equals_ar_greedy_and_sampled(engine)


FP8_BLOCK = (16, 16)  # (DeepSeek-V3's are 128 x 128; the tiny target's linears are narrower)


def fp8_directory(pair: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny target stored as DeepSeek-V3 is published: every linear weight but the embedding, lm_head and the
    routers as float8_e4m3fn blocks with a float32 `weight_scale_inv` each (amax / 448), quantization_config fp8.
    Returns the directory and, per quantized weight, the values it stands for, computed block by block here."""
    shutil.copytree(pair / "target", out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}}))
    weights, stored, expected = load_file(str(out / "model.safetensors")), {}, {}
    bm, bn = FP8_BLOCK
    for name, w in weights.items():
        if w.ndim != 2 or not name.endswith("proj.weight") and "kv_a_proj_with_mqa" not in name:
            stored[name] = w
            continue
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        scale = torch.empty(-(-w.shape[0] // bm), -(-w.shape[1] // bn))
        want = torch.empty(w.shape)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                block = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
                scale[i, j] = block.abs().amax() / 448.0
                q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (block / scale[i, j]).to(torch.float8_e4m3fn)
                want[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float() \
                    * scale[i, j]
        stored[name], stored[name + "_scale_inv"], expected[name] = q, scale, want.to(torch.bfloat16)
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, expected


def test_deepseek_v3_fp8_blocks_are_read_as_published(pair, tmp_path):
    """quant_method fp8 with weight_block_size: each weight is fp8 x its block's scale_inv (partial edge blocks:
    kv_a_proj_with_mqa's 40 rows are 2.5 blocks), in bfloat16, as the engine stores it; the engine decodes losslessly
    (greedy and sampled dflash == ar)."""
    fp8_dir, expected = fp8_directory(pair, tmp_path / "target")
    ckpt = load_target(fp8_dir)
    assert not any(n.endswith("_scale_inv") for n in ckpt.tensors.names())
    assert set(ckpt.tensors.names()) == set(target_tensor_shapes(ckpt.spec))
    for name in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.mlp.experts.3.down_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"):
        assert ckpt.tensors.shape_dtype(name) == (tuple(expected[name].shape), "BF16")
        assert torch.equal(ckpt.tensors.get(name), expected[name]), name
    assert ckpt.tensors.get("model.layers.1.mlp.gate.weight").dtype == torch.float32  # the router: as stored
    (tmp_path / "drafter").symlink_to(pair / "drafter")
    engine_dir = build(tmp_path, tmp_path / "engine", max_batch_size=4)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(load_file(str(engine_dir / rank_file(0)))["target." + name], expected[name].float())
    engine = Engine.load(engine_dir)
    assert_dflash_equals_ar_greedy_and_sampled(engine)


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "fp8", "fmt": "e4m3"}, "quantization_config.weight_block_size None must be two positive "
                                              "integers (DeepSeek-V3's FP8 blocks: [128, 128])."),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"},
     "quantization_config.format 'float-quantized' is not read; only compressed-tensors' pack-quantized INT4 (Kimi "
     "K2.x as published) is."),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}},
     "quantization_config.config_groups.group_0 is not symmetric 4-bit integer weights by group or channel with "
     "unquantized activations, the only compressed-tensors form read."),
    ({"quant_method": "awq", "bits": 4},
     "quantized deepseek_v3 checkpoints (quantization_config 'awq') are not supported yet; use a bfloat16 checkpoint, "
     "DeepSeek-V3 FP8 blocks (quant_method fp8) or Kimi K2.x INT4 (compressed-tensors)."),
])
def test_other_quantized_checkpoints_are_refused_in_one_sentence(pair, tmp_path, capsys, quantization_config,
                                                                  message):
    """Formats not read, and malformed FP8 / INT4 configs, named."""
    bad = tmp_path / "pair"
    shutil.copytree(pair, bad)
    config = json.loads((bad / "target" / "config.json").read_text())
    (bad / "target" / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    assert main(["build", str(write_family_config(tmp_path / "b.yaml", bad)), "--output", str(tmp_path / "e")]) == \
        EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


INT4_GROUP = 32


def kimi_int4_directory(pair: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny target laid out as Kimi K2.6 is published (kimi_directory) with its routed experts in INT4 as
    compressed-tensors writes them (symmetric, groups of 32 along the input, packed by its own pack_to_int32), the rest
    in bfloat16 and listed in `ignore`. Returns the directory and, per expert weight, the values it stands for."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    kimi = kimi_directory(pair, out)
    config = json.loads((kimi / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
            "dynamic": False, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
    (kimi / "config.json").write_text(json.dumps(config))
    stored, expected = {}, {}
    for name, w in load_file(str(kimi / "model.safetensors")).items():
        if ".mlp.experts." not in name:
            stored[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
            continue
        groups = w.float().unflatten(1, (-1, INT4_GROUP))  # [out, in / 32, 32]
        scale = (groups.abs().amax(dim=-1) / 7.0).to(torch.bfloat16)  # [out, in / 32]
        q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).flatten(1)
        module = name.removesuffix(".weight")
        stored |= {module + ".weight_packed": pack_to_int32(q, 4), module + ".weight_scale": scale,
                   module + ".weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}
        expected[name.removeprefix("language_model.")] = (q.float().unflatten(1, (-1, INT4_GROUP))
                                                          * scale.float()[..., None]).flatten(1).to(torch.bfloat16)
    save_file(stored, str(kimi / "model.safetensors"), metadata={"format": "pt"})
    return kimi, expected


def test_kimi_int4_experts_are_read_as_published(pair, tmp_path):
    """A Kimi K2.6-style directory with compressed-tensors INT4 experts: each expert weight is its codes x its group's
    scale, in bfloat16 (the attention and shared experts as stored), and the engine decodes losslessly."""
    kimi, expected = kimi_int4_directory(pair, tmp_path / "target")
    ckpt = load_target(kimi)
    assert set(ckpt.tensors.names()) == set(target_tensor_shapes(ckpt.spec))
    for name in ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.3.mlp.experts.7.down_proj.weight"):
        assert ckpt.tensors.shape_dtype(name) == (tuple(expected[name].shape), "BF16")
        assert torch.equal(ckpt.tensors.get(name), expected[name]), name
    assert len(expected) == 3 * 8 * 3
    (tmp_path / "drafter").symlink_to(pair / "drafter")
    engine = Engine.load(build(tmp_path, tmp_path / "engine", max_batch_size=4))
    assert_dflash_equals_ar_greedy_and_sampled(engine)


KIMI_K2_TEXT_CONFIG = {  # moonshotai/Kimi-K2-Instruct's config.json (the text model of K2.5 / K2.6), as published
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 131072, "model_type": "kimi_k2", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 163840,
}


def test_published_shapes_parse_and_split_eight_ways():
    """Kimi K2 (as the text model of a kimi_k25 directory) and DeepSeek-V3 (transformers' DeepseekV3Config defaults
    are its shape): 61 layers, 3 / 1 dense, 256 / 384 experts; 576 latent values a position and layer."""
    raw = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": KIMI_K2_TEXT_CONFIG}
    kimi = DecoderSpec.from_hf(hf_config_from_dict(raw, "Kimi-K2.6"))
    deepseek = DecoderSpec.from_hf(hf_config_from_dict(DeepseekV3Config().to_dict() | {"num_mtp_layers": 0}, "V3"))
    for spec, experts, dense in ((kimi, 384, 1), (deepseek, 256, 3)):
        assert (spec.routed_experts, len(spec.dense_layers), spec.kv_lora_rank + spec.head_dim) == (experts, dense, 576)
        assert DecoderSpec.from_hf(hf_config_from_dict(spec.to_hf_dict(), "round trip")) == spec
        # 3 + per layer: 2 norms, 7 latent attention tensors; dense layers 3 MLP tensors; sparse ones the router, its
        # bias, the experts' 3 each and the shared experts' 3
        assert len(target_tensor_shapes(spec)) == 3 + 61 * 9 + dense * 3 + (61 - dense) * (2 + experts * 3 + 3)
        for moe_parallel in ("tp", "ep"):
            check_tp(spec, 8, spec.model_type, quantized=False, moe_parallel=moe_parallel)
    assert kimi.n_group == kimi.topk_group == 1 and kimi.routed_scaling_factor == 2.827
    assert kimi.attention_scale == pytest.approx(192**-0.5 * (0.1 * __import__("math").log(32.0) + 1) ** 2)
    with pytest.raises(UserError, match=r"^K2: num_attention_heads 64 is not divisible by tp_size 128\.$"):
        check_tp(kimi, 128, "K2", quantized=False, moe_parallel="ep")
