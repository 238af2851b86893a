"""The seed's import path, ``from mmcv_custom.ddp_hooks import
fp16_compress_hook, bf16_compress_hook`` (InternVL's
``segmentation/mmcv_custom/ddp_hooks.py``), kept because code copied from
there imports it. The half-precision hooks live in
:mod:`mmcv_custom.hooks.half` and ``cpu_codec`` in
:mod:`mmcv_custom.hooks.cast`; this module only re-exports the same
objects, and nothing in the project imports it.
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
