"""PowerSGD whose result does not depend on where DDP put each gradient.

The algorithm, the state and every setting are PyTorch's
(``PowerSGDState``; Vogels et al., 2019): per bucket, after
``start_powerSGD_iter`` plain all-reduces, each gradient matrix ``M`` that
compression pays for is replaced by ``P Q^T`` with ``P = M Q`` and
``Q = M^T P`` (``P`` all-reduced and orthonormalised, ``Q`` all-reduced and
averaged), with error feedback and warm start; vectors and small matrices
are all-reduced as they are.

Unlike PyTorch's ``powerSGD_hook``, every product and orthonormalisation
runs on a tensor of its own, aligned as a fresh allocation is, and results
are copied back: the CPU's matrix-vector kernels round by where their
operands start, so the same gradients now give the same bits in any bucket
layout, and a resumed run ends where the uninterrupted one does
(``docs/en/design/hook_state_files.md``).

Errors and warm-start matrices keep PyTorch's per-bucket layout (one flat
residual per bucket; ``Q`` factors grouped by matrix shape in order of
first appearance), so
:class:`~mmcv_custom.hooks.powersgd_state.PowerSGDRelayout` moves and saves
them as before. CPU buckets run on
:mod:`mmcv_custom.hooks.worker`'s thread, one after another in DDP's order.
"""
import math
from collections import defaultdict
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD

from .half import group_or_world
from .worker import run_on_comm_worker

__all__ = ['powersgd_hook', 'compression', 'warm_up', 'add_error_feedback']

# Fresh allocations start at 64 bytes (CPU) or more (CUDA): the largest
# vector width the kernels align to.
_ALIGNMENT = 64


def powersgd_hook(
        state: powerSGD.PowerSGDState,
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress each gradient matrix of ``bucket`` to rank-r factors.

    Args:
        state (PowerSGDState): PyTorch's PowerSGD state (rank, warm-up,
            error feedback, warm start, epsilon, seed, batching).
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the bucket's own buffer holding the
        averaged approximation (a plain average during warm-up).
    """
    return run_on_comm_worker(
        lambda: _powersgd(state, bucket), bucket, wait=False)


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself where it is contiguous and aligned, else a copy.

    Kernels round alike for any two aligned starts; a copy of a contiguous
    tensor gets a fresh, aligned allocation.
    """
    if (tensor.is_contiguous() and tensor.data_ptr() % _ALIGNMENT == 0):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _powersgd(state: powerSGD.PowerSGDState,
              bucket: dist.GradBucket) -> torch.futures.Future:
    """The hook's work on one bucket; every collective has completed or
    (during warm-up) been issued when it returns."""
    group = group_or_world(state.process_group)
    world_size = group.size()
    buffer = bucket.buffer()
    index = bucket.index()
    dtype, device = buffer.dtype, buffer.device

    if state.iter < state.start_powerSGD_iter:
        return warm_up(state, bucket, group)
    target = add_error_feedback(state, bucket)

    matrices, vectors = _split(state, bucket.gradients())

    # Vectors and matrices too small to pay: all-reduced as they are,
    # while the factors are computed.
    flat = (
        torch.cat([t.reshape(-1) for t in vectors])
        if vectors else torch.empty(0, dtype=dtype, device=device))
    flat_work = dist.all_reduce(flat, group=group, async_op=True)

    groups = defaultdict(list)
    for matrix in matrices:
        groups[tuple(matrix.shape)].append(matrix)
    batches = _batches(state, groups.values())
    p_size = sum(len(b) * b[0].shape[0] * _rank(state, b[0]) for b in batches)
    q_size = sum(len(b) * b[0].shape[1] * _rank(state, b[0]) for b in batches)

    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = torch.empty(
            p_size, dtype=dtype, device=device)
        state.q_memory_dict[index] = torch.empty(
            q_size, dtype=dtype, device=device)
    p_memory = state.p_memory_dict[index]
    q_memory = state.q_memory_dict[index]
    ps = _views(p_memory, batches, rows=True, state=state)
    qs = _views(q_memory, batches, rows=False, state=state)
    inputs = [_own(_stack(batch)) for batch in batches]

    if fresh:
        # The same seed on every rank, drawn from the state's generator.
        generator = torch.Generator().manual_seed(
            int(state.rng.randint(1_000_000_000)))
        for q in qs:
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=dtype))
    epsilon = state.orthogonalization_epsilon
    for m, p, q in zip(inputs, ps, qs):
        q_own = _own(q)
        powerSGD._orthogonalize(q_own, epsilon)
        p.copy_(torch.bmm(m, q_own))
    if p_size:
        dist.all_reduce(p_memory, group=group)
    ps_own = []
    for m, p, q in zip(inputs, ps, qs):
        p_own = _own(p)
        powerSGD._orthogonalize(p_own, epsilon)
        ps_own.append(p_own)
        q.copy_(torch.bmm(m.transpose(1, 2), p_own))
    if q_size:
        dist.all_reduce(q_memory, group=group)
        q_memory.div_(world_size)

    for batch, p_own, q in zip(batches, ps_own, qs):
        approx = torch.bmm(p_own, _own(q).transpose(1, 2))
        for matrix, value in zip(batch, approx):
            matrix.copy_(value)
    flat_work.wait()
    flat.div_(world_size)
    for tensor, value in zip(vectors,
                             flat.split([t.numel() for t in vectors])):
        tensor.copy_(value.view_as(tensor))

    if target is not None:
        torch.sub(target, buffer, out=state.error_dict[index])
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def warm_up(state: powerSGD.PowerSGDState, bucket: dist.GradBucket,
            group) -> torch.futures.Future:
    """A step before ``start_powerSGD_iter``: the plain mean, left in
    flight (shared with batched PowerSGD)."""
    state.maybe_increase_iter(bucket)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def add_error_feedback(state: powerSGD.PowerSGDState,
                       bucket: dist.GradBucket) -> Optional[torch.Tensor]:
    """Add the bucket's residual of the last step (zeros the first time);
    returns a copy of what is to be sent, from which the next residual is
    taken, or None without error feedback (shared with batched PowerSGD)."""
    if not state.use_error_feedback:
        return None
    buffer = bucket.buffer()
    error = state.error_dict.get(bucket.index())
    if error is None:
        error = state.error_dict[bucket.index()] = torch.zeros_like(buffer)
    buffer.add_(error)
    return buffer.clone()


