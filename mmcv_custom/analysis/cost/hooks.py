"""The hook catalogue: what each registered hook sends and computes, read
from its record.

Every hook registered in :data:`~mmcv_custom.comm.registry.COMM_HOOKS`
whose :class:`~mmcv_custom.comm.records.HookRecord` has a ``cost`` (a
:class:`~mmcv_custom.comm.cost_records.CostRecord`) is in the catalogue,
built-in or a user's; a hook without one is listed by
:func:`uncosted_hooks`, not projected. A :class:`HookCost` is one hook
with its settings (``block_size``, ``matrix_approximation_rank``, ...):
the collectives it issues for a bucket layout on a world size, and the
memory traffic and FLOPs of its codec.

A hook whose cost record states a two-level form
(:attr:`~mmcv_custom.comm.cost_records.CostRecord.two_level`) has a second
:class:`HookCost` for a cluster's layout, :meth:`HookCost.two_level`
(a :class:`TwoLevelRecordCost`), whose collectives carry their level.

A periodic hook (``post_local_sgd``, ``diloco``) is not one gradient
exchange a step: its record's cost is a
:class:`~mmcv_custom.comm.periodic_costs.PeriodicCost`, projected at
several periods by :mod:`.periodic`, not in this catalogue.
"""
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Mapping, Optional, Sequence

from mmcv_custom.comm.accuracy import Accuracy, accuracy_of
from mmcv_custom.comm.cost_records import powersgd_compresses, square_side
from mmcv_custom.comm.records import HookRecord, record_of
from mmcv_custom.comm.registry import COMM_HOOKS
from mmcv_custom.comm.traffic import COLLECTIVE_KINDS
from ..registered import registered_hooks
from .buckets import Bucket, ParamSpec, ddp_buckets
from .checks import require_count, require_positive
from .collectives import FORMS, Collective
from .measurements import Benchmark

__all__ = [
    'HookCost', 'RecordCost', 'TwoLevelRecordCost', 'FORMS', 'AllReduceCost',
    'HalfPrecisionCost', 'Int8Cost', 'PowerSGDCost', 'BatchedPowerSGDCost',
    'powersgd_compresses', 'hook_costs', 'HOOK_COSTS', 'uncosted_hooks',
    'uncosted_reasons', 'uncosted_lines', 'PERIODIC_REASON',
    'compare_collectives', 'check_benchmark'
]


class HookCost(ABC):
    """What one communication hook sends, and its local work.

    :class:`RecordCost` reads both from the hook's record; a subclass of
    this class may state them otherwise.

    Attributes:
        name (str): The ``comm_hook`` type.
        lossless (bool): Whether the averaged gradients are the fp32 (or
            half-precision) average, as opposed to an approximation.
        overflows (bool): Whether its format overflows where fp32 does not:
            of two hooks whose steps tie, the other is recommended.
        caveat (str): What to know before choosing it.
        form (str): One of :data:`FORMS`.
        accuracy (Accuracy): Its accuracy class and the evidence for it
            (:mod:`mmcv_custom.comm.accuracy`); unknown by default.
    """
    name: str = ''
    lossless: bool = True
    overflows: bool = False
    caveat: str = ''
    form: str = 'flat'
    accuracy: Accuracy = Accuracy('unknown')

    @abstractmethod
    def collectives(self, buckets: Sequence[Bucket],
                    world_size: int) -> List[List[Collective]]:
        """Per bucket, in DDP's order, the collectives one step issues, in
        their order (sequential within a bucket). Empty ones are left
        out: they cost next to nothing."""

    @abstractmethod
    def memory_bytes(self, bucket: Bucket, world_size: int = 1) -> float:
        """Bytes of HBM traffic of the local work on ``bucket``."""

    def flops(self, bucket: Bucket, world_size: int = 1) -> float:
        """Matmul FLOPs of the local work on ``bucket``. Defaults to 0."""
        return 0.0

    def label(self) -> str:
        """The name with the settings that change the bytes."""
        return self.name

    @property
    def key(self) -> str:
        """Its key among a recommendation's predictions: the name, with
        ``' (two-level)'`` for that form (both forms share the name, as
        the hook does)."""
        if self.form == 'flat':
            return self.name
        return f'{self.name} ({self.form})'

    def two_level(self, ranks_per_node: int,
                  num_nodes: int) -> Optional['HookCost']:
        """Its two-level form on ``num_nodes`` nodes of ``ranks_per_node``
        ranks, or None if it has none. Defaults to None."""
        return None

    def config_keys(self) -> Dict[str, Any]:
        """The ``comm_hook`` keys beyond ``type`` that give these settings
        (those off the hook's defaults). Defaults to none."""
        return {}

    def synchronisation(self, buckets: Sequence[Bucket], cluster, constants,
                        codec) -> Optional[Any]:
        """A periodic hook's synchronisation across nodes, every
        :attr:`period` steps after the optimizer step (a
        :class:`~.periodic.Sync`: :class:`~.periodic.PeriodicHookCost`);
        None for a hook that exchanges every step (the default)."""
        return None

    def _form_of(self, flat: 'HookCost') -> None:
        """Be another form of ``flat``'s hook: its name, settings and
        what a recommendation reads of it (its accuracy, caveat...)."""
        self.flat = flat
        self.name = flat.name
        self.settings = flat.settings
        self.lossless = flat.lossless
        self.overflows = flat.overflows
        self.caveat = flat.caveat
        self.accuracy = flat.accuracy


