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
:class:`~mmcv_custom.hooks.powersgd_state.PowerSGDStateKeeper` moves and saves
them as before. CPU buckets run on
:mod:`mmcv_custom.hooks.worker`'s thread, one after another in DDP's order.

The two-level (node-aware) form, where the state's ``node_groups`` is set
(:class:`PowerSGDState`; the builder sets it from ``topology``), is
:func:`_two_level`.
"""
import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD

from .half import group_or_world
from .node_shares import NodeShares, gather_from_owners, reduce_to_owners
from .topology import NodeGroups
from .worker import run_on_comm_worker

__all__ = [
    'PowerSGDState', 'powersgd_hook', 'compression', 'factor_layout',
    'warm_up', 'two_level_warm_up', 'add_error_feedback', 'owners_sums'
]

# Fresh allocations start at 64 bytes (CPU) or more (CUDA): the largest
# vector width the kernels align to.
_ALIGNMENT = 64


class PowerSGDState(powerSGD.PowerSGDState):
    """PyTorch's ``PowerSGDState``, with room for the node groups of the
    two-level form (PyTorch's class has ``__slots__``, so nothing can be
    added to it).

    Takes PyTorch's arguments unchanged; both PowerSGD hooks also take
    PyTorch's own class, for the flat form.

    Attributes:
        node_groups (NodeGroups, optional): Compress in two levels over
            these groups (set by the builder from ``topology``). None: the
            flat form.
    """

    node_groups: Optional[NodeGroups] = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.node_groups = None
        # The two-level form's bookkeeping: parameter id -> node rank that
        # compresses it, each node rank's elements so far, and bucket index
        # -> (its parameters, its _TwoLevelPlan).
        self._owners: Dict[int, int] = {}
        self._loads: List[int] = []
        self._plans: Dict[int, tuple] = {}
        # Bucket index -> the NodeShares of its last step.
        self._shares: Dict[int, NodeShares] = {}
        # Bucket index -> (its Q memory, offsets of the usable slots).
        self._usable: Dict[int, tuple] = {}

    def node_share(self, bucket: dist.GradBucket) -> int:
        """Elements of ``bucket`` this rank reduced across nodes in its
        last two-level step (its share of the node's sums), for the byte
        count of a warm-up step."""
        return self._shares[bucket.index()].mine


def powersgd_hook(
        state: powerSGD.PowerSGDState,
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress each gradient matrix of ``bucket`` to rank-r factors.

    Args:
        state (PowerSGDState): PyTorch's PowerSGD state (rank, warm-up,
            error feedback, warm start, epsilon, seed, batching), or this
            module's, whose ``node_groups`` chooses the two-level form.
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the bucket's own buffer holding the
        averaged approximation (a plain average during warm-up).
    """
    if getattr(state, 'node_groups', None) is not None:
        return run_on_comm_worker(
            lambda: _two_level(state, bucket), bucket, wait=False)
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


def _power_step(state: powerSGD.PowerSGDState, inputs: List[torch.Tensor],
                ps: List[torch.Tensor], qs: List[torch.Tensor],
                p_buf: torch.Tensor, q_buf: torch.Tensor,
                group: dist.ProcessGroup,
                world_size: int) -> List[torch.Tensor]:
    """PyTorch's power iteration on each batch of matrices ``inputs``
    (``ps``, ``qs``: the batches' P and Q, views into ``p_buf`` and
    ``q_buf``): Q orthogonalized, ``P = M Q`` summed over ``group`` and
    orthogonalized, ``Q = M^T P`` summed and divided by ``world_size``.
    Returns the orthogonal P of each batch (aligned: see :func:`_own`)."""
    epsilon = state.orthogonalization_epsilon
    for m, p, q in zip(inputs, ps, qs):
        q_own = _own(q)
        powerSGD._orthogonalize(q_own, epsilon)
        p.copy_(torch.bmm(m, q_own))
    if ps:  # Each batch has a P and a Q of at least one value.
        dist.all_reduce(p_buf, group=group)
    ps_own = []
    for m, p, q in zip(inputs, ps, qs):
        p_own = _own(p)
        powerSGD._orthogonalize(p_own, epsilon)
        ps_own.append(p_own)
        q.copy_(torch.bmm(m.transpose(1, 2), p_own))
    if qs:
        dist.all_reduce(q_buf, group=group)
        q_buf.div_(world_size)
    return ps_own


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
    ps_own = _power_step(state, inputs, ps, qs, p_memory, q_memory, group,
                         world_size)

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


def factor_layout(shapes: Sequence, rank: int, min_rate: float):
    """Where the warm-start ``Q`` of each tensor of a bucket sits in the
    bucket's flat ``Q`` memory, as the flat form lays it out: compressed
    tensors only, grouped by matrix shape in order of first appearance.

    Returns:
        tuple: ``(slots, p_size, q_size)``: ``(offset, numel)`` of each
        tensor's ``Q`` (None where it is not compressed), and the sizes of
        the bucket's ``P`` and ``Q`` memories.
    """
    groups: Dict[tuple, list] = {}
    p_size = 0
    for i, shape in enumerate(shapes):
        if compression(shape, rank, min_rate)[0]:
            n = shape[0]
            m = math.prod(shape) // n
            r = min(n, m, rank)
            groups.setdefault((n, m), []).append((i, m * r))
            p_size += n * r
    slots: List[Optional[Tuple[int, int]]] = [None] * len(shapes)
    offset = 0
    for members in groups.values():
        for i, numel in members:
            slots[i] = (offset, numel)
            offset += numel
    return slots, p_size, offset


# -- the two-level form -------------------------------------------------------
class _TwoLevelPlan:
    """One bucket layout through the two levels, on one rank.

    Attributes:
        shares (NodeShares): Each node rank's tensors of the bucket.
        mine (list[tuple]): This rank's tensors, in bucket order:
            ``(offset in the bucket, offset in its packed sums, shape, Q
            slot or None)``.
        p_size, q_size (int): The bucket's ``P`` and ``Q`` memories, laid
            out as the flat form's (:func:`factor_layout`), so that
            :class:`~.powersgd_state.PowerSGDStateKeeper` moves and saves them
            unchanged; a rank uses the slots of its own tensors only.
    """

    def __init__(self, state: 'PowerSGDState', bucket: dist.GradBucket,
                 node_size: int, me: int) -> None:
        buffer = bucket.buffer()
        base, size = buffer.data_ptr(), buffer.element_size()
        grads = bucket.gradients()
        slots, self.p_size, self.q_size = factor_layout(
            [g.shape for g in grads], state.matrix_approximation_rank,
            state.min_compression_rate)
        pieces = [[] for _ in range(node_size)]
        self.mine = []
        packed = 0
        for param, grad, slot in zip(bucket.parameters(), grads, slots):
            offset = (grad.data_ptr() - base) // size
            owner = _owner(state, param, node_size)
            pieces[owner].append((offset, grad.numel()))
            if owner == me:
                self.mine.append((offset, packed, tuple(grad.shape), slot))
                packed += grad.numel()
        self.shares = NodeShares(pieces, me)


def _owner(state: 'PowerSGDState', param: torch.Tensor, node_size: int) -> int:
    """The node rank that compresses ``param``: on first sight, the one
    with the fewest elements so far (the lowest on a tie).

    Decided once per parameter, in the order DDP first hands them over
    (the same on every rank, and in every run of the model: DDP's first
    layout follows the parameters' order), never by bucket: where DDP puts
    a parameter later changes no owner, so the warm start stays on the
    rank that uses it and no result depends on the layout. The price is
    that one bucket's tensors may fall unevenly on the node's ranks (a
    bucket holding one large matrix is compressed by one of them); over
    the model the work is even.
    """
    owner = state._owners.get(id(param))
    if owner is None:
        if len(state._loads) != node_size:
            state._loads = [0] * node_size
        owner = min(range(node_size), key=lambda r: (state._loads[r], r))
        state._owners[id(param)] = owner
        state._loads[owner] += param.numel()
    return owner


def _two_level_plan(state: 'PowerSGDState',
                    bucket: dist.GradBucket) -> _TwoLevelPlan:
    groups = state.node_groups
    ids = tuple(id(p) for p in bucket.parameters())
    kept = state._plans.get(bucket.index())
    if kept is None or kept[0] != ids:
        kept = state._plans[bucket.index()] = (
            ids,
            _TwoLevelPlan(state, bucket, groups.layout.ranks_per_node,
                          groups.intra_rank))
    return kept[1]


def owners_sums(
        state: powerSGD.PowerSGDState, bucket: dist.GradBucket,
        shares: NodeShares) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The two-level forms' first step (shared by both PowerSGD hooks): the
    bucket plus its residual, summed over the node into this rank's pieces,
    in the bucket's dtype; and the residual, now zero (it is in the
    owners' sums; each owner refills its own), or None without error
    feedback."""
    buffer = bucket.buffer()
    error = None
    if state.use_error_feedback:
        error = state.error_dict.get(bucket.index())
        if error is None:
            error = state.error_dict[bucket.index()] = torch.zeros_like(buffer)
        buffer.add_(error)
    sums = reduce_to_owners(state.node_groups, buffer, shares)
    x = sums if buffer.dtype is torch.float32 else sums.to(buffer.dtype)
    if error is not None:
        error.zero_()
    return x, error


def two_level_warm_up(state: powerSGD.PowerSGDState, bucket: dist.GradBucket,
                      shares: NodeShares) -> torch.futures.Future:
    """A step before ``start_powerSGD_iter`` in the two-level form: the
    node's sum of each rank's share, its all-reduce among the rank's peers
    on the other nodes, the shares spread inside the node again (shared
    with batched PowerSGD). No sum's order depends on where a value sits
    in the bucket on 2 nodes, so neither does the mean."""
    groups = state.node_groups
    world_size = groups.layout.ranks_per_node * groups.layout.num_nodes
    state.maybe_increase_iter(bucket)
    buffer = bucket.buffer()
    mine = reduce_to_owners(groups, buffer, shares).div_(world_size)
    mine = mine.to(buffer.dtype)
    if mine.numel():
        dist.all_reduce(mine, group=groups.cross)
    return gather_from_owners(groups, buffer, shares, mine)


def _two_level(state: 'PowerSGDState',
               bucket: dist.GradBucket) -> torch.futures.Future:
    """The two-level form's work on one bucket; issues every collective
    and leaves the last step, inside the node, in flight.

    1. Every rank adds its residual to its bucket and sends each tensor to
       its owner (:func:`_owner`) inside the node, which sums the node's
       copies (:func:`~.node_shares.reduce_to_owners`);
    2. each rank compresses its tensors' node sums among its peers of the
       same place on every node (:func:`_compress_owned`);
    3. the owners' results go to every rank of the node
       (:func:`~.node_shares.gather_from_owners`).

    So each rank compresses about 1/G of the bucket and its factors cross
    nodes among M ranks, not M x G.
    """
    plan = _two_level_plan(state, bucket)
    state._shares[bucket.index()] = plan.shares
    if state.iter < state.start_powerSGD_iter:
        return two_level_warm_up(state, bucket, plan.shares)
    index = bucket.index()
    x, error = owners_sums(state, bucket, plan.shares)
    _compress_owned(state, plan, index, x, error)
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return gather_from_owners(state.node_groups, bucket.buffer(), plan.shares,
                              x)


def _warm_starts(state: 'PowerSGDState', plan: _TwoLevelPlan, index: int,
                 slots: List[Tuple[int, int]],
                 like: torch.Tensor) -> Tuple[torch.Tensor, set]:
    """The bucket's ``Q`` memory, and the offsets of the slots of this
    rank's matrices (``slots``) that hold a warm start it can use (the
    caller adds those it fills).

    The slot of a matrix this rank does not compress stays zero (another
    node rank's). Restored by the state keeper into a run where this rank
    does compress it (nodes of another size, a new parameter order), it
    must be drawn afresh, or ``P = M Q`` would stay zero for good. So each
    time the memory is new (a new layout, a restore) the rank's slots are
    looked at, once; the steps in between trust what the rank wrote.
    """
    memory = state.q_memory_dict.get(index)
    if (not state.warm_start or index not in state.p_memory_dict
            or memory is None or memory.numel() != plan.q_size):
        state.p_memory_dict[index] = like.new_empty(plan.p_size)
        memory = state.q_memory_dict[index] = like.new_zeros(plan.q_size)
        usable = set()
    else:
        kept = state._usable.get(index)
        if kept is not None and kept[0] is memory:
            usable = kept[1]
        else:
            held = (
                torch.stack([memory[at:at + n].ne(0).any()
                             for at, n in slots]).tolist() if slots else [])
            usable = {at for (at, _), ok in zip(slots, held) if ok}
    state._usable[index] = (memory, usable)
    return memory, usable


def _compress_owned(state: 'PowerSGDState', plan: _TwoLevelPlan, index: int,
                    x: torch.Tensor, error: Optional[torch.Tensor]) -> None:
    """PowerSGD on this rank's tensors (their node sums, packed in ``x``)
    among its peers of the same place on every node, in place.

    PyTorch's compression rule, settings and warm start, as in the flat
    form; ``P`` and ``Q`` all-reduced among the M peers, uncompressed
    tensors all-reduced as they are, everything divided by the world size.
    What a matrix's approximation misses of the node's sum goes into
    ``error`` (the bucket's layout), so that the next node sum carries it.
    """
    groups = state.node_groups
    node_size = groups.layout.ranks_per_node
    world_size = node_size * groups.layout.num_nodes
    dtype, device = x.dtype, x.device

    by_shape, vectors = defaultdict(list), []
    for offset, packed, shape, slot in plan.mine:
        view = x[packed:packed + math.prod(shape)]
        worth, before, after = compression(shape,
                                           state.matrix_approximation_rank,
                                           state.min_compression_rate)
        state.total_numel_before_compression += before
        if worth:
            by_shape[shape].append((view.view(shape[0], -1), offset, slot))
            state.total_numel_after_compression += after
        else:
            vectors.append(view)
            state.total_numel_after_compression += before

    flat = (
        torch.cat([t.reshape(-1) for t in vectors])
        if vectors else torch.empty(0, dtype=dtype, device=device))
    flat_work = (
        dist.all_reduce(flat, group=groups.cross, async_op=True)
        if flat.numel() else None)

    batches = _batches(state, by_shape.values())
    # Each batch's matrices, for _views (which reads the first's shape).
    shaped = [[batch[0][0]] * len(batch) for batch in batches]
    p_buf = torch.empty(
        sum(len(b) * b[0].shape[0] * _rank(state, b[0]) for b in shaped),
        dtype=dtype,
        device=device)
    q_buf = torch.empty(
        sum(len(b) * b[0].shape[1] * _rank(state, b[0]) for b in shaped),
        dtype=dtype,
        device=device)
    ps = _views(p_buf, shaped, rows=True, state=state)
    qs = _views(q_buf, shaped, rows=False, state=state)

    q_memory, usable = _warm_starts(
        state, plan, index,
        [slot for batch in batches for _, _, slot in batch], x)
    for batch, q in zip(batches, qs):
        for i, (_, _, (at, numel)) in enumerate(batch):
            if at not in usable:
                # One draw per matrix, in the order its owner meets them:
                # the same on the owner's peers, in any bucket layout.
                generator = torch.Generator().manual_seed(
                    int(state.rng.randint(1_000_000_000)))
                q[i].copy_(
                    torch.randn(*q[i].shape, generator=generator, dtype=dtype))
            else:
                q[i].copy_(q_memory[at:at + numel].view_as(q[i]))

    inputs = [_own(_stack([m for m, _, _ in batch])) for batch in batches]
    ps_own = _power_step(state, inputs, ps, qs, p_buf, q_buf, groups.cross,
                         world_size)

    for batch, p_own, q in zip(batches, ps_own, qs):
        approx = torch.bmm(p_own, _own(q).transpose(1, 2))
        for i, (matrix, offset, (at, numel)) in enumerate(batch):
            if error is not None:
                # The node's sum (with its residual) less the node's part
                # of the average.
                torch.sub(
                    matrix,
                    approx[i],
                    alpha=node_size,
                    out=error[offset:offset + matrix.numel()].view_as(matrix))
            matrix.copy_(approx[i])
            q_memory[at:at + numel].copy_(q[i].reshape(-1))
            usable.add(at)
    if flat_work is not None:
        flat_work.wait()
        flat.div_(world_size)
        for tensor, value in zip(vectors,
                                 flat.split([t.numel() for t in vectors])):
            tensor.copy_(value)
