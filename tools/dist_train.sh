#!/usr/bin/env bash
# Usage: tools/dist_train.sh CONFIG NPROC_PER_NODE [train.py args...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR and PORT on every node.
# PYTHON picks the interpreter; by default the repository's .venv/bin/python
# when it exists (what `make install` builds), else python on PATH.
CONFIG=$1
NPROC=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
HERE=$(cd "$(dirname "$0")" && pwd)
VENV_PYTHON="$(dirname "$HERE")/.venv/bin/python"
if [ -z "$PYTHON" ] && [ -x "$VENV_PYTHON" ]; then
    PYTHON=$VENV_PYTHON
fi

PYTHONPATH="$HERE/..":$PYTHONPATH \
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$NPROC" \
    --master_port="$PORT" \
    "$HERE/train.py" \
    "$CONFIG" \
    --launcher pytorch "${@:3}"
