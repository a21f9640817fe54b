"""TensorRT plans: `compile_engine` and `TensorRTExecutor.from_engine` refuse what they cannot do with one
sentence and write nothing; compile adds the plans and a new manifest in one swap, or changes nothing when a
plan fails (TensorRT faked); the executor's bindings (cache rows, in-place past/present pairs, padding rows),
run by onnxruntime stand-ins for TensorRT's execution contexts, give the torch executor's tokens; and, when
TensorRT-RTX is installed, the engine's graphs parse into TensorRT's native attention / KV-cache-update /
rotary layers and build into plans for SM89 and SM120 on the CPU.

Real TensorRT and a GPU are never needed here: the tests fake the `tensorrt` module and torch.cuda where a
refusal depends on them, so they pass whether or not either is present."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from trtllm_dflash.compile import tensorrt_build
from trtllm_dflash.compile.tensorrt_build import (
    ACCEPT,
    ACCEPT_PLUGIN,
    GRAPHS,
    PLANS,
    PLANS_DIR,
    PLANS_INFO,
    DimRange,
    PlanBuildError,
    build_plan,
    cache_length,
    cache_updates,
    compile_engine,
    engine_shapes,
    layer_types,
    mark_attention_decomposable,
    load_plugin_library,
    parse_graph,
    pass_tokens,
    plan_file,
    process_logger,
)
from trtllm_dflash.engine_dir import graph_dir, open_engine, read_engine_config, write_manifest
from trtllm_dflash.errors import UserError
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import engine_specs
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.runtime.tensorrt_executor import (
    TensorRTExecutor, _check_plan, bound_dtypes, communicator_address, pointer_capsule,
)
from tests.tensorrt_standin import standin_executor

RTX_INSTALL = ("TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13-libs==1.7.1.116 "
               "tensorrt_rtx_cu13_bindings==1.7.1.116")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def ort_engine(biased_ort_engine) -> Path:
    """A tiny engine with ONNX graphs (tests/conftest.py) of a pair whose drafts are often accepted
    (conftest.bias_target), so verify steps commit 1 .. block_size tokens."""
    return biased_ort_engine


def copy_engine(src: Path, tmp_path: Path, fake_graphs: bool = False) -> Path:
    """A copy of `src` alone in its own directory (so sibling temporaries would show); with `fake_graphs`, a
    torch engine gets placeholder ONNX files, listed in its manifest (enough for every refusal before parsing)."""
    root = tmp_path / "alone" / "engine"
    shutil.copytree(src, root)
    if fake_graphs:
        graph_dir(root, 0).mkdir(parents=True)
        for g in (*GRAPHS, ACCEPT, ACCEPT_PLUGIN):
            # the placeholders have the inputs compile looks for (the attended length, the new context rows)
            inputs = {"target_step": ("key_positions",), "drafter_draft": ("key_positions", "context_hidden")}
            (graph_dir(root, 0) / f"{g}.onnx").write_bytes(placeholder_graph(*inputs.get(g, ())))
        write_manifest(root)
    return root


def placeholder_graph(*input_names: str) -> bytes:
    """A one-node ONNX model (a Sum of its inputs, default one named x) that says it is rank 0 of tp_size 1, as
    exported graphs do."""
    import onnx
    from onnx import TensorProto, helper

    names = input_names or ("x",)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in names]
    model = helper.make_model(helper.make_graph([helper.make_node("Sum", list(names), ["y"])], "g", inputs,
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]))
    onnx.helper.set_model_props(model, {"rank": "0", "tp_size": "1"})
    return model.SerializeToString()


def snapshot(root: Path) -> dict[str, str]:
    """Every file in the engine's parent directory (the engine and any sibling) -> sha256."""
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.parent.rglob("*")) if p.is_file()}


def fake_tensorrt(monkeypatch, version: str | None) -> None:
    """`import tensorrt` fails (None) or gives an empty module of that version."""
    module = None
    if version is not None:
        module = types.ModuleType("tensorrt")
        module.__version__ = version
    monkeypatch.setitem(sys.modules, "tensorrt", module)


