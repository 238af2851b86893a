"""How one bucket layout is quantized and exchanged by the int8 hook: which
rank owns which block, and where each block's bytes go on the wire. Kept
apart from the hook so that its flat and two-level forms share it; the same
segments cut from equal chunks (:class:`Int8Chunks`) are what FSDP2's int8
forms send. Imports only torch.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import int8_codec
from .int8_codec import BlockTable
from .util import align_up, ceil_div

__all__ = [
    'Int8BucketPlan', 'sum_and_requantize', 'exchange_and_requantize',
    'Int8Chunks'
]


def _align4(nbytes: int) -> int:
    return align_up(nbytes, 4)


class Int8BucketPlan:
    """How one bucket layout is quantized, scattered and gathered, on one
    rank: built once per layout, reused every step.

    A rank's send buffer holds one segment per owner rank ``j``: the fp32
    scales of the blocks ``j`` owns, then their int8 payload, padded to 4
    bytes (so that the next segment's scales stay aligned), all in bucket
    order.

    Attributes:
        send (BlockTable): bucket -> send buffer (residual at the bucket
            offset).
        splits (list[int]): bytes of each owner's segment.
        own (BlockTable): this rank's blocks: a received segment -> the
            sum, in its own compact layout, and the sum -> the re-quantized
            segment (residual at the bucket offset); ``own.numel`` values.
        gather (BlockTable): all-gathered segments -> bucket.
        padded (int): bytes of each all-gathered segment (the largest).

    Args:
        pieces (list[tuple[int, int, int]]): The bucket's parameters in
            bucket order, as ``(offset, numel, first)``: where each starts
            in the bucket, its size and the number of its first block (its
            block ``b`` belongs to rank ``(first + b) % world_size``).
        world_size (int): Ranks in the group.
        rank (int): This rank in the group.
        block (int): ``block_size``.
    """

    def __init__(self, pieces: List[Tuple[int, int, int]], world_size: int,
                 rank: int, block: int) -> None:
        starts, lengths, owners = [], [], []
        for offset, numel, first in pieces:
            b = torch.arange(ceil_div(numel, block), dtype=torch.int64)
            starts.append(offset + b * block)
            lengths.append((numel - b * block).clamp(max=block))
            owners.append((first + b) % world_size)
        self._build(*(torch.cat(t) for t in (starts, lengths, owners)),
                    world_size, rank)

    @classmethod
    def of_blocks(cls, start: torch.Tensor, length: torch.Tensor,
                  owner: torch.Tensor, world_size: int,
                  rank: int) -> 'Int8BucketPlan':
        """The plan of blocks given one by one (int64 tensors: where each
        starts, its length and its owner), for a buffer that is not cut
        parameter by parameter: the two-level form's node sums."""
        plan = cls.__new__(cls)
        plan._build(start, length, owner, world_size, rank)
        return plan

    def _build(self, start: torch.Tensor, length: torch.Tensor,
               owner: torch.Tensor, world_size: int, rank: int) -> None:
        # Grouped by owner, in bucket order within each group.
        owner, order = torch.sort(owner, stable=True)
        start, length = start[order], length[order]
        counts = torch.bincount(owner, minlength=world_size)
        group_first = torch.cumsum(counts, 0) - counts
        index = torch.arange(len(owner)) - group_first[owner]
        numels = torch.zeros(
            world_size, dtype=torch.int64).index_add_(0, owner, length)
        local = torch.cumsum(length, 0) - length
        local -= (torch.cumsum(numels, 0) - numels)[owner]
        self.splits = [
            _align4(4 * int(c) + int(n)) for c, n in zip(counts, numels)
        ]
        self.padded = max(self.splits)
        self._payload_ends = [
            4 * int(c) + int(n) for c, n in zip(counts, numels)
        ]
        segment = torch.tensor([0] + self.splits[:-1]).cumsum(0)
        scale_at = 4 * index
        payload_at = 4 * counts[owner] + local

        # Rows in bucket order: the kernels then read the bucket (and
        # residual) front to back and write to world_size streams, about 2.5x
        # faster on CPU than reading it owner by owner.
        in_bucket_order = torch.argsort(start)

        def table(src, res, base):
            return BlockTable(
                torch.stack(
                    [src, res, length, base + payload_at, base + scale_at],
                    1)[in_bucket_order])

        self.send = table(start, start, segment[owner])
        self.gather = table(start, start, owner * self.padded)
        mine = owner == rank
        self.own = BlockTable(
            torch.stack([
                local[mine], start[mine], length[mine], payload_at[mine],
                scale_at[mine]
            ], 1))

    @property
    def send_bytes(self) -> int:
        return sum(self.splits)

    def zero_padding(self, send: torch.Tensor, out: torch.Tensor,
                     rank: int) -> None:
        """Zero the alignment bytes no block writes, so no stale memory
        goes on the wire."""
        at = 0
        for split, end in zip(self.splits, self._payload_ends):
            send[at + end:at + split].zero_()
            at += split
        out[self._payload_ends[rank]:].zero_()


def sum_and_requantize(plan: Int8BucketPlan, recv: torch.Tensor, ranks: int,
                       out: torch.Tensor, residual: Optional[torch.Tensor],
                       dtype: torch.dtype) -> None:
    """An owner's step: sum its blocks as ``ranks`` ranks sent them (their
    segments one after another in ``recv``), in rank order so that every
    run sums alike, and quantize the sum into ``out``.

    With a ``residual`` (fp32, at the blocks' residual offsets), the owner
    feeds back what this second rounding drops from its blocks, and for a
    ``dtype`` other than fp32 (a bf16 bucket) what the cast of the result
    drops too (see :class:`~.int8.Int8State`).
    """
    share = recv.numel() // ranks
    total = torch.empty(
        plan.own.numel, dtype=torch.float32, device=recv.device)
    for i in range(ranks):
        int8_codec.dequantize_blocks(
            recv[i * share:(i + 1) * share], plan.own, total, accumulate=i > 0)
    if residual is None:
        int8_codec.quantize_blocks(total, plan.own, out)
    elif dtype is torch.float32:
        # In the same pass.
        int8_codec.quantize_blocks(total, plan.own, out, 1.0, residual,
                                   'collect')
    else:
        int8_codec.quantize_blocks(total, plan.own, out)
        applied = torch.empty_like(total)
        int8_codec.dequantize_blocks(out, plan.own, applied)
        lost = total - applied.to(dtype).float()
        residual.index_add_(
            0, plan.own.residual_index(recv.device),
            torch.where(torch.isfinite(lost), lost, torch.zeros_like(lost)))


def exchange_and_requantize(plan: Int8BucketPlan, x: torch.Tensor,
                            prescale: float, residual: Optional[torch.Tensor],
                            rank: int, ranks: int, group: dist.ProcessGroup,
                            dtype: torch.dtype) -> torch.Tensor:
    """The flat exchange up to the all-gather, on rank ``rank`` of the
    ``ranks`` of ``group``: ``x * prescale`` (plus ``residual``) quantized
    into the owners' segments, each segment sent to its owner with one
    all-to-all, and this rank's blocks summed and quantized again
    (:func:`sum_and_requantize`, which feeds back into ``residual`` too).
    Returns the int8 result, ``plan.padded`` bytes, for the all-gather."""
    device = x.device
    send = torch.empty(plan.send_bytes, dtype=torch.uint8, device=device)
    out = torch.empty(plan.padded, dtype=torch.uint8, device=device)
    plan.zero_padding(send, out, rank)
    int8_codec.quantize_blocks(x, plan.send, send, prescale, residual)
    mine = plan.splits[rank]
    recv = torch.empty(ranks * mine, dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[mine] * ranks,
        input_split_sizes=plan.splits,
        group=group)
    sum_and_requantize(plan, recv, ranks, out, residual, dtype)
    return out


class Int8Chunks:
    """``parts`` equal chunks of ``chunk`` values, each quantized into a
    segment of its own: the chunk's fp32 scales, then its int8 values,
    padded to 4 bytes (an :class:`Int8BucketPlan` segment, for a buffer
    cut in equal chunks). What FSDP2's int8 reduce-scatter and hybrid
    sharding's int8 cross-node all-reduce send.

    Args:
        parts (int): Chunks (segments) in a buffer.
        chunk (int): Values per chunk.
        block (int): ``block_size``.
    """

    def __init__(self, parts: int, chunk: int, block: int) -> None:
        self.parts, self.chunk, self.block = parts, chunk, block
        self.blocks = int8_codec.num_blocks(chunk, block)
        #: Bytes of one segment.
        self.size = 4 * self.blocks + align_up(chunk, 4)

    @property
    def nbytes(self) -> int:
        """Bytes of a buffer of every segment."""
        return self.parts * self.size

    def segment(self, buf: torch.Tensor,
                j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(int8 values, fp32 scales)`` of segment ``j`` of ``buf``,
        as views."""
        at = j * self.size
        values = at + 4 * self.blocks
        return (buf[values:values + self.chunk].view(torch.int8),
                buf[at:values].view(torch.float32))

    def quantize(self,
                 x: torch.Tensor,
                 prescale: float,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A new buffer of :attr:`nbytes`: chunk ``j`` of ``x`` (fp32,
        ``parts * chunk`` values) times ``prescale``, plus its slice of
        ``residual`` (which keeps what rounding dropped), in segment
        ``j``; the padding zero, so no stale memory goes on the wire."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=x.device)
        for j in range(self.parts):
            values = slice(j * self.chunk, (j + 1) * self.chunk)
            end = j * self.size + 4 * self.blocks + self.chunk
            buf[end:(j + 1) * self.size].zero_()  # alignment
            q, scales = self.segment(buf, j)
            int8_codec.quantize(
                x[values],
                self.block,
                prescale,
                None if residual is None else residual[values],
                out=q,
                scales=scales)
        return buf

    def sum(self, buf: torch.Tensor) -> torch.Tensor:
        """The fp32 sum of every segment of ``buf``, in segment order, so
        that every run sums alike."""
        total = torch.empty(self.chunk, dtype=torch.float32, device=buf.device)
        for i in range(self.parts):
            q, scales = self.segment(buf, i)
            int8_codec.dequantize(
                q, scales, self.block, total, accumulate=i > 0)
        return total
