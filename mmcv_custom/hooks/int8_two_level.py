"""The two-level (node-aware) form of the int8 hook.

The flat form has every rank send its quantized share to every other rank:
each of a node's G ranks pushes its off-node share through the node's one
network link, about G times the bytes a ring puts there. The two-level form
reduces inside the node first, over the fast link and in fp32, and only the
node's sums cross nodes, in int8:

1. every rank scales its bucket by ``1 / world_size`` and adds its error
   feedback; an all-to-all inside the node hands each of the node's ranks
   its blocks from every other, which it sums in fp32 (in rank order);
2. the flat int8 exchange runs on those sums among the ranks of the same
   place on every node (``NodeGroups.cross``): quantize, all-to-all, sum,
   quantize again, all-gather;
3. an all-gather inside the node of every rank's int8 result (as the
   exchange across nodes returned it) gives every rank the whole average,
   each part decoded with its rank's plan: the same values on every rank,
   at a quarter of fp32's bytes on the fast link too.

So a node's link carries about 1/G of the flat form's int8 bytes.

Blocks follow the parameters, as in the flat form: block ``b`` of a
parameter whose first block is numbered ``f`` is block ``k = f + b``; it
is summed inside the node by the node's rank ``k % G`` and owned across
nodes by the cross-group rank ``(k // G) % M``. Neither depends on how DDP
cuts its buckets, nor do the order of any sum or any block's rounding, so
a re-laid-out or resumed run is bit for bit the uninterrupted one.

To move blocks without a per-element index, the bucket is copied into
*rows* of ``block`` values, one block a row, each parameter's last row
padded with zeros; rows are then picked by a per-row index. Error feedback
is kept in the bucket's layout, as the flat form keeps it: a rank's
residual is added to its values before the node's sum, so wherever the
residual of a block is kept the sum carries it, and what each rounding
drops is kept by the rank that rounds. Imports only torch.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import int8_codec
from .int8_plan import Int8BucketPlan, exchange_and_requantize
from .topology import NodeGroups
from .util import all_gather_single, ceil_div

__all__ = ['TwoLevelPlan', 'two_level_reduce']


class TwoLevelPlan:
    """How one bucket layout goes through the two levels, on one rank.

    Attributes:
        pieces (list[tuple[int, int, int]]): ``(offset, numel, first row)``
            of each parameter: where it is in the bucket and in the rows.
        rows (int): Rows of the bucket (its blocks).
        slots (Tensor): int64, ``G * M * Q``: the row each slot of the send
            buffer takes, grouped by node rank, then by cross owner, ``Q``
            slots each (``rows``, an all-zero row, where there is none).
        per_rank (int): ``M * Q``, the slots each node rank sums.
        filled (Tensor): The slots that hold a row; ``filled_rows``: those
            rows.
        cross (Int8BucketPlan): The flat exchange of this rank's node sums
            (``per_rank`` rows) among its cross-node peers.
    """

    def __init__(self, pieces: List[Tuple[int, int, int]], groups: NodeGroups,
                 block: int) -> None:
        layout = groups.layout
        node_size, nodes = layout.ranks_per_node, layout.num_nodes
        self.block = block
        self.pieces, firsts, counts = [], [], []
        row = 0
        for offset, numel, first in pieces:
            count = ceil_div(numel, block)
            self.pieces.append((offset, numel, row))
            firsts.append(first)
            counts.append(count)
            row += count
        self.rows = row
        count = torch.tensor(counts, dtype=torch.int64)
        row_start = torch.cumsum(count, 0) - count
        row_ids = torch.arange(self.rows, dtype=torch.int64)
        piece_of = torch.repeat_interleave(
            torch.arange(len(counts)), count, output_size=self.rows)
        b = row_ids - row_start[piece_of]
        k = torch.tensor(firsts, dtype=torch.int64)[piece_of] + b
        numel = torch.tensor([n for _, n, _ in pieces], dtype=torch.int64)
        length = (numel[piece_of] - b * block).clamp(max=block)

        # Slots: grouped by (node rank, cross owner), bucket order within.
        key = (k % node_size) * nodes + (k // node_size) % nodes
        key, order = torch.sort(key, stable=True)
        per_key = torch.bincount(key, minlength=node_size * nodes)
        slots_each = max(int(per_key.max()), 1) if self.rows else 1
        first_of_key = torch.cumsum(per_key, 0) - per_key
        slot = key * slots_each + (torch.arange(self.rows) - first_of_key[key])
        self.per_rank = nodes * slots_each
        self.slots = torch.full((node_size * self.per_rank, ),
                                self.rows,
                                dtype=torch.int64)
        self.slots[slot] = order
        self.filled = slot.sort().values
        self.filled_rows = self.slots[self.filled]

        # Each node rank's sums: its per_rank slots, one block each. This
        # rank exchanges its own across nodes (``cross``); every rank's
        # int8 result comes back inside the node, decoded with its plan.
        me = groups.intra_rank
        length_of = torch.cat([length, torch.zeros(1, dtype=torch.int64)])
        where = torch.arange(self.per_rank, dtype=torch.int64)
        self.node_plans = []
        for rank in range(node_size):
            theirs = self.slots[rank * self.per_rank:(rank + 1) *
                                self.per_rank]
            held = theirs < self.rows
            self.node_plans.append(
                Int8BucketPlan.of_blocks(where[held] * block,
                                         length_of[theirs][held],
                                         where[held] // slots_each, nodes,
                                         groups.cross_rank))
        self.cross = self.node_plans[me]
        #: Bytes each node rank gives the all-gather inside the node: its
        #: all-gathered int8 result, padded to the largest.
        self.spread_bytes = max(nodes * plan.padded
                                for plan in self.node_plans)
        # The indices the step needs, on the device of the buckets (CPU
        # here; a GPU's copies are made once, at the first step there).
        self._mine_at = me * self.per_rank
        self._on: dict = {}

    def indices(self, device: torch.device) -> tuple:
        """``(slots, filled, filled_rows, my slots' rows, which of them
        hold a row)`` on ``device``."""
        key = str(device)
        if key not in self._on:
            mine = self.slots[self._mine_at:self._mine_at + self.per_rank]
            held = mine < self.rows
            self._on[key] = tuple(
                t.to(device) for t in (self.slots, self.filled,
                                       self.filled_rows, mine[held], held))
        return self._on[key]

    def to_rows(self, x: torch.Tensor, scale: float, residual) -> torch.Tensor:
        """``x * scale (+ residual)`` cut into rows (plus the zero row)."""
        rows = torch.empty(
            (self.rows + 1) * self.block, dtype=torch.float32, device=x.device)
        for offset, numel, row in self.pieces:
            at = row * self.block
            into = rows[at:at + numel]
            if residual is not None:
                torch.add(
                    residual[offset:offset + numel],
                    x[offset:offset + numel],
                    alpha=scale,
                    out=into)
            else:
                torch.mul(x[offset:offset + numel], scale, out=into)
            rows[at + numel:at +
                 ceil_div(numel, self.block) * self.block].zero_()
        rows[self.rows * self.block:].zero_()
        return rows.view(-1, self.block)

    def from_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Rows back into a bucket-shaped ``out`` (every parameter)."""
        flat = rows.view(-1)
        for offset, numel, row in self.pieces:
            at = row * self.block
            out[offset:offset + numel].copy_(flat[at:at + numel])


