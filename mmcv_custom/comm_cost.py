"""A cost model of the DDP communication hooks, to project step times.

We measure a real training step per hook on a few emulated nodes (network
namespaces joined by veth, each node's link shaped to a rate by tc), but
want the step time on a GPU cluster of other sizes and link rates. This
module is the bridge: an alpha-beta model of the collectives each hook
issues, fitted to the measurement, and a simulation of how each bucket's
communication overlaps the backward pass. Nothing here imports torch or
MMEngine; a model is a list of :class:`ParamSpec` (shapes and dtypes), so a
projection needs no measurement of the model projected to.

**Collectives** on ``M`` nodes of ``G`` ranks (``P = M * G``), each node
link carrying ``B`` bits/s per direction, intra-node links ``B_in`` per
GPU, ``alpha`` seconds per message and an achieved fraction ``eta`` of
every rate (:func:`collective_time`):

* ring ``all_reduce`` of ``S`` bytes: ``2 (P - 1) alpha + 2 (P - 1) / P *
  S / (eta B)``. A flat ring crosses each node link once per direction, so
  the node link carries what one ring edge does; on one node (``M == 1``)
  the edges are intra-node and ``B_in`` sets the time;
* ``all_gather``, each rank contributing ``s`` bytes (``S = P s``):
  ``(P - 1) alpha + (P - 1) / P * S / (eta B)``;
* ``all_to_all``, each rank sending ``S`` bytes (``S / P`` to every rank):
  ``(P - 1) alpha + G (M - 1) / M * S / (eta B)`` plus ``(G - 1) / P * S
  / (eta B_in)`` inside the node. Unlike a ring, nothing is reduced on the
  way: all ``G`` ranks of a node push their off-node shares through the one
  node link. With ``G`` GPUs per node the flat all-to-all of
  ``int8_compress`` therefore costs about ``G`` times a ring
  reduce-scatter across nodes, and int8's advantage shrinks on multi-GPU
  nodes, to a loss at ``G = 8`` against a 2-byte all-reduce. A hierarchical
  all-to-all (reduce inside the node first, then one rank per node across)
  would fix it; it is not built.

With ``G = 1`` (the emulated nodes) ``B_in`` does not matter.

**Hooks** (:data:`HOOK_COSTS`, one :class:`HookCost` per hook): what each
sends for a bucket layout (:func:`ddp_buckets` lays parameters out as DDP
does) and what its local work (the codec) costs on a GPU, as memory passes
over HBM plus matmul FLOPs (:class:`GpuCodec`), or as measured seconds per
gradient byte (:class:`FittedCodec`).

**Overlap** (:func:`simulate_overlap`): bucket ``i`` becomes ready at
``ready_s[i]`` in the backward; its communication (codec included: it runs
on a stream or thread of its own, beside the backward) starts when it is
ready and the previous bucket's has finished (one link, first in first
out, in DDP's order). What runs past the end of the backward is exposed::

    step = compute_step + max(0, finish of the last bucket - backward)

**Fit** (:func:`fit`): ``alpha``, ``eta`` and optionally an overhead per
hook and step, as a share of the compute step, by least squares of the
relative error on a chosen subset of a benchmark's link rates, validated
on the others.

**Recommendation** (:func:`recommend`): per hook, the step on a cluster,
the speed-up against ``allreduce`` and the fastest hook, with its accuracy
caveats.

Example:
    >>> from mmcv_custom.comm_cost import (Cluster, ParamSpec, recommend)
    >>> params = [ParamSpec((4096, 4096), 'bfloat16')] * 100
    >>> rec = recommend(params, Cluster(8, 8, 100e9), backward_s=0.2,
    ...                 compute_step_s=0.35)
    >>> rec.best  # doctest: +SKIP
    'powerSGD'
"""
import dataclasses
import json
import math
from abc import ABC, abstractmethod
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .hooks.util import align_up, ceil_div

__all__ = [
    'MiB', 'DTYPE_BYTES', 'COLLECTIVE_KINDS', 'ParamSpec', 'Bucket',
    'Collective', 'Cluster', 'LinkConstants', 'GPU_CLUSTER_CONSTANTS',
    'Traffic', 'traffic', 'collective_time', 'all_reduce_time',
    'all_gather_time', 'all_to_all_time', 'ddp_buckets', 'powersgd_compresses',
    'CodecCost', 'GpuCodec', 'FittedCodec', 'HookCost', 'AllReduceCost',
    'HalfPrecisionCost', 'Int8Cost', 'PowerSGDCost', 'BatchedPowerSGDCost',
    'HOOK_COSTS', 'hook_costs', 'compare_collectives', 'Overlap',
    'simulate_overlap', 'even_ready_times', 'Workload', 'estimate_compute',
    'StepPrediction', 'predict_step', 'Benchmark', 'load_benchmark',
    'check_benchmark', 'FitPoint', 'FitResult', 'fit', 'Recommendation',
    'recommend', 'assumptions'
]

MiB = 1024 * 1024
DTYPE_BYTES = {'float32': 4, 'bfloat16': 2, 'float16': 2, 'float64': 8}
COLLECTIVE_KINDS = ('all_reduce', 'all_gather', 'all_to_all')

# DDP's bucket caps (torch.nn.parallel.DistributedDataParallel): 25 MiB,
# and a first bucket of 1 MiB unless bucket_cap_mb is given.
_DEFAULT_BUCKET_CAP_MB = 25.0
_DEFAULT_FIRST_BUCKET_MB = 1.0
# NVLink 4 (H100/H200): 900 GB/s per GPU, both directions together.
_DEFAULT_INTRA_BPS = 450e9 * 8


