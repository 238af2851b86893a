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
GPUS=${GPUS:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
check_count GPUS "$GPUS"
check_count GPUS_PER_NODE "$GPUS_PER_NODE"
SRUN_ARGS=${SRUN_ARGS:-""}
# CPU nodes: GRES= (empty) to ask for no GPUs.
GRES=${GRES-"--gres=gpu:${GPUS_PER_NODE}"}
PY_ARGS=${@:4}
# The interpreter of every task: PYTHON, else the repository's
# .venv/bin/python when it exists (`make install`), else python on PATH.
VENV_PYTHON="$(dirname "$HERE")/.venv/bin/python"
if [ -z "$PYTHON" ] && [ -x "$VENV_PYTHON" ]; then
    export PYTHON=$VENV_PYTHON
fi
# MASTER_ADDR for gloo on CPU nodes: the first host of the allocation.
export MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-0}
case "$MAX_RESTARTS" in
    ''|*[!0-9]*)
        echo "slurm_train.sh: MAX_RESTARTS=$MAX_RESTARTS: expected a whole number >= 0 (restarts after a failure)" >&2
        exit 2 ;;
esac

# Each task names its parent (slurmstepd) in MMCV_CUSTOM_LAUNCHER_PID: a rank
# ends with it, SIGKILL included (mmcv_custom/launching/lifetime.py).
attempt=0
while true; do
    PYTHONPATH="$HERE/..":$PYTHONPATH \
        MMCV_CUSTOM_RESTART_COUNT=$attempt \
        srun -p "${PARTITION}" \
        --job-name="${JOB_NAME}" \
        ${GRES} \
        --ntasks="${GPUS}" \
        --ntasks-per-node="${GPUS_PER_NODE}" \
        --cpus-per-task="${CPUS_PER_TASK}" \
        --kill-on-bad-exit=1 \
        ${SRUN_ARGS} \
        bash -c 'export MMCV_CUSTOM_LAUNCHER_PID=$PPID MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}; exec "${PYTHON:-python}" -u "$0" "$@" --launcher slurm' \
        "$HERE/train.py" "${CONFIG}" ${PY_ARGS}
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
