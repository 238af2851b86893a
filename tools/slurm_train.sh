#!/usr/bin/env bash
# Usage: [GPUS=16 GPUS_PER_NODE=8 CPUS_PER_TASK=5] \
#   tools/slurm_train.sh PARTITION JOB_NAME CONFIG [train.py args...]
# e.g. tools/slurm_train.sh PARTITION JOB CONFIG --work-dir DIR (the work dir
# is train.py's --work-dir, not an argument of its own).
# One task per GPU; MMEngine reads SLURM_* for rank and world size. On CPU
# nodes (no CUDA) set GPUS to the number of ranks: train.py starts gloo.
# MAX_RESTARTS=N runs the job step again, up to N times, after a failure;
# a restarted run resumes from the newest intact checkpoint.
PROG=slurm_train.sh
USAGE="usage: [GPUS=N GPUS_PER_NODE=N] $PROG PARTITION JOB_NAME CONFIG [train.py args...]"
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/launch_checks.sh"
help_requested "$@" && exit 0
if [ $# -lt 3 ]; then
    usage_error "PARTITION, JOB_NAME and CONFIG are required"
fi
PARTITION=$1
JOB_NAME=$2
CONFIG=$3
check_config "$CONFIG"
check_slurm_sizes
PY_ARGS=${@:4}
check_max_restarts

attempt=0
while true; do
    MMCV_CUSTOM_RESTART_COUNT=$attempt \
        srun_ranks "$HERE/train.py" "${CONFIG}" ${PY_ARGS}
    status=$?
    # 2: a usage or preflight error (a missing file, a bad value), which a
    # restart would only print again.
    if [ "$status" -eq 0 ] || [ "$status" -eq 2 ] ||
        [ "$attempt" -ge "$MAX_RESTARTS" ]; then
        exit "$status"
    fi
    attempt=$((attempt + 1))
    echo "slurm_train.sh: the job step failed (exit $status): restart $attempt of $MAX_RESTARTS" >&2
done
