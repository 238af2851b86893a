"""What each built-in hook sends and computes, as the cost model reads it.

A :class:`CostRecord` is the part of a hook's
:class:`~.records.HookRecord` that :mod:`mmcv_custom.analysis.cost` needs
to project its step time without running it: the collectives it issues for
a bucket layout on a world size, the local work (the codec) per bucket,
and what to know before choosing it. A user's hook gets the same
projection by giving its record a ``cost``.

The functions take buckets as the cost model lays them out
(:class:`mmcv_custom.analysis.cost.Bucket`), by duck typing: a bucket has
``params`` (each with ``numel``, ``itemsize``, ``dtype`` and ``matrix``,
the ``(n, m)`` PowerSGD sees), ``indices`` (the parameters' positions in
the model), ``numel`` and ``itemsize``. Settings are the hook's state keys
of a ``comm_hook`` config (``block_size``, ``matrix_approximation_rank``,
...), over :attr:`CostRecord.settings`' defaults. Standard library only,
like the counting rule beside it (:mod:`.traffic`).

A hook with a two-level (node-aware) form, chosen by the ``comm_hook`` key
``topology``, states it in :attr:`CostRecord.two_level` (a
:class:`TwoLevelCost`): its collectives per bucket on ``M`` nodes of ``G``
ranks, each at its level (:data:`LEVELS`: inside a node, or across the
nodes among the ranks of one local rank), and its codec. The cost model
times the two levels at different rates (NVLink against the NIC), which is
the whole point of the form: full precision where bytes are cheap,
compressed where they are not.
"""
import dataclasses
import math
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence,
                    Tuple)

from ..hooks.util import align_up, ceil_div

__all__ = [
    'CostRecord', 'TwoLevelCost', 'LEVELS', 'powersgd_compresses',
    'square_side', 'ALLREDUCE_COST', 'HALF_PRECISION_COSTS', 'INT8_COST',
    'POWERSGD_COST', 'BATCHED_POWERSGD_COST'
]

#: ``sends(buckets, world_size, settings)``: per bucket, in DDP's order, the
#: ``(kind, nbytes)`` of the collectives one step issues, in their order.
Sends = Callable[[Sequence[Any], int, Mapping], List[List[Tuple[str, float]]]]
#: ``work(bucket, world_size, settings) -> float``.
BucketWork = Callable[[Any, int, Mapping], float]

#: Where a two-level hook's collective runs: ``'intra'`` among the ranks of
#: one node (``G`` of them, over the node's GPU links), ``'cross'`` among
#: the ranks of one local rank on every node (``M`` of them, through the
#: node's network link, which the node's ``G`` such groups share).
LEVELS = ('intra', 'cross')

#: ``sends(buckets, ranks_per_node, num_nodes, settings)``: per bucket, in
#: DDP's order, the ``(kind, nbytes, level)`` of the collectives one step of
#: the two-level form issues, in their order; ``nbytes`` as :mod:`.traffic`
#: states it, for the group of that level.
TwoLevelSends = Callable[[Sequence[Any], int, int, Mapping],
                         List[List[Tuple[str, float, str]]]]
#: ``work(bucket, ranks_per_node, num_nodes, settings) -> float``.
LevelWork = Callable[[Any, int, int, Mapping], float]


def _no_flops(bucket, world_size: int, settings: Mapping) -> float:
    return 0.0


def _no_level_flops(bucket, ranks_per_node: int, num_nodes: int,
                    settings: Mapping) -> float:
    return 0.0


@dataclasses.dataclass(frozen=True)
class TwoLevelCost:
    """What the cost model knows about a hook's two-level form.

    The hooks run their two-level form only on several nodes of several
    ranks each (``topology='auto'``, or ``dict(ranks_per_node=N)``); on one
    node, or one rank per node, they run the flat form, and the cost model
    asks :attr:`CostRecord.sends` there instead. So these functions are
    called with ``ranks_per_node >= 2`` and ``num_nodes >= 2``.

    Attributes:
        sends (Callable): ``sends(buckets, ranks_per_node, num_nodes,
            settings)``: per bucket, the ``(kind, nbytes, level)`` of its
            collectives (:data:`TwoLevelSends`); ``level`` one of
            :data:`LEVELS`.
        codec_bytes (Callable): ``codec_bytes(bucket, ranks_per_node,
            num_nodes, settings)``: bytes of memory traffic of one rank's
            local work on ``bucket`` (a two-level hook quantizes or
            compresses only its ``1 / G`` share, but sums and copies the
            whole bucket).
        codec_flops (Callable): The same in matmul FLOPs. Defaults to none.
    """
    sends: TwoLevelSends
    codec_bytes: LevelWork
    codec_flops: LevelWork = _no_level_flops


