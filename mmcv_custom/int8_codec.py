"""The old import path ``mmcv_custom.int8_codec``, kept so that existing
imports work. The blockwise int8 codec now lives in
:mod:`mmcv_custom.hooks.int8_codec`; the hook math is the torch-only package
:mod:`mmcv_custom.hooks`. This module only re-exports the same objects; code
in this project imports them from their new module.
"""
from .hooks.int8_codec import (C_MAX_BLOCK, BlockTable, dequantize,
                               dequantize_blocks, num_blocks, quantize,
                               quantize_blocks, uses_c_kernel)

__all__ = [
    'quantize', 'dequantize', 'num_blocks', 'uses_c_kernel', 'BlockTable',
    'quantize_blocks', 'dequantize_blocks', 'C_MAX_BLOCK'
]
