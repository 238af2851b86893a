"""One record per communication hook: what the rest of the project needs
to know about it, in one place.

Registering a hook in :data:`~mmcv_custom.comm.registry.COMM_HOOKS` makes it
reachable from a config; its :class:`HookRecord` says how it is handled
there: the format it sends (and so which wrappers it refuses), whether it
runs on the communication worker, how its state follows DDP's bucket
layouts into checkpoints, the defaults the project sets for it, the notes
its log line carries and how the bytes it sends are counted. The built-in
hooks' records are here; a plugin gives its hook one the same way
(``COMM_HOOKS.register_module(record=...)`` or :func:`register_hook_record`)
and both are read with :func:`record_of`. A hook without a record is built
and run as registered; its traffic is reported as unknown. Imports only
torch (and :mod:`mmcv_custom.hooks`). What the cost model projects from
(:attr:`HookRecord.cost`) is in :mod:`.cost_records`; which collectives
count as sent, in :mod:`.traffic`.
"""
import dataclasses
from typing import (Any, Callable, Dict, Mapping, NamedTuple, Optional, Set,
                    Tuple, Type, Union)

import torch
import torch.distributed as dist

from ..hooks.state import HookStateKeeper
from .accuracy import ACCURACY_CLASSES
from .cost_records import CostRecord
from .periodic_costs import PeriodicCost
from .traffic import sent_bytes

__all__ = [
    'HookRecord', 'HOOK_RECORDS', 'record_of', 'has_record',
    'register_hook_record', 'unregister_hook_record', 'add_builtin_records',
    'is_builtin_hook', 'hook_name', 'sends_bucket', 'HookVariant'
]

#: ``count_bytes_sent(hook, state, bucket) -> (future, bytes sent)``.
BytesSentCounter = Callable[[Callable, Any, dist.GradBucket],
                            Tuple[torch.futures.Future, int]]

#: The values of :attr:`HookRecord.fsdp2_form`.
FSDP2_FORMS = ('averaging_reduce_scatter', 'int8_reduce_scatter')

#: ``codec(bucket, world_size, rank) -> run``, see :attr:`HookRecord.codec`.
Codec = Callable[[torch.Tensor, int, int], Callable[[], Any]]


