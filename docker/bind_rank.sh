#!/usr/bin/env bash
# Per-rank wrapper: gives one MPI rank its GPU and the NUMA node next to it, then runs the rank's command.
#
#   bind_rank.sh --gpus N -- trtllm-dflash run ENGINE_DIR ...    # N GPUs on this node, one per local rank
#   bind_rank.sh --cpu -- trtllm-dflash run ENGINE_DIR ...       # no GPUs: run the command as it is
#
# launch_node.sh and launch_slurm.sh put it in front of every rank's command; it must exist at the same path
# on every node (a shared file system, or the image). The local rank comes from the launcher:
# OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID (MPICH's hydra), PMI_LOCAL_RANK, SLURM_LOCALID (srun).
#
# GPU: CUDA_VISIBLE_DEVICES unset -> the GPU numbered like the local rank; a list of several -> its local-rank-th
# entry; exactly one entry (srun --gpus-per-task=1 binds each task itself) -> kept. Device numbers follow
# nvidia-smi's PCI order (CUDA_DEVICE_ORDER=PCI_BUS_ID), so nvidia-smi and CUDA name the same GPU.
# NUMA: TRTLLM_DFLASH_NUMA_NODES="0,0,0,0,1,1,1,1" (node of each local rank) if set; else the node of the GPU's
# PCI device (nvidia-smi's bus id -> /sys/bus/pci/devices/*/numa_node); else GPUs spread evenly over the
# nodes (GPU g of N on node g * nodes / N). The command runs under `numactl --cpunodebind=K --membind=K`;
# without numactl or nvidia-smi it runs unbound, with a message from local rank 0.
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }
note() { if [[ "${local_rank}" == 0 ]]; then echo "bind_rank.sh: $*" >&2; fi; }

gpus=""
cpu=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --gpus) [[ $# -ge 2 ]] || die "--gpus needs a number."; gpus="$2"; shift 2 ;;
        --cpu) cpu=1; shift ;;
        --) shift; break ;;
        *) die "unknown option $1 (usage: bind_rank.sh --gpus N | --cpu -- COMMAND ...)." ;;
    esac
done
[[ $# -gt 0 ]] || die "no command to run (usage: bind_rank.sh --gpus N | --cpu -- COMMAND ...)."

local_rank="${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PMI_LOCAL_RANK:-${SLURM_LOCALID:-}}}}"
[[ -n "${local_rank}" ]] || die "no local rank in the environment: start this under mpirun, mpiexec or srun."
# Checked as decimal strings before any arithmetic: bash evaluates a variable's text as an expression and wraps at 2^64.
[[ "${local_rank}" =~ ^(0|[1-9][0-9]{0,5})$ ]] || die "the local rank '${local_rank:0:40}' from the launcher is not a number."

if [[ "${cpu}" == 1 ]]; then
    exec "$@"
fi
if ! [[ "${gpus}" =~ ^[1-9][0-9]{0,5}$ ]] || (( gpus > 64 )); then
    die "--gpus must be an integer from 1 to 64, not '${gpus:0:40}'."
fi
(( local_rank < gpus )) || die "local rank ${local_rank} has no GPU: this node has ${gpus} (--gpus-per-node)."

# --- the GPU ------------------------------------------------------------------------------------------------
export CUDA_DEVICE_ORDER=PCI_BUS_ID
IFS=',' read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
if [[ ${#visible[@]} -eq 1 ]]; then
    gpu="${visible[0]}"                         # already bound by the launcher (srun --gpus-per-task=1)
elif [[ ${#visible[@]} -gt 1 ]]; then
    (( local_rank < ${#visible[@]} )) || die "local rank ${local_rank} has no GPU in CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES}."
    gpu="${visible[${local_rank}]}"
else
    gpu="${local_rank}"
fi
export CUDA_VISIBLE_DEVICES="${gpu}"

# --- the NUMA node ------------------------------------------------------------------------------------------
if ! command -v numactl > /dev/null 2>&1; then
    note "numactl not found: ranks are not NUMA-bound (apt-get install numactl)."
    exec "$@"
fi
numa=""
if [[ -n "${TRTLLM_DFLASH_NUMA_NODES:-}" ]]; then
    IFS=',' read -r -a numa_map <<< "${TRTLLM_DFLASH_NUMA_NODES}"
    (( local_rank < ${#numa_map[@]} )) || die "TRTLLM_DFLASH_NUMA_NODES has no entry for local rank ${local_rank}."
    numa="${numa_map[${local_rank}]}"
else
    if ! command -v nvidia-smi > /dev/null 2>&1; then
        note "nvidia-smi not found: ranks are not NUMA-bound (set TRTLLM_DFLASH_NUMA_NODES to bind anyway)."
        exec "$@"
    fi
    # "00000000:18:00.0" -> sysfs's "0000:18:00.0"
    bus_id="$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i "${gpu}" 2> /dev/null | head -n 1 || true)"
    bus_id="$(echo "${bus_id}" | tr '[:upper:]' '[:lower:]' | sed -E 's/^0{4}([0-9a-f]{4}:)/\1/')"
    if [[ -n "${bus_id}" && -r "/sys/bus/pci/devices/${bus_id}/numa_node" ]]; then
        numa="$(cat "/sys/bus/pci/devices/${bus_id}/numa_node")"
    fi
    if [[ -z "${numa}" || "${numa}" == "-1" ]]; then  # -1: the kernel does not know; spread evenly instead
        nodes="$(numactl --hardware 2> /dev/null | sed -n -E 's/^available: ([0-9]+) nodes.*/\1/p')"
        nodes="${nodes:-1}"
        [[ "${gpu}" =~ ^[0-9]{1,6}$ ]] || gpu_index="${local_rank}"  # a UUID, or digits too many to count with
        numa=$(( ${gpu_index:-${gpu}} * nodes / gpus ))
    fi
fi
[[ "${numa}" =~ ^[0-9]+$ ]] || die "NUMA node '${numa}' for local rank ${local_rank} is not a number."
if ! numactl --cpunodebind="${numa}" --membind="${numa}" true > /dev/null 2>&1; then
    note "numactl cannot bind to NUMA node ${numa} here (a CPU set or container limit): ranks are not NUMA-bound."
    exec "$@"
fi
exec numactl --cpunodebind="${numa}" --membind="${numa}" "$@"
