"""gpt-oss targets: our decoder == transformers' GptOssForCausalLM (bf16/fp32 and published MXFP4 checkpoints),
greedy DFlash == AR == HF generate(), tensor / expert parallelism under mpiexec == one process, bad inputs.

The tiny target (train/random_pair.py) alternates sliding (window 4) and full layers, has 4 experts (top 2),
YaRN RoPE, and weights large enough that sinks, biases and the SwiGLU clamp change the logits.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tests.conftest import (
    assert_dflash_equals_ar_equals_generate,
    assert_mpiexec_run_equals_one_process,
    build,
    write_family_config,
)
from tests.conftest import family_requests as requests
from trtllm_dflash.checkpoint.formats import expert_weight_shapes, load_target
from trtllm_dflash.checkpoint.mxfp4 import FP4_VALUES, dequantize_mxfp4
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
PROMPT_LENGTHS = (7, 19, 12)  # longer than the sliding window of 4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF expert weight [E, K, N] -> (blocks [E, N, K/32, 16], scales [E, N, K/32]) uint8: per block of 32 the
    smallest power of two that fits max|w| into e2m1's 6, then the nearest code. On values it produced it is an
    exact inverse: dequantize(quantize(w')) == w'."""
    e, k, n = w.shape
    v = w.transpose(1, 2).reshape(e, n, k // 32, 32).float()
    exp = torch.ceil(torch.log2(v.abs().amax(-1).clamp_min(2.0**-126) / 6.0)).clamp(-127, 127)
    lut = torch.tensor(FP4_VALUES)
    codes = ((v / torch.exp2(exp)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def write_mxfp4_copy(pair: Path, out: Path) -> Path:
    """`out/target`: the pair's target in the published MXFP4 layout (experts as _blocks/_scales, config.json's
    quantization_config); `out/reference`: an HF checkpoint holding exactly the dequantized experts."""
    ref, target = out / "reference", out / "target"
    shutil.copytree(pair / "target", ref)
    state = load_file(str(ref / "model.safetensors"))
    packed = {}
    for name in expert_weight_shapes(load_target(ref).spec):
        blocks, scales = quantize_mxfp4(state[name])
        state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' own dequant
        assert torch.equal(convert_moe_packed_tensors(*quantize_mxfp4(state[name]), dtype=torch.float32), state[name])
        packed |= {name + "_blocks": blocks, name + "_scales": scales}
    save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(ref, target)
    save_file({k: v for k, v in state.items() if k not in expert_weight_shapes(load_target(ref).spec)} | packed,
              str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copytree(pair / "drafter", out / "drafter")
    return out


@pytest.fixture(scope="module")
def pair(gpt_oss_pair) -> Path:
    return gpt_oss_pair  # tests/conftest.py: 4 experts (top 2), sinks, sliding window 4 / full layers


@pytest.fixture(scope="module")
def mxfp4_pair(pair, tmp_path_factory) -> Path:
    return write_mxfp4_copy(pair, tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def ours_and_hf(target: Path, reference: Path) -> tuple[TargetModel, torch.nn.Module]:
    ckpt = load_target(target)
    ours = TargetModel.from_state_dict(ckpt.spec, {n: ckpt.tensors.get(n).float() for n in ckpt.tensors.names()})
    return ours, AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()


def test_mxfp4_dequantization_equals_transformers():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 8, 4), dtype=torch.uint8, generator=g)  # 2^-127 .. 2^127
    for dtype in (torch.bfloat16, torch.float32):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))


@pytest.mark.parametrize("fmt", ["hf", "mxfp4"])
def test_batched_prefill_logits_and_hidden_states_equal_hf(pair, mxfp4_pair, fmt):
    target, reference = (pair / "target",) * 2 if fmt == "hf" else (mxfp4_pair / "target", mxfp4_pair / "reference")
    ours, hf = ours_and_hf(target, reference)
    spec = ours.spec
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
        torch.testing.assert_close(out.logits[row, :n], ref.logits[0], atol=2e-5, rtol=1e-4)
        for k, layer in enumerate(layers):
            torch.testing.assert_close(out.hidden[row, :n, k * H:(k + 1) * H], ref.hidden_states[layer + 1][0],
                                       atol=1e-4, rtol=1e-4)


def test_incremental_decoding_with_cache_equals_full_forward(pair):
    """Blocks of 3 and single tokens at per-request positions: the window slides across cached positions."""
    ours, hf = ours_and_hf(pair / "target", pair / "target")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, ours.spec.vocab_size, (n + 7,), generator=g) for n in PROMPT_LENGTHS]
    cache, slots, T = ours.new_cache(3, 64), torch.tensor([1, 2, 0]), max(PROMPT_LENGTHS)
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