def _require_positive(name: str, value, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number > 0 (or
    >= 0)."""
    ok = (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(value) and (value >= 0 if allow_zero else value > 0))
    if not ok:
        rule = 'a number >= 0' if allow_zero else 'a number > 0'
        raise ValueError(f'{name} should be {rule}, but got {value!r}')


def _require_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} should be an int >= 1, but got {value!r}')


# -- the model and its buckets ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """A trainable parameter as DDP sees it: its shape and dtype.

    Args:
        shape (tuple[int]): The parameter's shape.
        dtype (str): One of :data:`DTYPE_BYTES`; its gradient's dtype,
            hence the bucket's. Defaults to ``'float32'``.
        name (str): For messages only. Defaults to ``''``.
    """
    shape: Tuple[int, ...]
    dtype: str = 'float32'
    name: str = ''

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0
                for d in shape):
            raise ValueError(f'ParamSpec {self.name!r}: shape should hold '
                             f'ints >= 0, but got {self.shape!r}')
        object.__setattr__(self, 'shape', shape)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f'ParamSpec {self.name!r}: dtype should be one of '
                f'{sorted(DTYPE_BYTES)}, but got {self.dtype!r}')

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def matrix(self) -> Tuple[int, int]:
        """``(n, m)``: PowerSGD views a gradient as its first dimension by
        the rest (a 1-d tensor as ``n x 1``, a 0-d one as ``1 x 1``)."""
        n = self.shape[0] if self.shape else 1
        return n, (self.numel // n if n else 0)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One DDP gradient bucket: parameters of one dtype, in bucket order.

    Attributes:
        params (tuple[ParamSpec]): In the order DDP packs them.
        indices (tuple[int]): Their positions in the model's parameter
            list (what ``int8_compress`` numbers its blocks by).
    """
    params: Tuple[ParamSpec, ...]
    indices: Tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def itemsize(self) -> int:
        return self.params[0].itemsize if self.params else 4

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def ddp_buckets(params: Sequence[ParamSpec],
                bucket_cap_mb: Optional[float] = None,
                first_bucket_mb: Optional[float] = None) -> List[Bucket]:
    """Lay parameters out in buckets as DDP does after its first step.

    After the first iteration DDP rebuilds its buckets in the order the
    gradients became ready, which for a feed-forward model is the reverse
    of the parameter order; that is the layout of every later step and the
    one modelled. As DDP's ``compute_bucket_assignment_by_size``: one open
    bucket per dtype; a parameter joins its dtype's bucket, which closes
    once it holds at least the cap (so a parameter larger than the cap
    fills a bucket alone). The first bucket of each dtype has its own cap
    (1 MiB by default: the last layers' gradients go out early). Buckets
    come in the order they closed, then the ones still open at the end
    (each dtype's last), by their first parameter in ready order. (Within
    a layer DDP may order the parameters otherwise, e.g. a norm's weight
    before its bias; no hook's bytes depend on that order.)

    Args:
        params (Sequence[ParamSpec]): Trainable parameters in the model's
            order (``model.parameters()``).
        bucket_cap_mb (float, optional): DDP's ``bucket_cap_mb`` in MiB.
            Defaults to None: 25 MiB, and 1 MiB for the first bucket.
        first_bucket_mb (float, optional): The first bucket's cap. Defaults
            to None: 1 MiB if ``bucket_cap_mb`` is None, else the same as
            ``bucket_cap_mb`` (DDP's rule).

    Returns:
        list[Bucket]: In DDP's order (the order the hook is called in).
    """
    if bucket_cap_mb is None:
        cap = _DEFAULT_BUCKET_CAP_MB
        first = (
            _DEFAULT_FIRST_BUCKET_MB
            if first_bucket_mb is None else first_bucket_mb)
    else:
        cap = bucket_cap_mb
        first = cap if first_bucket_mb is None else first_bucket_mb
    _require_positive('bucket_cap_mb', cap)
    _require_positive('first_bucket_mb', first)
    limits = (first * MiB, cap * MiB)
    open_buckets: Dict[str, List[int]] = {}
    closed_per_dtype: Dict[str, int] = {}
    done: List[List[int]] = []
    for index in reversed(range(len(params))):
        dtype = params[index].dtype
        current = open_buckets.setdefault(dtype, [])
        current.append(index)
        limit = limits[min(closed_per_dtype.get(dtype, 0), 1)]
        if sum(params[i].nbytes for i in current) >= limit:
            done.append(current)
            open_buckets[dtype] = []
            closed_per_dtype[dtype] = closed_per_dtype.get(dtype, 0) + 1
    done.extend(
        sorted((b for b in open_buckets.values() if b), key=lambda b: -b[0]))
    return [Bucket(tuple(params[i] for i in b), tuple(b)) for b in done]


# -- collectives --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a hook issues for a bucket, as one rank sees it.

    Args:
        kind (str): One of :data:`COLLECTIVE_KINDS`.
        nbytes (float): ``all_reduce``: the tensor reduced; ``all_to_all``:
            the rank's whole send tensor; ``all_gather``: the rank's own
            part (the benchmark JSON's convention).
        bucket (int): The bucket's index. Defaults to 0.
    """
    kind: str
    nbytes: float
    bucket: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f'collective kind should be one of '
                             f'{list(COLLECTIVE_KINDS)}, but got '
                             f'{self.kind!r}')
        _require_positive('collective bytes', self.nbytes, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes, ranks per node and link rates.

    Args:
        nodes (int): ``M``.
        gpus_per_node (int): ``G``: ranks per node.
        link_bps (float): ``B``: each node's link, bits/s per direction.
        intra_bps (float): ``B_in``: each GPU's intra-node rate, bits/s per
            direction. Defaults to NVLink 4's 450 GB/s (900 GB/s counting
            both directions).
    """
    nodes: int
    gpus_per_node: int
    link_bps: float
    intra_bps: float = _DEFAULT_INTRA_BPS

    def __post_init__(self) -> None:
        _require_count('nodes', self.nodes)
        _require_count('gpus_per_node', self.gpus_per_node)
        _require_positive('link_bps', self.link_bps)
        _require_positive('intra_bps', self.intra_bps)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class LinkConstants:
    """The fitted (or assumed) constants of the cost model.

    Args:
        alpha_s (float): Latency per message (per ring step), seconds.
        eta (float): Achieved fraction of every link rate.
        overhead_share (Mapping[str, float]): A cost per step and hook
            beyond the model (thread hand-offs, the codec's thread taking
            cores from the backward), as a share of the compute step:
            it runs on the same cores as the compute, so a machine whose
            compute step is slower (more ranks per core) is slower at it
            alike. Fitted; 0 for hooks not named. Defaults to none.
        source (str): Where the constants come from, for the output.
    """
    alpha_s: float = 10e-6
    eta: float = 0.9
    overhead_share: Mapping[str,
                            float] = dataclasses.field(default_factory=dict)
    source: str = 'defaults'

    def __post_init__(self) -> None:
        _require_positive('alpha_s', self.alpha_s, allow_zero=True)
        _require_positive('eta', self.eta)


# NCCL on a GPU cluster: ~10 us per ring step, ~90% of the link rate.
GPU_CLUSTER_CONSTANTS = LinkConstants(
    alpha_s=10e-6, eta=0.9, source='defaults for NCCL on a GPU cluster')


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What a collective puts on the links, from one rank's side.

    Attributes:
        messages (int): Sequential latency steps (each costs ``alpha``).
        node_bytes (float): Bytes through each node link, per direction.
        intra_bytes (float): Bytes through each GPU's intra-node link, per
            direction, that add to the node link's time.
    """
    messages: int
    node_bytes: float
    intra_bytes: float

    def seconds(self,
                cluster: Cluster,
                alpha_s: float = 0.0,
                eta: float = 1.0) -> float:
        """The time with latency ``alpha_s`` and efficiency ``eta``."""
        return (self.messages * alpha_s + 8 *
                (self.node_bytes / cluster.link_bps +
                 self.intra_bytes / cluster.intra_bps) / eta)


def traffic(collective: Collective, cluster: Cluster) -> Traffic:
    """The links' load of ``collective`` on ``cluster`` (see the module's
    docstring for the formulas)."""
    p, m, g = cluster.world_size, cluster.nodes, cluster.gpus_per_node
    if p == 1:
        return Traffic(0, 0.0, 0.0)
    s = collective.nbytes
    if collective.kind == 'all_reduce':
        messages, moved = 2 * (p - 1), 2 * (p - 1) / p * s
    elif collective.kind == 'all_gather':
        messages, moved = p - 1, (p - 1) * s  # (P - 1) / P of P * s
    else:  # all_to_all: no ring, every off-node share crosses
        return Traffic(p - 1, g * (m - 1) / m * s, (g - 1) / p * s)
    if m > 1:
        return Traffic(messages, moved, 0.0)
    return Traffic(messages, 0.0, moved)


def collective_time(collective: Collective,
                    cluster: Cluster,
                    constants: LinkConstants = GPU_CLUSTER_CONSTANTS) -> float:
    """Seconds ``collective`` takes on ``cluster``."""
    return traffic(collective, cluster).seconds(cluster, constants.alpha_s,
                                                constants.eta)


def all_reduce_time(nbytes: float,
                    cluster: Cluster,
                    alpha_s: float = 0.0,
                    eta: float = 1.0) -> float:
    """Ring all-reduce of ``nbytes``:
    ``2 (P - 1) alpha + 2 (P - 1) / P * S / (eta B)``."""
    return collective_time(
        Collective('all_reduce', nbytes), cluster, LinkConstants(alpha_s, eta))


def all_gather_time(part_bytes: float,
                    cluster: Cluster,
                    alpha_s: float = 0.0,
                    eta: float = 1.0) -> float:
    """All-gather of ``part_bytes`` from each rank:
    ``(P - 1) alpha + (P - 1) / P * (P s) / (eta B)``."""
    return collective_time(
        Collective('all_gather', part_bytes), cluster,
        LinkConstants(alpha_s, eta))


def all_to_all_time(send_bytes: float,
                    cluster: Cluster,
                    alpha_s: float = 0.0,
                    eta: float = 1.0) -> float:
    """All-to-all of ``send_bytes`` per rank:
    ``(P - 1) alpha + G (M - 1) / M * S / (eta B) + (G - 1) / P * S /
    (eta B_in)``."""
    return collective_time(
        Collective('all_to_all', send_bytes), cluster,
        LinkConstants(alpha_s, eta))


# -- local (codec) cost ---------------------------------------------------
class CodecCost(ABC):
    """What a hook's local work on one bucket costs, in seconds."""

    @abstractmethod
    def seconds(self, hook: 'HookCost', bucket: Bucket) -> float:
        """The codec time of ``hook`` on ``bucket``."""

    @abstractmethod
    def describe(self) -> str:
        """One sentence for the assumptions of the output."""


@dataclasses.dataclass(frozen=True)
class GpuCodec(CodecCost):
    """Codec cost on a GPU, assumed: memory passes plus matmul FLOPs.

    A hook's elementwise work (division, casts, quantization, error
    feedback) is memory bound: each hook states the bytes of HBM traffic
    per gradient element (:meth:`HookCost.memory_bytes`), read at
    ``hbm_Bps``. PowerSGD's products with its rank-``r`` factors are
    skinny (``r`` columns), far from a GPU's peak, hence their own rate;
    the two times are added (no overlap assumed: an upper bound).

    Args:
        hbm_Bps (float): Effective HBM bandwidth, bytes/s. Defaults to 3e12
            (H100/H200-class: 3.35-4.8 TB/s peak).
        matmul_flops (float): Achieved FLOP/s of the low-rank products.
            Defaults to 5e13 (50 TFLOP/s).
    """
    hbm_Bps: float = 3.0e12
    matmul_flops: float = 5.0e13

    def __post_init__(self) -> None:
        _require_positive('hbm_Bps', self.hbm_Bps)
        _require_positive('matmul_flops', self.matmul_flops)

    def seconds(self, hook: 'HookCost', bucket: Bucket) -> float:
        return (hook.memory_bytes(bucket) / self.hbm_Bps +
                hook.flops(bucket) / self.matmul_flops)

    def describe(self) -> str:
        return (f'codec on the GPU assumed, not measured: memory passes per '
                f'element over {self.hbm_Bps / 1e12:g} TB/s of HBM, PowerSGD'
                f'\'s low-rank products at {self.matmul_flops / 1e12:g} '
                'TFLOP/s, added (no overlap)')


@dataclasses.dataclass(frozen=True)
class FittedCodec(CodecCost):
    """Codec cost measured: seconds per gradient byte, per hook.

    The benchmark times each hook's local work with no network
    (``codec_s``, per step); divided by the step's gradient bytes it scales
    to any bucket. It describes the machine it was measured on (CPU ranks,
    for the emulated nodes), not a GPU.

    Args:
        per_byte (Mapping[str, float]): Hook name -> seconds per gradient
            byte; 0 for hooks not named.
    """
    per_byte: Mapping[str, float]

    def seconds(self, hook: 'HookCost', bucket: Bucket) -> float:
        return self.per_byte.get(hook.name, 0.0) * bucket.nbytes

    def describe(self) -> str:
        return ('codec cost as measured by the benchmark (seconds per '
                'gradient byte; its machine, not a GPU)')


# -- the hooks ----------------------------------------------------------------
class HookCost(ABC):
    """What one communication hook sends, and its local work.

    One subclass per hook holds every fact the model needs about it, so
    adding a hook means adding one class to :data:`HOOK_COSTS`.

    Attributes:
        name (str): The ``comm_hook`` type.
        lossless (bool): Whether the averaged gradients are the fp32 (or
            half-precision) average, as opposed to an approximation.
        caveat (str): What to know before choosing it.
    """
    name: str = ''
    lossless: bool = True
    caveat: str = ''

    @abstractmethod
    def collectives(self, buckets: Sequence[Bucket],
                    world_size: int) -> List[List[Collective]]:
        """Per bucket, in DDP's order, the collectives one step issues, in
        their order (sequential within a bucket). Empty ones are left
        out: they cost next to nothing."""

    @abstractmethod
    def memory_bytes(self, bucket: Bucket) -> float:
        """Bytes of HBM traffic of the local work on ``bucket``."""

    def flops(self, bucket: Bucket) -> float:
        """Matmul FLOPs of the local work on ``bucket``. Defaults to 0."""
        return 0.0

    def label(self) -> str:
        """The name with the settings that change the bytes."""
        return self.name


def _nonempty(*collectives: Collective) -> List[Collective]:
    return [c for c in collectives if c.nbytes > 0]


class AllReduceCost(HookCost):
    """``allreduce``: each bucket in its own dtype (fp32: 4 bytes an
    element, a bf16 model's 2); the local work is the division by the
    world size (read and write)."""
    name = 'allreduce'
    caveat = 'exact: the reference'

    def collectives(self, buckets, world_size):
        return [
            _nonempty(Collective('all_reduce', b.nbytes, i))
            for i, b in enumerate(buckets)
        ]

    def memory_bytes(self, bucket):
        return 2.0 * bucket.nbytes


class HalfPrecisionCost(HookCost):
    """``fp16_compress`` / ``bf16_compress``: 2 bytes an element.

    fp32 buckets are divided and cast (read 4, write 2) and written back
    (read 2, write 4): 12 bytes of HBM traffic an element; a bucket already
    in 2 bytes is only divided in place (4).
    """

    def __init__(self, fmt: str) -> None:
        if fmt not in ('fp16', 'bf16'):
            raise ValueError(f"fmt should be 'fp16' or 'bf16', but got "
                             f'{fmt!r}')
        self.name = f'{fmt}_compress'
        self.caveat = ('nearly lossless: 11 significant bits, overflows '
                       'above 65504' if fmt == 'fp16' else
                       "nearly lossless: 8 significant bits, fp32's range")

    def collectives(self, buckets, world_size):
        return [
            _nonempty(Collective('all_reduce', 2 * b.numel, i))
            for i, b in enumerate(buckets)
        ]

    def memory_bytes(self, bucket):
        return (12.0 if bucket.itemsize > 2 else 4.0) * bucket.numel


def _align4(nbytes: int) -> int:
    return align_up(nbytes, 4)


class Int8Cost(HookCost):
    """``int8_compress``: blockwise int8, an all-to-all then an all-gather.

    Exactly as :mod:`mmcv_custom.hooks.int8` lays its bytes out: every
    parameter is cut into blocks of ``block_size`` (its last may be
    shorter); block ``b`` of a parameter belongs to rank ``(first + b) %
    P``, ``first`` numbering the parameter's blocks in the order the hook
    first met them (DDP's first-step layout: one bucket per dtype, the one
    holding the later parameters first, parameters in model order). Each
    owner's segment is its blocks' fp32 scales then their int8 payload,
    padded to 4 bytes; the all-to-all sends every segment (about ``numel
    * (1 + 4 / block_size)``), the all-gather each rank's own, padded to
    the largest.

    Local work, per element: error feedback (read and write the fp32
    residual, 8), reading the gradient and writing int8 (``itemsize + 1``),
    summing the received shares and quantizing the sum (about 2) and
    writing the result back (``1 + itemsize``): ``2 itemsize + 12``, or
    ``2 itemsize + 4`` without error feedback.

    Args:
        block_size (int): Elements per fp32 scale. Defaults to 256.
        error_feedback (bool): Defaults to True.
    """
    name = 'int8_compress'
    lossless = False
    caveat = ('lossy: int8 with a scale per block, moves a gradient by '
              'about 1%; keeps error-feedback state, one fp32 copy of the '
              'gradients per rank')

    def __init__(self,
                 block_size: int = 256,
                 error_feedback: bool = True) -> None:
        _require_count('block_size', block_size)
        self.block_size = block_size
        self.error_feedback = error_feedback

    def label(self) -> str:
        return f'{self.name} (block {self.block_size})'

    def _firsts(self, buckets: Sequence[Bucket]) -> Dict[int, int]:
        """Parameter index -> number of its first block."""
        params = {i: p for b in buckets for i, p in zip(b.indices, b.params)}
        groups: Dict[str, List[int]] = {}
        for i in sorted(params):
            groups.setdefault(params[i].dtype, []).append(i)
        # DDP's first layout: one bucket per dtype, reversed by first
        # parameter, so the later group is met first.
        order = sorted(groups.values(), key=lambda g: -g[0])
        firsts, next_block = {}, 0
        for group in order:
            for i in group:
                firsts[i] = next_block
                next_block += ceil_div(params[i].numel, self.block_size)
        return firsts

    def _segments(self, bucket: Bucket, firsts: Dict[int, int],
                  world_size: int) -> List[int]:
        """Bytes of each owner's segment of ``bucket``, aligned."""
        block = self.block_size
        counts = [0] * world_size
        numels = [0] * world_size
        for index, param in zip(bucket.indices, bucket.params):
            n = param.numel
            blocks = ceil_div(n, block)
            if not blocks:
                continue
            first = firsts[index]
            q, rem = divmod(blocks, world_size)
            for k in range(min(blocks, world_size)):
                owner = (first + k) % world_size
                counts[owner] += q + (1 if k < rem else 0)
                numels[owner] += block * (q + (1 if k < rem else 0))
            numels[(first + blocks - 1) % world_size] -= blocks * block - n
        return [_align4(4 * c + n) for c, n in zip(counts, numels)]

    def collectives(self, buckets, world_size):
        _require_count('world_size', world_size)
        if any(len(b.indices) != len(b.params) for b in buckets):
            raise ValueError('Int8Cost needs buckets with parameter indices '
                             '(from ddp_buckets)')
        firsts = self._firsts(buckets)
        out = []
        for i, bucket in enumerate(buckets):
            segments = self._segments(bucket, firsts, world_size)
            out.append(
                _nonempty(
                    Collective('all_to_all', sum(segments), i),
                    Collective('all_gather', max(segments), i)))
        return out

    def memory_bytes(self, bucket):
        per = 2 * bucket.itemsize + (12 if self.error_feedback else 4)
        return float(per * bucket.numel)


def powersgd_compresses(n: int,
                        m: int,
                        rank: int,
                        min_compression_rate: float = 2.0) -> bool:
    """PyTorch's rule: an ``n x m`` gradient is compressed at rank ``r``
    (``min(n, m, rank)``) iff ``(n + m) r * min_compression_rate < n m``
    (``_should_compress``, the rule ``comm.records.powersgd_numel`` uses).
    1-d tensors (``m == 1``) never pass."""
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


class PowerSGDCost(HookCost):
    """``powerSGD`` (PyTorch's, after its warm-up): per bucket, the
    uncompressed tensors all-reduced as they are, then the P factors (``sum
    n r``), then the Q factors (``sum m r``), one after the other, in the
    bucket's dtype.

    Local work on a compressed ``n x m`` gradient: error feedback (add,
    3 passes of ``itemsize``), a copy kept for the next residual (2), the
    two products ``P = M Q`` and ``Q = M^T P`` (reading ``M`` twice, 2),
    the decompression ``P Q^T`` (1) and the residual (3): 11 passes and
    ``6 n m r`` FLOPs; an uncompressed one is packed, divided and unpacked
    (6 passes). Orthogonalizing the skinny P is left out.

    Args:
        rank (int): ``matrix_approximation_rank``. Defaults to 1
            (PyTorch's).
        min_compression_rate (float): Defaults to 2 (PyTorch's).
    """
    name = 'powerSGD'
    lossless = False
    caveat = ('lossy: low-rank approximation of every weight gradient; '
              'keeps error-feedback state, a copy of the gradients, and '
              'warm-start factors; needs a warm-up of plain all-reduces, '
              'start_powerSGD_iter')

    def __init__(self,
                 rank: int = 1,
                 min_compression_rate: float = 2.0) -> None:
        _require_count('rank', rank)
        _require_positive('min_compression_rate', min_compression_rate)
        self.rank = rank
        self.min_compression_rate = min_compression_rate

    def label(self) -> str:
        return f'{self.name} (rank {self.rank})'

    def _split(self, bucket: Bucket) -> Tuple[int, int, int, float]:
        """Numbers uncompressed, in P, in Q; FLOPs."""
        plain = ps = qs = 0
        flops = 0.0
        for param in bucket.params:
            n, m = param.matrix
            r = min(n, m, self.rank)
            if powersgd_compresses(n, m, self.rank, self.min_compression_rate):
                ps += n * r
                qs += m * r
                flops += 6.0 * n * m * r
            else:
                plain += n * m
        return plain, ps, qs, flops

    def collectives(self, buckets, world_size):
        out = []
        for i, bucket in enumerate(buckets):
            plain, ps, qs, _ = self._split(bucket)
            e = bucket.itemsize
            out.append(
                _nonempty(
                    Collective('all_reduce', plain * e, i),
                    Collective('all_reduce', ps * e, i),
                    Collective('all_reduce', qs * e, i)))
        return out

    def memory_bytes(self, bucket):
        plain = self._split(bucket)[0]
        compressed = bucket.numel - plain
        return float(bucket.itemsize * (11 * compressed + 6 * plain))

    def flops(self, bucket):
        return self._split(bucket)[3]


class BatchedPowerSGDCost(HookCost):
    """``batched_powerSGD``: each bucket as one square matrix of side
    ``ceil(sqrt(numel))``, two sequential all-reduces of ``side * r``
    numbers each (:mod:`mmcv_custom.hooks.batched_powersgd`).

    Local work: error feedback (3 passes), a copy (2), the zero-padded
    square (2), two products (2), the decompression and copy back (3) and
    the residual (3): 15 passes and ``6 side^2 r`` FLOPs.

    Args:
        rank (int): ``matrix_approximation_rank``. Defaults to 1.
    """
    name = 'batched_powerSGD'
    lossless = False
    caveat = ('lossy, coarser than powerSGD: one low-rank matrix per '
              'bucket, mixing parameters; keeps error-feedback state and '
              'warm-start factors')

    def __init__(self, rank: int = 1) -> None:
        _require_count('rank', rank)
        self.rank = rank

    def label(self) -> str:
        return f'{self.name} (rank {self.rank})'

    @staticmethod
    def side(numel: int) -> int:
        """``ceil(sqrt(numel))``, exactly."""
        return math.isqrt(numel - 1) + 1 if numel > 0 else 0

    def collectives(self, buckets, world_size):
        out = []
        for i, bucket in enumerate(buckets):
            side = self.side(bucket.numel)
            nbytes = side * min(side, self.rank) * bucket.itemsize
            out.append(
                _nonempty(
                    Collective('all_reduce', nbytes, i),
                    Collective('all_reduce', nbytes, i)))
        return out

    def memory_bytes(self, bucket):
        return 15.0 * bucket.itemsize * bucket.numel

    def flops(self, bucket):
        side = self.side(bucket.numel)
        return 6.0 * side * side * min(side, self.rank)


def hook_costs(block_size: int = 256,
               powersgd_rank: int = 1,
               min_compression_rate: float = 2.0,
               int8_error_feedback: bool = True) -> Dict[str, HookCost]:
    """Every hook's :class:`HookCost`, keyed by its ``comm_hook`` type, in
    the order tables list them."""
    # bf16 before fp16: where they tie (a bf16 model sends both as
    # bf16), the first listed wins, and bf16 has fp32's range.
    costs = (AllReduceCost(), HalfPrecisionCost('bf16'),
             HalfPrecisionCost('fp16'),
             Int8Cost(block_size, int8_error_feedback),
             PowerSGDCost(powersgd_rank, min_compression_rate),
             BatchedPowerSGDCost(powersgd_rank))
    return {c.name: c for c in costs}


#: The hooks with their default settings.
HOOK_COSTS: Mapping[str, HookCost] = hook_costs()


def compare_collectives(predicted: Sequence[Sequence[Collective]],
                        measured: Sequence[Mapping]) -> List[str]:
    """Differences between a hook's predicted collectives and a benchmark's.

    Args:
        predicted (Sequence[Sequence[Collective]]): Per bucket, as
            :meth:`HookCost.collectives` returns them.
        measured (Sequence[Mapping]): The benchmark's ``collectives`` list
            of one hook (``bucket``, ``kind``, ``bytes``). Entries of 0
            bytes are ignored, as the model leaves empty collectives out.

    Returns:
        list[str]: One line per bucket that differs; empty if they agree.
    """
    got: Dict[int, List[Tuple[str, float]]] = {}
    for entry in measured:
        if entry['bytes']:
            got.setdefault(int(entry['bucket']), []).append(
                (entry['kind'], entry['bytes']))
    want = {
        i: [(c.kind, c.nbytes) for c in cs]
        for i, cs in enumerate(predicted) if cs
    }
    problems = []
    for index in sorted(set(got) | set(want)):
        if got.get(index, []) != want.get(index, []):
            problems.append(f'bucket {index}: predicted '
                            f'{want.get(index, [])}, measured '
                            f'{got.get(index, [])}')
    return problems


# -- overlap with the backward pass ------------------------------------------
@dataclasses.dataclass(frozen=True)
class Overlap:
    """The simulated communication of one step.

    Attributes:
        finish_s (tuple[float]): When each bucket's communication ends,
            seconds from the start of the backward.
        exposed_s (float): ``max(0, last finish - backward)``: what the
            step waits for after its backward.
    """
    finish_s: Tuple[float, ...]
    exposed_s: float


def simulate_overlap(ready_s: Sequence[float], busy_s: Sequence[float],
                     backward_s: float) -> Overlap:
    """Buckets through one link, first in first out, in DDP's order.

    Bucket ``i`` starts when it is ready and bucket ``i - 1`` has finished
    (DDP hands buckets to the hook in order; one NCCL stream, or the
    communication worker thread, carries them one after the other) and
    keeps the link ``busy_s[i]`` (its collectives plus its codec).

    Args:
        ready_s (Sequence[float]): When each bucket is ready, seconds from
            the start of the backward.
        busy_s (Sequence[float]): Each bucket's communication time.
        backward_s (float): The backward pass's length.

    Returns:
        Overlap: finish times and the exposed time.
    """
    if len(ready_s) != len(busy_s):
        raise ValueError(f'ready_s and busy_s should have one entry per '
                         f'bucket, but got {len(ready_s)} and '
                         f'{len(busy_s)}')
    finish, now = [], 0.0
    for ready, busy in zip(ready_s, busy_s):
        now = max(now, ready) + busy
        finish.append(now)
    return Overlap(tuple(finish), max(0.0, now - backward_s))


def even_ready_times(buckets: Sequence[Bucket],
                     backward_s: float) -> List[float]:
    """When each bucket is ready if the backward produces gradients at an
    even rate over its parameters, in DDP's order: bucket ``i`` at
    ``backward_s`` times the share of elements in buckets ``0..i``.
    Weighted by elements rather than bytes, since the backward's work
    follows the parameter count, not the gradients' dtype."""
    total = sum(b.numel for b in buckets) or 1
    out, seen = [], 0
    for bucket in buckets:
        seen += bucket.numel
        out.append(backward_s * seen / total)
    return out


# -- compute time -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    """What a GPU computes per step, to estimate the compute time.

    The defaults are InternViT-6B's UperNet recipe: 504 x 504 crops in
    14-pixel patches (36 x 36 = 1296 tokens an image), 2 images per GPU.
    (At 448 px it would be 2 x 32^2 = 2048 tokens.)

    Args:
        tokens_per_gpu (float): Tokens per GPU and step. Defaults to 2592.
        achieved_flops (float): Achieved FLOP/s of the model's matmuls.
            Defaults to 4e14 (about 40% of an H100/H200's 989 TFLOP/s
            dense bf16).
        recompute (bool): Activation checkpointing recomputes the forward
            in the backward (the 6B recipe's ``with_cp=True``). Defaults
            to True.
    """
    tokens_per_gpu: float = 2 * 36 * 36
    achieved_flops: float = 4.0e14
    recompute: bool = True

    def __post_init__(self) -> None:
        _require_positive('tokens_per_gpu', self.tokens_per_gpu)
        _require_positive('achieved_flops', self.achieved_flops)


def estimate_compute(
        params: Sequence[ParamSpec],
        workload: Workload,
        total_params: Optional[int] = None,
        hbm_Bps: float = GpuCodec().hbm_Bps) -> Tuple[float, float]:
    """Backward and whole-step compute time from FLOPs.

    A transformer spends about ``2 N T`` FLOPs in the forward and ``4 N T``
    in the backward (``N`` parameters, ``T`` tokens), plus one more forward
    in the backward with activation checkpointing. The optimizer (AdamW)
    is memory bound: it reads and writes the parameter and both moments and
    reads the gradient, 7 passes of each trainable parameter's dtype. The
    heads' convolutions, run at finer resolutions than the ViT's tokens,
    are not counted by ``N T``: an underestimate for UperNet.

    Args:
        params (Sequence[ParamSpec]): The trainable parameters.
        workload (Workload): Tokens and FLOP/s.
        total_params (int, optional): All parameters, frozen included, for
            the FLOPs. Defaults to the trainable ones.
        hbm_Bps (float): For the optimizer. Defaults to :class:`GpuCodec`'s.

    Returns:
        tuple[float, float]: ``(backward_s, compute_step_s)``.
    """
    n = total_params if total_params is not None else sum(p.numel
                                                          for p in params)
    per_pass = n * workload.tokens_per_gpu / workload.achieved_flops
    backward = (4 + 2 * workload.recompute) * per_pass
    optimizer = 7 * sum(p.nbytes for p in params) / hbm_Bps
    return backward, 2 * per_pass + backward + optimizer


# -- one hook's step on a cluster ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """One hook's predicted step on one cluster.

    Attributes:
        hook (str): Its name.
        label (str): With its settings (e.g. ``powerSGD (rank 1)``).
        step_s (float): ``compute_step_s * (1 + overhead_share) +
            exposed_s``.
        exposed_s (float): Communication not hidden by the backward.
        compute_step_s (float): The step without communication.
        comm_s (float): All buckets' communication, back to back (codec
            included).
        codec_s (float): The codec's part of ``comm_s``.
        wire_s (float): Bytes through the busiest link over its rate, with
            no latency and ``eta = 1``.
        overlap_bound_s (float): The exposed time with ``alpha = 0``,
            ``eta = 1`` and no codec: what no implementation beats on
            these links with this bucket order.
        sent_bytes (float): Bytes the hook reduces per step, as the size
            of the tensors an all-reduce would carry (what
            :class:`~mmcv_custom.registry.CommCounter` counts as
            ``wire_bytes``): all-reduced tensors, and int8's quantized
            bucket once (its all-to-all; the all-gather that completes the
            reduction adds nothing).
        node_bytes (float): Bytes through each node link per direction.
        collectives (int): Collectives per step.
    """
    hook: str
    label: str
    step_s: float
    exposed_s: float
    compute_step_s: float
    comm_s: float
    codec_s: float
    wire_s: float
    overlap_bound_s: float
    sent_bytes: float
    node_bytes: float
    collectives: int


def predict_step(hook: HookCost,
                 buckets: Sequence[Bucket],
                 cluster: Cluster,
                 backward_s: float,
                 compute_step_s: float,
                 constants: LinkConstants = GPU_CLUSTER_CONSTANTS,
                 codec: Optional[CodecCost] = None,
                 ready_s: Optional[Sequence[float]] = None) -> StepPrediction:
    """``hook``'s step time on ``cluster``.

    Args:
        hook (HookCost): The hook.
        buckets (Sequence[Bucket]): DDP's buckets (:func:`ddp_buckets`).
        cluster (Cluster): Nodes and links.
        backward_s (float): The backward pass.
        compute_step_s (float): The whole step without communication.
        constants (LinkConstants): alpha, eta and overheads. Defaults to
            :data:`GPU_CLUSTER_CONSTANTS`.
        codec (CodecCost, optional): Defaults to :class:`GpuCodec`'s
            defaults.
        ready_s (Sequence[float], optional): When each bucket is ready.
            Defaults to :func:`even_ready_times`.

    Returns:
        StepPrediction
    """
    _require_positive('backward_s', backward_s, allow_zero=True)
    _require_positive('compute_step_s', compute_step_s, allow_zero=True)
    codec = GpuCodec() if codec is None else codec
    if ready_s is None:
        ready_s = even_ready_times(buckets, backward_s)
    per_bucket = hook.collectives(buckets, cluster.world_size)
    busy, bound, codec_total, wire = [], [], 0.0, 0.0
    sent = node = 0.0
    for bucket, collectives in zip(buckets, per_bucket):
        loads = [traffic(c, cluster) for c in collectives]
        local = codec.seconds(hook, bucket)
        link = sum(
            t.seconds(cluster, constants.alpha_s, constants.eta)
            for t in loads)
        ideal = sum(t.seconds(cluster) for t in loads)
        busy.append(link + local)
        bound.append(ideal)
        codec_total += local
        wire += ideal
        node += sum(t.node_bytes for t in loads)
        sent += sum(c.nbytes for c in collectives if c.kind != 'all_gather')
    exposed = simulate_overlap(ready_s, busy, backward_s).exposed_s
    overhead = constants.overhead_share.get(hook.name, 0.0) * compute_step_s
    return StepPrediction(
        hook=hook.name,
        label=hook.label(),
        step_s=compute_step_s + exposed + overhead,
        exposed_s=exposed,
        compute_step_s=compute_step_s,
        comm_s=sum(busy),
        codec_s=codec_total,
        wire_s=wire,
        overlap_bound_s=simulate_overlap(ready_s, bound, backward_s).exposed_s,
        sent_bytes=sent,
        node_bytes=node,
        collectives=sum(len(c) for c in per_bucket))


# -- the benchmark and the fit ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A benchmark JSON (version 1), read and checked.

    Attributes:
        source (str): Its path (or ``'<dict>'``).
        nodes (int): Emulated nodes.
        ranks_per_node (int): Ranks per node.
        grad_bytes (float): All trainable gradients per step.
        bucket_bytes (tuple[float]): Per bucket, in DDP's order.
        ready_s (tuple[float]): When each bucket reached the hook.
        backward_s (float): Backward time with a hook that sends nothing.
        compute_step_s (float): The whole step with that hook, unshaped.
        hooks (dict): Name -> ``dict(collectives=[Collective...],
            codec_s=float)``.
        rates (tuple[dict]): ``mbit`` (None: unshaped),
            ``calibrated_mbit`` and ``median_step_s`` (hook -> seconds).
        config (str, optional): The config measured.
        bucket_cap_mb (float, optional): DDP's setting in the run.
        notes (tuple[str]): What was read but cannot be modelled (a hook
            without its ``collectives``).
    """
    source: str
    nodes: int
    ranks_per_node: int
    grad_bytes: float
    bucket_bytes: Tuple[float, ...]
    ready_s: Tuple[float, ...]
    backward_s: float
    compute_step_s: float
    hooks: Mapping[str, Mapping]
    rates: Tuple[Mapping, ...]
    config: Optional[str] = None
    bucket_cap_mb: Optional[float] = None
    notes: Tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def measured_rates(self) -> List[float]:
        """The shaped rates, Mbit/s."""
        return [r['mbit'] for r in self.rates if r['mbit'] is not None]


def _field(data: Mapping, key: str, where: str, kind=(int, float)):
    if not isinstance(data, Mapping) or key not in data:
        raise ValueError(f'{where}: the key {key!r} is missing')
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = (
            kind.__name__ if isinstance(kind, type) else ' or '.join(
                k.__name__ for k in kind))
        raise ValueError(f'{where}: {key!r} should be a {names}, but got '
                         f'{type(value).__name__}: {value!r}')
    return value


def load_benchmark(source: Union[str, Mapping]) -> Benchmark:
    """Read a benchmark JSON (a path or the parsed dict) and check it.

    Raises:
        ValueError: Not JSON, another ``version``, or a key missing or of
            the wrong type (the message names it).
        OSError: The file cannot be read.
    """
    name = '<dict>'
    if isinstance(source, str):
        name = source
        with open(source) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f'{name}: not JSON ({e})') from None
    else:
        data = source
    if not isinstance(data, Mapping):
        raise ValueError(f'{name}: should hold a JSON object, but got '
                         f'{type(data).__name__}')
    if data.get('version') != 1:
        raise ValueError(f'{name}: version should be 1, but got '
                         f'{data.get("version")!r}')
    nodes = _field(data, 'nodes', name, int)
    per_node = _field(data, 'ranks_per_node', name, int)
    if nodes < 1 or per_node < 1:
        raise ValueError(f'{name}: nodes and ranks_per_node should be >= 1, '
                         f'but got {nodes} and {per_node}')
    buckets = _field(data, 'buckets', name, list)
    if not buckets:
        raise ValueError(f'{name}: buckets is empty')
    bucket_bytes, ready = [], []
    for i, bucket in enumerate(buckets):
        where = f'{name}: buckets[{i}]'
        bucket_bytes.append(_field(bucket, 'bytes', where))
        ready.append(_field(bucket, 'ready_s', where))
    hooks, notes = _read_hooks(data, name, len(buckets))
    rates = _read_rates(data, name)
    return Benchmark(
        source=name,
        nodes=nodes,
        ranks_per_node=per_node,
        grad_bytes=_field(data, 'grad_bytes', name),
        bucket_bytes=tuple(bucket_bytes),
        ready_s=tuple(ready),
        backward_s=_field(data, 'backward_s', name),
        compute_step_s=_compute_step(data, rates, name),
        hooks=hooks,
        rates=tuple(rates),
        notes=tuple(notes),
        config=data.get('config')
        if isinstance(data.get('config'), str) else None,
        bucket_cap_mb=data.get('bucket_cap_mb'))


