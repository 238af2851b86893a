"""The names configs and user code have always imported from here.

The communication core now lives in :mod:`mmcv_custom.comm`, one module per
concern; this module re-exports its public names so that
``from mmcv_custom.registry import COMM_HOOKS, build_comm_hook`` and
``custom_imports=dict(imports=['mmcv_custom.registry'])`` keep working.

Users add their own hooks the MMEngine way::

    from mmcv_custom import COMM_HOOKS

    @COMM_HOOKS.register_module()
    def my_hook(process_group, bucket):
        ...

and, for a stateful hook, a state factory registered in
``COMM_HOOK_STATES`` under the same name (see
:func:`~mmcv_custom.hooks.validation.with_args_check` for checking its
values before anything is built); ``register_module(record=HookRecord(...))``
gives the hook its record (see :mod:`mmcv_custom.comm.records`).
"""
from .comm.builder import (CommHookSpec, build_comm_hook, check_comm_hook_cfg,
                           hook_record)
from .comm.records import HookRecord, register_hook_record, sends_bucket
from .comm.registry import COMM_HOOK_STATES, COMM_HOOKS
from .comm.sharded import ShardedCommSpec, build_sharded_comm
from .comm.telemetry import CommCounter
from .hooks.validation import (require_bool, require_int, require_real,
                               with_args_check)

__all__ = [
    'COMM_HOOKS', 'COMM_HOOK_STATES', 'CommCounter', 'CommHookSpec',
    'ShardedCommSpec', 'build_sharded_comm', 'build_comm_hook',
    'check_comm_hook_cfg', 'with_args_check', 'require_int', 'require_real',
    'require_bool', 'hook_record', 'HookRecord', 'register_hook_record',
    'sends_bucket'
]
