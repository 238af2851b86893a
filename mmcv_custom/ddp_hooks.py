"""The old import path ``mmcv_custom.ddp_hooks``, kept so that existing imports
work. The half-precision hooks now live in :mod:`mmcv_custom.hooks.half`,
and ``cpu_codec`` in :mod:`mmcv_custom.hooks.cast`; the hook math is the
torch-only package :mod:`mmcv_custom.hooks`. This module only re-exports the
same objects; code in this project imports them from their new module.
"""
from .hooks.cast import cpu_codec
from .hooks.half import (CompressState, allreduce_hook, bf16_compress_hook,
                         bf16_compress_wrapper, check_bf16_support,
                         default_predivide_factor, fp16_compress_hook,
                         fp16_compress_wrapper)

__all__ = [
    'allreduce_hook', 'fp16_compress_hook', 'bf16_compress_hook',
    'fp16_compress_wrapper', 'bf16_compress_wrapper', 'check_bf16_support',
    'CompressState', 'default_predivide_factor', 'cpu_codec'
]
