"""Batched PowerSGD: the whole bucket compressed as one square matrix.

PyTorch's ``batched_powerSGD_hook`` (torch 2.13) fails with an
``AssertionError`` at its first compressed step: it hands a 2-d matrix to an
orthogonalization that now expects a batch of matrices. This is the same
algorithm (Vogels et al., 2019, as PyTorch describes it), written for this
project on PyTorch's ``PowerSGDState``, so every state argument of the
config works as for ``powerSGD``.

Per bucket, after ``start_powerSGD_iter`` plain all-reduces:

1. add the previous step's residual (error feedback);
2. view the ``N`` gradients, zero-padded, as a square matrix ``M`` of side
   ``ceil(sqrt(N))``;
3. ``P = M Q`` (``Q`` kept from the last step: warm start), all-reduce and
   orthogonalise ``P``; ``Q = M^T P``, all-reduce and average ``Q``;
4. the bucket becomes ``P Q^T`` and the residual what it missed.

Two all-reduces of ``side * rank`` numbers replace one of ``N``. Compared
with ``powerSGD`` it compresses far more but less accurately, because the
matrix mixes all parameters of the bucket. The two all-reduces run one
after the other, for CPU buckets on :mod:`mmcv_custom.hooks.worker`'s thread
(one bucket after another in DDP's order): every backend (gloo included)
stays in step, and the backward pass goes on while a bucket travels.

The two-level (node-aware) form, where the state's ``node_groups`` is set,
is :func:`_two_level_batched`: each of a node's G ranks takes a 1/G slice
of the bucket, summed over the node, as its square matrix.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD

from .half import group_or_world
from .node_shares import NodeShares, gather_from_owners, split_evenly
from .powersgd import (add_error_feedback, owners_sums, two_level_warm_up,
                       warm_up)
from .worker import run_on_comm_worker

__all__ = ['batched_powersgd_hook']


def _orthonormal_columns(matrix: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of ``matrix`` (rows x rank), in place.

    ``epsilon`` keeps an all-zero column at zero instead of 0/0.
    """
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        col.div_(col.norm() + epsilon)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest.sub_(col.unsqueeze(1) * (col @ rest).unsqueeze(0))


def batched_powersgd_hook(
        state: powerSGD.PowerSGDState,
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress each bucket as one low-rank matrix (batched PowerSGD).

    Args:
        state (PowerSGDState): PyTorch's PowerSGD state (rank, warm-up,
            error feedback, warm start, epsilon, seed), or
            :class:`~.powersgd.PowerSGDState`, whose ``node_groups``
            chooses the two-level form.
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the bucket's own buffer holding the
        averaged low-rank approximation (a plain average during warm-up).
    """
    # Every all-reduce is issued before _batched_powersgd returns (the
    # warm-up's is left in flight).
    if getattr(state, 'node_groups', None) is not None:
        return run_on_comm_worker(
            lambda: _two_level_batched(state, bucket), bucket, wait=False)
    return run_on_comm_worker(
        lambda: _batched_powersgd(state, bucket), bucket, wait=False)


def _batched_powersgd(state: powerSGD.PowerSGDState,
                      bucket: dist.GradBucket) -> torch.futures.Future:
    """The hook's work on one bucket, waiting for its own all-reduces."""
    group = group_or_world(state.process_group)
    world_size = group.size()
    buffer = bucket.buffer()

    if state.iter < state.start_powerSGD_iter:
        return warm_up(state, bucket, group)

    numel = buffer.numel()
    side = math.ceil(math.sqrt(numel))
    rank = min(side, state.matrix_approximation_rank)
    index = bucket.index()
    dtype, device = buffer.dtype, buffer.device

    target = add_error_feedback(state, bucket)

    square = torch.zeros(side * side, dtype=dtype, device=device)
    square[:numel].copy_(buffer)
    square = square.view(side, side)

    fresh = (not state.warm_start or index not in state.q_memory_dict
             or state.q_memory_dict[index].shape != (side, rank))
    if fresh:
        # Same seed on every rank, from the state's generator.
        generator = torch.Generator().manual_seed(
            int(state.rng.randint(1_000_000_000)))
        q = torch.randn(side, rank, generator=generator).to(device, dtype)
        _orthonormal_columns(q, state.orthogonalization_epsilon)
        state.q_memory_dict[index] = q
    q = state.q_memory_dict[index]

    p = square @ q
    dist.all_reduce(p, group=group)
    _orthonormal_columns(p, state.orthogonalization_epsilon)
    torch.matmul(square.t(), p, out=q)
    dist.all_reduce(q, group=group)
    q.div_(world_size)
    state.p_memory_dict[index] = p

    buffer.copy_((p @ q.t()).view(-1)[:numel])
    if target is not None:
        torch.sub(target, buffer, out=state.error_dict[index])

    state.total_numel_before_compression += numel
    state.total_numel_after_compression += 2 * side * rank
    state.maybe_increase_iter(bucket)
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _fresh_q(state: powerSGD.PowerSGDState, side: int, rank: int,
             like: torch.Tensor) -> torch.Tensor:
    """A new orthonormal warm-start ``Q``, the same on every rank that
    draws it at the same point of the state's generator."""
    generator = torch.Generator().manual_seed(
        int(state.rng.randint(1_000_000_000)))
    q = torch.randn(
        side, rank, generator=generator).to(like.device, like.dtype)
    _orthonormal_columns(q, state.orthogonalization_epsilon)
    return q