def _rank(state: powerSGD.PowerSGDState, matrix: torch.Tensor) -> int:
    n, m = matrix.shape[-2:]
    return min(n, m, state.matrix_approximation_rank)


def compression(shape, rank: int, min_rate: float) -> Tuple[bool, int, int]:
    """PyTorch's rule for a gradient of ``shape``: whether PowerSGD at
    ``rank`` compresses it, and the numbers it holds before and sends after.

    It is seen as an ``n x m`` matrix, ``n`` its first dimension (a 0-d one
    as 1 x 1). The hook, the state's per-parameter layout
    (:mod:`mmcv_custom.hooks.powersgd_state`) and ``model_stats.py``'s
    prediction all decide with this.
    """
    shape = tuple(shape)
    n = shape[0] if shape else 1
    m = math.prod(shape) // max(n, 1)
    return powerSGD._should_compress(n, m, min(n, m, rank), min_rate)


def _split(state: powerSGD.PowerSGDState, tensors: List[torch.Tensor]):
    """Matrices (``n x m`` views of the bucket) that compression pays for,
    and the rest; the state's compression counters as PyTorch keeps them."""
    matrices, vectors = [], []
    for tensor in tensors:
        worth, before, after = compression(tensor.shape,
                                           state.matrix_approximation_rank,
                                           state.min_compression_rate)
        state.total_numel_before_compression += before
        if worth:
            matrices.append(tensor.view(tensor.shape[0], -1))
            state.total_numel_after_compression += after
        else:
            vectors.append(tensor)
            state.total_numel_after_compression += before
    return matrices, vectors


def _batches(state: powerSGD.PowerSGDState, groups) -> List[list]:
    """The matrices compressed together: one batch per shape with
    ``batch_tensors_with_same_shape``, else one each, in PyTorch's order."""
    if state.batch_tensors_with_same_shape:
        return [list(group) for group in groups]
    return [[matrix] for group in groups for matrix in group]


def _stack(batch: List[torch.Tensor]) -> torch.Tensor:
    return batch[0].unsqueeze(0) if len(batch) == 1 else torch.stack(batch)


def _views(memory: torch.Tensor, batches, rows: bool, state) -> list:
    """``P`` (``rows``) or ``Q`` factors of each batch, as views into the
    bucket's flat factor memory (which is what is all-reduced)."""
    views, offset = [], 0
    for batch in batches:
        n, m = batch[0].shape
        rank = _rank(state, batch[0])
        size = (n if rows else m) * rank
        views.append(memory[offset:offset + len(batch) * size].view(
            len(batch), n if rows else m, rank))
        offset += len(batch) * size
    return views
