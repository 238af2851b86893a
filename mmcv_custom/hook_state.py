"""The old import path ``mmcv_custom.hook_state``, kept so that existing
imports work. ``HookStateKeeper`` now lives in
:mod:`mmcv_custom.hooks.state`; the hook math is the torch-only package
:mod:`mmcv_custom.hooks`. This module only re-exports the same objects; code
in this project imports them from their new module.
"""
from .hooks.state import HookStateKeeper

__all__ = ['HookStateKeeper']
