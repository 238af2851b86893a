"""The old import path ``mmcv_custom.powersgd``, kept so that existing imports
work. The PowerSGD hook now lives in :mod:`mmcv_custom.hooks.powersgd`; the
hook math is the torch-only package :mod:`mmcv_custom.hooks`. This module
only re-exports the same objects; code in this project imports them from
their new module.
"""
from .hooks.powersgd import compression, powersgd_hook

__all__ = ['powersgd_hook', 'compression']
