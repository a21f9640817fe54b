"""`serve`: a standard Triton model repository for one engine (Python backend, decoupled).

    MODEL_REPO/
      NAME/
        config.pbtxt      backend "python", decoupled transaction policy, the tensors below
        1/model.py        imports trtllm_dflash.serve.triton_model.TritonPythonModel
        1/serve.json      ServeConfig: the engine directory and run options

The interface follows TensorRT-LLM's Triton LLM-API model (`triton_backend/all_models/llmapi/
tensorrt_llm`) where it can: the same input and output names and types, plus DFlash acceptance
outputs. `max_batch_size: 0` turns off Triton's own batching: requests are batched by our scheduler.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trtllm_dflash.config import Backend, describe_validation_error
from trtllm_dflash.engine_dir import EngineConfig
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import read_text, shown
from trtllm_dflash.outputs import atomic_directory, check_output_dir
from trtllm_dflash.runtime.options import check_tree_options

SERVE_CONFIG = "serve.json"
MODEL_VERSION = "1"

# (name, Triton data type, dims, optional); dims [1] = one value per request.
INPUTS = [
    ("text_input", "TYPE_STRING", [1], False),  # the prompt, UTF-8 (tokenized as `run` tokenizes `prompt`)
    ("streaming", "TYPE_BOOL", [1], True),  # true: one response per decoding step with the new text
    ("sampling_param_max_tokens", "TYPE_INT32", [1], True),  # default: ServeConfig.max_new_tokens
    ("sampling_param_temperature", "TYPE_FP32", [1], True),  # 0: greedy (default)
    ("sampling_param_top_k", "TYPE_INT32", [1], True),  # 0: no limit (default)
    ("sampling_param_top_p", "TYPE_FP32", [1], True),  # in (0, 1]; 1: no limit (default)
    ("sampling_param_stop", "TYPE_STRING", [-1], True),  # stop strings, UTF-8; the text ends before the first
    ("sampling_param_seed", "TYPE_UINT64", [1], True),  # default: ServeConfig.seed
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [1]),  # streaming: the new text of this step; else the whole text
    ("num_output_tokens", "TYPE_INT32", [1]),  # tokens committed so far
    # on the last response only:
    ("finish_reason", "TYPE_STRING", [1]),  # "stop" (EOS / stop token / stop string) or "length"
    ("stop_reason", "TYPE_STRING", [1]),  # the stop string that ended the request ("" if none did)
    ("acceptance_lengths", "TYPE_INT32", [-1]),  # tokens committed per verify step (accepted drafts + 1)
    ("mean_acceptance_length", "TYPE_FP32", [1]),
    ("acceptance_rate", "TYPE_FP32", [1]),  # TensorRT-LLM's: accepted draft tokens / draft tokens
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
    ("batch_size_max", "TYPE_INT32", [1]),  # most requests decoded in one step while this one ran
]

MODEL_PY = '''\
"""Triton Python-backend entry point written by `trtllm-dflash serve`; options in serve.json beside it."""

from trtllm_dflash.serve.triton_model import TritonPythonModel  # noqa: F401
'''


class ServeConfig(BaseModel):
    """MODEL_REPO/NAME/1/serve.json: what the Triton model loads and how it decodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_dir: str  # absolute path of the engine directory
    mode: Literal["dflash", "ar"] = "dflash"
    block_size: int | Literal["auto"] | None = None  # tokens per block, <= the engine's, or "auto" (None: the engine's)
    max_batch_size: int | None = Field(None, ge=1)  # requests decoded together, <= the engine's (None: the engine's)
    max_new_tokens: int = Field(256, ge=1)  # when a request has no sampling_param_max_tokens
    seed: int = Field(0, ge=0, le=2**63 - 1)  # when a request has no sampling_param_seed (`serve --seed`'s range)
    threads: int | None = Field(None, ge=1, le=4096)  # torch CPU threads (None: torch's default)
    backend: Backend | None = None  # the executor (None: what the engine was compiled for)
    kv_cache_memory: str | None = None  # KV memory: paged (torch executor) or rows + prefix pool (None: a slot each)
    prefix_cache: bool = True  # prompt blocks reused across requests by prefix (shared when paged, else copied)
    tree_budget: int | None = Field(None, ge=1, le=1024)  # dflash: verify a DDTree of this many nodes (None: a chain)
    prefix_states: int | None = Field(None, ge=1)  # a hybrid target's recurrent states kept (None: one a slot)