def _read_hooks(data: Mapping, name: str, num_buckets: int):
    """The benchmark's ``hooks``: each one's collectives and codec time;
    ``(hooks, notes)``, a note for each hook whose traffic is unknown."""
    hooks, notes = {}, []
    for hook, entry in _field(data, 'hooks', name, dict).items():
        where = f'{name}: hooks.{hook}'
        if isinstance(entry, Mapping) and entry.get('collectives') is None:
            # What it sent is unknown: it cannot be predicted, only shown.
            if hook != 'noop':
                notes.append(f'{where} lists no collectives: its points '
                             'are not fitted')
            continue
        collectives = []
        for j, c in enumerate(_field(entry, 'collectives', where, list)):
            at = f'{where}.collectives[{j}]'
            bucket = _field(c, 'bucket', at, int)
            if not 0 <= bucket < num_buckets:
                raise ValueError(f'{at}: bucket should be in [0, '
                                 f'{num_buckets - 1}], but got {bucket}')
            kind = _field(c, 'kind', at, str)
            if kind not in COLLECTIVE_KINDS:
                raise ValueError(f'{at}: kind should be one of '
                                 f'{list(COLLECTIVE_KINDS)}, but got '
                                 f'{kind!r}')
            collectives.append(
                Collective(kind, _field(c, 'bytes', at), bucket))
        hooks[hook] = dict(
            collectives=collectives, codec_s=_field(entry, 'codec_s', where))
    return hooks, notes


