"""What a periodic hook (``post_local_sgd``, ``diloco``) sends, as the cost
model reads it.

A periodic hook's step is not one gradient exchange: every step its inner
hook (any per-step hook, ``allreduce`` by default) exchanges the gradients
among the ranks of one node, and every ``period`` optimizer steps the model
crosses the nodes, after the optimizer step (so never beside the
backward). A :class:`PeriodicCost` is the part of the hook's
:class:`~.records.HookRecord` (its ``cost``) that states that
synchronisation, laid out exactly as :mod:`mmcv_custom.hooks.local_sgd`
runs it: each of a node's ``G`` ranks sends only its ``1 / G`` slice of the
flat parameters, in the outer format, to its peers of the same place on
the other nodes (level ``'cross'``, a ring of ``M``), then the node
all-gathers the slices in fp32 (level ``'intra'``). The inner exchange is
the inner hook's own :class:`~.cost_records.CostRecord` over the node's
``G`` ranks. Standard library only, like :mod:`.cost_records`.

DiLoCo's streaming form (``fragments`` F, ``overlap`` tau) splits the
rank's slice into F contiguous parts, each synchronised once a period at
its own step: so "one synchronisation" here is one fragment's (1/F of the
slice; F of them a period send what the plain form sends once), and with
``overlap`` its exchange across nodes stays in flight for tau steps, its
buffers kept beside the forward and backward
(:attr:`PeriodicCost.sync_inflight_bytes`).
"""
import dataclasses
from typing import Any, Callable, List, Mapping, Optional, Tuple

from ..hooks.util import ceil_div

__all__ = [
    'PeriodicCost', 'slice_numel', 'fragment_numel', 'overlap_limit',
    'POST_LOCAL_SGD_COST', 'DILOCO_COST', 'SYNC_LEVEL_BYTES'
]

#: ``sync_sends(numel, ranks_per_node, num_nodes, settings)``: the
#: ``(kind, nbytes, level)`` of one synchronisation's collectives, in their
#: order, for ``numel`` trainable values (bytes as :mod:`.traffic` states
#: them, for the group of that level).
SyncSends = Callable[[int, int, int, Mapping], List[Tuple[str, float, str]]]
#: ``work(numel, ranks_per_node, num_nodes, settings) -> float``.
SyncWork = Callable[[int, int, int, Mapping], float]

#: Bytes a value of the parameters' fp32 slice takes in the all-gather
#: inside the node (the node's ranks gather the slices in fp32).
SYNC_LEVEL_BYTES = 4


def slice_numel(numel: int, ranks_per_node: int) -> int:
    """The values of the slice each of a node's ranks synchronises across
    nodes: one of ``ranks_per_node`` equal chunks, the last one short
    (:meth:`~mmcv_custom.hooks.local_sgd.PeriodicState.my_slice`); the
    largest is counted."""
    return ceil_div(numel, ranks_per_node)


def fragment_numel(numel: int, ranks_per_node: int, fragments: int = 1) -> int:
    """The values one synchronisation moves: one of ``fragments`` equal
    parts of the rank's slice (:func:`slice_numel`), the last one short;
    the largest is counted. With one fragment, the slice."""
    return ceil_div(slice_numel(numel, ranks_per_node), fragments)


def overlap_limit(period: int, fragments: int) -> int:
    """What DiLoCo's ``overlap`` must stay below: the steps between two
    fragments' places in the period, so that a fragment's exchange is
    applied before the next fragment's place. The hook's check and the
    cost model's both ask it."""
    return period // fragments


def _chunk(numel: int, ranks_per_node: int, settings: Mapping) -> int:
    # One synchronisation's part of the slice (a hook without fragments:
    # the slice).
    return fragment_numel(numel, ranks_per_node, settings.get('fragments', 1))