@pytest.mark.parametrize("fmt", ["hf", "mxfp4"])
def test_greedy_dflash_equals_ar_equals_hf_generate(pair, mxfp4_pair, tmp_path, fmt):
    src = pair if fmt == "hf" else mxfp4_pair
    engine = Engine.load(build(src, tmp_path / "engine", max_batch_size=4))
    hf = AutoModelForCausalLM.from_pretrained(str(pair / "target" if fmt == "hf" else mxfp4_pair / "reference"),
                                              dtype=torch.float32).eval()
    reqs = requests(engine.executor.vocab_size)
    assert_dflash_equals_ar_equals_generate(engine, hf, reqs)


# --- tensor / expert parallelism ---------------------------------------------------------------------------


def cli_build(tmp: Path, pair: Path, name: str, **fields) -> Path:
    config = write_family_config(tmp / f"{name}.yaml", pair, **fields)
    assert main(["build", str(config), "--output", str(tmp / name)]) == 0
    return tmp / name


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
# tp 2 with the tp split: under NVFP4 in tests/test_gpt_oss_quantized.py (both splits)
@pytest.mark.parametrize("tp_size,moe_parallel", [(2, "ep"), (4, "tp"), (4, "ep")])
def test_tp_under_mpiexec_equals_one_process(pair, tmp_path, tp_size, moe_parallel):
    one = cli_build(tmp_path, pair, "tp1")
    split = cli_build(tmp_path, pair, f"tp{tp_size}", tp_size=tp_size, moe_parallel=moe_parallel)
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(split / rank_file(r))) for r in range(tp_size)]
    name = "target.model.layers.1.mlp.experts.gate_up_proj"  # [E, H, 2I]
    dim = 0 if moe_parallel == "ep" else 2
    assert ranks[0][name].shape[dim] * tp_size == full[name].shape[dim]
    assert torch.equal(torch.cat([r[name] for r in ranks], dim=dim), full[name])
    bias = "target.model.layers.1.mlp.experts.down_proj_bias"
    assert torch.equal(torch.cat([r[bias] for r in ranks]) if moe_parallel == "ep" else ranks[1][bias], full[bias])

    assert_mpiexec_run_equals_one_process(one, split, tmp_path, ranks=tp_size)


# --- bad inputs: one sentence, non-zero exit, nothing written ----------------------------------------------


