"""A config that trains with FSDP2 (``FSDP2Strategy``), modelled as FSDP2.

DDP all-reduces gradient buckets while the backward runs. FSDP2 does
something else, per unit (each module ``FSDP2Strategy`` shards, the root
last, :func:`~mmcv_custom.engine.fsdp2_units.unit_parameters`):

* the forward all-gathers a unit's parameters before it runs (FSDP2
  prefetches the next unit's while one computes), and, with
  ``reshard_after_forward=True``, the backward gathers them again (the
  root, which the strategy never reshards, once);
* when a unit's backward is done its gradients are reduce-scattered in the
  ``comm_hook``'s format (:mod:`mmcv_custom.hooks.sharded`): an averaging
  reduce-scatter in the gradients' dtype or half precision, int8 through
  one all-to-all (no error feedback), or in two levels, summed inside the
  node in full precision first;
* each rank updates only its shard: the optimizer's memory passes are
  ``1 / P`` of DDP's.

FSDP2 pads every parameter's first dimension to a multiple of the ranks,
so a unit's chunk per rank is ``sum(ceil(rows / P) * row_elements)``; the
reduce-scatter's input is ``P`` chunks (what a run's ``comm_MB`` counts)
and the all-gather takes one chunk from each rank.

:func:`simulate_sharded` puts that on one link, first in first out, beside
the compute: each unit's compute waits for its gather; gathers are issued
one unit ahead, reduce-scatters when their unit's backward ends. The
forward's and the backward's compute are shared among units by their
parameters. What runs past the compute is exposed.

Which hooks have an FSDP2 form, and which, is read from their records
(:attr:`~mmcv_custom.comm.records.HookRecord.fsdp2_form`,
``sent_format``, ``two_level``), and a form is weighed only where the
config line it needs passes the one FSDP2 check
(:func:`~mmcv_custom.comm.sharded.check_sharded_cfg`). That is full
sharding (over every rank); hybrid sharding (HSDP: sharded over the node,
replicated across nodes, the cross-node all-reduce in the hook's format)
is :mod:`.hybrid`'s, through the same simulation: its gathers and
reduce-scatters stay on the GPU links and its all-reduces take the node
link (:attr:`UnitTimes.cross_s`), each link first in first out.
"""
import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ...hooks.util import align_up, ceil_div
from .buckets import DTYPE_BYTES, Bucket, ParamSpec
from .codecs import CodecCost, GpuCodec
from .collectives import (GPU_CLUSTER_CONSTANTS, Cluster, Collective,
                          LinkConstants, traffic)
from .hooks import HookCost, RecordCost
from .recommend import StepPrediction

__all__ = [
    'ShardUnit', 'ShardedCost', 'sharded_costs', 'UnitTimes',
    'simulate_sharded', 'predict_sharded_step', 'gathered_bytes',
    'shard_units', 'wire_itemsize', 'int8_segment'
]


def int8_segment(chunk: int, block_size: int) -> int:
    """Bytes of one rank's segment of an int8 all-to-all (FSDP2's int8
    reduce-scatter, hybrid sharding's int8 all-reduce): ``chunk`` values'
    fp32 scales, one per ``block_size``, then their int8 values, padded to
    4 bytes."""
    return 4 * ceil_div(chunk, block_size) + align_up(chunk, 4)


def wire_itemsize(record, grad_itemsize: int) -> int:
    """Bytes per element an averaging form sends (a reduce-scatter, or
    hybrid sharding's all-reduce across nodes): half precision where the
    hook's record says so, else the gradients' own."""
    return 2 if record.half_precision else grad_itemsize


