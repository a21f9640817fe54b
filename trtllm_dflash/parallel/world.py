"""Ranks from MPI: bring-up of torch.distributed under `mpirun -n N`, agreement on errors, aborting.

A process started without an MPI launcher is a world of one and never imports mpi4py. Under
`mpirun` / `mpiexec` (MPICH's hydra or Open MPI), mpi4py gives the rank and size; rank 0 opens a
torch.distributed TCPStore on a free port and sends its address to the others over MPI, and every
rank joins the process group used by the sharded model's collectives: gloo on the CPU; on CUDA one group
with two backends, `cpu:gloo,cuda:nccl` (group_backend), because the lockstep headers, the new requests and
`agree`'s errors are CPU tensors and objects, which an NCCL-only group cannot carry ("No backend type
associated with device type cpu"). Before an NCCL group starts, each rank makes the GPU of its local rank
(its place among the ranks on its node, from the launcher: local_rank) torch's current device: NCCL's
communicator, ProcessGroupNCCL._comm_ptr and every `cuda` tensor without an index follow the current device,
which is GPU 0 in every rank otherwise.

Failure policy: errors while loading (bad engine file, wrong number of ranks, ...) are exchanged
with `agree`, so every rank exits with the same error printed once by rank 0. An error after that
(while decoding) is printed by the failing rank and aborts the whole MPI job, so no rank waits
forever on a collective; a killed rank is detected by the MPI launcher, which ends the others.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from trtllm_dflash.errors import UserError
from trtllm_dflash.parallel.group import TPGroup

T = TypeVar("T")

# Set by MPICH/hydra (PMI_*), Open MPI (OMPI_*) and PMIx launchers (srun --mpi=pmix).
_LAUNCHER_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
# A rank's place among the ranks of its node, as launchers say it (docker/bind_rank.sh reads the same, in this
# order): Open MPI, MPICH's hydra (and Intel MPI), PMI-2 launchers, Slurm's srun.
LOCAL_RANK_ENV = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def launched_by_mpi() -> bool:
    return any(k in os.environ for k in _LAUNCHER_ENV)


@dataclass
class World:
    """This process's place among the ranks of a tensor-parallel job (a world of one by default)."""

    rank: int = 0
    size: int = 1
    comm: Any = None  # mpi4py communicator (None in a world of one, or in a rank that is no MPI process)
    local_rank: int = 0  # this rank's place among the ranks on its node: which of the node's GPUs it drives

    @property
    def tp(self) -> TPGroup:
        return TPGroup(self.rank, self.size)

    def agree(self, fn: Callable[[], T]) -> T:
        """Run fn on every rank; if it fails on any, raise on every rank (rank 0's message names the ranks)."""
        if self.size == 1:
            return fn()
        try:
            value, error = fn(), None
        except UserError as exc:
            value, error = None, str(exc)
        except Exception as exc:  # noqa: BLE001 - reported below with its type, on every rank
            value, error = None, f"{type(exc).__name__}: {exc}"
        errors: list[str | None] = [None] * self.size
        dist.all_gather_object(errors, error)
        if any(errors):
            first = next(e for e in errors if e)
            ranks = [r for r, e in enumerate(errors) if e == first]
            where = "" if len(ranks) == self.size else f" (rank {', '.join(map(str, ranks))})"
            raise AgreedError(first.rstrip(".") + where + ".", quiet=self.rank != 0)
        return value

    def from_rank0(self, fn: Callable[[], T]) -> T:
        """fn's value on rank 0, on every rank: fn runs on rank 0 only (it may read files the others must not race
        for); its error is raised on every rank, as `agree`'s."""
        if self.size == 1:
            return fn()
        box = [self.agree(fn if self.rank == 0 else lambda: None)]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Leave the process group cleanly (gloo's threads otherwise end the process with std::terminate)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def abort(self, message: str, code: int = 1) -> None:
        """Print this rank's error and end every rank of the job (never returns)."""
        print(f"error (rank {self.rank} of {self.size}): {message}", file=sys.stderr, flush=True)
        if self.comm is not None and self.size > 1:
            self.comm.Abort(code)
        raise SystemExit(code)


class AgreedError(UserError):
    """An error every rank raised together; only rank 0 prints it (`quiet` on the others)."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet


def group_backend(backend: str) -> str:
    """torch.distributed's backend for `init_world(backend)`: "gloo" as is; "nccl" -> "cpu:gloo,cuda:nccl" (the
    CPU traffic of lockstep decoding and `agree` goes through gloo, the model's CUDA collectives through NCCL);
    a spec of device:backend pairs ("cpu:gloo,cuda:nccl") as given."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank among the ranks on its node, from the first of LOCAL_RANK_ENV the launcher set (None if
    it set none). Example: Open MPI's OMPI_COMM_WORLD_LOCAL_RANK=3 -> 3."""
    env = os.environ if env is None else env
    for key in LOCAL_RANK_ENV:
        value = env.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return None


def cuda_device_index(local: int, device_count: int) -> int:
    """The GPU a rank drives: its local rank among the node's visible GPUs (with CUDA_VISIBLE_DEVICES narrowed to one
    GPU per rank, as docker/bind_rank.sh does, always 0). Example: local rank 5 of 8 GPUs -> 5; of 1 -> 0."""
    if device_count < 1:
        raise ValueError("no CUDA device is visible")
    return local % device_count


def init_world(backend: str = "gloo") -> World:
    """The MPI world this process belongs to, with torch.distributed initialised when it has > 1 rank (`backend`:
    see group_backend). A backend with a CUDA part makes the GPU of this rank's local rank the current device first."""
    comm = mpi_comm()
    if comm is None or comm.Get_size() == 1:
        return World(comm=comm)
    local = local_rank()
    if local is None:  # a launcher that sets none of LOCAL_RANK_ENV: MPI knows which ranks share this node
        from mpi4py import MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank()).Get_rank()
    world = World(comm.Get_rank(), comm.Get_size(), comm, local)
    spec = group_backend(backend)
    if "cuda" in spec and torch.cuda.is_available():  # never on our CPU machines: written, not run
        torch.cuda.set_device(cuda_device_index(local, torch.cuda.device_count()))
    store = rendezvous(comm)
    dist.init_process_group(spec, store=store, rank=world.rank, world_size=world.size, timeout=COLLECTIVE_TIMEOUT)
    return world


def mpi_comm() -> Any:
    """mpi4py's COMM_WORLD when started by an MPI launcher, else None (mpi4py is then never imported)."""
    if not launched_by_mpi():
        return None
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise UserError(f"running under an MPI launcher needs mpi4py: pip install 'trtllm-dflash[mpi]' ({exc}).") from None
    return MPI.COMM_WORLD


def rendezvous(comm: Any) -> dist.TCPStore:
    """A torch.distributed TCPStore served by MPI rank 0 on a free port, its address sent to every rank
    (`store.host`, `store.port`)."""
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else socket.gethostname())
    size = comm.Get_size()
    if comm.Get_rank() == 0:
        store = dist.TCPStore(host, 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        comm.bcast((host, store.port), root=0)
        return store
    host, port = comm.bcast(None, root=0)
    return dist.TCPStore(host, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
