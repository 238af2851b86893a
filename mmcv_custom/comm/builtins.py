"""The built-in hooks: for each, the name a config gives, the function
and its :class:`~.records.HookRecord`, in one entry of
:data:`BUILTIN_HOOKS`.

Everything the project does with a hook beyond calling it (which wrappers
it refuses, the worker, its state in checkpoints, the bytes it sends, its
FSDP2 form, its cost, its label and colour in the tools) is read from
that record, and the tests iterate over these entries and read their
records, so a new stateless built-in hook is five files at most: its
function in :mod:`mmcv_custom.hooks`, one entry here, its test, its row in
the README's table, and its line in ``docs/en/design/layout.md`` where its
function is a new module (tried with an fp8 hook, issue 44). Until it is
measured, the tests that hold the published benchmarks to their data name
it as not yet benchmarked rather than fail. :mod:`.registry` registers
them; a plugin registers its own hook and record the same way
(``COMM_HOOKS.register_module(record=...)``).
"""
import math
from typing import Callable, NamedTuple, Optional

import torch

from ..hooks import cast, int8_codec
from ..hooks.batched_powersgd import batched_powersgd_hook
from ..hooks.half import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ..hooks.int8 import Int8BucketPlan, Int8StateKeeper, int8_compress_hook
from ..hooks.local_sgd import DEFAULT_INNER, diloco_hook, post_local_sgd_hook
from ..hooks.local_sgd_keeper import PeriodicStateKeeper
from ..hooks.powersgd import compression, powersgd_hook
from ..hooks.powersgd_state import (BatchedPowerSGDStateKeeper,
                                    PowerSGDStateKeeper)
from .cost_records import (ALLREDUCE_COST, BATCHED_POWERSGD_COST,
                           HALF_PRECISION_COSTS, INT8_COST, POWERSGD_COST)
from .periodic_costs import DILOCO_COST, POST_LOCAL_SGD_COST, PeriodicCost
from .records import HookRecord, HookVariant, sends_bucket
from .traffic import sent_bytes

__all__ = ['BuiltinHook', 'BUILTIN_HOOKS', 'powersgd_numel']


class BuiltinHook(NamedTuple):
    """One built-in hook: its ``comm_hook.type``, function and record."""
    name: str
    hook: Callable
    record: HookRecord


def _int8_bytes_sent(hook, state, bucket):
    # The all-to-all and the all-gather of the quantized bucket (payload,
    # block scales, alignment): the two halves of a ring all-reduce of it,
    # so they count about as that all-reduce's tensor (the one rule).
    # In the two-level form, those across nodes, on the number of nodes.
    collectives = state.collectives(bucket)
    return hook(state,
                bucket), int(sent_bytes(collectives, state.exchange_size()))


def _powersgd_bytes_sent(hook, state, bucket):
    # Both PowerSGD hooks all-reduce the bucket as is while iter <
    # start_powerSGD_iter, and leave the state's counters alone.
    buffer = bucket.buffer()
    compressing = state.iter >= state.start_powerSGD_iter
    before = state.total_numel_after_compression
    fut = hook(state, bucket)
    # Compressing, both add up what they send, in the bucket's dtype: P and
    # Q ((n + m) * r numbers for an n x m matrix at rank r) plus the numel
    # of every tensor left uncompressed (all-reduced as is). That may be 0.
    # In the two-level form they add up only this rank's share, which is
    # what it sends across nodes (its all-reduces among its peers there);
    # its warm-up all-reduces there its share of the node's sums.
    two_level = getattr(state, 'node_groups', None) is not None
    if compressing:
        size = ((state.total_numel_after_compression - before) *
                buffer.element_size())
    elif two_level:
        size = state.node_share(bucket) * buffer.element_size()
    else:
        size = buffer.numel() * buffer.element_size()
    return fut, int(sent_bytes([('all_reduce', size)], 1))


def _periodic_bytes_sent(hook, state, bucket):
    # Counted after the step instead, on the run's thread, when every
    # bucket's exchange is done: PeriodicState.pop_sent() (the inner
    # exchanges and the synchronisation; mmcv_custom.engine.periodic_sync).
    return hook(state, bucket), 0


