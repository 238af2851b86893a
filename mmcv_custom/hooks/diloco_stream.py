"""Streaming DiLoCo: the rank's slice synchronised in fragments, at
staggered steps, each exchange overlapped with the next inner steps.

Plain DiLoCo (:class:`~.local_sgd.DiLoCoState`) stops every rank for the
whole synchronisation once a period: on a slow link that one step can take
as long as the period's other steps together. Streaming DiLoCo (Douillard
et al. 2025) splits the synchronised values into ``fragments`` and gives
each its own place in the period, so each synchronisation moves
``1 / fragments`` of the bytes (the same bytes a period), and with
``overlap`` = tau the fragment's exchange across nodes is started after the
optimizer step and waited for tau optimizer steps later: the link works
while the ranks compute. The outer step is then taken with that
pseudo-gradient, and, as the ranks trained on meanwhile, the fragment's
new global values are mixed into the local ones: ``local = mix * local +
(1 - mix) * global`` (``mix`` 0.5, the paper's; without overlap the local
values are replaced, as in plain DiLoCo).

Fragment ``f`` (0-based) synchronises after local step ``start_iter +
offset_f + k * period`` (``k >= 0``), ``offset_f = (f + 1) * period //
fragments``: with one fragment, the plain schedule. The floating-point
buffers are averaged with the last fragment, once a period. Every
fragment of every rank of a node has the same relative place in the
node's slices, so the node gathers each fragment's new values from its
ranks as the plain form gathers the whole slices.

What an exchange still in flight at a checkpoint brings is waited for and
saved with the state (:func:`pending_results`), so a run resumed there
applies the same values at the same step: bit for bit. Torch only.
"""
import math
import time
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from . import int8_codec
from .util import ceil_div

__all__ = [
    'InFlight', 'fragment_offset', 'fragment_span', 'due_fragments',
    'stream_step', 'flush', 'stream_pending', 'pending_results',
    'restore_pending'
]


class InFlight(NamedTuple):
    """A fragment's exchange across nodes, sent and not yet applied.

    Attributes:
        fragment (int): Which fragment.
        apply_at (int): The optimizer step after which it is applied.
        works (list): The collectives' handles (empty once waited).
        received (tuple): What they fill: int8's gathered values and
            scales, or the half/fp32 sum.
        result (Tensor, optional): The nodes' mean pseudo-gradient, once
            waited for (what a checkpoint saves).
    """
    fragment: int
    apply_at: int
    works: list
    received: tuple
    result: Optional[torch.Tensor] = None


def fragment_offset(state, fragment: int) -> int:
    """Local steps into each period at which ``fragment`` synchronises."""
    return (fragment + 1) * state.period // state.fragments


def _nominal(state, fragment: int) -> tuple:
    """``fragment``'s ``(start, length)`` within a node's nominal chunk
    (every rank's slice but the last, which may be short)."""
    chunk = ceil_div(state.numel(), state.ranks_per_node)
    size = ceil_div(chunk, state.fragments)
    lo = min(fragment * size, chunk)
    return lo, min(size, chunk - lo)


def fragment_span(state, fragment: int) -> slice:
    """``fragment``'s values within this rank's slice (relative): one of
    ``fragments`` equal parts of the node's nominal chunk, clipped to the
    rank's slice."""
    lo, length = _nominal(state, fragment)
    mine = state.my_slice()
    have = mine.stop - mine.start
    return slice(min(lo, have), min(lo + length, have))


def _gather_and_write(state, fragment: int, values: torch.Tensor) -> int:
    """Every rank's new values of ``fragment`` gathered inside the node and
    written into the parameters in place; returns the bytes gathered (the
    rule: half what an all-gather gathers)."""
    lo, length = _nominal(state, fragment)
    ranks = state.ranks_per_node
    if ranks == 1:
        state._write_flat(values, state.my_slice().start + lo)
        return 0
    chunk = ceil_div(state.numel(), ranks)
    if values.numel() < length:
        values = torch.cat([values, values.new_zeros(length - values.numel())])
    parts = [torch.empty_like(values) for _ in range(ranks)]
    dist.all_gather(parts, values.contiguous(), group=state.groups.intra)
    for r, got in enumerate(parts):
        start = r * chunk + lo
        valid = min(length, state.numel() - start)
        if valid > 0:
            state._write_flat(got[:valid], start)
    return ranks * length * 4 // 2


def _local(state, span: slice) -> torch.Tensor:
    """The parameters' values of ``span`` of this rank's slice, flat, in
    fp32 (a copy of that fragment only: a 6B model's whole slice is
    gigabytes)."""
    base = state.my_slice().start
    return state._flat_range(base + span.start, base + span.stop)


def due_fragments(state) -> List[int]:
    """The fragments whose place in the period the step just counted is."""
    done = state.steps - state.start_iter
    out = []
    for f in range(state.fragments):
        at = done - fragment_offset(state, f)
        if at >= 0 and at % state.period == 0:
            out.append(f)
    return out


