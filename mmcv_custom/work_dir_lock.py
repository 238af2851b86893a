"""Old path of :mod:`mmcv_custom.launching.work_dir_lock`; kept for users.

The code now lives in :mod:`mmcv_custom.launching.work_dir_lock`; this
module only re-exports the names it used to define.
"""
from .launching.work_dir_lock import LOCK_FILE, WorkDirBusy, WorkDirLock

__all__ = ['LOCK_FILE', 'WorkDirBusy', 'WorkDirLock']