@dataclasses.dataclass(frozen=True)
class HookRecord:
    """What the project knows about one communication hook.

    Example, a plugin's fp16 hook (see
    ``docs/en/advanced_guides/own_hooks.md``)::

        @COMM_HOOKS.register_module(record=HookRecord(
            sent_format='fp16', count_bytes_sent=sends_bucket(2)))
        def my_fp16_hook(state, bucket):
            ...

    Attributes:
        sent_format (str, optional): The format the hook itself sends, e.g.
            ``'fp16'``, ``'bf16'`` or ``'int8'``; None when it sends the
            bucket's dtype (or low-rank factors in it). A hook with a sent
            format refuses a wrapper, which would round twice.
        quantizes (bool): Whether that format is below half precision (the
            refusal's wording differs).
        on_worker (bool): Whether, for CPU buckets, the hook's whole chain
            runs on the communication worker
            (:mod:`mmcv_custom.hooks.worker`): for a hook that waits for its
            own collectives, so that the waiting overlaps the backward.
        waits_per_bucket (bool): On the worker, whether it waits for a
            bucket's future before starting the next bucket (the hook's
            future callbacks issue collectives); False where every
            collective is issued when the hook returns. Needs
            ``on_worker``.
        powersgd_state (bool): Whether it runs on PyTorch's
            ``PowerSGDState`` (and keeps its compression counters).
        state_keeper (type, optional): The
            :class:`~mmcv_custom.hooks.state.HookStateKeeper` that keeps its
            state per parameter across DDP's bucket layouts and
            checkpoints; None for a stateless hook.
        defaults (Mapping): State keys the project sets when a config
            leaves them out, per wrapper (None: no wrapper).
        notes (Callable, optional): ``notes(state_kwargs, device) ->
            tuple[str]``: what its log line should add for these settings.
        count_bytes_sent (Callable, optional): ``count_bytes_sent(hook,
            state, bucket) -> (future, bytes_sent)``: runs the hook and
            says how many bytes it sent (see
            :class:`~mmcv_custom.comm.telemetry.CommCounter` and
            :func:`sends_bucket`); None: unknown.
        model_bytes (Callable, optional): ``model_bytes(params,
            state_kwargs, half, world_size) -> int``: the bytes it sends
            per step for these parameters on ``world_size`` ranks (counted
            by :func:`~.traffic.sent_bytes`), for a hook whose traffic does
            not depend on DDP's buckets (``half``: a half-precision wrapper
            or hook); None where it does.
        fsdp2_form (str, optional): What carries it out under FSDP2:
            ``'averaging_reduce_scatter'`` (a reduce-scatter in
            :attr:`sent_dtype`, see
            :class:`~mmcv_custom.hooks.sharded.AveragingReduceScatter`) or
            ``'int8_reduce_scatter'``
            (:class:`~mmcv_custom.hooks.sharded.Int8ReduceScatter`); None:
            it has no FSDP2 form.
        cost (CostRecord, optional): What the cost model
            (:mod:`mmcv_custom.analysis.cost`) projects its step time
            from: its collectives per bucket on a world size, its codec's
            memory traffic and FLOPs, its caveat, and its two-level form's
            where it has one (:class:`~.cost_records.TwoLevelCost`); a
            periodic hook's is a
            :class:`~.periodic_costs.PeriodicCost` (its synchronisation
            across nodes). None: it is left out of projections.
        label (str, optional): Its short name in the analysis tools' tables
            and legends; None: its registry name.
        colour (str, optional): Its colour in their plots (a matplotlib
            colour); None: the tool picks one.
        codec (Callable, optional): ``codec(bucket, world_size, rank) ->
            run``: ``run()`` compresses the fp32 ``bucket`` (one parameter)
            and decompresses it back in place, as the hook does to each
            element it sends (with the buffers its state keeps), so that
            the benchmarks can time its local work alone; None: it has
            none (it sends the bucket as it is, or low-rank factors).
        benchmark_options (Mapping): State keys the benchmarks and the
            convergence comparison run it with, where its defaults would
            not show it at work in a short run.
        two_level (bool): Whether it has a two-level (node-aware) form:
            its state takes the node groups as ``node_groups`` (set by the
            builder when ``topology`` calls for it, see
            :mod:`mmcv_custom.comm.topology`), and its byte count then
            counts what crosses nodes. Defaults to False.
        variants (tuple[HookVariant]): The settings the convergence
            comparison trains it under, each a variant of its own; empty:
            one, named as registered, with :attr:`label` and
            :attr:`colour`.
        accuracy (str, optional): Its accuracy class, one of
            :data:`~.accuracy.ACCURACY_CLASSES` (a variant may state its
            own, see :func:`~.accuracy.accuracy_of`); None: unknown, so
            the recommendation weighs it only where any loss is accepted.
        evidence (str): What shows it trains as its class says (the
            convergence runs, their figures and where they are
            published); empty: none recorded.
        periodic (bool): Whether it synchronises the model across nodes
            every ``period`` steps rather than averaging the gradients
            every step (``post_local_sgd``, ``diloco``: see
            :mod:`mmcv_custom.hooks.local_sgd`): its DDP hook carries only
            the exchange inside the node, the run steps it after each
            optimizer step, and it takes the node layout (``topology``)
            whatever its two-level form. A plugin's periodic hook needs a
            state derived from
            :class:`mmcv_custom.hooks.local_sgd.PeriodicState`: the run
            steps that state after each optimizer step (the
            synchronisation every ``period`` steps is its). ``auto``
            never tries it and FSDP2 refuses it; it takes no
            ``fsdp2_form``, ``codec`` nor ``two_level`` (refused here).
            Defaults to False.
        state_bytes (Callable, optional): ``state_bytes(buckets,
            state_kwargs) -> int``: the bytes its state keeps on each GPU
            from step to step under DDP (an error-feedback residual,
            warm-start factors), for gradients laid out in ``buckets``
            (each with ``numel``, ``itemsize`` and ``params``, each of
            those with ``shape``: DDP's buckets as
            :func:`mmcv_custom.analysis.cost.ddp_buckets` lays them out)
            and the state's settings; None: unknown (the memory tools say
            so rather than count 0).
    """
    sent_format: Optional[str] = None
    quantizes: bool = False
    on_worker: bool = False
    waits_per_bucket: bool = False
    powersgd_state: bool = False
    state_keeper: Optional[Type[HookStateKeeper]] = None
    defaults: Mapping[Optional[str], Mapping[str, Any]] = \
        dataclasses.field(default_factory=dict)
    notes: Optional[Callable[[dict, Optional[torch.device]], tuple]] = None
    count_bytes_sent: Optional[BytesSentCounter] = None
    model_bytes: Optional[Callable[[Any, dict, bool, int], int]] = None
    fsdp2_form: Optional[str] = None
    cost: Optional[Union[CostRecord, PeriodicCost]] = None
    label: Optional[str] = None
    colour: Optional[str] = None
    codec: Optional[Codec] = None
    benchmark_options: Mapping[str, Any] = \
        dataclasses.field(default_factory=dict)
    variants: Tuple['HookVariant', ...] = ()
    two_level: bool = False
    accuracy: Optional[str] = None
    evidence: str = ''
    state_bytes: Optional[Callable[[Any, dict], int]] = None
    periodic: bool = False

    @property
    def half_precision(self) -> Optional[str]:
        """``'fp16'`` or ``'bf16'`` for a hook that reduces in it."""
        return (self.sent_format if self.sent_format in ('fp16',
                                                         'bf16') else None)

    @property
    def sent_dtype(self) -> Optional[torch.dtype]:
        """The dtype of :attr:`half_precision` (None: the gradients')."""
        return _HALF_DTYPES.get(self.half_precision)

    def __post_init__(self) -> None:
        # A plugin writes its record by hand: a contradiction is an error
        # here rather than a wrapper quietly allowed or a worker not used.
        if self.sent_format is not None and not isinstance(
                self.sent_format, str):
            raise TypeError('HookRecord sent_format should be a str such as '
                            f"'fp16' or None, but got {self.sent_format!r}")
        if self.quantizes and self.sent_format in (None, 'fp16', 'bf16'):
            raise ValueError(
                'HookRecord quantizes=True should name the format below '
                "half precision it sends (e.g. sent_format='int8'), but got "
                f'sent_format={self.sent_format!r}')
        if self.waits_per_bucket and not self.on_worker:
            raise ValueError('HookRecord waits_per_bucket=True needs '
                             'on_worker=True: only the communication worker '
                             'waits between buckets')
        if self.fsdp2_form not in (None, ) + FSDP2_FORMS:
            raise ValueError(f'HookRecord fsdp2_form should be one of '
                             f'{FSDP2_FORMS} or None, but got '
                             f'{self.fsdp2_form!r}')
        if self.periodic:
            self._check_periodic()
        elif isinstance(self.cost, PeriodicCost):
            raise TypeError('HookRecord cost PeriodicCost is for a periodic '
                            'hook (periodic=True); a per-step hook states a '
                            'CostRecord')
        for klass in [self.accuracy] + [v.accuracy for v in self.variants]:
            if klass is not None and klass not in ACCURACY_CLASSES:
                raise ValueError(
                    f'HookRecord accuracy should be one of {ACCURACY_CLASSES}'
                    f' or None, but got {klass!r}')
        for name in ('notes', 'count_bytes_sent', 'model_bytes',
                     'state_bytes'):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f'HookRecord {name} should be callable or '
                                f'None, but got {value!r}')

    def _check_periodic(self) -> None:
        # A periodic hook's traffic across nodes is the run's, every
        # period steps, not a per-bucket form: the fields that describe
        # one would be read by the tools and be wrong.
        why = (
            ('fsdp2_form', 'FSDP2 shards the parameters a periodic hook '
             'synchronises through DDP, so FSDP2 refuses it'),
            ('codec', 'the benchmarks time a codec as a per-step bucket '
             "exchange's local work; a periodic hook's inner hook has its "
             'own'),
            ('two_level', 'a periodic hook always takes the node layout '
             '(its inner hook runs inside the node)'),
        )
        for name, reason in why:
            value = getattr(self, name)
            if value is not None and value is not False:
                raise ValueError(
                    f'HookRecord periodic=True takes no {name}, but got '
                    f'{name}={value!r}: {reason}')
        if self.cost is not None and not isinstance(self.cost, PeriodicCost):
            raise TypeError(
                'HookRecord periodic=True takes a cost that states its '
                'synchronisation, a PeriodicCost '
                '(mmcv_custom.comm.periodic_costs), but got '
                f'{type(self.cost).__name__}')