@dataclasses.dataclass(frozen=True)
class CostRecord:
    """What the cost model knows about one hook.

    Attributes:
        sends (Callable): ``sends(buckets, world_size, settings)``: per
            bucket, the ``(kind, nbytes)`` of its collectives (kinds and
            byte conventions as :mod:`.traffic` states them); empty ones
            may be left in (the cost model leaves them out).
        codec_bytes (Callable): ``codec_bytes(bucket, world_size,
            settings)``: bytes of memory traffic of the hook's local work
            on ``bucket`` (divisions, casts, quantization, error feedback).
        codec_flops (Callable): The same in matmul FLOPs. Defaults to none.
        settings (Mapping): The state keys that change the bytes, with the
            defaults the hook's state takes. Defaults to none.
        detail (str): Appended to the hook's name in tables, formatted
            with the settings (e.g. ``'(rank {matrix_approximation_rank})'``).
            Defaults to none.
        lossless (bool): Whether the averaged gradients are the exact (or
            half-precision) average. Defaults to True.
        overflows (bool): Whether its format overflows where fp32 does not
            (fp16): where two hooks' steps tie, the other is preferred.
            Defaults to False.
        caveat (str | Callable): What to know before choosing it, or
            ``caveat(settings) -> str`` where the settings change it.
        two_level (TwoLevelCost, optional): The hook's two-level form, if
            it has one (``topology`` picks it). Defaults to None: flat only.
    """
    sends: Sends
    codec_bytes: BucketWork
    codec_flops: BucketWork = _no_flops
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    detail: str = ''
    lossless: bool = True
    overflows: bool = False
    caveat: Any = ''
    two_level: Optional[TwoLevelCost] = None

    def caveat_for(self, settings: Mapping[str, Any]) -> str:
        """:attr:`caveat` for these settings."""
        return self.caveat(settings) if callable(self.caveat) else self.caveat

    def settings_with(self, given: Mapping[str, Any]) -> Dict[str, Any]:
        """:attr:`settings` overridden by the keys of ``given`` it names
        (a config's other state keys do not change the bytes)."""
        return {k: given.get(k, v) for k, v in self.settings.items()}


def _each_bucket(per_bucket: Callable) -> Sends:
    """A :data:`Sends` of a hook whose buckets do not depend on each
    other: ``per_bucket(bucket, world_size, settings)`` for each."""

    def sends(buckets, world_size, settings):
        return [per_bucket(b, world_size, settings) for b in buckets]

    return sends


def _each_bucket_two_level(per_bucket: Callable) -> TwoLevelSends:
    """A :data:`TwoLevelSends` of a hook whose buckets do not depend on
    each other: ``per_bucket(bucket, ranks_per_node, num_nodes, settings)``
    for each."""

    def sends(buckets, ranks_per_node, num_nodes, settings):
        return [
            per_bucket(b, ranks_per_node, num_nodes, settings) for b in buckets
        ]

    return sends


def _intra_reduce(bucket) -> Tuple[str, float, str]:
    """The first step of every two-level form: the bucket all-to-all'd
    inside the node in its own dtype (segment ``l`` to local rank ``l``),
    each rank then summing the ``G`` segments of its share: a
    reduce-scatter over the fast link, in full precision."""
    return ('all_to_all', bucket.numel * bucket.itemsize, 'intra')


# -- allreduce, fp16_compress, bf16_compress --------------------------------
def _whole_bucket(bucket, world_size, settings):
    return [('all_reduce', bucket.numel * bucket.itemsize)]


def _half_bucket(bucket, world_size, settings):
    return [('all_reduce', 2 * bucket.numel)]


#: ``allreduce``: each bucket in its own dtype (fp32: 4 bytes an element, a
#: bf16 model's 2); the local work is the division by the world size (read
#: and write).
ALLREDUCE_COST = CostRecord(
    sends=_each_bucket(_whole_bucket),
    codec_bytes=lambda b, world_size, settings: 2.0 * b.numel * b.itemsize,
    caveat='exact: the reference')


