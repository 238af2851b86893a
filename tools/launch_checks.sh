# What tools/dist_*.sh and tools/slurm_*.sh share (sourced; each sets PROG,
# USAGE and HERE, its own folder, first): the argument checks, the
# interpreter, and the launch itself. A mistake prints the usage line and
# what is wrong, and exits with 2 before anything starts, as argparse does.

usage_error() {
    echo "$USAGE" >&2
    echo "$PROG: error: $1" >&2
    exit 2
}

# is_count VALUE: a whole number >= 1.
is_count() {
    case "$1" in
        '' | *[!0-9]* | 0 | 0*) return 1 ;;
    esac
}

# is_config PATH: named like a config file MMEngine reads.
is_config() {
    case "$1" in
        *.py | *.json | *.yaml | *.yml) return 0 ;;
    esac
    return 1
}

# check_count NAME VALUE
check_count() {
    is_count "$2" || usage_error "$1 should be a whole number >= 1, but got '$2'"
}

# check_config CONFIG: an existing config file.
check_config() {
    is_config "$1" ||
        usage_error "CONFIG '$1' is not a config file (.py, .json, .yaml or .yml)"
    [ -f "$1" ] || usage_error "CONFIG '$1': no such file"
}

# help_requested "$@": the usage line for -h or --help first.
help_requested() {
    case "$1" in
        -h | --help)
            echo "$USAGE"
            return 0
            ;;
    esac
    return 1
}

# check_max_restarts: MAX_RESTARTS, by default 0, a whole number.
check_max_restarts() {
    MAX_RESTARTS=${MAX_RESTARTS:-0}
    case "$MAX_RESTARTS" in
        '' | *[!0-9]*)
            echo "$PROG: MAX_RESTARTS=$MAX_RESTARTS: expected a whole number >= 0 (restarts after a failure)" >&2
            exit 2
            ;;
    esac
}

# default_python: PYTHON, else the repository's .venv/bin/python when it
# exists (what `make install` builds); unset, the launch uses python on PATH.
default_python() {
    local venv_python
    venv_python="$(dirname "$HERE")/.venv/bin/python"
    if [ -z "$PYTHON" ] && [ -x "$venv_python" ]; then
        PYTHON=$venv_python
    fi
}

# exec_torchrun [TORCHRUN_OPTION...] SCRIPT [ARG...]: NPROC ranks on this
# node through mmcv_custom/launching/torchrun.py (torchrun, reporting a
# failure once), on the nodes NNODES, NODE_RANK, MASTER_ADDR and PORT name.
exec_torchrun() {
    default_python
    # torchrun's own default, without its banner.
    if [ -z "${OMP_NUM_THREADS+set}" ] && [ "$NPROC" -gt 1 ]; then
        export OMP_NUM_THREADS=1
    fi
    PYTHONPATH="$HERE/..":$PYTHONPATH \
    exec "${PYTHON:-python}" "$(dirname "$HERE")/mmcv_custom/launching/torchrun.py" "$PROG" \
        --nnodes="${NNODES:-1}" \
        --node_rank="${NODE_RANK:-0}" \
        --master_addr="${MASTER_ADDR:-127.0.0.1}" \
        --nproc_per_node="$NPROC" \
        --master_port="${PORT:-29500}" \
        "$@"
}

# check_slurm_sizes: GPUS, GPUS_PER_NODE and CPUS_PER_TASK, by default 4, 4
# and 5; the first two checked.
check_slurm_sizes() {
    GPUS=${GPUS:-4}
    GPUS_PER_NODE=${GPUS_PER_NODE:-4}
    CPUS_PER_TASK=${CPUS_PER_TASK:-5}
    check_count GPUS "$GPUS"
    check_count GPUS_PER_NODE "$GPUS_PER_NODE"
}

# srun_ranks SCRIPT [ARG...]: one task per GPU in PARTITION as JOB_NAME,
# each running SCRIPT ARG... --launcher slurm; the status is srun's.
srun_ranks() {
    # CPU nodes: GRES= (empty) to ask for no GPUs.
    local gres=${GRES-"--gres=gpu:${GPUS_PER_NODE}"}
    # The interpreter of every task.
    default_python
    export PYTHON
    # MASTER_ADDR for gloo on CPU nodes: the first host of the allocation.
    export MASTER_PORT=${MASTER_PORT:-29500}
    # Each task names its parent (slurmstepd) in MMCV_CUSTOM_LAUNCHER_PID: a
    # rank ends with it, SIGKILL included (mmcv_custom/launching/lifetime.py).
    PYTHONPATH="$HERE/..":$PYTHONPATH \
    srun -p "${PARTITION}" \
        --job-name="${JOB_NAME}" \
        ${gres} \
        --ntasks="${GPUS}" \
        --ntasks-per-node="${GPUS_PER_NODE}" \
        --cpus-per-task="${CPUS_PER_TASK}" \
        --kill-on-bad-exit=1 \
        ${SRUN_ARGS} \
        bash -c 'export MMCV_CUSTOM_LAUNCHER_PID=$PPID MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}; exec "${PYTHON:-python}" -u "$0" "$@" --launcher slurm' \
        "$@"
}
