"""Hybrid sharding (HSDP) modelled, and both of ``FSDP2Strategy``'s
shardings weighed for a config (:func:`recommend_sharded`).

``FSDP2Strategy(sharding='hybrid')`` shards every parameter over the
``G`` ranks of its node and replicates the shards across the ``M``
nodes. Per unit (:class:`~.fsdp2.ShardUnit`), on ``M`` nodes of ``G``:

* the all-gathers (the forward's, and the backward's again where
  resharded) run among the node's ``G`` ranks, on the GPU links: a ring
  of ``G`` at the intra-node rate and latency, nothing on the node link;
* when its backward is done, its gradients are reduce-scattered among the
  same ``G`` ranks in their own dtype (always full precision: exact
  inside the node);
* then each rank's shard (``1 / G`` of the unit, padded as FSDP2 pads)
  crosses nodes in one all-reduce among the ``M`` ranks that hold the
  same shard, one per node, in the hook's format: the gradients' dtype
  (``allreduce``), 2 bytes (``fp16_compress``, ``bf16_compress``), or
  int8 with an fp32 scale per block (``int8_compress``: an all-to-all of
  the quantized shard's ``M`` pieces, then an all-gather of each owner's
  requantized piece; by the counting rule,
  :mod:`mmcv_custom.comm.traffic`, one all-reduce of the quantized shard,
  which is what the run's ``comm_MB`` counts). The node's ``G`` such
  all-reduces run at once and share its link: the whole gradient crosses
  it once in the hook's format, as a two-level DDP hook's does.

The gathers and reduce-scatters take the GPU links, one after the other;
the all-reduces the node link, each after its reduce-scatter and the
previous all-reduce (:func:`~.fsdp2.simulate_sharded`), beside the
backward as FSDP2 overlaps them; the hook's codec runs beside its
all-reduce. The optimizer updates the node's shard (``1 / G``).

Memory per GPU (:mod:`.memory`): parameters, gradients and AdamW's
moments sharded over the node's ``G`` ranks instead of every rank, plus
the hook's state on the rank's shard: ``int8_compress`` keeps a residual
of it with error feedback, in fp32 (``4 P / G`` bytes for ``P`` gradient
elements) or, with ``residual_dtype='bfloat16'``, in bf16 (``2 P / G``),
or nothing without.

Which hooks: those whose record states an FSDP2 form and whose config
line hybrid sharding accepts (:func:`hybrid_costs`), each with the
settings given, ``int8_compress`` with error feedback (its default;
hybrid sharding keeps the residual of the rank's own shard), its residual
in fp32 or in bf16 (the same bytes on the wire and the same time; half
the state, the residual itself rounded to 8 significant bits), and
without.
PowerSGD has no such form; the two-level forms do not apply (the
all-reduce across nodes already has one rank per node). On one node,
or one rank a node, ``'auto'`` shards fully and ``'hybrid'`` is refused
by the strategy (:func:`config_sharding` projects full sharding and says
so).
"""
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mmcv_custom.comm.traffic import reduced_bytes
from ...hooks.util import ceil_div
from .buckets import Bucket, ParamSpec
from .checks import require_count, require_positive
from .codecs import CodecCost, GpuCodec
from .collectives import (GPU_CLUSTER_CONSTANTS, Cluster, Collective,
                          LinkConstants)
from .compute import Workload, estimate_compute
from .fsdp2 import (ShardUnit, int8_segment, predict_sharded_step,
                    sharded_costs, wire_itemsize)
from .hooks import HookCost, RecordCost
from .memory import hook_state_bytes
from .recommend import Recommendation

__all__ = [
    'HybridCost', 'hybrid_costs', 'config_sharding', 'recommend_sharded',
    'hybrid_state_bytes'
]

#: The evidence that int8 with its residual kept in bf16 trains as int8
#: with an fp32 one does (issue 43): the convergence of hybrid sharding on
#: the tiny recipe, docs/en/notes/benchmarks.md.
_BF16_RESIDUAL_EVIDENCE = (
    "its residual kept in bf16 (residual_dtype='bfloat16': rounded to 8 "
    "significant bits, about 1/256 of what int8's rounding drops; the "
    'arithmetic in fp32): final mIoU under hybrid sharding against full '
    'sharding + allreduce, tiny InternViT FSDP2 recipe, 2 x 2 ranks: 80.72 '
    '/ 80.77 (with the fp32 residual 80.82) (docs/en/notes/benchmarks.md, '
    '"Hybrid sharding on emulated nodes")')


