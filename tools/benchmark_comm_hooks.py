"""Measure the communication hooks side by side, in one run.

Starts ``--nproc`` ranks (gloo on CPU, NCCL when every rank has a GPU) and,
for every bucket size, times one DDP backward step per hook, interleaving
the hooks round by round so that drift on a shared machine hits them all
alike. Compared:

* this project's ``allreduce_hook``, ``fp16_compress_hook`` and
  ``bf16_compress_hook`` (the compressing ones with a ``CompressState``, as
  the runner hook registers them);
* PyTorch's built-ins of the same names (``torch.distributed.algorithms.
  ddp_comm_hooks.default_hooks``), and DDP with no hook (its C++ all-reduce);
* a hook that communicates nothing, whose time is subtracted from every
  other one, so that "time per bucket" is the hook's own cost.

For each hook it also reports the bytes each rank hands to ``all_reduce``,
read from the profiler's record of the collective (shape and dtype), and
the error of the averaged gradient against the exact mean (computed in
float64 from every rank's known gradient). Finally, on each rank at once, it
times compress + decompress against a plain copy of the same fp32 bucket:
how close the hooks come to the memory-bandwidth limit.

It prints two Markdown tables, as the README shows them, and a verdict on
the targets. Arguments are checked before any rank starts (a bad value is
a usage error, exit code 2), as are the ``--json`` and ``--plot`` paths.

Examples:
    python tools/benchmark_comm_hooks.py --nproc 2 --json bench.json \\
        --plot bench.png
    python tools/benchmark_comm_hooks.py --sizes-mb 1 4 --repeat 3  # quick
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mmcv_custom import ddp_hooks  # noqa: E402

MB = 2**20


def _noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _torch_bf16_compress_hook(process_group, bucket):
    # PyTorch's own function; DDP refuses to register it under its own name
    # off NCCL, so it is called through this one-line indirection.
    return default_hooks.bf16_compress_hook(process_group, bucket)


# name -> (hook or None for DDP's built-in all-reduce, wire dtype, family)
HOOKS = {
    'noop': (_noop_hook, None, None),
    'ddp_builtin': (None, torch.float32, 'allreduce'),
    'torch.allreduce_hook': (default_hooks.allreduce_hook, torch.float32,
                             'allreduce'),
    'ours.allreduce_hook': (ddp_hooks.allreduce_hook, torch.float32,
                            'allreduce'),
    'torch.fp16_compress_hook': (default_hooks.fp16_compress_hook,
                                 torch.float16, 'fp16'),
    'ours.fp16_compress_hook': (ddp_hooks.fp16_compress_hook, torch.float16,
                                'fp16'),
    'torch.bf16_compress_hook': (_torch_bf16_compress_hook, torch.bfloat16,
                                 'bf16'),
    'ours.bf16_compress_hook': (ddp_hooks.bf16_compress_hook,
                                torch.bfloat16, 'bf16'),
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
    return torch.randn(numel, generator=gen) * 10**torch.randint(
        -3, 3, (numel, ), generator=gen).float()


def _wire_bytes(step):
    """Bytes handed to all_reduce during ``step()``, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        step()
    total = 0
    for event in p.profiler.kineto_results.events():
        name = event.name()
        if not (name.startswith('gloo:all_reduce')
                or name.startswith('nccl:all_reduce')):
            continue
        for shape, dtype in zip(event.shapes(), event.dtypes()):
            numel = 1
            for d in shape:
                numel *= d
            total += numel * _DTYPE_SIZES.get(dtype, 4)
    return total


_DTYPE_SIZES = {
    'float': 4, 'c10::Half': 2, 'c10::BFloat16': 2, 'double': 8,
    'Half': 2, 'BFloat16': 2, 'Float': 4,
}


