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
check_max_restarts
exec_torchrun --max-restarts="$MAX_RESTARTS" \
    "$HERE/train.py" "$CONFIG" --launcher pytorch "${@:3}"
