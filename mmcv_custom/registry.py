"""Config names for DDP communication hooks, and building them from a config.

A config chooses a hook with a dict::

    comm_hook = dict(type='powerSGD', wrapper='bf16',
                     matrix_approximation_rank=2, start_powerSGD_iter=1000)

It keeps PyTorch's three separate pieces apart (as Lightning does): the
*hook* function, looked up by ``type`` in :data:`COMM_HOOKS`; its *state*,
built from the remaining keys by a factory registered under the same name in
:data:`COMM_HOOK_STATES` (hooks without one get the process group as state
and accept no extra keys); and an optional half-precision *wrapper*.

Users add their own hooks the MMEngine way::

    from mmcv_custom import COMM_HOOKS

    @COMM_HOOKS.register_module()
    def my_hook(process_group, bucket):
        ...

and, for a stateful hook, a state factory
``@COMM_HOOK_STATES.register_module(name='my_hook')`` taking
``(process_group, **config_keys)``.

:func:`check_comm_hook_cfg` checks a config before anything is built, with no
process group (the runner hook calls it at the start of every run,
distributed or not): the names, and the value of every key. A state factory
declares how its values are checked with :func:`with_args_check`; the
built-in factories use the same mechanism, and :func:`require_int`,
:func:`require_real` and :func:`require_bool` word the errors alike::

    def _check_my_args(args):
        require_int('every', args['every'], minimum=1)

    @COMM_HOOK_STATES.register_module(name='my_hook')
    @with_args_check(_check_my_args)
    def my_state(process_group, every=1):
        return dict(group=process_group, every=every)

``comm_hook=dict(type='my_hook', every=0)`` then fails with ``ValueError:
comm_hook my_hook: every should be an int >= 1, but got 0``. A factory
without a check is built with whatever values the config holds, as before.
"""
import dataclasses
import inspect
import math
import numbers
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from mmengine.registry import Registry
from mmengine.utils import get_object_from_string
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD

from .batched_powersgd import batched_powersgd_hook
from .comm_worker import on_comm_worker
from .ddp_hooks import (CompressState, _check_compress_args,
                        allreduce_hook,
                        bf16_compress_hook, bf16_compress_wrapper,
                        check_bf16_support, fp16_compress_hook,
                        fp16_compress_wrapper)
from .hook_records import HookRecord, record_of
from .int8_hooks import Int8State, int8_compress_hook
from .powersgd import powersgd_hook
from .powersgd_state import PowerSGDRelayout

__all__ = [
    'COMM_HOOKS', 'COMM_HOOK_STATES', 'CommCounter', 'CommHookSpec',
    'ShardedCommSpec', 'build_sharded_comm',
    'build_comm_hook', 'check_comm_hook_cfg', 'with_args_check',
    'require_int', 'require_real', 'require_bool', 'hook_record'
]

COMM_HOOKS = Registry('DDP communication hook', scope='mmcv_custom')
COMM_HOOK_STATES = Registry('DDP communication hook state',
                            scope='mmcv_custom')

COMM_HOOKS.register_module(name='allreduce', module=allreduce_hook)
COMM_HOOKS.register_module(name='fp16_compress', module=fp16_compress_hook)
COMM_HOOKS.register_module(name='bf16_compress', module=bf16_compress_hook)
COMM_HOOKS.register_module(name='powerSGD', module=powersgd_hook)
COMM_HOOKS.register_module(
    name='batched_powerSGD', module=batched_powersgd_hook)
COMM_HOOKS.register_module(name='int8_compress', module=int8_compress_hook)

_WRAPPERS: Dict[str, Callable] = {
    'fp16': fp16_compress_wrapper,
    'bf16': bf16_compress_wrapper,
}


