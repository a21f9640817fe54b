#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Launch a tensor-parallel engine on one node: one MPI rank per GPU, each bound to its GPU and NUMA node.
#
#   launch_node.sh [OPTIONS] run   ENGINE_DIR [trtllm-dflash run options...]
#   launch_node.sh [OPTIONS] serve ENGINE_DIR [trtllm-dflash serve options...]
#
# Options (before run / serve):
#   --gpus-per-node N   GPUs (ranks) on this node (default: nvidia-smi -L's count)
#   --cpu               no GPUs: N ranks on the CPU, no GPU / NUMA binding, no --device cuda (tests, laptops)
#   --mpi KIND          openmpi | mpich: the launcher's flags (default: asked from `LAUNCHER --version`)
#   --launcher PATH     mpirun / mpiexec to use (default: mpirun on PATH, else mpiexec)
#   --trtllm-dflash CMD the command every rank runs (default: trtllm-dflash, from each rank's PATH)
#   --dry-run           print the command instead of running it
#
# The engine's tp_size (ENGINE_DIR/config.json, mapping.tp_size) must equal the GPUs used; otherwise the script
# refuses with one sentence and exit code 2. Example, 8 GPUs, printed and not run:
#   docker/launch_node.sh --dry-run run engines/qwen3-8b-tp8 --input in.jsonl --output out.jsonl
#   /usr/bin/mpirun -n 8 --bind-to none /repo/docker/bind_rank.sh --gpus 8 -- trtllm-dflash run \
#       engines/qwen3-8b-tp8 --device cuda --input in.jsonl --output out.jsonl
set -euo pipefail
# shellcheck source=launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() { sed -n '3,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

gpus="" cpu=0 mpi="" launcher="" exe="trtllm-dflash" dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --gpus-per-node) [[ $# -ge 2 ]] || die "--gpus-per-node needs a number."; gpus="$2"; shift 2 ;;
        --cpu) cpu=1; shift ;;
        --mpi) [[ $# -ge 2 ]] || die "--mpi needs openmpi or mpich."; mpi="$2"; shift 2 ;;
        --launcher) [[ $# -ge 2 ]] || die "--launcher needs a path."; launcher="$2"; shift 2 ;;
        --trtllm-dflash) [[ $# -ge 2 ]] || die "--trtllm-dflash needs a command."; exe="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) usage; exit 0 ;;
        run|serve) break ;;
        *) die "unknown option or command $1 (see launch_node.sh --help)." ;;
    esac
done
[[ $# -ge 2 ]] || die "usage: launch_node.sh [OPTIONS] run|serve ENGINE_DIR [ARGS...] (see --help)."
command="$1" engine="$2"
shift 2
[[ "${mpi}" == "" || "${mpi}" == openmpi || "${mpi}" == mpich ]] || die "--mpi must be openmpi or mpich, not '${mpi}'."

tp="$(engine_tp_size "${engine}")" || exit 2

# The node's GPUs: as told, or counted by nvidia-smi.
if [[ -z "${gpus}" ]]; then
    if [[ "${cpu}" == 0 ]] && command -v nvidia-smi > /dev/null 2>&1; then
        gpus="$(nvidia-smi -L | grep -c '^GPU ' || true)"
        [[ "${gpus}" != 0 ]] || die "nvidia-smi lists no GPU on this node; pass --gpus-per-node N (and --cpu to run without GPUs)."
    else
        die "cannot count this node's GPUs (no nvidia-smi, or --cpu): pass --gpus-per-node N."
    fi
fi
positive_int --gpus-per-node "${gpus}" 64

unit="GPUs"
[[ "${cpu}" == 1 ]] && unit="CPU ranks"
check_layout "${engine}" "${tp}" 1 "${gpus}" "${unit}"

# The launcher and its flavour (their flags differ).
if [[ -z "${launcher}" ]]; then
    case "${mpi}" in
        openmpi) launcher="$(command -v mpirun || echo mpirun)" ;;
        mpich) launcher="$(command -v mpiexec || echo mpiexec)" ;;
        *) launcher="$(command -v mpirun || command -v mpiexec || true)" ;;
    esac
elif [[ "${launcher}" != */* ]]; then
    launcher="$(command -v "${launcher}" || echo "${launcher}")"
fi
if [[ -z "${mpi}" ]]; then
    [[ -n "${launcher}" ]] || die "no mpirun or mpiexec on PATH: pip install 'trtllm-dflash[mpi]' (MPICH) or load your MPI."
    version="$("${launcher}" --version 2>&1 || true)"
    if grep -qiE 'open mpi|openrte|prrte' <<< "${version}"; then
        mpi=openmpi
    elif grep -qiE 'hydra|mpich' <<< "${version}"; then
        mpi=mpich
    else
        die "${launcher} is neither Open MPI nor MPICH (by its --version); pass --mpi openmpi or --mpi mpich."
    fi
fi

launch=("${launcher}" -n "${tp}")
if [[ "${mpi}" == openmpi ]]; then
    # Open MPI binds ranks to cores by default: numactl in bind_rank.sh decides instead.
    launch+=(--bind-to none)
    [[ "${EUID}" == 0 ]] && launch+=(--allow-run-as-root)   # Open MPI refuses root without it (containers)
    [[ "${cpu}" == 1 ]] && launch+=(--oversubscribe)        # CPU ranks may outnumber the cores
else
    launch+=(-bind-to none)                                  # MPICH's hydra spells it with one dash
fi

build_rank_cmd "${cpu}" "${gpus}" "${exe}" "${command}" "${engine}" "$@"
full=("${launch[@]}" "${RANK_CMD[@]}")

if [[ "${dry_run}" == 1 ]]; then
    print_cmd "${full[@]}"
    exit 0
fi
[[ -x "${launcher}" ]] || command -v "${launcher}" > /dev/null 2>&1 || die "${launcher} not found: pip install 'trtllm-dflash[mpi]' or load your MPI."
exec "${full[@]}"
