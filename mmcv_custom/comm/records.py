"""One record per built-in communication hook: what the rest of the
project needs to know about it, in one place.

Registering a hook in :data:`~mmcv_custom.comm.registry.COMM_HOOKS` makes it
reachable from a config; its :class:`HookRecord` says how it is handled
there: the format it sends (and so which wrappers it refuses), whether it
runs on the communication worker, how its state follows DDP's bucket
layouts into checkpoints, the defaults the project sets for it, the notes
its log line carries and how its wire bytes are counted. A hook without a
record (a user's) is built and run as registered; its traffic is reported
as unknown. What the cost model projects from (:attr:`HookRecord.cost`)
is in :mod:`.cost_records`; which collectives count as sent, in
:mod:`.traffic`. Imports only torch (and the hooks' own modules).
"""
import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple, Type

import torch
import torch.distributed as dist

from .. import ddp_hooks, int8_codec
from ..batched_powersgd import batched_powersgd_hook
from ..ddp_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ..hook_state import HookStateKeeper
from ..int8_hooks import Int8BucketPlan, Int8StateKeeper, int8_compress_hook
from ..powersgd import compression, powersgd_hook
from ..powersgd_state import BatchedPowerSGDRelayout, PowerSGDRelayout
from .cost_records import (ALLREDUCE_COST, BATCHED_POWERSGD_COST,
                           HALF_PRECISION_COSTS, INT8_COST, POWERSGD_COST,
                           CostRecord)
from .traffic import sent_bytes

__all__ = [
    'HookRecord', 'HOOK_RECORDS', 'record_of', 'powersgd_numel', 'HookVariant'
]

#: ``count_wire(hook, state, bucket) -> (future, bytes sent)``.
WireCounter = Callable[[Callable, Any, dist.GradBucket],
                       Tuple[torch.futures.Future, int]]