def _record(name: str) -> HookRecord:
    """The record of the hook registered as ``name``."""
    hook = COMM_HOOKS.get(name)
    if hook is None:
        raise KeyError(
            f'{name} is not in the DDP communication hook '
            f'registry; registered: {sorted(COMM_HOOKS.module_dict)}')
    return record_of(hook)


class RecordCost(HookCost):
    """A hook's cost as its record's ``cost`` states it.

    Args:
        name (str): The ``comm_hook`` type, as registered.
        record (HookRecord, optional): Its record. Defaults to None: the
            record of the hook registered as ``name``.
        **settings: State keys that change its bytes (those of the cost
            record's ``settings``), over their defaults.

    Raises:
        KeyError: ``name`` is not registered.
        ValueError: Its record has no ``cost`` (or is periodic's), or a
            setting is not one of the cost record's.
    """

    def __init__(self,
                 name: str,
                 record: Optional[HookRecord] = None,
                 **settings: Any) -> None:
        record = _record(name) if record is None else record
        if record.cost is None:
            raise ValueError(f'{name}: its HookRecord states no cost, so the '
                             'cost model cannot project it')
        if record.periodic:
            raise ValueError(f'{name} synchronises every period steps: its '
                             'cost is a PeriodicHookCost '
                             '(mmcv_custom.analysis.cost.periodic)')
        cost = record.cost
        unknown = sorted(set(settings) - set(cost.settings))
        if unknown:
            raise ValueError(f'{name}: settings should be among '
                             f'{sorted(cost.settings)}, but got {unknown}')
        self.name = name
        self.record = record
        self.settings = cost.settings_with(settings)
        self.lossless = cost.lossless
        self.overflows = cost.overflows
        self.caveat = cost.caveat_for(self.settings)
        self.accuracy = accuracy_of(record, self.settings)

    def collectives(self, buckets, world_size):
        require_count('world_size', world_size)
        sends = self.record.cost.sends(buckets, world_size, self.settings)
        return [[
            Collective(kind, nbytes, i) for kind, nbytes in bucket
            if nbytes > 0
        ] for i, bucket in enumerate(sends)]

    def memory_bytes(self, bucket, world_size=1):
        return self.record.cost.codec_bytes(bucket, world_size, self.settings)

    def flops(self, bucket, world_size=1):
        return self.record.cost.codec_flops(bucket, world_size, self.settings)

    def label(self) -> str:
        detail = self.record.cost.detail.format(**self.settings)
        return f'{self.name} {detail}' if detail else self.name

    def two_level(self, ranks_per_node, num_nodes):
        # Only a form the hook runs (its record's two_level) is costed.
        if not self.record.two_level or self.record.cost.two_level is None:
            return None
        return TwoLevelRecordCost(self, ranks_per_node, num_nodes)

    def config_keys(self):
        defaults = self.record.cost.settings
        return {k: v for k, v in self.settings.items() if v != defaults[k]}


