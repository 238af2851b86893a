#!/usr/bin/env bash
# Usage: tools/dist_test.sh CONFIG CHECKPOINT NPROC_PER_NODE [test.py args...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR and PORT on every node.
# PYTHON picks the interpreter; by default the repository's .venv/bin/python
# when it exists (what `make install` builds), else python on PATH.
# A failed run ends with the cause (from the first rank that failed), the log
# file and the exit code (mmcv_custom/launching/torchrun.py: torchrun, reporting so).
PROG=dist_test.sh
USAGE="usage: $PROG CONFIG CHECKPOINT NPROC_PER_NODE [test.py args...]"
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/launch_checks.sh"
help_requested "$@" && exit 0
CONFIG=$1
CHECKPOINT=$2
NPROC=$3
case $# in
    0) usage_error "CONFIG, CHECKPOINT and NPROC_PER_NODE are required" ;;
    1) usage_error "CHECKPOINT and NPROC_PER_NODE are missing" ;;
    2)
        is_count "$CHECKPOINT" && usage_error "CHECKPOINT is missing"
        usage_error "NPROC_PER_NODE is missing"
        ;;
esac
if ! is_config "$CONFIG" && is_config "$CHECKPOINT"; then
    usage_error "CONFIG comes first, then CHECKPOINT (got '$CONFIG' '$CHECKPOINT')"
fi
if is_count "$CHECKPOINT" && ! is_count "$NPROC"; then
    usage_error "CHECKPOINT comes before NPROC_PER_NODE (got '$CHECKPOINT' '$NPROC')"
fi
check_config "$CONFIG"
check_count NPROC_PER_NODE "$NPROC"
exec_torchrun "$HERE/test.py" "$CONFIG" "$CHECKPOINT" --launcher pytorch "${@:4}"