def _periodic_bytes(cost: PeriodicCost) -> Callable:
    """``model_bytes`` of a periodic hook: what a rank sends across nodes
    per step, averaged over the period: its cost record's collectives
    across nodes (``cost.sync_sends``, on ``world_size`` nodes of one rank
    each) by the one counting rule, ``fragments`` times (1: plain) every
    ``period`` steps. The
    exchange inside the node every step and the buffers come on top."""

    def model_bytes(params, state_kwargs: dict, half: bool,
                    world_size: int) -> int:
        settings = dict(cost.settings)
        settings.update(
            (k, v) for k, v in state_kwargs.items() if v is not None)
        numel = sum(p.numel() for p in params)
        cross = [(kind, nbytes) for kind, nbytes, level in cost.sync_sends(
            numel, 1, world_size, settings) if level == 'cross']
        # One synchronisation is one fragment's (the streaming form
        # synchronises `fragments` of them a period).
        return int(
            sent_bytes(cross, world_size) * settings.get('fragments', 1) /
            (settings['period'] or 1))

    return model_bytes


def _diloco_state_bytes(buckets, state_kwargs: dict) -> int:
    # Kept on each device between steps, in fp32: the global parameters and
    # the outer momentum, and with int8's error feedback the residual (a
    # rank keeps its slice of each: fewer with several ranks a node; the
    # inner hook's own state comes on top).
    copies = 3 if (state_kwargs.get('outer_format', 'int8') == 'int8'
                   and state_kwargs.get('error_feedback') is not False) else 2
    return 4 * copies * sum(b.numel for b in buckets)


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


def _no_state(buckets, state_kwargs: dict) -> int:
    # Nothing kept on the GPU from step to step: the half-precision hooks
    # keep a non-finite flag per bucket (and, on CPU only, a send buffer).
    return 0


def _int8_state_bytes(buckets, state_kwargs: dict) -> int:
    # Int8State._residual: one fp32 residual per bucket element, whatever
    # the gradients' dtype, in both forms (the two-level form feeds the
    # whole bucket's back too); none without error feedback. Under hybrid
    # sharding (buckets: the rank's shards) residual_dtype='bfloat16' keeps
    # it in 2 bytes (HybridInt8State). The plans' index tables (a few int64
    # a block) are left out.
    if not state_kwargs.get('error_feedback', True):
        return 0
    itemsize = 2 if state_kwargs.get('residual_dtype') == 'bfloat16' else 4
    return itemsize * sum(b.numel for b in buckets)


def _powersgd_state_bytes(buckets, state_kwargs: dict) -> int:
    # In each bucket's dtype: the error (a copy of the bucket) with
    # use_error_feedback, and with warm_start the P and Q factors of every
    # matrix it compresses ((n + m) r numbers), cleared each step without.
    # The two-level form keeps only its own tensors' factors: fewer.
    rank = state_kwargs.get('matrix_approximation_rank', 1)
    min_rate = state_kwargs.get('min_compression_rate', 2)
    total = 0
    for b in buckets:
        if state_kwargs.get('use_error_feedback', True):
            total += b.numel * b.itemsize
        if state_kwargs.get('warm_start', True):
            total += b.itemsize * sum(
                after
                for compress, _, after in (compression(p.shape, rank, min_rate)
                                           for p in b.params) if compress)
    return total


def _batched_state_bytes(buckets, state_kwargs: dict) -> int:
    # Per bucket, in its dtype: the error with use_error_feedback, and the
    # side x r factors P and Q of its square (kept even without warm start:
    # only then drawn afresh).
    rank = state_kwargs.get('matrix_approximation_rank', 1)
    total = 0
    for b in buckets:
        side = math.isqrt(b.numel - 1) + 1 if b.numel else 0
        total += 2 * side * min(side, rank) * b.itemsize
        if state_kwargs.get('use_error_feedback', True):
            total += b.numel * b.itemsize
    return total


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
            sent = cast.compress(bucket, world_size, dtype, out=half)
            cast.decompress(sent, bucket)

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


