"""The old import path ``mmcv_custom.int8_hooks``, kept so that existing
imports work. The int8 hook now lives in :mod:`mmcv_custom.hooks.int8`; the
hook math is the torch-only package :mod:`mmcv_custom.hooks`. This module
only re-exports the same objects; code in this project imports them from
their new module.
"""
from .hooks.int8 import (Int8BucketPlan, Int8State, Int8StateKeeper,
                         int8_compress_hook)

__all__ = [
    'Int8State', 'Int8StateKeeper', 'Int8BucketPlan', 'int8_compress_hook'
]
