"""Config values the runner would use only after building the model:
``custom_imports``, ``custom_hooks`` and ``comm_hook``, checked before.
"""
from typing import List, Optional

from mmengine.config import Config

from ..cpu_start import uses_fsdp2
from .problems import Problem

__all__ = [
    'import_problems', 'custom_hooks_problems', 'comm_hook_problems',
    'checked_comm_hook'
]


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
    """The problems of :func:`checked_comm_hook`."""
    return checked_comm_hook(cfg, launcher)[1]


def checked_comm_hook(cfg: Config, launcher: Optional[str] = None) -> tuple:
    """``comm_hook`` checked as the runner hook will check it (the same
    function, :func:`~mmcv_custom.comm.config.comm_hook_config`), but
    before the model is built (minutes for InternViT-6B). Its messages
    name the bad value and the valid ones. Under FSDP2 by the sharding
    the config will run on ``launcher``'s nodes (hybrid: the format of
    the cross-node all-reduce), or, where that is not known before the
    ranks start, by whether it has a form under either.

    Returns:
        tuple: ``(CommHookConfig or None, problems)``: the checked config
        the rest of the preflight reads (None without ``comm_hook`` or
        with a problem), and every bad value, one problem each.
    """
    comm_hook = cfg.get('comm_hook')
    if comm_hook is None:
        return None, []
    from ...comm.builder import CommHookConfigError
    from ...comm.config import comm_hook_config
    from .strategy import hybrid_at_start

    sharding = None
    if uses_fsdp2(cfg):
        hybrid = hybrid_at_start(cfg, launcher)
        sharding = 'hybrid' if hybrid else 'full'
        if hybrid is None:
            # Unknown here: the runner hook checks once the ranks have
            # decided. Fine under full sharding, or else said as hybrid
            # sharding says it.
            try:
                return comm_hook_config(comm_hook, 'full'), []
            except (KeyError, TypeError, ValueError):
                sharding = 'hybrid'
    try:
        return comm_hook_config(comm_hook, sharding), []
    except (KeyError, TypeError, ValueError) as e:
        # Every bad value, one problem each.
        errors = e.errors if isinstance(e, CommHookConfigError) else [e]
        return None, [
            Problem(
                str(err.args[0]
                    if isinstance(err, KeyError) and err.args else err))
            for err in errors
        ]


_CLI_DICT_FIX = (
    "give dicts, not strings: custom_hooks = [dict(type='EMAHook')] in a "
    "config (one that inherits this one: _base_ = ['...']), or "
    "--cfg-options \"custom_hooks=[dict(type='EMAHook')]\"")


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