def _half_codec_bytes(bucket, world_size, settings):
    # fp32 buckets are divided and cast (read 4, write 2) and written back
    # (read 2, write 4): 12 bytes an element; a bucket already in 2 bytes
    # is only divided in place (4).
    return (12.0 if bucket.itemsize > 2 else 4.0) * bucket.numel


def _two_level_half_bucket(bucket, ranks_per_node, num_nodes, settings):
    # Full precision inside the node, 2 bytes only across it: the rank's
    # 1 / G share all-reduced among its M peers, then all-gathered inside
    # the node in the half format.
    share = ceil_div(bucket.numel, ranks_per_node)
    return [
        _intra_reduce(bucket), ('all_reduce', 2 * share, 'cross'),
        ('all_gather', 2 * share, 'intra')
    ]


def _two_level_half_codec_bytes(bucket, ranks_per_node, num_nodes, settings):
    # Summing the G received segments (read the bucket's n e bytes) into
    # the share, divided and cast (write 2 a share element); the gathered
    # half-precision bucket cast back into an fp32 bucket (read 2, write
    # 4; a 2-byte bucket is gathered into in place).
    n, e = bucket.numel, bucket.itemsize
    back = (2 + e) * n if e > 2 else 0
    return float(e * n + 2 * ceil_div(n, ranks_per_node) + back)


#: The two-level form of ``fp16_compress`` / ``bf16_compress`` (and of the
#: ``'fp16'``/``'bf16'`` wrappers on ``allreduce``).
_TWO_LEVEL_HALF = TwoLevelCost(
    sends=_each_bucket_two_level(_two_level_half_bucket),
    codec_bytes=_two_level_half_codec_bytes)

#: ``fp16_compress`` / ``bf16_compress``: 2 bytes an element.
HALF_PRECISION_COSTS = {
    fmt:
    CostRecord(
        sends=_each_bucket(_half_bucket),
        codec_bytes=_half_codec_bytes,
        two_level=_TWO_LEVEL_HALF,
        overflows=fmt == 'fp16',
        caveat=('nearly lossless: 11 significant bits, overflows above 65504'
                if fmt == 'fp16' else
                "nearly lossless: 8 significant bits, fp32's range"))
    for fmt in ('fp16', 'bf16')
}


# -- int8_compress ------------------------------------------------------------
def _int8_firsts(buckets, block: int) -> Dict[int, int]:
    """Parameter index -> number of its first block (both forms of the
    int8 hook number blocks so)."""
    if any(len(b.indices) != len(b.params) for b in buckets):
        raise ValueError('int8_compress\'s cost needs buckets with parameter '
                         'indices (from ddp_buckets)')
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
            next_block += ceil_div(params[i].numel, block)
    return firsts


def _int8_segments(bucket, firsts: Dict[int, int], world_size: int,
                   block: int) -> List[int]:
    """Bytes of each owner's segment of ``bucket``, aligned to 4."""
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
    return [align_up(4 * c + n, 4) for c, n in zip(counts, numels)]


def _int8_sends(buckets, world_size, settings):
    """Exactly as :mod:`mmcv_custom.hooks.int8` lays its bytes out: every
    parameter is cut into blocks of ``block_size`` (its last may be
    shorter); block ``b`` of a parameter belongs to rank ``(first + b) %
    P``, ``first`` numbering the parameter's blocks in the order the hook
    first met them (DDP's first-step layout: one bucket per dtype, the one
    holding the later parameters first, parameters in model order). Each
    owner's segment is its blocks' fp32 scales then their int8 payload,
    padded to 4 bytes; the all-to-all sends every segment (about ``numel
    * (1 + 4 / block_size)``), the all-gather each rank's own, padded to
    the largest."""
    block = settings['block_size']
    firsts = _int8_firsts(buckets, block)
    out = []
    for bucket in buckets:
        segments = _int8_segments(bucket, firsts, world_size, block)
        out.append([('all_to_all', sum(segments)),
                    ('all_gather', max(segments))])
    return out


