"""One record per built-in communication hook: what the rest of the
project needs to know about it, in one place.

Registering a hook in :data:`~mmcv_custom.comm.registry.COMM_HOOKS` makes it
reachable from a config; its :class:`HookRecord` says how it is handled
there: the format it sends (and so which wrappers it refuses), whether it
runs on the communication worker, how its state follows DDP's bucket
layouts into checkpoints, the defaults the project sets for it, the notes
its log line carries and how its wire bytes are counted. A hook without a
record (a user's) is built and run as registered; its traffic is reported
as unknown. Imports only torch (and :mod:`mmcv_custom.hooks`).
"""
import dataclasses
from typing import Any, Callable, Mapping, Optional, Tuple, Type

import torch
import torch.distributed as dist

from ..hooks import int8_codec
from ..hooks.batched_powersgd import batched_powersgd_hook
from ..hooks.half import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ..hooks.int8 import Int8StateKeeper, int8_compress_hook
from ..hooks.powersgd import compression, powersgd_hook
from ..hooks.powersgd_state import BatchedPowerSGDRelayout, PowerSGDRelayout
from ..hooks.state import HookStateKeeper

__all__ = ['HookRecord', 'HOOK_RECORDS', 'record_of', 'powersgd_numel']

#: ``count_wire(hook, state, bucket) -> (future, bytes sent)``.
WireCounter = Callable[[Callable, Any, dist.GradBucket],
                       Tuple[torch.futures.Future, int]]


