"""The communication core: from a ``comm_hook`` config to a registered hook.

Modules, each with one concern:

* :mod:`.records`: :class:`~.records.HookRecord`, one per hook (the
  built-ins', and those plugins register), read with ``record_of``;
* :mod:`.registry`: ``COMM_HOOKS`` (whose ``register_module`` takes a
  ``record``) and ``COMM_HOOK_STATES`` (MMEngine);
* :mod:`.states`: the built-in state factories and their value checks;
* :mod:`.builder`: ``CommHookConfig`` (a config, checked),
  ``build_comm_hook`` and the ``CommHookSpec`` it builds;
* :mod:`.config`: ``comm_hook_config``, the one check a run makes of its
  ``comm_hook``;
* :mod:`.cost_records` and :mod:`.traffic`: ``CostRecord`` (what a hook
  sends, for the cost model) and ``sent_bytes`` (the counting rule);
* :mod:`.telemetry`: ``CommCounter``, the bytes handed to the hooks and
  the bytes they send;
* :mod:`.sharded`: the FSDP2 form of a config.

``require_int``/``require_real``/``require_bool`` and ``with_args_check``
live with the hook math in :mod:`mmcv_custom.hooks.validation` and are
handed out here too, since a plugin's state factory checks its values with
them beside ``COMM_HOOK_STATES``.

The names below are imported on first use, not with the package:
:mod:`.records` imports only torch and :mod:`mmcv_custom.hooks`, and must
not pull MMEngine in through this file.
"""
import importlib

__all__ = [
    'COMM_HOOKS', 'COMM_HOOK_STATES', 'CommCounter', 'CommHookConfig',
    'CommHookSpec', 'comm_hook_config', 'CostRecord', 'sent_bytes',
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
    'CommHookConfig': '.builder',
    'CommHookSpec': '.builder',
    'comm_hook_config': '.config',
    'CostRecord': '.cost_records',
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
    'sent_bytes': '.traffic',
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
