"""Checking a ``comm_hook`` config and building what it describes.

A config keeps PyTorch's three pieces apart (as Lightning does): the *hook*
function, looked up by ``type`` in :data:`~.registry.COMM_HOOKS`; its
*state*, built from the remaining keys by the factory registered under the
same name in :data:`~.registry.COMM_HOOK_STATES` (hooks without one get the
process group as state and accept no extra keys); and an optional
half-precision *wrapper*. What the project knows about a hook (the format
it sends, its worker, state keeper, defaults), a built-in's or a plugin's,
is its :class:`~.records.HookRecord`.

:meth:`CommHookConfig.check` checks a config with no process group and
gives the checked, read-only :class:`CommHookConfig` that a run hands on
(a run reads its config once: :func:`~.config.comm_hook_config`);
:func:`check_comm_hook_cfg` is the same check as a plain dict;
:func:`build_comm_hook` builds the hook, its state and the chain around it
from a checked config, without checking it again.
"""
import dataclasses
import inspect
from types import MappingProxyType
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import torch
import torch.distributed as dist
from mmengine.utils import get_object_from_string

from ..hooks.half import (CompressState, bf16_compress_wrapper,
                          check_bf16_support, fp16_compress_wrapper)
from ..hooks.int8 import Int8State
from ..hooks.state import HookStateKeeper
from ..hooks.topology import NodeClaim
from ..hooks.worker import on_comm_worker
from . import states  # noqa: F401 (registers the built-in factories)
from .auto import AUTO, check_auto_cfg
from .half_notes import describe_sent_as_they_are
from .local_sgd import check_inner, prepare_periodic
from .records import HookRecord, record_of
from .registry import COMM_HOOK_STATES, COMM_HOOKS, did_you_mean
from .telemetry import CommCounter, add_baseline_count, add_sent_count
from .topology import Topology, check_topology, resolve_topology

__all__ = [
    'CommHookConfig', 'CommHookSpec', 'check_comm_hook_cfg', 'build_comm_hook',
    'hook_record', 'lookup_hook', 'CommHookConfigError'
]

