"""A DDP communication hook that averages gradients as blockwise int8.

:func:`int8_compress_hook` follows PyTorch's communication-hook contract, so
it registers on any plain :class:`torch.nn.parallel.DistributedDataParallel`::

    >>> from mmcv_custom.int8_hooks import Int8State, int8_compress_hook
    >>> ddp_model.register_comm_hook(Int8State(None), int8_compress_hook)

Nothing here imports MMEngine. The format: the bucket is cut into blocks of
``block_size`` elements, each sent as int8 with one fp32 scale
(``max |x| / 127`` of the block), so an element costs ``1 + 4 / block_size``
bytes on the wire instead of 4 (fp32) or 2 (bf16). The rounding rule, and
the one-pass C kernels that carry it out on CPU bit for bit as torch's ops
do elsewhere, are :mod:`mmcv_custom.int8_codec`'s.

Integers do not add up the way floats do (the ranks' scales differ), so the
reduction cannot be a plain ``all_reduce``. It is a reduce-scatter followed
by an all-gather, the two halves of a ring all-reduce, each in int8:

1. every rank multiplies its bucket by ``1 / world_size`` (before any
   rounding, so the sum cannot overflow and the rounding is of the rank's
   share; exact for power-of-two world sizes, as in the fp16/bf16 hooks),
   pads it to ``world_size`` shards of whole blocks and quantizes it;
2. ``all_to_all_single`` hands shard ``j`` of every rank to rank ``j``;
3. rank ``j`` dequantizes the ``world_size`` copies of its shard, sums them
   in fp32 in rank order and quantizes the sum again;
4. ``all_gather`` gives every rank every re-quantized shard, which each
   dequantizes into the bucket's own buffer, in place.

Each rank sends ``2 * (world_size - 1) / world_size`` times the quantized
bucket, as a ring all-reduce of it would: nearly constant in the number of
ranks. Payload and scales travel together in one byte tensor, so a bucket
costs two collectives.
"""
import numbers
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import int8_codec

__all__ = ['Int8State', 'Int8Relayout', 'int8_compress_hook']

_QMAX = 127
_VERSION = 1

# The torch this project pins (2.13) calls it all_gather_single and warns on
# every call of the older name; older torches only have the older one.
_all_gather_single = (getattr(dist, 'all_gather_single', None)
                      or dist.all_gather_into_tensor)


def _group_or_world(process_group: Optional[dist.ProcessGroup]):
    return process_group if process_group is not None else dist.group.WORLD