def fake_gpu(monkeypatch, capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H200") -> None:
    """TensorRT 11.1 (an empty module) and a CUDA GPU of that compute capability, as compile sees them."""
    fake_tensorrt(monkeypatch, "11.1.0.7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def refused(call, *words) -> None:
    with pytest.raises(UserError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith("."), msg
    for w in words:
        assert w in msg, (w, msg)


# --------------------------------------------------------------------------------------------------------
# compile_engine refusals
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["no graphs", "plugin missing", "no tensorrt", "old tensorrt", "no gpu",
                                  "damaged graph", "draft graph of an earlier version"])
def test_compile_refuses_with_one_sentence_and_writes_nothing(case, qwen3_engine_dir, tmp_path, monkeypatch):
    root = copy_engine(qwen3_engine_dir, tmp_path, fake_graphs=case != "no graphs")
    plugin = None
    fake_tensorrt(monkeypatch, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if case == "no graphs":
        words = ["the engine has no ONNX graphs", "backend: onnxruntime", "backend torch"]
    elif case == "plugin missing":
        plugin, words = tmp_path / "libtrtllm_dflash_plugins.so", ["--plugin-library", "no such file"]
    elif case == "no tensorrt":
        words = ["compile needs TensorRT 10.15+ on the GPU machine", "pip install tensorrt", "TensorRT-RTX",
                 "SM90/SM100"]
    elif case == "old tensorrt":
        fake_tensorrt(monkeypatch, "10.8.0.43")
        words = ["TensorRT 10.15+", "this is TensorRT 10.8.0.43"]
    elif case == "no gpu":
        fake_tensorrt(monkeypatch, "11.1.0.7")
        words = ["compile needs a CUDA GPU"]
    elif case == "damaged graph":
        graph = graph_dir(root, 0) / "target_step.onnx"
        graph.write_bytes(graph.read_bytes() + b"\0")
        words = ["target_step.onnx: engine file does not match manifest.json"]
    else:  # exported before the graphs took the attended length as key_positions' length
        fake_tensorrt(monkeypatch, "11.1.0.7")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        (graph_dir(root, 0) / "drafter_draft.onnx").write_bytes(placeholder_graph())
        write_manifest(root)
        words = ["drafter_draft.onnx: this graph was exported by an earlier trtllm-dflash",
                 "no key_positions input", "trtllm-dflash build CONFIG --force"]
    before = snapshot(root)
    refused(lambda: compile_engine(root, plugin_library=plugin), *words)
    assert snapshot(root) == before


def test_compile_adds_plans_atomically(qwen3_engine_dir, tmp_path, monkeypatch):
    """Everything of compile_engine but TensorRT itself: a fake build_plan on a fake GPU."""
    root = copy_engine(qwen3_engine_dir, tmp_path, fake_graphs=True)
    fake_gpu(monkeypatch)
    built = []

    def fake_build_plan(trt, onnx_path, *, dtype_note, shapes, targets=None, plugin_library=None,
                        dense_experts=True):
        built.append(Path(onnx_path).stem)
        if Path(onnx_path).stem == fail_at:
            raise tensorrt_build.PlanBuildError("refused")
        assert trt.__version__ == "11.1.0.7" and dtype_note == "float32" and targets is None
        assert dense_experts  # (no experts: nothing to rewrite, nothing to keep)
        assert shapes == engine_shapes(read_engine_config(root))
        return f"plan of {Path(onnx_path).stem} #{len(built)}".encode()

    monkeypatch.setattr(tensorrt_build, "build_plan", fake_build_plan)
    before, fail_at = snapshot(root), "drafter_draft"
    with pytest.raises(tensorrt_build.PlanBuildError):  # the last plan fails: nothing changes
        compile_engine(root)
    assert snapshot(root) == before

    lines = []
    for fail_at in (None, None):  # compile, then compile again: the plans are replaced
        built.clear()
        files = compile_engine(root, report=lines.append)
        assert files == [plan_file(root, 0, g) for g in PLANS] and built == list(PLANS)
        assert [f.read_bytes() for f in files] == [f"plan of {g} #{i + 1}".encode() for i, g in enumerate(PLANS)]
        open_engine(root)  # the manifest lists the plans
        info = json.loads((root / PLANS_DIR / PLANS_INFO).read_text())
        assert info["tensorrt_version"] == "11.1.0.7" and info["compute_capability"] == "9.0"
        assert info["cache_length"] == cache_length(read_engine_config(root)) and info["plugin_library"] is None
        assert info["experts"] is None
        assert [p.name for p in root.parent.iterdir()] == ["engine"]  # no temporaries left
        changed = {k for k in set(before) | set(snapshot(root)) if before.get(k) != snapshot(root).get(k)}
        assert changed == {"engine/manifest.json", "engine/tensorrt/plans.json",
                           *(f"engine/tensorrt/rank0/{g}.engine" for g in PLANS)}
    assert lines[0].startswith("rank 0: target_step -> tensorrt/rank0/target_step.engine")
    # With the plugin library, the acceptance plan is built from its plugin form.
    library = tmp_path / "libtrtllm_dflash_plugins.so"
    library.write_bytes(b"")
    built.clear()
    compile_engine(root, plugin_library=library)
    assert built == [*GRAPHS, ACCEPT_PLUGIN]
    assert json.loads((root / PLANS_DIR / PLANS_INFO).read_text())["plugin_library"] == library.name


# --------------------------------------------------------------------------------------------------------
# TensorRTExecutor.from_engine refusals
# --------------------------------------------------------------------------------------------------------


def fake_plans(root: Path, **info) -> None:
    for g in PLANS:
        plan_file(root, 0, g).parent.mkdir(parents=True, exist_ok=True)
        plan_file(root, 0, g).write_bytes(b"plan")
    info = {"tensorrt_version": "11.1.0.7", "compute_capability": "9.0", "device": "NVIDIA H200",
            "cache_length": 520, "plugin_library": None, **info}
    (root / PLANS_DIR / PLANS_INFO).write_text(json.dumps(info))


@pytest.mark.parametrize("case", ["no plans", "plugin needed", "plugin missing", "other plugin build", "no tensorrt",
                                  "other tensorrt", "no gpu", "other gpu", "auto with the plugin"])
def test_executor_refuses_with_one_sentence(case, qwen3_engine_dir, tmp_path, monkeypatch):
    root = copy_engine(qwen3_engine_dir, tmp_path)
    cfg = read_engine_config(root)
    plugin = None
    fake_tensorrt(monkeypatch, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if case == "no plans":
        words = ["the engine has no TensorRT plans", f"run `trtllm-dflash compile {root}` on the GPU machine first"]
    else:
        fake_plans(root, plugin_library="libtrtllm_dflash_plugins.so" if case in ("plugin needed",
                                                                                   "auto with the plugin") else None)
    if case == "plugin needed":
        words = ["built with the plugin library libtrtllm_dflash_plugins.so", "--plugin-library"]
    elif case == "plugin missing":
        plugin, words = tmp_path / "missing.so", ["--plugin-library", "no such file"]
    elif case == "other plugin build":
        plugin = tmp_path / "libtrtllm_dflash_plugins.so"
        plugin.write_bytes(b"a plugin library of another build")
        fake_plans(root, plugin_library=plugin.name, plugin_library_sha256=hashlib.sha256(b"the one compiled").hexdigest())
        words = ["another build of the plugin library", "compile"]
    elif case == "no tensorrt":
        words = ["--backend tensorrt needs TensorRT 10.15+", "pip install tensorrt"]
    elif case == "other tensorrt":
        fake_tensorrt(monkeypatch, "11.0.0.1")
        words = ["built with TensorRT 11.1.0.7 and this is TensorRT 11.0.0.1", "compile"]
    elif case == "no gpu":
        fake_tensorrt(monkeypatch, "11.1.0.7")
        words = ["--backend tensorrt needs a CUDA GPU"]
    elif case == "other gpu":
        fake_tensorrt(monkeypatch, "11.1.0.7")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
        words = ["built for compute capability 9.0 (NVIDIA H200) and this GPU is 10.0", "on this machine"]
    elif case == "auto with the plugin":
        words = ["--block-size auto", "DFlashAccept plugin, built for blocks of 8 tokens", "without --plugin-library"]
    refused(lambda: TensorRTExecutor.from_engine(root, cfg, 0, None, plugin_library=plugin,
                                                 auto=case == "auto with the plugin"), *words)


class FakePlan:
    """What _check_plan reads of a tensorrt.ICudaEngine."""

    def __init__(self, length: int, aliases: dict[str, str | None], dtypes: dict[str, str] | None = None):
        self.length, self.aliases = length, aliases
        self.names = ["token_ids", *(p.replace("present_", "past_") for p in aliases), "logits", *aliases]
        self.num_io_tensors = len(self.names)
        self.dtypes = dtypes or {}

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return "OUTPUT" if name in self.aliases or name == "logits" else "INPUT"

    def get_tensor_shape(self, name):
        return (-1, 2, self.length, 16)

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name)

    def get_tensor_dtype(self, name):
        return types.SimpleNamespace(name=self.dtypes.get(name, "INT64" if name == "token_ids" else "FLOAT"))


def test_plans_must_update_caches_in_place():
    trt = types.SimpleNamespace(TensorIOMode=types.SimpleNamespace(OUTPUT="OUTPUT"))
    good = {"present_key_0": "past_key_0", "present_value_0": "past_value_0"}
    _check_plan(trt, FakePlan(520, good), Path("p.engine"), 520)
    with pytest.raises(RuntimeError, match="present_value_0 is not aliased to input past_value_0"):
        _check_plan(trt, FakePlan(520, {**good, "present_value_0": None}), Path("p.engine"), 520)
    with pytest.raises(RuntimeError, match="past_key_0 has 512 positions, not the 520"):
        _check_plan(trt, FakePlan(512, good), Path("p.engine"), 520)
    # a sliding-window layer's caches are rings of their own length, and only those caches
    _check_plan(trt, FakePlan(20, good), Path("p.engine"), 520, rings={"past_key_0": 20, "past_value_0": 20})
    with pytest.raises(RuntimeError, match="past_value_0 has 20 positions, not the 520"):
        _check_plan(trt, FakePlan(20, good), Path("p.engine"), 520, rings={"past_key_0": 20})


def test_a_plan_whose_tensors_have_other_dtypes_is_refused_in_one_sentence():
    trt = types.SimpleNamespace(TensorIOMode=types.SimpleNamespace(OUTPUT="OUTPUT"))
    good = {"present_key_0": "past_key_0", "present_value_0": "past_value_0"}
    bound = {"token_ids": torch.int64, "logits": torch.float32,
             **{n: torch.float32 for n in ("past_key_0", "past_value_0", "present_key_0", "present_value_0")}}
    _check_plan(trt, FakePlan(520, good), Path("p.engine"), 520, bound, Path("eng"))
    for plan, words in [
        (FakePlan(520, good, {"past_value_0": "HALF", "present_value_0": "HALF"}),
         ["p.engine: past_value_0 is HALF in this plan and --backend tensorrt binds it as float32",
          "run `trtllm-dflash compile eng` again"]),
        (FakePlan(520, good, {"token_ids": "INT32"}), ["token_ids is INT32 in this plan", "binds it as int64"]),
        (FakePlan(520, good), ["this plan has no tensor hidden"]),
    ]:
        expected = {**bound, "hidden": torch.float32} if "hidden" in words[0] else bound
        refused(lambda: _check_plan(trt, plan, Path("p.engine"), 520, expected, Path("eng")), *words)


@pytest.mark.slow
def test_bound_dtypes_are_the_graphs_own(ort_engine):
    """What the executor binds, by name and dtype, is exactly each ONNX graph's inputs and outputs (the plans are
    built from them, strongly typed), for the plain-op acceptance graph (int64) and the plugin's (int32)."""
    import onnx

    cfg = read_engine_config(ort_engine)
    onnx_types = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.INT64: torch.int64,
                  onnx.TensorProto.INT32: torch.int32}
    for plan, source, plugin in [*((g, g, False) for g in GRAPHS), (ACCEPT, ACCEPT, False), (ACCEPT, ACCEPT_PLUGIN, True)]:
        graph = onnx.load(str(graph_dir(ort_engine, 0) / f"{source}.onnx"), load_external_data=False).graph
        io = {v.name: onnx_types[v.type.tensor_type.elem_type] for v in (*graph.input, *graph.output)}
        assert bound_dtypes(cfg, plan, plugin) == io, source


def test_the_communicator_is_a_capsule_that_a_void_pointer_binding_takes(tmp_path):
    """TensorRT binds IExecutionContext::setCommunicator(void*) with pybind11 (python/src/infer/pyCore.cpp), which
    refuses an int: the same binding compiled here takes the capsule and receives the very address."""
    import sysconfig

    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    source = tmp_path / "ctx.cpp"
    source.write_text("""
#include <pybind11/pybind11.h>
#include <cstdint>
struct Context {
    void* communicator = nullptr;
    bool setCommunicator(void* c) noexcept { communicator = c; return c != nullptr; }
};
PYBIND11_MODULE(trt_like, m) {
    pybind11::class_<Context>(m, "Context").def(pybind11::init<>())
        .def("set_communicator", &Context::setCommunicator, pybind11::arg("communicator"))
        .def_property_readonly("address", [](Context const& c) { return reinterpret_cast<std::uintptr_t>(c.communicator); });
}
""")
    include = Path(torch.__file__).parent / "include"  # torch ships pybind11's headers
    module = tmp_path / f"trt_like{sysconfig.get_config_var('EXT_SUFFIX')}"
    import subprocess

    subprocess.run(["g++", "-O0", "-shared", "-fPIC", "-std=c++17", f"-I{sysconfig.get_paths()['include']}",
                    f"-I{include}", str(source), "-o", str(module)], check=True, capture_output=True, timeout=300)
    sys.path.insert(0, str(tmp_path))
    try:
        import trt_like
    finally:
        sys.path.remove(str(tmp_path))
    context, address = trt_like.Context(), 0x7F3A_2B10_0400
    with pytest.raises(TypeError, match="incompatible function arguments"):
        context.set_communicator(address)  # what the executor did before
    assert context.set_communicator(pointer_capsule(address)) and context.address == address
    with pytest.raises(ValueError):
        pointer_capsule(0)


def test_the_communicator_address_waits_for_nccls_first_collective():
    """ProcessGroupNCCL._comm_ptr is 0 until NCCL has started the communicator (at the group's first collective)."""
    state = {"started": False, "collectives": 0}

    def start():
        state["collectives"] += 1
        state["started"] = True

    assert communicator_address(lambda: 0xABC0 if state["started"] else 0, start) == 0xABC0
    assert state["collectives"] == 1
    assert communicator_address(lambda: 0xABC0, start) == 0xABC0 and state["collectives"] == 1  # started already
    refused(lambda: communicator_address(lambda: 0, lambda: None), "no communicator on this GPU",
            "ProcessGroupNCCL._comm_ptr is 0")


class FakeRegistry:
    """TensorRT's plugin registry as NvInferRuntimeCommon.h describes loadLibrary: one per process, and a library
    whose plugins are registered already fails (nullptr, None in Python)."""

    def __init__(self):
        self.registered: set[str] = set()
        self.calls = 0

    def load_library(self, path):
        self.calls += 1
        if path in self.registered:
            return None
        self.registered.add(path)
        return object()


def test_the_plugin_library_is_loaded_once_per_process(tmp_path, monkeypatch):
    registry = FakeRegistry()
    trt = types.SimpleNamespace(__name__="tensorrt_under_test", get_plugin_registry=lambda: registry)
    monkeypatch.setattr(tensorrt_build, "_PLUGIN_LIBRARIES", {})
    library = tmp_path / "libtrtllm_dflash_plugins.so"
    library.write_bytes(b"")
    for _ in range(4):  # compile's four plans, then an executor in the same process
        load_plugin_library(trt, library)
    load_plugin_library(trt, tmp_path / "." / library.name)  # the same library by another path
    assert registry.calls == 1
    other = tmp_path / "copy" / library.name
    other.parent.mkdir()
    other.write_bytes(b"")
    registry.registered.add(str(other.resolve()))  # its plugins are registered already (another library did)
    refused(lambda: load_plugin_library(trt, other), "TensorRT could not load this plugin library")


# --------------------------------------------------------------------------------------------------------
# Shapes and names
# --------------------------------------------------------------------------------------------------------


def test_profile_and_cache_length(qwen3_engine_dir):
    cfg = read_engine_config(qwen3_engine_dir)  # max_batch_size 8, max_seq_len 512, block 8
    shapes = engine_shapes(cfg)
    assert shapes["batch"] == DimRange(1, 8, 8)
    assert shapes["seq"] == shapes["ctx"] == DimRange(1, 8, 256)  # a prefill runs in passes of 256 positions
    assert pass_tokens(cfg.model_copy(update={"max_seq_len": 100})) == 100
    assert shapes["block"] == DimRange(2, 8, 8)
    length = shapes["max_len"].max
    assert shapes["max_len"] == DimRange.fixed(length) and length == cache_length(cfg) >= 512 + 8
    for spec in engine_specs(cfg)[:2]:  # every cache row starts on TensorRT's 256-byte alignment
        assert spec.num_kv_heads * length * spec.head_dim * 4 % 256 == 0
    odd = cfg.model_copy(update={"max_seq_len": 501})  # 509 positions of 128 bytes: rounded up to 510
    assert cache_length(odd) == 510
    with pytest.raises(ValueError):
        DimRange(2, 1, 4)


def test_graph_names_are_the_exports():
    pytest.importorskip("onnxscript")
    from trtllm_dflash.compile.onnx_export import DRAFTER_CONTEXT, DRAFTER_DRAFT, TARGET_STEP

    assert GRAPHS == (TARGET_STEP, DRAFTER_CONTEXT, DRAFTER_DRAFT)


# --------------------------------------------------------------------------------------------------------
# The executor's bindings, run by onnxruntime in place of TensorRT
# --------------------------------------------------------------------------------------------------------


def requests(vocab: int) -> list[Request]:
    """7 requests for 4 slots (so some join mid-run and rows move), greedy and sampled (with top-p, top-k)."""
    g = torch.Generator().manual_seed(0)
    return [Request(id=i, prompt_token_ids=torch.randint(4, vocab, (int(torch.randint(3, 20, (1,), generator=g)),),
                                                         generator=g).tolist(),
                    max_new_tokens=6 + 3 * i, temperature=0.0 if i % 2 == 0 else 0.8, seed=1000 + i,
                    top_p=0.9 if i % 4 == 1 else 1.0, top_k=5 if i % 4 == 3 else 0)
            for i in range(7)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_bindings_give_the_torch_executors_tokens(ort_engine, mode):
    executor = standin_executor(ort_engine)
    cfg = read_engine_config(ort_engine)
    reference = Engine.load(ort_engine, backend="torch")
    reqs = requests(executor.vocab_size)
    expected = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                for r in reference.decoder(mode).generate(reqs)}
    got = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
           for r in Decoder.for_mode(executor, mode, cfg.eos_token_ids).generate(reqs)}
    assert got == expected
    assert executor._rows.in_use == 0  # every request released its row


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_cuda_graph_calls_bind_once_and_give_the_same_tokens(ort_engine, mode):
    """--cuda-graphs on the tensorrt executor (runtime/plan_graphs.py), its contexts stood in for by onnxruntime: every
    decode-step plan call runs on a context of its own bound once over static buffers (what a captured graph replays:
    no shape or address set after its first run), the calls repeat (replays), and the tokens and acceptance lengths
    are the torch executor's (greedy and sampled, requests joining mid-run, rows moving)."""
    made: list = []
    executor = standin_executor(ort_engine, cuda_graphs=True, made=made)
    cfg = read_engine_config(ort_engine)
    reqs = requests(executor.vocab_size)
    expected = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
                for r in Engine.load(ort_engine, backend="torch").decoder(mode).generate(reqs)}
    got = {r.request.id: (r.output_token_ids, r.acceptance_lengths)
           for r in Decoder.for_mode(executor, mode, cfg.eos_token_ids).generate(reqs)}
    assert got == expected
    graphed = {"target_step", *(("drafter_draft", "accept") if mode == "dflash" else ())}
    assert {plan for plan, _ in made} == graphed
    assert all(context.rebinds == 0 for _, context in made)
    replays = sum(context.calls for _, context in made) - len(made)
    assert replays > len(made)  # most calls replay a key made before
    own = executor._contexts
    assert own["drafter_draft"].calls == own["accept"].calls == 0  # only graphed calls run these plans
    assert own["target_step"].calls > 0  # prompts run eagerly on the plan's own context
    # attended lengths in the graphs' coarse buckets (cuda_graphs.length_bucket): 64 keys at most here
    assert {key.tensors[2][1] for key in executor._graphs.calls if key.plan == "target_step"} == {(64,)}


