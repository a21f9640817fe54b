"""The engine directory (docs/architecture.md §The engine directory): its config, its files, its manifest.
Written by `build` (atomically, engine/builder.py), read and verified by every command that runs an engine.

    ENGINE_DIR/
      config.json          EngineConfig
      rank{r}.safetensors  target tensors under `target.`, drafter tensors under `drafter.`
      tokenizer/           tokenizer files + chat template
      onnx/rank{r}/        backend onnxruntime: the ONNX graphs of the DFlash step and their weights
      .trtllm-dflash       the marker of a directory trtllm-dflash wrote (outputs.py): `build --force` replaces
                           only such a directory
      manifest.json        sha256 and size of every file above
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, model_serializer

from trtllm_dflash.config import Backend, Dtype, describe_validation_error
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import read_json, read_text, require_dir

CONFIG = "config.json"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer"
GRAPHS = "onnx"  # folder of the ONNX graphs, one subfolder per rank
TARGET_PREFIX, DRAFTER_PREFIX = "target.", "drafter."


class DFlash2Section(BaseModel):
    """A DFlash2 drafter's settings (models/spec.py DFlash2Params)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None


class DFlashSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    # Rows of the drafter's own lm_head (`drafter.draft_lm_head.weight`; a speculators drafter whose lm_head is
    # not the target's): with fewer rows than the target's vocabulary, `drafter.d2t` maps drafts to target ids.
    # Absent (None): the drafter uses the target's lm_head.
    draft_vocab_size: int | None = None
    dflash2: DFlash2Section | None = None  # a DFlash2 drafter; absent: DFlash

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict:
        """Engines whose drafter uses the target's lm_head (and is DFlash) keep the config they had before these
        fields existed."""
        data = handler(self)
        for key in ("draft_vocab_size", "dflash2"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Mapping(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    world_size: int = 1
    tp_size: int = 1


class EngineConfig(BaseModel):
    """ENGINE_DIR/config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = 1
    trtllm_dflash_version: str
    dtype: Dtype
    target: dict  # target architecture, HF config.json fields
    drafter: dict  # drafter architecture, HF config.json fields (Qwen3 layers)
    dflash: DFlashSection
    quantization: dict = Field(default_factory=lambda: {"quant_algo": None})
    mapping: Mapping = Field(default_factory=Mapping)
    max_batch_size: int
    max_seq_len: int
    eos_token_ids: list[int]
    build: dict  # the build config that produced this engine (for provenance)
    # What the engine was compiled for, and so what `run` uses by default. The torch weights are always
    # there (`--backend torch` runs any engine); onnxruntime and tensorrt engines also hold ONNX graphs.
    backend: Backend = "torch"
    kv_cache_memory: str | int | float | None = None  # the paged KV cache run / bench / serve default to (None: static slots)


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def graph_dir(root: Path, rank: int) -> Path:
    """Where rank `rank`'s ONNX graphs live (compile/onnx_export.py writes them)."""
    return Path(root) / GRAPHS / f"rank{rank}"


# Graph metadata (compile/onnx_export.py): the experts of these graphs are this one onnxruntime op
# ("com.microsoft.MoE"), which TensorRT cannot parse; absent in graphs with the experts' dense form.
EXPERTS_OP_KEY = "experts_op"
# ... target_step's sliding-window layers keep rings of (window + this) positions, and no pass may write more positions
# per row than this (onnx_ops.GraphKVCache); absent: every layer keeps max_len positions
RING_PASS_KEY = "window_ring_pass"
# ... how the rings are written: "rewrite" (graphs for TensorRT: the whole ring through one linear KV-cache update,
# onnx_ops.ring_rewrite); absent: TensorScatter's circular mode, which TensorRT cannot parse (graphs for onnxruntime)
RING_WRITE_KEY = "window_ring_write"
# ... (Qwen3.5 targets) a one-token pass leaves each Gated DeltaNet layer's state after its token, so the next pass
# replays nothing (linear_attention.RecurrentStates one_token_advances); absent (graphs exported before 2026-12-05):
# it keeps the pass's inputs, as a verify block's
ONE_TOKEN_ADVANCES_KEY = "recurrent_one_token_advances"
# target_tree.onnx of a target with sliding-window layers: those layers see a node's ancestors within the window of the
# node's position (TargetModel.forward's visible_keys); absent (graphs exported before 2026-12-07): their mask ignored
# the tree, so such graphs do not verify trees
TREE_WINDOWS_KEY = "tree_sliding_windows"


def check_graph_inputs(graph: str, inputs: list[str], where: Path) -> None:
    """Refuse a target_step or drafter_draft graph (or a plan compiled from one) exported by an earlier trtllm-dflash,
    whose executor contract differs: one without `key_positions` (the attended length as an input's length, not read
    from the positions inside the graph), or a drafter_draft without `context_hidden` (the new context rows)."""
    needed = {"target_step": ("key_positions",), "drafter_draft": ("key_positions", "context_hidden")}[graph]
    missing = [name for name in needed if name not in inputs]
    if missing:
        raise UserError(f"{where}: this graph was exported by an earlier trtllm-dflash (it has no {missing[0]} "
                        "input); build the engine again with `trtllm-dflash build CONFIG --force`.")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    entries = {str(p.relative_to(root)): {"sha256": _sha256(p), "size": p.stat().st_size} for p in _files(root)}
    (root / MANIFEST).write_text(json.dumps({"files": entries}, indent=2) + "\n")


def verify_manifest(root: Path, rank: int | None = None) -> None:
    """Every listed file exists with its size and sha256, and nothing unlisted was added.

    With `rank`, other ranks' weight files are not read (each MPI rank checks the files it uses)."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise UserError(f"{root}: not an engine directory ({MANIFEST} is missing; was the build interrupted?).")
    try:
        entries = read_json(manifest, "manifest")["files"]
        if not isinstance(entries, dict):
            raise TypeError
    except (KeyError, TypeError):
        raise UserError(f"{manifest}: unreadable manifest.") from None
    for rel, meta in entries.items():
        if rank is not None and re.fullmatch(r"rank\d+\.safetensors", rel) and rel != rank_file(rank):
            continue
        path = root / rel
        if not path.is_file():
            raise UserError(f"{path}: engine file listed in {MANIFEST} is missing.")
        if path.stat().st_size != meta["size"] or _sha256(path) != meta["sha256"]:
            raise UserError(f"{path}: engine file does not match {MANIFEST} (modified or corrupted).")
    extra = [str(p.relative_to(root)) for p in _files(root) if str(p.relative_to(root)) not in entries]
    if extra:
        raise UserError(f"{root / extra[0]}: file is not listed in {MANIFEST}.")


def read_engine_config(root: Path) -> EngineConfig:
    path = root / CONFIG
    try:
        return EngineConfig.model_validate_json(read_text(path, "engine config"))
    except ValidationError as exc:
        raise UserError(describe_validation_error(str(path), exc)) from None


def open_engine(root: Path, rank: int | None = None) -> EngineConfig:
    """Verify an engine directory (with `rank`: only that rank's weights) and return its config."""
    root = require_dir(root, "engine directory")
    verify_manifest(root, rank)
    return read_engine_config(root)
