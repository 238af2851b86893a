"""The periodic hooks (``post_local_sgd``, ``diloco``) in the cost model.

Their step is not one gradient exchange. Every step the inner hook (any
per-step hook, ``allreduce`` by default) exchanges the gradients among a
node's ``G`` ranks: its own collectives over ``G`` ranks, each at level
``'intra'`` on the GPU links, beside the backward as any hook's (with one
rank a node there is none). Every ``period`` optimizer steps, after the
optimizer step, the model crosses the nodes as the record's
:class:`~mmcv_custom.comm.periodic_costs.PeriodicCost` states it: each
rank's ``1 / G`` slice in the outer format among its ``M`` peers (the
node's ``G`` rings share its link), then the slices gathered inside the
node in fp32. Nothing hides that synchronisation, so a step's prediction
is the inner hook's step plus ``sync / period`` (the average step), and
the step that synchronises is the inner hook's plus the whole ``sync``
(:attr:`~.recommend.StepPrediction.sync_step_s`).

DiLoCo's streaming form (``fragments`` F, ``overlap`` tau) runs F
synchronisations a period, each of one fragment of the slice (1/F of the
bytes). With tau > 0 a fragment's exchange across nodes is started after
the optimizer step and waited for tau steps later, so up to tau times the
step's own time (compute and the inner exchange) of it is hidden, if the
link runs beside the compute: exposed ``max(0, cross - tau * step)`` a
fragment; its local work and the gather inside the node stay exposed.
The average step adds ``F * exposed / period``; the step that
synchronises, one fragment's whole exposed time (its local work counted
on one step: an upper bound). The in-flight fragment's receive buffers
are kept from step to step, in the memory per GPU.

:func:`periodic_costs` makes one :class:`PeriodicHookCost` per hook,
period and (``diloco``) outer format, for one node layout;
:func:`periodic_table` is the projection's table of them.
"""
import dataclasses
import itertools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from mmcv_custom.comm.accuracy import accuracy_of
from mmcv_custom.comm.builder import hook_record
from mmcv_custom.comm.periodic_costs import (PeriodicCost, overlap_limit,
                                             slice_numel)
from mmcv_custom.comm.records import HookRecord
from mmcv_custom.comm.traffic import reduced_bytes
from mmcv_custom.hooks.local_sgd import DEFAULT_INNER
from ..registered import registered_hooks
from .buckets import Bucket, ParamSpec
from .checks import require_count
from .codecs import GpuCodec
from .collectives import Cluster, Collective, group_size, traffic
from .hooks import HookCost, RecordCost
from .memory import GiB, ddp_memory, hook_state_bytes

__all__ = [
    'DEFAULT_PERIODS', 'DEFAULT_INNER_TYPE', 'Sync', 'NO_SYNC',
    'PeriodicHookCost', 'periodic_costs', 'left_out_lines', 'periodic_table'
]

#: The periods projected where none are given: every 25 optimizer steps,
#: 100 and 500 (the DiLoCo paper's H).
DEFAULT_PERIODS = (25, 100, 500)

#: The inner hook of a config that names none (the hooks' own default).
DEFAULT_INNER_TYPE = DEFAULT_INNER['type']


class Sync(NamedTuple):
    """One synchronisation on a cluster, from one rank's side.

    Attributes:
        seconds (float): Its time: the collectives one after the other,
            and its local work.
        codec_s (float): The local work's part of it.
        wire_s (float): Its bytes over the link rates, no latency.
        sent_bytes (float): What crosses nodes, by the one counting rule
            (what the run's ``cross_MB`` adds up over the period).
        node_bytes (float): Bytes through each node link, each way.
        collectives (int): How many.
        cross_s (float): The part of :attr:`seconds` across nodes (what an
            overlap may hide). Defaults to 0.
        cross_wire_s (float): The part of :attr:`wire_s` across nodes.
            Defaults to 0.
        per_period (int): Synchronisations a period (``fragments``; each
            field above is one's). Defaults to 1.
        overlap (int): Steps its exchange across nodes runs beside.
            Defaults to 0: none.
    """
    seconds: float
    codec_s: float
    wire_s: float
    sent_bytes: float
    node_bytes: float
    collectives: int
    cross_s: float = 0.0
    cross_wire_s: float = 0.0
    per_period: int = 1
    overlap: int = 0

    def exposed_s(self, step_s: float) -> float:
        """One synchronisation's time that steps of ``step_s`` (compute
        and the inner exchange) do not hide: its exchange across nodes
        less ``overlap`` steps, at least 0, and the rest whole."""
        return self.seconds - min(self.cross_s, self.overlap * step_s)

    def exposed_wire_s(self, step_s: float) -> float:
        """As :meth:`exposed_s`, of :attr:`wire_s`."""
        return self.wire_s - min(self.cross_wire_s, self.overlap * step_s)