# What each hook's accuracy class rests on: the convergence comparison's
# runs (tools/analysis_tools/compare_comm_convergence.py, 2 gloo ranks,
# block 256), published with their commands in docs/en/notes/benchmarks.md
# ("Does each hook train like fp32?"); the recommendation prints them.
_WHERE = ' (docs/en/notes/benchmarks.md, "Does each hook train like fp32?")'
_EXACT_EVIDENCE = ('the reference: every other hook\'s runs are compared '
                   'with its own')
_INT8_EF_EVIDENCE = (
    'final mIoU against fp32 on the toy configs, 2 ranks: FCN 90.32 / '
    '90.18, tiny InternViT 72.87 / 73.35 (the runs differ by about 0.5 '
    'point on it: fp16 72.92); two-level on 2 x 2 ranks: FCN 90.56 / '
    '90.48, tiny InternViT 78.22 / 78.19' + _WHERE)
_INT8_NOEF_EVIDENCE = (
    'final mIoU against fp32 on the toy configs, 2 ranks: FCN 90.16 / '
    '90.18, tiny InternViT 73.33 / 73.35; FSDP2 tiny recipe 73.73 / 73.84' +
    _WHERE)
_FP16_EVIDENCE = ('final mIoU against fp32 on the toy configs, 2 ranks: '
                  'FCN 90.17 / 90.18, tiny InternViT 72.92 / 73.35 (about '
                  'the runs\' noise there)' + _WHERE)
_BF16_EVIDENCE = ('final mIoU against fp32 on the toy configs, 2 ranks: '
                  'FCN 90.10 / 90.18, tiny InternViT 73.22 / 73.35' + _WHERE)
_POWERSGD_EVIDENCE = (
    'final mIoU against fp32 (73.35, 90.18), compressing from step 2: tiny '
    'InternViT, 200 iterations, rank 4 62.93, rank 1 41.96, rank 4 under '
    'the bf16 wrapper 60.86; FCN, 600 iterations, 89.91, 88.02 and 89.84: '
    'the short toy runs lose points that error feedback has not given '
    'back yet' + _WHERE)
_BATCHED_EVIDENCE = (
    'final mIoU against fp32 (73.35, 90.18), compressing from step 2: tiny '
    'InternViT, 200 iterations, rank 4 51.78, rank 1 38.51, rank 4 under '
    'the bf16 wrapper 43.26; FCN, 600 iterations, 86.44, 86.76 and 86.36' +
    _WHERE)

# The periodic hooks' runs: 2 emulated nodes x 1 rank, against fp32 on the
# same layout (FCN 90.12, tiny InternViT 73.21).
_PERIODIC_WHERE = (' (docs/en/notes/benchmarks.md, "Periodic synchronisation:'
                   ' post-local SGD and DiLoCo (2 nodes x 1 rank)")')
_POST_LOCAL_SGD_EVIDENCE = (
    'final mIoU against fp32 on the toy configs, 2 nodes x 1 rank (FCN '
    '90.12, tiny InternViT 73.21): period 5, 25, 100: FCN 89.87, 89.93, '
    '89.55, tiny InternViT 70.17, 67.33, 63.01; with start_iter=100 at '
    'period 5: 89.96 and 72.98' + _PERIODIC_WHERE)
_DILOCO_EVIDENCE = (
    'final mIoU against fp32 on the toy configs, 2 nodes x 1 rank (FCN '
    '90.12, tiny InternViT 73.21), outer Nesterov 0.7 / 0.9, int8: H 5, '
    '25, 100: FCN 84.40, 88.43, 81.28, tiny InternViT 62.83, 63.53, '
    '58.91; H 25 with outer_lr=0.6: 89.08 and 62.80; H 25 with '
    'start_iter=50: 90.97 and 85.56; outer_momentum=0.5, H 25 and 50: '
    'FCN 90.20 and 90.09, tiny InternViT 70.37 and 61.64' + _PERIODIC_WHERE)

