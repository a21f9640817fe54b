# shellcheck shell=bash
# What launch_node.sh and launch_slurm.sh share: the engine's tp_size, the layout check, the rank command and
# how a command is printed. Sourced, never run.

die() { echo "error: $*" >&2; exit 2; }

# The directory of these scripts, resolved: bind_rank.sh is named by this absolute path in every rank's command.
LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"

# tp_size of an engine: config.json's mapping.tp_size (trtllm_dflash/engine_dir.py, EngineConfig.mapping).
# Any problem with the file (not JSON, not UTF-8, not an object, no integer tp_size in 1..4096) is one sentence.
engine_tp_size() {
    local engine="$1" config="$1/config.json"
    [[ -e "${engine}" ]] || die "${engine}: engine directory does not exist."
    [[ -d "${engine}" ]] || die "${engine}: engine directory is a file, not a directory."
    [[ -f "${config}" ]] || die "${config} not found: ${engine} is not an engine directory."
    "${PYTHON:-python3}" - "${config}" <<'EOF' || die "${config}: no readable mapping.tp_size (is it an engine's config.json?)."
import json, sys
try:
    with open(sys.argv[1], encoding="utf-8") as f:
        tp = json.load(f)["mapping"]["tp_size"]
except (OSError, ValueError, KeyError, TypeError, RecursionError):
    sys.exit(1)
if type(tp) is not int or not 1 <= tp <= 4096:
    sys.exit(1)
print(tp)
EOF
}

# Refuse, in one sentence, a layout whose number of ranks is not the engine's tp_size.
check_layout() {
    local engine="$1" tp="$2" nodes="$3" per_node="$4" unit="$5"
    local ranks=$(( nodes * per_node ))
    if (( ranks != tp )); then
        local node_word="nodes"
        (( nodes == 1 )) && node_word="node"
        die "${engine} was built for tp_size ${tp}, but ${nodes} ${node_word} x ${per_node} ${unit} per node is ${ranks} ranks; launch it on ${tp} ${unit} in all, or rebuild it with tp_size: ${ranks}."
    fi
}

# True when the argument list names an option (--device or --device=...).
has_option() {
    local name="$1"
    shift
    local a
    for a in "$@"; do
        [[ "${a}" == "${name}" || "${a}" == "${name}="* ]] && return 0
    done
    return 1
}

# RANK_CMD: what every rank runs, bind_rank.sh in front.
#   build_rank_cmd CPU(0|1) GPUS_PER_NODE TRTLLM_DFLASH COMMAND ENGINE_DIR ARGS...
# `run` on GPUs gets --device cuda (each rank sees one GPU, so rank r uses cuda:0 = its own) unless ARGS
# name a device; `serve` gets --launch (rank 0 starts tritonserver, the others follow) unless ARGS have it.
build_rank_cmd() {
    local cpu="$1" gpus="$2" exe="$3" command="$4" engine="$5"
    shift 5
    RANK_CMD=("${LAUNCH_DIR}/bind_rank.sh")
    if [[ "${cpu}" == 1 ]]; then
        RANK_CMD+=(--cpu)
    else
        RANK_CMD+=(--gpus "${gpus}")
    fi
    RANK_CMD+=(-- "${exe}" "${command}" "${engine}")
    if [[ "${command}" == run && "${cpu}" == 0 ]] && ! has_option --device "$@"; then
        RANK_CMD+=(--device cuda)
    fi
    if [[ "${command}" == serve ]] && ! has_option --launch "$@"; then
        RANK_CMD+=(--launch)
    fi
    RANK_CMD+=("$@")
}

# One shell-quoted line, quoted exactly as Python's shlex.join quotes (so tests can compare it).
print_cmd() {
    local out=() a
    for a in "$@"; do
        if [[ -n "${a}" && "${a}" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            out+=("${a}")
        else
            out+=("'${a//\'/\'\"\'\"\'}'")
        fi
    done
    local IFS=' '
    echo "${out[*]}"
}

# positive_int NAME VALUE MAX: VALUE is a decimal integer from 1 to MAX, checked as a string first: bash arithmetic
# wraps at 2^64 (18446744073709551618 would count as 2) and reads 010 as octal.
positive_int() {
    local name="$1" value="$2" max="$3"
    if ! [[ "${value}" =~ ^[1-9][0-9]{0,5}$ ]] || (( value > max )); then
        die "${name} must be an integer from 1 to ${max}, not '${value:0:40}'."
    fi
}