def _time_codecs(numel, world_size, device, repeat):
    """Median seconds of compress + decompress per method, and of a copy."""
    buffer = torch.randn(numel, device=device)
    copy_dst = torch.empty_like(buffer)
    halves = {
        dt: torch.empty(numel, dtype=dt, device=device)
        for dt in (torch.float16, torch.bfloat16)
    }

    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize()

    def ours(dt):
        # What the hook does with its state's kept send buffer.
        half = ddp_hooks._compress(buffer, world_size, dt, out=halves[dt])
        ddp_hooks._decompress(half, buffer)

    def theirs(dt):
        buffer.copy_(buffer.to(dt).div_(world_size))

    methods = {
        'copy_fp32': lambda: copy_dst.copy_(buffer),
        'ours.fp16': lambda: ours(torch.float16),
        'torch.fp16': lambda: theirs(torch.float16),
        'ours.bf16': lambda: ours(torch.bfloat16),
        'torch.bf16': lambda: theirs(torch.bfloat16),
    }
    times = {k: [] for k in methods}
    for _ in range(repeat + 1):
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
    results = []
    for size_mb in args.sizes_mb:
        numel = int(size_mb * MB) // 4
        x = _planted(rank, numel).to(device)
        exact = torch.stack([_planted(r, numel).double()
                             for r in range(world_size)]).mean(0).to(device)
        models = {}
        for name, (hook, _, _) in HOOKS.items():
            model = nn.parallel.DistributedDataParallel(
                _OneBucket(numel).to(device),
                device_ids=[rank] if use_cuda else None,
                bucket_cap_mb=size_mb * 2 + 1,
                gradient_as_bucket_view=True)
            if hook is not None:
                # Ours as the runner hook registers them: with a state
                # (which keeps the send buffers between steps on CPU).
                state = (ddp_hooks.CompressState(None)
                         if name.startswith('ours.') and 'compress' in name
                         else None)
                model.register_comm_hook(state, hook)
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
            entry['hooks'][name] = dict(
                wire_bytes=_wire_bytes(lambda: step(model)),
                rel_error=float(err.norm() / exact.norm()),
                max_abs_error=float(err.abs().max()),
                times=[])
        for _ in range(args.repeat):
            for name, model in models.items():
                dist.barrier()
                start = time.perf_counter()
                step(model)
                elapsed = torch.tensor([time.perf_counter() - start])
                # The slowest rank sets the step time.
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                entry['hooks'][name]['times'].append(float(elapsed))
        noop = statistics.median(entry['hooks']['noop']['times'])
        for name, data in entry['hooks'].items():
            data['step_s'] = statistics.median(data['times'])
            data['hook_s'] = max(data['step_s'] - noop, 0.0)
        dist.barrier()
        entry['codec_s'] = _time_codecs(numel, world_size, device,
                                        args.repeat)
        results.append(entry)
        del models
    if rank == 0:
        with open(os.path.join(folder, 'results.json'), 'w') as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _ratio(a, b):
    return a / b if b > 0 else float('nan')


def _ms(seconds):
    ms = seconds * 1e3
    return f'{ms:.1f} ms' if ms >= 1 else f'{ms:.2f} ms'


