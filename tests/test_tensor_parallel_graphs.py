"""Per-rank ONNX graphs of tensor-parallel engines (`backend: tensorrt`, tp 2 and 4).

Every rank's graphs pass onnx.checker, hold TensorRT's DistCollective node for each collective of the sharded
model (an all-reduce per row-parallel projection and for the vocab-parallel embedding, an all-gather of the
logits' vocabulary shards), say which rank of which split they are, and, with TensorRT-RTX installed, parse
into DIST_COLLECTIVE layers and build into plans on the CPU: fp16 for SM89 and SM120 (tp 4, Qwen3), NVFP4 (the
tp 2 engine: gpt-oss with its experts split by expert parallelism, FLOAT4E2M1 weights and experts,
TRT_FP4DynamicQuantize inputs) for SM120. `compile` refuses a graph of another rank or split before TensorRT
parses anything.

Not shown here: the numbers. onnxruntime cannot run DistCollective, and no machine of ours runs TensorRT on
two GPUs; the modules the graphs are traced from are the ones tests/test_tensor_parallel.py runs under MPI.
"""

from __future__ import annotations

import shutil
import sys
import types
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch

from trtllm_dflash.cli import main
from trtllm_dflash.compile.tensorrt_build import (
    GRAPHS,
    build_plan,
    compile_engine,
    graph_placement,
    layer_types,
    parse_graph,
    plan_shapes,
)
from trtllm_dflash.config import BuildConfig
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.engine_dir import graph_dir, read_engine_config, write_manifest
from trtllm_dflash.errors import UserError
from trtllm_dflash.runtime.executor import engine_specs
from trtllm_dflash.train.random_pair import write_random_pair

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")]
SIZES = (2, 4)


# tp -> the build's quantization: the tp 2 engine is the gpt-oss pair with NVFP4 target (experts too) and drafter,
# its experts split by expert parallelism (as the 120b config), so its graphs also show NVFP4 and the experts
# through the collectives; the tp 4 engine is a Qwen3 pair, unquantized
QUANTIZATION = {2: "nvfp4", 4: "none"}
# NVFP4 plans need FP4 tensor cores: TensorRT-RTX refuses SM89 for them ("HW-specific datatypes: fp4_e2m1")
TARGETS = {"nvfp4": ["SM120"], "none": ["SM89", "SM120"]}


@pytest.fixture(scope="module")
def tp_engines(gpt_oss_pair, tmp_path_factory) -> dict[int, Path]:
    """Built for TensorRT: tp 2, the gpt-oss pair (4 experts, 2 per rank) in NVFP4; tp 4, a random Qwen3 pair
    (4 KV heads, so tp 4 splits them; 2 layers and a 1-layer drafter, as each layer adds export time) in float16."""
    root = tmp_path_factory.mktemp("tp_graphs")
    write_random_pair(root / "pair", "qwen3", num_kv_heads=4, block_size=4, num_layers=2, draft_layers=1)
    common = dict(backend="tensorrt", max_batch_size=4, max_seq_len=128)
    return {
        2: build_engine(BuildConfig(target=gpt_oss_pair / "target", drafter=gpt_oss_pair / "drafter", tp_size=2,
                                    output=root / "tp2", dtype="bfloat16", quantization="nvfp4", quantize_drafter=True,
                                    moe_parallel="ep", calibration_samples=4, calibration_max_tokens=24, **common),
                        force=False, progress=False),
        4: build_engine(BuildConfig(target=root / "pair" / "target", drafter=root / "pair" / "drafter", tp_size=4,
                                    output=root / "tp4", dtype="float16", **common), force=False, progress=False),
    }


def expected_collectives(tp_engine: Path) -> dict[str, Counter]:
    """graph -> Counter of DistCollective operations the sharded modules perform."""
    target, drafter, _ = engine_specs(read_engine_config(tp_engine))
    return {
        # embedding + (o_proj, down_proj) per layer; the logits' vocabulary shards
        "target_step": Counter(all_reduce=1 + 2 * target.num_layers, all_gather=1),
        "drafter_context": Counter(),  # fc and the context K/V projections are column-parallel
        "drafter_draft": Counter(all_reduce=1 + 2 * drafter.num_layers, all_gather=1),
    }


