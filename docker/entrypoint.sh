#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# The GPU image's entry point: `docker run IMAGE <command> [args...]`.
#
#   build CONFIG.yaml [...]            trtllm-dflash build
#   compile ENGINE_DIR [...]           trtllm-dflash compile, with the image's DFlash plugin library unless
#                                      --plugin-library is given
#   run ENGINE_DIR [...]               trtllm-dflash run (tp_size 1; tensor-parallel engines: launch-node run)
#   serve ENGINE_DIR [...]             trtllm-dflash serve --launch, endpoints on 0.0.0.0:8000/8001/8002, model
#                                      repository in $TRTLLM_DFLASH_MODEL_REPO; an engine with tp_size > 1 goes
#                                      through launch_node.sh (one rank per GPU, rank 0 serving)
#   launch-node [...] run|serve ...    docker/launch_node.sh: one rank per GPU under mpirun
#   launch-slurm [...] run|serve ...   docker/launch_slurm.sh
#   inspect | compare | bench | train-drafter | make-random-pair ...   the trtllm-dflash command of that name
#   anything else                      run as a command (bash, nvidia-smi, ...)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
# shellcheck source=launch_common.sh
source "${here}/launch_common.sh"
plugin="${TRTLLM_DFLASH_PLUGIN:-/opt/trtllm-dflash/lib/libtrtllm_dflash_plugins.so}"

if [[ $# -eq 0 || "$1" == -h || "$1" == --help ]]; then
    exec trtllm-dflash --help
fi
command="$1"
shift
case "${command}" in
    build|run|inspect|compare|bench|train-drafter|make-random-pair)
        exec trtllm-dflash "${command}" "$@" ;;
    compile)
        extra=()
        if ! has_option --plugin-library "$@" && [[ -f "${plugin}" ]]; then
            extra=(--plugin-library "${plugin}")
        fi
        exec trtllm-dflash compile "$@" "${extra[@]}" ;;
    serve)
        extra=()
        has_option --launch "$@" || extra+=(--launch)
        has_option --host "$@" || extra+=(--host 0.0.0.0)            # reachable through the published ports
        # --force: a container restarted by its restart policy finds the repository it wrote before.
        has_option --model-repo "$@" || extra+=(--model-repo "${TRTLLM_DFLASH_MODEL_REPO:-/tmp/trtllm-dflash-repo}" --force)
        # A tensor-parallel engine: one rank per GPU of this container, rank 0 serving (launch_node.sh).
        tp=1
        if [[ $# -gt 0 && -f "$1/config.json" ]]; then
            tp="$(engine_tp_size "$1")" || exit 2
        fi
        if (( tp > 1 )); then
            exec "${here}/launch_node.sh" serve "$@" "${extra[@]}"
        fi
        exec trtllm-dflash serve "$@" "${extra[@]}" ;;
    launch-node)
        exec "${here}/launch_node.sh" "$@" ;;
    launch-slurm)
        exec "${here}/launch_slurm.sh" "$@" ;;
    *)
        exec "${command}" "$@" ;;
esac