def _read_rates(data: Mapping, name: str) -> list:
    """The benchmark's ``rates``: each link rate and its measured steps."""
    rates = []
    for i, rate in enumerate(_field(data, 'rates', name, list)):
        where = f'{name}: rates[{i}]'
        if not isinstance(rate, Mapping) or 'mbit' not in rate:
            raise ValueError(f'{where}: the key \'mbit\' is missing')
        mbit = rate['mbit']
        if mbit is not None:
            mbit = _field(rate, 'mbit', where)
            if mbit <= 0:
                raise ValueError(f'{where}: mbit should be > 0 or null, but '
                                 f'got {mbit}')
        steps = _field(rate, 'median_step_s', where, dict)
        # A hook that was not measured at this rate may be null.
        steps = {
            h: t
            for h, t in steps.items()
            if isinstance(t, (int,
                              float)) and not isinstance(t, bool) and t > 0
        }
        rates.append(
            dict(
                mbit=mbit,
                calibrated_mbit=rate.get('calibrated_mbit'),
                median_step_s=steps))
    return rates


def _compute_step(data: Mapping, rates: Sequence[Mapping], name: str) -> float:
    """``compute_step_s``, or where it is null the unshaped rate's
    ``noop`` step (the same measurement: a hook that sends nothing)."""
    if data.get('compute_step_s') is not None:
        return _field(data, 'compute_step_s', name)
    for rate in rates:
        if rate['mbit'] is None and 'noop' in rate['median_step_s']:
            return rate['median_step_s']['noop']
    raise ValueError(f'{name}: compute_step_s is null and no unshaped rate '
                     'has a noop step to take it from')


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
            benchmark ran. Defaults to :data:`HOOK_COSTS`.

    Returns:
        list[str]: One line per finding; the first says whether the
        layouts agree.
    """
    hooks = HOOK_COSTS if hooks is None else hooks
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
        if name not in hooks:
            lines.append(f'  {name}: not in the catalogue')
            continue
        predicted = hooks[name].collectives(buckets, bench.world_size)
        measured = entry['collectives']
        if same:
            problems = compare_collectives(predicted, [
                dict(bucket=c.bucket, kind=c.kind, bytes=c.nbytes)
                for c in measured
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


@dataclasses.dataclass(frozen=True)
class FitPoint:
    """One measured (benchmark, hook, rate) against the fitted model.

    Attributes:
        source (str): The benchmark file.
        world_size (int): Its ranks.
        hook (str): The hook.
        mbit (float): The set rate, Mbit/s.
        measured_s (float): Median step measured.
        predicted_s (float): The model's, with the fitted constants.
        fitted (bool): Whether the fit saw it (else it validates).
    """
    source: str
    world_size: int
    hook: str
    mbit: float
    measured_s: float
    predicted_s: float
    fitted: bool

    @property
    def rel_error(self) -> float:
        """``predicted / measured - 1``."""
        return self.predicted_s / self.measured_s - 1


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What :func:`fit` found.

    Attributes:
        constants (LinkConstants): alpha, eta and each hook's overhead.
        codec (FittedCodec): Each hook's measured codec per byte.
        points (tuple[FitPoint]): Every point, fitted or validating.
        skipped (tuple[str]): What could not be used, and why.
    """
    constants: LinkConstants
    codec: FittedCodec
    points: Tuple[FitPoint, ...]
    skipped: Tuple[str, ...] = ()

    def worst(self, fitted: bool = False) -> Optional[FitPoint]:
        """The point of largest relative error among the validating (or
        the fitted) ones; None if there is none."""
        chosen = [p for p in self.points if p.fitted == fitted]
        return max(chosen, key=lambda p: abs(p.rel_error), default=None)


