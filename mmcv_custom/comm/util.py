"""The old import path ``mmcv_custom.comm.util``, kept so that existing imports
work. The helpers now live in :mod:`mmcv_custom.hooks.util`, beside the hook
modules that use them; the hook math is the torch-only package
:mod:`mmcv_custom.hooks`. This module only re-exports the same objects; code
in this project imports them from their new module.
"""
from ..hooks.util import align_up, ceil_div, named_after

__all__ = ['ceil_div', 'align_up', 'named_after']
