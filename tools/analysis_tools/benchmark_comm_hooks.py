"""Measure the communication hooks side by side, in one run.

Starts ``--nproc`` ranks (gloo on CPU, NCCL when every rank has a GPU) and,
for every bucket size, times one DDP backward step per hook, interleaving
the hooks round by round so that drift on a shared machine hits them all
alike. Compared:

* this project's ``allreduce_hook``, ``fp16_compress_hook`` and
  ``bf16_compress_hook`` (the compressing ones with a ``CompressState``, as
  the runner hook registers them), and ``int8_compress_hook`` with an
  ``Int8State(None)`` (blocks of 256, error feedback on: the registry's
  defaults);
* PyTorch's built-ins of the same names (``torch.distributed.algorithms.
  ddp_comm_hooks.default_hooks``), and DDP with no hook (its C++ all-reduce).
  PyTorch has no int8 hook to set beside ours: its experimental
  ``quantization_pertensor_hook`` fails on gloo (torch 2.13: an
  ``IndexError`` in its own callback), and would not be a like-for-like
  rival anyway (one scale per bucket, all-gather of every rank's bucket,
  no error feedback), so the int8 row has no PyTorch column;
* a hook that communicates nothing, whose time is subtracted from every
  other one, so that "time per bucket" is the hook's own cost.

For each hook it also reports the bytes each rank hands to its collectives
as input, read from the profiler's record of each collective (shape and
dtype; gloo and NCCL record the input tensor only), the most of any rank:
the tensor given to ``all_reduce``, or for the int8 hook the send tensor of
its ``all_to_all`` (the segments for every rank, its own included) plus the
input of its ``all_gather`` (its own segment). It also reports the error of
the averaged gradient against the exact mean (computed in float64 from
every rank's known gradient). Finally, on each rank at once, it times
compress + decompress against a plain copy of the same fp32 bucket: how
close the hooks come to the memory-bandwidth limit (for int8, blockwise
quantize with error feedback, then dequantize, as the hook does to each
element it sends).

It prints two Markdown tables, as docs/en/notes/benchmarks.md shows
them, and a verdict on the targets; meanwhile rank 0 reports each step
done (a hook's warm-up, a round, the codecs) on stderr, with an ETA.
Arguments are checked before any rank starts (a bad value is a usage
error, exit code 2), as are the ``--json`` and ``--plot`` paths (missing
folders under ``work_dirs/`` are created).

Examples:
    python tools/analysis_tools/benchmark_comm_hooks.py --nproc 2 \\
        --json work_dirs/bench/bench.json --plot work_dirs/bench/bench.png
    python tools/analysis_tools/benchmark_comm_hooks.py --sizes-mb 1 4 \\
        --repeat 3  # quick
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mmcv_custom.analysis import Progress, check_output
from mmcv_custom.hooks import cast, int8_codec
from mmcv_custom.hooks.half import (CompressState, allreduce_hook,
                                    bf16_compress_hook, fp16_compress_hook)
from mmcv_custom.hooks.int8 import (Int8BucketPlan, Int8State,
                                    int8_compress_hook)
from mmcv_custom.launcher import (shutdown_distributed, spawn_ranks,
                                  write_results)
from mmcv_custom.registry import hook_record

MB = 2**20


def _noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _torch_bf16_compress_hook(process_group, bucket):
    # PyTorch's own function; DDP refuses to register it under its own name
    # off NCCL, so it is called through this one-line indirection.
    return default_hooks.bf16_compress_hook(process_group, bucket)


def _compress_state():
    return CompressState(None)


def _int8_state():
    return Int8State(None)


# Blocks of the int8 hook as benchmarked (Int8State's default).
_INT8_BLOCK = 256

# name -> (hook or None for DDP's built-in all-reduce, state factory or
# None for the process group). Ours are registered as the runner hook
# registers them: with a state, which keeps the send buffers (and the int8
# hook's error feedback) between steps. What each of ours sends is read
# from its hook record (see _PAIRS).
HOOKS = {
    'noop': (_noop_hook, None),
    'ddp_builtin': (None, None),
    'torch.allreduce_hook': (default_hooks.allreduce_hook, None),
    'ours.allreduce_hook': (allreduce_hook, None),
    'torch.fp16_compress_hook': (default_hooks.fp16_compress_hook, None),
    'ours.fp16_compress_hook': (fp16_compress_hook, _compress_state),
    'torch.bf16_compress_hook': (_torch_bf16_compress_hook, None),
    'ours.bf16_compress_hook': (bf16_compress_hook, _compress_state),
    'ours.int8_compress_hook': (int8_compress_hook, _int8_state),
}


class _OneBucket(nn.Module):
    """One parameter of ``numel`` floats; ``(p * x).sum()`` has gradient x,
    so the backward pass itself costs one elementwise pass."""

    def __init__(self, numel):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(numel))

    def forward(self, x):
        return (self.p * x).sum()


def _planted(rank, numel):
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(
        numel, generator=gen) * 10**torch.randint(
            -3, 3, (numel, ), generator=gen).float()


# The collectives whose bytes are counted, by the start of the name the
# backend gives its profiler event (``gloo:all_to_all``,
# ``nccl:_all_gather_base``, ...).
_COLLECTIVES = ('all_reduce', 'all_to_all', 'all_gather')


def _collective(name):
    """Which of :data:`_COLLECTIVES` the profiler event ``name`` is, or
    None (not a gloo or NCCL collective we count)."""
    backend, _, op = name.partition(':')
    if backend not in ('gloo', 'nccl'):
        return None
    op = op.lstrip('_')
    return next((c for c in _COLLECTIVES if op.startswith(c)), None)


def _wire_bytes(step):
    """Bytes handed to each collective during ``step()``, from the profiler.

    Gloo and NCCL record a collective's input tensor only (not the output
    it writes), so this is what the rank hands over: the tensor of an
    ``all_reduce``, the whole send tensor of an ``all_to_all`` (its own
    segment included), the rank's own part of an ``all_gather``.

    Returns:
        dict: Collective (:data:`_COLLECTIVES`) -> bytes.
    """
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    # The int8 hook issues its collectives on mmcv_custom.hooks.worker's
    # thread, started before the profiler: recorded only when all threads
    # are.
    with profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            experimental_config=_ExperimentalConfig(
                profile_all_threads=True)) as p:
        step()
    totals = dict.fromkeys(_COLLECTIVES, 0)
    for event in p.profiler.kineto_results.events():
        kind = _collective(event.name())
        if kind is None:
            continue
        for shape, dtype in zip(event.shapes(), event.dtypes()):
            numel = 1
            for d in shape:
                numel *= d
            totals[kind] += numel * _DTYPE_SIZES.get(dtype, 4)
    return totals


_DTYPE_SIZES = {
    'float': 4,
    'c10::Half': 2,
    'c10::BFloat16': 2,
    'double': 8,
    'Half': 2,
    'BFloat16': 2,
    'Float': 4,
    'unsigned char': 1,
    'signed char': 1,
    'Byte': 1,
    'Char': 1,
}


def _time_codecs(numel, world_size, device, repeat):
    """Median seconds of compress + decompress per method, and of a copy."""
    source = torch.randn(numel, device=device)
    buffer = source.clone()
    copy_dst = torch.empty_like(buffer)
    halves = {
        dt: torch.empty(numel, dtype=dt, device=device)
        for dt in (torch.float16, torch.bfloat16)
    }
    # The int8 hook's plan of a one-parameter bucket (per-parameter blocks
    # grouped by owner rank) and its send buffer.
    plan = Int8BucketPlan([(0, numel, 0)], world_size, dist.get_rank(),
                          _INT8_BLOCK)
    packed = torch.empty(plan.send_bytes, dtype=torch.uint8, device=device)
    residual = torch.zeros_like(buffer)

    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize()

    def ours(dt):
        # What the hook does with its state's kept send buffer.
        half = cast.compress(buffer, world_size, dt, out=halves[dt])
        cast.decompress(half, buffer)

    def theirs(dt):
        buffer.copy_(buffer.to(dt).div_(world_size))

    def ours_int8():
        # What the hook does to every element, with error feedback: quantize
        # its share (plus the residual) into the owners' segments, then
        # dequantize in place (the owner's sum and re-quantization of its
        # 1 / world_size of the bucket are left out).
        int8_codec.quantize_blocks(buffer, plan.send, packed, 1.0 / world_size,
                                   residual)
        int8_codec.dequantize_blocks(packed, plan.send, buffer)

    methods = {
        'copy_fp32': lambda: copy_dst.copy_(buffer),
        'ours.fp16': lambda: ours(torch.float16),
        'torch.fp16': lambda: theirs(torch.float16),
        'ours.bf16': lambda: ours(torch.bfloat16),
        'torch.bf16': lambda: theirs(torch.bfloat16),
        'ours.int8': ours_int8,
    }
    times = {k: [] for k in methods}
    for _ in range(repeat + 1):
        # Every method divides the buffer by world_size: without a fresh
        # start each round the values would shrink until fp16 flushes them
        # to zero, and the later rounds would time a bucket of zeros.
        buffer.copy_(source)
        for name, fn in methods.items():
            sync()
            # Every rank times the same method at the same moment, so each
            # one meets the same contention for memory from the others.
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


# Methods _time_codecs times (a copy and five codecs).
_CODEC_METHODS = 6


def _progress_steps(args):
    """The steps rank 0 reports, in order, as ``(note, weight)``: per
    bucket size, each hook's warm-up and measured bytes, each timed round
    (every hook once) and the codec timings. A weight is the step's DDP
    steps (or codec passes) times the bucket's MB, plus 0.1 MB for what
    does not grow with it, so that the ETA counts a 100 MB round as
    such."""
    steps = []
    for size_mb in args.sizes_mb:
        cost = size_mb + 0.1
        for name in HOOKS:
            # The warm-up steps, one to read the error, one profiled.
            steps.append((f'{size_mb:g} MB, {name}: warm-up and bytes',
                          (args.warmup + 2) * cost))
        for i in range(args.repeat):
            steps.append((f'{size_mb:g} MB, round {i + 1}/{args.repeat}',
                          len(HOOKS) * cost))
        steps.append((f'{size_mb:g} MB, codecs',
                      (args.repeat + 1) * _CODEC_METHODS * cost / 2))
    return steps


def _worker(rank, world_size, folder, args):
    # Kineto, under torch.profiler, writes "USDT: ... profiler_start" and
    # "profiler_stop" to stderr on every profiled step; its USDT level is
    # above ERROR, so only level 6 silences it (read when the profiler
    # first starts). A user's own KINETO_LOG_LEVEL wins.
    os.environ.setdefault('KINETO_LOG_LEVEL', '6')
    use_cuda = args.backend == 'nccl'
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device('cuda', rank) if use_cuda else torch.device('cpu')
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.FileStore(os.path.join(folder, 'store'), world_size)
    dist.init_process_group(
        args.backend, store=store, rank=rank, world_size=world_size)
    steps = _progress_steps(args)
    # On stderr, from rank 0 only: the tables go to stdout at the end.
    progress = Progress(
        len(steps), weights=[w for _, w in steps], enabled=rank == 0)
    notes = iter(note for note, _ in steps)
    # Each size's DDP models live in _measure_size's frame and are gone
    # when it returns: see shutdown_distributed for why that must come
    # first.
    results = [
        _measure_size(size_mb, rank, world_size, device, args, progress, notes)
        for size_mb in args.sizes_mb
    ]
    progress.close()
    if rank == 0:
        write_results(folder, results)
    shutdown_distributed()


def _measure_size(size_mb, rank, world_size, device, args, progress, notes):
    """Every hook on one bucket of ``size_mb``: its error and bytes,
    then ``args.repeat`` timed rounds and the codecs."""
    use_cuda = device.type == 'cuda'
    numel = int(size_mb * MB) // 4
    x = _planted(rank, numel).to(device)
    exact = torch.stack([
        _planted(r, numel).double() for r in range(world_size)
    ]).mean(0).to(device)
    models = {}
    for name, (hook, make_state) in HOOKS.items():
        model = nn.parallel.DistributedDataParallel(
            _OneBucket(numel).to(device),
            device_ids=[rank] if use_cuda else None,
            bucket_cap_mb=size_mb * 2 + 1,
            gradient_as_bucket_view=True)
        if hook is not None:
            model.register_comm_hook(
                None if make_state is None else make_state(), hook)
        models[name] = model

    def step(model):
        model.zero_grad(set_to_none=False)
        model(x).backward()
        if use_cuda:
            torch.cuda.synchronize()

    entry = dict(size_mb=size_mb, numel=numel, hooks={})
    for name, model in models.items():
        for _ in range(args.warmup):
            step(model)
        err = (model.module.p.grad.double() - exact)
        counted = _wire_bytes(lambda: step(model))
        # The int8 hook's segments may differ in size between ranks:
        # the most any rank hands over is reported.
        counted = torch.tensor([counted[c] for c in _COLLECTIVES],
                               dtype=torch.int64,
                               device=device)
        dist.all_reduce(counted, op=dist.ReduceOp.MAX)
        by_collective = dict(zip(_COLLECTIVES, counted.tolist()))
        entry['hooks'][name] = dict(
            # The tensor an all-reduce of the bucket would carry: the
            # bucket, or for int8 the quantized bucket its all_to_all
            # scatters (the all_gather brings the same back, one
            # owner's segment from each rank).
            wire_bytes=(by_collective['all_reduce'] +
                        by_collective['all_to_all']),
            wire_bytes_by_collective=by_collective,
            rel_error=float(err.norm() / exact.norm()),
            max_abs_error=float(err.abs().max()),
            times=[])
        progress.advance(next(notes))
    for _ in range(args.repeat):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            step(model)
            # On the rank's device: NCCL reduces no CPU tensor.
            elapsed = torch.tensor([time.perf_counter() - start],
                                   device=device)
            # The slowest rank sets the step time.
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            entry['hooks'][name]['times'].append(float(elapsed))
        progress.advance(next(notes))
    noop = statistics.median(entry['hooks']['noop']['times'])
    for name, data in entry['hooks'].items():
        data['step_s'] = statistics.median(data['times'])
        data['hook_s'] = max(data['step_s'] - noop, 0.0)
    dist.barrier()
    entry['codec_s'] = _time_codecs(numel, world_size, device, args.repeat)
    progress.advance(next(notes))
    # Asked in the rank, whose thread count decides it.
    entry['int8_c_kernel'] = int8_codec.uses_c_kernel(
        torch.empty(1, device=device), _INT8_BLOCK)
    return entry


def _ratio(a, b):
    return a / b if b > 0 else float('nan')


def _ms(seconds):
    ms = seconds * 1e3
    return f'{ms:.1f} ms' if ms >= 1 else f'{ms:.2f} ms'


def _table(header, rows):
    """A Markdown table, as docs/en/notes/benchmarks.md shows the results."""
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
    return lines


def _dash_or(value, fmt):
    """``value`` formatted, or a dash where there is none (NaN)."""
    return '—' if math.isnan(value) else fmt(value)


def _pytorch_twin(ours):
    """PyTorch's hook of the same name as ``ours``, or None: PyTorch has
    none that runs here for int8 (see the module docstring)."""
    theirs = 'torch.' + ours[len('ours.'):]
    return theirs if theirs in HOOKS else None


def _pairs():
    """(family, our hook, PyTorch's or None, our hook's record) in the
    order of the step-time table. The family is the wire format the record
    names (``'fp16'``, ``'bf16'``, ``'int8'``), or ``'allreduce'`` for a
    hook that sends the gradients' own dtype."""
    out = []
    for name, (hook, _) in HOOKS.items():
        if name.startswith('ours.'):
            record = hook_record(hook)
            out.append((record.wire
                        or 'allreduce', name, _pytorch_twin(name), record))
    return out