@pytest.mark.slow
def test_bench_step_costs_prefill_a_context_longer_than_a_plan_pass(ort_engine):
    """bench's speedup bound (runtime/compare.py step_costs) at a mean context of 300 positions, more than a plan's
    pass of 256: its prefill reads the last position's logits, as a request's does, so it runs in passes (asking for
    every position's, it was refused; so was the cost profile's prefill of --block-size auto, test below)."""
    from trtllm_dflash.runtime.compare import step_costs

    executor = standin_executor(ort_engine)
    costs = step_costs(executor, context_len=300, context_rows=2, repeats=2)
    assert min(costs.draft_s, costs.verify_s, costs.ar_s) > 0


@pytest.mark.slow
def test_block_size_auto_measures_and_decodes_on_the_tensorrt_executor(ort_engine, tmp_path, monkeypatch):
    """--block-size auto on the tensorrt executor (plans whose accept step is plain ops take every verify length), as
    Engine.load sets it up: its pass costs measured through the executor's plans (stand-ins here, CUDA graphs on),
    then a decoder choosing k each step gives the torch executor's plain-decoding tokens, greedy and sampled."""
    from trtllm_dflash.runtime.costs import load_or_measure
    from trtllm_dflash.runtime.verify import AutoBlock
    from trtllm_dflash.speculative.schedule import AcceptanceEstimate, AutoBlockSize

    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(tmp_path))
    executor = standin_executor(ort_engine, cuda_graphs=True)
    costs, path = load_or_measure(ort_engine, executor, "tensorrt")
    assert path.is_file() and costs.tokens[-1] == executor.block_size
    # What auto chooses from this machine's timings varies with its load; every pass priced as one token's, and the
    # draft as free, makes it speculate, so that the decoding below verifies blocks of several lengths (the measured
    # path is the one above; a measured draft pass under load once priced every k > 1 out: CI at eab1ef7).
    def flat(table):
        return tuple(tuple(row[0] for _ in row) for row in table)

    priced = dataclasses.replace(costs, target_s=tuple(flat(at) for at in costs.target_s),
                                 draft_s=tuple(tuple(tuple(0.0 for _ in row) for row in at) for at in costs.draft_s),
                                 context_s=flat(costs.context_s), accept_s=flat(costs.accept_s))
    auto = AutoBlockSize(priced, executor.block_size, AcceptanceEstimate(executor.block_size - 1, prior_rate=0.9))
    reqs = requests(executor.vocab_size)
    expected = {r.request.id: r.output_token_ids
                for r in Engine.load(ort_engine, backend="torch").decoder("ar").generate(reqs)}
    results = list(Decoder(executor, AutoBlock(auto), read_engine_config(ort_engine).eos_token_ids).generate(reqs))
    assert {r.request.id: r.output_token_ids for r in results} == expected
    assert any(length > 1 for r in results for length in r.acceptance_lengths)  # speculative steps ran
    assert len({k for k in executor._graphs.calls if k.plan == "target_step"}) > 1  # verify passes of several keys