class _Point:
    """A benchmark point prepared for fast evaluation: per bucket the
    latency steps and the link seconds at eta = 1."""

    def __init__(self, bench: Benchmark, hook: str, mbit: float,
                 measured: float, fitted: bool) -> None:
        self.bench, self.hook, self.mbit = bench, hook, mbit
        self.measured, self.fitted = measured, fitted
        cluster = Cluster(bench.nodes, bench.ranks_per_node, mbit * 1e6)
        entry = bench.hooks[hook]
        per_byte = entry['codec_s'] / bench.grad_bytes
        n = len(bench.bucket_bytes)
        self.messages = [0] * n
        self.seconds = [0.0] * n
        self.codec = [per_byte * b for b in bench.bucket_bytes]
        for c in entry['collectives']:
            load = traffic(c, cluster)
            self.messages[c.bucket] += load.messages
            self.seconds[c.bucket] += load.seconds(cluster)

    def comm_exposed(self, alpha: float, eta: float) -> float:
        busy = [
            m * alpha + s / eta + c
            for m, s, c in zip(self.messages, self.seconds, self.codec)
        ]
        return simulate_overlap(self.bench.ready_s, busy,
                                self.bench.backward_s).exposed_s

    def base(self, alpha: float, eta: float) -> float:
        """The prediction without the hook's overhead."""
        return self.bench.compute_step_s + self.comm_exposed(alpha, eta)

    def predicted(self, alpha: float, eta: float,
                  shares: Mapping[str, float]) -> float:
        return (self.base(alpha, eta) +
                shares.get(self.hook, 0.0) * self.bench.compute_step_s)