_PAIRS = _pairs()
# Columns of the codec table, after the fp32 copy.
_CODECS = ('ours.fp16', 'torch.fp16', 'ours.bf16', 'torch.bf16', 'ours.int8')
# Quantize with error feedback reads the bucket and the residual (4 + 4
# bytes an element), writes the residual and the int8 value (4 + 1); the
# dequantize reads 1 and writes 4: 18 bytes against the copy's 8.
_INT8_CODEC_FLOOR = 18 / 8


def _int8_codec_note(results):
    """What ran the int8 codec: each rank asked, as its thread count (and
    device) decides it, not this process."""
    flags = {bool(e.get('int8_c_kernel')) for e in results}
    if flags == {True}:
        return 'C kernel (mmcv_custom._cpu_codec) in every rank'
    if flags == {False}:
        return 'torch ops (no C kernel: not built, GPU, or threads > 1)'
    return 'C kernel at some sizes, torch ops at others'


def report(results, world_size, backend, repeat=None):
    """The results as the two tables of docs/en/notes/benchmarks.md, then
    the verdict on the targets, as text."""
    rounds = '' if repeat is None else f', {repeat} rounds'
    lines = [
        f'{world_size} ranks, backend {backend}, torch '
        f'{torch.__version__}{rounds}'
    ]
    if backend == 'gloo':
        lines.append(f'CPU casts: {cast.cpu_codec()}')
    lines.append(f'int8 codec (block {_INT8_BLOCK}): '
                 f'{_int8_codec_note(results)}')
    # Only pairs with a PyTorch hook have a ratio and a target.
    ratios = {family: [] for family, _, theirs, _ in _PAIRS if theirs}
    bytes_ok, worst = True, (0.0, '', 0)
    int8_phases = []  # (size, all_to_all send / fp32, gathered / fp32)
    int8_vs_bf16, int8_cost = [], []  # step / bf16's; codec / copy, bf16
    step_rows, codec_rows = [], []
    for entry in results:
        hooks = entry['hooks']
        fp32_bytes = entry['numel'] * 4
        bucket = f'{entry["size_mb"]:g} MB'
        for family, ours, theirs, record in _PAIRS:
            data = hooks[ours]
            theirs_s = hooks[theirs]['hook_s'] if theirs else math.nan
            r = (
                _ratio(data['step_s'], hooks[theirs]['step_s'])
                if theirs else math.nan)
            if theirs:
                ratios[family].append(r)
            wire = data['wire_bytes']
            if record.half_precision:
                bytes_ok &= wire == fp32_bytes // 2
            elif record.quantizes:
                by = data['wire_bytes_by_collective']
                int8_phases.append(
                    (entry['size_mb'], by['all_to_all'] / fp32_bytes,
                     by['all_gather'] * world_size / fp32_bytes))
                int8_vs_bf16.append(
                    _ratio(data['step_s'],
                           hooks['ours.bf16_compress_hook']['step_s']))
            step_rows.append([
                bucket, f'`{ours[len("ours."):]}`',
                _ms(data['hook_s']),
                _dash_or(theirs_s, _ms),
                _dash_or(r, '{:.2f}'.format), f'{wire / MB:.4g}',
                f'{data["rel_error"]:.1e}'
            ])
        codec = entry['codec_s']
        cells = [bucket, _ms(codec['copy_fp32'])]
        for name in _CODECS:
            r = _ratio(codec[name], codec['copy_fp32'])
            if name in ('ours.fp16', 'ours.bf16'):
                worst = max(worst, (r, name, entry['size_mb']))
            cells.append(f'{r:.2f}x')
        int8_cost.append((_ratio(codec['ours.int8'], codec['copy_fp32']),
                          _ratio(codec['ours.int8'], codec['ours.bf16'])))
        codec_rows.append(cells)
    lines += [
        '', 'Time per bucket: `ours` and `PyTorch` are the hook\'s own time '
        '(the step minus that of a hook that communicates nothing); '
        '`ours / PyTorch` is the ratio of whole step times (medians; the '
        'slowest rank sets each step); PyTorch has no int8 hook that runs '
        'here (—). `wire MB (ours)`: MiB a rank hands to its collectives '
        'as input (the most of any rank, from the profiler): the '
        'all_reduce\'s tensor; for int8 the all_to_all\'s send tensor, '
        'the quantized bucket (every owner\'s segment, its own included), '
        'which the all_gather then brings back one owner\'s segment from '
        'each rank. Each rank sends (N - 1) / N of it in each phase, as a '
        'ring all-reduce does of its tensor.', ''
    ]
    lines += _table([
        'bucket', 'hook', 'ours', 'PyTorch', 'ours / PyTorch',
        'wire MB (ours)', 'rel. error'
    ], step_rows)
    lines += [
        '', 'Compress + decompress on every rank at once, as a '
        'multiple of a plain copy of the fp32 bucket (int8: quantize '
        'with error feedback, then dequantize):', ''
    ]
    lines += _table([
        'bucket', 'fp32 copy', 'ours fp16', 'PyTorch fp16', 'ours bf16',
        'PyTorch bf16', 'ours int8'
    ], codec_rows)
    lines.append('')
    lines.append('Targets (step time incl. the shared backward; median '
                 'over bucket sizes):')
    for family, values in ratios.items():
        med = statistics.median(values)
        lines.append(f'  ours/torch {family:<9}: {med:.3f} '
                     f'{"PASS" if med <= 1.05 else "FAIL"} (<= 1.05)')
    lines.append(f'  wire bytes fp16/bf16 = 0.5 x fp32: '
                 f'{"PASS" if bytes_ok else "FAIL"}')
    # Each phase moves the quantized bucket: 1 byte an element plus a 4-byte
    # scale a block, against 4 bytes of fp32 (0.2539 for blocks of 256);
    # 0.27 leaves room for padding to whole blocks and equal segments.
    target = (1 + 4 / _INT8_BLOCK) / 4
    send = max(int8_phases, key=lambda p: p[1])
    gathered = max(int8_phases, key=lambda p: p[2])
    ok = send[1] <= 0.27 and gathered[2] <= 0.27
    lines.append(
        f'  wire bytes int8 <= 0.27 x fp32 per phase ((1 + 4/'
        f'{_INT8_BLOCK}) / 4 = {target:.4f}), every size: '
        f'{"PASS" if ok else "FAIL"} (worst: all_to_all send '
        f'{send[1]:.4f} at {send[0]:g} MB, {world_size} x all_gather input '
        f'{gathered[2]:.4f} at {gathered[0]:g} MB)')
    # 1.5 is the byte ratio of the two (read 4 + write 2, then read 2 +
    # write 4, against read 4 + write 4): the floor for memory-bound passes.
    r, name, size = worst
    lines.append(f'  compress+decompress <= 1.5 x fp32 copy, every size: '
                 f'{"PASS" if r <= 1.5 else "FAIL"} (worst {r:.2f}x, '
                 f'{name} at {size:g} MB)')
    lines.append('Reported, no target:')
    lines.append(f'  int8/bf16 step time (ours, median over sizes): '
                 f'{statistics.median(int8_vs_bf16):.3f}')
    copies = [c for c, _ in int8_cost]
    bf16s = [b for _, b in int8_cost]
    lines.append(
        f'  int8 compress+decompress: {min(copies):.2f}x to '
        f'{max(copies):.2f}x an fp32 copy (it moves {_INT8_CODEC_FLOOR:.2f}x '
        f'the copy\'s bytes), {min(bf16s):.2f}x to {max(bf16s):.2f}x ours '
        'bf16')
    return '\n'.join(lines)


