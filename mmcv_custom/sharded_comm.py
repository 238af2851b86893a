"""The old import path ``mmcv_custom.sharded_comm``, kept so that existing
imports work. The FSDP2 reduce-scatters now live in
:mod:`mmcv_custom.hooks.sharded`; the hook math is the torch-only package
:mod:`mmcv_custom.hooks`. This module only re-exports the same objects; code
in this project imports them from their new module.
"""
from .hooks.sharded import (AveragingReduceScatter, Int8ReduceScatter,
                            fsdp_modules, install_reduce_scatter)

__all__ = [
    'AveragingReduceScatter', 'Int8ReduceScatter', 'install_reduce_scatter',
    'fsdp_modules'
]
