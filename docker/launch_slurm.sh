#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Launch a tensor-parallel engine over Slurm nodes: `srun --mpi=pmix`, one task per GPU, each task bound to its
# GPU (Slurm's --gpus-per-task=1) and NUMA node (bind_rank.sh). Run it inside an allocation (sbatch / salloc).
#
#   launch_slurm.sh [OPTIONS] run   ENGINE_DIR [trtllm-dflash run options...]
#   launch_slurm.sh [OPTIONS] serve ENGINE_DIR [trtllm-dflash serve options...]
#
# Options (before run / serve):
#   --nodes N           nodes (default: the allocation's, SLURM_JOB_NUM_NODES)
#   --gpus-per-node G   GPUs (tasks) per node (default: the allocation's, SLURM_GPUS_ON_NODE)
#   --cpu               no GPUs: G tasks per node on the CPU, no GPU / NUMA binding, no --device cuda
#   --trtllm-dflash CMD the command every task runs (default: trtllm-dflash, from each node's PATH)
#   --dry-run           print the command instead of running it
#
# The engine's tp_size (ENGINE_DIR/config.json, mapping.tp_size) must equal nodes x GPUs per node; otherwise the
# script refuses with one sentence and exit code 2. ENGINE_DIR must be at the same path on every node. Rank 0
# (first node) opens the torch.distributed store on its host name (MASTER_ADDR overrides it), and serves
# Triton's endpoints when the command is serve (pass --host 0.0.0.0 to reach them from other machines).
# Example, 2 nodes x 8 GPUs, printed and not run:
#   docker/launch_slurm.sh --nodes 2 --gpus-per-node 8 --dry-run run engines/tp16 --input in.jsonl --output o.jsonl
set -euo pipefail
# shellcheck source=launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() { sed -n '3,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}"
gpus="${SLURM_GPUS_ON_NODE:-}"
cpu=0 exe="trtllm-dflash" dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nodes) [[ $# -ge 2 ]] || die "--nodes needs a number."; nodes="$2"; shift 2 ;;
        --gpus-per-node) [[ $# -ge 2 ]] || die "--gpus-per-node needs a number."; gpus="$2"; shift 2 ;;
        --cpu) cpu=1; shift ;;
        --trtllm-dflash) [[ $# -ge 2 ]] || die "--trtllm-dflash needs a command."; exe="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) usage; exit 0 ;;
        run|serve) break ;;
        *) die "unknown option or command $1 (see launch_slurm.sh --help)." ;;
    esac
done
[[ $# -ge 2 ]] || die "usage: launch_slurm.sh [OPTIONS] run|serve ENGINE_DIR [ARGS...] (see --help)."
command="$1" engine="$2"
shift 2
[[ -n "${nodes}" ]] || die "no node count: run inside a Slurm allocation or pass --nodes N."
[[ -n "${gpus}" ]] || die "no GPU count per node: run inside an allocation with GPUs or pass --gpus-per-node G."
positive_int --nodes "${nodes}" 4096
positive_int --gpus-per-node "${gpus}" 64

tp="$(engine_tp_size "${engine}")" || exit 2
unit="GPUs"
[[ "${cpu}" == 1 ]] && unit="CPU ranks"
check_layout "${engine}" "${tp}" "${nodes}" "${gpus}" "${unit}"

# One task per GPU; ranks are numbered node by node (block distribution), so local rank = GPU of its node.
# --cpu-bind=none: bind_rank.sh's numactl binds each task next to its GPU; --kill-on-bad-exit: a dead rank
# ends the job instead of leaving the others waiting in a collective.
launch=(srun --mpi=pmix "--nodes=${nodes}" "--ntasks-per-node=${gpus}" --distribution=block)
[[ "${cpu}" == 0 ]] && launch+=(--gpus-per-task=1)
launch+=(--cpu-bind=none --kill-on-bad-exit=1)

build_rank_cmd "${cpu}" "${gpus}" "${exe}" "${command}" "${engine}" "$@"
full=("${launch[@]}" "${RANK_CMD[@]}")

if [[ "${dry_run}" == 1 ]]; then
    print_cmd "${full[@]}"
    exit 0
fi
command -v srun > /dev/null 2>&1 || die "srun not found: launch_slurm.sh runs inside a Slurm allocation (sbatch / salloc)."
exec "${full[@]}"
