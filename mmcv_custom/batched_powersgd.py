"""The old import path ``mmcv_custom.batched_powersgd``, kept so that existing
imports work. The batched PowerSGD hook now lives in
:mod:`mmcv_custom.hooks.batched_powersgd`; the hook math is the torch-only
package :mod:`mmcv_custom.hooks`. This module only re-exports the same
objects; code in this project imports them from their new module.
"""
from .hooks.batched_powersgd import batched_powersgd_hook

__all__ = ['batched_powersgd_hook']
