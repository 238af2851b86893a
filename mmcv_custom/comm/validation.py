"""The old import path ``mmcv_custom.comm.validation``, kept so that existing
imports work. The value checks now live in
:mod:`mmcv_custom.hooks.validation`, beside the hook modules that use them;
the hook math is the torch-only package :mod:`mmcv_custom.hooks`. This
module only re-exports the same objects; code in this project imports them
from their new module.
"""
from ..hooks.validation import (require_bool, require_int, require_real,
                                with_args_check)

__all__ = ['with_args_check', 'require_int', 'require_real', 'require_bool']
