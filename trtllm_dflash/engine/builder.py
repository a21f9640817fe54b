"""`trtllm-dflash build`: a validated target + drafter pair -> one engine directory."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections import abc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from rich.progress import Progress
from safetensors.torch import load_file

from trtllm_dflash import __version__
from trtllm_dflash.checkpoint.formats import (
    DrafterCheckpoint,
    load_pair,
    target_tensor_shapes,
)
from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.config import BuildConfig
from trtllm_dflash.engine.quantize_drafter import quantize_drafter
from trtllm_dflash.engine.quantize_moe_target import LayerwiseQuantizedTarget
from trtllm_dflash.engine.quantize_layers import LayerByLayer, ModelOptLayers
from trtllm_dflash.engine.quantize_target import LATENT_ATTENTION, QUANT_ALGOS, calibration_batches
from trtllm_dflash.engine.safetensors_stream import SafetensorsWriter
from trtllm_dflash.engine_dir import (
    CONFIG,
    DRAFTER_PREFIX,
    TARGET_PREFIX,
    TOKENIZER,
    DFlashSection,
    EngineConfig,
    Mapping,
    graph_dir,
    rank_file,
    write_manifest,
)
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.quantized import SCALE_SUFFIXES
from trtllm_dflash.models.shard import check_tp, holds, shard_tensor, split_for
from trtllm_dflash.models.spec import DecoderSpec
from trtllm_dflash.outputs import atomic_directory, check_output_dir
from trtllm_dflash.parallel.group import TPGroup
from trtllm_dflash.quantize.experts import EXPERT_SCALE_SUFFIXES


def quantization_section(quantization: str, target: abc.Mapping[str, torch.Tensor],
                         drafter: abc.Mapping[str, torch.Tensor]) -> dict:
    """EngineConfig.quantization: ModelOpt's quant_algo naming, and which modules are quantized."""
    if quantization == "none":
        return {"quant_algo": None}

    def modules(prefix: str, tensors: abc.Mapping[str, torch.Tensor]) -> list[str]:
        # a linear's `<module>.weight_scale`, or the experts' `<experts>.<projection>_weight_scale`
        return sorted(prefix + k[: -len(".weight_scale")] for k in tensors
                      if k.endswith((".weight_scale", "_weight_scale")))

    return {"quant_algo": QUANT_ALGOS[quantization], "group_size": 16 if quantization == "nvfp4" else None,
            "quantized_modules": modules(TARGET_PREFIX, target) + modules(DRAFTER_PREFIX, drafter),
            "drafter": "quantized" if drafter else "unquantized"}


def check_backend(cfg: BuildConfig, source: str) -> None:
    """What `backend: onnxruntime | tensorrt` can build today (see README "Backends")."""
    if cfg.backend == "torch":
        return
    supported: dict[str, tuple] = {}
    if cfg.backend == "onnxruntime":
        # onnxruntime cannot run TensorRT's DistCollective and FP4-quantize nodes (tensor-parallel and NVFP4
        # graphs), and its CPU kernels have no bfloat16 MatMul.
        supported = {"tp_size": (1,), "quantization": ("none", "fp8"), "dtype": ("float32",)}
    for key, allowed in supported.items():
        value = getattr(cfg, key)
        if value not in allowed:
            raise UserError(f"{source}: backend {cfg.backend} builds {key} {' or '.join(map(str, allowed))} engines "
                            f"for now, not {value}; use backend: torch for this engine.")
    try:
        import onnxruntime  # noqa: F401 - the graphs are checked in it after export
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise UserError(f"{source}: backend {cfg.backend} needs the onnx extra: pip install "
                        f"'trtllm-dflash[onnx]' ({exc}).") from None


def check_target_family(cfg: BuildConfig, spec: DecoderSpec, source: str) -> None:
    """What Gemma 4 targets can be built into today: the torch executor only (the exported graphs have one head_dim
    per model and no soft-capped logits). Every other
    family builds for every backend (Qwen3.5: its Gated DeltaNet layers' states as graph inputs and outputs,
    docs/models.md §Recurrent state; DeepSeek-V3 / Kimi K2: the latent cache as one KV head and a zero-wide V)."""
    if not spec.is_gemma4:
        return
    if cfg.backend != "torch":
        raise UserError(f"{source}: backend {cfg.backend} cannot export {spec.model_type} targets yet (per-layer-type "
                        "head dims, attention scale 1, soft-capped logits); use backend: torch for this engine.")