_HALF_DTYPES = {'fp16': torch.float16, 'bf16': torch.bfloat16}


class HookVariant(NamedTuple):
    """One setting of a hook that the convergence comparison trains
    (:attr:`HookRecord.variants`): its name there, the state keys it sets,
    its label and its plot colour; and, where the setting changes them, its
    accuracy class and evidence (None: the record's, see
    :func:`~.accuracy.accuracy_of`)."""
    name: str
    options: Mapping[str, Any]
    label: str
    colour: Optional[str] = None
    accuracy: Optional[str] = None
    evidence: str = ''


def sends_bucket(element_bytes: Optional[int] = None) -> BytesSentCounter:
    """A :attr:`HookRecord.count_bytes_sent` for a hook that sends the
    bucket whole, ``element_bytes`` an element (None: in the bucket's own
    dtype), e.g. ``sends_bucket(2)`` for one that all-reduces it in fp16.

    Args:
        element_bytes (int, optional): Bytes per element sent. Defaults to
            None.
    """
    if element_bytes is not None and (isinstance(element_bytes, bool)
                                      or not isinstance(element_bytes, int)
                                      or element_bytes < 1):
        raise ValueError('element_bytes should be an int >= 1 or None, but '
                         f'got {element_bytes!r}')

    def count(hook, state, bucket):
        buffer = bucket.buffer()
        numel = buffer.numel()
        groups = getattr(state, 'node_groups', None)
        if groups is not None:
            # The two-level form: what crosses nodes, one all-reduce of
            # the rank's share of the node's sum.
            numel = -(-numel // groups.layout.ranks_per_node)
        size = numel * (element_bytes or buffer.element_size())
        # An all-reduce counts its tensor, whatever the world size.
        return hook(state, bucket), int(sent_bytes([('all_reduce', size)], 1))

    return count


#: Hook function -> its record: the built-in hooks'
#: (:mod:`.builtins`) and those plugins registered
#: (:func:`register_hook_record`). Read it with :func:`record_of`.
HOOK_RECORDS: Dict[Callable, HookRecord] = {}
_BUILTIN_HOOKS: Set[Callable] = set()
_UNKNOWN = HookRecord()


def add_builtin_records(builtins) -> None:
    """Record the project's own hooks (``(name, hook, record)`` entries
    of :data:`~.builtins.BUILTIN_HOOKS`): their records are the project's,
    and no plugin may replace them."""
    for _, hook, record in builtins:
        HOOK_RECORDS[hook] = record
        _BUILTIN_HOOKS.add(hook)


def record_of(hook: Callable) -> HookRecord:
    """``hook``'s record, a built-in's or a plugin's; an empty one (traffic
    unknown) for a hook that has none."""
    return HOOK_RECORDS.get(hook, _UNKNOWN)


def has_record(hook: Callable) -> bool:
    """Whether ``hook`` was registered with a record (a built-in's, or a
    plugin's through ``register_module(record=...)``); without one what
    it sends is unknown."""
    return hook in HOOK_RECORDS


def is_builtin_hook(hook: Callable) -> bool:
    """Whether ``hook`` is one of the project's own hooks (its record is
    the project's, not a plugin's)."""
    return hook in _BUILTIN_HOOKS


def hook_name(hook: Callable) -> str:
    """``module.qualname`` of a hook, to name it in a message."""
    module = getattr(hook, '__module__', None)
    name = getattr(hook, '__qualname__', None) or repr(hook)
    return f'{module}.{name}' if module else name


def register_hook_record(hook: Callable, record: HookRecord) -> None:
    """Give a plugin's hook its record, as the built-in hooks have theirs.

    With a record, the hook's traffic is counted (``comm_MB`` and
    ``comm_ratio``, if the record has ``count_bytes_sent``), a wrapper
    around a hook with a ``sent_format`` is refused as for the built-ins,
    and the rest of the record is used as a built-in's is.
    ``COMM_HOOKS.register_module(record=...)`` calls this.

    Args:
        hook (Callable): The hook function, as registered in ``COMM_HOOKS``.
        record (HookRecord): What the project should know about it.

    Raises:
        TypeError: ``hook`` is not callable or ``record`` not a
            :class:`HookRecord`.
        ValueError: ``hook`` is a built-in (its record is the project's),
            or already has a different record.
    """
    if not callable(hook):
        raise TypeError(f'hook should be callable, but got {hook!r}')
    if not isinstance(record, HookRecord):
        raise TypeError('record should be a HookRecord, but got '
                        f'{type(record).__name__}: {record!r}')
    if is_builtin_hook(hook):
        raise ValueError(
            f'{hook_name(hook)} is a built-in hook of mmcv_custom with its '
            'own record; a plugin cannot replace it. Register a hook of '
            'your own (it may call this one) with the record instead.')
    known = HOOK_RECORDS.get(hook)
    if known is not None and known != record:
        raise ValueError(f'{hook_name(hook)} already has a different '
                         f'record: {known!r}; give each hook one record.')
    HOOK_RECORDS[hook] = record


def unregister_hook_record(hook: Callable) -> None:
    """Forget a plugin hook's record (a built-in's stays)."""
    if not is_builtin_hook(hook):
        HOOK_RECORDS.pop(hook, None)