@dataclasses.dataclass(frozen=True)
class PeriodicCost:
    """What the cost model knows about a periodic hook.

    Attributes:
        sync_sends (Callable): One synchronisation's collectives
            (:data:`SyncSends`), each at its level.
        sync_codec_bytes (Callable): ``(numel, ranks_per_node, num_nodes,
            settings)``: bytes of memory traffic of one rank's local work
            in a synchronisation (slicing, the outer step, quantizing,
            copying back).
        sync_buffer_bytes (Callable): The same arguments: the bytes the
            synchronisation allocates at once on a rank beside what is
            kept from step to step. It runs after the optimizer step, when
            the activations are freed, so it needs that room then.
        sync_inflight_bytes (Callable, optional): The same arguments: the
            bytes one exchange across nodes holds while in flight (what it
            receives). With ``overlap`` > 0 they stay allocated for that
            many steps, beside the forward and backward. None: never in
            flight.
        settings (Mapping): The state keys that change the bytes, with the
            defaults the state takes (``period`` has none: the config must
            give it, so every setting of the model names one).
        detail (str): Appended to the name in tables, formatted with the
            settings.
        extra_detail (Mapping): Setting -> its words, formatted with the
            settings and added inside ``detail``'s parentheses only where
            the setting is not its default (so the default's label stays
            as it was).
        caveat (str): What to know before choosing it.
        min_nodes (int): The fewest nodes it runs on (``post_local_sgd``
            refuses one: it would be plain DDP). Defaults to 1.
    """
    sync_sends: SyncSends
    sync_codec_bytes: SyncWork
    sync_buffer_bytes: SyncWork
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    detail: str = '(period {period})'
    extra_detail: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sync_inflight_bytes: Optional[SyncWork] = None
    caveat: str = ''
    min_nodes: int = 1


def _gather(chunk: int, ranks_per_node: int) -> List[Tuple[str, float, str]]:
    # The node's ranks gather their fp32 slices (or fragments of them; none
    # with one rank).
    if ranks_per_node == 1:
        return []
    return [('all_gather', SYNC_LEVEL_BYTES * chunk, 'intra')]


def _local_sgd_sends(numel, ranks_per_node, num_nodes, settings):
    """The slice's mean across nodes, an fp32 all-reduce among the ``M``
    peers; then the node's gather."""
    chunk = slice_numel(numel, ranks_per_node)
    cross = [('all_reduce', 4 * chunk, 'cross')] if num_nodes > 1 else []
    return cross + _gather(chunk, ranks_per_node)


def _diloco_sends(numel, ranks_per_node, num_nodes, settings):
    """The pseudo-gradient's slice averaged across nodes: an all-reduce in
    fp32 (4 bytes a value) or bf16 (2), or for int8 an all-gather of the
    values (1 byte each) and one of the fp32 block scales, every rank
    summing the ``M`` copies. A ring all-gather sends ``M - 1`` times its
    part, an all-reduce ``2 (M - 1) / M`` times its tensor: so int8 sends
    less than bf16 on 2 or 3 nodes, 1.6% more on 4 (the scales) and more
    beyond, and less than fp32 up to 7 nodes. Then the node's gather of the
    new global slice. In the streaming form, all of it for one fragment of
    the slice."""
    chunk = _chunk(numel, ranks_per_node, settings)
    fmt = settings['outer_format']
    cross: List[Tuple[str, float, str]] = []
    if num_nodes > 1 and fmt == 'int8':
        cross = [('all_gather', chunk, 'cross'),
                 ('all_gather', 4 * ceil_div(chunk, settings['block_size']),
                  'cross')]
    elif num_nodes > 1:
        cross = [('all_reduce', (4 if fmt == 'fp32' else 2) * chunk, 'cross')]
    return cross + _gather(chunk, ranks_per_node)


def _write_back(numel: int, ranks_per_node: int, chunk: int) -> float:
    # The node's slices (of ``chunk`` values, a fragment's in the streaming
    # form: the node's G of them cover at most ``numel``) gathered piece by
    # piece (write 4 a value, with several ranks; the rank's own padded:
    # read and write 4 a value of it), all copied into the parameters (read
    # 4, write up to 4).
    covered = min(numel, ranks_per_node * chunk)
    gathered = 4 * covered + 8 * chunk if ranks_per_node > 1 else 0
    return float(gathered + 8 * covered)