#: A per-step hook's: none.
NO_SYNC = Sync(0.0, 0.0, 0.0, 0.0, 0.0, 0)


class PeriodicHookCost(HookCost):
    """A periodic hook with its settings, on ``num_nodes`` nodes of
    ``ranks_per_node`` ranks.

    Args:
        name (str): ``'post_local_sgd'`` or ``'diloco'`` (or a plugin's
            periodic hook whose record states a ``PeriodicCost``).
        ranks_per_node (int): ``G``.
        num_nodes (int): ``M``.
        inner (str | HookCost): The hook that exchanges the gradients
            inside the node every step. Defaults to ``'allreduce'``.
        record (HookRecord, optional): Defaults to the registered hook's.
        **settings: The cost record's settings (``period``, which has no
            default; ``outer_format``, ``block_size``, ``fragments``,
            ``overlap``).

    Raises:
        KeyError: ``name`` is not registered.
        ValueError: Its record states no ``PeriodicCost``; a setting is
            not one of its; ``period`` is missing or below 1; ``fragments``
            below 1; ``overlap`` below 0 or not below ``period //
            fragments`` (the hook's own rule: a fragment's exchange ends
            before its next one starts).
    """

    form = 'periodic'

    def __init__(self,
                 name: str,
                 ranks_per_node: int,
                 num_nodes: int,
                 inner: Any = DEFAULT_INNER_TYPE,
                 record: Optional[HookRecord] = None,
                 **settings: Any) -> None:
        require_count('ranks_per_node', ranks_per_node)
        require_count('num_nodes', num_nodes)
        record = hook_record(name) if record is None else record
        cost = record.cost
        if not isinstance(cost, PeriodicCost):
            raise ValueError(f'{name}: its HookRecord states no PeriodicCost,'
                             ' so the cost model cannot project its '
                             'synchronisation')
        unknown = sorted(set(settings) - set(cost.settings))
        if unknown:
            raise ValueError(f'{name}: settings should be among '
                             f'{sorted(cost.settings)}, but got {unknown}')
        self.settings = {
            k: settings.get(k, v)
            for k, v in cost.settings.items()
        }
        if self.settings.get('period') is None:
            raise ValueError(f'{name}: period (the optimizer steps between '
                             'synchronisations) should be given: the hook '
                             'has no default')
        require_count('period', self.settings['period'])
        self.fragments = self.settings.get('fragments', 1)
        self.overlap = self.settings.get('overlap', 0)
        require_count('fragments', self.fragments)
        spacing = overlap_limit(self.settings['period'], self.fragments)
        if (isinstance(self.overlap, bool)
                or not isinstance(self.overlap, int)
                or not 0 <= self.overlap < spacing):
            raise ValueError(
                f'{name}: overlap should be an int >= 0 and below period // '
                f'fragments ({spacing}), but got {self.overlap!r}')
        self.name = name
        self.record = record
        self.cost = cost
        self.period = self.settings['period']
        self.ranks_per_node = ranks_per_node
        self.num_nodes = num_nodes
        self.inner = inner if isinstance(inner,
                                         HookCost) else RecordCost(inner)
        self.lossless = False
        self.caveat = cost.caveat
        self.accuracy = accuracy_of(record, self.settings)

    @property
    def key(self) -> str:
        """Its label: several settings of one hook are weighed apart."""
        return self.label()

    def label(self) -> str:
        text = f'{self.name} {self.cost.detail.format(**self.settings)}'
        extra = [
            words.format(**self.settings)
            for k, words in self.cost.extra_detail.items()
            if self.settings[k] != self.cost.settings[k]
        ]
        if extra:
            text = f'{text[:-1]}, {", ".join(extra)})'
        if self.inner.name != DEFAULT_INNER_TYPE:
            text += f' (inner {self.inner.label()})'
        return text

    def config_keys(self) -> Dict[str, Any]:
        defaults = self.cost.settings
        keys = {
            k: v
            for k, v in self.settings.items()
            if k == 'period' or v != defaults[k]
        }
        if self.inner.name != DEFAULT_INNER_TYPE:
            keys['inner'] = dict(
                type=self.inner.name, **self.inner.config_keys())
        return keys

    def _check(self, world_size: int) -> None:
        layout = self.ranks_per_node * self.num_nodes
        if world_size != layout:
            raise ValueError(
                f'{self.name} was costed for {self.num_nodes} nodes x '
                f'{self.ranks_per_node} ranks ({layout}), but got world_size '
                f'{world_size}')

    def collectives(self, buckets, world_size):
        """The inner hook's, over the node's ``G`` ranks (none for one)."""
        self._check(world_size)
        if self.ranks_per_node == 1:
            return [[] for _ in buckets]
        return [[
            Collective(c.kind, c.nbytes, c.bucket, 'intra') for c in bucket
        ] for bucket in self.inner.collectives(buckets, self.ranks_per_node)]

    def memory_bytes(self, bucket, world_size=1):
        if self.ranks_per_node == 1:
            return 0.0
        return self.inner.memory_bytes(bucket, self.ranks_per_node)

    def flops(self, bucket, world_size=1):
        if self.ranks_per_node == 1:
            return 0.0
        return self.inner.flops(bucket, self.ranks_per_node)

    def sync_collectives(self, numel: int) -> List[Collective]:
        """One synchronisation's collectives for ``numel`` trainable
        values, each at its level."""
        return [
            Collective(kind, nbytes, 0, level)
            for kind, nbytes, level in self.cost.sync_sends(
                numel, self.ranks_per_node, self.num_nodes, self.settings)
            if nbytes > 0
        ]

    def synchronisation(self, buckets, cluster: Cluster, constants,
                        codec) -> Sync:
        """One synchronisation's (one fragment's) time and bytes on
        ``cluster``; its local work at the HBM rate of ``codec`` (a
        :class:`GpuCodec`'s, else the default GPU's)."""
        self._check(cluster.world_size)
        numel = sum(b.numel for b in buckets)
        collectives = self.sync_collectives(numel)
        loads = [traffic(c, cluster) for c in collectives]
        hbm = (codec if isinstance(codec, GpuCodec) else GpuCodec()).hbm_Bps
        local = self.cost.sync_codec_bytes(numel, self.ranks_per_node,
                                           self.num_nodes, self.settings) / hbm
        link = [
            t.seconds(cluster, constants.alpha_s, constants.eta,
                      constants.intra_alpha_s) for t in loads
        ]
        cross = [c.level != 'intra' for c in collectives]
        return Sync(
            seconds=local + sum(link),
            codec_s=local,
            wire_s=sum(t.seconds(cluster) for t in loads),
            sent_bytes=sum(
                reduced_bytes(c.kind, c.nbytes, group_size(c, cluster))
                for c in collectives if c.level != 'intra'),
            node_bytes=sum(t.node_bytes for t in loads),
            collectives=len(collectives),
            cross_s=sum(s for s, c in zip(link, cross) if c),
            cross_wire_s=sum(
                t.seconds(cluster) for t, c in zip(loads, cross) if c),
            per_period=self.fragments,
            overlap=self.overlap)

    def gpu_memory(self, buckets: Sequence[Bucket], facts):
        """Per GPU under DDP: as any hook's (:func:`~.memory.ddp_memory`),
        its state that of the rank's slice (its record's ``state_bytes``
        of one fp32 bucket of the slice: DiLoCo's global parameters, outer
        momentum and int8's residual), plus the inner hook's state (of
        every gradient) and, with ``overlap``, the in-flight fragment's
        receive buffers (kept beside the forward and backward; its
        record's ``sync_inflight_bytes``) and, apart, what the
        synchronisation (one fragment's) needs beyond
        it: its buffers, less the gradients the optimizer wrapper's
        ``zero_grad`` (``set_to_none``, torch's default) has freed before
        it where they are tensors of their own (DDP's buckets are not
        freed; with ``gradient_as_bucket_view=True`` the gradients are
        views of them)."""
        numel = sum(b.numel for b in buckets)
        part = [
            Bucket((ParamSpec((slice_numel(numel, self.ranks_per_node), ),
                              'float32'), ))
        ]
        memory = ddp_memory(facts['param_bytes'], buckets, None, None,
                            bool(facts.get('gradient_as_bucket_view')))
        own = hook_state_bytes(self.record, part, self.settings)
        inner = getattr(self.inner, 'record', None)
        kept = (None if inner is None else hook_state_bytes(
            inner, buckets, self.inner.settings))
        if kept is not None and self.overlap and self.cost.sync_inflight_bytes:
            kept += int(
                self.cost.sync_inflight_bytes(numel, self.ranks_per_node,
                                              self.num_nodes, self.settings))
        return dataclasses.replace(
            memory,
            state_bytes=None if own is None or kept is None else own + kept,
            transient_bytes=max(
                0,
                int(
                    self.cost.sync_buffer_bytes(numel, self.ranks_per_node,
                                                self.num_nodes, self.settings))
                - (memory.grad_bytes if memory.bucket_bytes else 0)))


