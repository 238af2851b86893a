"""The two registries a ``comm_hook`` config is looked up in.

:data:`COMM_HOOKS` maps a config's ``type`` to a hook function;
:data:`COMM_HOOK_STATES` maps the same name to the factory that builds the
hook's state from the config's other keys (see :mod:`.states`). Users add
their own with ``@COMM_HOOKS.register_module()``, and give a hook its
:class:`~.records.HookRecord` with ``record=``, as the built-ins have theirs.
"""
import difflib
import logging
from typing import Any, Callable, List, Optional, Sequence, Union

from mmengine.logging import print_log
from mmengine.registry import Registry

from .builtins import BUILTIN_HOOKS
from .records import (HOOK_RECORDS, HookRecord, add_builtin_records, hook_name,
                      is_builtin_hook, register_hook_record,
                      unregister_hook_record)

__all__ = [
    'COMM_HOOKS', 'COMM_HOOK_STATES', 'CommHookRegistry', 'did_you_mean'
]


class CommHookRegistry(Registry):
    """MMEngine's :class:`~mmengine.registry.Registry`, whose
    :meth:`register_module` also takes the hook's record, and which says
    so when a plugin's name and a built-in hook's meet.

    Example:
        >>> from mmcv_custom.comm import COMM_HOOKS, HookRecord, sends_bucket
        >>> @COMM_HOOKS.register_module(record=HookRecord(
        ...         sent_format='fp16', count_bytes_sent=sends_bucket(2)))
        ... def my_fp16_hook(state, bucket):
        ...     ...
    """

    def register_module(self,
                        name: Optional[Union[str, List[str]]] = None,
                        force: bool = False,
                        module: Optional[Callable] = None,
                        record: Optional[HookRecord] = None):
        """Register a hook, as MMEngine's ``register_module`` does (as a
        decorator or with ``module=``), and with ``record`` give it its
        :class:`~.records.HookRecord` (see
        :func:`~.records.register_hook_record`).

        Raises:
            KeyError: ``name`` is taken; where a built-in hook is one of the
                two, the message names both.
            TypeError, ValueError: The errors of ``register_hook_record``.
        """
        if record is not None and not isinstance(record, HookRecord):
            raise TypeError('record should be a HookRecord, but got '
                            f'{type(record).__name__}: {record!r}')
        if record is None:
            return super().register_module(name, force, module)

        def _register(hook):
            had_record = hook in HOOK_RECORDS
            register_hook_record(hook, record)
            try:
                super(CommHookRegistry,
                      self).register_module(name, force, hook)
            except Exception:
                if not had_record:
                    unregister_hook_record(hook)
                raise
            return hook

        return _register(module) if module is not None else _register

    def _register_module(self,
                         module: Callable,
                         module_name: Optional[Union[str, List[str]]] = None,
                         force: bool = False) -> None:
        names = module_name if module_name is not None else getattr(
            module, '__name__', None)
        for name in [names] if isinstance(names, str) else names or ():
            taken = self._module_dict.get(name)
            if taken is None or taken is module:
                continue
            if not (is_builtin_hook(taken) or is_builtin_hook(module)):
                continue
            if is_builtin_hook(taken):
                message = (f'comm hook name {name!r} is the built-in hook '
                           f'{hook_name(taken)}, so the plugin hook '
                           f'{hook_name(module)} cannot take it')
            else:
                message = (
                    f'comm hook name {name!r} is now a built-in hook of '
                    f'mmcv_custom, {hook_name(module)}, but the plugin hook '
                    f'{hook_name(taken)} already has it')
            if not force:
                raise KeyError(
                    f'{message}. Register the plugin hook under another '
                    "name (register_module(name='...')) and use that name "
                    'as comm_hook type.')
            print_log(
                f'{message}; force=True: {name!r} now means '
                f'{hook_name(module)}.',
                logger='current',
                level=logging.WARNING)
        super()._register_module(module, module_name, force)


COMM_HOOKS = CommHookRegistry('DDP communication hook', scope='mmcv_custom')
COMM_HOOK_STATES = Registry(
    'DDP communication hook state', scope='mmcv_custom')

add_builtin_records(BUILTIN_HOOKS)
for _builtin in BUILTIN_HOOKS:
    COMM_HOOKS.register_module(name=_builtin.name, module=_builtin.hook)


def did_you_mean(name: Any, extra: Sequence[str] = ()) -> str:
    """`` (did you mean 'diloco'?)`` for a hook type that differs from a
    registered one (or one of ``extra``) in case or a few letters
    (``'DiLoCo'``, ``'bf16'``), or begins one; empty where none is
    close."""
    if not isinstance(name, str):
        return ''
    names = {n.lower(): n for n in list(COMM_HOOKS.module_dict) + list(extra)}
    close = [
        names[n] for n in difflib.get_close_matches(
            name.lower(), sorted(names), n=2, cutoff=0.6)
    ]
    if not close and len(name) >= 3:
        close = [
            n for low, n in sorted(names.items())
            if low.startswith(name.lower())
        ]
    return (f" (did you mean {' or '.join(map(repr, close[:2]))}?)"
            if close else '')