def plot(results, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    sizes = [e['size_mb'] for e in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in HOOKS:
        if name == 'noop':
            continue
        style = '-' if name.startswith('ours.') else '--'
        ax1.plot(
            sizes, [e['hooks'][name]['hook_s'] * 1e3 for e in results],
            style,
            marker='o',
            label=name)
    ax1.set(
        xscale='log',
        yscale='log',
        xlabel='bucket size (MB of fp32)',
        ylabel='ms per bucket (hook only)',
        title='Time per bucket')
    ax1.legend(fontsize=7)
    for name in _CODECS:
        style = '-' if name.startswith('ours.') else '--'
        ax2.plot(
            sizes,
            [e['codec_s'][name] / e['codec_s']['copy_fp32'] for e in results],
            style,
            marker='o',
            label=name)
    ax2.axhline(1.5, color='grey', lw=0.8, ls=':', label='target 1.5x')
    ax2.set(
        xscale='log',
        xlabel='bucket size (MB of fp32)',
        ylabel='x time of a plain fp32 copy',
        title='Compress + decompress cost')
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        '--nproc', type=int, default=2, help='ranks (processes) to start')
    parser.add_argument(
        '--sizes-mb',
        type=float,
        nargs='+',
        default=[1, 4, 16, 64, 100],
        help='bucket sizes in MB of fp32 gradients')
    parser.add_argument(
        '--repeat',
        type=int,
        default=10,
        help='timed rounds per bucket size (every hook once per round)')
    parser.add_argument(
        '--warmup',
        type=int,
        default=2,
        help='untimed steps per hook before the rounds')
    parser.add_argument(
        '--backend',
        choices=['auto', 'gloo', 'nccl'],
        default='auto',
        help='auto: NCCL when every rank has a GPU, else gloo')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--plot', help='draw a PNG here (needs matplotlib)')
    args = parser.parse_args(argv)
    # Everything is checked before a rank starts: a bad value fails in a
    # second, not after the measurement.
    if args.nproc < 1:
        parser.error(f'--nproc should be at least 1, but got {args.nproc}')
    for size in args.sizes_mb:
        if not math.isfinite(size) or size <= 0:
            parser.error('--sizes-mb values should be positive, but got '
                         f'{size:g}')
        if int(size * MB) // 4 < 1:
            parser.error(f'--sizes-mb {size:g} is less than one fp32 '
                         'gradient (4 bytes)')
    if args.repeat < 1:
        parser.error(f'--repeat should be at least 1, but got {args.repeat}')
    if args.warmup < 1:
        parser.error(f'--warmup should be at least 1, but got {args.warmup}')
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend == 'auto':
        args.backend = 'nccl' if gpus >= args.nproc else 'gloo'
    elif args.backend == 'nccl' and not gpus:
        parser.error('--backend nccl needs CUDA GPUs, but torch sees none '
                     '(use --backend gloo on CPUs)')
    elif args.backend == 'nccl' and gpus < args.nproc:
        parser.error(f'--backend nccl needs one CUDA GPU per rank, but got '
                     f'--nproc {args.nproc} with {gpus} GPUs')
    if args.backend == 'gloo':
        # Each rank holds the bucket's gradients at least once in memory:
        # beyond the machine's, the ranks would die of it mid-run.
        memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
        largest = max(args.sizes_mb)
        if largest * MB * args.nproc > memory:
            parser.error(f'--sizes-mb {largest:g}: {args.nproc} ranks would '
                         f'hold {largest * args.nproc:g} MB at least, more '
                         f'than this machine\'s {memory / MB:.0f} MB')
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot needs matplotlib, which is not installed '
                         '(pip install matplotlib)')
    for option in ('json', 'plot'):
        if getattr(args, option):
            check_output(parser, f'--{option}', getattr(args, option))
    return args


def main():
    args = parse_args()
    results = spawn_ranks(_worker, args.nproc, args)
    print(report(results, args.nproc, args.backend, args.repeat))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(
                dict(
                    world_size=args.nproc,
                    backend=args.backend,
                    torch=torch.__version__,
                    results=results),
                f,
                indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == '__main__':
    main()