def periodic_costs(
        ranks_per_node: int,
        num_nodes: int,
        periods: Optional[Sequence[int]] = None,
        outer_formats: Optional[Sequence[str]] = None,
        inner: str = DEFAULT_INNER_TYPE,
        names: Optional[Sequence[str]] = None,
        fragments: Optional[Sequence[int]] = None,
        overlap: Optional[Sequence[int]] = None
) -> Dict[str, PeriodicHookCost]:
    """Every registered periodic hook whose record states a
    ``PeriodicCost`` (of ``names``, default all), at each of ``periods``
    (default :data:`DEFAULT_PERIODS`) and, where it takes them, each of
    ``outer_formats`` (default: the hook's own, int8 for ``diloco``), of
    ``fragments`` and of ``overlap`` (the streaming form's; default: the
    hook's own, 1 and 0), keyed by :attr:`PeriodicHookCost.key`, for
    nodes of ``ranks_per_node`` ranks. A hook is left out on fewer nodes
    than it runs on (``PeriodicCost.min_nodes``: ``post_local_sgd``
    refuses one, where it would be plain DDP), and so is a combination it
    refuses (``overlap`` not below ``period // fragments``)."""
    out: Dict[str, PeriodicHookCost] = {}
    periods = DEFAULT_PERIODS if periods is None else periods
    for hook in registered_hooks():
        cost = hook.record.cost
        if (not hook.record.periodic or not isinstance(cost, PeriodicCost)
                or (names is not None and hook.name not in names)
                or num_nodes < cost.min_nodes):
            continue
        # Each setting's values to project (None: not one of the hook's).
        choices = [(key, (given or [cost.settings[key]])
                    if key in cost.settings else [None])
                   for key, given in (('outer_format', outer_formats),
                                      ('fragments', fragments), ('overlap',
                                                                 overlap))]
        for period in periods:
            for values in itertools.product(*(v for _, v in choices)):
                given = dict(period=period)
                given.update((key, v) for (key, _), v in zip(choices, values)
                             if v is not None)
                if given.get('overlap',
                             0) >= overlap_limit(period,
                                                 given.get('fragments', 1)):
                    continue
                one = PeriodicHookCost(hook.name, ranks_per_node, num_nodes,
                                       inner, hook.record, **given)
                out[one.key] = one
    return out


