"""The old import path ``mmcv_custom.powersgd_state``, kept so that existing
imports work. The PowerSGD state across bucket layouts now lives in
:mod:`mmcv_custom.hooks.powersgd_state`; the hook math is the torch-only
package :mod:`mmcv_custom.hooks`. This module only re-exports the same
objects; code in this project imports them from their new module.
"""
from .hooks.powersgd_state import BatchedPowerSGDRelayout, PowerSGDRelayout

__all__ = ['PowerSGDRelayout', 'BatchedPowerSGDRelayout']
