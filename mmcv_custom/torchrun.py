"""Old path of :mod:`mmcv_custom.launching.torchrun`; kept for users.

The code now lives in :mod:`mmcv_custom.launching.torchrun`; this module only
re-exports the names it used to define. ``tools/dist_train.sh`` and
``tools/dist_test.sh`` run the new file by path.
"""
from .launching.torchrun import (ERROR_KEY, LAUNCHER_PID_ENV,
                                 RESTART_COUNT_ENV, first_failure,
                                 format_report, main, write_error_file)

__all__ = [
    'ERROR_KEY', 'LAUNCHER_PID_ENV', 'RESTART_COUNT_ENV', 'format_report',
    'write_error_file', 'first_failure', 'main'
]