def _two_level_batched(state: powerSGD.PowerSGDState,
                       bucket: dist.GradBucket) -> torch.futures.Future:
    """The two-level form's work on one bucket; leaves the last step,
    inside the node, in flight.

    Node rank ``l`` owns the bucket's ``l``-th slice of ``ceil(N / G)``
    elements: every rank adds its residual and sends each slice to its
    owner, who sums the node's copies; each owner compresses the node's
    sum of its slice as one square matrix (side about ``side / sqrt(G)``)
    among its peers of the same place on every node, ``P`` and ``Q``
    all-reduced among M ranks, and keeps what the approximation misses as
    its residual (in the bucket's layout, zero elsewhere); every slice then
    goes to every rank of the node. The warm-start ``Q`` is the slice's,
    per bucket as in the flat form.
    """
    groups = state.node_groups
    node_size = groups.layout.ranks_per_node
    world_size = node_size * groups.layout.num_nodes
    buffer = bucket.buffer()
    index = bucket.index()
    shares = NodeShares(
        split_evenly(buffer.numel(), node_size), groups.intra_rank)
    state._shares[index] = shares
    if state.iter < state.start_powerSGD_iter:
        return two_level_warm_up(state, bucket, shares)

    x, error = owners_sums(state, bucket, shares)

    numel = shares.mine
    if numel:
        side = math.ceil(math.sqrt(numel))
        rank = min(side, state.matrix_approximation_rank)
        square = torch.zeros(side * side, dtype=x.dtype, device=x.device)
        square[:numel].copy_(x)
        square = square.view(side, side)
        q = state.q_memory_dict.get(index)
        if (not state.warm_start or q is None or q.shape != (side, rank)):
            q = state.q_memory_dict[index] = _fresh_q(state, side, rank, x)
        p = square @ q
        dist.all_reduce(p, group=groups.cross)
        _orthonormal_columns(p, state.orthogonalization_epsilon)
        torch.matmul(square.t(), p, out=q)
        dist.all_reduce(q, group=groups.cross)
        q.div_(world_size)
        state.p_memory_dict[index] = p
        approx = (p @ q.t()).view(-1)[:numel]
        if error is not None:
            start = shares.pieces[shares.me][0][0]
            # The node's sum (with its residual) less the node's part of
            # the average.
            torch.sub(
                x, approx, alpha=node_size, out=error[start:start + numel])
        x.copy_(approx)
        state.total_numel_before_compression += numel
        state.total_numel_after_compression += 2 * side * rank
    state.maybe_increase_iter(bucket)
    return gather_from_owners(groups, buffer, shares, x)