_WRAPPERS: Dict[str, Callable] = {
    'fp16': fp16_compress_wrapper,
    'bf16': bf16_compress_wrapper,
}


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
            worker thread (see ``HookRecord.on_worker``): CPU buckets are
            communicated one at a time, in DDP's order, while the backward
            pass goes on.
        state_keeper (HookStateKeeper, optional): Saves and restores the
            hook's state per parameter (built when ``param_names`` is
            given, for a hook whose record names a keeper).
        notes (tuple[str]): What the user should read in the log besides
            :meth:`describe`, as warnings (e.g. a bf16 backbone's buckets
            sent as bf16 under ``fp16_compress``).
        topology (str): Flat or two-level, and why (see
            :mod:`.topology`); empty where not decided (a plugin's hook).
    """
    type: str
    hook: Callable
    state: Any
    base_hook: Callable
    wrapper: Optional[str] = None
    state_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    defaults_set: tuple = ()
    on_worker: bool = False
    state_keeper: Optional[HookStateKeeper] = None
    notes: tuple = ()
    topology: str = ''

    def describe(self) -> str:
        """One line saying what is registered, for the training log."""
        base = getattr(self.base_hook, '__qualname__', repr(self.base_hook))
        parts = [f"type='{self.type}' ({base})"]
        parts.append(f"wrapper={self.wrapper!r}")
        if isinstance(self.state, (CompressState, Int8State)):
            parts.append(f'state: {self.state!r}')
        elif self.state_kwargs:
            args = ', '.join(f'{k}={v!r}' +
                             (' (default set by mmcv_custom)' if k in
                              self.defaults_set else '')
                             for k, v in self.state_kwargs.items())
            parts.append(f'state: {type(self.state).__name__}({args})')
        if self.topology:
            parts.append(f'topology: {self.topology}')
        if self.on_worker:
            parts.append('CPU buckets communicated in order on a worker '
                         'thread, overlapped with backward')
        return ', '.join(parts)


def _valid_types() -> str:
    return ', '.join(sorted(COMM_HOOKS.module_dict)) + f' (or {AUTO!r})'


def lookup_hook(hook_type: Any) -> Callable:
    """The hook function a config's ``type`` names: a name registered in
    :data:`~.registry.COMM_HOOKS`, a dotted import path, or the callable
    itself.

    Raises:
        TypeError: ``type`` is neither a str nor a callable, or its path
            names something not callable.
        KeyError: A name not registered (nor, for a dotted path,
            importable), with the valid names and how to register one.
    """
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
            f'{COMM_HOOKS.scope}::{COMM_HOOKS.name} registry'
            f'{did_you_mean(hook_type, extra=(AUTO, ))}. Valid types: '
            f'{_valid_types()}. Register your own with '
            '@COMM_HOOKS.register_module(), or give an import path such as '
            "'my_pkg.hooks.my_hook'.")
    return hook


def hook_record(hook_type: Any) -> HookRecord:
    """The record (:mod:`mmcv_custom.comm.records`) of the hook a config's
    ``type`` names, a built-in's or a plugin's; an empty one for a hook
    without a record."""
    return record_of(lookup_hook(hook_type))


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
                and param.kind
                in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)):
            args[name] = param.default
    args.update(state_kwargs)
    return args


def _run_args_check(factory: Callable, hook_type: str, state_kwargs: dict,
                    given: Sequence[str]) -> List[Exception]:
    """The errors of the factory's ``check_args``, every bad value named.

    The ``given`` keys are checked together first; when that fails, each
    is checked beside the defaults, and one that fails alone is checked
    again beside the other given keys that do not (a rule between keys,
    such as PowerSGD's ``start_powerSGD_iter=1`` that needs
    ``use_error_feedback=False``, may need them). Then the good keys
    together, for the rules between them.
    """
    check = getattr(factory, 'check_args', None)
    if check is None:
        return []

    def run(kwargs: dict) -> Optional[Exception]:
        try:
            check(_factory_args(factory, kwargs))
        except TypeError as e:
            return TypeError(f'comm_hook {hook_type}: {e}')
        except ValueError as e:
            return ValueError(f'comm_hook {hook_type}: {e}')
        return None

    whole = run(state_kwargs)
    if whole is None:
        return []
    defaults = {k: v for k, v in state_kwargs.items() if k not in given}
    alone = {}
    for key in given:
        error = run(dict(defaults, **{key: state_kwargs[key]}))
        if error is not None:
            alone[key] = error
    errors, bad = [], set()
    for key, error in alone.items():
        others = {k: v for k, v in state_kwargs.items() if k not in alone}
        if run(dict(others, **{key: state_kwargs[key]})) is not None:
            errors.append(error)
            bad.add(key)
    good = {k: v for k, v in state_kwargs.items() if k not in bad}
    together = run(good) if bad else whole
    if together is not None and str(together) not in map(str, errors):
        errors.append(together)
    return errors


def _check_wrapper(hook_type: Any, wrapper: Any,
                   record: Optional[HookRecord]) -> List[Exception]:
    """A known wrapper, and none around a hook that already rounds
    (``record``: None while the hook is unknown)."""
    if wrapper is not None and wrapper not in _WRAPPERS:
        return [
            ValueError(
                "comm_hook wrapper should be 'fp16', 'bf16' or None, but got "
                f'{wrapper!r}')
        ]
    if wrapper is not None and record is not None and record.periodic:
        return [
            ValueError(
                f'comm_hook type {hook_type!r} exchanges the gradients inside '
                'the node through its inner hook: put the wrapper there, '
                f"inner=dict(type='allreduce', wrapper={wrapper!r}), not on "
                f'{hook_type!r}')
        ]
    if wrapper is not None and record is not None and record.half_precision:
        return [
            ValueError(
                f"comm_hook type {hook_type!r} already reduces in "
                f'{record.sent_format}, so wrapper={wrapper!r} would '
                "round twice. Use type='allreduce' with the wrapper, or drop "
                'the wrapper.')
        ]
    if wrapper is not None and record is not None and record.quantizes:
        return [
            ValueError(f"comm_hook type {hook_type!r} already quantizes to "
                       f'{record.sent_format}, so wrapper={wrapper!r} would '
                       'round twice. Drop the wrapper.')
        ]
    return []


def _check_state_keys(hook_type: Any, wrapper: Optional[str],
                      record: HookRecord,
                      state_kwargs: dict) -> Tuple[tuple, List[Exception]]:
    """Check the state keys by the factory's signature and its
    ``check_args``, after adding the defaults the record sets (in place).
    Returns the names of the defaults added and every error found."""
    factory = _lookup_state_factory(hook_type)
    if factory is None:
        if state_kwargs:
            return (), [
                TypeError(
                    f'comm_hook type {hook_type!r} takes no arguments '
                    f'besides type and wrapper, but got '
                    f'{sorted(state_kwargs)}. Register a state factory in '
                    f'COMM_HOOK_STATES under {hook_type!r} for a stateful '
                    'hook.')
            ]
        return (), []
    params = inspect.signature(factory).parameters
    valid = [
        n for n, p in params.items()
        if n != 'process_group' and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                               p.KEYWORD_ONLY)
    ]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in state_kwargs if k not in valid)
    errors: List[Exception] = []
    if 'process_group' in state_kwargs or (unknown and not takes_any):
        hybrid = (" residual_dtype is int8_compress's under hybrid FSDP2 "
                  "sharding only (FSDP2Strategy sharding='hybrid')."
                  if 'residual_dtype' in unknown else '')
        errors.append(
            TypeError(f'comm_hook type {hook_type!r} got unexpected keys '
                      f'{unknown}. Valid keys: type, wrapper, '
                      f'{", ".join(valid)} (the process group is the DDP '
                      f"model's own).{hybrid}"))
        for key in unknown:
            state_kwargs.pop(key)
        state_kwargs.pop('process_group', None)
    # Keys the factory has no default for (DiLoCo's period): named, with
    # what the factory says of them (its ``required_keys``).
    helps = getattr(factory, 'required_keys', {})
    for key, param in params.items():
        if (key != 'process_group' and param.default is param.empty
                and key in valid and key not in state_kwargs):
            errors.append(
                TypeError(f'comm_hook type {hook_type!r} needs {key}'
                          f'{": " + helps[key] if key in helps else ""}'))
    given = list(state_kwargs)
    defaults_set = []
    for key, value in record.defaults.get(wrapper, {}).items():
        if key not in state_kwargs:
            state_kwargs[key] = value
            defaults_set.append(key)
    errors += _run_args_check(factory, hook_type, state_kwargs, given)
    return tuple(defaults_set), errors


class CommHookConfigError(ValueError):
    """A ``comm_hook`` config with several problems; ``errors`` holds
    each (a ``TypeError``, ``KeyError`` or ``ValueError`` of its own), and
    the message names them all."""

    def __init__(self, errors: Sequence[Exception]) -> None:
        self.errors = list(errors)
        lines = '; '.join(f'({i}) {_text(e)}'
                          for i, e in enumerate(self.errors, 1))
        super().__init__(f'comm_hook has {len(self.errors)} problems: '
                         f'{lines}')


def _text(error: Exception) -> str:
    """An error's message (a KeyError's without the quotes it adds)."""
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    return str(error)


def _raise_all(errors: Sequence[Exception]) -> None:
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise CommHookConfigError(errors)


@dataclasses.dataclass(frozen=True)
class CommHookConfig:
    """A ``comm_hook`` config, checked: all a run reads of it, read-only.

    Made once per rank (:func:`~.config.comm_hook_config`, the one check:
    ``docs/en/design/layout.md``, "The path of ``comm_hook``") and handed
    to what acts on it: :func:`build_comm_hook`, the FSDP2 forms
    (:func:`~.sharded.build_sharded_comm`), ``auto``'s trials, the hook
    state files. None of them checks it again, so the rules live in one
    place.

    Attributes:
        given (Mapping): The config as written.
        type: Its ``type``: a registered name, an import path, the hook
            itself, or ``'auto'``.
        wrapper (str, optional): ``'fp16'``, ``'bf16'`` or None.
        topology: ``'auto'``, ``'flat'`` or ``dict(ranks_per_node=N)``.
        state_kwargs (Mapping): The state arguments in effect, including
            the defaults this project sets (``defaults_set``).
        defaults_set (tuple[str]): Names in ``state_kwargs`` the user did
            not write.
        base_hook (Callable, optional): The hook ``type`` names; None for
            ``auto``.
        record (HookRecord, optional): Its record; None for ``auto``.
        auto (Mapping, optional): ``auto``'s settings, defaults included
            (:func:`~.auto.check_auto_cfg`); None for a named hook.
        candidates (tuple): ``auto``'s candidates that run where it was
            checked, each ``(AutoCandidate, CommHookConfig)``, checked
            once here.
        sharding (str, optional): Where it was checked for: None for DDP,
            ``'full'`` or ``'hybrid'`` for FSDP2 (see :mod:`.sharded`).
        residual_dtype (str, optional): ``int8_compress``'s under hybrid
            sharding (:data:`~.sharded.RESIDUAL_DTYPES`); None: not given.
    """
    given: Mapping
    type: Any
    wrapper: Optional[str] = None
    topology: Any = 'auto'
    state_kwargs: Mapping = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    defaults_set: tuple = ()
    base_hook: Optional[Callable] = dataclasses.field(default=None, repr=False)
    record: Optional[HookRecord] = dataclasses.field(default=None, repr=False)
    auto: Optional[Mapping] = None
    candidates: tuple = dataclasses.field(default=(), repr=False)
    sharding: Optional[str] = None
    residual_dtype: Optional[str] = None
    inner: Optional['CommHookConfig'] = None

    @classmethod
    def check(
            cls,
            cfg: Any,
            runnable: Optional[Callable[[dict],
                                        Any]] = None) -> 'CommHookConfig':
        """The checks of :func:`check_comm_hook_cfg`, as a
        :class:`CommHookConfig` for DDP (``runnable``: ``auto``'s, see
        :func:`~.auto.check_auto_cfg`; the FSDP2 form adds its own checks
        in :func:`~.sharded.check_sharded_cfg`)."""
        if not isinstance(cfg, dict):
            raise TypeError(
                "comm_hook should be a dict such as dict(type='bf16_compress'"
                f'), but got {type(cfg).__name__}: {cfg!r}')
        given = MappingProxyType(dict(cfg))
        cfg = dict(cfg)
        wrapper = cfg.pop('wrapper', None)
        topology = cfg.pop('topology', 'auto')
        if 'type' not in cfg:
            _raise_all([
                KeyError(f'comm_hook needs a `type` key, but got '
                         f'{dict(given)!r}. Valid types: {_valid_types()}')
            ] + _check_wrapper(None, wrapper, None))
        hook_type = cfg.pop('type')
        if hook_type == AUTO and AUTO not in COMM_HOOKS.module_dict:
            # Not a hook: the run picks one (see .auto).
            settings = check_auto_cfg(dict(given), runnable)
            return cls(given=given, type=AUTO, auto=MappingProxyType(settings))
        try:
            base_hook = lookup_hook(hook_type)
        except (KeyError, TypeError) as e:
            # The keys depend on the type: only the wrapper can be judged.
            _raise_all([e] + _check_wrapper(hook_type, wrapper, None))
        record = record_of(base_hook)
        errors = _check_wrapper(hook_type, wrapper, record)
        errors += check_topology(topology, hook_type, record,
                                 _two_level_types())
        defaults_set, found = _check_state_keys(hook_type, wrapper, record,
                                                cfg)
        inner = None
        if record.periodic and isinstance(cfg.get('inner'), dict):
            # The exchange inside the node: a config of its own.
            try:
                inner = cls.check(check_inner(cfg['inner']))
            except (TypeError, ValueError, KeyError) as e:
                found.append(
                    type(e)(f'comm_hook {hook_type} inner: {_text(e)}'))
        _raise_all(errors + found)
        return cls(
            given=given,
            type=hook_type,
            wrapper=wrapper,
            topology=topology,
            state_kwargs=MappingProxyType(cfg),
            defaults_set=defaults_set,
            base_hook=base_hook,
            record=record,
            inner=inner)

    def as_dict(self) -> dict:
        """What :func:`check_comm_hook_cfg` returns: ``auto``'s settings,
        or the names with the state keys under ``state_kwargs``."""
        if self.auto is not None:
            return dict(self.auto)
        return dict(
            type=self.type,
            wrapper=self.wrapper,
            topology=self.topology,
            state_kwargs=dict(self.state_kwargs),
            defaults_set=self.defaults_set)


def check_comm_hook_cfg(cfg: Any) -> dict:
    """Check a ``comm_hook`` config without building anything.

    Needs no process group, so a run checks its config at its start,
    distributed or not (as a :class:`CommHookConfig`, the same checks): a
    typo or a value out of range fails on a one-GPU debugging run as it
    would on 64 GPUs. Checks the names
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

    Every problem is found before one is raised: a config with several
    raises :class:`CommHookConfigError` naming each (its ``errors``), one
    with a single problem raises that problem's own error:

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
    return CommHookConfig.check(cfg).as_dict()


