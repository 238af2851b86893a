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
GPUS=${GPUS:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
check_count GPUS "$GPUS"
check_count GPUS_PER_NODE "$GPUS_PER_NODE"
SRUN_ARGS=${SRUN_ARGS:-""}
# CPU nodes: GRES= (empty) to ask for no GPUs.
GRES=${GRES-"--gres=gpu:${GPUS_PER_NODE}"}
PY_ARGS=${@:5}
# The interpreter of every task: PYTHON, else the repository's
# .venv/bin/python when it exists (`make install`), else python on PATH.
VENV_PYTHON="$(dirname "$HERE")/.venv/bin/python"
if [ -z "$PYTHON" ] && [ -x "$VENV_PYTHON" ]; then
    export PYTHON=$VENV_PYTHON
fi
export MASTER_PORT=${MASTER_PORT:-29500}

# Each task names its parent (slurmstepd) in MMCV_CUSTOM_LAUNCHER_PID: a rank
# ends with it, SIGKILL included (mmcv_custom/launching/lifetime.py).
PYTHONPATH="$HERE/..":$PYTHONPATH \
srun -p "${PARTITION}" \
    --job-name="${JOB_NAME}" \
    ${GRES} \
    --ntasks="${GPUS}" \
    --ntasks-per-node="${GPUS_PER_NODE}" \
    --cpus-per-task="${CPUS_PER_TASK}" \
    --kill-on-bad-exit=1 \
    ${SRUN_ARGS} \
    bash -c 'export MMCV_CUSTOM_LAUNCHER_PID=$PPID MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}; exec "${PYTHON:-python}" -u "$0" "$@" --launcher slurm' \
    "$HERE/test.py" "${CONFIG}" "${CHECKPOINT}" ${PY_ARGS}