def with_args_check(check: Callable[[dict], None]) -> Callable:
    """Attach a check of the config values to a state factory.

    :func:`check_comm_hook_cfg` calls ``check(args)`` before anything is
    built and without a process group, on every run (distributed or not).
    ``args`` holds every argument of the factory except ``process_group``:
    the config's value, or the factory's default where the config has none
    (a factory taking ``**kwargs`` gets just the config's keys). The check
    raises ``TypeError`` for a wrong type and ``ValueError`` for a value
    out of range, saying what is valid and what it got; the checker puts
    ``comm_hook <type>: `` in front, so one factory can serve several
    names. :func:`require_int`, :func:`require_real` and
    :func:`require_bool` word such errors.

    The check is kept as the factory's ``check_args`` attribute, which may
    also be set directly. Factories without one are built unchecked.

    Args:
        check (Callable): ``check(args: dict) -> None``.

    Returns:
        Callable: A decorator that returns the factory itself.

    Example:
        >>> def _check(args):
        ...     require_int('every', args['every'], minimum=1)
        >>> @COMM_HOOK_STATES.register_module(name='my_hook')
        ... @with_args_check(_check)
        ... def my_state(process_group, every=1):
        ...     return dict(group=process_group, every=every)
    """
    if not callable(check):
        raise TypeError('with_args_check needs a callable check(args), but '
                        f'got {type(check).__name__}: {check!r}')

    def attach(factory: Callable) -> Callable:
        factory.check_args = check
        return factory

    return attach


def _got(value: Any) -> str:
    """How a wrongly typed value is named: its type, then its repr."""
    return f'{type(value).__name__}: {value!r}'