def _local_sgd_codec_bytes(numel, ranks_per_node, num_nodes, settings):
    # The slice read from the parameters and made fp32 (read up to 4, write
    # 4, concatenated: 8 more), divided (8): 24 a value of the slice.
    chunk = slice_numel(numel, ranks_per_node)
    return 24.0 * chunk + _write_back(numel, ranks_per_node, chunk)


def _diloco_codec_bytes(numel, ranks_per_node, num_nodes, settings):
    # Per value of the slice: the slice made fp32 (16), the delta (12), its
    # average (bf16's cast and back 12, int8's quantization with the
    # residual 14 and the M copies dequantized 5 M, fp32's division 8), the
    # momentum (12), the Nesterov step (12) and the global update (12); of
    # one fragment of the slice in the streaming form.
    chunk = _chunk(numel, ranks_per_node, settings)
    fmt = settings['outer_format']
    average = {'fp32': 8, 'bf16': 12}.get(fmt, 14 + 5 * num_nodes)
    return float((16 + 12 + average + 36) * chunk) + _write_back(
        numel, ranks_per_node, chunk)


def _gather_pieces(chunk: int, ranks_per_node: int) -> int:
    # Values alive at the node's gather: the rank's slice padded, and one
    # piece from every rank and its own (mmcv_custom.hooks.local_sgd
    # gathers 2**24 values a piece, so a 6B model's whole fp32 copy is
    # never made); none with one rank.
    if ranks_per_node == 1:
        return 0
    return chunk + (ranks_per_node + 1) * min(chunk, 1 << 24)


def _local_sgd_buffers(numel, ranks_per_node, num_nodes, settings):
    # The slice in fp32, and what the gather holds.
    chunk = slice_numel(numel, ranks_per_node)
    return 4 * (chunk + _gather_pieces(chunk, ranks_per_node))


def _diloco_buffers(numel, ranks_per_node, num_nodes, settings):
    # The slice, the delta and the Nesterov step in fp32 (int8's M
    # received copies, a byte a value each, are freed before the gather),
    # and what the gather holds; of one fragment in the streaming form.
    chunk = _chunk(numel, ranks_per_node, settings)
    return 4 * (3 * chunk + _gather_pieces(chunk, ranks_per_node))


def _diloco_inflight(numel, ranks_per_node, num_nodes, settings):
    # What the exchange across nodes receives into while in flight: int8's
    # values from each of the M nodes (a byte each) and their fp32 block
    # scales; bf16's or fp32's all-reduced tensor. None on one node.
    if num_nodes == 1:
        return 0
    chunk = _chunk(numel, ranks_per_node, settings)
    fmt = settings['outer_format']
    if fmt == 'int8':
        return num_nodes * (
            chunk + 4 * ceil_div(chunk, settings['block_size']))
    return (4 if fmt == 'fp32' else 2) * chunk


#: ``post_local_sgd``: the parameters averaged across nodes in fp32.
POST_LOCAL_SGD_COST = PeriodicCost(
    sync_sends=_local_sgd_sends,
    sync_codec_bytes=_local_sgd_codec_bytes,
    sync_buffer_bytes=_local_sgd_buffers,
    settings=dict(period=None),
    detail='(period {period})',
    caveat=('the nodes train apart between synchronisations, each on its '
            'own gradients; the parameters averaged across nodes every '
            'period steps'),
    min_nodes=2)

#: ``diloco``: the pseudo-gradient averaged across nodes in its
#: ``outer_format`` and applied by the outer Nesterov SGD.
DILOCO_COST = PeriodicCost(
    sync_sends=_diloco_sends,
    sync_codec_bytes=_diloco_codec_bytes,
    sync_buffer_bytes=_diloco_buffers,
    settings=dict(
        period=None,
        outer_format='int8',
        block_size=256,
        fragments=1,
        overlap=0),
    detail='(period {period}, {outer_format})',
    extra_detail=dict(
        fragments='fragments {fragments}', overlap='overlap {overlap}'),
    sync_inflight_bytes=_diloco_inflight,
    caveat=('the nodes train apart between synchronisations; every period '
            'steps the pseudo-gradient is averaged across nodes and applied '
            'by an outer Nesterov SGD; keeps the global parameters and the '
            'outer momentum (and int8\'s residual) of the rank\'s slice, in '
            'fp32'))
