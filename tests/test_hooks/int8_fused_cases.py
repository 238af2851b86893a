"""The fused int8 kernels against the torch path, case by case: run by
``test_int8_fused.py`` under Triton's interpreter (CPU) and by
``tests/test_cuda`` on a GPU. ``python -m tests.test_hooks.int8_fused_cases
DEVICE`` prints one line per case that differs, then ``OK`` or ``DIFF``."""
import sys

import torch

from mmcv_custom.hooks import int8_codec, int8_fused
from mmcv_custom.hooks.int8_codec import (BlockTable, _dequantize_blocks_torch,
                                          _dequantize_torch,
                                          _quantize_blocks_torch,
                                          _quantize_torch)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN, and the same sign of
    every zero."""
    a, b = a.cpu(), b.cpu()
    if not a.is_floating_point():
        return torch.equal(a, b)
    fa, fb = a.nan_to_num(0.0), b.nan_to_num(0.0)
    return (torch.equal(a.isnan(), b.isnan()) and torch.equal(fa, fb)
            and torch.equal(fa.signbit(), fb.signbit()))


def _values(n: int, seed: int) -> torch.Tensor:
    """Ordinary values with the cases the rule names: an all-zero block,
    -0.0, NaN, +-inf, denormals."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    x[:64] = 0
    x[70] = -0.0
    x[100] = float('nan')
    x[300] = float('inf')
    x[700] = -float('inf')
    x[1000:1010] = 1e-40
    return x


def plain_cases(device: str) -> list:
    """Differences of :func:`int8_fused.quantize`/``dequantize`` from the
    torch path, over block sizes, prescales and residuals."""
    n = 3000
    x = _values(n, 0).to(device)
    res0 = (torch.randn(n, generator=torch.Generator().manual_seed(1)) *
            1e-3).to(device)
    found = []
    for block, prescale, with_res in [(256, 1.0, False), (32, 0.125, True),
                                      (1000, 1 / 3, True), (7, 1.0, True),
                                      (5000, 0.5, False)]:
        outs = []
        for fused in (False, True):
            r = res0.clone() if with_res else None
            q = torch.empty(n, dtype=torch.int8, device=device)
            s = torch.empty(int8_codec.num_blocks(n, block), device=device)
            (int8_fused.quantize if fused else _quantize_torch)(x, block,
                                                                prescale, r, q,
                                                                s)
            back = torch.empty(n, device=device)
            total = torch.randn(
                n, generator=torch.Generator().manual_seed(5)).to(device)
            for out, acc in ((back, False), (total, True)):
                (int8_fused.dequantize if fused else _dequantize_torch)(q, s,
                                                                        block,
                                                                        out,
                                                                        acc)
            outs.append([q, s, back, total] + ([r] if with_res else []))
        for i, (a, b) in enumerate(zip(*outs)):
            if not _same(a, b):
                found.append(f'plain block {block} prescale {prescale:g} '
                             f'residual {with_res}: output {i}')
    return found


def table_cases(device: str) -> list:
    """Differences of the block-table kernels from the torch path: blocks
    of several lengths at scattered offsets, scales at unaligned bytes,
    every residual mode."""
    rows, payload, src = [], 0, 0
    for length in (5, 256, 256, 31, 1, 100, 256):
        rows.append([src, src + 3, length, payload + 4, payload + 1])
        payload += 6 + length
        src += length + 7
    table = BlockTable(torch.tensor(rows))
    x = torch.randn(src + 10, generator=torch.Generator().manual_seed(2))
    x[20] = float('nan')
    x[300:310] = 0
    x[400] = float('inf')
    x = x.to(device)
    found = []
    for mode, prescale in ((0, 1.0), (1, 0.25), (2, 1.0)):
        outs = []
        for fused in (False, True):
            r = (
                torch.randn(
                    src +
                    20, generator=torch.Generator().manual_seed(9)).to(device)
                if mode else None)
            dst = torch.zeros(payload + 8, dtype=torch.uint8, device=device)
            if fused:
                int8_fused.quantize_table(x, table, dst, prescale, r, mode)
            else:
                _quantize_blocks_torch(x, table, dst, prescale, r, mode)
            out = torch.randn(
                src + 10,
                generator=torch.Generator().manual_seed(3)).to(device)
            total = out.clone()
            for target, acc in ((out, False), (total, True)):
                if fused:
                    int8_fused.dequantize_table(dst, table, target, acc)
                else:
                    _dequantize_blocks_torch(dst, table, target, acc)
            outs.append([dst, out, total] + ([r] if mode else []))
        for i, (a, b) in enumerate(zip(*outs)):
            if not _same(a, b):
                found.append(f'table mode {mode}: output {i}')
    return found


if __name__ == '__main__':
    found = plain_cases(sys.argv[1]) + table_cases(sys.argv[1])
    print('\n'.join(found + ['DIFF' if found else 'OK']))