def _shard_layout(numel: int, world_size: int,
                  block_size: int) -> Tuple[int, int]:
    """``(shard numel, blocks per shard)`` of a bucket of ``numel``.

    The bucket is padded with zeros to ``world_size`` shards of the same
    whole number of blocks (at least one), so that every block has a single
    owner and the shards are equal, as ``all_to_all_single`` and
    ``all_gather`` want.
    """
    per_rank = -(-numel // world_size)
    blocks = max(1, -(-per_rank // block_size))
    return blocks * block_size, blocks


def _encode_rows(x: torch.Tensor, packed: torch.Tensor, shard: int,
                block: int, prescale: float,
                residual: Optional[torch.Tensor]) -> None:
    """Quantize the flat fp32 ``x`` (``prescale`` times it, plus
    ``residual``) into the rows of ``packed``, one shard per row: payload
    first, then the shard's block scales as bytes. Past the end of ``x``
    (the padding) payload and scales are zero. ``residual`` receives what
    rounding dropped (see :mod:`mmcv_custom.int8_codec`: one fused pass in
    C on CPU)."""
    rows, numel = packed.shape[0], x.numel()
    blocks = (packed.shape[1] - shard) // 4
    scales = torch.zeros(rows, blocks, dtype=torch.float32, device=x.device)
    for row in range(rows):
        start, stop = row * shard, min((row + 1) * shard, numel)
        payload = packed[row, :shard].view(torch.int8)
        if stop <= start:
            payload.zero_()
            continue
        length = stop - start
        int8_codec.quantize(
            x[start:stop], block, prescale,
            None if residual is None else residual[start:stop],
            out=payload[:length],
            scales=scales[row, :int8_codec.num_blocks(length, block)])
        payload[length:].zero_()
    _write_scales(packed, shard, scales)


def _decode_row(packed: torch.Tensor, row: int, shard: int, block: int,
                out: torch.Tensor, accumulate: bool = False) -> None:
    """Dequantize the first ``out.numel()`` values of row ``row`` into the
    fp32 ``out`` (added to it when ``accumulate``)."""
    length = out.numel()
    if length == 0:
        return
    payload = packed[row, :length].view(torch.int8)
    # A copy: the scales sit at any byte offset in the row.
    scales = packed[row, shard:].clone().view(torch.float32)
    int8_codec.dequantize(payload, scales[:int8_codec.num_blocks(
        length, block)], block, out, accumulate)


def _pack(shards: int, shard_numel: int, blocks: int,
          device: torch.device) -> Tuple[torch.Tensor, ...]:
    """A ``(shards, shard_numel + 4 * blocks)`` byte tensor and the int8
    view of its payload columns; the scales go in the remaining bytes
    (:func:`_write_scales`).

    One tensor per collective instead of two halves the collectives (and
    their latency) per bucket; the payload is quantized straight into it,
    so packing copies only the scales.
    """
    packed = torch.empty(shards,
                         shard_numel + 4 * blocks,
                         dtype=torch.uint8,
                         device=device)
    return packed, packed[:, :shard_numel].view(torch.int8)


def _write_scales(packed: torch.Tensor, shard_numel: int,
                  scales: torch.Tensor) -> None:
    packed[:, shard_numel:].copy_(
        scales.view(packed.shape[0], -1).view(torch.uint8))


def _split(layout: tuple, residual: torch.Tensor) -> dict:
    """Parameter id -> its piece of a bucket's residual (views)."""
    if sum(numel for _, numel in layout) != residual.numel():
        return {}  # not laid out parameter after parameter: drop it
    out, offset = {}, 0
    for pid, numel in layout:
        out[pid] = residual[offset:offset + numel]
        offset += numel
    return out


class Int8State:
    """State of :func:`int8_compress_hook`: settings and error feedback.

    Error feedback: what quantization drops from this rank's share of a
    step's gradient is added to its share of the next step's before it is
    quantized, so nothing is lost for good, only delayed: summed over
    steps, the applied gradients plus the ranks' current residuals equal
    the sum of the true mean gradients (up to fp32 rounding).

    Two roundings drop something. The first, of ``g / world_size`` on each
    rank, is that rank's own. The second, of a shard's sum (and, for a
    bf16 bucket, the cast of the result back to bf16), is made by the
    shard's owner alone, and its result is what every rank applies. It is
    fed back too, into the owner's residual for its own shard: next step
    the owner's share carries it into the same sum. That keeps one residual
    per rank and bucket, in the bucket's layout, and makes the identity
    above exact; without it the second rounding (up to half a step of the
    sum's scale, about ``world_size`` times the first's) would be lost
    every step.

    DDP lays its buckets out again after the first iteration (and a
    resumed run lays them out afresh), so residuals are kept by bucket
    index *and* the parameters in it: when a bucket's parameters change,
    every residual is cut into per-parameter pieces and reassembled for
    the new buckets. :meth:`state_dict` saves the same per-parameter form,
    keyed by name.

    Args:
        process_group (ProcessGroup, optional): Group to average over.
            Defaults to None (WORLD).
        block_size (int): Elements per fp32 scale. Smaller blocks follow
            the gradient's magnitude more closely and cost more bytes
            (``4 / block_size`` per element). Defaults to 256.
        error_feedback (bool): Keep what quantization drops and add it to
            the next step's gradient. Costs one fp32 copy of the gradients
            per rank. Defaults to True.

    Raises:
        TypeError: ``block_size`` is not an int (``True`` is not one), or
            ``error_feedback`` is not a bool.
        ValueError: ``block_size`` is below 1.
    """

    def __init__(self,
                 process_group: Optional[dist.ProcessGroup] = None,
                 block_size: int = 256,
                 error_feedback: bool = True) -> None:
        if isinstance(block_size, bool) or not isinstance(
                block_size, numbers.Integral):
            raise TypeError('block_size should be an int >= 1, but got '
                            f'{type(block_size).__name__}: {block_size!r}')
        if block_size < 1:
            raise ValueError(
                f'block_size should be an int >= 1, but got {block_size!r}')
        if not isinstance(error_feedback, bool):
            raise TypeError(
                'error_feedback should be True or False, but got '
                f'{type(error_feedback).__name__}: {error_feedback!r}')
        self.process_group = process_group
        self.block_size = int(block_size)  # numpy's ints count too
        self.error_feedback = error_feedback
        # bucket index -> (((parameter id, numel), ...) in bucket order,
        # fp32 residual of the bucket).
        self._residuals: Dict[int, Tuple[tuple, torch.Tensor]] = {}
        # parameter id -> fp32 residual, while no bucket holds it.
        self._pending: Dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f'Int8State(block_size={self.block_size}, '
                f'error_feedback={self.error_feedback})')

    def wire_bytes(self, numel: int) -> int:
        """Bytes of the quantized form of a bucket of ``numel`` elements.

        The padded int8 payload plus 4 bytes per block scale: what the
        all-to-all scatters and the all-gather gathers back. Each rank
        sends ``(world_size - 1) / world_size`` of it in each phase, as a
        ring all-reduce of a tensor of this size would.
        """
        world_size = _group_or_world(self.process_group).size()
        shard, blocks = _shard_layout(numel, world_size, self.block_size)
        return world_size * (shard + 4 * blocks)

    # -- error feedback across bucket layouts ----------------------------
    def _residual(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's fp32 residual in its current layout (zeros where
        nothing is known yet)."""
        buffer = bucket.buffer()
        layout = tuple((id(p), p.numel()) for p in bucket.parameters())
        kept = self._residuals.get(bucket.index())
        if kept is not None and kept[0] == layout:
            return kept[1]
        ids = {pid for pid, _ in layout}
        if kept is not None or any(pid in ids
                                   for old, _ in self._residuals.values()
                                   for pid, _ in old):
            # DDP laid its buckets out again: every residual goes to
            # per-parameter form once, then each new bucket takes its own.
            self._to_params()
        residual = torch.zeros(buffer.numel(),
                               dtype=torch.float32,
                               device=buffer.device)
        if sum(numel for _, numel in layout) == buffer.numel():
            offset = 0
            for pid, numel in layout:
                saved = self._pending.pop(pid, None)
                if saved is not None:
                    residual[offset:offset + numel].copy_(saved.reshape(-1))
                offset += numel
        self._residuals[bucket.index()] = (layout, residual)
        return residual

    def _to_params(self) -> None:
        """Cut every bucket's residual into per-parameter pieces."""
        for layout, residual in self._residuals.values():
            self._pending.update(_split(layout, residual))
        self._residuals.clear()

    # -- checkpoints -------------------------------------------------------
    def state_dict(self, names: Dict[torch.Tensor, str]) -> dict:
        """This rank's residuals per parameter name, on the CPU.

        Each rank saves its own: the residuals differ between ranks (each
        holds what its own quantization dropped).

        Args:
            names (dict): Parameter -> name, e.g.
                ``{p: n for n, p in ddp.module.named_parameters()}``.
        """
        by_id = {id(p): n for p, n in names.items()}
        per_param = dict(self._pending)
        for layout, residual in self._residuals.values():
            per_param.update(_split(layout, residual))
        return dict(version=_VERSION,
                    world_size=_group_or_world(self.process_group).size(),
                    block_size=self.block_size,
                    error_feedback=self.error_feedback,
                    params={
                        by_id[pid]: r.detach().cpu().clone()
                        for pid, r in per_param.items() if pid in by_id
                    })

    def load_state_dict(self, saved: dict, names: Dict[torch.Tensor,
                                                       str]) -> None:
        """Restore :meth:`state_dict`'s output, before the first step.

        The residuals are laid out for whatever buckets DDP builds. Nothing
        is changed when ``saved`` does not fit.

        Raises:
            ValueError: ``saved`` is not such a dict, was saved with
                another world size (each rank's residual is its share of
                the dropped mass: they do not carry over to another number
                of ranks), holds residuals while ``error_feedback`` is
                off, or names a parameter ``names`` lacks or of another
                size.
        """
        self.check_state_dict(saved, names)
        by_name = {n: p for p, n in names.items()}
        self._residuals.clear()
        self._pending = {
            id(by_name[name]): r.float().reshape(-1)
            for name, r in saved['params'].items()
        }

    def check_state_dict(self, saved, names: Dict[torch.Tensor,
                                                  str]) -> None:
        """Raise ``ValueError`` (see :meth:`load_state_dict`) if ``saved``
        does not fit; change nothing."""
        if not isinstance(saved, dict):
            raise ValueError('expected an Int8State.state_dict(), but got '
                             f'{type(saved).__name__}')
        if saved.get('version') != _VERSION:
            raise ValueError(f'int8 state version {saved.get("version")!r} '
                             f'is not {_VERSION}')
        world_size = _group_or_world(self.process_group).size()
        if saved.get('world_size') != world_size:
            raise ValueError(
                f'the int8 residuals were saved on {saved.get("world_size")!r}'
                f' ranks and cannot be used on {world_size}; start without '
                'them')
        by_name = {n: p for p, n in names.items()}
        params = saved.get('params')
        if not isinstance(params, dict):
            raise ValueError('the saved int8 state holds no per-parameter '
                             'residuals')
        if params and not self.error_feedback:
            raise ValueError('the saved int8 state holds residuals, but '
                             'error_feedback is False here: nothing would '
                             'use them')
        unknown = sorted(set(params) - set(by_name))
        if unknown:
            raise ValueError('the saved int8 residuals have parameters this '
                             f'model does not: {unknown[:5]}')
        for name, residual in params.items():
            if not (isinstance(residual, torch.Tensor)
                    and residual.numel() == by_name[name].numel()):
                raise ValueError(f'the int8 residual of {name} does not fit '
                                 'the parameter')


class Int8Relayout:
    """What the checkpoint machinery of the runner hook needs of a stateful
    hook (``mmcv_custom.engine.hook_state_files``), for :class:`Int8State`,
    as ``PowerSGDRelayout`` is for PowerSGD: the state already follows DDP's
    bucket layouts itself, so this only names its parameters.

    Args:
        state (Int8State): The hook's state.
        names (dict): Parameter -> name of the DDP model.
    """

    #: What a restore brings back, for the log.
    RESTORED = 'error feedback'

    def __init__(self, state: Int8State, names: Dict[torch.Tensor,
                                                     str]) -> None:
        self.state = state
        self.names = names

    def wrap(self, hook):
        return hook

    def state_dict(self) -> dict:
        return self.state.state_dict(self.names)

    def check_state_dict(self, saved) -> None:
        self.state.check_state_dict(saved, self.names)

    def load_state_dict(self, saved: dict) -> None:
        self.state.load_state_dict(saved, self.names)

    def fresh_note(self, steps_done: int) -> str:
        """What :meth:`start_fresh` means for the run, for the log."""
        return 'error feedback from zero'

    def start_fresh(self, steps_done: int) -> None:
        """Forget every residual (the saved ones could not be used)."""
        self.state._residuals.clear()
        self.state._pending = {}


def int8_compress_hook(
        state: Int8State,
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as blockwise int8 (see the module docstring).

    Works for fp32 and bf16 buckets (the buffer keeps its dtype; the math is
    fp32) on gloo and NCCL. Only bytes cross the wire and the sums are
    taken locally, so no backend needs to reduce bf16 (no NCCL >= 2.10
    rule, unlike ``bf16_compress``). The first phase is waited for inside the hook
    and the all-gather is left in flight: a collective started from a
    future's callback would run on gloo's worker threads, where several
    buckets' collectives can be issued in different orders on different
    ranks (see ``registry._CALLBACK_COLLECTIVE_HOOKS``). Only the final
    dequantization runs in the callback.

    Error: each element of the average is off by at most half a first-phase
    step of its block summed over the ranks, plus half the second-phase
    step of its block (``scale / 2`` each); with error feedback the error
    is carried into the next step instead of lost.

    Args:
        state (Int8State): Settings and error feedback; one per DDP model.
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the bucket's own buffer, in its original
        dtype, holding the average.

    Raises:
        TypeError: ``state`` is not an :class:`Int8State` (a process group
            or None has nowhere to keep the error feedback).
    """
    if not isinstance(state, Int8State):
        raise TypeError(
            'int8_compress_hook needs an Int8State, e.g. '
            'ddp.register_comm_hook(Int8State(process_group), '
            f'int8_compress_hook), but got {type(state).__name__}: {state!r}')
    group = _group_or_world(state.process_group)
    world_size, rank = group.size(), group.rank()
    block = state.block_size
    buffer = bucket.buffer()
    numel, device = buffer.numel(), buffer.device
    shard, blocks = _shard_layout(numel, world_size, block)

    # This rank's share (the bucket times 1 / world_size, plus the residual
    # of earlier steps), quantized one shard per row in a single pass.
    x = buffer if buffer.dtype is torch.float32 else buffer.float()
    residual = state._residual(bucket) if state.error_feedback else None
    send, _ = _pack(world_size, shard, blocks, device)
    _encode_rows(x, send, shard, block, 1.0 / world_size, residual)
    if residual is not None:
        # A NaN or inf gradient leaves nothing worth keeping (its step is
        # skipped or the run stops); zeroing it keeps later steps clean.
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)

    # Sum this rank's shard over the ranks, in rank order (deterministic).
    total = torch.empty(shard, dtype=torch.float32, device=device)
    for i in range(world_size):
        _decode_row(recv, i, shard, block, total, accumulate=i > 0)

    out, _ = _pack(1, shard, blocks, device)
    start = rank * shard
    stop = min(start + shard, numel)
    if residual is None:
        _encode_rows(total, out, shard, block, 1.0, None)
    else:
        # The owner feeds back what the second rounding dropped from its
        # shard (see Int8State): for fp32, computed in the same pass; for
        # a bf16 bucket, with what the cast of the result dropped too.
        if buffer.dtype is torch.float32:
            lost = torch.zeros_like(total)
            _encode_rows(total, out, shard, block, 1.0, lost)
        else:
            _encode_rows(total, out, shard, block, 1.0, None)
            applied = torch.empty_like(total)
            _decode_row(out, 0, shard, block, applied)
            lost = total - applied.to(buffer.dtype).float()
        if stop > start:
            residual[start:stop].add_(
                lost[:stop - start].nan_to_num_(0.0, 0.0, 0.0))

    gathered = torch.empty(world_size,
                           out.shape[1],
                           dtype=torch.uint8,
                           device=device)
    fut = _all_gather_single(gathered, out, group=group,
                             async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        # In place into the bucket's own buffer when it is fp32: no second
        # full-size copy at peak memory (pytorch/pytorch#45968).
        target = buffer if buffer.dtype is torch.float32 else torch.empty(
            numel, dtype=torch.float32, device=device)
        for row in range(world_size):
            lo, hi = row * shard, min((row + 1) * shard, numel)
            if hi > lo:
                _decode_row(gathered, row, shard, block, target[lo:hi])
        if target is not buffer:
            buffer.copy_(target)
        return buffer

    return fut.then(decompress)
