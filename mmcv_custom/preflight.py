"""Moved: the preflight now lives in :mod:`mmcv_custom.launching.preflight`
(a package, one module per check); this module re-exports its public names
so that ``from mmcv_custom.preflight import ...`` keeps working.
"""
from .launching.preflight import (CheckpointSize, PreflightError, Problem,
                                  check_preflight, checked_config,
                                  checkpoint_size, estimate_checkpoint_bytes,
                                  exit_on_problems, format_problems,
                                  format_size, preflight, preflight_report)

__all__ = [
    'Problem', 'PreflightError', 'preflight', 'check_preflight',
    'checked_config', 'format_problems', 'estimate_checkpoint_bytes',
    'checkpoint_size', 'CheckpointSize', 'format_size', 'preflight_report',
    'exit_on_problems'
]
