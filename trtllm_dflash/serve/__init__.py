"""Serving with Triton Inference Server: a model repository for an engine, and a scheduler that batches
requests from many clients (see repository.py, scheduler.py, triton_model.py, launch.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from trtllm_dflash.engine_dir import EngineConfig
from trtllm_dflash.serve.launch import NGC_IMAGE, Endpoints, check_endpoints, find_tritonserver, launch
from trtllm_dflash.serve.repository import ServeConfig, write_model_repository


def serve(repo: Path, name: str, cfg: ServeConfig, engine: EngineConfig, decoupled: bool, force: bool,
          endpoints: Endpoints | None) -> int:
    """The `serve` command: write the repository for the verified `engine`; with `endpoints`, run tritonserver on
    it (its exit code)."""
    install = None
    if endpoints is not None:  # fail before writing anything
        check_endpoints(endpoints)
        install = find_tritonserver()
    model_dir = write_model_repository(repo, name, cfg, engine, decoupled, force)
    print(f"model repository written to {Path(repo).absolute()} (model {name!r}: {model_dir})", file=sys.stderr)
    if install is None:
        print(f"start it with: tritonserver --model-repository {Path(repo).absolute()} (in the {NGC_IMAGE} image, "
              f"with trtllm-dflash installed), or add --launch", file=sys.stderr)
        return 0
    return launch(install, Path(repo).absolute(), endpoints)