def test_wrong_mxfp4_shape_is_one_sentence(mxfp4_pair, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(mxfp4_pair, bad)
    path = bad / "target" / "model.safetensors"
    state = load_file(str(path))
    name = "model.layers.2.mlp.experts.down_proj_scales"
    state[name] = state[name][:, :, :-1].contiguous()
    save_file(state, str(path))
    config = write_family_config(tmp_path / "b.yaml", bad)
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert f"{path}: MXFP4 tensor {name!r} has shape" in err and "expected [4, 64, 4] and U8" in err
    assert err.count(".") >= 1 and len(err.splitlines()) == 1, err
    assert not (tmp_path / "e").exists()


def test_unsupported_model_type_lists_the_supported_ones(pair, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(pair, bad)
    config = json.loads((bad / "target" / "config.json").read_text())
    (bad / "target" / "config.json").write_text(json.dumps(config | {"model_type": "mixtral"}))
    config = write_family_config(tmp_path / "b.yaml", bad)
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert ("model_type 'mixtral' is not supported; supported: qwen3, qwen3_moe, llama, gpt_oss, gemma4_text, "
            "qwen3_5_text, qwen3_5_moe_text, deepseek_v3, gemma4, qwen3_5, qwen3_5_moe, kimi_k25 (their text "
            "part).") in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("fields, message", [
    ({"tp_size": 8, "moe_parallel": "ep"}, "num_local_experts 4 is not divisible by tp_size 8"),
    ({"backend": "onnxruntime", "quantization": "nvfp4"}, "backend onnxruntime builds quantization none or fp8"),
], ids=["ep-not-divisible", "nvfp4-onnx-backend"])
def test_build_options_a_gpt_oss_target_cannot_take(pair, tmp_path, capsys, fields, message):
    config = write_family_config(tmp_path / "b.yaml", pair, **fields)
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert str(config) in err and len(err.splitlines()) == 1, err
    assert message is None or message in err
    assert not (tmp_path / "e").exists()


# --- the published checkpoints' configs (no download) -----------------------------------------------------

GPT_OSS_20B_CONFIG = {  # openai/gpt-oss-20b config.json, as published (extra keys transformers does not read included)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_published_configs_parse_and_split_eight_ways():
    from dataclasses import replace

    from trtllm_dflash.checkpoint.formats import target_tensor_shapes
    from trtllm_dflash.checkpoint.mxfp4 import packed_shapes
    from trtllm_dflash.models.shard import check_tp
    from trtllm_dflash.models.spec import DecoderSpec, hf_config_from_dict

    spec = DecoderSpec.from_hf(hf_config_from_dict(GPT_OSS_20B_CONFIG, "gpt-oss-20b"))
    assert (spec.num_experts, spec.num_experts_per_tok, spec.sliding_window) == (32, 4, 128)
    assert spec.is_sliding(0) and not spec.is_sliding(1) and spec.attention_sinks
    assert spec.rope_parameters["rope_type"] == "yarn" and spec.rope_inv_freq()[0].shape == (32,)
    assert DecoderSpec.from_hf(hf_config_from_dict(spec.to_hf_dict(), "round trip")) == spec
    # per layer: 2 norms, q/k/v/o weights and biases, sinks, router weight and bias, 4 expert tensors
    assert len(target_tensor_shapes(spec)) == 3 + 24 * 17
    assert packed_shapes(expert_weight_shapes(spec)["model.layers.0.mlp.experts.gate_up_proj"]) == (
        (32, 5760, 90, 16), (32, 5760, 90))
    assert packed_shapes(expert_weight_shapes(spec)["model.layers.0.mlp.experts.down_proj"]) == (
        (32, 2880, 90, 16), (32, 2880, 90))
    big = replace(spec, num_layers=36, num_experts=128, layer_types=spec.layer_types + spec.layer_types[:12])
    for model in (spec, big):
        for moe_parallel in ("tp", "ep"):
            check_tp(model, 8, "gpt-oss", quantized=False, moe_parallel=moe_parallel)


def test_sliding_window_drafter_is_refused(pair, tmp_path, capsys):
    """The reference and vLLM disagree on sliding-window draft layers: refused, not guessed
    (docs/algorithm.md §Sliding-window drafters)."""
    bad = tmp_path / "bad"
    shutil.copytree(pair, bad)
    path = bad / "drafter" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}))
    config = write_family_config(tmp_path / "b.yaml", bad)
    assert main(["build", str(config), "--output", str(tmp_path / "e")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert f"{path}: layer_types has sliding_attention layers (sliding_window 4)" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "e").exists()


def test_a_sliding_window_drafter_whose_window_covers_the_engine_builds(pair, tmp_path, capsys):
    """is_causal: false and a window of at least max_seq_len + block_size (256 + 8): the layers attend as full-attention
    ones, so the drafter builds into the very engine its full-attention twin does (same drafts); a window one short, or
    no is_causal, is one sentence."""
    slid = tmp_path / "slid"
    shutil.copytree(pair, slid)
    path = slid / "drafter" / "config.json"
    config = json.loads(path.read_text())
    sliding = {"layer_types": ["sliding_attention"] * config["num_hidden_layers"], "is_causal": False}
    for window, causal, ok in ((264, False, True), (263, False, False), (4096, None, False)):
        fields = sliding | {"sliding_window": window}
        if causal is None:
            fields.pop("is_causal")
        path.write_text(json.dumps(config | fields))
        out = tmp_path / f"e{window}{causal}"
        assert main(["build", str(write_family_config(tmp_path / "b.yaml", slid)), "--output", str(out)]) == \
            (0 if ok else EXIT_USER_ERROR)
        err = capsys.readouterr().err
        if not ok:
            assert (f"{path}: layer_types has sliding_attention layers (sliding_window {window}); such a drafter runs "
                    "only where its window covers every position (max_seq_len 256 + block_size 8 = 264 must be at "
                    f"most {window}) and its config says is_causal: false (it says "
                    f"{'False' if causal is False else 'nothing'}), where it attends as a full-attention one.") in err
            assert not out.exists()
    full = tmp_path / "full"
    assert main(["build", str(write_family_config(tmp_path / "f.yaml", pair)), "--output", str(full)]) == 0
    engines = [Engine.load(e) for e in (full, tmp_path / "e264False")]
    assert engines[1].config.drafter.get("layer_types") in (None, ["full_attention"] * config["num_hidden_layers"])
    reqs = requests(engines[0].executor.vocab_size)
    steps = [[r.acceptance_lengths for r in e.decoder("dflash").generate(reqs)] for e in engines]
    assert steps[0] == steps[1]


# --- the compiled backends: ONNX graphs of gpt-oss (sinks, sliding window, experts) ---------------------------


def test_exported_experts_form_equals_the_routed_loop(pair):
    """MoEMLP's exported form (every local expert over every token, weighted by its routing weight or 0) equals the
    routed loop unsharded, and its per-rank partial sums under tp and ep add up to it (what the graphs' all-reduce
    does)."""
    from trtllm_dflash.models.moe import MoEMLP
    from trtllm_dflash.models.shard import shard_tensor, split_for
    from trtllm_dflash.parallel.group import TPGroup

    ckpt = load_target(pair / "target")
    spec, prefix = ckpt.spec, "model.layers.1.mlp."
    state = {n.removeprefix(prefix): ckpt.tensors.get(n).float() for n in ckpt.tensors.names() if n.startswith(prefix)}
    x = torch.randn(3, 5, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    flat = x.flatten(0, 1)

    def mlp(tp: TPGroup, parallel: str) -> MoEMLP:
        m = MoEMLP(spec, tp, parallel)
        m.load_state_dict({k: shard_tensor(v, split_for(prefix + k, spec, tp.size, tp.rank, parallel))
                           for k, v in state.items()})
        return m

    full = mlp(TPGroup(), "tp")
    ref = full(x)
    assert len(set(full.router(flat)[1].flatten().tolist())) == spec.num_experts  # every expert is routed to
    torch.testing.assert_close(full._every_expert(flat, *full.router(flat)).view_as(x), ref, atol=1e-5, rtol=1e-5)
    for parallel in ("tp", "ep"):
        ranks = [mlp(TPGroup(rank, 2), parallel) for rank in range(2)]
        total = sum(m._every_expert(flat, *m.router(flat)) for m in ranks)
        torch.testing.assert_close(total.view_as(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_onnxruntime_backend_gives_the_torch_executors_tokens(gpt_oss_ort_engine):
    """The onnxruntime executor on gpt-oss graphs (sinks as ONNX Attention's extra key, the sliding window in the
    mask, each layer's experts one com.microsoft.MoE node): the torch executor's tokens and acceptance, dflash and
    ar, greedy and sampled, 7 requests through 4 slots, prompts longer than the window of 4."""
    import onnx

    from trtllm_dflash.engine_dir import graph_dir

    graph = onnx.load(str(graph_dir(gpt_oss_ort_engine, 0) / "target_step.onnx"), load_external_data=False)
    assert [n.domain for n in graph.graph.node if n.op_type == "MoE"] == ["com.microsoft"] * 4  # one per layer
    assert {p.key: p.value for p in graph.metadata_props}["experts_op"] == "com.microsoft.MoE"
    ort = Engine.load(gpt_oss_ort_engine)
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    torch_engine = Engine.load(gpt_oss_ort_engine, backend="torch")
    g = torch.Generator().manual_seed(0)
    reqs = [Request(id=i, prompt_token_ids=torch.randint(4, 500, (int(torch.randint(5, 20, (1,), generator=g)),),
                                                         generator=g).tolist(),
                    max_new_tokens=6 + 4 * i, temperature=0.0 if i % 2 == 0 else 0.8, seed=100 + i) for i in range(7)]
    for mode in ("dflash", "ar"):
        expected = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                    for r in torch_engine.decoder(mode).generate(reqs)}
        assert {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                for r in ort.decoder(mode).generate(reqs)} == expected, mode


def rings_decode_as_the_torch_executor(new_executor, torch_engine: Engine, g: torch.Generator) -> list[Request]:
    """Five requests one after another on executors with rings (`new_executor()`, one per mode) give the torch
    executor's tokens and acceptance lengths, dflash and ar, greedy and sampled: two prompts of one 45-token prefix, then
    three of another whose first tail (30 tokens) is longer than the ring's pass, so its published prompt leaves no ring
    part of the prefix (the next request computes its whole prompt, then publishes the window): the second and the fifth
    skip 32 prompt positions each. Returns the requests."""
    from trtllm_dflash.runtime.decoding import Decoder

    first, second = (torch.randint(4, 500, (45,), generator=g).tolist() for _ in range(2))
    tails = [(first, 3), (first, 4), (second, 30), (second, 3), (second, 5)]
    reqs = [Request(i, prefix + torch.randint(4, 500, (n,), generator=g).tolist(), 12,
                    temperature=0.8 if i % 2 else 0.0, seed=i) for i, (prefix, n) in enumerate(tails)]
    for mode in ("dflash", "ar"):
        expected = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                    for q in reqs for r in torch_engine.decoder(mode).generate([q])}
        ex = new_executor()
        prefilled, forward = [], ex.target_forward

        def counted(token_ids, starts, slots, capture, last_index=None, rows=None):
            if last_index is not None:  # a prefill: the positions it computes
                prefilled.append(int((last_index + 1).sum()))
            return forward(token_ids, starts, slots, capture, last_index=last_index, rows=rows)

        ex.target_forward = counted
        decoder = Decoder(ex, torch_engine.decoder(mode).policy, torch_engine.config.eos_token_ids)
        got = {r.request.id: (r.output_token_ids, r.acceptance_lengths) for q in reqs for r in decoder.generate([q])}
        assert got == expected, mode
        assert prefilled == [48, 49 - 32, 75, 48, 50 - 32], (mode, prefilled)
    return reqs


def long_prompt_in_passes(ring_executor, torch_engine: Engine, prompt: list[int]) -> None:
    """A prompt longer than a pass, prefilled through the rings in passes, gives the logits and hidden states of the
    torch executor's full-length caches."""
    executors = (ring_executor, torch_engine.executor)
    for executor in executors:
        executor.reserve(0, prompt)
    ring_out, full_out = (executor.target_forward(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([0]), True,
                                                  last_index=torch.tensor([len(prompt) - 1])) for executor in executors)
    torch.testing.assert_close(ring_out.logits, full_out.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ring_out.hidden, full_out.hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_onnxruntime_sliding_layers_keep_rings_and_prefix_reuse_copies_their_window(gpt_oss_ort_engine):
    """An onnxruntime engine's sliding-window layers keep rings of the window + a pass's positions (window 4, passes of
    at most 16: 20 positions, where full layers keep max_seq_len + block = 264), and prompts longer than a pass run in
    passes. Prefix reuse copies a prompt's blocks into a later request's row, and the rings' part of the window before
    the prefix's end only if the pool has it: a published prompt whose tail after the prefix is longer than its ring
    left none (the next request with that prefix computes its whole prompt, then publishes the window), so of five
    requests one after another the second and the fifth skip 32 prompt positions each. Tokens and acceptance lengths
    equal the torch executor's, dflash and ar, greedy and sampled."""
    from trtllm_dflash.bench.runner import _kv_cache_report

    ort = Engine.load(gpt_oss_ort_engine, backend="onnxruntime")
    assert [buf.shape[2] for buf in ort.executor._target.keys] == [20, 264, 20, 264]  # layers 0 and 2 slide
    assert _kv_cache_report(ort)["window_ring_positions"] == 20
    torch_engine = Engine.load(gpt_oss_ort_engine, backend="torch")
    g = torch.Generator().manual_seed(3)
    reqs = rings_decode_as_the_torch_executor(lambda: Engine.load(gpt_oss_ort_engine, backend="onnxruntime").executor,
                                              torch_engine, g)

    # The prefill after a hit gives the logits and hidden states of a whole prompt's, after the row's ring was moved on
    # by 12 more positions of the request before (tokens alone hardly see a few wrong keys in this random model)
    def prefill(ex, slot: int, tokens: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
        cached = ex.reserve(slot, tokens, "engine")
        out = ex.target_forward(torch.tensor([tokens[cached:]]), torch.tensor([cached]), torch.tensor([slot]), True,
                                last_index=torch.tensor([len(tokens) - cached - 1]))
        ex.publish(slot)
        return cached, out.logits, out.hidden[:, -1]

    ex = Engine.load(gpt_oss_ort_engine, backend="onnxruntime").executor
    assert prefill(ex, 0, reqs[0].prompt_token_ids)[0] == 0
    more = torch.randint(4, 500, (1, 12), generator=g)
    ex.target_forward(more, torch.tensor([48]), torch.tensor([0]), False)
    ex.release(0)
    cached, logits, hidden = prefill(ex, 1, reqs[1].prompt_token_ids)  # (row 0 again)
    _, whole_logits, whole_hidden = prefill(Engine.load(gpt_oss_ort_engine, backend="onnxruntime").executor, 0,
                                            reqs[1].prompt_token_ids)
    assert cached == 32
    torch.testing.assert_close(logits, whole_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, whole_hidden, atol=1e-5, rtol=1e-5)
    # ... and a prompt of 75 positions in 5 passes through the rings gives the torch executor's (full-length caches)
    long_prompt_in_passes(Engine.load(gpt_oss_ort_engine, backend="onnxruntime").executor, torch_engine,
                          reqs[2].prompt_token_ids)


@pytest.mark.slow
def test_an_engine_shorter_than_a_ring_keeps_its_sliding_layers_whole(gpt_oss_ort_engine):
    """Where max_seq_len + block is shorter than window + pass (the engine's config cut to 8 positions here: 16 < 20),
    the sliding layers keep max_len positions, not a longer ring, and their circular writes never wrap: the torch
    executor's tokens, dflash and ar, greedy and sampled."""
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config
    from trtllm_dflash.runtime.decoding import Decoder
    from trtllm_dflash.runtime.onnxruntime_executor import OnnxRuntimeExecutor

    short = read_engine_config(gpt_oss_ort_engine).model_copy(update={"max_seq_len": 8})
    executor = OnnxRuntimeExecutor(graph_dir(gpt_oss_ort_engine, 0), short, None, 1)
    assert executor.window_ring == 16 and [buf.shape[2] for buf in executor._target.keys] == [16] * 4
    torch_engine = Engine.load(gpt_oss_ort_engine, backend="torch")
    reqs = [Request(i, [5 + i, 9, 30 + i], 5, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(3)]
    for mode in ("dflash", "ar"):
        expected = {r.request.id: r.output_token_ids for r in torch_engine.decoder(mode).generate(reqs)}
        decoder = Decoder(executor, torch_engine.decoder(mode).policy, torch_engine.config.eos_token_ids)
        assert {r.request.id: r.output_token_ids for r in decoder.generate(reqs)} == expected, mode


@pytest.fixture(scope="module")
def gpt_oss_trt_engine(pair, tmp_path_factory) -> Path:
    """The pair built for backend tensorrt: its experts are TensorRT's TRT_MoE nodes (compile builds them as IMoELayer
    on Blackwell and in the dense form elsewhere; TensorRT cannot parse onnxruntime's com.microsoft.MoE)."""
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine

    return build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32", max_batch_size=4,
                                    max_seq_len=256, backend="tensorrt",
                                    output=tmp_path_factory.mktemp("gpt_oss_trt") / "engine"), progress=False)


def test_compile_refuses_graphs_with_onnxruntimes_experts_op(gpt_oss_ort_engine, capsys, tmp_path):
    """An engine built for onnxruntime holds com.microsoft.MoE nodes and rings: compile says so in one sentence (before
    it looks for TensorRT or a GPU)."""
    from trtllm_dflash.engine_dir import graph_dir

    assert main(["compile", str(gpt_oss_ort_engine)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {graph_dir(gpt_oss_ort_engine, 0) / 'target_step.onnx'}: its experts are onnxruntime's "
                   "com.microsoft.MoE node (the engine was built with backend: onnxruntime), which TensorRT cannot "
                   "parse; rebuild the engine with backend: tensorrt."), err

    # ... and, without experts (its metadata's experts_op dropped here), that its sliding layers keep rings
    import onnx

    from trtllm_dflash.engine_dir import write_manifest

    copy = tmp_path / "engine"
    shutil.copytree(gpt_oss_ort_engine, copy)
    graph = graph_dir(copy, 0) / "target_step.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    kept = [p for p in model.metadata_props if p.key != "experts_op"]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    onnx.save(model, str(graph))
    write_manifest(copy)
    assert main(["compile", str(copy)]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip() == (
        f"error: {graph}: its sliding-window layers keep rings written in TensorScatter's circular mode (the engine "
        "was built with backend: onnxruntime), which TensorRT's KV-cache update cannot write; rebuild the engine with "
        "backend: tensorrt.")


def compile_faked(engine: Path, tmp_path: Path, monkeypatch, gpu: tuple[int, int], experts: str = "auto"
                  ) -> tuple[Path, list, list, dict]:
    """compile_engine over a copy of `engine` with TensorRT itself and a GPU of compute capability `gpu` faked: (the
    copy, each plan's build_plan arguments, the lines compile reported, the plans' info)."""
    from tests.test_tensorrt_build import fake_gpu

    from trtllm_dflash.compile import tensorrt_build
    from trtllm_dflash.compile.tensorrt_build import PLANS_DIR, PLANS_INFO, compile_engine

    root = tmp_path / "engine"
    shutil.copytree(engine, root)
    fake_gpu(monkeypatch, gpu, "a GPU")
    calls, lines = [], []

    def fake_build_plan(trt, onnx_path, *, dtype_note, shapes, targets=None, plugin_library=None,
                        dense_experts=True):
        calls.append({"shapes": shapes, "dense_experts": dense_experts})
        return b"plan"

    monkeypatch.setattr(tensorrt_build, "build_plan", fake_build_plan)
    compile_engine(root, report=lines.append, experts=experts)
    return root, calls, lines, json.loads((root / PLANS_DIR / PLANS_INFO).read_text())


def test_compile_gives_the_rings_their_length(gpt_oss_trt_engine, tmp_path, monkeypatch):
    """compile (TensorRT itself and the GPU faked) profiles a ring engine's plans with the rings' fixed length and
    target passes of at most the ring's pass, and records the length in the plans' info, from which the executor sizes
    the sliding layers' rows."""
    from trtllm_dflash.compile.tensorrt_build import DimRange

    from trtllm_dflash.engine_dir import read_engine_config
    from trtllm_dflash.runtime.tensorrt_executor import ring_caches

    _, calls, _, info = compile_faked(gpt_oss_trt_engine, tmp_path, monkeypatch, (10, 0))
    assert calls and all(c["shapes"]["ring"] == DimRange.fixed(20) and c["shapes"]["seq"].max == 16 for c in calls)
    assert info["window_ring"] == 20
    # what the executor then expects of target_step's plan: rings for the sliding layers' caches only
    cfg = read_engine_config(gpt_oss_trt_engine)
    sliding = [i for i, kind in enumerate(cfg.target["layer_types"]) if kind == "sliding_attention"]
    assert sliding and len(sliding) < cfg.target["num_hidden_layers"]
    assert ring_caches(cfg, 20) == {f"past_{kv}_{i}": 20 for i in sliding for kv in ("key", "value")}
    assert ring_caches(cfg, None) == {}


@pytest.mark.parametrize("gpu, choice, routed", [
    ((10, 0), "auto", True), ((11, 0), "auto", True), ((9, 0), "auto", False), ((12, 0), "auto", False),
    ((10, 0), "routed", True), ((10, 0), "dense", False), ((9, 0), "dense", False)],
    ids=["B200", "Thor", "H200", "RTX-5090", "B200-routed", "B200-dense", "H200-dense"])
def test_compile_chooses_the_experts_form_per_gpu(gpt_oss_trt_engine, tmp_path, monkeypatch, gpu, choice, routed):
    """Graphs for TensorRT hold one TRT_MoE node per MLP of experts; compile (TensorRT and the GPU faked) builds them
    as IMoELayer on SM 10.x / 11.x and in the dense form elsewhere (or as --experts says), says which, and records it
    in the plans' info."""
    import onnx

    from trtllm_dflash.engine_dir import graph_dir, read_engine_config
    from trtllm_dflash.runtime.executor import engine_specs

    graph = onnx.load(str(graph_dir(gpt_oss_trt_engine, 0) / "target_step.onnx"), load_external_data=False)
    layers = engine_specs(read_engine_config(gpt_oss_trt_engine))[0].num_layers
    assert [n.op_type for n in graph.graph.node if n.domain == "trt"].count("TRT_MoE") == layers
    assert {p.key: p.value for p in graph.metadata_props}["experts_op"] == "trt.TRT_MoE"
    _, calls, lines, info = compile_faked(gpt_oss_trt_engine, tmp_path, monkeypatch, gpu, choice)
    assert calls and {c["dense_experts"] for c in calls} == {not routed}
    experts = info["experts"]
    assert lines[0] == f"experts: {experts}"
    assert experts.startswith("IMoELayer") if routed else experts.startswith("the dense form"), experts
    assert f"SM {gpu[0]}.{gpu[1]}" in experts or choice == "dense"


def test_compile_refuses_routed_experts_it_cannot_build(gpt_oss_trt_engine, qwen3_engine_dir, tmp_path, monkeypatch,
                                                        capsys):
    """`compile --experts routed` on a GPU where IMoELayer does not build, or for an engine without TRT_MoE nodes: one
    sentence, a non-zero exit, the engine unchanged."""
    from tests.test_tensorrt_build import copy_engine, fake_gpu, snapshot

    root = tmp_path / "gpt_oss"
    shutil.copytree(gpt_oss_trt_engine, root)
    fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    before = snapshot(root)
    assert main(["compile", str(root), "--experts", "routed"]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip() == ("error: --experts routed: TensorRT's IMoELayer builds on SM 10.x / 11.x "
                                               "only, and this GPU is SM 9.0; use --experts auto or dense.")
    assert snapshot(root) == before
    dense = copy_engine(qwen3_engine_dir, tmp_path, fake_graphs=True)
    fake_gpu(monkeypatch, (10, 0), "NVIDIA B200")
    assert main(["compile", str(dense), "--experts", "routed"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --experts routed: this engine's graphs hold no TRT_MoE node") and "\n" not in err


@pytest.mark.slow
def test_tensorrt_graphs_keep_rings_written_whole(gpt_oss_trt_engine):
    """Graphs built for TensorRT keep the sliding-window layers' rings too (window 4 + passes of at most 16: 20
    positions, where full layers keep 264), written as TensorRT's linear KV-cache update can: the whole ring computed
    and written at 0 (onnx_ops.ring_rewrite). The TensorRT executor, over onnxruntime stand-ins of its contexts with
    the profile compile gives the plans, gives the torch executor's tokens and acceptance lengths (dflash and ar,
    greedy and sampled) through prefix hits and prompts longer than a pass, and a 75-token prompt's logits and hidden
    states in 5 passes."""
    from tests.tensorrt_standin import standin_executor

    from trtllm_dflash.compile.tensorrt_build import engine_shapes, graph_ring_pass
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config

    graph = graph_dir(gpt_oss_trt_engine, 0) / "target_step.onnx"
    assert graph_ring_pass(graph) == 16
    assert engine_shapes(read_engine_config(gpt_oss_trt_engine), 16)["ring"].max == 20
    ex = standin_executor(gpt_oss_trt_engine)
    assert ex.window_ring == 20 and [buf.shape[2] for buf in ex._target.keys] == [20, 264, 20, 264]
    torch_engine = Engine.load(gpt_oss_trt_engine, backend="torch")
    reqs = rings_decode_as_the_torch_executor(lambda: standin_executor(gpt_oss_trt_engine), torch_engine,
                                              torch.Generator().manual_seed(3))
    long_prompt_in_passes(standin_executor(gpt_oss_trt_engine), torch_engine, reqs[2].prompt_token_ids)


@pytest.mark.slow
def test_tensorrt_rtx_parses_gpt_oss_graphs_into_native_layers_and_builds_plans(gpt_oss_trt_engine):
    """TensorRT-RTX (on the CPU) parses the target step into one native attention per layer (the sinks ride in its
    additive mask), the KV-cache updates (one per cache: a sliding layer's ring too, every present_* the in-place
    update of its past_*), RoPE and the routers' TopK, and builds plans for SM89 and SM120 with the experts' TRT_MoE
    nodes in the dense form (as they stand they parse into IMoELayer layers, which build on Blackwell only)."""
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed (the tensorrt-rtx extra)")
    from trtllm_dflash.compile.tensorrt_build import (
        GRAPHS, build_plan, cache_length, cache_updates, engine_shapes, graph_ring_pass, layer_types,
        mark_attention_decomposable, parse_graph, ring_length)
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config

    cfg = read_engine_config(gpt_oss_trt_engine)
    layers = cfg.target["num_hidden_layers"]
    path = graph_dir(gpt_oss_trt_engine, 0) / "target_step.onnx"
    ring_pass = graph_ring_pass(path)
    network = parse_graph(rtx, path, static_dims={"max_len": cache_length(cfg),
                                                  "ring": ring_length(cfg, ring_pass)}).network
    types_ = layer_types(network)
    assert (types_["ATTENTION_OUTPUT"], types_["KV_CACHE_UPDATE"], types_["ROTARY_EMBEDDING"], types_["TOPK"]) == (
        layers, 2 * layers, 2 * layers, layers), types_
    assert cache_updates(network) == {f"present_{kv}_{i}": f"past_{kv}_{i}" for i in range(layers)
                                      for kv in ("key", "value")}
    assert mark_attention_decomposable(rtx, network) == layers
    # its experts: in the dense form by default (above: no MoE layer), one IMoELayer per layer as they stand
    assert types_["MOE"] == 0
    routed = parse_graph(rtx, path, static_dims={"max_len": cache_length(cfg), "ring": ring_length(cfg, ring_pass)},
                         dense_experts=False).network
    assert layer_types(routed)["MOE"] == layers
    for graph in GRAPHS:
        plan = build_plan(rtx, graph_dir(gpt_oss_trt_engine, 0) / f"{graph}.onnx", dtype_note=cfg.dtype,
                          shapes=engine_shapes(cfg, ring_pass), targets=["SM89", "SM120"])
        assert len(plan) > 100_000, graph


def test_sliding_layers_read_only_their_window(pair):
    """A pass whose sliding layers read keys from the window's first block on (`window_key`, what the torch executor
    passes: its rows' smallest start - window + 1, rounded down to 16) gives the logits of one that reads every key,
    from the static cache and from a paged one."""
    from trtllm_dflash.runtime.executor import HostRows, TorchExecutor
    from trtllm_dflash.runtime.kv_blocks import BlockTables, PagedKVCache
    from trtllm_dflash.runtime.executor import cache_shape

    ours, _ = ours_and_hf(pair / "target", pair / "target")
    g = torch.Generator().manual_seed(4)
    starts = torch.tensor([60, 70])
    seqs = torch.randint(4, ours.spec.vocab_size, (2, 80), generator=g)
    tables = BlockTables(20, 2, 128, 16, "cpu", window=None)
    for slot in range(2):
        tables.reserve(slot, 128)
    for cache in (ours.new_cache(2, 128), PagedKVCache(tables, cache_shape(ours), torch.float32, "cpu")):
        slots = torch.tensor([0, 1])
        ours(seqs[:, :70], torch.arange(70).expand(2, 70), slots, cache)  # both rows' prompts (row 0 re-written below)
        block = torch.stack([seqs[r, s:s + 8] for r, s in enumerate(starts.tolist())])
        positions = starts[:, None] + torch.arange(8)
        full = ours(block, positions, slots, cache, kv_len=80).logits
        windowed = ours(block, positions, slots, cache, kv_len=80, window_key=48).logits
        torch.testing.assert_close(windowed, full, atol=1e-6, rtol=1e-6)
    executor = TorchExecutor(ours, None, 2, 120)
    assert executor._window_key(HostRows((0, 1), (60, 70))) == 48 and executor._window_key(None) == 0