def read_serve_config(path: Path) -> ServeConfig:
    try:
        return ServeConfig.model_validate_json(read_text(Path(path), "serve config"))
    except ValidationError as exc:
        raise UserError(describe_validation_error(str(path), exc)) from None


def check_serve_config(cfg: ServeConfig, engine: EngineConfig) -> None:
    """Options that only the engine can judge; shared by `serve` (early) and the model (at load)."""
    if cfg.block_size not in (None, "auto") and not 2 <= cfg.block_size <= engine.dflash.block_size:
        raise UserError(f"--block-size {cfg.block_size}: must be between 2 and the engine's trained block_size "
                        f"{engine.dflash.block_size}.")
    if cfg.max_batch_size is not None and cfg.max_batch_size > engine.max_batch_size:
        raise UserError(f"--max-batch-size {cfg.max_batch_size}: the engine has KV-cache slots for "
                        f"{engine.max_batch_size} requests (its build's max_batch_size).")
    if cfg.kv_cache_memory is not None:
        from trtllm_dflash.runtime.kv_blocks import check_budget_syntax  # torch: not at `--help` time

        check_budget_syntax(cfg.kv_cache_memory)
    check_tree_options(cfg.tree_budget, cfg.mode, cfg.block_size)
    if cfg.tree_budget is not None:
        from trtllm_dflash.runtime.runner import check_tree

        check_tree(engine, cfg.backend or engine.backend, cfg.tree_budget, cfg.block_size == "auto")
    if cfg.prefix_states is not None:
        from trtllm_dflash.runtime.runner import check_prefix_states

        check_prefix_states(engine, cfg.backend or engine.backend, cfg.prefix_states, cfg.prefix_cache,
                            cfg.kv_cache_memory or engine.kv_cache_memory)
    if cfg.max_new_tokens >= engine.max_seq_len:
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens}: must be below the engine's max_seq_len "
                        f"{engine.max_seq_len} (which also holds the prompt).")


def config_pbtxt(name: str, decoupled: bool) -> str:
    def tensor(name: str, dtype: str, dims: list[int], optional: bool = False) -> str:
        opt = "\n    optional: true" if optional else ""
        return f'  {{\n    name: "{name}"\n    data_type: {dtype}\n    dims: {dims}{opt}\n  }}'

    inputs = ",\n".join(tensor(*t) for t in INPUTS)
    outputs = ",\n".join(tensor(*t) for t in OUTPUTS)
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0  # requests are batched by trtllm-dflash\'s '
            f'scheduler\nmodel_transaction_policy {{\n  decoupled: {str(decoupled).lower()}\n}}\n'
            f'instance_group [\n  {{\n    count: 1\n    kind: KIND_CPU\n  }}\n]\n'
            f'input [\n{inputs}\n]\noutput [\n{outputs}\n]\n')


def write_model_repository(repo: Path, name: str, cfg: ServeConfig, engine: EngineConfig, decoupled: bool = True,
                           force: bool = False) -> Path:
    """Write MODEL_REPO with the one model NAME for `engine` (the config of the already verified cfg.engine_dir);
    returns the model's directory.

    `decoupled` (Triton's transaction policy): streaming, and gRPC streams / HTTP `generate` endpoints
    only; not decoupled: one response per request, for Triton's plain `infer` (HTTP and gRPC), no
    streaming. The same choice as TensorRT-LLM's `triton_config.decoupled`.

    Everything is written into a temporary sibling and renamed into place, so MODEL_REPO is either
    untouched or complete. `force` replaces a MODEL_REPO that trtllm-dflash wrote (all of it), nothing else.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise UserError(f"--model-name {shown(name)}: use letters, digits, '_', '-' and '.' only.")
    repo = check_output_dir(repo, "model repository", "--model-repo", inputs=(Path(cfg.engine_dir),), force=force)
    check_serve_config(cfg, engine)
    with atomic_directory(repo, "model repository", force) as tmp:
        version = tmp / name / MODEL_VERSION
        version.mkdir(parents=True)
        (tmp / name / "config.pbtxt").write_text(config_pbtxt(name, decoupled))
        (version / "model.py").write_text(MODEL_PY)
        (version / SERVE_CONFIG).write_text(cfg.model_dump_json(indent=2) + "\n")
    return repo / name
