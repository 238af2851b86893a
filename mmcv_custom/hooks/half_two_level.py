"""The two-level (node-aware) form of the half-precision hooks.

Kept apart from :mod:`.half`, which calls it for a ``CompressState`` with
node groups; the groups are :mod:`.topology`'s. Imports only torch.
"""
from typing import Callable

import torch
import torch.distributed as dist

from . import cast
from .util import all_gather_single, ceil_div

__all__ = ['two_level_compress']


def two_level_compress(wire: torch.dtype, state, bucket: dist.GradBucket,
                       before: float, after: float,
                       record_nonfinite: Callable) -> torch.futures.Future:
    """The two-level form of the fp16 and bf16 hooks: the node's sum in
    the bucket's own precision, half precision only across nodes.

    1. An all-to-all inside the node hands each of its G ranks one G-th of
       the bucket from every other (in the bucket's dtype: the fast link),
       summed in fp32, in rank order;
    2. that sum, divided and cast as the flat form casts the bucket, is
       all-reduced in ``wire`` among the ranks of the same place on every
       node: the node's link carries 1/G of the flat form's bytes;
    3. an all-gather inside the node, still in ``wire`` (the values are
       half-precision numbers already), gives every rank the whole sum,
       which it writes back into the bucket as the flat form does.

    Every element is one G-th's, so the result does not depend on how DDP
    cut the buckets. Issues the last all-gather and returns its future.

    ``state`` is the hook's :class:`~.half.CompressState` (its
    ``node_groups``, ``check_finite``), ``before`` and ``after`` its
    divisors for ``wire``, ``record_nonfinite(state, bucket, buffer)``
    what marks a non-finite average.
    """
    groups = state.node_groups
    node_size = groups.layout.ranks_per_node
    buffer = bucket.buffer()
    numel, device = buffer.numel(), buffer.device
    share = ceil_div(numel, node_size)
    if share * node_size == numel:
        send = buffer
    else:
        send = torch.zeros(
            share * node_size, dtype=buffer.dtype, device=device)
        send[:numel].copy_(buffer)
    recv = torch.empty_like(send)
    # Bytes: no reduction happens in this collective.
    dist.all_to_all_single(
        recv.view(torch.uint8), send.view(torch.uint8), group=groups.intra)
    parts = recv.view(node_size, share)
    total = parts[0].float()
    for i in range(1, node_size):
        total += parts[i]
    half = cast.compress(total, before, wire)
    dist.all_reduce(half, group=groups.cross)
    everything = torch.empty(share * node_size, dtype=wire, device=device)
    fut = all_gather_single(
        everything.view(torch.uint8),
        half.view(torch.uint8),
        group=groups.intra,
        async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        if buffer.dtype is wire:
            buffer.copy_(everything[:numel])
            if after != 1:
                buffer.mul_(1.0 / after)
        else:
            cast.decompress(everything[:numel], buffer, after)
        if state.check_finite:
            record_nonfinite(state, bucket, buffer)
        return buffer

    return fut.then(decompress)
