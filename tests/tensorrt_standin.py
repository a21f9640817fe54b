"""The TensorRT executor on the CPU: onnxruntime sessions of an engine's ONNX graphs stand in for TensorRT's execution
contexts (the plans are built from these very graphs), over exactly the memory the executor binds.

Like a TensorRT context, a stand-in refuses an input shape outside the optimization profile that `compile` gives the
plans (compile/tensorrt_build.engine_shapes), so a call the real plans could not take fails here too."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import numpy as np

from trtllm_dflash.compile.tensorrt_build import (
    STATE_OUTPUTS,
    TRT_MOE,
    _with_static_dims,
    cache_length,
    engine_plans,
    graph_metadata,
    plan_shapes,
)
from trtllm_dflash.engine_dir import EXPERTS_OP_KEY, graph_dir, read_engine_config
from trtllm_dflash.runtime.executor import engine_specs
from trtllm_dflash.runtime.tensorrt_executor import TensorRTExecutor


class OnnxRuntimeContext:
    """Stands in for a TensorRT execution context: keeps the shapes and addresses the executor sets and, on
    execute, runs the same ONNX graph in onnxruntime over exactly that memory (cpu tensors)."""

    NUMPY = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(int32)": "int32"}

    def __init__(self, session, output_shape, profile: dict | None = None):
        """`output_shape(name, input shapes) -> shape`; `profile`: dimension name -> DimRange (None: any shape)."""
        self.session, self.output_shape, self.profile = session, output_shape, profile
        self.dims = {i.name: i.shape for i in session.get_inputs()}  # ["batch", "seq"], [.., 64]
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.calls = 0
        self.rebinds = 0  # shapes and addresses set after the first execute (a captured CUDA graph could not see them)

    def set_input_shape(self, name, shape):
        if self.profile is not None:
            for dim, size in zip(self.dims[name], shape):
                r = self.profile.get(dim) if isinstance(dim, str) else None
                if r is not None and not r.min <= size <= r.max:
                    return False  # TensorRT: "... is out of the profile's range"
        self.rebinds += self.calls > 0
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, memory):
        self.rebinds += self.calls > 0
        self.addresses[name] = memory
        return True

    def execute_async_v3(self, stream_handle):
        assert stream_handle == 0
        binding = self.session.io_binding()
        for i in self.session.get_inputs():
            binding.bind_input(i.name, "cpu", 0, np.dtype(self.NUMPY[i.type]), self.shapes[i.name],
                               self.addresses[i.name])
        for o in self.session.get_outputs():
            if o.name.startswith(STATE_OUTPUTS):  # a Gated DeltaNet layer's state: a buffer of its own
                past = o.name.replace("present_", "past_", 1)
                assert self.addresses[o.name] != self.addresses.get(past), "TensorRT aliases only KV-cache updates"
                shape = (self.shapes["kept"][0], *o.shape[1:])  # (the graph's own sizes but the batch)
            elif o.name.startswith("present_"):
                past = o.name.replace("present_", "past_", 1)
                assert self.addresses[o.name] == self.addresses[past], "a cache must be updated in place"
                shape = self.shapes[past]
            else:
                shape = self.output_shape(o.name, self.shapes)
            binding.bind_output(o.name, "cpu", 0, np.dtype(self.NUMPY[o.type]), shape, self.addresses[o.name])
        self.session.run_with_iobinding(binding)
        self.calls += 1
        return True


def as_compiled(path: Path) -> Path:
    """`path`, or where its experts are TensorRT's TRT_MoE nodes (which onnxruntime cannot run), the graph as compile
    builds it on a GPU other than Blackwell (the nodes rewritten into the dense form, onnx_ops.dense_experts), written
    into a temporary directory beside copies of the graph directory's other files (its external data: onnxruntime
    refuses a link that leads out of the model's directory)."""
    if graph_metadata(path).get(EXPERTS_OP_KEY) != TRT_MOE:
        return path
    out = Path(tempfile.mkdtemp(prefix="dense_experts_"))
    atexit.register(shutil.rmtree, out, True)
    for other in path.parent.iterdir():
        if other != path:
            shutil.copyfile(other, out / other.name)
    (out / path.name).write_bytes(_with_static_dims(path, {}, dense=True))
    return out / path.name


def standin_executor(engine: Path, profile: bool = True, block_size: int | None = None,
                     pass_tokens: int | None = None, prefix_cache: bool = True, cuda_graphs: bool = False,
                     made: list | None = None) -> TensorRTExecutor:
    """A TensorRTExecutor of `engine` (rank 0, built with backend onnxruntime, or tensorrt where its sliding-window
    layers' rings must be written as TensorRT can) whose contexts are OnnxRuntimeContexts,
    holding the profile `compile` would give its plans (and taking passes of its length, or of `pass_tokens`), unless
    `profile` is False. `cuda_graphs`: the executor's decode-step calls over static buffers, each on a context of its
    own (runtime/plan_graphs.py: a CPU runs them where a GPU replays graphs); `made` gets (plan, context) for each
    context made for them."""
    import onnxruntime as ort

    cfg = read_engine_config(engine)
    target, _, params = engine_specs(cfg)
    features = len(params.target_layer_ids) * target.hidden_size

    def output_shape(name, shapes):
        if "draft_tokens" in shapes:  # the acceptance step
            b, k = shapes["draft_tokens"]
            return {"accepted": (b,), "new_context_lengths": (b,)}.get(name, (b, k + 1))
        b, t = shapes.get("token_ids", shapes.get("block_ids"))
        return {"logits": (b, t, target.vocab_size), "hidden": (b, t, features), "draft_tokens": (b, t - 1)}[name]

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    compiled = plan_shapes(cfg, engine)  # (rings as TensorRT writes them, or none)
    rings = compiled.get("ring")
    shapes = compiled if profile else None
    sessions = {g: ort.InferenceSession(str(as_compiled(graph_dir(engine, 0) / f"{g}.onnx")), options,
                                        providers=["CPUExecutionProvider"]) for g in engine_plans(cfg, engine)}

    def new_context(plan: str) -> OnnxRuntimeContext:
        context = OnnxRuntimeContext(sessions[plan], output_shape, shapes)
        if made is not None:
            made.append((plan, context))
        return context

    return TensorRTExecutor({g: OnnxRuntimeContext(s, output_shape, shapes) for g, s in sessions.items()}, cfg,
                            block_size, "cpu", cache_length(cfg),
                            pass_tokens=pass_tokens or (compiled["seq"].max if profile or rings else None),
                            prefix_cache=prefix_cache, new_context=new_context, cuda_graphs=cuda_graphs,
                            window_ring=rings.max if rings is not None else None)
