"""TensorRT plans of an engine's ONNX graphs: `trtllm-dflash compile ENGINE_DIR`.

`build_plan` turns one graph of compile/onnx_export.py into a serialized TensorRT plan: TensorRT's ONNX parser
maps Attention / RotaryEmbedding / TensorScatter onto its native attention, rotary and KV-cache-update layers
(docs/backends.md §Facts found), the network is strongly typed (its precision is the graph's own), one
optimization profile covers every dynamic dimension. It takes the module as an argument, so the same code
builds with real TensorRT (`import tensorrt`, 10.15+ / 11, on the GPU that will run the plan) and with
TensorRT-RTX (`import tensorrt_rtx_bindings`, ahead of time on a CPU for chosen compute capabilities: the tests).

`compile_engine` builds every rank's graphs on this machine's GPU and adds them to the engine:

    ENGINE_DIR/
      tensorrt/plans.json                  what the plans were built with and for (checked before loading)
      tensorrt/rank{r}/target_step.engine  one plan per graph of onnx/rank{r}/
      tensorrt/rank{r}/drafter_context.engine
      tensorrt/rank{r}/drafter_draft.engine
      tensorrt/rank{r}/accept.engine       the acceptance step: accept_plugin.onnx (our DFlashAccept plugin) with
                                           --plugin-library, else accept.onnx (plain ONNX ops)
      tensorrt/rank{r}/target_replay.engine  Qwen3.5 targets: the Gated DeltaNet states' rollback (a TensorRT loop)
      manifest.json                        rewritten: lists the plans too

Atomicity: the plans are built into a temporary sibling directory that holds hard links to the engine's files
(outputs.atomic_directory), the manifest is rewritten there, and the directory is renamed over the engine.
A crash while building (minutes) leaves the engine as it was and a `.ENGINE.building-PID` directory that the
next build or compile removes. The one unsafe instant is atomic_directory's swap (two renames, microseconds):
a crash between them leaves no ENGINE_DIR, and the complete old engine in `.ENGINE.replaced-PID`.

Graph-specific choices (found with TensorRT-RTX 1.7.1, see tests/test_tensorrt_build.py):
- The caches' `max_len` is made static before parsing (the parser refuses a KV-cache update whose cache has a
  dynamic sequence length), so a plan serves one cache length: `cache_length(cfg)`.
- Every attention layer is marked decomposable: TensorRT may then fall back to several kernels where no fused
  kernel exists (fp32 with more than one query row: "Attention operation was not supported by a dedicated
  kernel"); where one exists it is still used (fp16 / bf16 plans come out the same size either way).
- Experts exported as TensorRT's TRT_MoE node (metadata `experts_op`) become IMoELayer layers on SM 10.x / 11.x only,
  where that layer builds (NvInfer.h); on any other GPU each node is rewritten into the dense form before parsing
  (onnx_ops.dense_experts). compile says which and records it in plans.json (`experts`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from trtllm_dflash.engine_dir import (
    EXPERTS_OP_KEY,
    ONE_TOKEN_ADVANCES_KEY,
    RING_PASS_KEY,
    RING_WRITE_KEY,
    EngineConfig,
    check_graph_inputs,
    graph_dir,
    open_engine,
    write_manifest,
)
from trtllm_dflash.errors import UserError
from trtllm_dflash.outputs import atomic_directory

# The graphs compile/onnx_export.py writes (its TARGET_STEP, DRAFTER_CONTEXT, DRAFTER_DRAFT; not imported, so
# that this module loads without the onnx extra and a missing one is a UserError).
GRAPHS = ("target_step", "drafter_context", "drafter_draft")
# The acceptance step's plan: from accept_plugin.onnx (one DFlashAccept node: plugins/dflash/) when compile is
# given the plugin library, else from accept.onnx (the same step in plain ONNX ops).
ACCEPT, ACCEPT_PLUGIN = "accept", "accept_plugin"
PLANS = (*GRAPHS, ACCEPT)
# A target with Gated DeltaNet layers (Qwen3.5) has one more: the replay that resumes their states (onnx_export.py's
# TARGET_REPLAY). Those states are outputs of their own buffers (TensorRT aliases an output with an input only in a
# KV-cache update): the executor copies them back into its state rows after the plan ran.
REPLAY = "target_replay"
# ... and, where its engine was built for tensorrt, a one-token pass without TensorRT loops (onnx_export.py's
# TARGET_TOKEN; plain steps run it in place of target_step, whose recurrence is a loop per layer).
TOKEN = "target_token"
STATE_OUTPUTS = ("present_conv_", "present_state_", "present_delta_")
COLLECTIVE_OP = "DistCollective"  # compile/onnx_ops.py's tensor-parallel collectives
PLANS_DIR, PLANS_INFO = "tensorrt", "plans.json"
MIN_TENSORRT = (10, 15)  # RotaryEmbedding and TensorScatter in the ONNX parser
_ALIGN = 256  # TensorRT's alignment for tensor addresses: each cache row must start on it
# Positions per row of one prefill pass (pass_tokens): Qwen3-8B's fp32 logits of a pass at batch 8 are then 1.2 GB,
# where a 4k-token prompt in one pass needed 20 GB of logits and the plans' scratch for max_seq_len as many again.
PASS_TOKENS = 256
# The keys dimension's optimum (key_positions: the attended length): TensorRT tunes its attention kernels for it.
KEYS_OPT = 1024

_log = logging.getLogger(__name__)


class PlanBuildError(RuntimeError):
    """TensorRT refused a graph (parser or builder); the message holds TensorRT's own errors."""


