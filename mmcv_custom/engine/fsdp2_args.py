"""The arguments of :class:`~mmcv_custom.engine.fsdp2_strategy.FSDP2Strategy`,
checked without building it.

The strategy's constructor raises the first bad one; the preflight
(:mod:`mmcv_custom.launching.preflight.strategy`) names every bad one
before any rank starts. Both call :func:`strategy_arg_errors`, so one
place decides what a valid ``strategy = dict(type='FSDP2Strategy', ...)``
is. The preflight cannot build the strategy instead: MMEngine's
``BaseStrategy`` makes the work dir, the log folder and the logger in its
constructor, and the preflight writes nothing.
"""
import difflib
import inspect
from typing import Any, List, Mapping, Tuple

from .fsdp2_mesh import check_sharding
from .fsdp2_units import parse_mp_policy

__all__ = ['STRATEGY_DEFAULTS', 'strategy_arg_errors', 'check_strategy_args']

#: FSDP2Strategy's own keys and their defaults (its constructor's).
STRATEGY_DEFAULTS = dict(
    shard_modules=None,
    reshard_after_forward=True,
    mp_policy=None,
    broadcast_buffers=True,
    sharding='full',
    ranks_per_node=None)


def _mmengine_keys() -> Tuple[str, ...]:
    """The keyword arguments MMEngine's ``DDPStrategy`` and its bases take
    (``sync_bn``, ``work_dir``, ``env_kwargs``...), which FSDP2Strategy
    passes on; read from their signatures, so that a newer MMEngine's
    keys are valid here too."""
    from mmengine._strategy import DDPStrategy
    keys = []
    for cls in DDPStrategy.__mro__:
        init = cls.__dict__.get('__init__')
        if init is None:
            continue
        for param in inspect.signature(init).parameters.values():
            if param.kind is param.KEYWORD_ONLY and param.name not in keys:
                keys.append(param.name)
    return tuple(keys)


def _unknown_keys(args: Mapping) -> List[Exception]:
    passed_on = [k for k in _mmengine_keys() if k != 'model_wrapper']
    valid = list(STRATEGY_DEFAULTS) + passed_on
    unknown = [k for k in args if k not in valid and k != 'model_wrapper']
    if not unknown:
        return []
    close = [
        repr(m) for k in unknown
        for m in difflib.get_close_matches(k, valid, n=1)
    ]
    hint = f" (did you mean {' or '.join(close)}?)" if close else ''
    return [
        TypeError(f'FSDP2Strategy got unknown keys {sorted(unknown)}{hint}; '
                  f'valid keys: {", ".join(STRATEGY_DEFAULTS)}, and '
                  f"MMEngine's DDPStrategy's {', '.join(passed_on)}")
    ]


def _check_shard_modules(value: Any) -> None:
    if value is None:
        return
    listed = isinstance(value, (list, tuple))
    if not listed or not all(isinstance(m, (str, type)) for m in value):
        raise TypeError(
            'FSDP2Strategy shard_modules should be a list of module '
            "classes or class names, e.g. ['InternViTBlock'], but "
            f'got {value!r}')


def strategy_arg_errors(args: Mapping) -> List[Exception]:
    """Every bad value among FSDP2Strategy's arguments ``args`` (the
    config's ``strategy`` without ``type``), each the error the
    constructor raises for it, in the order it checks them; empty when
    all are valid. Whether the node layout suits ``sharding`` is decided
    once the world is known (:func:`~.fsdp2_mesh.decide_sharding`).
    """
    args = dict(STRATEGY_DEFAULTS, **args)
    errors = _unknown_keys(args)
    if 'model_wrapper' in args:
        errors.append(
            TypeError('FSDP2Strategy takes no model_wrapper: fully_shard '
                      'changes the model in place instead of wrapping it.'))
    for key in ('reshard_after_forward', 'broadcast_buffers'):
        if not isinstance(args[key], bool):
            errors.append(
                TypeError(f'FSDP2Strategy {key} should be True or False, '
                          f'but got {args[key]!r}'))
    checks = (
        lambda: _check_shard_modules(args['shard_modules']),
        lambda: check_sharding(args['sharding'], args['ranks_per_node']),
        lambda: parse_mp_policy(args['mp_policy']),
    )
    for check in checks:
        try:
            check()
        except (TypeError, ValueError) as e:
            errors.append(e)
    return errors


def check_strategy_args(args: Mapping) -> None:
    """Raise the first of :func:`strategy_arg_errors`, if any.

    Raises:
        TypeError: A key FSDP2Strategy does not take, or a value of the
            wrong type.
        ValueError: A value out of its range.
    """
    errors = strategy_arg_errors(args)
    if errors:
        raise errors[0]