# PowerSGD as the benchmarks run it: compressing from the second step on
# (PyTorch's default waits 1000), at a rank that shows its products.
_POWERSGD_BENCHMARK = dict(matrix_approximation_rank=4, start_powerSGD_iter=2)


def _powersgd_variants(name: str, label: str, colours: tuple) -> tuple:
    """The convergence comparison's settings of a PowerSGD hook: rank 4
    (the benchmarks'), rank 1 (the cost model's default, the coarsest) and
    rank 4 under the bf16 wrapper; each compressing from the second step,
    in ``colours`` (one each)."""
    return (HookVariant(name, _POWERSGD_BENCHMARK, f'{label}, rank 4',
                        colours[0]),
            HookVariant(f'{name}_r1',
                        dict(_POWERSGD_BENCHMARK, matrix_approximation_rank=1),
                        f'{label}, rank 1', colours[1]),
            HookVariant(f'{name}_bf16',
                        dict(_POWERSGD_BENCHMARK, wrapper='bf16'),
                        f'{label}, rank 4, bf16 wrapper', colours[2]))


#: The periods the convergence comparison trains the periodic hooks at:
#: every 5 optimizer steps (close to per-step averaging), 25 and 100 (the
#: DiLoCo paper's H=100 scaled down to the toy runs' length).
_PERIODS = (5, 25, 100)


def _periodic_variants(name: str, prefix: str, label: Callable[[int], str],
                       colours: tuple) -> tuple:
    """The convergence comparison's settings of a periodic hook: one per
    period of :data:`_PERIODS`, named ``<name>_<prefix><period>``, in
    ``colours`` (one each); their accuracy class is the record's."""
    return tuple(
        HookVariant(f'{name}_{prefix}{p}', dict(period=p), label(p), colour)
        for p, colour in zip(_PERIODS, colours))


