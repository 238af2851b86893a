"""Time the hooks' codecs on one device, against its copy bandwidth.

A codec is memory bound: it reads a bucket and writes its compressed form
(or the reverse). So its speed is given as the bytes it must move at the
least (read plus write) over its time, and set against a plain copy of the
same fp32 bucket (``dst.copy_(src)``, ``2 S`` bytes) timed in the same run:
the fraction of copy bandwidth a codec reaches is what fusing its passes
could still gain. Each figure is the median of ``--repeat`` runs after
``--warmup``, each waited for (CUDA synchronised), on fixed random data.

Cases: the copy; int8 quantize (with and without error feedback) and
dequantize (:mod:`mmcv_custom.hooks.int8_codec`: its C kernels on one CPU
thread, torch's ops elsewhere), and on a GPU with Triton the same in one
fused kernel each (:mod:`mmcv_custom.hooks.int8_fused`); the bf16 and fp16
casts
(:mod:`mmcv_custom.hooks.cast`, dividing by 8 ranks on the way). Imports
only torch and :mod:`mmcv_custom.hooks`: it runs on a GPU image without
MMEngine (``tools/device_check.sh`` runs it there).

Examples:
    python tools/analysis_tools/benchmark_codec.py --device cuda \\
        --sizes-mb 16 64 256 --json work_dirs/codec.json
    python tools/analysis_tools/benchmark_codec.py --sizes-mb 4
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from mmcv_custom.hooks import cast, int8_codec, int8_fused

__all__ = ['CodecTiming', 'time_codecs', 'main']

MB = 2**20


@dataclasses.dataclass(frozen=True)
class CodecTiming:
    """One codec on one bucket size.

    Attributes:
        name (str): E.g. ``'int8 quantize'``.
        size_mb (float): The fp32 bucket, MiB.
        seconds (float): The median time.
        bytes_moved (int): Read plus written, at the least.
        copy_gbps (float): The copy's bandwidth in the same run, GB/s.
    """
    name: str
    size_mb: float
    seconds: float
    bytes_moved: int
    copy_gbps: float

    @property
    def gbps(self) -> float:
        """Bytes moved per second, GB/s."""
        return self.bytes_moved / self.seconds / 1e9

    @property
    def of_copy(self) -> float:
        """The fraction of the copy bandwidth reached."""
        return self.gbps / self.copy_gbps

    def to_dict(self) -> dict:
        return dict(
            dataclasses.asdict(self), gbps=self.gbps, of_copy=self.of_copy)


def _median_seconds(fn: Callable[[], object], device: torch.device,
                    warmup: int, repeat: int) -> float:

    def wait():
        if device.type == 'cuda':
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    wait()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_codecs(size_mb: float,
                device: str = 'cpu',
                block_size: int = 256,
                warmup: int = 3,
                repeat: int = 10) -> List[CodecTiming]:
    """The copy, the half casts and the int8 codec on one fp32 bucket of
    ``size_mb`` MiB on ``device``.

    The int8 codec is the hooks' (:mod:`mmcv_custom.hooks.int8_codec`:
    the C kernels on one CPU thread, torch's ops elsewhere); the casts are
    :mod:`mmcv_custom.hooks.cast`'s, dividing by 8 ranks on the way.
    """
    dev = torch.device(device)
    n = int(size_mb * MB) // 4
    x = torch.randn(n, device=dev)
    fp32 = 4 * n
    blocks = int8_codec.num_blocks(n, block_size)
    q = torch.empty(n, dtype=torch.int8, device=dev)
    scales = torch.empty(blocks, dtype=torch.float32, device=dev)
    residual = torch.zeros(n, device=dev)
    out = torch.empty(n, device=dev)
    int8 = n + 4 * blocks
    cases: Dict[str, tuple] = {
        'copy': (lambda: out.copy_(x), 2 * fp32),
        'int8 quantize':
        (lambda: int8_codec.quantize(x, block_size, 0.125, None, q, scales),
         fp32 + int8),
        'int8 quantize + error feedback': (lambda: int8_codec.quantize(
            x, block_size, 0.125, residual, q, scales), 3 * fp32 + int8),
        'int8 dequantize':
        (lambda: int8_codec.dequantize(q, scales, block_size, out),
         int8 + fp32),
    }
    if int8_fused.usable(x):  # the same, one Triton kernel per direction
        cases.update({
            'int8 quantize (fused)': (lambda: int8_fused.quantize(
                x, block_size, 0.125, None, q, scales), fp32 + int8),
            'int8 quantize + error feedback (fused)':
            (lambda: int8_fused.quantize(x, block_size, 0.125, residual, q,
                                         scales), 3 * fp32 + int8),
            'int8 dequantize (fused)':
            (lambda: int8_fused.dequantize(q, scales, block_size, out, False),
             int8 + fp32),
        })
    scratch = x.clone()  # the torch CPU path scales its input in place
    for dtype in (torch.bfloat16, torch.float16):
        half = torch.empty(n, dtype=dtype, device=dev)
        name = str(dtype).replace('torch.', '')
        cases[f'{name} compress'] = (
            lambda d=dtype, h=half: cast.compress(scratch, 8.0, d, h),
            fp32 + 2 * n)
        cases[f'{name} decompress'] = (lambda h=half: cast.decompress(h, out),
                                       2 * n + fp32)
    seconds = {
        name: _median_seconds(fn, dev, warmup, repeat)
        for name, (fn, _) in cases.items()
    }
    # The copy's own row is the reference of every row, itself included.
    copy = cases['copy'][1] / seconds['copy'] / 1e9
    return [
        CodecTiming(name, size_mb, seconds[name], moved, copy)
        for name, (_, moved) in cases.items()
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='\n'.join(__doc__.splitlines()[2:]))
    parser.add_argument(
        '--device', default='cpu', help='cpu (default) or cuda[:N]')
    parser.add_argument(
        '--sizes-mb',
        nargs='+',
        type=float,
        default=[64.0],
        metavar='MB',
        help='fp32 bucket sizes, MiB (default 64)')
    parser.add_argument(
        '--block-size',
        type=int,
        default=256,
        help='int8 values per scale (default 256, the hook\'s)')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--repeat', type=int, default=10)
    parser.add_argument('--json', metavar='OUT', help='also write JSON')
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked: a bad value is a usage error (exit 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f'--device should be cpu or cuda[:N], but got '
                     f'{args.device!r}')
    if device.type not in ('cpu', 'cuda'):
        parser.error(f'--device should be cpu or cuda[:N], but got '
                     f'{args.device!r}')
    if device.type == 'cuda' and not torch.cuda.is_available():
        parser.error(f'--device {args.device}: this torch sees no CUDA '
                     'device')
    if any(not size > 0 for size in args.sizes_mb):
        parser.error(f'--sizes-mb should be above 0, but got '
                     f'{min(args.sizes_mb):g}')
    for flag, value, least in (('--block-size', args.block_size, 1),
                               ('--warmup', args.warmup, 0), ('--repeat',
                                                              args.repeat, 1)):
        if value < least:
            parser.error(f'{flag} should be at least {least}, but got '
                         f'{value}')
    return args


def _device_name(device: torch.device) -> str:
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    return f'CPU, {torch.get_num_threads()} thread(s)'


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for size in args.sizes_mb:
        rows += time_codecs(size, args.device, args.block_size, args.warmup,
                            args.repeat)
    name = _device_name(device)
    print(f'## Codec speed on {name} (torch {torch.__version__})\n')
    print('| case | MiB | ms | GB/s | of copy |')
    print('|---|--:|--:|--:|--:|')
    for r in rows:
        print(f'| {r.name} | {r.size_mb:g} | {r.seconds * 1e3:.3f} | '
              f'{r.gbps:.1f} | {r.of_copy:.2f} |')
    print('\nGB/s: the bytes a case must read and write at the least, per '
          'second; of copy: that over the fp32 copy\'s in the same run')
    if args.json:
        out = dict(
            version=1,
            device=name,
            torch=torch.__version__,
            block_size=args.block_size,
            rows=[r.to_dict() for r in rows])
        tmp = f'{args.json}.{os.getpid()}.tmp'
        with open(tmp, 'w') as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == '__main__':
    sys.exit(main())