@dataclasses.dataclass(frozen=True)
class HookRecord:
    """What the project knows about one communication hook.

    Attributes:
        wire (str, optional): The format the hook itself sends, ``'fp16'``,
            ``'bf16'`` or ``'int8'``; None when it sends the bucket's dtype
            (or low-rank factors in it). A hook with a wire format refuses
            a wrapper, which would round twice.
        quantizes (bool): Whether that format is below half precision (the
            refusal's wording differs).
        worker_waits (bool, optional): None: the hook runs where DDP calls
            it. Otherwise it waits for its own collectives, so for CPU
            buckets its whole chain runs on the communication worker
            (:mod:`mmcv_custom.hooks.worker`), and this says whether the
            worker waits for a bucket's future before the next bucket (its
            callbacks issue collectives) or may go on (every collective
            issued when the hook returns).
        powersgd_state (bool): Whether it runs on PyTorch's
            ``PowerSGDState`` (and keeps its compression counters).
        state_keeper (type, optional): The
            :class:`~mmcv_custom.hooks.state.HookStateKeeper` that keeps its
            state per parameter across DDP's bucket layouts and
            checkpoints; None for a stateless hook.
        defaults (Mapping): State keys the project sets when a config
            leaves them out, per wrapper (None: no wrapper).
        notes (Callable, optional): ``notes(state_kwargs, device) ->
            tuple[str]``: what its log line should add for these settings.
        count_wire (Callable, optional): Runs the hook and says how many
            bytes it put on the wire (see
            :class:`~mmcv_custom.comm.telemetry.CommCounter`); None: unknown.
        model_bytes (Callable, optional): ``model_bytes(params,
            state_kwargs, half) -> int``: the bytes it sends per step for
            these parameters, for a hook whose traffic does not depend on
            DDP's buckets (``half``: a half-precision wrapper or hook);
            None where it does.
        sharded (str, optional): Its form under FSDP2: ``'reduce_scatter'``
            (a reduce-scatter in :attr:`wire`'s dtype) or ``'int8'``; None:
            it has none.
    """
    wire: Optional[str] = None
    quantizes: bool = False
    worker_waits: Optional[bool] = None
    powersgd_state: bool = False
    state_keeper: Optional[Type[HookStateKeeper]] = None
    defaults: Mapping[Optional[str], Mapping[str, Any]] = \
        dataclasses.field(default_factory=dict)
    notes: Optional[Callable[[dict, Optional[torch.device]], tuple]] = None
    count_wire: Optional[WireCounter] = None
    model_bytes: Optional[Callable[[Any, dict, bool], int]] = None
    sharded: Optional[str] = None

    @property
    def half_precision(self) -> Optional[str]:
        """``'fp16'`` or ``'bf16'`` for a hook that reduces in it."""
        return self.wire if self.wire in ('fp16', 'bf16') else None

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype of :attr:`half_precision` (None: the gradients')."""
        return _HALF_DTYPES.get(self.half_precision)


_HALF_DTYPES = {'fp16': torch.float16, 'bf16': torch.bfloat16}


def _sends_bucket(element_bytes: Optional[int] = None) -> WireCounter:
    """The bucket goes out whole, ``element_bytes`` an element (None: in
    its own dtype)."""

    def count(hook, state, bucket):
        buffer = bucket.buffer()
        sent = buffer.numel() * (element_bytes or buffer.element_size())
        return hook(state, bucket), sent

    return count


def _int8_wire(hook, state, bucket):
    sent = state.wire_bytes(bucket)
    return hook(state, bucket), sent


def _powersgd_wire(hook, state, bucket):
    # Both PowerSGD hooks all-reduce the bucket as is while iter <
    # start_powerSGD_iter, and leave the state's counters alone.
    buffer = bucket.buffer()
    compressing = state.iter >= state.start_powerSGD_iter
    before = state.total_numel_after_compression
    fut = hook(state, bucket)
    # Compressing, both add up what they send, in the bucket's dtype: P and
    # Q ((n + m) * r numbers for an n x m matrix at rank r) plus the numel
    # of every tensor left uncompressed (all-reduced as is). That may be 0.
    if compressing:
        sent = ((state.total_numel_after_compression - before) *
                buffer.element_size())
    else:
        sent = buffer.numel() * buffer.element_size()
    return fut, sent


def _whole_bytes(params, state_kwargs: dict, half: bool) -> int:
    # Half precision halves fp32 gradients; bf16 ones go as they are.
    return sum(p.numel() *
               (min(p.element_size(), 2) if half else p.element_size())
               for p in params)


def powersgd_numel(params, rank: int, min_rate: float) -> int:
    """Numbers PowerSGD sends for ``params`` (PyTorch's compression rule:
    the factors of every matrix it compresses, the rest as it is)."""
    total = 0
    for p in params:
        compress, before, after = compression(p.shape, rank, min_rate)
        total += after if compress else before
    return total


def _powersgd_bytes(params, state_kwargs: dict, half: bool) -> int:
    numel = powersgd_numel(params,
                           state_kwargs.get('matrix_approximation_rank', 1),
                           state_kwargs.get('min_compression_rate', 2))
    return numel * (2 if half else 4)


def _slow_int8_blocks(state_kwargs: dict,
                      device: Optional[torch.device]) -> tuple:
    """A note when ``block_size`` keeps int8 off the one-pass C kernels on
    CPU: it trains, but each step quantizes some 25x slower."""
    block = state_kwargs.get('block_size', 256)
    on_cpu = device is None or torch.device(device).type == 'cpu'
    if (not on_cpu or not int8_codec.C_MAX_BLOCK
            or block <= int8_codec.C_MAX_BLOCK):
        return ()
    return (f"comm_hook type='int8_compress': block_size={block} is larger "
            "than the C kernels' largest block "
            f'({int8_codec.C_MAX_BLOCK}), so on CPU the quantization runs in '
            "torch's ops, about 25x slower; a block_size <= "
            f'{int8_codec.C_MAX_BLOCK} keeps the one-pass kernels.', )


# PyTorch's PowerSGD default orthogonalization_epsilon=0 divides 0 by 0 when
# a gradient matrix has an all-zero column (a layer whose loss gradient is
# zero for a step), which puts NaN into every parameter of the bucket. A tiny
# epsilon avoids it; fp16 needs one above its smallest subnormal (6e-8), or
# the addition rounds back to zero.
_POWERSGD_DEFAULTS = {
    wrapper: {
        'orthogonalization_epsilon': epsilon
    }
    for wrapper, epsilon in ((None, 1e-8), ('bf16', 1e-8), ('fp16', 1e-6))
}

#: Hook function -> its record, for the built-in hooks.
HOOK_RECORDS = {
    allreduce_hook:
    HookRecord(
        count_wire=_sends_bucket(),
        model_bytes=_whole_bytes,
        sharded='reduce_scatter'),
    fp16_compress_hook:
    HookRecord(
        wire='fp16',
        count_wire=_sends_bucket(2),
        model_bytes=_whole_bytes,
        sharded='reduce_scatter'),
    bf16_compress_hook:
    HookRecord(
        wire='bf16',
        count_wire=_sends_bucket(2),
        model_bytes=_whole_bytes,
        sharded='reduce_scatter'),
    # Both PowerSGD hooks and int8 wait between their collectives (PyTorch's
    # own PowerSGD hook would start collectives from future callbacks,
    # unsafe on gloo with several buckets in flight: pytorch/pytorch#48478);
    # each has issued all of them when it returns.
    powersgd_hook:
    HookRecord(
        worker_waits=False,
        powersgd_state=True,
        state_keeper=PowerSGDRelayout,
        defaults=_POWERSGD_DEFAULTS,
        count_wire=_powersgd_wire,
        model_bytes=_powersgd_bytes),
    batched_powersgd_hook:
    HookRecord(
        worker_waits=False,
        powersgd_state=True,
        state_keeper=BatchedPowerSGDRelayout,
        defaults=_POWERSGD_DEFAULTS,
        count_wire=_powersgd_wire),
    int8_compress_hook:
    HookRecord(
        wire='int8',
        quantizes=True,
        worker_waits=False,
        state_keeper=Int8StateKeeper,
        notes=_slow_int8_blocks,
        count_wire=_int8_wire,
        sharded='int8'),
}

_UNKNOWN = HookRecord()


def record_of(hook: Callable) -> HookRecord:
    """``hook``'s record; an empty one (traffic unknown) for a hook the
    project does not know."""
    return HOOK_RECORDS.get(hook, _UNKNOWN)