@dataclass(frozen=True)
class DimRange:
    """One optimization-profile range of an ONNX dimension (0 only for a fixed one: a latent attention layer's V)."""

    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not (0 <= self.min <= self.opt <= self.max and (self.min >= 1 or self.min == self.max)):
            raise ValueError(f"a dimension range needs 1 <= min <= opt <= max (or min = max = 0), not {self}")

    @classmethod
    def fixed(cls, n: int) -> "DimRange":
        return cls(n, n, n)


def plan_dir(root: Path, rank: int) -> Path:
    """Where rank `rank`'s plans live (next to graph_dir's ONNX graphs)."""
    return Path(root) / PLANS_DIR / f"rank{rank}"


def plan_file(root: Path, rank: int, graph: str) -> Path:
    return plan_dir(root, rank) / f"{graph}.engine"


def _rounded(cfg: EngineConfig, positions: int) -> int:
    """`positions` rounded up so that every row of every cache of that many positions starts on a 256-byte
    boundary."""
    from trtllm_dflash.runtime.executor import engine_specs

    target, drafter, _ = engine_specs(cfg)
    element = {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.dtype]
    step = 1
    for spec in (target, drafter):
        position_bytes = spec.num_kv_heads * spec.head_dim * element
        step = math.lcm(step, _ALIGN // math.gcd(_ALIGN, position_bytes))
    return -(-positions // step) * step


def cache_length(cfg: EngineConfig) -> int:
    """Positions per cache row: max_seq_len + block_size (a verify writes a block past the last committed
    position), rounded up so that every row of every cache starts on a 256-byte boundary."""
    from trtllm_dflash.runtime.executor import engine_specs

    return _rounded(cfg, cfg.max_seq_len + engine_specs(cfg)[2].block_size)


def ring_length(cfg: EngineConfig, ring_pass: int) -> int:
    """Positions per row of a sliding-window layer's ring (graphs exported with rings, RING_PASS_KEY): the window plus
    the most positions a pass writes (`ring_pass`), rounded as cache_length; an engine shorter than that keeps
    cache_length positions (its writes never wrap)."""
    from trtllm_dflash.runtime.executor import engine_specs

    return min(_rounded(cfg, engine_specs(cfg)[0].sliding_window + ring_pass), cache_length(cfg))


def graph_ring_pass(onnx_path: Path) -> int | None:
    """The most positions per row a pass of target_step `onnx_path` may write where its sliding-window layers keep
    rings written as TensorRT can (RING_WRITE_KEY "rewrite"); None: no rings. UserError for rings in TensorScatter's
    circular mode (graphs for onnxruntime), which TensorRT's KV-cache update cannot write."""
    metadata = graph_metadata(onnx_path)
    if not metadata.get(RING_PASS_KEY):
        return None
    if metadata.get(RING_WRITE_KEY) != "rewrite":
        raise UserError(f"{onnx_path}: its sliding-window layers keep rings written in TensorScatter's circular mode "
                        "(the engine was built with backend: onnxruntime), which TensorRT's KV-cache update cannot "
                        "write; rebuild the engine with backend: tensorrt.")
    return int(metadata[RING_PASS_KEY])


def pass_tokens(cfg: EngineConfig) -> int:
    """The most positions per row one target_step or drafter_context call takes: PASS_TOKENS (a verify block or the
    whole sequence if either is longer or shorter). The TensorRT executor cuts a longer prefill into passes of this
    many; each plan's scratch memory, and a pass's fp32 logits [B, T, V], are sized for it, not for max_seq_len."""
    block = cfg.dflash.block_size
    return max(block, min(cfg.max_seq_len, PASS_TOKENS))


TREE_NODES, TREE_CANDIDATES = 65, 8


def engine_plans(cfg: EngineConfig, root: Path | None = None) -> tuple[str, ...]:
    """The plans of this engine: PLANS, and target_replay for a target with Gated DeltaNet layers, and target_token
    where the engine directory `root` has that graph (engines built for tensorrt since 2026-12-05)."""
    from trtllm_dflash.runtime.executor import engine_specs

    if not engine_specs(cfg)[0].has_recurrent_state:
        return PLANS
    token = root is not None and (graph_dir(root, 0) / f"{TOKEN}.onnx").is_file()
    return PLANS + (REPLAY,) + ((TOKEN,) if token else ())


def plan_shapes(cfg: EngineConfig, root: Path) -> dict[str, DimRange]:
    """The profile compile gives the plans of engine directory `root` (engine_shapes, with its graphs' rings)."""
    return engine_shapes(cfg, graph_ring_pass(graph_dir(root, 0) / "target_step.onnx"))


def engine_shapes(cfg: EngineConfig, ring_pass: int | None = None) -> dict[str, DimRange]:
    """The profile of the graphs' named dimensions for this engine (one dict for all three graphs).

    seq (target_step) and ctx (drafter_context) reach pass_tokens: a prefill runs in passes of at most that many
    positions; their optimum is a verify block. block (drafter_draft) is 2 .. block_size; max_len is the fixed
    cache length. `ring_pass` (graph_ring_pass): the sliding-window layers' rings are `ring` positions (fixed), and
    a target pass writes at most that many positions."""
    block = cfg.dflash.block_size
    longest = pass_tokens(cfg)
    rings = {} if ring_pass is None else {"ring": DimRange.fixed(ring_length(cfg, ring_pass))}
    return {
        **rings,
        "batch": DimRange(1, cfg.max_batch_size, cfg.max_batch_size),
        "seq": DimRange(1, block, longest if ring_pass is None else min(longest, ring_pass)),
        "ctx": DimRange(1, block, longest),
        "block": DimRange(2, block, block),
        "max_len": DimRange.fixed(cache_length(cfg)),
        # keys attended (key_positions: target_step, drafter_draft): a bucket chosen by the executor, up to the cache
        "keys": DimRange(1, min(KEYS_OPT, cache_length(cfg)), cache_length(cfg)),
        # accept.onnx: K drafts of a run-time block of K + 1 tokens, over the whole vocabulary
        "drafts": DimRange(1, block - 1, block - 1),
        "drafts + 1": DimRange(2, block, block),
        "vocab": DimRange.fixed(int(cfg.target["vocab_size"])),
        # the draft trees' graphs (target_tree, drafter_candidates; engines built for onnxruntime export them): the
        # anchor and up to 64 nodes, and the candidates kept per position (TreeDrafting's 8)
        "nodes": DimRange(2, block, TREE_NODES),
        "candidates": DimRange(1, TREE_CANDIDATES, TREE_CANDIDATES),
        # target_replay (Gated DeltaNet targets): the tokens replayed, up to a verify block (the executor: all of it)
        "steps": DimRange(1, block, block),
    }


# ----------------------------------------------------------------------------------------------------------
# One graph -> one plan (either TensorRT module)
# ----------------------------------------------------------------------------------------------------------


_LOGGERS: dict[str, Any] = {}  # TensorRT module name -> the one logger of this process
_PLUGIN_LIBRARIES: dict[tuple[str, Path], Any] = {}  # (module name, library) -> the handle TensorRT returned


def process_logger(trt: ModuleType):
    """This process's one TensorRT logger (per TensorRT module): every builder and runtime gets it. TensorRT has long
    documented its logger as a singleton (a builder or runtime made with another one may still log to the first),
    so a logger per build could miss the errors of every build but the first. It keeps the errors logged since
    `start()` (for PlanBuildError) and passes warnings to logging at INFO: the parser warns about every int64 input."""
    logger = _LOGGERS.get(trt.__name__)
    if logger is not None:
        return logger

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def start(self) -> None:
            """Forget the errors of earlier builds."""
            self.errors = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
            elif severity == trt.ILogger.Severity.WARNING:
                _log.info("TensorRT: %s", msg)

    logger = _LOGGERS[trt.__name__] = Logger()
    return logger


def load_plugin_library(trt: ModuleType, library: Path) -> None:
    """Register a plugin library's creators in TensorRT's plugin registry, once per process: the registry is one per
    process, and TensorRT's loadLibrary fails (returns nullptr) when any of the library's plugins is registered
    already, so a second call for the same library (the next plan of `compile`, or an executor after it) would fail."""
    key = (trt.__name__, Path(library).resolve())
    if key in _PLUGIN_LIBRARIES:
        return
    handle = trt.get_plugin_registry().load_library(str(key[1]))
    if handle is None:
        raise UserError(f"{library}: TensorRT could not load this plugin library (another library that registers "
                        "the same plugins may be loaded in this process).")
    _PLUGIN_LIBRARIES[key] = handle


@dataclass
class ParsedGraph:
    """A parsed ONNX graph. The builder, parser and logger stay referenced: the network points into them."""

    builder: Any  # trt.Builder
    network: Any  # trt.INetworkDefinition
    parser: Any  # trt.OnnxParser (owns the weights the network refers to)
    logger: Any


def graph_metadata(onnx_path: Path) -> dict[str, str]:
    """The metadata compile/onnx_export.py writes into each graph."""
    import onnx

    return {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False).metadata_props}


def graph_placement(onnx_path: Path) -> tuple[int, int]:
    """(rank, tp_size) a graph was exported for."""
    meta = graph_metadata(onnx_path)
    try:
        return int(meta["rank"]), int(meta["tp_size"])
    except (KeyError, ValueError):
        raise UserError(f"{onnx_path}: the graph does not say which rank and tp_size it was exported for "
                        "(metadata 'rank' and 'tp_size'); rebuild the engine.") from None


def graph_inputs(onnx_path: Path) -> list[str]:
    """The names of a graph's inputs."""
    import onnx

    return [i.name for i in onnx.load(str(onnx_path), load_external_data=False).graph.input]


def set_collective_ranks(trt: ModuleType, network, onnx_path: Path) -> int:
    """Give every DistCollective layer its number of ranks, the group_size of the graph's DistCollective nodes
    (the ONNX parser leaves 1, which would size an all_gather's output for one rank); returns how many there are."""
    import onnx

    sizes = {attr.i for node in onnx.load(str(onnx_path), load_external_data=False).graph.node
             if node.op_type == COLLECTIVE_OP for attr in node.attribute if attr.name == "group_size"}
    if len(sizes) > 1:
        raise PlanBuildError(f"{onnx_path}: DistCollective nodes of several group sizes {sorted(sizes)}")
    ranks, count = next(iter(sizes), 1), 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.DIST_COLLECTIVE:
            layer.num_ranks = ranks
            count += 1
    return count


def _with_static_dims(onnx_path: Path, static: Mapping[str, int], dense: bool = True) -> bytes:
    """The graph (without its external data) with the named dimensions `static` made fixed sizes, and, with `dense`,
    its TRT_MoE nodes rewritten into the experts' dense form (onnx_ops.dense_experts: IMoELayer builds on Blackwell
    only)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    for info in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for dim in info.type.tensor_type.shape.dim:
            if dim.dim_param in static:
                dim.dim_value = static[dim.dim_param]  # dim_value and dim_param are a oneof: this clears the name
    if dense:
        from trtllm_dflash.compile.onnx_ops import dense_experts

        dense_experts(model)
    return model.SerializeToString()


def parse_graph(trt: ModuleType, onnx_path: Path, *, static_dims: Mapping[str, int] | None = None,
                plugin_library: Path | None = None, dense_experts: bool = True) -> ParsedGraph:
    """Parse `onnx_path` into a strongly typed network; `static_dims` fixes named dimensions first; `dense_experts`
    rewrites TRT_MoE nodes into the dense form (False: they become IMoELayer layers, which build on Blackwell only).

    The parser reads the graph from bytes but is given its path, so external data (weights.onnx.data) is
    found next to it, as parse_from_file would."""
    onnx_path = Path(onnx_path)
    logger = process_logger(trt)
    logger.start()
    builder = trt.Builder(logger)
    if plugin_library is not None:
        # TensorRT-RTX's parser aborts the process once a plugin creator is registered (docs/backends.md §Facts found)
        if _is_rtx(trt):
            raise ValueError("TensorRT-RTX takes no plugin libraries")
        load_plugin_library(trt, plugin_library)
    # Deprecated in TensorRT 11, where every network is strongly typed; required for that in 10.x.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(_with_static_dims(onnx_path, static_dims or {}, dense_experts), str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise PlanBuildError(f"{onnx_path}: TensorRT's ONNX parser refused the graph: {'; '.join(errors)}")
    return ParsedGraph(builder, network, parser, logger)


def layer_types(network) -> Counter[str]:
    """Layer type name -> count, e.g. {'ATTENTION_OUTPUT': 4, 'KV_CACHE_UPDATE': 8, ...}."""
    return Counter(network.get_layer(i).type.name for i in range(network.num_layers))


def mark_attention_decomposable(trt: ModuleType, network) -> int:
    """Allow every attention layer to fall back to unfused kernels; returns how many there are.

    The parser creates each IAttention as a pair of boundary layers; the output one reaches it."""
    count = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.ATTENTION_OUTPUT:
            layer.__class__ = trt.IAttentionOutputLayer  # get_layer returns the base class
            layer.attention.decomposable = True
            count += 1
    return count


def cache_updates(network) -> dict[str, str]:
    """present_* output -> past_* input, for outputs written in place by a KV-cache-update layer.

    The executors bind each such pair to one buffer, which is only right when TensorRT aliases them."""
    producer = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            producer[layer.get_output(j).name] = layer
    pairs = {}
    for i in range(network.num_outputs):
        name = network.get_output(i).name
        layer = producer.get(name)
        if layer is not None and layer.type.name == "KV_CACHE_UPDATE" and layer.get_input(0).is_network_input:
            pairs[name] = layer.get_input(0).name
    return pairs


def _check_in_place(network, onnx_path: Path) -> None:
    """Every present_* output but a recurrent state's (STATE_OUTPUTS: bound to buffers of their own) and a zero-wide
    one (a latent attention layer's V: its past_* passed through, no bytes to share) is the in-place KV-cache update
    of its past_* input."""
    pairs = cache_updates(network)
    for i in range(network.num_outputs):
        output = network.get_output(i)
        name = output.name
        if name.startswith("present_") and not name.startswith(STATE_OUTPUTS) and output.shape[-1] != 0 and \
                pairs.get(name) != name.replace("present_", "past_", 1):
            raise PlanBuildError(f"{onnx_path}: output {name} is not a KV-cache update of "
                                 f"{name.replace('present_', 'past_', 1)}, so it cannot share its memory")


def _profile(builder, network, shapes: Mapping[str, DimRange], onnx_path: Path):
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if all(d >= 0 for d in tensor.shape):
            continue
        ranges = []
        for axis, size in enumerate(tensor.shape):
            name = tensor.get_dimension_name(axis)
            if size >= 0:
                ranges.append(DimRange.fixed(size))
            elif name in shapes:
                ranges.append(shapes[name])
            else:
                raise ValueError(f"{onnx_path}: input {tensor.name} axis {axis} ({name or 'unnamed'}) is dynamic "
                                 "and `shapes` gives no range for it")
        profile.set_shape(tensor.name, [r.min for r in ranges], [r.opt for r in ranges], [r.max for r in ranges])
    return profile


def _is_rtx(trt: ModuleType) -> bool:
    return hasattr(trt, "ComputeCapability")  # TensorRT-RTX builds ahead of time for chosen GPUs


def _set_targets(trt: ModuleType, config, targets: Sequence[str]) -> None:
    if not _is_rtx(trt):
        raise ValueError("targets (compute capabilities) are for TensorRT-RTX; TensorRT builds for the GPU it runs on")
    known = [n for n in trt.ComputeCapability.__members__ if n.startswith("SM")]
    config.num_compute_capabilities = len(targets)
    for i, name in enumerate(targets):
        if name not in known:
            raise ValueError(f"compute capability {name!r}: TensorRT-RTX {trt.__version__} knows {', '.join(known)}")
        config.set_compute_capability(getattr(trt.ComputeCapability, name), i)


def build_plan(trt: ModuleType, onnx_path: Path, *, dtype_note: str, shapes: Mapping[str, DimRange],
               targets: Sequence[str] | None = None, plugin_library: Path | None = None,
               dense_experts: bool = True) -> bytes:
    """Parse, profile and build one graph; returns the serialized plan.

    `trt`: the `tensorrt` or `tensorrt_rtx_bindings` module. `dtype_note`: the engine's dtype, named in errors
    (the strongly typed network takes its precision from the graph). `shapes`: the range of each named
    dynamic dimension (engine_shapes); a range with min == max becomes a static size before parsing.
    `targets`: TensorRT-RTX compute capabilities ("SM89", "SM120", ...); real TensorRT builds for its GPU.
    `dense_experts`: TRT_MoE nodes in the dense form (True) or as IMoELayer (False: Blackwell GPUs only)."""
    onnx_path = Path(onnx_path)
    static = {name: r.min for name, r in shapes.items() if r.min == r.max}
    graph = parse_graph(trt, onnx_path, static_dims=static, plugin_library=plugin_library,
                        dense_experts=dense_experts)
    _check_in_place(graph.network, onnx_path)
    mark_attention_decomposable(trt, graph.network)
    set_collective_ranks(trt, graph.network, onnx_path)
    config = graph.builder.create_builder_config()
    config.add_optimization_profile(_profile(graph.builder, graph.network, shapes, onnx_path))
    if targets:
        _set_targets(trt, config, targets)
    plan = graph.builder.build_serialized_network(graph.network, config)
    if plan is None:
        raise PlanBuildError(f"{onnx_path}: TensorRT could not build a {dtype_note} plan: "
                             f"{'; '.join(graph.logger.errors) or 'no error was logged'}")
    return bytes(plan)


# ----------------------------------------------------------------------------------------------------------
# `trtllm-dflash compile ENGINE_DIR`
# ----------------------------------------------------------------------------------------------------------


def import_tensorrt(command: str) -> ModuleType:
    """The `tensorrt` module, 10.15 or newer, or a UserError that says how to get it."""
    try:
        import tensorrt
    except (ImportError, OSError) as exc:  # OSError: a wheel whose shared libraries are missing
        raise UserError(f"{command} needs TensorRT {'.'.join(map(str, MIN_TENSORRT))}+ on the GPU machine that will "
                        "run the engine: pip install tensorrt (TensorRT-RTX is not enough: it cannot target "
                        f"SM90/SM100 GPUs such as H100, H200 or B200) ({exc}).") from None
    version = getattr(tensorrt, "__version__", "0")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < MIN_TENSORRT:
        raise UserError(f"{command} needs TensorRT {'.'.join(map(str, MIN_TENSORRT))}+ (its ONNX parser reads "
                        f"RotaryEmbedding and TensorScatter); this is TensorRT {version}: pip install -U tensorrt.")
    return tensorrt


def require_gpu(command: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{command} needs a CUDA GPU and none is visible to torch (no GPU or driver, "
                        "CUDA_VISIBLE_DEVICES, or a CPU-only torch build).")


def _require_onnx(command: str) -> None:
    try:
        import onnx  # noqa: F401 - build_plan fixes the cache length in the graph before parsing
    except ImportError:
        raise UserError(f"{command} needs the onnx package: pip install 'trtllm-dflash[onnx]'.") from None


def plan_source(root: Path, rank: int, plan: str, plugin: bool) -> Path:
    """The ONNX graph a plan is built from (the acceptance step: its plugin form when a plugin library is used)."""
    return graph_dir(root, rank) / f"{ACCEPT_PLUGIN if plan == ACCEPT and plugin else plan}.onnx"


def _missing_graphs(root: Path, ranks: int, plugin: bool, plans: Sequence[str] = PLANS) -> list[Path]:
    return [path for r in range(ranks) for g in plans if not (path := plan_source(root, r, g, plugin)).is_file()]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _link_tree(src: Path, dst: Path, skip: Iterable[Path]) -> None:
    """Hard-link every file under `src` into `dst` (same relative paths), except those under `skip`.

    The engine's weights are not copied: the new directory shares them with the old one until the swap."""
    skip = [Path(s) for s in skip]
    for path in sorted(src.rglob("*")):
        if not path.is_file() or any(path == s or s in path.parents for s in skip):
            continue
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, target)


TRT_MOE = "trt.TRT_MoE"  # graphs' `experts_op` when their experts are TensorRT's node (onnx_ops.TRT_MOE_OP)


ExpertsChoice = Literal["auto", "routed", "dense"]  # compile --experts


def experts_form(routed_op: bool, major: int, minor: int, choice: ExpertsChoice = "auto") -> tuple[bool, str | None]:
    """How compile builds graphs whose experts are TRT_MoE nodes (`routed_op`) on a GPU of compute capability
    major.minor, as `choice` (compile --experts) asks: (whether as TensorRT's IMoELayer, which builds on SM 10.x / 11.x
    only, else rewritten into the dense form; what to tell the user, None without such nodes)."""
    from trtllm_dflash.compile.onnx_ops import ROUTED_EXPERTS_SM_MAJORS

    if not routed_op:
        if choice == "routed":
            raise UserError("--experts routed: this engine's graphs hold no TRT_MoE node (no experts, quantized "
                            "experts, experts split by moe_parallel: ep, or an engine built before 2026-12-05).")
        return False, None
    builds = major in ROUTED_EXPERTS_SM_MAJORS
    if choice == "routed" and not builds:
        raise UserError(f"--experts routed: TensorRT's IMoELayer builds on SM 10.x / 11.x only, and this GPU is SM "
                        f"{major}.{minor}; use --experts auto or dense.")
    if builds and choice != "dense":
        return True, f"IMoELayer (TensorRT's routed experts; SM {major}.{minor})"
    why = ("--experts dense" if builds else
           f"TensorRT's IMoELayer builds on SM 10.x / 11.x only, this GPU is SM {major}.{minor}")
    return False, f"the dense form (every expert over every token; {why})"


def compile_engine(engine_dir: Path, plugin_library: Path | None = None,
                   report: Callable[[str], None] | None = None, experts: ExpertsChoice = "auto") -> list[Path]:
    """Build every rank's graphs into TensorRT plans on this GPU and add them to the engine (see the module
    docstring for the layout and what a crash leaves). Returns the plan files. `report` gets one line per plan (and
    one on the experts' form); `experts`: how TRT_MoE nodes are built (experts_form)."""
    command = "compile"
    root = Path(engine_dir)
    cfg = open_engine(root)  # the manifest check: a damaged or edited graph is refused here, before TensorRT
    ranks = cfg.mapping.tp_size
    missing = _missing_graphs(root, ranks, plugin_library is not None, engine_plans(cfg, root))
    if missing:
        raise UserError(f"{root}: the engine has no ONNX graphs to compile ({missing[0]} is missing); build it "
                        "with `backend: onnxruntime` (an engine built with backend torch has none).")
    if plugin_library is not None and not Path(plugin_library).is_file():
        raise UserError(f"--plugin-library {plugin_library}: no such file.")
    target_graph = graph_dir(root, 0) / "target_step.onnx"
    metadata = graph_metadata(target_graph)
    routed_op = metadata.get(EXPERTS_OP_KEY) == TRT_MOE
    if metadata.get(EXPERTS_OP_KEY) and not routed_op:
        raise UserError(f"{target_graph}: its experts are onnxruntime's {metadata[EXPERTS_OP_KEY]} node (the engine "
                        "was built with backend: onnxruntime), which TensorRT cannot parse; rebuild the engine with "
                        "backend: tensorrt.")
    graph_ring_pass(target_graph)  # (rings TensorRT cannot write are refused here, before TensorRT is looked for)
    trt = import_tensorrt(command)
    _require_onnx(command)
    require_gpu(command)
    for rank in range(ranks):  # a graph of another export (copied in from a tp 4 engine, ...) before any build
        for graph in (g for g in engine_plans(cfg, root) if g != ACCEPT):
            path = graph_dir(root, rank) / f"{graph}.onnx"
            if graph_placement(path) != (rank, ranks):
                exported = "rank {} of tp_size {}".format(*graph_placement(path))
                raise UserError(f"{path}: this graph was exported for {exported}, but it is rank {rank}'s graph of an "
                                f"engine split for tp_size {ranks}; rebuild the engine.")
        for graph in ("target_step", "drafter_draft"):
            path = graph_dir(root, rank) / f"{graph}.onnx"
            check_graph_inputs(graph, graph_inputs(path), path)

    import torch

    shapes = plan_shapes(cfg, root)
    major, minor = torch.cuda.get_device_capability()
    routed, experts_built = experts_form(routed_op, major, minor, experts)
    if report is not None and experts_built is not None:
        report(f"experts: {experts_built}")
    written = []
    with atomic_directory(root, "engine", force=True) as tmp:
        _link_tree(root, tmp, skip=[root / ".trtllm-dflash", root / "manifest.json", root / PLANS_DIR])
        for rank in range(ranks):
            plan_dir(tmp, rank).mkdir(parents=True)
            for graph in engine_plans(cfg, root):
                source = plan_source(tmp, rank, graph, plugin_library is not None)
                plan = build_plan(trt, source, dtype_note=cfg.dtype, shapes=shapes, plugin_library=plugin_library,
                                  dense_experts=not routed)
                plan_file(tmp, rank, graph).write_bytes(plan)
                written.append(plan_file(root, rank, graph))
                if report is not None:
                    report(f"rank {rank}: {graph} -> {plan_file(root, rank, graph).relative_to(root)} "
                           f"({len(plan) / 2**20:.1f} MiB)")
        info = {
            "tensorrt_version": trt.__version__,
            "compute_capability": f"{major}.{minor}",
            "device": torch.cuda.get_device_name(),
            "cache_length": shapes["max_len"].max,
            "window_ring": shapes["ring"].max if "ring" in shapes else None,  # the sliding layers' positions per row
            "experts": experts_built,  # (None: the graphs have no experts' node)
            "tp_size": ranks,
            "shapes": {name: [r.min, r.opt, r.max] for name, r in shapes.items()},
            "plugin_library": Path(plugin_library).name if plugin_library is not None else None,
            # the run must load this very library: a plugin of another build may read its fields differently
            "plugin_library_sha256": file_sha256(plugin_library) if plugin_library is not None else None,
            ONE_TOKEN_ADVANCES_KEY: ONE_TOKEN_ADVANCES_KEY in metadata,  # (a Qwen3.5 target's graphs)
        }
        (tmp / PLANS_DIR / PLANS_INFO).write_text(json.dumps(info, indent=2) + "\n")
        write_manifest(tmp)
    return written