def left_out_lines(rec) -> List[str]:
    """The line on the periodic settings ``rec`` (a
    :class:`~.recommend.Recommendation`) leaves out for the GPU's memory,
    in one line for all of them (empty: none)."""
    out = [
        k for k, h in rec.hooks.items()
        if h.form == 'periodic' and not rec.fits(k)
    ]
    memory = [rec.memory[k] for k in out if rec.memory[k].total is not None]
    if not out or not memory:
        return []
    names = ', '.join(dict.fromkeys(rec.hooks[k].name for k in out))

    def span(values) -> str:
        low, high = min(values) / GiB, max(values) / GiB
        return (f'{low:.2f} GiB' if round(low, 2) == round(high, 2) else
                f'{low:.2f} to {high:.2f} GiB')

    kept = [m.total for m in memory]
    text = (f'- left out: {len(out)} settings of {names} (marked (does not '
            f'fit) under Periodic synchronisation): each keeps {span(kept)} '
            'per GPU')
    if max(kept) > rec.gpu_bytes:
        return [text + ', over the GPU\'s before any activation']
    return [
        text + ', which fits, but its synchronisation needs '
        f'{span([m.transient_bytes for m in memory])} more at once after '
        'the optimizer step (a few fp32 slices of the model and the '
        "node's slices gathered piece by piece, less the gradients "
        'zero_grad has freed), over the '
        f'{rec.gpu_bytes / GiB:g} GiB of a GPU: a GPU with that room '
        '(--gpu-mem) would run it'
    ]