def _flat_bucket(numel: int, unit: ShardUnit) -> Optional[Bucket]:
    """``numel`` elements of ``unit``'s gradients' dtype as one bucket;
    None for none."""
    if not numel:
        return None
    return Bucket((ParamSpec((numel, ), unit.reduced[0].dtype), ), (0, ))


def _state_buckets(units: Sequence[ShardUnit], ranks_per_node: int,
                   pieces: int) -> List[Bucket]:
    """The rank's shard of each unit's gradients, padded to ``pieces``
    equal pieces, as one bucket a unit (none for a unit without)."""
    buckets = (
        _flat_bucket(
            pieces *
            ceil_div(ShardUnit.chunk(u.reduced, ranks_per_node), pieces), u)
        for u in units)
    return [b for b in buckets if b is not None]


def hybrid_state_bytes(record,
                       state_kwargs: Mapping,
                       units: Sequence[ShardUnit],
                       ranks_per_node: int,
                       num_nodes: int = 1) -> Optional[int]:
    """What a hook keeps per GPU under hybrid sharding on ``num_nodes``
    nodes of ``ranks_per_node`` ranks, as the cost model counts it
    (:meth:`HybridCost.state_buckets`, :func:`~.memory.hook_state_bytes`):
    its state of the rank's shards of ``units``, with ``state_kwargs``
    (int8's ``error_feedback`` and ``residual_dtype``). ``num_nodes`` only
    pads int8's residual of a unit to one equal piece a node (fewer than
    ``num_nodes`` values a unit); 1: not padded. None: unknown (the record
    states no ``state_bytes``)."""
    pieces = num_nodes if record.fsdp2_form == 'int8_reduce_scatter' else 1
    return hook_state_bytes(record,
                            _state_buckets(units, ranks_per_node, pieces),
                            state_kwargs, 'hybrid')


