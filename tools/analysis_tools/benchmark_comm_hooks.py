"""Measure the communication hooks side by side, in one run.

Starts ``--nproc`` ranks (gloo on CPU, NCCL when every rank has a GPU) and,
for every bucket size, times one DDP backward step per hook, interleaving
the hooks round by round so that drift on a shared machine hits them all
alike. Compared:

* every hook registered in ``COMM_HOOKS`` but those on PowerSGD's state
  and the periodic ones (``post_local_sgd``, ``diloco``: they send across
  the nodes every ``period`` optimizer steps, after the step and outside
  any bucket, so a time per bucket cannot show them; train them to
  measure them) (read from the registry and the hook records, see
  :mod:`mmcv_custom.analysis.hook_benchmark`): today this project's
  ``allreduce_hook``, ``fp16_compress_hook`` and
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

For each hook it also reports the bytes it sends, by the one counting rule
of a training run's ``comm_MB`` (:mod:`mmcv_custom.comm.traffic`), from
what each rank hands to its collectives as input, read from the
profiler's record of each collective (shape and dtype; gloo and NCCL
record the input tensor only), the most of any rank: the tensor given to
``all_reduce``; half the send tensor of an ``all_to_all`` and half what an
``all_gather`` gathers (for the int8 hook, its pair: about its quantized
bucket once). A plugin's hooks are compared too, with a record or
without one, when ``--import MODULE`` (repeatable) names the modules
that register them. It also reports the error of
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

import torch

from mmcv_custom.analysis import check_output
from mmcv_custom.analysis.hook_benchmark import MB, worker
from mmcv_custom.analysis.hook_benchmark_report import plot, report
from mmcv_custom.analysis.plugins import add_import_option, plugin_parser
from mmcv_custom.launching.bench_ranks import spawn_ranks


def _parser():
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
    add_import_option(
        parser, 'the hooks it registers are compared too, with a record '
        'or without one (every rank imports it)')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--plot', help='draw a PNG here (needs matplotlib)')
    return parser


def parse_args(argv=None):
    # --import's modules imported here (a usage error if one cannot be);
    # each rank imports them again (spawned).
    parser = plugin_parser(_parser, argv, config=None)
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
    results = spawn_ranks(worker, args.nproc, args)
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