def periodic_table(gbps: Sequence[float], recs,
                   size: Callable[[float], str]) -> List[str]:
    """The projection's lines on the periodic hooks (none without them):
    per rate, the average step against the step without communication,
    the step that synchronises, and what a synchronisation sends (in
    ``size``'s words)."""
    keys = [k for k, p in recs[0].predictions.items() if p.form == 'periodic']
    if not keys:
        return []
    lines = [
        '', '### Periodic synchronisation', '',
        '| hook | Gbit/s | average step s | x compute | sync step s | '
        'sync s | across nodes per sync | per node link per sync | memory '
        'per GPU |', '|---|--:|--:|--:|--:|--:|--:|--:|--:|'
    ]
    for key in keys:
        for g, rec in zip(gbps, recs):
            p, memory = rec.predictions[key], rec.memory.get(key)
            held = ('unknown' if memory is None or memory.total is None else
                    f'{memory.total / GiB:.2f} GiB')
            if not rec.fits(key):
                held += ' (does not fit)'
            # A compute step given as 0 (--compute-step-s 0) has no ratio.
            ratio = (f'{p.step_s / p.compute_step_s:.2f}x'
                     if p.compute_step_s else 'none')
            # Per synchronisation: a fragment's in the streaming form.
            per = p.period / p.syncs
            lines.append(f'| {p.label} | {g:g} | {p.step_s:.3f} | {ratio} | '
                         f'{p.sync_step_s:.3f} | '
                         f'{p.sync_s:.3f} | {size(p.sent_bytes * per)} | '
                         f'{size(p.node_bytes * per)} | {held} |')
    lines += [
        '', 'average step: the step without communication, the inner '
        "hook's exchange inside the node that the backward does not hide, "
        'and the synchronisation over its period; the synchronisation runs '
        'after the optimizer step, so nothing hides it: the step that runs '
        'it (sync step, one in period) takes it whole. x compute: the '
        'average step over the step without communication. Across nodes: '
        "each rank's 1/G slice of the model in the outer format (fp32 for "
        "post_local_sgd), by the one counting rule (the run's cross_MB "
        'times the period); then the slices gathered inside the node in '
        "fp32. Memory: DiLoCo's state of the rank's slice (global "
        'parameters, outer momentum, int8\'s residual, fp32) and the inner '
        "hook's; (does not fit) counts the synchronisation's buffers too"
    ]
    hooks = [recs[0].hooks[k] for k in keys]
    if any(h.fragments > 1 or h.overlap for h in hooks):
        lines[-1] += (
            '. Streaming (fragments F, overlap tau): F synchronisations a '
            'period, each of 1/F of the slice (the bytes above are one\'s, F '
            'times less; a period sends the same); with tau, each '
            "fragment's exchange across nodes runs beside the next tau steps "
            'and only what they do not hide is exposed (sync s; its local '
            'work and the gather inside the node stay exposed): a projection '
            'that assumes the link runs beside the compute. Memory counts the '
            "in-flight fragment's receive buffers, kept across steps")
    return lines