def check_own_lm_head(cfg: BuildConfig, draft_vocab_size: int | None, source: str) -> None:
    """A drafter with its own lm_head (a speculators drafter whose lm_head is not the target's, e.g. over a
    pruned vocabulary) runs on the torch executor only: the exported graphs draft with the target's lm_head,
    and the drafter's quantization calibrates the z-lab modules only."""
    if draft_vocab_size is None:
        return
    what = f"{source}: drafter {cfg.drafter} has its own lm_head over {draft_vocab_size} tokens"
    if cfg.backend != "torch":
        raise UserError(f"{what}, which backend {cfg.backend} does not support yet; use backend: torch.")
    if cfg.quantize_drafter:
        raise UserError(f"{what}, which quantize_drafter does not support yet; use quantize_drafter: false.")


def check_dflash2(cfg: BuildConfig, drafter: DrafterCheckpoint, source: str) -> None:
    """A DFlash2 drafter runs on the torch and onnxruntime executors, unquantized: its graph (the selector's walk over
    the trained block) is not compiled for TensorRT yet, and the drafter's quantization calibrates DFlash's modules
    only."""
    if drafter.params.dflash2 is None:
        return
    what = f"{source}: drafter {cfg.drafter} is a DFlash2 drafter"
    if cfg.backend == "tensorrt":
        raise UserError(f"{what}, which backend tensorrt does not support yet (its plans are not built from the "
                        "candidate selector's graph); use backend: onnxruntime or torch.")
    if cfg.quantize_drafter:
        raise UserError(f"{what}, which quantize_drafter does not support yet; use quantize_drafter: false.")


# Processes that share one rank's graphs: each loads the rank's weights, and the graphs are few (target_step,
# target_tree and target_decode take most of the time: onnx_export._claim_order), so more would mostly add memory.
MAX_PROCESSES_PER_RANK = 3
EXPORT_PROCESSES_ENV = "TRTLLM_DFLASH_EXPORT_PROCESSES"  # at most this many (e.g. 1 where other work fills the cores)


def export_process_limit() -> int | None:
    """$TRTLLM_DFLASH_EXPORT_PROCESSES (None where unset); build_engine checks it before any work."""
    limit = os.environ.get(EXPORT_PROCESSES_ENV)
    if limit is not None and (not limit.strip().isdigit() or int(limit) < 1):
        raise UserError(f"{EXPORT_PROCESSES_ENV}={limit!r}: must be a whole number of processes, 1 or more.")
    return None if limit is None else int(limit)