@pytest.mark.parametrize("tp", SIZES)
def test_every_rank_has_checked_graphs_with_its_collectives(tp_engines, tp):
    engine = tp_engines[tp]
    expected = expected_collectives(engine)
    target, drafter, _ = engine_specs(read_engine_config(engine))
    cache_writes = {"target_step": 2 * target.num_layers, "drafter_context": 2 * drafter.num_layers,
                    "drafter_draft": 2 * drafter.num_layers}
    for rank in range(tp):
        for graph in GRAPHS:
            path = graph_dir(engine, rank) / f"{graph}.onnx"
            onnx.checker.check_model(str(path))
            model = onnx.load(str(path), load_external_data=False)
            ops = Counter(n.op_type for n in model.graph.node)
            assert ops["RotaryEmbedding"] and ops["TensorScatter"] == cache_writes[graph], (graph, ops)
            assert ops["Attention"] == (0 if graph == "drafter_context" else
                                        target.num_layers if graph == "target_step" else drafter.num_layers)
            collectives = [n for n in model.graph.node if n.op_type == "DistCollective"]
            attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in collectives]
            assert {n.domain for n in collectives} <= {"trt"}
            assert Counter(a["collective_operation"].decode() for a in attrs) == expected[graph], graph
            for a in attrs:
                assert (a["group_size"], list(a["groups"]), a["root"]) == (tp, list(range(tp)), -1)
                assert a["reduce_op"].decode() == ("sum" if a["collective_operation"] == b"all_reduce" else "none")
            assert graph_placement(path) == (rank, tp)


def test_nvfp4_graphs_hold_the_stored_weights_and_fp4_quantize_nodes(tp_engines):
    """Each NVFP4 linear and experts projection of each rank: its packed E2M1 bytes, FP8 block scales and global
    scale are the rank file's own (a FLOAT4E2M1 initializer holds the checkpoint's bytes as they are; the experts,
    stored by ModelOpt packed along K as [E, K/2, N], as the linears they are, [E, N, K/2], since ONNX packs along
    the innermost axis); each rank holds its own 2 of the 4 experts; each quantized input goes through TensorRT's
    TRT_FP4DynamicQuantize (q/k/v and gate/up share theirs)."""
    import onnx_ir as ir
    from safetensors.torch import load_file

    engine = tp_engines[2]
    target, drafter, _ = engine_specs(read_engine_config(engine))
    for rank in range(2):
        weights = load_file(str(engine / f"rank{rank}.safetensors"))
        # Per layer: the linears (experts apart) and TensorRT FP4 quantize nodes, one per distinct input: the
        # target's q/k/v, o, gate/up (experts: theirs) and down; the drafter's q (the block), k/v (the context rows
        # and the block, projected at once), o, gate/up and down. The drafter's fc, outside its layers, once.
        graphs = (("target_step", "target.", target.num_layers, 4, 4, 0),
                  ("drafter_draft", "drafter.", drafter.num_layers, 7, 5, 1))
        for graph, prefix, layers, linears, quantizes, fc in graphs:
            model = ir.load(graph_dir(engine, rank) / f"{graph}.onnx")
            stored = {name: v.const_value for name, v in model.graph.initializers.items()
                      if name.endswith(".stored_weight")}
            assert len(stored) == linears * layers + fc
            assert all(t.dtype == ir.DataType.FLOAT4E2M1 for t in stored.values())
            for name, tensor in stored.items():
                module = name.removesuffix(".stored_weight")
                assert tensor.tobytes() == weights[f"{module}.weight"].numpy().tobytes(), name
                scale = model.graph.initializers[f"{module}.stored_weight_scale"].const_value
                assert scale.tobytes() == weights[f"{module}.weight_scale"].view(torch.uint8).numpy().tobytes()
            ops = Counter(node.op_type for node in model.graph)
            assert ops["TRT_FP4DynamicQuantize"] == quantizes * layers + fc, (graph, ops)
            if graph != "target_step":
                continue
            for layer in range(layers):
                for projection in ("gate_up_proj", "down_proj"):
                    name = f"{prefix}model.layers.{layer}.mlp.experts.{projection}"
                    experts = model.graph.initializers[f"{name}_stored_weight"].const_value
                    assert experts.dtype == ir.DataType.FLOAT4E2M1 and experts.shape[0] == 2
                    assert experts.tobytes() == weights[name].transpose(1, 2).contiguous().numpy().tobytes(), name


