"""The old import path ``mmcv_custom.comm_worker``, kept so that existing
imports work. The communication worker thread now lives in
:mod:`mmcv_custom.hooks.worker`; the hook math is the torch-only package
:mod:`mmcv_custom.hooks`. This module only re-exports the same objects; code
in this project imports them from their new module.
"""
from .hooks.worker import on_comm_worker, on_worker_thread, run_on_comm_worker

__all__ = ['run_on_comm_worker', 'on_comm_worker', 'on_worker_thread']
