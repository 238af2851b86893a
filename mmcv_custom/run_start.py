"""Old path of :mod:`mmcv_custom.launching.run_start`; kept for users.

The code now lives in :mod:`mmcv_custom.launching.run_start`; this module only
re-exports the names it used to define.
"""
from .launching.run_start import (SUPERSEDED_PREFIX, StartPlan,
                                  apply_start_plan, plan_start)

__all__ = ['StartPlan', 'plan_start', 'apply_start_plan', 'SUPERSEDED_PREFIX']
