"""Serving a tensor-parallel engine: `mpirun -n N trtllm-dflash serve ENGINE --model-repo R --launch`.

As in TensorRT-LLM's Triton model, rank 0 serves and the other ranks follow:

- MPI rank 0 opens the torch.distributed store, writes the model repository and starts tritonserver
  with the store's address in TRTLLM_DFLASH_TP_STORE;
- the Triton model (in the Python-backend stub: a child of tritonserver, not an MPI process) joins
  the process group as rank 0, loads rank 0's shard and drives the Decoder in lockstep
  (runtime/lockstep.py) from its serving loop;
- MPI ranks 1..N-1 load their shards and follow every step until the model is unloaded.

If tritonserver ends with an error, MPI rank 0 aborts the job, so no follower is left waiting.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch.distributed as dist

from trtllm_dflash.engine_dir import EngineConfig, open_engine
from trtllm_dflash.errors import UserError
from trtllm_dflash.parallel.world import COLLECTIVE_TIMEOUT, AgreedError, World, mpi_comm, rendezvous
from trtllm_dflash.runtime.lockstep import LockstepDriver, follow
from trtllm_dflash.runtime.options import RunOptions
from trtllm_dflash.runtime.runner import Engine, prepare
from trtllm_dflash.serve.repository import ServeConfig

STORE_ENV = "TRTLLM_DFLASH_TP_STORE"  # "host:port:world_size", set for tritonserver by MPI rank 0


def _options(cfg: ServeConfig) -> RunOptions:
    return RunOptions(mode=cfg.mode, block_size=cfg.block_size, threads=cfg.threads, backend=cfg.backend,
                      kv_cache_memory=cfg.kv_cache_memory, prefix_cache=cfg.prefix_cache, tree_budget=cfg.tree_budget,
                      prefix_states=cfg.prefix_states)


def check_launch(cfg: ServeConfig, launching: bool) -> EngineConfig:
    """The engine's config (its shared files and rank 0's weights verified), when this is how it is served: one
    process for tp_size 1, `mpirun -n N ... --launch` for N > 1. Every MPI rank checks; an error is printed by
    rank 0 only."""
    comm = mpi_comm()
    size = comm.Get_size() if comm is not None else 1
    quiet = comm is not None and comm.Get_rank() != 0
    try:
        engine = open_engine(Path(cfg.engine_dir), rank=0)
    except UserError as exc:
        raise AgreedError(str(exc), quiet) from None
    tp = engine.mapping.tp_size
    if tp == size and (tp == 1 or launching):
        return engine
    message = (f"{cfg.engine_dir}: the engine is split for tp_size {tp}; serve it with "
               f"`mpirun -n {tp} trtllm-dflash serve ... --launch`" +
               (f" (this is {size} process{'es' if size > 1 else ''})." if tp != size else "."))
    raise AgreedError(message, quiet)


def serve_under_mpi(cfg: ServeConfig, serve_rank0) -> int:
    """Every MPI rank of `mpirun -n N trtllm-dflash serve`: rank 0 runs `serve_rank0()` (write the repository,
    run tritonserver); the others follow the Triton model's decoder."""
    comm = mpi_comm()
    store = rendezvous(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        os.environ[STORE_ENV] = f"{store.host}:{store.port}:{size}"
        code = serve_rank0()
        if code != 0:
            World(rank, size, comm).abort(f"tritonserver exited with code {code}", code)
        return code
    # mpirun passes SIGINT / SIGTERM to every rank: followers leave when the model releases them after
    # tritonserver's graceful shutdown (or are killed by mpirun if rank 0 dies).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    world = World(rank, size, comm)
    _, decoder = prepare(cfg.engine_dir, _options(cfg), world)
    follow(decoder)
    world.close()
    return 0


def join_as_rank0(cfg: ServeConfig) -> tuple[Engine, LockstepDriver, World]:
    """In the Triton model: join the followers' process group as rank 0; rank 0's engine and lockstep driver."""
    address = os.environ.get(STORE_ENV)
    if not address:
        raise UserError(f"{cfg.engine_dir}: a tensor-parallel engine is served with `mpirun -n N trtllm-dflash "
                        f"serve ... --launch` ({STORE_ENV} is not set, so there are no follower ranks).")
    host, port, size = address.rsplit(":", 2)
    store = dist.TCPStore(host, int(port), int(size), is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=0, world_size=int(size), timeout=COLLECTIVE_TIMEOUT)
    world = World(0, int(size))
    engine, decoder = prepare(cfg.engine_dir, _options(cfg), world)
    return engine, LockstepDriver(decoder), world