def _two_level_types() -> list:
    """The registered names whose hooks have a two-level form."""
    return sorted(name for name, hook in COMM_HOOKS.module_dict.items()
                  if record_of(hook).two_level)


def build_comm_hook(cfg: Union[dict, CommHookConfig],
                    process_group: Optional[dist.ProcessGroup] = None,
                    device: Optional[torch.device] = None,
                    counter: Optional[CommCounter] = None,
                    param_names: Optional[dict] = None,
                    node_claim: Optional[NodeClaim] = None) -> CommHookSpec:
    """Build the hook and state a ``comm_hook`` config describes.

    Args:
        cfg (dict or CommHookConfig): See :func:`check_comm_hook_cfg`; a
            :class:`CommHookConfig` is not checked again.
        process_group (ProcessGroup, optional): The group the DDP model
            reduces over. Defaults to None (WORLD). A process group must be
            initialised.
        device (torch.device, optional): Device of the gradients, for the
            bf16 backend check. Defaults to None.
        counter (CommCounter, optional): Count the bytes through the hook
            into this. Defaults to None.
        param_names (dict, optional): Parameter -> name of the DDP model.
            Given, PowerSGD's state is kept per parameter across bucket
            layouts and can be saved (``spec.state_keeper``), and
            ``spec.notes`` says which parameters a half-precision hook
            sends in their own dtype. Defaults to None.
        node_claim (NodeClaim, optional): What this rank's launcher says of
            its node, for ``topology='auto'`` (see :mod:`.topology`); None:
            it says nothing, and 'auto' is flat. Collective: with a hook
            that has a two-level form, every rank builds together.

    Returns:
        CommHookSpec: register it with
        ``ddp.register_comm_hook(spec.state, spec.hook)``. Build one per DDP
        module: stateful hooks must not share state between models.

    Raises:
        The errors of :func:`check_comm_hook_cfg`.
    """
    checked = cfg if isinstance(cfg,
                                CommHookConfig) else CommHookConfig.check(cfg)
    if checked.type == AUTO:
        raise ValueError(
            "comm_hook type='auto' is not one hook: the runner hook "
            '(CommHookRegistrationHook) tries the allowed ones and keeps '
            'one (mmcv_custom.comm.auto); build_comm_hook builds a named '
            f'hook, one of {_valid_types()}')
    hook_type, wrapper = checked.type, checked.wrapper
    base_hook, record = checked.base_hook, checked.record
    factory = _lookup_state_factory(hook_type)
    state_kwargs = dict(checked.state_kwargs)
    state = (
        process_group
        if factory is None else factory(process_group, **state_kwargs))

    if record.periodic:
        # Its own node groups and inner exchanges (collective).
        topology = Topology(
            None,
            prepare_periodic(state, checked, process_group, device,
                             param_names, node_claim, build_comm_hook))
    else:
        topology = resolve_topology(checked.topology, record, process_group,
                                    node_claim)
    if topology.groups is not None:
        state.node_groups = topology.groups
    if wrapper == 'bf16' or record.sent_format == 'bf16':
        check_bf16_support(process_group, device)
    notes = ()
    if param_names is not None:
        note = describe_sent_as_they_are(checked, base_hook, param_names)
        notes = (note, ) if note else ()
    if record.notes is not None:
        notes += record.notes(state_kwargs, device)
    hook = base_hook
    state_keeper = None
    if param_names is not None and record.state_keeper is not None:
        state_keeper = record.state_keeper(state, param_names)
        hook = state_keeper.wrap(hook)
    if counter is not None:
        hook = add_sent_count(hook, counter, base_hook)
    if wrapper is not None:
        hook = _WRAPPERS[wrapper](hook)

    on_worker = record.on_worker
    if on_worker:
        # The whole chain, so that the state's bookkeeping (PowerSGD's
        # relayout, the int8 plan that the byte count builds) runs on one
        # thread in bucket order.
        hook = on_comm_worker(hook, wait=record.waits_per_bucket)
    if counter is not None:
        hook = add_baseline_count(hook, counter)
    name = hook_type if isinstance(hook_type, str) else getattr(
        hook_type, '__qualname__', repr(hook_type))
    return CommHookSpec(
        type=name,
        hook=hook,
        state=state,
        base_hook=base_hook,
        wrapper=wrapper,
        state_kwargs=state_kwargs,
        defaults_set=checked.defaults_set,
        on_worker=on_worker,
        state_keeper=state_keeper,
        notes=notes,
        topology=topology.describe)