class TwoLevelRecordCost(HookCost):
    """A hook's two-level form, as its record's ``cost.two_level`` states
    it, on nodes of ``ranks_per_node`` ranks.

    Its collectives carry their level (``'intra'`` inside a node,
    ``'cross'`` among the ranks of one local rank across nodes), so the
    model times each on its own link. On one node, or one rank per node,
    the hook runs its flat form (there is nothing to split), and so does
    this cost: the flat collectives and codec.

    Args:
        flat (RecordCost): The hook's flat form, with its settings.
        ranks_per_node (int): ``G``.
        num_nodes (int): ``M``.

    Raises:
        ValueError: ``flat``'s record states no two-level form, or a count
            is below 1.
    """

    form = 'two-level'

    def __init__(self, flat: RecordCost, ranks_per_node: int,
                 num_nodes: int) -> None:
        require_count('ranks_per_node', ranks_per_node)
        require_count('num_nodes', num_nodes)
        if flat.record.cost.two_level is None or not flat.record.two_level:
            raise ValueError(
                f'{flat.name}: its record states no two-level form it runs '
                '(HookRecord.two_level and CostRecord.two_level), so it has '
                'none to cost')
        self._form_of(flat)
        self.ranks_per_node = ranks_per_node
        self.num_nodes = num_nodes
        self.cost = flat.record.cost.two_level

    @property
    def splits(self) -> bool:
        """Whether the two levels differ from the flat form: several
        nodes of several ranks each (what ``topology='auto'`` needs)."""
        return self.ranks_per_node > 1 and self.num_nodes > 1

    def collectives(self, buckets, world_size):
        layout = self.ranks_per_node * self.num_nodes
        if world_size != layout:
            raise ValueError(
                f'{self.name} (two-level) was costed for {self.num_nodes} '
                f'nodes x {self.ranks_per_node} ranks ({layout}), but got '
                f'world_size {world_size}')
        if not self.splits:
            return self.flat.collectives(buckets, world_size)
        sends = self.cost.sends(buckets, self.ranks_per_node, self.num_nodes,
                                self.settings)
        return [[
            Collective(kind, nbytes, i, level)
            for kind, nbytes, level in bucket if nbytes > 0
        ] for i, bucket in enumerate(sends)]

    def memory_bytes(self, bucket, world_size=1):
        if not self.splits:
            return self.flat.memory_bytes(bucket, world_size)
        return self.cost.codec_bytes(bucket, self.ranks_per_node,
                                     self.num_nodes, self.settings)

    def flops(self, bucket, world_size=1):
        if not self.splits:
            return self.flat.flops(bucket, world_size)
        return self.cost.codec_flops(bucket, self.ranks_per_node,
                                     self.num_nodes, self.settings)

    def label(self) -> str:
        return f'{self.flat.label()} (two-level)'

    def config_keys(self):
        return self.flat.config_keys()


class AllReduceCost(RecordCost):
    """``allreduce``: each bucket in its own dtype."""

    def __init__(self) -> None:
        super().__init__('allreduce')


class HalfPrecisionCost(RecordCost):
    """``fp16_compress`` / ``bf16_compress``: 2 bytes an element.

    Args:
        fmt (str): ``'fp16'`` or ``'bf16'``.
    """

    def __init__(self, fmt: str) -> None:
        if fmt not in ('fp16', 'bf16'):
            raise ValueError(f"fmt should be 'fp16' or 'bf16', but got "
                             f'{fmt!r}')
        super().__init__(f'{fmt}_compress')


class Int8Cost(RecordCost):
    """``int8_compress``: blockwise int8, an all-to-all then an all-gather.

    Args:
        block_size (int): Elements per fp32 scale. Defaults to 256.
        error_feedback (bool): Defaults to True.
    """

    def __init__(self,
                 block_size: int = 256,
                 error_feedback: bool = True) -> None:
        require_count('block_size', block_size)
        super().__init__(
            'int8_compress',
            block_size=block_size,
            error_feedback=error_feedback)
        self.block_size = block_size
        self.error_feedback = error_feedback


class PowerSGDCost(RecordCost):
    """``powerSGD`` (PyTorch's, after its warm-up).

    Args:
        rank (int): ``matrix_approximation_rank``. Defaults to 1.
        min_compression_rate (float): Defaults to 2 (PyTorch's).
    """

    def __init__(self,
                 rank: int = 1,
                 min_compression_rate: float = 2.0) -> None:
        require_count('rank', rank)
        require_positive('min_compression_rate', min_compression_rate)
        super().__init__(
            'powerSGD',
            matrix_approximation_rank=rank,
            min_compression_rate=min_compression_rate)
        self.rank = rank
        self.min_compression_rate = min_compression_rate