# --------------------------------------------------------------------------------------------------------
# TensorRT-RTX: parse and build the engine's graphs on the CPU
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rtx():
    return pytest.importorskip("tensorrt_rtx_bindings", reason=RTX_INSTALL)


@pytest.mark.slow
def test_tensorrt_rtx_parses_into_native_layers(rtx, ort_engine):
    cfg = read_engine_config(ort_engine)
    target, drafter, _ = engine_specs(cfg)
    L, D = target.num_layers, drafter.num_layers
    expected = {  # layer type -> count; attention is a pair of boundary layers per IAttention
        "target_step": {"ATTENTION_OUTPUT": L, "KV_CACHE_UPDATE": 2 * L, "ROTARY_EMBEDDING": 2 * L},
        "drafter_context": {"ATTENTION_OUTPUT": 0, "KV_CACHE_UPDATE": 2 * D, "ROTARY_EMBEDDING": D},
        "drafter_draft": {"ATTENTION_OUTPUT": D, "KV_CACHE_UPDATE": 2 * D, "ROTARY_EMBEDDING": 2 * D, "TOPK": 1},
    }
    length = cache_length(cfg)
    for g in GRAPHS:
        parsed = parse_graph(rtx, graph_dir(ort_engine, 0) / f"{g}.onnx", static_dims={"max_len": length})
        types_ = layer_types(parsed.network)
        assert {k: types_[k] for k in expected[g]} == expected[g], (g, types_)
        assert types_["ATTENTION_INPUT"] == types_["ATTENTION_OUTPUT"]
        assert mark_attention_decomposable(rtx, parsed.network) == types_["ATTENTION_OUTPUT"]
        outputs = [parsed.network.get_output(i).name for i in range(parsed.network.num_outputs)]
        presents = [n for n in outputs if n.startswith("present_")]
        assert cache_updates(parsed.network) == {n: n.replace("present_", "past_") for n in presents}
        assert len(presents) == 2 * (L if g == "target_step" else D)