#: ``codec(bucket, world_size, rank) -> run``, see :attr:`HookRecord.codec`.
Codec = Callable[[torch.Tensor, int, int], Callable[[], Any]]


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
            (:mod:`mmcv_custom.comm_worker`), and this says whether the
            worker waits for a bucket's future before the next bucket (its
            callbacks issue collectives) or may go on (every collective
            issued when the hook returns).
        powersgd_state (bool): Whether it runs on PyTorch's
            ``PowerSGDState`` (and keeps its compression counters).
        state_keeper (type, optional): The
            :class:`~mmcv_custom.hook_state.HookStateKeeper` that keeps its
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
            state_kwargs, half, world_size) -> int``: the bytes it sends
            per step for these parameters on ``world_size`` ranks (counted
            by :func:`~.traffic.sent_bytes`), for a hook whose traffic does
            not depend on DDP's buckets (``half``: a half-precision wrapper
            or hook); None where it does.
        sharded (str, optional): Its form under FSDP2: ``'reduce_scatter'``
            (a reduce-scatter in :attr:`wire`'s dtype) or ``'int8'``; None:
            it has none.
        cost (CostRecord, optional): What the cost model
            (:mod:`mmcv_custom.analysis.cost`) projects its step time
            from: its collectives per bucket on a world size, its codec's
            memory traffic and FLOPs, its caveat. None: it is left out of
            projections.
        label (str, optional): Its short name in the analysis tools' tables
            and legends; None: its registry name.
        colour (str, optional): Its colour in their plots (a matplotlib
            colour); None: the tool picks one.
        codec (Callable, optional): ``codec(bucket, world_size, rank) ->
            run``: ``run()`` compresses the fp32 ``bucket`` (one parameter)
            and decompresses it back in place, as the hook does to each
            element it sends (with the buffers its state keeps), so that
            the benchmarks can time its local work alone; None: it has
            none (it sends the bucket as it is, or low-rank factors).
        benchmark_options (Mapping): State keys the benchmarks and the
            convergence comparison run it with, where its defaults would
            not show it at work in a short run.
        variants (tuple[HookVariant]): The settings the convergence
            comparison trains it under, each a variant of its own; empty:
            one, named as registered, with :attr:`label` and
            :attr:`colour`.
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
    model_bytes: Optional[Callable[[Any, dict, bool, int], int]] = None
    sharded: Optional[str] = None
    cost: Optional[CostRecord] = None
    label: Optional[str] = None
    colour: Optional[str] = None
    codec: Optional[Codec] = None
    benchmark_options: Mapping[str, Any] = \
        dataclasses.field(default_factory=dict)
    variants: Tuple['HookVariant', ...] = ()

    @property
    def half_precision(self) -> Optional[str]:
        """``'fp16'`` or ``'bf16'`` for a hook that reduces in it."""
        return self.wire if self.wire in ('fp16', 'bf16') else None

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype of :attr:`half_precision` (None: the gradients')."""
        return _HALF_DTYPES.get(self.half_precision)


_HALF_DTYPES = {'fp16': torch.float16, 'bf16': torch.bfloat16}


class HookVariant(NamedTuple):
    """One setting of a hook that the convergence comparison trains
    (:attr:`HookRecord.variants`): its name there, the state keys it sets,
    its label and its plot colour."""
    name: str
    options: Mapping[str, Any]
    label: str
    colour: Optional[str] = None


def _sends_bucket(element_bytes: Optional[int] = None) -> WireCounter:
    """The bucket goes out whole, ``element_bytes`` an element (None: in
    its own dtype)."""

    def count(hook, state, bucket):
        buffer = bucket.buffer()
        size = buffer.numel() * (element_bytes or buffer.element_size())
        # An all-reduce counts its tensor, whatever the world size.
        return hook(state, bucket), int(sent_bytes([('all_reduce', size)], 1))

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
        size = ((state.total_numel_after_compression - before) *
                buffer.element_size())
    else:
        size = buffer.numel() * buffer.element_size()
    return fut, int(sent_bytes([('all_reduce', size)], 1))


def _whole_bytes(params, state_kwargs: dict, half: bool,
                 world_size: int) -> int:
    # Half precision halves fp32 gradients; bf16 ones go as they are. One
    # all-reduce of them all, whatever the world size.
    return int(
        sent_bytes(
            [('all_reduce',
              sum(p.numel() *
                  (min(p.element_size(), 2) if half else p.element_size())
                  for p in params))], world_size))


def powersgd_numel(params, rank: int, min_rate: float) -> int:
    """Numbers PowerSGD sends for ``params`` (PyTorch's compression rule:
    the factors of every matrix it compresses, the rest as it is)."""
    total = 0
    for p in params:
        compress, before, after = compression(p.shape, rank, min_rate)
        total += after if compress else before
    return total


def _powersgd_bytes(params, state_kwargs: dict, half: bool,
                    world_size: int) -> int:
    numel = powersgd_numel(params,
                           state_kwargs.get('matrix_approximation_rank', 1),
                           state_kwargs.get('min_compression_rate', 2))
    # All-reduced, in whatever buckets: the world size changes nothing.
    return int(
        sent_bytes([('all_reduce', numel * (2 if half else 4))], world_size))


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


def _half_codec(dtype: torch.dtype) -> Callable:
    """The fp16 or bf16 hook's codec: the bucket divided by the world size
    and cast into the send buffer its state keeps, then cast back in
    place."""

    def codec(bucket: torch.Tensor, world_size: int, rank: int) -> Callable:
        half = torch.empty(bucket.numel(), dtype=dtype, device=bucket.device)

        def run():
            sent = ddp_hooks._compress(bucket, world_size, dtype, out=half)
            ddp_hooks._decompress(sent, bucket)

        return run

    return codec


def _int8_codec(bucket: torch.Tensor,
                world_size: int,
                rank: int,
                block_size: int = 256) -> Callable:
    """The int8 hook's codec with its state's defaults (blocks of 256,
    error feedback): quantize the bucket (plus the residual) into the
    owners' segments, then dequantize in place. The owner's sum and
    re-quantization of its share are left out."""
    plan = Int8BucketPlan([(0, bucket.numel(), 0)], world_size, rank,
                          block_size)
    packed = torch.empty(
        plan.send_bytes, dtype=torch.uint8, device=bucket.device)
    residual = torch.zeros_like(bucket)

    def run():
        int8_codec.quantize_blocks(bucket, plan.send, packed, 1.0 / world_size,
                                   residual)
        int8_codec.dequantize_blocks(packed, plan.send, bucket)

    return run


# PowerSGD as the benchmarks run it: compressing from the second step on
# (PyTorch's default waits 1000), at a rank that shows its products.
_POWERSGD_BENCHMARK = dict(matrix_approximation_rank=4, start_powerSGD_iter=2)

#: Hook function -> its record, for the built-in hooks.
HOOK_RECORDS = {
    allreduce_hook:
    HookRecord(
        count_wire=_sends_bucket(),
        model_bytes=_whole_bytes,
        sharded='reduce_scatter',
        cost=ALLREDUCE_COST,
        label='fp32 all-reduce',
        colour='black'),
    fp16_compress_hook:
    HookRecord(
        wire='fp16',
        count_wire=_sends_bucket(2),
        model_bytes=_whole_bytes,
        sharded='reduce_scatter',
        cost=HALF_PRECISION_COSTS['fp16'],
        label='fp16',
        colour='tab:green',
        codec=_half_codec(torch.float16)),
    bf16_compress_hook:
    HookRecord(
        wire='bf16',
        count_wire=_sends_bucket(2),
        model_bytes=_whole_bytes,
        sharded='reduce_scatter',
        cost=HALF_PRECISION_COSTS['bf16'],
        label='bf16',
        colour='tab:purple',
        codec=_half_codec(torch.bfloat16)),
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
        model_bytes=_powersgd_bytes,
        cost=POWERSGD_COST,
        label='PowerSGD',
        colour='tab:orange',
        benchmark_options=_POWERSGD_BENCHMARK),
    batched_powersgd_hook:
    HookRecord(
        worker_waits=False,
        powersgd_state=True,
        state_keeper=BatchedPowerSGDRelayout,
        defaults=_POWERSGD_DEFAULTS,
        count_wire=_powersgd_wire,
        cost=BATCHED_POWERSGD_COST,
        label='batched PowerSGD',
        colour='tab:brown',
        benchmark_options=_POWERSGD_BENCHMARK),
    int8_compress_hook:
    HookRecord(
        wire='int8',
        quantizes=True,
        worker_waits=False,
        state_keeper=Int8StateKeeper,
        notes=_slow_int8_blocks,
        count_wire=_int8_wire,
        sharded='int8',
        cost=INT8_COST,
        label='int8',
        colour='tab:blue',
        codec=_int8_codec,
        variants=(HookVariant('int8_ef', dict(error_feedback=True),
                              'int8 + error feedback', 'tab:blue'),
                  HookVariant('int8_noef', dict(error_feedback=False),
                              'int8, no error feedback', 'tab:red'))),
}

_UNKNOWN = HookRecord()


def record_of(hook: Callable) -> HookRecord:
    """``hook``'s record; an empty one (traffic unknown) for a hook the
    project does not know."""
    return HOOK_RECORDS.get(hook, _UNKNOWN)