#: The built-in hooks, one entry each: the name a config gives as
#: ``comm_hook.type``, the function and its record.
BUILTIN_HOOKS = (
    BuiltinHook(
        'allreduce', allreduce_hook,
        HookRecord(
            state_bytes=_no_state,
            count_bytes_sent=sends_bucket(),
            model_bytes=_whole_bytes,
            fsdp2_form='averaging_reduce_scatter',
            cost=ALLREDUCE_COST,
            label='fp32 all-reduce',
            colour='black',
            accuracy='exact',
            evidence=_EXACT_EVIDENCE)),
    BuiltinHook(
        'fp16_compress', fp16_compress_hook,
        HookRecord(
            state_bytes=_no_state,
            sent_format='fp16',
            count_bytes_sent=sends_bucket(2),
            model_bytes=_whole_bytes,
            fsdp2_form='averaging_reduce_scatter',
            cost=HALF_PRECISION_COSTS['fp16'],
            label='fp16',
            colour='tab:green',
            codec=_half_codec(torch.float16),
            two_level=True,
            accuracy='half',
            evidence=_FP16_EVIDENCE)),
    BuiltinHook(
        'bf16_compress', bf16_compress_hook,
        HookRecord(
            state_bytes=_no_state,
            sent_format='bf16',
            count_bytes_sent=sends_bucket(2),
            model_bytes=_whole_bytes,
            fsdp2_form='averaging_reduce_scatter',
            cost=HALF_PRECISION_COSTS['bf16'],
            label='bf16',
            colour='tab:purple',
            codec=_half_codec(torch.bfloat16),
            two_level=True,
            accuracy='half',
            evidence=_BF16_EVIDENCE)),
    # Both PowerSGD hooks and int8 wait between their collectives (PyTorch's
    # own PowerSGD hook would start collectives from future callbacks,
    # unsafe on gloo with several buckets in flight: pytorch/pytorch#48478);
    # each has issued all of them when it returns.
    BuiltinHook(
        'powerSGD', powersgd_hook,
        HookRecord(
            state_bytes=_powersgd_state_bytes,
            on_worker=True,
            waits_per_bucket=False,
            powersgd_state=True,
            state_keeper=PowerSGDStateKeeper,
            defaults=_POWERSGD_DEFAULTS,
            count_bytes_sent=_powersgd_bytes_sent,
            model_bytes=_powersgd_bytes,
            cost=POWERSGD_COST,
            label='PowerSGD',
            colour='tab:orange',
            benchmark_options=_POWERSGD_BENCHMARK,
            two_level=True,
            variants=_powersgd_variants('powerSGD', 'PowerSGD',
                                        ('tab:orange', 'gold', 'tab:cyan')),
            accuracy='low_rank',
            evidence=_POWERSGD_EVIDENCE)),
    BuiltinHook(
        'batched_powerSGD', batched_powersgd_hook,
        HookRecord(
            state_bytes=_batched_state_bytes,
            on_worker=True,
            waits_per_bucket=False,
            powersgd_state=True,
            state_keeper=BatchedPowerSGDStateKeeper,
            defaults=_POWERSGD_DEFAULTS,
            count_bytes_sent=_powersgd_bytes_sent,
            cost=BATCHED_POWERSGD_COST,
            label='batched PowerSGD',
            colour='tab:brown',
            benchmark_options=_POWERSGD_BENCHMARK,
            two_level=True,
            variants=_powersgd_variants(
                'batched_powerSGD', 'batched PowerSGD',
                ('tab:brown', 'tab:pink', 'tab:olive')),
            accuracy='low_rank',
            evidence=_BATCHED_EVIDENCE)),
    BuiltinHook(
        'int8_compress', int8_compress_hook,
        HookRecord(
            state_bytes=_int8_state_bytes,
            sent_format='int8',
            quantizes=True,
            on_worker=True,
            waits_per_bucket=False,
            state_keeper=Int8StateKeeper,
            notes=_slow_int8_blocks,
            count_bytes_sent=_int8_bytes_sent,
            fsdp2_form='int8_reduce_scatter',
            cost=INT8_COST,
            label='int8',
            colour='tab:blue',
            codec=_int8_codec,
            two_level=True,
            variants=(HookVariant('int8_ef', dict(error_feedback=True),
                                  'int8 + error feedback', 'tab:blue',
                                  'quantized_ef', _INT8_EF_EVIDENCE),
                      HookVariant('int8_noef', dict(error_feedback=False),
                                  'int8, no error feedback', 'tab:red',
                                  'quantized', _INT8_NOEF_EVIDENCE)),
            accuracy='quantized_ef',
            evidence=_INT8_EF_EVIDENCE)),
    BuiltinHook(
        'post_local_sgd',
        post_local_sgd_hook,
        HookRecord(
            periodic=True,
            cost=POST_LOCAL_SGD_COST,
            state_keeper=PeriodicStateKeeper,
            defaults={None: {
                'inner': DEFAULT_INNER
            }},
            count_bytes_sent=_periodic_bytes_sent,
            # The parameters averaged in fp32; nothing kept between steps.
            model_bytes=_periodic_bytes(POST_LOCAL_SGD_COST),
            state_bytes=_no_state,
            accuracy='periodic',
            evidence=_POST_LOCAL_SGD_EVIDENCE,
            label='post-local SGD',
            colour='darkgoldenrod',
            variants=_periodic_variants(
                'post_local_sgd', 'p', lambda p: f'post-local SGD, period {p}',
                ('goldenrod', 'darkgoldenrod', 'saddlebrown')))),
    BuiltinHook(
        'diloco', diloco_hook,
        HookRecord(
            periodic=True,
            cost=DILOCO_COST,
            state_keeper=PeriodicStateKeeper,
            defaults={None: {
                'inner': DEFAULT_INNER
            }},
            count_bytes_sent=_periodic_bytes_sent,
            model_bytes=_periodic_bytes(DILOCO_COST),
            state_bytes=_diloco_state_bytes,
            accuracy='periodic',
            evidence=_DILOCO_EVIDENCE,
            label='DiLoCo',
            colour='teal',
            variants=_periodic_variants(
                'diloco', 'h', lambda p: f'DiLoCo, H={p}',
                ('mediumturquoise', 'teal', 'darkslategray')))),
)