class BatchedPowerSGDCost(RecordCost):
    """``batched_powerSGD``: each bucket as one square matrix.

    Args:
        rank (int): ``matrix_approximation_rank``. Defaults to 1.
    """

    def __init__(self, rank: int = 1) -> None:
        require_count('rank', rank)
        super().__init__('batched_powerSGD', matrix_approximation_rank=rank)
        self.rank = rank

    @staticmethod
    def side(numel: int) -> int:
        """``ceil(sqrt(numel))``, exactly."""
        return square_side(numel)


def hook_costs(block_size: int = 256,
               powersgd_rank: int = 1,
               min_compression_rate: float = 2.0,
               int8_error_feedback: bool = True) -> Dict[str, HookCost]:
    """Every registered hook that exchanges every step and whose record
    states a cost, keyed by its ``comm_hook`` type, in the registry's
    order (the periodic ones: :func:`~.periodic.periodic_costs`).

    The arguments set the state keys of every hook that has them:
    ``block_size`` and ``error_feedback`` (``int8_compress``),
    ``matrix_approximation_rank`` and ``min_compression_rate`` (the
    PowerSGD hooks).
    """
    require_count('block_size', block_size)
    require_count('powersgd_rank', powersgd_rank)
    require_positive('min_compression_rate', min_compression_rate)
    given = dict(
        block_size=block_size,
        error_feedback=int8_error_feedback,
        matrix_approximation_rank=powersgd_rank,
        min_compression_rate=min_compression_rate)
    out = {}
    for hook in registered_hooks():
        # A periodic hook's cost is its synchronisation's, projected at
        # several periods: :func:`~.periodic.periodic_costs`.
        if hook.record.cost is not None and not hook.record.periodic:
            out[hook.name] = RecordCost(
                hook.name, hook.record,
                **hook.record.cost.settings_with(given))
    return out


def uncosted_hooks() -> List[str]:
    """The registered hooks whose record states no cost: their steps are
    unknown to the model."""
    return [
        hook.name for hook in registered_hooks() if hook.record.cost is None
    ]


#: Why a periodic hook without a cost (a plugin's) is not projected: a
#: step of it is not one gradient exchange, so only a
#: :class:`~mmcv_custom.comm.periodic_costs.PeriodicCost` states it.
PERIODIC_REASON = ('synchronised across nodes every period steps, and its '
                   'record states no PeriodicCost')