class HybridCost(HookCost):
    """A hook's form under hybrid sharding, on ``num_nodes`` nodes of
    ``ranks_per_node`` ranks (see the module docstring).

    Args:
        flat (RecordCost): The hook with its settings (``int8_compress``'s
            ``error_feedback`` among them).
        ranks_per_node (int): ``G``, the ranks each unit is sharded over.
        num_nodes (int): ``M``, the replicas.
        residual_dtype (str): ``int8_compress``'s with error feedback:
            where it keeps the residual of the rank's shard, a key of
            :data:`~mmcv_custom.comm.sharded.RESIDUAL_DTYPES`. Defaults to
            ``'float32'``.

    Raises:
        ValueError: Its record states no FSDP2 form, a count is below 1,
            or ``residual_dtype`` is not one of ``RESIDUAL_DTYPES`` or is
            not float32 for a form that keeps no residual.
    """

    form = 'hybrid'
    #: Which ``FSDP2Strategy`` sharding runs it.
    sharding = 'hybrid'

    def __init__(self,
                 flat: RecordCost,
                 ranks_per_node: int,
                 num_nodes: int,
                 residual_dtype: str = 'float32') -> None:
        require_count('ranks_per_node', ranks_per_node)
        require_count('num_nodes', num_nodes)
        if flat.record.fsdp2_form is None:
            raise ValueError(f'{flat.name}: its HookRecord states no FSDP2 '
                             'form (fsdp2_form), so hybrid sharding cannot '
                             'run it')
        self._form_of(flat)
        self.fsdp2_form = flat.record.fsdp2_form
        self.ranks_per_node = ranks_per_node
        self.num_nodes = num_nodes
        self._residual(residual_dtype)

    def _residual(self, residual_dtype: str) -> None:
        """Keep ``residual_dtype``, checked, and say what it changes: the
        caveat, and for bf16 the evidence beside the record's."""
        from mmcv_custom.comm.sharded import RESIDUAL_DTYPES
        if residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f'residual_dtype should be one of '
                f'{", ".join(repr(d) for d in RESIDUAL_DTYPES)}, but got '
                f'{residual_dtype!r}')
        keeps = self._int8 and self.settings['error_feedback']
        if residual_dtype != 'float32' and not keeps:
            raise ValueError(
                f"{self.flat.label()}: residual_dtype={residual_dtype!r} is "
                "int8_compress's with error feedback; this form keeps no "
                'residual')
        self.residual_dtype = residual_dtype
        if not keeps:
            return
        lossy = self.caveat.split('; ')[0]
        short = 'bf16' if residual_dtype == 'bfloat16' else 'fp32'
        self.caveat = (f'{lossy}; keeps error-feedback state, one {short} '
                       "copy of the rank's shard of the gradients")
        if residual_dtype == 'bfloat16':
            self.accuracy = self.accuracy._replace(
                evidence=f'{_BF16_RESIDUAL_EVIDENCE}; int8 with error '
                f'feedback: {self.accuracy.evidence}')

    @property
    def _int8(self) -> bool:
        return self.fsdp2_form == 'int8_reduce_scatter'

    @property
    def _variant(self) -> str:
        """' no EF' for int8 without error feedback, ' bf16 EF' for its
        residual in bf16, as the label says."""
        if not self._int8:
            return ''
        if not self.settings['error_feedback']:
            return ' no EF'
        return ' bf16 EF' if self.residual_dtype == 'bfloat16' else ''

    @property
    def key(self) -> str:
        return f'{self.name}{self._variant} (hybrid)'

    def label(self) -> str:
        return f'{self.flat.label()}{self._variant} (hybrid)'

    @property
    def state_kwargs(self) -> Dict[str, object]:
        """The settings the hook's state is counted with
        (:func:`~.memory.hook_state_bytes`): its settings, and a
        ``residual_dtype`` other than float32."""
        if self.residual_dtype == 'float32':
            return dict(self.settings)
        return dict(self.settings, residual_dtype=self.residual_dtype)

    def _check(self, world_size: int) -> None:
        layout = self.ranks_per_node * self.num_nodes
        if world_size != layout:
            raise ValueError(
                f'{self.key} was costed for {self.num_nodes} nodes x '
                f'{self.ranks_per_node} ranks ({layout}), but got world_size '
                f'{world_size}')

    def shard_ranks(self, cluster: Cluster) -> int:
        """The ranks each parameter is sharded over: the node's."""
        return self.ranks_per_node

    def gathers(self, unit: ShardUnit, cluster: Cluster) -> List[Collective]:
        """``unit``'s all-gather among the node's ranks."""
        self._check(cluster.world_size)
        gather = unit.gather(self.ranks_per_node)
        if gather is None:
            return []
        return [Collective('all_gather', gather.nbytes, 0, 'intra')]

    def _chunk(self, unit: ShardUnit) -> int:
        return ShardUnit.chunk(unit.reduced, self.ranks_per_node)

    def reduces(self, unit: ShardUnit, world_size: int) -> List[Collective]:
        """``unit``'s reduce-scatter among the node's ranks, in the
        gradients' dtype."""
        self._check(world_size)
        chunk = self._chunk(unit)
        if not chunk:
            return []
        return [
            Collective('reduce_scatter',
                       self.ranks_per_node * chunk * unit.reduced[0].itemsize,
                       0, 'intra')
        ]

    def crosses(self, unit: ShardUnit, world_size: int) -> List[Collective]:
        """The all-reduce of the rank's shard across nodes, in the hook's
        format: int8 as an all-to-all of the quantized shard's ``M``
        pieces (each its fp32 scales then its int8 values, padded to 4
        bytes) and an all-gather of one piece."""
        self._check(world_size)
        chunk = self._chunk(unit)
        if not chunk:
            return []
        if self._int8:
            part = int8_segment(
                ceil_div(chunk, self.num_nodes), self.settings['block_size'])
            return [
                Collective('all_to_all', self.num_nodes * part, 0, 'cross'),
                Collective('all_gather', part, 0, 'cross')
            ]
        itemsize = wire_itemsize(self.flat.record, unit.reduced[0].itemsize)
        return [Collective('all_reduce', chunk * itemsize, 0, 'cross')]

    def shard(self, unit: ShardUnit) -> Optional[Bucket]:
        """The rank's shard of ``unit``'s gradients, as one bucket (what
        the codec works on); None where it has none."""
        return _flat_bucket(self._chunk(unit), unit)

    def state_buckets(self, units: Sequence[ShardUnit]) -> List[Bucket]:
        """The rank's shards of every unit's gradients, as the hook's state
        keeps them: int8's residual is one per element of the shard padded
        to ``M`` equal pieces
        (:class:`~mmcv_custom.hooks.hybrid.HybridInt8State`)."""
        return _state_buckets(units, self.ranks_per_node,
                              self.num_nodes if self._int8 else 1)

    def codec_seconds(self, codec: CodecCost, unit: ShardUnit,
                      world_size: int) -> float:
        """The codec on the rank's shard, beside its all-reduce."""
        shard = self.shard(unit)
        if shard is None:
            return 0.0
        return codec.seconds(self.flat, shard, self.num_nodes)

    def sent_bytes(self, units: Sequence[ShardUnit], world_size: int) -> int:
        """What one step sends across nodes, as the run's ``comm_MB``
        counts it: each shard's all-reduce in the hook's format (int8's
        pair as its quantized shard), nothing of what stays in the
        node."""
        return int(
            sum(
                reduced_bytes(c.kind, c.nbytes, self.num_nodes)
                for unit in units for c in self.crosses(unit, world_size)))

    def collectives(self, buckets, world_size):
        """Per unit (``buckets`` are :class:`ShardUnit`), its
        reduce-scatter and all-reduce."""
        return [
            self.reduces(unit, world_size) + self.crosses(unit, world_size)
            for unit in buckets
        ]

    def memory_bytes(self, bucket, world_size=1):
        return self.flat.memory_bytes(bucket, world_size)

    def flops(self, bucket, world_size=1):
        return self.flat.flops(bucket, world_size)

    def config_keys(self):
        keys = self.flat.config_keys()
        if self.residual_dtype != 'float32':
            keys['residual_dtype'] = self.residual_dtype
        return keys


