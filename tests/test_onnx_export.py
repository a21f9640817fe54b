"""ONNX graphs of the DFlash step (trtllm_dflash.compile) against the torch executor they were exported from.

Each family's graphs are exported once; onnxruntime (CPU EP) then replays a continuous-batching history on
its own per-slot caches, bound in place with IOBinding as an executor would bind them (a run of rows of
[num_slots, kv_heads, max_len, head_dim] buffers), and every result must equal the TorchExecutor's.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from trtllm_dflash.compile.onnx_export import (
    ACCEPT,
    ACCEPT_PLUGIN,
    DRAFTER_CANDIDATES,
    DRAFTER_CONTEXT,
    DRAFTER_DRAFT,
    TARGET_STEP,
    TARGET_TREE,
    WEIGHTS_FILE,
    TargetDecode,
    TargetStep,
    cache_names,
    export_engine_graphs,
)
from trtllm_dflash.compile.onnx_ops import tensor_scatter
from trtllm_dflash.engine_dir import graph_dir
from trtllm_dflash.models.quantized import quantize_inputs
from trtllm_dflash.runtime.executor import DraftContext
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.speculative.core import block_input

NUM_SLOTS = 3
# torch.export's own deprecation warning (torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")


class OrtGraphs:
    """The exported graphs in onnxruntime with per-slot caches [num_slots, kv_heads, max_len, head_dim] per
    layer; a call runs the rows r0 .. r0 + batch - 1 (a test helper, not an executor)."""

    def __init__(self, graph_dir: Path, engine: Engine, extra_keys: int = 0):
        """`extra_keys`: attend to this many masked keys past the longest row (as an executor's bucket does)."""
        ex = engine.executor
        self.extra_keys = extra_keys
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.sessions = {name: ort.InferenceSession(str(graph_dir / f"{name}.onnx"), options,
                                                    providers=["CPUExecutionProvider"])
                         for name in (TARGET_STEP, DRAFTER_CONTEXT, DRAFTER_DRAFT)}
        max_len = ex.target_cache.capacity
        self.target_cache = [torch.zeros(NUM_SLOTS, kv, max_len, hd) for kv, hd in [_kv_shape(ex.target)]
                             for _ in range(2 * ex.target.spec.num_layers)]
        self.draft_cache = [torch.zeros(NUM_SLOTS, kv, max_len, hd) for kv, hd in [_kv_shape(ex.drafter)]
                            for _ in range(2 * ex.drafter.spec.num_layers)]

    def _run(self, name: str, inputs: dict[str, torch.Tensor], caches: list[torch.Tensor], r0: int,
             outputs: list[str], write: bool) -> list[torch.Tensor]:
        io = self.sessions[name].io_binding()
        for key, value in inputs.items():
            io.bind_cpu_input(key, value.contiguous().numpy())
        for key in outputs:
            io.bind_output(key)
        batch = next(iter(inputs.values())).shape[0]
        layers = len(caches) // 2
        for cache, past, present in zip(caches, cache_names(layers, "past"), cache_names(layers, "present")):
            rows = cache[r0 : r0 + batch]  # contiguous: axis 0 is outermost
            args = ("cpu", 0, np.float32, list(rows.shape), rows.data_ptr())
            io.bind_input(past, *args)
            if write:  # present_* aliases past_*: the cache is updated in place
                io.bind_output(present, *args)
        self.sessions[name].run_with_iobinding(io)
        return [torch.from_numpy(a) for a in io.copy_outputs_to_cpu()[: len(outputs)]]

    def target(self, token_ids, starts, r0):
        positions = starts[:, None] + torch.arange(token_ids.shape[1])
        keys = torch.arange(int(positions.max()) + 1 + self.extra_keys)
        return self._run(TARGET_STEP, {"token_ids": token_ids, "positions": positions, "key_positions": keys},
                         self.target_cache, r0, ["logits", "hidden"], write=True)

    def append_context(self, hidden, starts, r0):
        positions = starts[:, None] + torch.arange(hidden.shape[1])
        self._run(DRAFTER_CONTEXT, {"target_hidden": hidden, "positions": positions}, self.draft_cache, r0, [],
                  write=True)

    def draft(self, block_ids, starts, r0, context: DraftContext):
        positions = starts[:, None] + torch.arange(block_ids.shape[1])
        inputs = {"block_ids": block_ids, "positions": positions, "context_hidden": context.hidden,
                  "context_positions": context.positions(),
                  "key_positions": torch.arange(int(starts.max()) + self.extra_keys)}
        return self._run(DRAFTER_DRAFT, inputs, self.draft_cache, r0, ["draft_tokens"], write=True)[0]


def _kv_shape(model) -> tuple[int, int]:
    attn = (model.model.layers if hasattr(model, "model") else model.layers)[0].self_attn
    return attn.num_kv_heads, attn.head_dim


@pytest.fixture(scope="module")
def export_family(ort_engine_dir):
    """family -> (a fresh torch executor's engine, graph dir, graph files) of the family's `backend: onnxruntime`
    engine (tests/conftest.py; shared with tests/test_onnxruntime_backend.py): the tiny random qwen3 pair, the
    llama one (llama3 RoPE, tied embeddings), or gpt-oss (attention sinks, sliding window, experts)."""
    done = {}

    def export(family: str):
        if family not in done:
            engine_dir = ort_engine_dir(family)
            out = graph_dir(engine_dir, 0)
            files = [out / f"{name}.onnx" for name in (TARGET_STEP, DRAFTER_CONTEXT, DRAFTER_DRAFT,
                                                       DRAFTER_CANDIDATES, TARGET_TREE)]
            files += [out / WEIGHTS_FILE, out / f"{ACCEPT}.onnx", out / f"{ACCEPT_PLUGIN}.onnx"]
            # A fresh torch executor: its caches start empty, like the onnxruntime ones.
            done[family] = Engine.load(engine_dir, backend="torch"), out, files
        return done[family]

    return export


# llama's graphs (its own engine export, ~1 min) are the extended tier's: they trace the same modules as Qwen3's
# but for llama3 RoPE and tied embeddings, which tests/test_models_vs_hf.py checks against transformers
@pytest.fixture(params=["qwen3", pytest.param("llama", marks=pytest.mark.extended), "gpt_oss"])
def exported(request, export_family):
    return export_family(request.param)


def test_tensor_scatter_writes_each_row_at_its_index():
    cache = torch.zeros(2, 1, 5, 1)  # [batch, heads, max_len, head_dim]
    update = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(2, 1, 2, 1)
    out = tensor_scatter(cache, update, torch.tensor([0, 3]))
    assert out.flatten(1).tolist() == [[1, 2, 0, 0, 0], [0, 0, 0, 3, 4]]
    assert cache.abs().sum() == 0  # functional: the input is untouched


def test_the_in_place_decode_module_equals_target_step_in_torch(qwen3_engine_dir):
    """TargetDecode run eagerly (onnx_ops.attend_in_place's torch form: write at each row's position, attend up to it)
    gives TargetStep's logits, features and caches for one token per row, rows at different positions (0 among them)."""
    target = Engine.load(qwen3_engine_dir).executor.target
    attn = target.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    past = [torch.randn(3, attn.num_kv_heads, 32, attn.head_dim, generator=g) for _ in range(2 * target.spec.num_layers)]
    tokens, positions = torch.tensor([[5], [9], [11]]), torch.tensor([[7], [0], [20]])
    step = TargetStep(target, (0, 1))(tokens, positions, torch.arange(21), [t.clone() for t in past])
    decode = TargetDecode(target, (0, 1))(tokens, positions, [t.clone() for t in past])
    for a, b in zip(decode, step):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_graphs_are_valid_and_use_the_onnx_llm_ops(exported):
    engine, out, files = exported
    assert [f.name for f in files] == [f"{TARGET_STEP}.onnx", f"{DRAFTER_CONTEXT}.onnx", f"{DRAFTER_DRAFT}.onnx",
                                       f"{DRAFTER_CANDIDATES}.onnx", f"{TARGET_TREE}.onnx", WEIGHTS_FILE,
                                       f"{ACCEPT}.onnx", f"{ACCEPT_PLUGIN}.onnx"]
    for f in files[:5]:  # which rank of which split (compile checks it)
        meta = {p.key: p.value for p in onnx.load(str(f), load_external_data=False).metadata_props}
        assert (meta["rank"], meta["tp_size"]) == ("0", "1")
    layers, draft_layers = engine.executor.target.spec.num_layers, engine.executor.drafter.spec.num_layers
    ops = {}
    for f in files[:5]:
        onnx.checker.check_model(str(f), full_check=True)
        ops[f.stem] = Counter(n.op_type for n in onnx.load(str(f), load_external_data=False).graph.node)
    # No size inside a graph comes from an input's values: the attended length is key_positions' length.
    for f in files[:5]:
        graph = onnx.load(str(f), load_external_data=False).graph
        assert "NonZero" not in {n.op_type for n in graph.node}, f.name
        keys = [[d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input if i.name == "key_positions"]
        assert keys == ([] if f.stem == DRAFTER_CONTEXT else [["keys"]]), f.name
    # ONNX's own attention, RoPE (q and k) and KV-cache write: TensorRT parses each into its native layer
    # (IAttention, IRotaryEmbeddingLayer, IKVCacheUpdateLayer), so no plugin is needed.
    assert (ops[TARGET_STEP]["Attention"], ops[TARGET_STEP]["RotaryEmbedding"], ops[TARGET_STEP]["TensorScatter"]) \
        == (layers, 2 * layers, 2 * layers)
    # The context pass only writes K/V: no attention.
    assert (ops[DRAFTER_CONTEXT]["Attention"], ops[DRAFTER_CONTEXT]["RotaryEmbedding"],
            ops[DRAFTER_CONTEXT]["TensorScatter"]) == (0, draft_layers, 2 * draft_layers)
    # The draft writes the new context rows (RoPE over context and block keys at once, and the queries), attends,
    # and ends in the greedy ArgMax.
    assert (ops[DRAFTER_DRAFT]["Attention"], ops[DRAFTER_DRAFT]["RotaryEmbedding"], ops[DRAFTER_DRAFT]["TensorScatter"],
            ops[DRAFTER_DRAFT]["ArgMax"]) == (draft_layers, 2 * draft_layers, 2 * draft_layers, 1)
    # The draft trees' graphs: the same attention, RoPE and cache writes (the tree's mask an input), and the
    # candidates' TopK in place of the ArgMax.
    assert (ops[TARGET_TREE]["Attention"], ops[TARGET_TREE]["RotaryEmbedding"], ops[TARGET_TREE]["TensorScatter"]) \
        == (layers, 2 * layers, 2 * layers)
    assert (ops[DRAFTER_CANDIDATES]["Attention"], ops[DRAFTER_CANDIDATES]["TopK"], ops[DRAFTER_CANDIDATES]["ArgMax"]) \
        == (draft_layers, 1, 0)
    # Embedding and lm_head are in both target_step and drafter_draft, stored once in the shared file.
    external = {f.stem: {t.name: {e.key: e.value for e in t.external_data}
                         for t in onnx.load(str(f), load_external_data=False).graph.initializer if t.external_data}
                for f in files[:3]}
    embed = "target.model.embed_tokens.weight"
    assert external[DRAFTER_DRAFT][embed] == external[TARGET_STEP][embed]
    assert {e["location"] for graph in external.values() for e in graph.values()} == {WEIGHTS_FILE}
    stored = sum(int(e["length"]) for graph in external.values() for e in graph.values())
    assert (out / WEIGHTS_FILE).stat().st_size < stored


@pytest.mark.slow
def test_onnxruntime_equals_the_torch_executor(exported):
    """Prefill (two prompt lengths, then a third request alone in row 2), verify of an 8-token block over all
    rows, AR steps over rows 1..2 on the caches written so far; drafter context appends and drafts in between."""
    engine, out, _ = exported
    ex = engine.executor
    # qwen3 attends to exactly the keys it needs; the others to 7 masked keys more, as an executor's bucket may
    # (gpt-oss's sliding-window layers too): the same values either way.
    graphs = OrtGraphs(out, engine, extra_keys=0 if ex.target.spec.model_type == "qwen3" else 7)
    g = torch.Generator().manual_seed(0)
    vocab, block_size, mask_id = ex.vocab_size, ex.block_size, ex.drafter.params.mask_token_id

    def target(token_ids, starts, r0):
        ref = ex.target_forward(token_ids, starts, torch.arange(r0, r0 + len(starts)), capture=True)
        logits, hidden = graphs.target(token_ids, starts, r0)
        torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
        assert torch.equal(logits.argmax(-1), ref.logits.argmax(-1))
        torch.testing.assert_close(hidden, ref.hidden, atol=1e-4, rtol=0)
        return ref

    def context_and_draft(hidden, starts, r0, draft_starts, fused):
        """The drafter gets `hidden` at `starts` in a pass of its own, or (`fused`) in the draft pass itself."""
        slots = torch.arange(r0, r0 + len(starts))
        features = hidden.shape[-1]
        if fused:
            context = DraftContext(hidden, starts)
        else:
            ex.append_context(hidden, starts, slots)
            graphs.append_context(hidden, starts, r0)
            context = None
        anchors = torch.randint(0, vocab, (len(starts),), generator=g)
        # The graphs take at least one context row: a padding row where there is nothing to add (the executors'
        # choice), given to both so that the caches stay equal.
        padding = DraftContext.padding(draft_starts, features, hidden.dtype)
        context = context or padding
        assert torch.equal(graphs.draft(block_input(anchors, mask_id, block_size), draft_starts, r0, context),
                           ex.draft(anchors, draft_starts, slots, context=context))
        # A shorter run-time block (one draft token): TorchExecutor.draft's code with block_size 2.
        short = block_input(anchors, mask_id, 2)
        positions = draft_starts[:, None] + torch.arange(2)
        hidden = ex.drafter(ex.target.embed(short), positions, draft_starts, slots, ex.draft_cache,
                            padding.hidden, padding.positions())
        assert torch.equal(graphs.draft(short, draft_starts, r0, padding), ex.target.logits(hidden[:, 1:]).argmax(-1))

    lengths = torch.tensor([11, 6])  # rows 0, 1: a padded batch, as Decoder._prefill builds it
    prompts = torch.randint(0, vocab, (2, 11), generator=g)
    ref = target(prompts, torch.zeros(2, dtype=torch.long), r0=0)
    context_and_draft(ref.hidden, torch.zeros(2, dtype=torch.long), 0, draft_starts=lengths, fused=False)
    ref = target(torch.randint(0, vocab, (1, 4), generator=g), torch.zeros(1, dtype=torch.long), r0=2)
    context_and_draft(ref.hidden, torch.zeros(1, dtype=torch.long), 2, draft_starts=torch.tensor([4]), fused=False)

    starts = torch.tensor([11, 6, 4])  # verify one block per row, then commit 3 of its positions
    ref = target(torch.randint(0, vocab, (3, block_size), generator=g), starts, r0=0)
    context_and_draft(ref.hidden[:, :3], starts, 0, draft_starts=starts + 3, fused=True)
    starts = torch.tensor([9, 7])  # rows 1, 2: AR steps on top of the caches
    for _ in range(3):
        target(torch.randint(0, vocab, (2, 1), generator=g), starts, r0=1)
        starts = starts + 1

    # The caches themselves: TorchExecutor's per layer [slots, max_len, kv_heads, hd], ours [slots, kv, max_len, hd]
    for i in range(ex.target.spec.num_layers):
        for ours, theirs in ((graphs.target_cache[2 * i], ex.target_cache.k[i]),
                             (graphs.target_cache[2 * i + 1], ex.target_cache.v[i])):
            torch.testing.assert_close(ours, theirs[:NUM_SLOTS].transpose(1, 2), atol=1e-5, rtol=0)
    # The drafter's: each row's context positions (11 + 3, 6 + 3 and 4 + 3 committed). Past them the torch executor's
    # draft passes left their blocks' K/V (written, masked, overwritten later) and the graphs' did not.
    for i in range(ex.drafter.spec.num_layers):
        for row, committed in enumerate((14, 9, 7)):
            torch.testing.assert_close(graphs.draft_cache[2 * i][row, :, :committed],
                                       ex.draft_cache.k[i][row, :committed].transpose(0, 1), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_export_is_deterministic(export_family, tmp_path):
    """Exporting the engine's graphs again, in three processes that claim them one by one (engine/builder.py
    export_graphs; merge_graph_parts writes their parts as one process would), gives the build's files byte for byte:
    no process's object addresses in the graphs, one weights file in the graphs' order."""
    from trtllm_dflash.engine.builder import export_graphs
    from trtllm_dflash.engine_dir import read_engine_config

    _, out, _ = export_family("qwen3")
    root = out.parents[1]
    copy = tmp_path / "engine"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("onnx"))
    export_graphs(copy, read_engine_config(copy), processes=3)
    again = graph_dir(copy, 0)
    assert sorted(f.name for f in again.iterdir()) == sorted(f.name for f in out.iterdir())  # target_decode.onnx too
    for f in out.iterdir():
        assert f.read_bytes() == (again / f.name).read_bytes(), f.name
    assert sorted(f.name for f in copy.iterdir()) == sorted(f.name for f in root.iterdir())  # (no parts left)


def test_export_processes_follow_the_cores_and_the_limit(qwen3_engine_dir, monkeypatch):
    """A build exports in one process per core at most (this engine's rank file is small, so memory does not
    decide here), and no more than $TRTLLM_DFLASH_EXPORT_PROCESSES, where a larger limit changes nothing."""
    import os

    from trtllm_dflash.engine.builder import EXPORT_PROCESSES_ENV, export_processes
    from trtllm_dflash.engine_dir import read_engine_config

    cfg = read_engine_config(qwen3_engine_dir)
    monkeypatch.delenv(EXPORT_PROCESSES_ENV, raising=False)
    unlimited = export_processes(qwen3_engine_dir, cfg)
    assert 1 <= unlimited <= (os.cpu_count() or 1)
    monkeypatch.setenv(EXPORT_PROCESSES_ENV, "1")
    assert export_processes(qwen3_engine_dir, cfg) == 1
    monkeypatch.setenv(EXPORT_PROCESSES_ENV, "1000")
    assert export_processes(qwen3_engine_dir, cfg) == unlimited


def test_refuses_what_it_cannot_export(qwen3_engine_dir, tmp_path):
    """Quantized linears whose stored weight was not given back (keep_stored_weights): the graph would hold the
    dequantized weight and lose the format."""
    ex = Engine.load(qwen3_engine_dir).executor
    quantize_inputs(ex.drafter, {"layers.0.mlp.down_proj": ("fp8", torch.tensor(1.0))})
    with pytest.raises(ValueError, match=r"drafter\.layers\.0\.mlp\.down_proj: fp8 linears are exported only with "
                                         r"their stored weight"):
        export_engine_graphs(ex.target, ex.drafter, tmp_path)
    quantize_inputs(ex.target, {"model.layers.1.self_attn.o_proj": ("nvfp4", torch.tensor(1.0))})
    with pytest.raises(ValueError, match=r"target\.model\.layers\.1\.self_attn\.o_proj: nvfp4 linears"):
        export_engine_graphs(ex.target, None, tmp_path)
    assert not list(tmp_path.iterdir())  # refused before anything is written
