"""The node's sum of each rank's share of a bucket, and the shares back:
the first and last steps of the two-level PowerSGD forms.

PowerSGD's two-level forms give each of a node's G ranks whole pieces of a
bucket (whole tensors for ``powerSGD``, a 1/G slice for
``batched_powerSGD``), which that rank alone compresses among its peers on
the other nodes. Before, every rank sends each owner its pieces (an
all-to-all inside the node, in the bucket's dtype: no rounding) and the
owner sums the G copies in fp32, in the node's rank order; after, an
all-gather inside the node hands every rank every owner's result. The sum
of a value does not depend on where it sits in the bucket, so where a
form's pieces follow the parameters, so does every bit of the node's sums.
Imports only torch.
"""
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .topology import NodeGroups
from .util import all_gather_single

__all__ = [
    'NodeShares', 'reduce_to_owners', 'gather_from_owners', 'split_evenly'
]


class NodeShares:
    """Which pieces of one bucket layout each of the node's ranks owns.

    Args:
        pieces (Sequence[Sequence[tuple[int, int]]]): For each node rank
            in order, ``(offset, numel)`` of the pieces of the bucket it
            owns, in the order it packs them.
        me (int): This rank's place in the node.

    Attributes:
        sizes (list[int]): Elements each node rank owns.
        mine (int): Elements this rank owns (``sizes[me]``).
    """

    def __init__(self, pieces: Sequence[Sequence[Tuple[int, int]]],
                 me: int) -> None:
        self.pieces = [list(p) for p in pieces]
        self.sizes = [sum(numel for _, numel in p) for p in self.pieces]
        self.me = me
        self.mine = self.sizes[me]


def reduce_to_owners(groups: NodeGroups, buffer: torch.Tensor,
                     shares: NodeShares) -> torch.Tensor:
    """The node's fp32 sum of this rank's pieces of ``buffer``, packed in
    its order: one all-to-all inside the node (sent as bytes: nothing is
    reduced on the way), then the G copies added in node rank order."""
    node_size = groups.layout.ranks_per_node
    send = torch.cat([
        buffer[offset:offset + numel] for pieces in shares.pieces
        for offset, numel in pieces
    ])
    size = buffer.element_size()
    recv = torch.empty(
        node_size * shares.mine, dtype=buffer.dtype, device=buffer.device)
    dist.all_to_all_single(
        recv.view(torch.uint8),
        send.view(torch.uint8),
        output_split_sizes=[shares.mine * size] * node_size,
        input_split_sizes=[n * size for n in shares.sizes],
        group=groups.intra)
    parts = recv.view(node_size, shares.mine)
    total = parts[0].float()
    for i in range(1, node_size):
        total += parts[i]
    return total


def gather_from_owners(groups: NodeGroups, buffer: torch.Tensor,
                       shares: NodeShares,
                       mine: torch.Tensor) -> torch.futures.Future:
    """Every owner's ``mine`` (its pieces' results, packed, in the bucket's
    dtype) to every rank of the node and into ``buffer``, left in flight;
    the future resolves to ``buffer``.

    One all-gather where every owner holds as much; otherwise one
    broadcast from each owner, in node rank order: gloo gathers only equal
    parts, and padding every part to the largest (a bucket of one large
    matrix has one owner) would multiply the bytes. Either way the node's
    links carry ``(G - 1) n`` bytes for a bucket of ``n``.
    """
    node_size = groups.layout.ranks_per_node
    device, dtype = buffer.device, buffer.dtype
    futures = []
    if len(set(shares.sizes)) == 1:
        parts = torch.empty(
            node_size * shares.mine, dtype=dtype, device=device)
        fut = all_gather_single(
            parts.view(torch.uint8),
            mine.view(torch.uint8),
            group=groups.intra,
            async_op=True).get_future()
        parts = list(parts.split(shares.mine))
    else:
        parts = []
        for owner, size in enumerate(shares.sizes):
            part = (
                mine if owner == shares.me else torch.empty(
                    size, dtype=dtype, device=device))
            parts.append(part)
            if size:
                futures.append(
                    dist.broadcast(
                        part,
                        dist.get_global_rank(groups.intra, owner),
                        group=groups.intra,
                        async_op=True).get_future())
        fut = torch.futures.collect_all(futures)

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        # Raise what a collective raised (collect_all only gathers them).
        fut.value()
        for done in futures:
            done.value()
        for part, pieces in zip(parts, shares.pieces):
            at = 0
            for offset, numel in pieces:
                buffer[offset:offset + numel].copy_(part[at:at + numel])
                at += numel
        return buffer

    return fut.then(unpack)


def split_evenly(numel: int, node_size: int) -> List[List[Tuple[int, int]]]:
    """``numel`` elements in ``node_size`` slices of ``ceil(numel / G)``
    (the last ones shorter, or empty)."""
    share = -(-numel // node_size)
    if share == 0:
        return [[(0, 0)] for _ in range(node_size)]
    return [[(start, max(0, min(share, numel - start)))]
            for start in range(0, share * node_size, share)]