def hybrid_costs(hooks: Mapping[str, HookCost], ranks_per_node: int,
                 num_nodes: int) -> Dict[str, HybridCost]:
    """The hybrid forms of ``hooks`` (a catalogue,
    :func:`~.hooks.hook_costs`), keyed by :attr:`HybridCost.key`: each hook
    whose record states an FSDP2 form, with its settings and,
    ``int8_compress`` with error feedback, also with its residual in bf16
    and without it; kept only where hybrid sharding accepts the config
    line that sets it (the one check,
    :func:`~mmcv_custom.comm.sharded.check_sharded_cfg`)."""
    from mmcv_custom.comm.sharded import check_sharded_cfg
    out = {}
    for name, hook in hooks.items():
        record = getattr(hook, 'record', None)
        if record is None or record.fsdp2_form is None:
            continue
        settings = [(dict(hook.settings), 'float32')]
        if (record.fsdp2_form == 'int8_reduce_scatter'
                and hook.settings.get('error_feedback')):
            settings += [(dict(hook.settings), 'bfloat16'),
                         (dict(hook.settings,
                               error_feedback=False), 'float32')]
        for given, residual in settings:
            cost = HybridCost(
                RecordCost(name, record, **given), ranks_per_node, num_nodes,
                residual)
            try:
                check_sharded_cfg(
                    dict(type=name, **cost.config_keys()), hybrid=True)
            except ValueError:
                continue
            out[cost.key] = cost
    return out


def config_sharding(
        asked: Optional[str],
        ranks_per_node: Optional[int],
        cluster: Cluster,
        auto_fit: Optional[Tuple[bool, str]] = None) -> Tuple[str, str]:
    """Which sharding a config runs on ``cluster``, as ``FSDP2Strategy``
    decides it (:func:`mmcv_custom.engine.fsdp2_mesh.plan_sharding`):
    ``'hybrid'`` where it asks for ``'hybrid'`` on several nodes of several
    ranks, or ``'auto'`` there where the node's shard fits the GPU, else
    ``'full'``; and why, in words.

    Args:
        asked (str, optional): The config's ``strategy.sharding``; None:
            the strategy's default, ``'full'``.
        ranks_per_node (int, optional): The config's, where it states one;
            the cluster's ``gpus_per_node`` is what is projected.
        cluster (Cluster): The cluster projected to.
        auto_fit (tuple[bool, str], optional): For ``'auto'``, whether the
            node's shard fits and why
            (:func:`~mmcv_custom.engine.fsdp2_mesh.fit_on_node`, as
            :func:`~.model.config_params` reads it); None: not checked.

    Returns:
        tuple[str, str]: ``'full'`` or ``'hybrid'``, and why.
    """
    said = (f"the config's sharding={asked!r}" if asked is not None else
            "FSDP2Strategy's default sharding='full'")
    asked = asked or 'full'
    g, m = cluster.gpus_per_node, cluster.nodes
    note = ''
    if ranks_per_node is not None and ranks_per_node != g:
        note = (f'; its ranks_per_node={ranks_per_node} is not the {g} GPUs '
                'a node projected, and the strategy refuses a ranks_per_node '
                'the launcher contradicts')
    full = f'full sharding over the {cluster.world_size} ranks'
    if asked == 'full':
        return 'full', f'{full} ({said})'
    if m == 1 or g == 1:
        what = f'one node of {g} ranks' if m == 1 else (
            f'one rank a node, {m} nodes')
        if asked == 'hybrid':
            # The strategy refuses it there (exit 2 at the start).
            return 'full', (
                f'{full}: {said} is refused by the strategy on {what}, '
                "where sharding='auto' or 'full' shards fully, as projected"
                f'{note}')
        return 'full', (f'{full} ({said}, but {what}: nothing to replicate '
                        f'across{note})')
    why = ''
    if asked == 'auto':
        why = ': several nodes of several ranks'
        if auto_fit is not None and not auto_fit[0]:
            return 'full', f'{auto_fit[1]}{note}'
        if auto_fit is not None:
            why += f', {auto_fit[1]}'
    return 'hybrid', (f'hybrid sharding over the {g} ranks of each node, '
                      f'replicated over {m} nodes ({said}{why}{note})')