@dataclasses.dataclass(frozen=True)
class ShardUnit:
    """One module FSDP2 shards as a unit of its own (or the root).

    Attributes:
        name (str): Its module name (``''``: the root).
        gathered (tuple[ParamSpec]): Every parameter it all-gathers,
            frozen ones too, in the dtype it gathers them in (the
            ``mp_policy``'s ``param_dtype``, else their own).
        reduced (tuple[ParamSpec]): Its trainable parameters, in the dtype
            their gradients are reduce-scattered from.
        resharded (bool): Whether the backward gathers it again
            (``reshard_after_forward=True``, and not the root).
        root (bool): Whether it is the root: gathered first, computed last
            in the forward and first in the backward (the heads, where
            they are not units), reduced after the whole backward.
    """
    name: str
    gathered: Tuple[ParamSpec, ...]
    reduced: Tuple[ParamSpec, ...]
    resharded: bool = True
    root: bool = False

    @property
    def gathers(self) -> int:
        """All-gathers a step: 2 where the backward gathers it again."""
        return 1 + (self.resharded and not self.root)

    @property
    def numel(self) -> int:
        """Elements gathered: its share of the compute."""
        return sum(p.numel for p in self.gathered)

    @staticmethod
    def chunk(params: Sequence[ParamSpec], world_size: int) -> int:
        """Elements per rank of ``params`` sharded on ``world_size``
        ranks: each one's first dimension padded to a multiple of them."""
        total = 0
        for p in params:
            rows = p.shape[0] if p.shape else 1
            if rows:
                total += ceil_div(rows, world_size) * (p.numel // rows)
        return total

    def gather(self, world_size: int) -> Optional[Collective]:
        """Its all-gather (one chunk from each rank), or None when it
        gathers nothing."""
        chunk = self.chunk(self.gathered, world_size)
        if not chunk:
            return None
        return Collective('all_gather', chunk * self.gathered[0].itemsize)

    @property
    def grads(self) -> Bucket:
        """Its gradients as one bucket (what the codec works on)."""
        return Bucket(self.reduced, tuple(range(len(self.reduced))))


class ShardedCost(HookCost):
    """A hook's FSDP2 form: what it reduce-scatters per unit.

    Args:
        flat (RecordCost): The hook with its settings, as DDP runs it
            (its codec is taken for the FSDP2 form's, on each unit's
            gradients).
        ranks_per_node (int, optional): ``G``, for the two-level form.
        num_nodes (int, optional): ``M``, for the two-level form. Both
            None: the flat form.

    Raises:
        ValueError: Its record states no FSDP2 form.
    """

    def __init__(self,
                 flat: RecordCost,
                 ranks_per_node: Optional[int] = None,
                 num_nodes: Optional[int] = None) -> None:
        record = flat.record
        if record.fsdp2_form is None:
            raise ValueError(f'{flat.name}: its HookRecord states no FSDP2 '
                             'form (fsdp2_form), so FSDP2 cannot run it')
        self._form_of(flat)
        self.fsdp2_form = record.fsdp2_form
        self.layout = (None if ranks_per_node is None else
                       (ranks_per_node, num_nodes))
        self.form = 'flat' if self.layout is None else 'two-level'

    @property
    def _int8(self) -> bool:
        return self.fsdp2_form == 'int8_reduce_scatter'

    def _int8_bytes(self, chunk: int, ranks: int) -> int:
        return ranks * int8_segment(chunk, self.settings['block_size'])

    def _scatter(self, chunk: int, ranks: int, grad_itemsize: int,
                 level: Optional[str]) -> Collective:
        """The flat form on ``ranks`` ranks, ``chunk`` elements each."""
        if self._int8:
            return Collective('all_to_all', self._int8_bytes(chunk, ranks), 0,
                              level)
        return Collective(
            'reduce_scatter',
            ranks * chunk * wire_itemsize(self.flat.record, grad_itemsize), 0,
            level)

    def reduces(self, unit: ShardUnit, world_size: int) -> List[Collective]:
        """What ``unit``'s gradients cost on ``world_size`` ranks, in
        order: the flat form's one collective, or the node's all-to-all in
        the gradients' dtype and then the flat form across nodes on the
        node's sums."""
        chunk = ShardUnit.chunk(unit.reduced, world_size)
        if not chunk:
            return []
        itemsize = unit.reduced[0].itemsize
        if not self.splits:
            return [self._scatter(chunk, world_size, itemsize, None)]
        g, m = self.layout
        return [
            Collective('all_to_all', world_size * chunk * itemsize, 0,
                       'intra'),
            self._scatter(chunk, m, itemsize, 'cross')
        ]

    def sent_bytes(self, units: Sequence[ShardUnit], world_size: int) -> int:
        """What one step's reduce-scatters send, as the run's ``comm_MB``
        counts it (:mod:`mmcv_custom.hooks.sharded`): each unit's input in
        the wire format, or the node's sums' across nodes in two levels."""
        return sum(reduce[-1].nbytes
                   for reduce in (self.reduces(u, world_size) for u in units)
                   if reduce)

    @property
    def splits(self) -> bool:
        """Whether it runs in two levels: several nodes of several ranks."""
        return self.layout is not None and min(self.layout) > 1

    #: Which ``FSDP2Strategy`` sharding runs it: over every rank.
    sharding = 'full'

    def shard_ranks(self, cluster: Cluster) -> int:
        """The ranks each parameter is sharded over: every rank."""
        return cluster.world_size

    def gathers(self, unit: ShardUnit, cluster: Cluster) -> List[Collective]:
        """``unit``'s all-gather among every rank (none when it gathers
        nothing)."""
        gather = unit.gather(cluster.world_size)
        return [] if gather is None else [gather]

    def crosses(self, unit: ShardUnit, world_size: int) -> List[Collective]:
        """Collectives after the reduce, on the node link of their own:
        none (see :class:`~.hybrid.HybridCost`)."""
        return []

    def codec_seconds(self, codec: CodecCost, unit: ShardUnit,
                      world_size: int) -> float:
        """The codec on ``unit``'s gradients, beside its reduce."""
        if not self.reduces(unit, world_size):
            return 0.0
        return codec.seconds(self, unit.grads, world_size)

    def collectives(self, buckets, world_size):
        """Per unit (``buckets`` are :class:`ShardUnit`), its reduce."""
        return [self.reduces(unit, world_size) for unit in buckets]

    def memory_bytes(self, bucket, world_size=1):
        return self.flat.memory_bytes(bucket, world_size)

    def flops(self, bucket, world_size=1):
        return self.flat.flops(bucket, world_size)

    def label(self) -> str:
        text = self.flat.label()
        if self._int8:
            text += ' no EF'
        return text + (' (two-level)' if self.form == 'two-level' else '')

    def two_level(self, ranks_per_node, num_nodes):
        if not self.flat.record.two_level or self.layout is not None:
            return None
        return ShardedCost(self.flat, ranks_per_node, num_nodes)

    def config_keys(self):
        return self.flat.config_keys()


def sharded_costs(hooks: Mapping[str, HookCost]) -> Dict[str, ShardedCost]:
    """The FSDP2 forms of ``hooks`` (a catalogue, :func:`~.hooks.hook_costs`):
    each hook whose record states one, with the settings FSDP2 runs it
    with (the int8 reduce-scatter without error feedback), kept only where
    FSDP2 accepts the config line that sets it."""
    from mmcv_custom.comm.sharded import check_sharded_cfg
    out = {}
    for name, hook in hooks.items():
        record = getattr(hook, 'record', None)
        if record is None or record.fsdp2_form is None:
            continue
        settings = dict(hook.settings)
        if (record.fsdp2_form == 'int8_reduce_scatter'
                and 'error_feedback' in settings):
            settings['error_feedback'] = False
        cost = ShardedCost(RecordCost(name, record, **settings))
        try:
            check_sharded_cfg(dict(type=name, **cost.config_keys()))
        except ValueError:
            continue
        out[name] = cost
    return out


@dataclasses.dataclass(frozen=True)
class UnitTimes:
    """One unit's part in :func:`simulate_sharded`: its share of the
    compute, the seconds its gather and its reduce keep the link busy,
    whether it is gathered again in the backward, or is the root, and the
    seconds its all-reduce across nodes keeps the node link busy after its
    reduce (hybrid sharding's; 0: none)."""
    share: float  # of the forward's and the backward's compute
    gather_s: float
    reduce_s: float
    resharded: bool
    root: bool
    cross_s: float = 0.0


def simulate_sharded(units: Sequence[UnitTimes], forward_s: float,
                     backward_s: float) -> float:
    """The time past ``forward_s + backward_s`` that the step waits for
    communication (see the module docstring), units in forward order.

    Gathers and reduces share one link, first in first out; a unit's
    all-reduce across nodes (:attr:`UnitTimes.cross_s`) starts when its
    reduce is done and the previous one's has finished, on a second link
    (the node's, while the first is the GPUs' inside it)."""
    link = cross = 0.0

    def send(issued: float, busy: float) -> float:
        nonlocal link
        link = max(link, issued) + busy
        return link

    def reduce(issued: float, unit: UnitTimes) -> None:
        nonlocal cross
        done = send(issued, unit.reduce_s)
        if unit.cross_s:
            cross = max(cross, done) + unit.cross_s

    roots = [u for u in units if u.root]
    inner = [u for u in units if not u.root]
    forward = inner + roots  # the root's own layers (heads) run last
    ready = {id(u): send(0.0, u.gather_s) for u in roots}
    now = 0.0
    if inner:
        ready[id(inner[0])] = send(0.0, inner[0].gather_s)
    for i, unit in enumerate(forward):
        start = max(now, ready[id(unit)])
        if i + 1 < len(inner):
            ready[id(inner[i + 1])] = send(start, inner[i + 1].gather_s)
        now = start + forward_s * unit.share
    backward = forward[::-1]
    if backward and backward[0].resharded:
        ready[id(backward[0])] = send(now, backward[0].gather_s)
    for i, unit in enumerate(backward):
        start = max(now, ready[id(unit)])
        if i + 1 < len(backward) and backward[i + 1].resharded:
            ready[id(backward[i + 1])] = send(start, backward[i + 1].gather_s)
        now = start + backward_s * unit.share
        if not unit.root:
            reduce(now, unit)
    for unit in roots:  # reduced after the whole backward
        reduce(now, unit)
    return max(0.0, max(now, link, cross) - forward_s - backward_s)


def predict_sharded_step(hook: HookCost,
                         units: Sequence[ShardUnit],
                         cluster: Cluster,
                         forward_s: float,
                         backward_s: float,
                         compute_step_s: float,
                         constants: LinkConstants = GPU_CLUSTER_CONSTANTS,
                         codec: Optional[CodecCost] = None) -> StepPrediction:
    """``hook``'s step under FSDP2 on ``cluster``: a :class:`ShardedCost`
    (full sharding) or a :class:`~.hybrid.HybridCost` (hybrid sharding,
    whose codec runs beside its all-reduce across nodes).

    Returns:
        StepPrediction: As :func:`~.recommend.predict_step`'s, except that
        ``sent_bytes`` is what the run's ``comm_MB`` counts (the
        reduce-scatters' input as sent, or hybrid sharding's all-reduces
        across nodes) and ``node_bytes`` and ``wire_s`` count the
        all-gathers too.
    """
    codec = GpuCodec() if codec is None else codec
    p = cluster.world_size

    def seconds(collectives, ideal=False):
        loads = [traffic(c, cluster) for c in collectives]
        if ideal:
            return sum(t.seconds(cluster) for t in loads)
        return sum(
            t.seconds(cluster, constants.alpha_s, constants.eta,
                      constants.intra_alpha_s) for t in loads)

    def node_bytes(collectives):
        return sum(traffic(c, cluster).node_bytes for c in collectives)

    total = sum(u.numel for u in units) or 1
    real, bound = [], []
    codec_s = wire = node = comm = 0.0
    count = 0
    for unit in units:
        gather = hook.gathers(unit, cluster)
        reduce, cross = hook.reduces(unit, p), hook.crosses(unit, p)
        local = hook.codec_seconds(codec, unit, p)
        share = unit.numel / total
        g, r, x = seconds(gather), seconds(reduce), seconds(cross)
        if cross:
            x += local
        else:
            r += local
        g0, r0, x0 = (seconds(c, True) for c in (gather, reduce, cross))
        real.append(UnitTimes(share, g, r, unit.resharded, unit.root, x))
        bound.append(UnitTimes(share, g0, r0, unit.resharded, unit.root, x0))
        codec_s += local
        comm += unit.gathers * g + r + x
        wire += unit.gathers * g0 + r0 + x0
        node += (
            unit.gathers * node_bytes(gather) + node_bytes(reduce) +
            node_bytes(cross))
        count += unit.gathers * len(gather) + len(reduce) + len(cross)
    return StepPrediction.of(
        hook,
        constants,
        compute_step_s,
        simulate_sharded(real, forward_s, backward_s),
        comm_s=comm,
        codec_s=codec_s,
        wire_s=wire,
        overlap_bound_s=simulate_sharded(bound, forward_s, backward_s),
        sent_bytes=hook.sent_bytes(units, p),
        node_bytes=node,
        collectives=count)


def gathered_bytes(units: Sequence[ShardUnit], world_size: int) -> float:
    """The parameters a rank gathers in one step, in bytes, sharded over
    ``world_size`` ranks (every rank, or a node's under hybrid sharding):
    each unit's gathered tensor (one padded chunk per rank), twice for a
    unit the backward gathers again."""
    out = 0.0
    for unit in units:
        c = unit.gather(world_size)
        if c is not None:
            out += unit.gathers * world_size * c.nbytes
    return out


def shard_units(layout: Sequence[Tuple[str, Sequence[Tuple[ParamSpec, bool]]]],
                reshard_after_forward: bool = True,
                param_dtype: Optional[str] = None) -> List[ShardUnit]:
    """One :class:`ShardUnit` per entry of ``layout``, in forward order.

    Args:
        layout: ``(name, [(parameter, trainable), ...])`` per unit, as
            :func:`~mmcv_custom.engine.fsdp2_units.unit_parameters` lists
            them: deepest first, the root last (name ``''``).
        reshard_after_forward (bool): ``FSDP2Strategy``'s. Defaults to
            True.
        param_dtype (str, optional): The ``mp_policy``'s: what parameters
            are gathered and gradients reduced in. Defaults to None: their
            own dtype.

    Returns:
        list[ShardUnit]: The forward's order (the root's entry stays last:
        see :attr:`ShardUnit.root`).
    """
    if param_dtype is not None and param_dtype not in DTYPE_BYTES:
        raise ValueError(f'param_dtype should be one of {sorted(DTYPE_BYTES)}'
                         f' or None, but got {param_dtype!r}')
    units = []
    for name, params in layout:
        cast = [
            p if param_dtype is None else dataclasses.replace(
                p, dtype=param_dtype) for p, _ in params
        ]
        units.append(
            ShardUnit(
                name,
                tuple(cast),
                tuple(c for c, (_, trained) in zip(cast, params) if trained),
                resharded=reshard_after_forward and name != '',
                root=name == ''))
    # Listed deepest first (the order to shard in); the forward meets
    # them the other way round.
    return units[-2::-1] + units[-1:]