@pytest.mark.slow
def test_tensorrt_rtx_builds_plans_for_sm89_and_sm120(rtx, ort_engine):
    cfg = read_engine_config(ort_engine)
    for g in GRAPHS:
        plan = build_plan(rtx, graph_dir(ort_engine, 0) / f"{g}.onnx", dtype_note=cfg.dtype,
                          shapes=engine_shapes(cfg), targets=["SM89", "SM120"])
        assert len(plan) > 100_000, g
    with pytest.raises(ValueError, match="SM90"):  # not a TensorRT-RTX target
        build_plan(rtx, graph_dir(ort_engine, 0) / "drafter_context.onnx", dtype_note=cfg.dtype,
                   shapes=engine_shapes(cfg), targets=["SM90"])


@pytest.mark.slow
def test_tensorrt_rtx_parses_and_builds_the_tree_graphs(rtx, ort_engine):
    """target_tree (the ancestor mask an input of IAttention) and drafter_candidates parse into the same native layers
    as the chain's graphs and build plans: TensorRT takes the trees' graphs (its executor does not run them yet)."""
    cfg = read_engine_config(ort_engine)
    target, drafter, _ = engine_specs(cfg)
    L, D = target.num_layers, drafter.num_layers
    expected = {"target_tree": {"ATTENTION_OUTPUT": L, "KV_CACHE_UPDATE": 2 * L, "ROTARY_EMBEDDING": 2 * L},
                "drafter_candidates": {"ATTENTION_OUTPUT": D, "KV_CACHE_UPDATE": 2 * D, "ROTARY_EMBEDDING": 2 * D,
                                       "TOPK": 1}}
    for g, counts in expected.items():
        parsed = parse_graph(rtx, graph_dir(ort_engine, 0) / f"{g}.onnx", static_dims={"max_len": cache_length(cfg)})
        types_ = layer_types(parsed.network)
        assert {k: types_[k] for k in counts} == counts, (g, types_)
        plan = build_plan(rtx, graph_dir(ort_engine, 0) / f"{g}.onnx", dtype_note=cfg.dtype,
                          shapes=engine_shapes(cfg), targets=["SM120"])
        assert len(plan) > 100_000, g