def recommend_sharded(units: Sequence[ShardUnit],
                      cluster: Cluster,
                      hooks: Mapping[str, HookCost],
                      backward_s: Optional[float] = None,
                      compute_step_s: Optional[float] = None,
                      constants: LinkConstants = GPU_CLUSTER_CONSTANTS,
                      codec: Optional[CodecCost] = None,
                      workload: Workload = Workload(),
                      total_params: Optional[int] = None,
                      max_loss: str = 'quantized_ef',
                      min_gain: float = 0.1,
                      forward_flops: Optional[float] = None,
                      sharding: str = 'full') -> Recommendation:
    """Every FSDP2 form of ``hooks`` predicted on ``cluster`` under both
    shardings and one picked, by the rule of :func:`~.recommend.recommend`
    (whose arguments these are, ``units`` in place of parameters): under
    full sharding (:func:`~.fsdp2.sharded_costs`, each two-level form
    too) and, on several nodes of several ranks, hybrid
    (:func:`hybrid_costs`). The compute is estimated as for DDP, the
    optimizer's part divided by the ranks a parameter is sharded over
    (each updates its shard).

    Args:
        sharding (str): What the config runs on ``cluster``
            (:func:`config_sharding`): its ``allreduce`` is the speed-ups'
            reference, and a pick of the other sharding names the
            strategy line that sets it. Defaults to ``'full'``.
    """
    from mmcv_custom.comm.accuracy import check_class
    check_class(max_loss)
    require_positive(
        'min_gain (a fraction: 0.1 is 10%)', min_gain, allow_zero=True)
    codec = GpuCodec() if codec is None else codec
    hbm = codec.hbm_Bps if isinstance(codec, GpuCodec) else GpuCodec().hbm_Bps
    params = [p for u in units for p in u.reduced]
    est_backward, est_step = estimate_compute(params, workload, total_params,
                                              hbm, forward_flops)
    ratio = 2 + workload.recompute
    optimizer = est_step - est_backward - est_backward / ratio
    if backward_s is None:
        backward_s = est_backward
    forward_s = backward_s / ratio

    def step(hook) -> float:
        if compute_step_s is not None:
            return compute_step_s
        return backward_s + forward_s + optimizer / hook.shard_ranks(cluster)

    forms: Dict[str, HookCost] = {}
    for hook in sharded_costs(hooks).values():
        forms[hook.key] = hook
        two = hook.two_level(cluster.gpus_per_node, cluster.nodes)
        if two is not None and two.splits:
            forms[two.key] = two
    if cluster.nodes > 1 and cluster.gpus_per_node > 1:
        forms.update(hybrid_costs(hooks, cluster.gpus_per_node, cluster.nodes))
    reference = 'allreduce'
    if sharding == 'hybrid' and 'allreduce (hybrid)' in forms:
        reference = 'allreduce (hybrid)'
    return Recommendation(
        cluster=cluster,
        predictions={
            key:
            predict_sharded_step(hook, units, cluster, forward_s, backward_s,
                                 step(hook), constants, codec)
            for key, hook in forms.items()
        },
        hooks=forms,
        max_loss=max_loss,
        min_gain=min_gain,
        reference=reference,
        sharding=sharding)
