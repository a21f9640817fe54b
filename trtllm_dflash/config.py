"""The build config (YAML, user-written), typed; the engine's own config.json is `engine_dir.EngineConfig`.

Unknown keys and wrong types are errors that name the file, the key and the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import lone_surrogate, read_text, shown

DTYPES = ("bfloat16", "float16", "float32")
Dtype = Literal["bfloat16", "float16", "float32"]
Backend = Literal["torch", "onnxruntime", "tensorrt"]  # the executors; an engine is compiled for one (README "Backends")
MAX_BATCH_SIZE = 4096  # TensorRT-LLM's largest max_batch_size default is 2048; more KV-cache slots are a typo


def describe_validation_error(source: str, exc: ValidationError) -> str:
    """The first problem of a pydantic error as one sentence naming the field and the value."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown key {field!r}."
    if err["type"] == "missing":
        return f"{source}: required key {field!r} is missing."
    return f"{source}: field {field!r} {err['msg'].lower()}, got {shown(err.get('input'))}."


class BuildConfig(BaseModel):
    """`trtllm-dflash build CONFIG.yaml`: what to build. Paths are relative to the YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: Path  # HF-format target checkpoint directory
    drafter: Path  # z-lab-format DFlash drafter directory
    output: Path | None = None  # engine directory to write (or `--output`)
    dtype: Dtype = "bfloat16"  # compute / storage dtype of the engine's weights
    quantization: Literal["none", "fp8", "nvfp4"] = "none"
    tp_size: Literal[1, 2, 4, 8] = 1  # tensor-parallel ranks (MPI processes at run time)
    # Mixture-of-experts targets (gpt-oss) over tp_size ranks: "tp" splits every expert's intermediate features
    # (TensorRT-LLM's default, its low-latency gpt-oss recipe), "ep" gives each rank whole experts.
    moe_parallel: Literal["tp", "ep"] = "tp"
    max_batch_size: int = Field(8, ge=1, le=MAX_BATCH_SIZE)  # requests decoded together (KV cache slots)
    max_seq_len: int = Field(4096, ge=2)  # prompt + generated tokens per request (<= the target's positions)
    calibration: Path | None = None  # JSONL prompts for quantization (default: stdlib code)
    calibration_samples: int = Field(64, ge=1, le=100_000)  # calibration prompts used
    calibration_max_tokens: int = Field(256, ge=1, le=1_000_000)  # tokens per calibration prompt
    quantize_drafter: bool = False  # also quantize the drafter's linears (needs quantization nvfp4 | fp8)
    backend: Backend = "torch"  # what the engine is compiled for
    # The KV cache `run`, `bench` and `serve` give this engine unless told otherwise (--kv-cache-memory): a paged one of
    # this size (512MiB, 2GiB, bytes, or a fraction of the free memory such as 0.5); None: a max_seq_len slot a request
    kv_cache_memory: str | int | float | None = None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (line {key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_build_config(path: Path, output: Path | None = None) -> BuildConfig:
    path = Path(path)
    text = read_text(path, "build config file")
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({str(exc).splitlines()[0]}).") from None
    except RecursionError:  # PyYAML recurses once per level: "[[[[..." 100,000 deep
        raise UserError(f"{path}: not a build config (lists or mappings nested thousands deep).") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a build config must be a YAML mapping of keys to values.")
    bad = lone_surrogate(raw)
    if bad:
        raise UserError(f"{path}: {bad}.")
    try:
        cfg = BuildConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError(describe_validation_error(str(path), exc)) from None
    if output is not None:
        cfg = cfg.model_copy(update={"output": output})
    if cfg.output is None:
        raise UserError(f"{path}: key 'output' is not set and no --output was given.")
    # Paths in the file are relative to the file; --output is relative to the working directory.
    resolved = {k: (path.parent / getattr(cfg, k)).resolve() for k in ("target", "drafter", "calibration")
                if getattr(cfg, k) is not None}
    resolved["output"] = (Path.cwd() if output is not None else path.parent).joinpath(cfg.output).resolve()
    return cfg.model_copy(update=resolved)
