"""Old path of :mod:`mmcv_custom.launching.lifetime`; kept for users.

The code now lives in :mod:`mmcv_custom.launching.lifetime`; this module only
re-exports the names it used to define.
"""
from .launching.lifetime import (DEATH_SIGNAL, LAUNCHER_PID_ENV, LAUNCHERS,
                                 die_with_launcher)

__all__ = [
    'LAUNCHERS', 'LAUNCHER_PID_ENV', 'DEATH_SIGNAL', 'die_with_launcher'
]