def _table(header, rows):
    """A Markdown table, as the README shows the results."""
    lines = ['| ' + ' | '.join(header) + ' |',
             '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
    return lines


# (family, our hook, PyTorch's) in the order of the step-time table.
_PAIRS = [(family, name, 'torch.' + name[len('ours.'):])
          for name, (_, _, family) in HOOKS.items()
          if name.startswith('ours.')]
_CODECS = ('ours.fp16', 'torch.fp16', 'ours.bf16', 'torch.bf16')


def report(results, world_size, backend, repeat=None):
    """The results as the README's two tables, then the verdict on the
    targets, as text."""
    rounds = '' if repeat is None else f', {repeat} rounds'
    lines = [f'{world_size} ranks, backend {backend}, torch '
             f'{torch.__version__}{rounds}']
    if backend == 'gloo':
        lines.append(f'CPU casts: {ddp_hooks.cpu_codec()}')
    ratios = {'allreduce': [], 'fp16': [], 'bf16': []}
    bytes_ok, worst = True, (0.0, '', 0)
    step_rows, codec_rows = [], []
    for entry in results:
        hooks = entry['hooks']
        fp32_bytes = entry['numel'] * 4
        bucket = f'{entry["size_mb"]:g} MB'
        for family, ours, theirs in _PAIRS:
            data = hooks[ours]
            r = _ratio(data['step_s'], hooks[theirs]['step_s'])
            ratios[family].append(r)
            wire = data['wire_bytes']
            if family != 'allreduce':
                bytes_ok &= wire == fp32_bytes // 2
            step_rows.append([
                bucket, f'`{ours[len("ours."):]}`', _ms(data['hook_s']),
                _ms(hooks[theirs]['hook_s']), f'{r:.2f}',
                f'{wire / MB:g}', f'{data["rel_error"]:.1e}'
            ])
        codec = entry['codec_s']
        cells = [bucket, _ms(codec['copy_fp32'])]
        for name in _CODECS:
            r = _ratio(codec[name], codec['copy_fp32'])
            if name.startswith('ours.'):
                worst = max(worst, (r, name, entry['size_mb']))
            cells.append(f'{r:.2f}x')
        codec_rows.append(cells)
    lines += [
        '', 'Time per bucket: `ours` and `PyTorch` are the hook\'s own time '
        '(the step minus that of a hook that communicates nothing); '
        '`ours / PyTorch` is the ratio of whole step times (medians; the '
        'slowest rank sets each step).', ''
    ]
    lines += _table([
        'bucket', 'hook', 'ours', 'PyTorch', 'ours / PyTorch',
        'wire MB (ours)', 'rel. error'
    ], step_rows)
    lines += ['', 'Compress + decompress on every rank at once, as a '
              'multiple of a plain copy of the fp32 bucket:', '']
    lines += _table([
        'bucket', 'fp32 copy', 'ours fp16', 'PyTorch fp16', 'ours bf16',
        'PyTorch bf16'
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
    # 1.5 is the byte ratio of the two (read 4 + write 2, then read 2 +
    # write 4, against read 4 + write 4): the floor for memory-bound passes.
    r, name, size = worst
    lines.append(f'  compress+decompress <= 1.5 x fp32 copy, every size: '
                 f'{"PASS" if r <= 1.5 else "FAIL"} (worst {r:.2f}x, '
                 f'{name} at {size:g} MB)')
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
        ax1.plot(sizes, [e['hooks'][name]['hook_s'] * 1e3 for e in results],
                 style, marker='o', label=name)
    ax1.set(xscale='log', yscale='log', xlabel='bucket size (MB of fp32)',
            ylabel='ms per bucket (hook only)',
            title='Time per bucket')
    ax1.legend(fontsize=7)
    for name in ('ours.fp16', 'torch.fp16', 'ours.bf16', 'torch.bf16'):
        style = '-' if name.startswith('ours.') else '--'
        ax2.plot(sizes, [
            e['codec_s'][name] / e['codec_s']['copy_fp32'] for e in results
        ], style, marker='o', label=name)
    ax2.axhline(1.5, color='grey', lw=0.8, ls=':', label='target 1.5x')
    ax2.set(xscale='log', xlabel='bucket size (MB of fp32)',
            ylabel='x time of a plain fp32 copy',
            title='Compress + decompress cost')
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _check_writable(parser, option, path):
    """``parser.error`` now, not after the run, if ``path`` cannot be
    written: its folder is missing or read-only, or it is a folder."""
    if os.path.isdir(path):
        parser.error(f'{option} {path}: is a directory, not a file')
    existed = os.path.exists(path)
    try:
        with open(path, 'a'):
            pass
    except OSError as e:
        parser.error(f'{option} {path}: cannot write there ({e.strerror})')
    if not existed:
        os.remove(path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        '--nproc', type=int, default=2, help='ranks (processes) to start')
    parser.add_argument(
        '--sizes-mb', type=float, nargs='+', default=[1, 4, 16, 64, 100],
        help='bucket sizes in MB of fp32 gradients')
    parser.add_argument(
        '--repeat', type=int, default=10,
        help='timed rounds per bucket size (every hook once per round)')
    parser.add_argument(
        '--warmup', type=int, default=2,
        help='untimed steps per hook before the rounds')
    parser.add_argument(
        '--backend', choices=['auto', 'gloo', 'nccl'], default='auto',
        help='auto: NCCL when every rank has a GPU, else gloo')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument(
        '--plot', help='draw a PNG here (needs matplotlib)')
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
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot needs matplotlib, which is not installed '
                         '(pip install matplotlib)')
    for option in ('json', 'plot'):
        if getattr(args, option):
            _check_writable(parser, f'--{option}', getattr(args, option))
    return args


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _worker, args=(args.nproc, folder, args), nprocs=args.nproc,
            start_method='spawn')
        with open(os.path.join(folder, 'results.json')) as f:
            results = json.load(f)
    print(report(results, args.nproc, args.backend, args.repeat))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(world_size=args.nproc, backend=args.backend,
                           torch=torch.__version__, results=results), f,
                      indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == '__main__':
    main()
