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

Examples:
    python tools/benchmark_comm_hooks.py --nproc 2 --json bench.json \\
        --plot bench.png
    python tools/benchmark_comm_hooks.py --sizes-mb 1 4 --repeat 3  # quick
"""
import argparse
import json
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


def report(results, world_size, backend):
    """The table and the verdict on the issue's targets, as text."""
    lines = [
        f'{world_size} ranks, backend {backend}, torch {torch.__version__}',
        '',
        f'{"bucket":>8} {"hook":<26} {"ms/bucket":>10} {"vs torch":>9} '
        f'{"wire MB":>8} {"vs fp32":>8} {"rel err":>9}'
    ]
    if backend == 'gloo':
        lines.insert(1, f'CPU casts: {ddp_hooks.cpu_codec()}')
    ratios = {'allreduce': [], 'fp16': [], 'bf16': []}
    bytes_ok, worst = True, (0.0, '', 0)
    for entry in results:
        hooks = entry['hooks']
        fp32_bytes = entry['numel'] * 4
        for name, (_, wire_dtype, family) in HOOKS.items():
            if name == 'noop':
                continue
            data = hooks[name]
            vs_torch = ''
            if name.startswith('ours.'):
                torch_name = 'torch.' + name[len('ours.'):]
                r = _ratio(data['step_s'], hooks[torch_name]['step_s'])
                ratios[family].append(r)
                vs_torch = f'{r:.3f}'
            wire = data['wire_bytes']
            if name.startswith('ours.') and family != 'allreduce':
                bytes_ok &= wire == fp32_bytes // 2
            lines.append(
                f'{entry["size_mb"]:>6g}MB {name:<26} '
                f'{data["hook_s"] * 1e3:>10.2f} {vs_torch:>9} '
                f'{wire / MB:>8.2f} {wire / fp32_bytes:>8.3f} '
                f'{data["rel_error"]:>9.2e}')
        codec = entry['codec_s']
        cells = []
        for name in ('ours.fp16', 'torch.fp16', 'ours.bf16', 'torch.bf16'):
            r = _ratio(codec[name], codec['copy_fp32'])
            if name.startswith('ours.'):
                worst = max(worst, (r, name, entry['size_mb']))
            cells.append(f'{name} {r:.2f}x')
        lines.append(f'{"":>8} compress+decompress vs fp32 copy '
                     f'({codec["copy_fp32"] * 1e3:.2f} ms): ' +
                     ', '.join(cells))
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


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--nproc', type=int, default=2)
    parser.add_argument(
        '--sizes-mb', type=float, nargs='+', default=[1, 4, 16, 64, 100],
        help='bucket sizes in MB of fp32 gradients')
    parser.add_argument('--repeat', type=int, default=10)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument(
        '--backend', choices=['auto', 'gloo', 'nccl'], default='auto')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--plot', help='draw a PNG here')
    args = parser.parse_args()
    if args.backend == 'auto':
        args.backend = ('nccl' if torch.cuda.is_available()
                        and torch.cuda.device_count() >= args.nproc else
                        'gloo')
    if args.repeat < 1 or args.warmup < 1:
        parser.error('--repeat and --warmup must be at least 1')
    return args


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _worker, args=(args.nproc, folder, args), nprocs=args.nproc,
            start_method='spawn')
        with open(os.path.join(folder, 'results.json')) as f:
            results = json.load(f)
    print(report(results, args.nproc, args.backend))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(world_size=args.nproc, backend=args.backend,
                           torch=torch.__version__, results=results), f,
                      indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == '__main__':
    main()
