"""Old path of the tools' start-up helpers; kept for users.

The code now lives, split by concern, in :mod:`mmcv_custom.launching` (CPU
start-up in :mod:`~mmcv_custom.launching.cpu_start`, reading a config and
running its runner in :mod:`~mmcv_custom.launching.running`, free ports in
:mod:`~mmcv_custom.launching.ports`, the benchmarks' ranks in
:mod:`~mmcv_custom.launching.bench_ranks`, output-path checks in
:mod:`~mmcv_custom.launching.output_paths`) and in
:mod:`mmcv_custom.engine.process_group` (the launchers' variables and the
gloo start, which FSDP2Strategy needs too); this module only re-exports the
names it used to define.
"""
from .engine.process_group import (LAUNCH_ENV, LaunchEnv, init_gloo,
                                   is_launch_rank0, restart_count)
from .launching.bench_ranks import spawn_ranks, write_results
from .launching.cpu_start import (check_cpu_strategy, check_cpu_wrapper,
                                  prepare_launch, uses_fsdp2)
from .launching.output_paths import check_writable
from .launching.ports import free_port
from .launching.running import (NothingToTrain, build_runner, load_config,
                                run_runner, shutdown_distributed)

__all__ = [
    'check_cpu_strategy', 'uses_fsdp2', 'build_runner', 'run_runner',
    'init_gloo', 'load_config', 'prepare_launch', 'is_launch_rank0',
    'shutdown_distributed', 'check_cpu_wrapper', 'check_writable',
    'spawn_ranks', 'write_results', 'free_port', 'NothingToTrain', 'LaunchEnv',
    'LAUNCH_ENV', 'restart_count'
]