def stream_pending(state) -> int:
    """Local steps since the fragment synchronised longest ago (at least
    1 while an exchange is in flight): the last iteration synchronises
    every fragment where this is above 0."""
    done = state.steps - state.start_iter
    if done <= 0:
        return 0
    oldest = state.steps
    for f in range(state.fragments):
        at = done - fragment_offset(state, f)
        last = (state.start_iter + fragment_offset(state, f) +
                (at // state.period) * state.period) if at >= 0 else 0
        oldest = min(oldest, max(last, state.synced_at, state.start_iter))
    return max(state.steps - oldest, 1 if state.in_flight else 0)


def _send(state, fragment: int) -> tuple:
    """Start ``fragment``'s exchange (its pseudo-gradient, averaged across
    nodes in the outer format); ``(InFlight, bytes sent)``."""
    span = fragment_span(state, fragment)
    delta = state.global_params[span] - _local(state, span)
    nodes, group = state.num_nodes, state.groups.cross
    apply_at = state.steps + state.overlap
    if nodes == 1 or delta.numel() == 0:
        return InFlight(fragment, apply_at, [], (delta, ), delta), 0
    if state.outer_format in ('fp32', 'bf16'):
        dtype = torch.float32 if state.outer_format == 'fp32' else \
            torch.bfloat16
        sent = delta.div(nodes).to(dtype)
        work = dist.all_reduce(sent, group=group, async_op=True)
        return (InFlight(fragment, apply_at, [work],
                         (sent, )), sent.numel() * sent.element_size())
    block = state.block_size
    residual = None if state.residual is None else state.residual[span]
    # The residual's fragment is a view: quantize updates it in place.
    q, scales = int8_codec.quantize(delta.contiguous(), block, 1.0 / nodes,
                                    residual)
    qs = [torch.empty_like(q) for _ in range(nodes)]
    ss = [torch.empty_like(scales) for _ in range(nodes)]
    works = [
        dist.all_gather(qs, q, group=group, async_op=True),
        dist.all_gather(ss, scales, group=group, async_op=True)
    ]
    sent = q.numel() + scales.numel() * 4
    return (InFlight(fragment, apply_at, works,
                     (qs, ss)), int(math.ceil(nodes * sent / 2)))


def _result(state, flight: InFlight) -> torch.Tensor:
    """The nodes' mean pseudo-gradient of ``flight`` (waits for it)."""
    if flight.result is not None:
        return flight.result
    for work in flight.works:
        work.wait()
    if len(flight.received) == 1:
        return flight.received[0].float()
    qs, ss = flight.received
    out = torch.zeros(qs[0].numel(), dtype=torch.float32, device=qs[0].device)
    for q_i, s_i in zip(qs, ss):
        int8_codec.dequantize(
            q_i, s_i, state.block_size, out=out, accumulate=True)
    return out


def _apply(state, flight: InFlight, mix: float) -> int:
    """The outer step on ``flight``'s fragment and its new values written
    into the parameters (mixed with the local ones by ``mix``); returns
    the bytes gathered inside the node."""
    span = fragment_span(state, flight.fragment)
    delta = _result(state, flight)
    momentum = state.momentum[span]
    momentum.mul_(state.outer_momentum).add_(delta)
    step = (
        delta.add(momentum, alpha=state.outer_momentum)
        if state.nesterov else momentum)
    state.global_params[span] -= state.outer_lr * step
    new = state.global_params[span]
    if mix:
        new = _local(state, span).mul_(mix).add_(new, alpha=1 - mix)
    return _gather_and_write(state, flight.fragment, new)


def stream_step(state):
    """After the optimizer step just counted: apply the exchanges due now,
    then start the fragments whose place this is (applied at once without
    overlap). Collective on those steps; ``(cross, intra, seconds)`` or
    None when nothing happened."""
    began = time.perf_counter()
    cross = intra = 0
    done_any = False
    for flight in [f for f in state.in_flight if f.apply_at <= state.steps]:
        state.in_flight.remove(flight)
        intra += _apply(state, flight, state.mix)
        done_any = True
    due = due_fragments(state)
    if due and state.global_params is None:
        state.start()
    for fragment in due:
        flight, sent = _send(state, fragment)
        cross += sent
        if state.overlap == 0:
            intra += _apply(state, flight, 0.0)
        else:
            state.in_flight.append(flight)
        done_any = True
    if state.fragments - 1 in due:
        sent = state._average_buffers(None)
        if state.num_nodes > 1:
            cross += sent
        else:
            intra += sent
    if not done_any:
        return None
    return cross, intra, time.perf_counter() - began


def flush(state) -> tuple:
    """Apply every exchange in flight now (the run's last step, before its
    synchronisation of every fragment); ``(intra bytes, seconds)``."""
    began = time.perf_counter()
    intra = 0
    while state.in_flight:
        intra += _apply(state, state.in_flight.pop(0), state.mix)
    return intra, time.perf_counter() - began


def pending_results(state) -> list:
    """The exchanges in flight, waited for, as a checkpoint saves them:
    ``[{'fragment', 'apply_at', 'result'}]`` (the mean pseudo-gradient on
    the CPU)."""
    out = []
    for i, flight in enumerate(state.in_flight):
        result = _result(state, flight)
        state.in_flight[i] = flight._replace(works=[], result=result)
        out.append(
            dict(
                fragment=flight.fragment,
                apply_at=flight.apply_at,
                result=result.detach().to('cpu', copy=True)))
    return out


def restore_pending(state, saved: list, device) -> None:
    """The exchanges :func:`pending_results` saved, in flight again, with
    their results (applied at their steps as the saving run would)."""
    state.in_flight = [
        InFlight(p['fragment'], p['apply_at'], [], (), p['result'].to(device))
        for p in saved
    ]