def export_processes(root: Path, cfg: EngineConfig) -> int:
    """How many export processes a build may run at once: one per CPU core (an export is mostly single-threaded
    Python), no more than the available memory holds at about four times the largest rank file each (its weights
    in the export dtype, the traced program's and the ONNX model's copies) plus 1 GiB (torch and the exporter), and
    no more than $TRTLLM_DFLASH_EXPORT_PROCESSES says."""
    processes = os.cpu_count() or 1
    limit = export_process_limit()
    if limit is not None:
        processes = min(processes, limit)
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):  # (not Linux: the cores decide)
        return processes
    largest = max((root / rank_file(rank)).stat().st_size for rank in range(cfg.mapping.tp_size))
    return max(1, min(processes, available // (4 * largest + 2**30)))


def export_graphs(root: Path, cfg: EngineConfig, processes: int | None = None) -> None:
    """Every rank's graphs (ROOT holds config.json and the rank files), in up to `processes` processes (default:
    export_processes): an export is mostly single-threaded Python, so a tp 8 engine on an 8-core machine exports in
    about the time of one rank, and a tp 1 engine's graphs are shared by up to MAX_PROCESSES_PER_RANK processes
    (engine/export_rank.py; each claims the next graph nobody has, and merge_graph_parts writes them as one process
    would: the same files, byte for byte). With one process, the graphs are exported here."""
    ranks = range(cfg.mapping.tp_size)
    processes = processes or export_processes(root, cfg)
    per_rank = max(1, min(MAX_PROCESSES_PER_RANK, processes // len(ranks)))
    at_once = max(1, min(len(ranks), processes // per_rank))
    if per_rank * at_once == 1:
        for rank in ranks:
            export_rank_graphs(root, cfg, rank)
        return
    threads = max(1, (os.cpu_count() or 1) // (per_rank * at_once))

    def export(rank: int) -> None:
        parts = [root / ".export" / f"rank{rank}" / str(i) for i in range(per_rank)] if per_rank > 1 else [None]
        if per_rank > 1:
            (root / ".export" / f"rank{rank}" / "claims").mkdir(parents=True)
        jobs = [subprocess.Popen([sys.executable, "-m", "trtllm_dflash.engine.export_rank", str(root), str(rank),
                                  str(threads), *([str(part)] if part else [])],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for part in parts]
        try:
            for job in jobs:
                lines = job.communicate()[1].strip().splitlines()
                if job.returncode == -signal.SIGINT or lines[-1:] == ["KeyboardInterrupt"]:
                    raise KeyboardInterrupt  # Ctrl-C reached the whole process group: report it as ours
                if job.returncode != 0:
                    raise RuntimeError(f"exporting rank {rank}'s graphs failed (exit {job.returncode}): "
                                       f"{lines[-1] if lines else 'no message'}")
        finally:  # (a failed process's siblings would go on exporting a build that has failed)
            for job in jobs:
                if job.poll() is None:
                    job.kill()
                    job.wait()
        if per_rank > 1:
            from trtllm_dflash.compile.onnx_export import merge_graph_parts

            merge_graph_parts(parts, graph_dir(root, rank))

    try:
        with ThreadPoolExecutor(at_once) as pool:
            list(pool.map(export, ranks))
    finally:
        shutil.rmtree(root / ".export", ignore_errors=True)


def export_rank_graphs(root: Path, cfg: EngineConfig, rank: int, part: Path | None = None) -> list[Path]:
    """Export rank `rank`'s graphs from the very torch modules the torch executor builds from ROOT's weights; with
    `part`, only the graphs this process claims (in its parent's `claims` folder), into `part` (export_graphs)."""
    from trtllm_dflash.compile.onnx_export import claim_file, export_engine_graphs, keep_stored_weights
    from trtllm_dflash.runtime.executor import TorchExecutor

    tp = TPGroup(rank, cfg.mapping.tp_size)  # collectives become DistCollective nodes under export
    modules = TorchExecutor.from_engine(root, cfg, rank, tp, "cpu", None)
    if cfg.quantization.get("quant_algo"):  # FP8 linears keep their stored weights in the graph
        weights = load_file(str(Path(root) / rank_file(rank)))
        for prefix, model in ((TARGET_PREFIX, modules.target), (DRAFTER_PREFIX, modules.drafter)):
            keep_stored_weights(model, {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
    # torch.export's deprecation warnings and its "torchvision is not installed" log line say nothing to a user.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        # onnxruntime's own forms: its MoE and GroupQueryAttention nodes (TensorRT parses neither), the trees' graphs;
        # TensorRT's: its TRT_MoE node (IMoELayer on Blackwell; compile rewrites it into the dense form elsewhere),
        # rings written whole (its KV-cache update writes linearly only), a Qwen3.5 target's target_token
        ort = cfg.backend == "onnxruntime"
        return export_engine_graphs(modules.target, modules.drafter, graph_dir(root, rank) if part is None else part,
                                    experts_op="onnxruntime" if ort else "tensorrt",
                                    trees=ort, in_place=ort, rings=True, token_step=not ort, rewrite_rings=not ort,
                                    claim=None if part is None else claim_file(part.parent / "claims"))


@contextmanager
def _stage(report: Callable[[str], None] | None, done: str) -> Iterator[None]:
    """Report `done` with the stage's duration when the stage has finished."""
    start = time.perf_counter()
    yield
    if report is not None:
        report(f"{done} ({time.perf_counter() - start:.1f} s)")


def check_kv_cache_memory(cfg: BuildConfig, source: str) -> None:
    """kv_cache_memory's form (the machine that runs the engine judges the amount)."""
    from trtllm_dflash.runtime.kv_blocks import resolve_budget

    try:
        resolve_budget(cfg.kv_cache_memory, available=2**62)
    except ValueError as e:
        raise UserError(f"{source}: kv_cache_memory {cfg.kv_cache_memory}: {e}.") from None


def build_engine(cfg: BuildConfig, force: bool = False, progress: bool = True, config_file: Path | None = None,
                 report: Callable[[str], None] | None = None) -> Path:
    """Validate, convert, shard and write the engine; returns its directory. `config_file` (the YAML the
    config came from) is named in errors and is one of the inputs the output must keep clear of.

    `progress` shows a bar while weights are written; `report` receives one line per finished stage."""
    source = str(config_file) if config_file is not None else "build config"
    if cfg.backend != "torch":
        export_process_limit()
    if cfg.quantize_drafter and cfg.quantization == "none":
        raise UserError(f"{source}: quantize_drafter: true needs quantization nvfp4 or fp8 (it is none).")
    check_backend(cfg, source)
    if cfg.kv_cache_memory is not None:
        check_kv_cache_memory(cfg, source)
    assert cfg.output is not None
    check_output_dir(cfg.output, "engine", "output directory", force=force,
                     inputs=(cfg.target, cfg.drafter, cfg.calibration, config_file))
    with _stage(report, "checked the target + drafter pair and the build options"):
        warnings_ = []  # said once the engine is written: a build that fails prints its error alone
        target, drafter = load_pair(cfg.target, cfg.drafter, warn=warnings_.append, max_seq_len=cfg.max_seq_len)
        if cfg.max_seq_len > target.spec.max_position_embeddings:
            raise UserError(
                f"{source}: max_seq_len {cfg.max_seq_len} exceeds the target's max_position_embeddings "
                f"{target.spec.max_position_embeddings}."
            )
        check_target_family(cfg, target.spec, source)
        check_tp(target.spec, cfg.tp_size, f"{source}: target {cfg.target}", cfg.quantization != "none",
                 cfg.moe_parallel)
        check_tp(drafter.spec, cfg.tp_size, f"{source}: drafter {cfg.drafter}", cfg.quantize_drafter)
        check_own_lm_head(cfg, drafter.draft_vocab_size, source)
        check_dflash2(cfg, drafter, source)
        tokenizer = load_tokenizer(cfg.target)
        batches = [] if cfg.quantization == "none" else calibration_batches(
            tokenizer, cfg.calibration, cfg.calibration_samples, cfg.calibration_max_tokens)
    eos = list(target.eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    dtype = getattr(torch, cfg.dtype)

    quantized: dict[str, abc.Mapping[str, torch.Tensor]] = {TARGET_PREFIX: {}, DRAFTER_PREFIX: {}}
    if cfg.quantization != "none":
        fmt = QUANT_ALGOS[cfg.quantization]
        if cfg.quantize_drafter:
            with _stage(report, f"drafter quantized to {fmt} (ModelOpt, calibrated on {len(batches)} prompts)"):
                quantized[DRAFTER_PREFIX] = quantize_drafter(target, drafter, cfg.quantization, batches)
        # calibrated and quantized a layer at a time while the rank files are written (engine/quantize_layers.py)
        quantized[TARGET_PREFIX] = (
            LayerwiseQuantizedTarget(target, cfg.quantization, batches) if target.spec.num_experts  # gpt-oss
            else ModelOptLayers(target, cfg.quantization, batches, LATENT_ATTENTION if target.spec.is_mla else ()))

    def stored(prefix: str, store, name: str) -> list[tuple[str, torch.Tensor]]:
        """One checkpoint tensor as stored in the engine (a quantized linear: in ModelOpt's unified format)."""
        module, q = name.removesuffix(".weight"), quantized[prefix]
        if f"{module}.weight_scale" in q:
            return [(key, q[key]) for key in (name, *(module + s for s in SCALE_SUFFIXES)) if key in q]
        if f"{name}_weight_scale" in q:  # fused experts (quantize/experts.py)
            return [(key, q[key]) for key in (name, *(name + s for s in EXPERT_SCALE_SUFFIXES)) if key in q]
        tensor = store.get(name)  # (the drafter's d2t is an index map: it keeps its integer dtype)
        return [(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)]

    sources = [(TARGET_PREFIX, target.tensors, target_tensor_shapes(target.spec), target.spec),
               (DRAFTER_PREFIX, drafter.tensors, drafter.engine_tensor_names(), drafter.spec)]
    with atomic_directory(cfg.output, "engine", force) as tmp:
        total = sum(len(names) for _, _, names, _ in sources)
        wrote = f"wrote {cfg.tp_size} rank file{'s' if cfg.tp_size > 1 else ''}"
        if cfg.quantization != "none":
            wrote = (f"quantized the target to {QUANT_ALGOS[cfg.quantization]} a layer at a time "
                     f"(calibrated on {len(batches)} prompts) and {wrote}")
        with _stage(report, wrote), Progress(disable=not progress, transient=True) as bar, ExitStack() as files:
            task = bar.add_task(f"writing {cfg.tp_size} rank file(s)", total=total)
            layers = quantized[TARGET_PREFIX]
            if isinstance(layers, LayerByLayer):  # (a layer's calibration can take minutes: say which one runs)
                layers.on_layer = lambda i: bar.update(task, description=f"quantizing layer {i + 1} of "
                                                       f"{layers.num_layers}, writing {cfg.tp_size} rank file(s)")
            # Streamed: each source tensor is read once, its slices go to every rank's file, and memory holds one
            # source tensor at a time, never a whole rank.
            outs = [files.enter_context(SafetensorsWriter(tmp / rank_file(r), metadata={"format": "pt"}))
                    for r in range(cfg.tp_size)]
            for prefix, store, names, spec in sources:
                for name in names:
                    for key, tensor in stored(prefix, store, name):
                        for rank, out in enumerate(outs):
                            if not holds(key, spec, cfg.tp_size, rank, cfg.moe_parallel):
                                continue  # (another rank's expert)
                            out.add(prefix + key, shard_tensor(tensor, split_for(key, spec, cfg.tp_size, rank,
                                                                                  cfg.moe_parallel)))
                    bar.advance(task)
        tokenizer.save_pretrained(str(tmp / TOKENIZER))
        engine_cfg = EngineConfig(
            trtllm_dflash_version=__version__,
            dtype=cfg.dtype,
            target=target.spec.to_hf_dict(),
            drafter=drafter.spec.to_hf_dict(),
            dflash=DFlashSection(block_size=drafter.params.block_size,
                                 mask_token_id=drafter.params.mask_token_id,
                                 target_layer_ids=list(drafter.params.target_layer_ids),
                                 draft_vocab_size=drafter.draft_vocab_size,
                                 dflash2=(None if drafter.params.dflash2 is None
                                          else dataclasses.asdict(drafter.params.dflash2))),
            quantization=quantization_section(cfg.quantization, quantized[TARGET_PREFIX], quantized[DRAFTER_PREFIX]),
            mapping=Mapping(world_size=cfg.tp_size, tp_size=cfg.tp_size),
            max_batch_size=cfg.max_batch_size,
            max_seq_len=cfg.max_seq_len,
            eos_token_ids=eos,
            build=cfg.model_dump(mode="json"),
            backend=cfg.backend,
            kv_cache_memory=cfg.kv_cache_memory,
        )
        (tmp / CONFIG).write_text(engine_cfg.model_dump_json(indent=2) + "\n")
        if cfg.backend in ("onnxruntime", "tensorrt"):  # TensorRT plans are built from the graphs by `compile`
            ranks = f" of {cfg.tp_size} ranks" if cfg.tp_size > 1 else ""
            with _stage(report, f"exported the ONNX graphs of the target and drafter steps{ranks}"):
                export_graphs(tmp, engine_cfg)
        write_manifest(tmp)
    for warning in warnings_ if report else ():
        report(f"warning: {warning}")
    return cfg.output
