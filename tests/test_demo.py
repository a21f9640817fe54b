"""The embedded demo pair: shipped in the package, loadable by transformers, lossless and accepting drafts."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.compare import side_by_side
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.corpus import is_held_out

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "trtllm_dflash" / "assets" / "demo"
HELD_OUT = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=tmp_path_factory.mktemp("demo") / "engine")
    # the torch form (the reference executor; the compiled form is demo_ort_engine's)
    return Engine.load(build_engine(cfg.model_copy(update={"backend": "torch"}), progress=False))


def test_assets_fit_the_size_budget():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total <= 30 * 2**20, total  # the target, the DFlash drafter (4 MB) and the DFlash2 one (6 MB)


def test_target_loads_with_transformers():
    model = AutoModelForCausalLM.from_pretrained(str(ASSETS / "target"))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, model.config.vocab_size)


def test_held_out_prompts_come_from_held_out_modules():
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines()]
    assert len(rows) >= 50
    assert all(is_held_out(r["id"].split(":")[0]) for r in rows)


def test_greedy_dflash_equals_ar_on_held_out_prompts_and_accepts_drafts(demo_engine):
    defaults = Defaults(64, 0.0, 0, demo_engine.config.max_seq_len, demo_engine.executor.vocab_size)
    requests, errors = read_requests(HELD_OUT, demo_engine.tokenizer, defaults)
    assert not errors
    cmp = side_by_side(demo_engine, requests[:6])
    assert cmp.identical
    # The trained drafter accepts several drafts per step (benchmarks/ measures it on all prompts).
    assert cmp.mean_acceptance_length >= 2.5, cmp.mean_acceptance_length


def test_the_dflash2_demo_drafter_is_lossless_and_accepts_more(demo_engine, tmp_path):
    """build_configs/demo-dflash2.yaml (its torch form): a DFlash2 drafter, lossless on held-out prompts, accepting
    more per step than the DFlash demo drafter on the same prompts (benchmarks/dflash2_demo.py measures it)."""
    cfg = load_build_config(ROOT / "build_configs" / "demo-dflash2.yaml", output=tmp_path / "engine")
    engine = Engine.load(build_engine(cfg.model_copy(update={"backend": "torch"}), progress=False))
    assert engine.config.dflash.dflash2 is not None
    defaults = Defaults(64, 0.0, 0, engine.config.max_seq_len, engine.executor.vocab_size)
    requests, _ = read_requests(HELD_OUT, engine.tokenizer, defaults)
    two, one = (side_by_side(e, requests[:6]) for e in (engine, demo_engine))
    assert two.identical
    assert two.mean_acceptance_length > one.mean_acceptance_length, (two.mean_acceptance_length,
                                                                     one.mean_acceptance_length)


@pytest.mark.slow
def test_demo_graphs_are_checked_and_hold_the_expected_nodes(demo_ort_engine):
    import onnx

    from trtllm_dflash.engine_dir import graph_dir, read_engine_config
    from trtllm_dflash.runtime.executor import engine_specs

    target, drafter, _ = engine_specs(read_engine_config(demo_ort_engine))
    L, D = target.num_layers, drafter.num_layers
    expected = {  # op type -> count
        "target_step": {"Attention": L, "RotaryEmbedding": 2 * L, "TensorScatter": 2 * L},
        "drafter_context": {"Attention": 0, "RotaryEmbedding": D, "TensorScatter": 2 * D},
        "drafter_draft": {"Attention": D, "RotaryEmbedding": 2 * D, "TensorScatter": 2 * D, "ArgMax": 1},
        "accept": {"ArgMax": 1, "CumSum": 1},
        "accept_plugin": {"DFlashAccept": 1},
    }
    for graph, counts in expected.items():
        path = graph_dir(demo_ort_engine, 0) / f"{graph}.onnx"
        onnx.checker.check_model(str(path))
        ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
        assert {op: ops.count(op) for op in counts} == counts, graph


@pytest.mark.slow
def test_demo_graphs_build_with_tensorrt_rtx(demo_ort_engine):
    """Every graph of the demo's compiled form (float32; float16 graphs: tests/test_tensor_parallel_graphs.py), built
    ahead of time on this CPU for SM89 and SM120 (the plugin form of the acceptance step excepted: TensorRT-RTX
    has no plugins)."""
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed (the tensorrt-rtx extra)")
    from trtllm_dflash.compile.tensorrt_build import GRAPHS, build_plan, engine_shapes
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config

    cfg = read_engine_config(demo_ort_engine)
    for graph in (*GRAPHS, "accept"):
        plan = build_plan(rtx, graph_dir(demo_ort_engine, 0) / f"{graph}.onnx", dtype_note=cfg.dtype,
                          shapes=engine_shapes(cfg), targets=["SM89", "SM120"])
        assert len(plan) > 20_000, graph
