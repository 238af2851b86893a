#!/usr/bin/env bash
# Usage: [GPUS=8 GPUS_PER_NODE=8 CPUS_PER_TASK=5] \
#   tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args...]
PROG=slurm_test.sh
USAGE="usage: [GPUS=N GPUS_PER_NODE=N] $PROG PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args...]"
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/launch_checks.sh"
help_requested "$@" && exit 0
if [ $# -lt 4 ]; then
    usage_error "PARTITION, JOB_NAME, CONFIG and CHECKPOINT are required"
fi
PARTITION=$1
JOB_NAME=$2
CONFIG=$3
CHECKPOINT=$4
if ! is_config "$CONFIG" && is_config "$CHECKPOINT"; then
    usage_error "CONFIG comes first, then CHECKPOINT (got '$CONFIG' '$CHECKPOINT')"
fi
check_config "$CONFIG"
check_slurm_sizes
PY_ARGS=${@:5}
srun_ranks "$HERE/test.py" "${CONFIG}" "${CHECKPOINT}" ${PY_ARGS}