def test_tensorrt_rtx_parser_errors_are_in_the_exception(rtx, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="nowhere")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("nowhere", 1)])
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(PlanBuildError, match=r"bad.onnx: TensorRT's ONNX parser refused the graph: .*NoSuchOp"):
        build_plan(rtx, tmp_path / "bad.onnx", dtype_note="float32", shapes={})


def test_one_tensorrt_logger_per_process_and_each_builds_own_errors(rtx, tmp_path):
    """Every builder gets the process's one logger (TensorRT documents it as a singleton), and a failed build reports
    its own errors, not those of the builds before it."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 10000])
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)
    outputs = [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", 5000]),
               helper.make_tensor_value_info("i", TensorProto.INT64, ["batch", 5000])]
    k = helper.make_tensor("k", TensorProto.INT64, [1], [5000])  # TensorRT's TopK stops at K = 3840
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], outputs, [k]),
                                opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "topk.onnx")
    messages = []
    for _ in range(2):
        with pytest.raises(PlanBuildError) as info:
            build_plan(rtx, tmp_path / "topk.onnx", dtype_note="float32", shapes={"batch": DimRange(1, 2, 4)},
                       targets=["SM89"])
        messages.append(str(info.value))
        assert parse_graph(rtx, tmp_path / "topk.onnx").logger is process_logger(rtx)
    assert messages[0] == messages[1] and messages[0].count("K exceeds the maximum value allowed (3840)") == 1