def uncosted_reasons(names: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """Why each registered hook without a cost (of ``names``, default
    all) is unknown to the model: ``'it has no record'`` (a plugin
    registered without ``record=``), ``'its record states no cost'``, or
    :data:`PERIODIC_REASON` for a periodic one (the built-ins state theirs:
    :func:`~.periodic.periodic_costs`)."""

    def why(hook) -> str:
        if hook.record.periodic:
            return PERIODIC_REASON
        return 'its record states no cost' if hook.has_record else (
            'it has no record')

    return {
        hook.name: why(hook)
        for hook in registered_hooks()
        if hook.record.cost is None and (names is None or hook.name in names)
    }


def uncosted_lines(names: Optional[Sequence[str]] = None) -> List[str]:
    """The projection's lines naming the hooks (of ``names``) it leaves
    out and why, with how to give each a cost: the periodic ones on one
    line (a :class:`~mmcv_custom.comm.periodic_costs.PeriodicCost`), the
    others on another (a ``CostRecord``); empty where it leaves none."""
    reasons = uncosted_reasons(names)
    periodic = [n for n, why in reasons.items() if why == PERIODIC_REASON]
    unknown = {n: why for n, why in reasons.items() if n not in periodic}
    lines = []
    if periodic:
        lines.append(f'- not projected: {", ".join(periodic)} '
                     f'({PERIODIC_REASON}); give its record a cost='
                     'PeriodicCost(...) (mmcv_custom/comm/periodic_costs.py)')
    if unknown:
        lines.append(
            f'- not projected, {"its" if len(unknown) == 1 else "their"} '
            'traffic unknown: ' + ', '.join(f'{n} ({why})'
                                            for n, why in unknown.items()) +
            '; give a hook a record with its cost where it is registered: '
            '@COMM_HOOKS.register_module(record=HookRecord(..., cost='
            'CostRecord(...))) (docs/en/advanced_guides/own_hooks.md)')
    return lines


#: The hooks registered at import, with their default settings.
HOOK_COSTS: Mapping[str, HookCost] = hook_costs()


def _described(kind: str, nbytes: float, level: Optional[str]) -> tuple:
    """A collective as :func:`compare_collectives` shows it: its kind and
    bytes, and its level where it has one."""
    return (kind, nbytes) if level is None else (kind, nbytes, level)


def _benchmark_form(hooks: Mapping[str, HookCost], name: str, entry: Mapping,
                    bench: Benchmark) -> Optional[HookCost]:
    """The catalogue's cost of the form a benchmark's hook ran: its
    ``form`` (``'two-level'`` or ``'flat'``), the hook's name without a
    form suffix (``'int8_compress:two_level'``); None if not there."""
    flat = hooks.get(name.partition(':')[0])
    if flat is None or entry.get('form', 'flat') == 'flat':
        return flat
    return flat.two_level(bench.ranks_per_node, bench.nodes)


def compare_collectives(predicted: Sequence[Sequence[Collective]],
                        measured: Sequence[Mapping]) -> List[str]:
    """Differences between a hook's predicted collectives and a benchmark's.

    Args:
        predicted (Sequence[Sequence[Collective]]): Per bucket, as
            :meth:`HookCost.collectives` returns them.
        measured (Sequence[Mapping]): The benchmark's ``collectives`` list
            of one hook (``bucket``, ``kind``, ``bytes``, and ``level``
            where a two-level form ran it). Entries of 0
            bytes are ignored, as the model leaves empty collectives out.

    Returns:
        list[str]: One line per bucket that differs; empty if they agree.
    """
    got: Dict[int, List[tuple]] = {}
    for entry in measured:
        if entry['bytes']:
            got.setdefault(int(entry['bucket']), []).append(
                _described(entry['kind'], entry['bytes'], entry.get('level')))
    want = {
        i: [_described(c.kind, c.nbytes, c.level) for c in cs]
        for i, cs in enumerate(predicted) if cs
    }
    problems = []
    for index in sorted(set(got) | set(want)):
        if got.get(index, []) != want.get(index, []):
            problems.append(f'bucket {index}: predicted '
                            f'{want.get(index, [])}, measured '
                            f'{got.get(index, [])}')
    return problems


def check_benchmark(
        bench: Benchmark,
        params: Sequence[ParamSpec],
        hooks: Optional[Mapping[str, HookCost]] = None) -> List[str]:
    """Check the hook catalogue against what a benchmark measured.

    The model's parameters are laid out as :func:`ddp_buckets` does with
    the benchmark's ``bucket_cap_mb``; where those buckets have the
    benchmark's sizes, each hook's collectives are compared bucket by
    bucket (:func:`compare_collectives`), else only the bytes per step
    and kind (DDP may have ordered the parameters otherwise than the
    reverse model order when the backward's order differs).

    Args:
        bench (Benchmark): The measurement.
        params (Sequence[ParamSpec]): Its config's trainable parameters.
        hooks (Mapping[str, HookCost], optional): With the settings the
            benchmark ran. Defaults to :func:`hook_costs`' defaults.

    Returns:
        list[str]: One line per finding; the first says whether the
        layouts agree.
    """
    hooks = hook_costs() if hooks is None else hooks
    buckets = ddp_buckets(params, bench.bucket_cap_mb)
    same = [b.nbytes for b in buckets] == list(bench.bucket_bytes)
    lines = [
        f'{bench.source}: ' +
        (f'the {len(buckets)} buckets have the measured sizes; collectives '
         'compared bucket by bucket'
         if same else f'buckets differ (predicted {len(buckets)}, measured '
         f'{len(bench.bucket_bytes)}); bytes per step compared')
    ]
    for name, entry in bench.hooks.items():
        cost = _benchmark_form(hooks, name, entry, bench)
        if cost is None:
            lines.append(f'  {name}: not in the catalogue')
            continue
        predicted = cost.collectives(buckets, bench.world_size)
        measured = entry['collectives']
        if same:
            problems = compare_collectives(predicted, [
                dict(
                    bucket=c.bucket,
                    kind=c.kind,
                    bytes=c.nbytes,
                    level=c.level) for c in measured
            ])
            lines.append(f'  {name}: ' + (
                'agrees' if not problems else f'{len(problems)} buckets '
                f'differ, e.g. {problems[0]}'))
            continue
        for kind in COLLECTIVE_KINDS:
            want = sum(c.nbytes for b in predicted for c in b
                       if c.kind == kind)
            got = sum(c.nbytes for c in measured if c.kind == kind)
            if want or got:
                lines.append(
                    f'  {name} {kind}: predicted {want:,.0f} '
                    f'bytes, measured {got:,.0f} (' +
                    (f'{got / want - 1:+.2%}' if want else 'none predicted') +
                    ')')
    return lines