def _overheads(points: Sequence[_Point],
               bases: Sequence[float]) -> Dict[str, float]:
    """Each hook's overhead share minimizing the squared relative error of
    its points, given their predictions without it (closed form, weights
    ``1 / measured^2``: the share ``f`` of the compute step ``c`` with
    ``sum w c (measured - base - f c) = 0``), not below 0."""
    sums: Dict[str, List[float]] = {}
    for p, base in zip(points, bases):
        w = 1.0 / p.measured**2
        c = p.bench.compute_step_s
        s = sums.setdefault(p.hook, [0.0, 0.0])
        s[0] += w * c * (p.measured - base)
        s[1] += w * c * c
    return {h: max(0.0, a / b) if b else 0.0 for h, (a, b) in sums.items()}


def _loss(points: Sequence[_Point], alpha: float, eta: float,
          overhead: bool) -> float:
    bases = [p.base(alpha, eta) for p in points]
    shares = _overheads(points, bases) if overhead else {}
    return sum(
        ((b + shares.get(p.hook, 0.0) * p.bench.compute_step_s) / p.measured -
         1)**2 for p, b in zip(points, bases))


# Search bounds: log10(alpha / s), eta.
_LOG_ALPHA = (-8.0, 0.0)
_ETA = (0.02, 2.0)


