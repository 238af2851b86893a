#!/usr/bin/env bash
# Usage: tools/dist_train.sh CONFIG NPROC_PER_NODE [train.py args...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR and PORT on every node.
# PYTHON picks the interpreter; by default the repository's .venv/bin/python
# when it exists (what `make install` builds), else python on PATH.
# MAX_RESTARTS=N restarts every rank up to N times after a failure, but not
# after exit code 2 (a usage or preflight error); a restarted run resumes from
# the newest intact checkpoint. Ranks end with the launcher, SIGKILL included.
# A failed run ends with the cause (from the first rank that failed), the log
# file and the exit code (mmcv_custom/launching/torchrun.py: torchrun, reporting so).
PROG=dist_train.sh
USAGE="usage: $PROG CONFIG NPROC_PER_NODE [train.py args...]"
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/launch_checks.sh"
help_requested "$@" && exit 0
CONFIG=$1
NPROC=$2
case $# in
    0) usage_error "CONFIG and NPROC_PER_NODE are required" ;;
    1) usage_error "NPROC_PER_NODE is missing" ;;
esac
if is_count "$CONFIG" && is_config "$NPROC"; then
    usage_error "CONFIG comes first, then NPROC_PER_NODE (got '$CONFIG' '$NPROC')"
fi
check_config "$CONFIG"
check_count NPROC_PER_NODE "$NPROC"
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
MAX_RESTARTS=${MAX_RESTARTS:-0}
case "$MAX_RESTARTS" in
    ''|*[!0-9]*)
        echo "dist_train.sh: MAX_RESTARTS=$MAX_RESTARTS: expected a whole number >= 0 (restarts after a failure)" >&2
        exit 2 ;;
esac
VENV_PYTHON="$(dirname "$HERE")/.venv/bin/python"
if [ -z "$PYTHON" ] && [ -x "$VENV_PYTHON" ]; then
    PYTHON=$VENV_PYTHON
fi
# torchrun's own default, without its banner.
if [ -z "${OMP_NUM_THREADS+set}" ] && [ "$NPROC" -gt 1 ]; then
    export OMP_NUM_THREADS=1
fi

PYTHONPATH="$HERE/..":$PYTHONPATH \
exec "${PYTHON:-python}" "$(dirname "$HERE")/mmcv_custom/launching/torchrun.py" "$PROG" \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$NPROC" \
    --master_port="$PORT" \
    --max-restarts="$MAX_RESTARTS" \
    "$HERE/train.py" \
    "$CONFIG" \
    --launcher pytorch "${@:3}"