def test_ranks_hold_different_shards(tp_engines):
    """Each rank's graphs carry its own slice of the weights (the external data files differ)."""
    engine = tp_engines[2]
    data = [(graph_dir(engine, r) / "weights.onnx.data").read_bytes() for r in range(2)]
    assert data[0] != data[1] and abs(len(data[0]) - len(data[1])) < len(data[0]) // 4


def test_compile_refuses_a_graph_of_another_rank_or_split(tp_engines, tmp_path, monkeypatch):
    """Checked once TensorRT and a GPU are there (faked: neither is needed to find the mistake)."""
    fake = types.ModuleType("tensorrt")
    fake.__version__ = "11.1.0.7"
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = tmp_path / "swapped"
    shutil.copytree(tp_engines[2], engine)
    ranks = [graph_dir(engine, r) for r in range(2)]
    ranks[0].rename(tmp_path / "rank0")
    ranks[1].rename(ranks[0])
    (tmp_path / "rank0").rename(ranks[1])
    write_manifest(engine)  # the files themselves are intact: only their placement is wrong
    with pytest.raises(UserError, match=r"exported for rank 1 of tp_size 2, but it is rank 0's graph"):
        compile_engine(engine)
    assert not (engine / "tensorrt").exists()


def test_onnxruntime_backend_stays_tp_1(tp_engines, tmp_path, capsys):
    pair = tp_engines[4].parent / "pair"
    config = tmp_path / "b.yaml"
    config.write_text(f"target: {pair / 'target'}\ndrafter: {pair / 'drafter'}\noutput: {tmp_path / 'e'}\n"
                      "backend: onnxruntime\ntp_size: 2\n")
    assert main(["build", str(config)]) == 2
    assert "backend onnxruntime builds tp_size 1 engines for now, not 2" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


@pytest.fixture(scope="module")
def rtx():
    return pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed (the tensorrt-rtx extra)")


@pytest.mark.parametrize("tp", SIZES)
def test_tensorrt_rtx_builds_every_rank(rtx, tp_engines, tp):
    engine = tp_engines[tp]
    cfg = read_engine_config(engine)
    shapes = plan_shapes(cfg, engine)  # (a gpt-oss target's sliding layers keep rings of a fixed length too)
    assert ("ring" in shapes) == (tp == 2)  # tp 2: the gpt-oss pair, its rings written whole on every rank
    expected = expected_collectives(engine)
    for rank in range(tp):
        for graph in GRAPHS:
            path = graph_dir(engine, rank) / f"{graph}.onnx"
            parsed = parse_graph(rtx, path, static_dims={name: r.max for name, r in shapes.items() if r.min == r.max})
            assert layer_types(parsed.network)["DIST_COLLECTIVE"] == sum(expected[graph].values())
            plan = build_plan(rtx, path, dtype_note=cfg.dtype, shapes=shapes, targets=TARGETS[QUANTIZATION[tp]])
            assert len(plan) > 50_000, (rank, graph)
            if QUANTIZATION[tp] == "nvfp4":
                assert layer_types(parsed.network)["DYNAMIC_QUANTIZE"] > 0


@pytest.mark.parametrize("processes", [2, 4])  # a process per rank; two per rank, claiming its graphs
def test_a_failed_rank_export_names_the_rank(tp_engines, tmp_path, processes):
    """Ranks export in processes of their own (builder.export_graphs): a failure in one says which rank and why, and
    leaves no graphs and no parts of them."""
    from trtllm_dflash.engine.builder import export_graphs

    shutil.copy(tp_engines[2] / "config.json", tmp_path / "config.json")  # no rank files: the export cannot load them
    with pytest.raises(RuntimeError, match=r"exporting rank \d's graphs failed \(exit 1\): .*rank\d\.safetensors"):
        export_graphs(tmp_path, read_engine_config(tmp_path), processes=processes)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
