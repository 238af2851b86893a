"""Moved to :mod:`mmcv_custom.comm.records` (temporary shim)."""
from .comm.records import *  # noqa: F401,F403
from .comm.records import HOOK_RECORDS, HookRecord, powersgd_numel, record_of  # noqa