def _int8_codec_bytes(bucket, world_size, settings):
    # Per element: error feedback (read and write the fp32 residual, 8),
    # reading the gradient and writing int8 (itemsize + 1), summing the
    # received shares and quantizing the sum (about 2) and writing the
    # result back (1 + itemsize): 2 itemsize + 12, or 2 itemsize + 4
    # without error feedback.
    per = 2 * bucket.itemsize + (12 if settings['error_feedback'] else 4)
    return float(per * bucket.numel)


def _two_level_int8_slots(bucket, firsts: Dict[int, int], ranks_per_node: int,
                          num_nodes: int, block: int):
    """Blocks and elements of ``bucket`` per (local rank ``l``, node
    ``j``) slot group, as :class:`~mmcv_custom.hooks.int8_two_level.
    TwoLevelPlan` assigns them: block number ``k`` goes to local rank ``k
    % G`` and, among its peers, to node ``(k // G) % M`` (a period of ``G
    * M`` blocks)."""
    g, m = ranks_per_node, num_nodes
    period = g * m
    counts, numels = [0] * period, [0] * period

    def key(k):
        return (k % g) * m + (k // g) % m

    for index, param in zip(bucket.indices, bucket.params):
        blocks = ceil_div(param.numel, block)
        if not blocks:
            continue
        first = firsts[index]
        q, rem = divmod(blocks, period)
        for i in range(min(blocks, period)):
            c = q + (1 if i < rem else 0)
            counts[key(first + i)] += c
            numels[key(first + i)] += block * c
        numels[key(first + blocks - 1)] -= blocks * block - param.numel
    return counts, numels


def _two_level_int8_sends(buckets, ranks_per_node, num_nodes, settings):
    """The two-level ``int8_compress``, laid out exactly as the hook does:
    (1) the bucket cut into blocks of ``block_size`` per parameter, in
    fp32, all-to-all'd inside the node (every local rank gets ``M * Q``
    block slots, ``Q`` the most blocks any (local rank, node) pair holds),
    each summing its ``G`` received copies; (2) those sums quantized (int8
    and an fp32 scale a block, each node's segment padded to 4 bytes) and
    all-to-all'd among the rank's ``M`` peers on the other nodes; (3) each
    peer's segment, summed and quantized again, all-gathered among the
    peers (padded to the largest); (4) that int8 result all-gathered inside
    the node, each rank decoding every part. Only (2) and (3) cross nodes:
    about ``2 (M - 1) / M`` of the quantized bucket per node link, against
    about ``G`` times that for the flat all-to-all. Local ranks' shares
    differ by a block or so; the largest sets the pace, and is counted."""
    g, m = ranks_per_node, num_nodes
    block = settings['block_size']
    firsts = _int8_firsts(buckets, block)
    out = []
    for bucket in buckets:
        counts, numels = _two_level_int8_slots(bucket, firsts, g, m, block)
        slots = max(max(counts), 1)
        segments = [[
            align_up(4 * counts[i * m + j] + numels[i * m + j], 4)
            for j in range(m)
        ] for i in range(g)]
        padded = max(max(s) for s in segments)
        out.append([('all_to_all', 4 * block * g * m * slots, 'intra'),
                    ('all_to_all', max(sum(s) for s in segments), 'cross'),
                    ('all_gather', padded, 'cross'),
                    ('all_gather', m * padded, 'intra')])
    return out


def _two_level_int8_codec_bytes(bucket, ranks_per_node, num_nodes, settings):
    # Per element of the bucket: copied into fp32 blocks (read e, write 4),
    # the received segments read to sum them (4), the gathered bucket
    # copied out of its blocks (2 e) after every part is decoded (read 1,
    # write 4). Per element of the 1 / G share: writing the sum (4),
    # quantizing it (read 4, write 1, and the fp32 residual read and
    # written, 8, with error feedback) and summing the received pieces and
    # quantizing again (about 2).
    n, e = bucket.numel, bucket.itemsize
    share = ceil_div(n, ranks_per_node)
    ef = 8 if settings['error_feedback'] else 0
    return float((e + 4 + 4 + 2 * e + 5) * n + (4 + 5 + ef + 2) * share)


def _int8_caveat(settings: Mapping) -> str:
    text = ('lossy: int8 with a scale per block, moves a gradient by about '
            '1%; ')
    if settings['error_feedback']:
        return text + ('keeps error-feedback state, one fp32 copy of the '
                       'gradients per rank (of its shard under hybrid '
                       'sharding)')
    return text + ('no error feedback: what the rounding drops is lost, not '
                   'carried to the next step')


#: ``int8_compress``: blockwise int8, an all-to-all then an all-gather.
INT8_COST = CostRecord(
    sends=_int8_sends,
    codec_bytes=_int8_codec_bytes,
    two_level=TwoLevelCost(
        sends=_two_level_int8_sends, codec_bytes=_two_level_int8_codec_bytes),
    settings=dict(block_size=256, error_feedback=True),
    detail='(block {block_size})',
    lossless=False,
    caveat=_int8_caveat)


# -- powerSGD, batched_powerSGD -----------------------------------------------
def powersgd_compresses(n: int,
                        m: int,
                        rank: int,
                        min_compression_rate: float = 2.0) -> bool:
    """PyTorch's rule: an ``n x m`` gradient is compressed at rank ``r``
    (``min(n, m, rank)``) iff ``(n + m) r * min_compression_rate < n m``
    (``_should_compress``, the rule
    :func:`mmcv_custom.hooks.powersgd.compression` applies to tensors). 1-d
    tensors (``m == 1``) never pass."""
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


def _powersgd_split(bucket, settings) -> Tuple[int, int, int, float]:
    """Numbers uncompressed, in P, in Q; FLOPs."""
    rank = settings['matrix_approximation_rank']
    plain = ps = qs = 0
    flops = 0.0
    for param in bucket.params:
        n, m = param.matrix
        r = min(n, m, rank)
        if powersgd_compresses(n, m, rank, settings['min_compression_rate']):
            ps += n * r
            qs += m * r
            flops += 6.0 * n * m * r
        else:
            plain += n * m
    return plain, ps, qs, flops


def _powersgd_bucket(bucket, world_size, settings):
    # The uncompressed tensors all-reduced as they are, then the P factors,
    # then the Q factors, one after the other, in the bucket's dtype.
    plain, ps, qs, _ = _powersgd_split(bucket, settings)
    e = bucket.itemsize
    return [('all_reduce', plain * e), ('all_reduce', ps * e),
            ('all_reduce', qs * e)]


def _powersgd_codec_bytes(bucket, world_size, settings):
    # A compressed n x m gradient: error feedback (add, 3 passes of
    # itemsize), a copy kept for the next residual (2), the two products
    # P = M Q and Q = M^T P (reading M twice, 2), the decompression P Q^T
    # (1) and the residual (3): 11 passes; an uncompressed one is packed,
    # divided and unpacked (6). Orthogonalizing the skinny P is left out.
    plain = _powersgd_split(bucket, settings)[0]
    compressed = bucket.numel - plain
    return float(bucket.itemsize * (11 * compressed + 6 * plain))


def _two_level_powersgd_bucket(bucket, ranks_per_node, num_nodes, settings):
    # Reduced inside the node in the bucket's dtype (each tensor to its
    # owner); then each local rank runs PowerSGD on its tensors among its M
    # peers (its uncompressed tensors, P and Q all-reduced). The hook gives
    # whole tensors to owners, balanced over the model: a rank's share of a
    # bucket varies, the node's G ranks' together are the flat form's, so
    # 1 / G of each is what a rank sends on average. Then the decompressed
    # shares spread inside the node: an all-gather where the owners' shares
    # are equal, else a broadcast from each owner, the same (G - 1) n e
    # bytes on the node's links as an all-gather of n / G each.
    plain, ps, qs, _ = _powersgd_split(bucket, settings)
    g, e = ranks_per_node, bucket.itemsize
    return [
        _intra_reduce(bucket), ('all_reduce', ceil_div(plain, g) * e, 'cross'),
        ('all_reduce', ceil_div(ps, g) * e, 'cross'),
        ('all_reduce', ceil_div(qs, g) * e, 'cross'),
        ('all_gather', ceil_div(bucket.numel, g) * e, 'intra')
    ]


def _two_level_powersgd_codec_bytes(bucket, ranks_per_node, num_nodes,
                                    settings):
    # The G received segments read to sum them (n e), then the flat form's
    # work on the rank's 1 / G of the matrices: on average, since the hook
    # gives whole tensors to owners (a bucket of one large matrix is one
    # rank's work; spread over the model, the work is even).
    return (bucket.numel * bucket.itemsize +
            _powersgd_codec_bytes(bucket, 1, settings) / ranks_per_node)


#: ``powerSGD`` (PyTorch's, after its warm-up); ``6 n m r`` FLOPs a
#: compressed gradient.
POWERSGD_COST = CostRecord(
    sends=_each_bucket(_powersgd_bucket),
    codec_bytes=_powersgd_codec_bytes,
    codec_flops=lambda b, world_size, s: _powersgd_split(b, s)[3],
    two_level=TwoLevelCost(
        sends=_each_bucket_two_level(_two_level_powersgd_bucket),
        codec_bytes=_two_level_powersgd_codec_bytes,
        codec_flops=lambda b, g, m, s: _powersgd_split(b, s)[3] / g),
    settings=dict(matrix_approximation_rank=1, min_compression_rate=2.0),
    detail='(rank {matrix_approximation_rank})',
    lossless=False,
    caveat=('lossy: low-rank approximation of every weight gradient; keeps '
            'error-feedback state, a copy of the gradients, and warm-start '
            'factors; needs a warm-up of plain all-reduces, '
            'start_powerSGD_iter'))


def square_side(numel: int) -> int:
    """``ceil(sqrt(numel))``, exactly: the side of the square matrix
    ``batched_powerSGD`` makes of a bucket."""
    return math.isqrt(numel - 1) + 1 if numel > 0 else 0


def _batched_bucket(bucket, world_size, settings):
    # Two sequential all-reduces of side * r numbers each.
    side = square_side(bucket.numel)
    rank = min(side, settings['matrix_approximation_rank'])
    return [('all_reduce', side * rank * bucket.itemsize)] * 2


def _batched_flops(bucket, world_size, settings):
    side = square_side(bucket.numel)
    return 6.0 * side * side * min(side, settings['matrix_approximation_rank'])


def _two_level_batched_bucket(bucket, ranks_per_node, num_nodes, settings):
    # Reduced inside the node; each local rank's 1 / G slice of the bucket
    # as one square matrix (side about side / sqrt(G)), its two factors
    # all-reduced among its M peers; the slices all-gathered inside the node
    # (broadcast from each owner where the last slice is shorter: the same
    # bytes).
    share = ceil_div(bucket.numel, ranks_per_node)
    side = square_side(share)
    rank = min(side, settings['matrix_approximation_rank'])
    e = bucket.itemsize
    factor = ('all_reduce', side * rank * e, 'cross')
    return [
        _intra_reduce(bucket), factor, factor,
        ('all_gather', share * e, 'intra')
    ]


def _two_level_batched_codec_bytes(bucket, ranks_per_node, num_nodes,
                                   settings):
    # The G received segments read to sum them (n e), then the flat form's
    # 15 passes over the 1 / G share.
    share = ceil_div(bucket.numel, ranks_per_node)
    return float(bucket.itemsize * (bucket.numel + 15 * share))


def _two_level_batched_flops(bucket, ranks_per_node, num_nodes, settings):
    side = square_side(ceil_div(bucket.numel, ranks_per_node))
    return 6.0 * side * side * min(side, settings['matrix_approximation_rank'])


#: ``batched_powerSGD``: each bucket as one square matrix. Local work:
#: error feedback (3 passes), a copy (2), the zero-padded square (2), two
#: products (2), the decompression and copy back (3) and the residual (3):
#: 15 passes and ``6 side^2 r`` FLOPs.
BATCHED_POWERSGD_COST = CostRecord(
    sends=_each_bucket(_batched_bucket),
    codec_bytes=lambda b, world_size, s: 15.0 * b.itemsize * b.numel,
    codec_flops=_batched_flops,
    two_level=TwoLevelCost(
        sends=_each_bucket_two_level(_two_level_batched_bucket),
        codec_bytes=_two_level_batched_codec_bytes,
        codec_flops=_two_level_batched_flops),
    settings=dict(matrix_approximation_rank=1),
    detail='(rank {matrix_approximation_rank})',
    lossless=False,
    caveat=('lossy, coarser than powerSGD: one low-rank matrix per bucket, '
            'mixing parameters; keeps error-feedback state and warm-start '
            'factors'))