def two_level_reduce(groups: NodeGroups, bucket: dist.GradBucket,
                     plan: TwoLevelPlan,
                     residual: Optional[torch.Tensor]) -> torch.futures.Future:
    """The two-level form's work on one bucket (see the module docstring);
    waits for all but the last all-gather, which it leaves in flight.
    ``residual``: the bucket's error feedback (fp32, the bucket's layout),
    None without."""
    node_size, nodes = groups.layout.ranks_per_node, groups.layout.num_nodes
    buffer = bucket.buffer()
    device, block = buffer.device, plan.block
    x = buffer if buffer.dtype is torch.float32 else buffer.float()

    # 1. Inside the node: every rank's blocks to the rank that sums them.
    rows = plan.to_rows(x, 1.0 / (node_size * nodes), residual)
    if residual is not None:
        residual.zero_()  # now in the node's sums; refilled below
    slots, filled, filled_rows, my_rows, held = plan.indices(device)
    send = rows.index_select(0, slots)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=groups.intra)
    del send
    parts = recv.view(node_size, -1)
    sums = parts[0].clone()
    for i in range(1, node_size):
        sums += parts[i]
    del recv, parts

    # 2. Across nodes: the flat exchange of the sums, its residual in the
    # sums' layout.
    cross = plan.cross
    me = groups.cross_rank
    dropped = torch.zeros_like(sums) if residual is not None else None
    out8 = exchange_and_requantize(cross, sums, 1.0, dropped, me, nodes,
                                   groups.cross, buffer.dtype)
    # The int8 result of this rank's sums from every node, padded for the
    # all-gather inside the node.
    gathered8 = torch.zeros(
        plan.spread_bytes, dtype=torch.uint8, device=device)
    all_gather_single(
        gathered8[:nodes * cross.padded], out8, group=groups.cross)

    if residual is not None:
        # What this rank's roundings dropped, back to the bucket's layout.
        rows.zero_()
        rows.index_copy_(0, my_rows, dropped.view(-1, block)[held])
        plan.from_rows(rows, residual)

    # 3. Inside the node: every rank's int8 result, to all, each decoded
    # with its rank's plan.
    everything = torch.empty(
        node_size * plan.spread_bytes, dtype=torch.uint8, device=device)
    fut = all_gather_single(
        everything, gathered8, group=groups.intra, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        values = torch.empty(
            node_size * plan.per_rank * block,
            dtype=torch.float32,
            device=device)
        at, size = 0, plan.per_rank * block
        for rank, theirs in enumerate(plan.node_plans):
            start = rank * plan.spread_bytes
            int8_codec.dequantize_blocks(
                everything[start:start + nodes * theirs.padded], theirs.gather,
                values[at:at + size])
            at += size
        rows.index_copy_(0, filled_rows, values.view(-1, block)[filled])
        plan.from_rows(rows, buffer)
        return buffer

    return fut.then(decompress)