def require_int(name: str,
                value: Any,
                minimum: Optional[int] = None,
                maximum: Optional[int] = None) -> None:
    """Raise unless ``value`` is an int within ``[minimum, maximum]``.

    ``bool`` does not count as an int (``True`` is no rank). Integers of
    other libraries (numpy's) do.

    Raises:
        TypeError: not an int, e.g. ``matrix_approximation_rank should be
            an int >= 1, but got str: 'two'``.
        ValueError: out of range, e.g. ``... should be an int >= 1, but got
            0``.
    """
    if minimum is not None and maximum is not None:
        rule = f'an int in [{minimum}, {maximum}]'
    elif minimum is not None:
        rule = f'an int >= {minimum}'
    elif maximum is not None:
        rule = f'an int <= {maximum}'
    else:
        rule = 'an int'
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f'{name} should be {rule}, but got {_got(value)}')
    if ((minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise ValueError(f'{name} should be {rule}, but got {value!r}')


def require_real(name: str,
                 value: Any,
                 minimum: Optional[float] = None,
                 inclusive: bool = True,
                 allow_none: bool = False) -> None:
    """Raise unless ``value`` is a finite real number above ``minimum``.

    Args:
        name (str): The key, for the message.
        value: The value to check. ``bool`` is not a number here.
        minimum (float, optional): The lower bound. Defaults to None.
        inclusive (bool): Whether ``minimum`` itself is allowed. Defaults to
            True.
        allow_none (bool): Whether None is allowed. Defaults to False.

    Raises:
        TypeError: not a real number, e.g. ``min_compression_rate should be
            a finite real number > 0, but got str: 'two'``.
        ValueError: out of range, inf or NaN.
    """
    rule = 'a finite real number'
    if minimum is not None:
        rule += f" {'>=' if inclusive else '>'} {minimum}"
    if allow_none:
        rule = 'None or ' + rule
        if value is None:
            return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f'{name} should be {rule}, but got {_got(value)}')
    if not math.isfinite(value) or (minimum is not None and (
            value < minimum or (not inclusive and value == minimum))):
        raise ValueError(f'{name} should be {rule}, but got {value!r}')


def require_bool(name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is True or False (a truthy
    string such as ``'no'`` is neither)."""
    if not isinstance(value, bool):
        raise TypeError(
            f'{name} should be True or False, but got {_got(value)}')


def _check_fp16_args(args: dict) -> None:
    _check_compress_args(args['predivide_factor'], args['check_finite'])


def _check_bf16_args(args: dict) -> None:
    _check_compress_args(None, args['check_finite'])


@COMM_HOOK_STATES.register_module(name='fp16_compress')
@with_args_check(_check_fp16_args)
def _fp16_state(process_group: Optional[dist.ProcessGroup],
                predivide_factor: Optional[float] = None,
                check_finite: bool = True) -> CompressState:
    """fp16's range guard: where to divide, and whether to look for inf
    and NaN after the reduction (on by default: fp16 is the format that
    overflows).

    Any ``predivide_factor`` > 0 works with any world size: above the
    world size the ranks' shares sum to less than their mean, which lets
    fp16 carry an average above 65504 (the rest of the division becomes a
    product after the reduction), at the cost of flushing more small
    gradients to zero.
    """
    return CompressState(process_group, predivide_factor, check_finite)


@COMM_HOOK_STATES.register_module(name='bf16_compress')
@with_args_check(_check_bf16_args)
def _bf16_state(process_group: Optional[dist.ProcessGroup],
                check_finite: bool = False) -> CompressState:
    """bf16 keeps fp32's range: it always divides before the reduction."""
    return CompressState(process_group, check_finite=check_finite)


# NumPy's RandomState, which PowerSGDState seeds, takes seeds below 2**32.
_MAX_SEED = 2**32 - 1


def _check_powersgd_args(args: dict) -> None:
    """PyTorch's ``PowerSGDState`` arguments (torch 2.13), which it takes
    as given: rank 0 compresses every gradient to nothing, a negative rank
    or a string fails deep inside the hook at the first compressed step,
    and a stats frequency below 1 is quietly raised to 1. A key a later
    torch adds is left to PyTorch."""
    checks = {
        'matrix_approximation_rank': lambda v: require_int(
            'matrix_approximation_rank', v, minimum=1),
        'start_powerSGD_iter': lambda v: require_int(
            'start_powerSGD_iter', v, minimum=1),
        'min_compression_rate': lambda v: require_real(
            'min_compression_rate', v, minimum=0, inclusive=False),
        'use_error_feedback': lambda v: require_bool('use_error_feedback',
                                                     v),
        'warm_start': lambda v: require_bool('warm_start', v),
        'orthogonalization_epsilon': lambda v: require_real(
            'orthogonalization_epsilon', v, minimum=0),
        'random_seed': lambda v: require_int(
            'random_seed', v, minimum=0, maximum=_MAX_SEED),
        'compression_stats_logging_frequency': lambda v: require_int(
            'compression_stats_logging_frequency', v, minimum=1),
        'batch_tensors_with_same_shape': lambda v: require_bool(
            'batch_tensors_with_same_shape', v),
    }
    for key, check in checks.items():
        if key in args:
            check(args[key])
    # PowerSGDState.__init__'s own rule, checked before anything is built.
    start = args.get('start_powerSGD_iter', 1)
    if (args.get('use_error_feedback') or args.get('warm_start')) and (
            start <= 1):
        raise ValueError(
            'start_powerSGD_iter should be > 1 when use_error_feedback or '
            'warm_start is True (both are by default), because PowerSGD '
            "can only be applied after DDP's first two iterations (PyTorch's "
            f'rule), but got {start!r}. Set start_powerSGD_iter >= 2, or '
            'use_error_feedback=False and warm_start=False.')


@COMM_HOOK_STATES.register_module(name='powerSGD')
@with_args_check(_check_powersgd_args)
def _powersgd_state(process_group: Optional[dist.ProcessGroup],
                    **kwargs) -> powerSGD.PowerSGDState:
    """Build PyTorch's ``PowerSGDState`` from the config keys."""
    return powerSGD.PowerSGDState(process_group=process_group, **kwargs)


# Only so that config keys (and, with their defaults, values) can be checked
# against PowerSGDState's arguments.
_powersgd_state.__signature__ = inspect.signature(powerSGD.PowerSGDState)
COMM_HOOK_STATES.register_module(
    name='batched_powerSGD', module=_powersgd_state)


def _check_int8_args(args: dict) -> None:
    require_int('block_size', args['block_size'], minimum=1)
    require_bool('error_feedback', args['error_feedback'])


@COMM_HOOK_STATES.register_module(name='int8_compress')
@with_args_check(_check_int8_args)
def _int8_state(process_group: Optional[dist.ProcessGroup],
                block_size: int = 256,
                error_feedback: bool = True) -> Int8State:
    """Blockwise int8 with one fp32 scale per ``block_size`` elements, and
    error feedback of what the rounding drops (see :class:`Int8State`)."""
    return Int8State(process_group, block_size, error_feedback)


@dataclasses.dataclass(frozen=True)
class CommHookSpec:
    """A communication hook ready for ``ddp.register_comm_hook(state, hook)``.

    Attributes:
        type (str): The config name, e.g. ``'powerSGD'``.
        hook (Callable): The composed hook to register.
        state (Any): The state to register it with.
        base_hook (Callable): The hook ``type`` names, before composition.
        wrapper (str, optional): ``'fp16'``, ``'bf16'`` or None.
        state_kwargs (dict): The state arguments in effect, including the
            defaults this project sets (see ``defaults_set``).
        defaults_set (tuple[str]): Names in ``state_kwargs`` that the user
            did not write and this project chose.
        on_worker (bool): True when the hook runs on the communication
            worker thread (see ``HookRecord.worker_waits``): CPU buckets are
            communicated one at a time, in DDP's order, while the backward
            pass goes on.
        relayout (PowerSGDRelayout, optional): Saves and restores a
            PowerSGD state per parameter.
        notes (tuple[str]): What the user should read in the log besides
            :meth:`describe`, as warnings (e.g. a bf16 backbone's buckets
            sent as bf16 under ``fp16_compress``).
    """
    type: str
    hook: Callable
    state: Any
    base_hook: Callable
    wrapper: Optional[str] = None
    state_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    defaults_set: tuple = ()
    on_worker: bool = False
    relayout: Optional[PowerSGDRelayout] = None
    notes: tuple = ()

    def describe(self) -> str:
        """One line saying what is registered, for the training log."""
        base = getattr(self.base_hook, '__qualname__', repr(self.base_hook))
        parts = [f"type='{self.type}' ({base})"]
        parts.append(f"wrapper={self.wrapper!r}")
        if isinstance(self.state, (CompressState, Int8State)):
            parts.append(f'state: {self.state!r}')
        elif self.state_kwargs:
            args = ', '.join(
                f'{k}={v!r}' + (' (default set by mmcv_custom)'
                                if k in self.defaults_set else '')
                for k, v in self.state_kwargs.items())
            parts.append(f'state: {type(self.state).__name__}({args})')
        if self.on_worker:
            parts.append('CPU buckets communicated in order on a worker '
                         'thread, overlapped with backward')
        return ', '.join(parts)


def _valid_types() -> str:
    return ', '.join(sorted(COMM_HOOKS.module_dict))


def _lookup_hook(hook_type: Any) -> Callable:
    if callable(hook_type):
        return hook_type
    if not isinstance(hook_type, str):
        raise TypeError('comm_hook type should be a registered name or a '
                        f'callable, but got {type(hook_type).__name__}: '
                        f'{hook_type!r}. Valid names: {_valid_types()}')
    # Not Registry.get: for a name it does not know, it imports whatever
    # module of that name it finds (a folder called 'allreduce' in the
    # working directory, say). Only a dotted path is imported, on purpose.
    hook = COMM_HOOKS.module_dict.get(hook_type)
    if hook is None and '.' in hook_type:
        hook = get_object_from_string(hook_type)
        if hook is not None and not callable(hook):
            raise TypeError(f'comm_hook type {hook_type!r} should name a '
                            f'callable hook, but it is {hook!r}')
    if hook is None:
        raise KeyError(
            f"comm_hook type {hook_type!r} is not in the "
            f'{COMM_HOOKS.scope}::{COMM_HOOKS.name} registry. Valid types: '
            f'{_valid_types()}. Register your own with '
            '@COMM_HOOKS.register_module(), or give an import path such as '
            "'my_pkg.hooks.my_hook'.")
    return hook


def hook_record(hook_type: Any) -> HookRecord:
    """The record (:mod:`mmcv_custom.hook_records`) of the hook a config's
    ``type`` names; an empty one for a hook the project does not know."""
    return record_of(_lookup_hook(hook_type))


def _lookup_state_factory(hook_type: Any) -> Optional[Callable]:
    if isinstance(hook_type, str):
        return COMM_HOOK_STATES.module_dict.get(hook_type)
    return None


def _factory_args(factory: Callable, state_kwargs: dict) -> dict:
    """What a factory's ``check_args`` sees: every argument but the process
    group, from the config or else the factory's default."""
    args = {}
    for name, param in inspect.signature(factory).parameters.items():
        if (name != 'process_group' and param.default is not param.empty
                and param.kind in (param.POSITIONAL_OR_KEYWORD,
                                   param.KEYWORD_ONLY)):
            args[name] = param.default
    args.update(state_kwargs)
    return args


def _run_args_check(factory: Callable, hook_type: str,
                    state_kwargs: dict) -> None:
    check = getattr(factory, 'check_args', None)
    if check is None:
        return
    try:
        check(_factory_args(factory, state_kwargs))
    except TypeError as e:
        raise TypeError(f'comm_hook {hook_type}: {e}') from e
    except ValueError as e:
        raise ValueError(f'comm_hook {hook_type}: {e}') from e


def check_comm_hook_cfg(cfg: Any) -> dict:
    """Check a ``comm_hook`` config without building anything.

    Needs no process group, so the runner hook calls it at the start of
    every run, distributed or not: a typo or a value out of range fails on
    a one-GPU debugging run as it would on 64 GPUs. Checks the names
    (``type``, ``wrapper``, the state keys), then the values, with the
    ``check_args`` of the state factory (see :func:`with_args_check`): the
    built-in ones check the type and range of every key of
    ``fp16_compress``, ``bf16_compress``, ``powerSGD``,
    ``batched_powerSGD`` and ``int8_compress``.

    Args:
        cfg (dict): e.g. ``dict(type='powerSGD', wrapper='bf16',
            matrix_approximation_rank=2)``.

    Returns:
        dict: A copy of the config with the state keys, including the
        defaults this project sets, under ``state_kwargs`` and the names
        of those defaults under ``defaults_set``.

    Raises:
        TypeError: ``cfg`` is not a dict, carries keys the hook's state
            does not take, or a state value of the wrong type (e.g.
            ``comm_hook powerSGD: matrix_approximation_rank should be an int
            >= 1, but got str: 'two'``).
        KeyError: ``type`` is missing or not a registered name.
        ValueError: ``wrapper`` is not ``'fp16'``, ``'bf16'`` or None, or
            wraps a hook that already compresses, or a state value is out
            of range (``comm_hook powerSGD: matrix_approximation_rank should
            be an int >= 1, but got 0``).
    """
    if not isinstance(cfg, dict):
        raise TypeError(
            "comm_hook should be a dict such as dict(type='bf16_compress'), "
            f'but got {type(cfg).__name__}: {cfg!r}')
    cfg = dict(cfg)
    if 'type' not in cfg:
        raise KeyError(
            f'comm_hook needs a `type` key, but got {cfg!r}. Valid types: '
            f'{_valid_types()}')
    hook_type = cfg.pop('type')
    hook = _lookup_hook(hook_type)
    wrapper = cfg.pop('wrapper', None)
    if wrapper is not None and wrapper not in _WRAPPERS:
        raise ValueError(
            "comm_hook wrapper should be 'fp16', 'bf16' or None, but got "
            f'{wrapper!r}')
    record = record_of(hook)
    if wrapper is not None and record.half_precision:
        raise ValueError(
            f"comm_hook type {hook_type!r} already reduces in "
            f'{record.wire}, so wrapper={wrapper!r} would '
            "round twice. Use type='allreduce' with the wrapper, or drop "
            'the wrapper.')
    if wrapper is not None and record.quantizes:
        raise ValueError(
            f"comm_hook type {hook_type!r} already quantizes to "
            f'{record.wire}, so wrapper={wrapper!r} would '
            'round twice. Drop the wrapper.')

    factory = _lookup_state_factory(hook_type)
    defaults_set = []
    if factory is None:
        if cfg:
            raise TypeError(
                f'comm_hook type {hook_type!r} takes no arguments besides '
                f'type and wrapper, but got {sorted(cfg)}. Register a state '
                f'factory in COMM_HOOK_STATES under {hook_type!r} for a '
                'stateful hook.')
    else:
        params = inspect.signature(factory).parameters
        valid = [n for n, p in params.items()
                 if n != 'process_group' and p.kind in (
                     p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = sorted(k for k in cfg if k not in valid)
        if 'process_group' in cfg or (unknown and not takes_any):
            raise TypeError(
                f'comm_hook type {hook_type!r} got unexpected keys '
                f'{unknown}. Valid keys: type, wrapper, {", ".join(valid)} '
                '(the process group is the DDP model\'s own).')
        for key, value in record.defaults.get(wrapper, {}).items():
            if key not in cfg:
                cfg[key] = value
                defaults_set.append(key)
        _run_args_check(factory, hook_type, cfg)
    return dict(type=hook_type, wrapper=wrapper, state_kwargs=cfg,
                defaults_set=tuple(defaults_set))


class CommCounter:
    """Bytes a rank handed to its hooks, and what the hooks sent.

    Counted in Python per bucket as the hooks run: no collective, no device
    synchronisation.

    Attributes:
        baseline_bytes (int): What DDP would have all-reduced without the
            hook: ``numel * element_size`` of each bucket as DDP hands it
            over (4 bytes an element for fp32 gradients, 2 for a bf16 or
            fp16 model's).
        wire_bytes (int): What the hook reduces, as the size of the
            tensor an all-reduce would carry: the bucket in the format it
            sends, or for PowerSGD once it compresses (``iter >=
            start_powerSGD_iter``) the P and Q factors plus the tensors it
            leaves uncompressed. For ``int8_compress``, which reduces as
            an all-to-all and then an all-gather (the two halves of a ring
            all-reduce), it is the quantized bucket: the int8 payload plus
            4 bytes per block scale (blocks are per parameter) and at most
            3 bytes of alignment per rank (:meth:`Int8State.wire_bytes`),
            about ``numel * (1 + 4 / block_size)``, and it covers both
            phases: the hook
            sends ``2 * (world_size - 1) / world_size`` times it from each
            rank, half in each phase, the multiple a ring all-reduce
            sends of its tensor, so counts of different hooks compare as
            their traffic does.
        wire_known (bool): False once a hook ran whose traffic is unknown
            (a user hook).
    """

    def __init__(self) -> None:
        self.baseline_bytes = 0
        self.wire_bytes = 0
        self.wire_known = True

    def pop(self):
        """``(baseline_bytes, wire_bytes or None)`` since the last call."""
        out = (self.baseline_bytes,
               self.wire_bytes if self.wire_known else None)
        self.baseline_bytes = self.wire_bytes = 0
        return out


def _count_baseline(hook: Callable, counter: CommCounter) -> Callable:
    """Outermost: the bucket as DDP hands it over, in its own dtype."""

    def _counted_hook(state, bucket: dist.GradBucket):
        buffer = bucket.buffer()
        counter.baseline_bytes += buffer.numel() * buffer.element_size()
        return hook(state, bucket)

    _counted_hook.__qualname__ = getattr(hook, '__qualname__', 'hook')
    _counted_hook.__wrapped__ = hook
    return _counted_hook


def _count_wire(hook: Callable, counter: CommCounter,
                base: Callable) -> Callable:
    """Around the named hook ``base`` (``hook`` may be it or wrap it): what
    it puts on the wire, as its record counts it. Inside any wrapper, so
    ``bucket.buffer()`` is in the format that is sent."""
    count_wire = record_of(base).count_wire

    def _counted_hook(state, bucket: dist.GradBucket):
        if count_wire is None:
            counter.wire_known = False
            return hook(state, bucket)
        fut, sent = count_wire(hook, state, bucket)
        counter.wire_bytes += sent
        return fut

    _counted_hook.__qualname__ = getattr(hook, '__qualname__', 'hook')
    _counted_hook.__wrapped__ = hook
    return _counted_hook


def _sent_as_they_are(checked: dict, base_hook: Callable,
                      param_names: dict) -> Optional[str]:
    """Say which parameters a half-precision hook or wrapper sends in their
    own 2-byte dtype instead of its own (see ``ddp_hooks._wire_dtype``),
    e.g. a bf16 backbone under ``fp16_compress``: a user who asked for fp16
    should read that part of the model goes as bf16, and why."""
    wrapper = checked['wrapper']
    wire = wrapper or record_of(base_hook).half_precision
    if wire is None:
        return None
    other = 'bf16' if wire == 'fp16' else 'fp16'
    dtype = torch.bfloat16 if other == 'bf16' else torch.float16
    names = [name for param, name in param_names.items()
             if param.requires_grad and param.dtype is dtype]
    if not names:
        return None
    shown = ', '.join(names[:3]) + (f', ... ({len(names)} in all)'
                                    if len(names) > 3 else '')
    what = (f"type={checked['type']!r}" +
            (f', wrapper={wrapper!r}' if wrapper is not None else ''))
    instead = (f"wrapper='{other}'" if wrapper is not None else
               f"type='{other}_compress'")
    why = ('fp16 has far less range than bf16: it would overflow above '
           '65504 and flush values below about 6e-8 to zero'
           if other == 'bf16' else
           'bf16 keeps 3 fewer significant bits than fp16')
    return (f'comm_hook {what}: the {other} parameters ({shown}) are sent '
            f'as {other}, as they are, not cast to {wire} ({why}); the '
            f'bytes are the same. Only fp32 buckets are cast to {wire}. '
            f'For one wire format everywhere use {instead}.')


def build_comm_hook(cfg: dict,
                    process_group: Optional[dist.ProcessGroup] = None,
                    device: Optional[torch.device] = None,
                    counter: Optional[CommCounter] = None,
                    param_names: Optional[dict] = None) -> CommHookSpec:
    """Build the hook and state a ``comm_hook`` config describes.

    Args:
        cfg (dict): See :func:`check_comm_hook_cfg`.
        process_group (ProcessGroup, optional): The group the DDP model
            reduces over. Defaults to None (WORLD). A process group must be
            initialised.
        device (torch.device, optional): Device of the gradients, for the
            bf16 backend check. Defaults to None.
        counter (CommCounter, optional): Count the bytes through the hook
            into this. Defaults to None.
        param_names (dict, optional): Parameter -> name of the DDP model.
            Given, PowerSGD's state is kept per parameter across bucket
            layouts and can be saved (``spec.relayout``), and
            ``spec.notes`` says which parameters a half-precision hook
            sends in their own dtype. Defaults to None.

    Returns:
        CommHookSpec: register it with
        ``ddp.register_comm_hook(spec.state, spec.hook)``. Build one per DDP
        module: stateful hooks must not share state between models.

    Raises:
        The errors of :func:`check_comm_hook_cfg`.
    """
    checked = check_comm_hook_cfg(cfg)
    hook_type, wrapper = checked['type'], checked['wrapper']
    base_hook = _lookup_hook(hook_type)
    factory = _lookup_state_factory(hook_type)
    state_kwargs = checked['state_kwargs']
    state = (process_group if factory is None else factory(
        process_group, **state_kwargs))

    record = record_of(base_hook)
    if wrapper == 'bf16' or record.wire == 'bf16':
        check_bf16_support(process_group, device)
    notes = ()
    if param_names is not None:
        note = _sent_as_they_are(checked, base_hook, param_names)
        notes = (note, ) if note else ()
    if record.notes is not None:
        notes += record.notes(state_kwargs, device)
    hook = base_hook
    relayout = None
    if param_names is not None and record.relayout is not None:
        relayout = record.relayout(state, param_names)
        hook = relayout.wrap(hook)
    if counter is not None:
        hook = _count_wire(hook, counter, base_hook)
    if wrapper is not None:
        hook = _WRAPPERS[wrapper](hook)

    on_worker = record.worker_waits is not None
    if on_worker:
        # The whole chain, so that the state's bookkeeping (PowerSGD's
        # relayout, the int8 plan that the byte count builds) runs on one
        # thread in bucket order.
        hook = on_comm_worker(hook, wait=record.worker_waits)
    if counter is not None:
        hook = _count_baseline(hook, counter)
    name = hook_type if isinstance(hook_type, str) else getattr(
        hook_type, '__qualname__', repr(hook_type))
    return CommHookSpec(
        type=name,
        hook=hook,
        state=state,
        base_hook=base_hook,
        wrapper=wrapper,
        state_kwargs=state_kwargs,
        defaults_set=checked['defaults_set'],
        on_worker=on_worker,
        relayout=relayout,
        notes=notes)


@dataclasses.dataclass
class ShardedCommSpec:
    """What a ``comm_hook`` config makes FSDP2's reduce-scatter do.

    FSDP2 has no DDP communication hooks; the same config types that have
    a sharded form (``allreduce``, ``fp16_compress``, ``bf16_compress``)
    are carried out by
    :class:`~mmcv_custom.sharded_comm.AveragingReduceScatter`, and
    ``int8_compress`` with ``error_feedback=False`` by
    :class:`~mmcv_custom.sharded_comm.Int8ReduceScatter`.

    Attributes:
        type (str): The config name.
        wire_dtype (torch.dtype, optional): What is sent; None for the
            gradients' own dtype (or int8, see ``int8_block_size``).
        notes (tuple[str]): Log warnings, as :class:`CommHookSpec`'s.
        int8_block_size (int, optional): Set for ``int8_compress``: values
            per fp32 scale. Defaults to None.
    """
    type: str
    wire_dtype: Optional[torch.dtype]
    notes: tuple = ()
    state: Any = None  # no DDP-style state (no non-finite records)
    int8_block_size: Optional[int] = None

    def describe(self) -> str:
        """One line saying what is installed, for the training log."""
        if self.int8_block_size is not None:
            return (f"type='{self.type}' (FSDP2 reduce-scatter in int8, one "
                    f'fp32 scale per {self.int8_block_size} values, no error '
                    'feedback, averaged before the rounding)')
        wire = ('the gradients\' own dtype' if self.wire_dtype is None else
                str(self.wire_dtype).replace('torch.', ''))
        return (f"type='{self.type}' (FSDP2 reduce-scatter in {wire}, "
                'averaged before the cast)')


def build_sharded_comm(cfg: dict,
                       param_names: Optional[dict] = None
                       ) -> ShardedCommSpec:
    """The sharded (FSDP2) form of a ``comm_hook`` config.

    Args:
        cfg (dict): See :func:`check_comm_hook_cfg`.
        param_names (dict, optional): Parameter -> name of the sharded
            model, for ``spec.notes`` (a bf16 backbone under
            ``fp16_compress``). Defaults to None.

    Raises:
        ValueError: A type without a sharded form (PowerSGD, user hooks,
            ``int8_compress`` with error feedback), a ``wrapper``, or
            CompressState keys that change nothing under FSDP2
            (``predivide_factor``: the whole division is done before the
            cast; ``check_finite``). Besides the errors of
            :func:`check_comm_hook_cfg`.
    """
    checked = check_comm_hook_cfg(cfg)
    hook_type = checked['type']
    what = f'comm_hook type={hook_type!r}'
    record = hook_record(hook_type)
    if record.sharded == 'int8':
        return _sharded_int8(checked, what)
    if record.sharded != 'reduce_scatter':
        forms = [name for name, hook in COMM_HOOKS.module_dict.items()
                 if record_of(hook).sharded == 'reduce_scatter']
        raise ValueError(
            f'{what} has no sharded form: under FSDP2 (FSDP2Strategy) '
            'gradients are reduce-scattered, not all-reduced through DDP '
            'communication hooks. Use one of '
            f'{", ".join(repr(t) for t in forms)}, or train this hook '
            'with DDP (the default Runner).')
    if checked['wrapper'] is not None:
        raise ValueError(
            f"{what}, wrapper={checked['wrapper']!r}: wrappers have no "
            f"sharded form under FSDP2; use type='{checked['wrapper']}"
            "_compress' instead.")
    given = {k: v for k, v in checked['state_kwargs'].items()
             if k not in checked['defaults_set']
             and v is not None and v is not False}
    if given:
        raise ValueError(
            f'{what}: {", ".join(f"{k}={v!r}" for k, v in given.items())} '
            'is not supported under FSDP2: the sharded form always divides '
            'by the whole world size before the cast (fp16 overflows only '
            'if the mean does) and does not record non-finite buckets. '
            f"Remove it, e.g. comm_hook = dict(type='{hook_type}').")
    notes = ()
    if param_names is not None:
        note = _sent_as_they_are(checked, _lookup_hook(hook_type),
                                 param_names)
        notes = (note, ) if note else ()
    return ShardedCommSpec(type=hook_type, wire_dtype=record.wire_dtype,
                           notes=notes)


def _sharded_int8(checked: dict, what: str) -> ShardedCommSpec:
    """``int8_compress`` under FSDP2: only without error feedback.

    Error feedback keeps, on every rank, what rounding dropped from the
    whole unsharded gradient the rank sends: as large as the gradients
    FSDP2 shards, so it would take back the memory FSDP2 saves.
    """
    if checked['wrapper'] is not None:
        raise ValueError(
            f"{what}, wrapper={checked['wrapper']!r}: int8_compress already "
            'quantizes; drop the wrapper.')
    kwargs = checked['state_kwargs']
    if kwargs.get('error_feedback', True):
        raise ValueError(
            f'{what} with error_feedback=True has no sharded form: under '
            'FSDP2 (FSDP2Strategy) error feedback would keep a full-size, '
            'unsharded residual of the gradients on every rank, the memory '
            'FSDP2 is there to save. Set error_feedback=False (e.g. '
            '--cfg-options comm_hook.error_feedback=False) to reduce-scatter '
            "in int8 without it, or use type='bf16_compress'.")
    return ShardedCommSpec(type='int8_compress', wire_dtype=None,
                           int8_block_size=kwargs.get('block_size', 256))
