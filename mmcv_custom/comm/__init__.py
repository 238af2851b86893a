"""The communication core: from a ``comm_hook`` config to a registered hook.

Modules, each with one concern:

* :mod:`.records`: :class:`~.records.HookRecord`, one per hook (the
  built-ins', and those plugins register), read with ``record_of``;
* :mod:`.registry`: ``COMM_HOOKS`` (whose ``register_module`` takes a
  ``record``) and ``COMM_HOOK_STATES`` (MMEngine);
* :mod:`.states`: the built-in state factories and their value checks;
* :mod:`.builder`: ``check_comm_hook_cfg``, ``build_comm_hook``,
  ``CommHookSpec``;
* :mod:`.telemetry`: ``CommCounter``, the bytes handed to the hooks and
  the bytes they send;
* :mod:`.sharded`: the FSDP2 form of a config.

``require_int``/``require_real``/``require_bool`` and ``with_args_check``
live with the hook math in :mod:`mmcv_custom.hooks.validation` and are
re-exported here; :mod:`.validation` and :mod:`.util` are the old import
paths of :mod:`mmcv_custom.hooks.validation` and :mod:`mmcv_custom.hooks.util`.

The names below are imported on first use, not with the package:
:mod:`.records` imports only torch and :mod:`mmcv_custom.hooks`, and must
not pull MMEngine in through this file.
"""
import importlib

__all__ = [
    'COMM_HOOKS', 'COMM_HOOK_STATES', 'CommCounter', 'CommHookSpec',
    'HookRecord', 'ShardedCommSpec', 'build_comm_hook', 'build_sharded_comm',
    'check_comm_hook_cfg', 'hook_record', 'lookup_hook', 'record_of',
    'register_hook_record', 'require_bool', 'require_int', 'require_real',
    'sends_bucket', 'with_args_check'
]

# Name -> its module, relative to this package.
_HOME = {
    'COMM_HOOKS': '.registry',
    'COMM_HOOK_STATES': '.registry',
    'CommCounter': '.telemetry',
    'CommHookSpec': '.builder',
    'HookRecord': '.records',
    'ShardedCommSpec': '.sharded',
    'build_comm_hook': '.builder',
    'build_sharded_comm': '.sharded',
    'check_comm_hook_cfg': '.builder',
    'hook_record': '.builder',
    'lookup_hook': '.builder',
    'record_of': '.records',
    'register_hook_record': '.records',
    'require_bool': '..hooks.validation',
    'require_int': '..hooks.validation',
    'require_real': '..hooks.validation',
    'sends_bucket': '.records',
    'with_args_check': '..hooks.validation',
}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
