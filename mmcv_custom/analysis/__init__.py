"""What the analysis tools compute, importable: a config's parameter
counts, gradient traffic and memory per GPU under DDP and FSDP2
(:mod:`~mmcv_custom.analysis.model_stats`, built on the meta device),
what a rank actually holds (:mod:`~mmcv_custom.analysis.held_memory`), and
the third-party warnings the tools keep off the console
(:mod:`~mmcv_custom.analysis.tool_warnings`), their progress lines
(:mod:`~mmcv_custom.analysis.progress`) and the checks of their command
lines (:mod:`~mmcv_custom.analysis.cli`, which also re-exports the check of
the ``PORT`` their runs use, :mod:`~mmcv_custom.launching.ports`).
The cost model that projects each hook's step time to a GPU cluster is the
subpackage :mod:`mmcv_custom.analysis.cost` (imported on its own: it reads
the hooks' records).

What the benchmarks and the convergence comparison measure and report
lives in modules imported on their own, not with this package (they
import the communication core): :mod:`.step_time` and
:mod:`.step_time_report` (``benchmark_step_time.py``, with
:mod:`.hook_forms`, a hook named in its flat or two-level form),
:mod:`.hook_benchmark` and :mod:`.hook_benchmark_report`
(``benchmark_comm_hooks.py``), :mod:`.convergence` and
:mod:`.convergence_runs` (``compare_comm_convergence.py``), all reading
their hooks through :mod:`.registered`.

``tools/analysis_tools/`` holds the command lines over them.
"""
from .cli import (cfg_options, check_output, check_work_dir, convert_file,
                  read_config, tool_error, write_failure_reason)
from .held_memory import GatheredPeak, held_bytes
from .model_stats import fsdp2_memory, fsdp2_units, shard_numel, stats
from .progress import Progress, format_eta
from .tool_warnings import filter_tool_warnings

__all__ = [
    'stats', 'fsdp2_units', 'fsdp2_memory', 'shard_numel', 'held_bytes',
    'GatheredPeak', 'filter_tool_warnings', 'Progress', 'format_eta',
    'check_output', 'read_config', 'cfg_options', 'check_work_dir',
    'convert_file', 'tool_error', 'write_failure_reason'
]