def _nelder_mead(f,
                 start: Sequence[float],
                 step: Sequence[float],
                 iterations: int = 400,
                 tolerance: float = 1e-12) -> List[float]:
    """Minimize ``f`` from ``start`` by Nelder and Mead's simplex (the
    standard coefficients: reflect 1, expand 2, contract and shrink 1/2).
    Written out because scipy is not a dependency."""
    simplex = [list(start)]
    for i, s in enumerate(step):
        vertex = list(start)
        vertex[i] += s
        simplex.append(vertex)
    values = [f(v) for v in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] <= tolerance * (abs(values[0]) + 1e-30):
            break
        centroid = [
            sum(v[k] for v in simplex[:-1]) / (len(simplex) - 1)
            for k in range(len(start))
        ]

        def toward(t, centroid=centroid):
            return [c + t * (w - c) for c, w in zip(centroid, simplex[-1])]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = ((expanded, fe) if fe < fr else
                                       (reflected, fr))
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5 if fr >= values[-1] else -0.5)
            fc = f(contracted)
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[
                    b + 0.5 * (v - b) for b, v in zip(best, vertex)
                ] for vertex in simplex[1:]]
                values = [values[0]] + [f(v) for v in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def fit(benchmarks: Sequence[Benchmark],
        fit_rates: Optional[Sequence[float]] = None,
        fit_world_sizes: Optional[Sequence[int]] = None,
        overhead: bool = True) -> FitResult:
    """Fit alpha, eta (and each hook's overhead) to measured step times.

    Every hook of every shaped rate of every benchmark is a point: the model
    predicts its step from the benchmark's own buckets, ready times,
    collectives and codec time (no hook catalogue involved), on
    ``Cluster(nodes, ranks_per_node, mbit)``. The fit minimizes the summed
    squared relative error over the chosen points: a coarse grid over
    ``log10(alpha)`` and ``eta``, refined by Nelder-Mead; for given alpha
    and eta the overheads have a closed form. The other points validate.

    Args:
        benchmarks (Sequence[Benchmark]): From :func:`load_benchmark`.
        fit_rates (Sequence[float], optional): Rates (Mbit/s) to fit on.
            Defaults to None: all.
        fit_world_sizes (Sequence[int], optional): World sizes to fit on.
            Defaults to None: all.
        overhead (bool): Fit an overhead per hook and step (a share of
            the compute step). Defaults to True.

    Returns:
        FitResult

    Raises:
        ValueError: No point is left to fit on.
    """
    points, skipped = [], []
    for bench in benchmarks:
        skipped.extend(bench.notes)
        for rate in bench.rates:
            if rate['mbit'] is None:
                skipped.append(f'{bench.source}: the unshaped rate (no link '
                               'rate to model)')
                continue
            for hook, step in rate['median_step_s'].items():
                if hook not in bench.hooks:
                    continue  # 'noop' (the compute reference), or noted
                chosen = ((fit_rates is None or rate['mbit'] in fit_rates)
                          and (fit_world_sizes is None
                               or bench.world_size in fit_world_sizes))
                points.append(_Point(bench, hook, rate['mbit'], step, chosen))
    fitting = [p for p in points if p.fitted]
    if not fitting:
        raise ValueError('no measured point to fit on: the rates '
                         f'{list(fit_rates or [])} and world sizes '
                         f'{list(fit_world_sizes or [])} select none')

    def objective(x):
        alpha = 10**min(max(x[0], _LOG_ALPHA[0]), _LOG_ALPHA[1])
        eta = min(max(x[1], _ETA[0]), _ETA[1])
        return _loss(fitting, alpha, eta, overhead)

    grid = [(_LOG_ALPHA[0] + 0.5 * i, _ETA[0] + 0.09 * j) for i in range(17)
            for j in range(23)]
    start = min(grid, key=objective)
    best = _nelder_mead(objective, start, (0.25, 0.045))
    alpha = 10**min(max(best[0], _LOG_ALPHA[0]), _LOG_ALPHA[1])
    eta = min(max(best[1], _ETA[0]), _ETA[1])
    extra = (
        _overheads(fitting, [p.base(alpha, eta)
                             for p in fitting]) if overhead else {})
    sources = sorted({b.source for b in benchmarks})
    constants = LinkConstants(
        alpha, eta, extra, source='fitted to ' + ', '.join(sources))
    codec = FittedCodec({
        h: e['codec_s'] / b.grad_bytes
        for b in benchmarks
        for h, e in b.hooks.items()
    })
    return FitResult(
        constants=constants,
        codec=codec,
        points=tuple(
            FitPoint(p.bench.source, p.bench.world_size, p.hook, p.mbit,
                     p.measured, p.predicted(alpha, eta, extra), p.fitted)
            for p in points),
        skipped=tuple(dict.fromkeys(skipped)))


# -- the recommendation -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Recommendation:
    """Every hook's predicted step on one cluster, and the pick.

    Attributes:
        cluster (Cluster): The cluster.
        predictions (dict): Hook name -> :class:`StepPrediction`, in
            :func:`hook_costs`' order.
        hooks (dict): Hook name -> its :class:`HookCost`.
    """
    cluster: Cluster
    predictions: Mapping[str, StepPrediction]
    hooks: Mapping[str, HookCost]

    @property
    def best(self) -> str:
        """The fastest hook."""
        return min(self.predictions, key=lambda h: self.predictions[h].step_s)

    @property
    def best_lossless(self) -> Optional[str]:
        """The fastest hook that does not approximate the average."""
        lossless = [h for h in self.predictions if self.hooks[h].lossless]
        return min(
            lossless, key=lambda h: self.predictions[h].step_s, default=None)

    def speedup(self, hook: str) -> Optional[float]:
        """``allreduce``'s step over ``hook``'s; None without allreduce."""
        if 'allreduce' not in self.predictions:
            return None
        return (self.predictions['allreduce'].step_s /
                self.predictions[hook].step_s)

    def line(self) -> str:
        """One line: the hook to use, what it saves, its caveat."""
        rate = f'{self.cluster.link_bps / 1e9:g} Gbit/s'
        best = self.predictions[self.best]
        text = f'{rate}: use {best.label}: {best.step_s:.3f} s per step'
        if 'allreduce' in self.predictions:
            ref = self.predictions['allreduce'].step_s
            text += (f' against {ref:.3f} s with allreduce (saves '
                     f'{ref - best.step_s:.3f} s, '
                     f'{self.speedup(self.best):.2f}x)')
        text += f'; {self.hooks[self.best].caveat}.'
        safe = self.best_lossless
        if safe is not None and safe != self.best:
            text += (' Fastest of the exact or nearly exact hooks: '
                     f'{self.predictions[safe].label} at '
                     f'{self.predictions[safe].step_s:.3f} s '
                     f'({self.hooks[safe].caveat}).')
        return text


def recommend(params: Sequence[ParamSpec],
              cluster: Cluster,
              backward_s: Optional[float] = None,
              compute_step_s: Optional[float] = None,
              constants: LinkConstants = GPU_CLUSTER_CONSTANTS,
              codec: Optional[CodecCost] = None,
              hooks: Optional[Mapping[str, HookCost]] = None,
              workload: Workload = Workload(),
              total_params: Optional[int] = None,
              bucket_cap_mb: Optional[float] = None) -> Recommendation:
    """Predict every hook's step on ``cluster`` and pick the fastest.

    Args:
        params (Sequence[ParamSpec]): Trainable parameters, model order.
        cluster (Cluster): Nodes, GPUs per node, link rates.
        backward_s (float, optional): Measured or given backward time.
            Defaults to None: :func:`estimate_compute` from ``workload``.
        compute_step_s (float, optional): The step without communication.
            Defaults to None: estimated (given a ``backward_s``, the
            estimate's forward and optimizer are added to it).
        constants (LinkConstants): Defaults to
            :data:`GPU_CLUSTER_CONSTANTS`.
        codec (CodecCost, optional): Defaults to :class:`GpuCodec`'s
            defaults.
        hooks (Mapping[str, HookCost], optional): Defaults to
            :data:`HOOK_COSTS`.
        workload (Workload): For the estimates. Defaults to InternViT-6B's
            recipe.
        total_params (int, optional): All parameters, for the FLOPs.
        bucket_cap_mb (float, optional): DDP's. Defaults to DDP's default.

    Returns:
        Recommendation
    """
    codec = GpuCodec() if codec is None else codec
    hooks = HOOK_COSTS if hooks is None else hooks
    hbm = codec.hbm_Bps if isinstance(codec, GpuCodec) else GpuCodec().hbm_Bps
    est_backward, est_step = estimate_compute(params, workload, total_params,
                                              hbm)
    if backward_s is None:
        backward_s = est_backward
    if compute_step_s is None:
        compute_step_s = est_step - est_backward + backward_s
    buckets = ddp_buckets(params, bucket_cap_mb)
    return Recommendation(
        cluster=cluster,
        predictions={
            name:
            predict_step(hook, buckets, cluster, backward_s, compute_step_s,
                         constants, codec)
            for name, hook in hooks.items()
        },
        hooks=dict(hooks))


def assumptions(constants: LinkConstants,
                codec: CodecCost,
                cluster: Optional[Cluster] = None) -> List[str]:
    """The model's assumptions, one sentence each, for the output."""
    out = [
        f'link constants: alpha {constants.alpha_s * 1e6:.3g} us per '
        f'message, eta {constants.eta:.3g} of the link rate '
        f'({constants.source})',
        'flat rings for all_reduce and all_gather (one node-link crossing '
        'per node and direction); a flat all_to_all for int8, whose G ranks '
        'per node all push their off-node shares through the node link (no '
        'hierarchical all-to-all)',
        'no propagation delay: the emulated links measured none, so alpha '
        'holds only the software latency; long-haul links add their own',
        codec.describe(),
        'one link, first in first out: each bucket communicates after it is '
        'ready and the previous bucket is done; its codec on a stream of its '
        'own, beside the backward',
        'steady state: DDP\'s rebuilt buckets (reverse parameter order), '
        'PowerSGD after its warm-up; empty collectives cost nothing',
        'latency as ring steps (2 (P - 1) alpha an all_reduce); NCCL '
        'switches to trees (about 2 log2 P steps) for small messages, so '
        'the many small collectives of PowerSGD may cost less than shown',
    ]
    if cluster is not None:
        out.insert(
            1, f'{cluster.nodes} nodes x {cluster.gpus_per_node} '
            f'GPUs, intra-node {cluster.intra_bps / 8e9:g} GB/s '
            'per GPU per direction')
    return out
