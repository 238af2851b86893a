"""Config values the runner would use only after building the model:
``custom_imports``, ``custom_hooks`` and ``comm_hook``, checked before.
"""
import functools
from typing import List, Optional

from mmengine.config import Config

from ..cpu_start import uses_fsdp2
from .problems import Problem

__all__ = ['import_problems', 'custom_hooks_problems', 'comm_hook_problems']


def import_problems(cfg: Config) -> List[Problem]:
    """Import ``custom_imports`` (the runner would), so that the dataset
    and model classes are registered; a failure is a problem itself."""
    custom = cfg.get('custom_imports')
    if not custom:
        return []
    from mmengine.utils import import_modules_from_strings
    try:
        import_modules_from_strings(**custom)
    except ImportError as e:
        return [
            Problem(f'custom_imports: {e}',
                    'install the package, or correct custom_imports')
        ]
    return []


def comm_hook_problems(cfg: Config,
                       launcher: Optional[str] = None) -> List[Problem]:
    """``comm_hook`` checked as the runner hook will check it, but before
    the model is built (minutes for InternViT-6B). Its messages name the
    bad value and the valid ones. Under FSDP2 by the sharding the config
    will run on ``launcher``'s nodes (hybrid: the format of the
    cross-node all-reduce), or, where that is not known before the ranks
    start, by whether it has a form under either."""
    comm_hook = cfg.get('comm_hook')
    if comm_hook is None:
        return []
    from ...comm.builder import CommHookConfigError, check_comm_hook_cfg
    from ...comm.sharded import check_sharded_cfg
    from .strategy import hybrid_at_start

    if uses_fsdp2(cfg):
        hybrid = hybrid_at_start(cfg, launcher)
        if hybrid is None:
            # Unknown here: the runner hook checks again once the ranks
            # have decided.
            try:
                check_sharded_cfg(comm_hook)
                return []
            except (KeyError, TypeError, ValueError):
                hybrid = True
        check = functools.partial(check_sharded_cfg, hybrid=hybrid)
    else:
        check = check_comm_hook_cfg
    try:
        check(comm_hook)
    except (KeyError, TypeError, ValueError) as e:
        # Every bad value, one problem each.
        errors = e.errors if isinstance(e, CommHookConfigError) else [e]
        return [
            Problem(
                str(err.args[0]
                    if isinstance(err, KeyError) and err.args else err))
            for err in errors
        ]
    return []


_CLI_DICT_FIX = (
    "--cfg-options reads a dict inside a list only with quoted values and "
    "one key (custom_hooks=\"[dict(type='EMAHook')]\"); otherwise it stays "
    "a string: set custom_hooks in a config that inherits this one "
    "(_base_ = ['...'] and custom_hooks = [dict(type='...')])")


def custom_hooks_problems(cfg: Config, registered: bool) -> List[Problem]:
    """``custom_hooks``: a list of ``dict(type=...)`` (or Hook objects),
    each type registered (when ``registered``), as the runner will need
    them after building the model."""
    from mmengine.hooks import Hook
    hooks = cfg.get('custom_hooks')
    if hooks is None:
        return []
    if not isinstance(hooks, (list, tuple)):
        return [
            Problem(
                'custom_hooks should be a list of hook configs such as '
                f"[dict(type='...')], but got {hooks!r}",
                _CLI_DICT_FIX if isinstance(hooks, str) else '')
        ]
    problems = []
    for i, hook in enumerate(hooks):
        if isinstance(hook, Hook):
            continue
        if not isinstance(hook, dict) or 'type' not in hook:
            problems.append(
                Problem(
                    f'custom_hooks[{i}] should be a hook config such as '
                    f"dict(type='...'), but got {hook!r}",
                    _CLI_DICT_FIX if isinstance(hook, str) else ''))
        elif registered and isinstance(hook['type'], str):
            unknown = _unknown_hook(cfg, hook['type'])
            if unknown:
                problems.append(
                    Problem(
                        f'custom_hooks[{i}]: {unknown}',
                        'correct the type, or import the module that '
                        'registers it in custom_imports'))
    return problems


def _unknown_hook(cfg: Config, name: str) -> Optional[str]:
    """Why the runner would not find hook type ``name`` in the config's
    scope (with close matches), or None when it would."""
    import difflib

    from mmengine.registry import HOOKS
    with HOOKS.switch_scope_and_registry(cfg.get('default_scope')) as found:
        if found.get(name) is not None:
            return None
        names, registry = set(), found
        while registry is not None:
            names.update(registry.module_dict)
            registry = registry.parent
    close = difflib.get_close_matches(name, sorted(names), n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ''
    return f'{name!r} is not a registered hook{hint}'
