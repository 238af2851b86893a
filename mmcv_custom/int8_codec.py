"""Blockwise symmetric int8 quantisation of gradient buckets.

One rule, two implementations that agree bit for bit: the one-pass C kernels
of ``mmcv_custom._cpu_codec`` on CPU (when built and torch runs one thread,
as in each DDP rank), and torch's ops everywhere else (GPUs, other builds).
For each block of ``block`` consecutive values ``v = x * prescale``, plus the
error-feedback ``residual`` when one is given:

* ``scale = max|v| / 127`` in fp32, NaN if the block holds a NaN;
* ``q = clamp(round_half_even(v / scale), -127, 127)`` as int8, and 0 where
  ``v / scale`` is NaN (an all-zero block, 0 / 0; an infinite value,
  inf / inf) — so a block with a non-finite value dequantises to NaN and
  the run's non-finite checks see it;
* the residual, when given, becomes ``v - q * scale``: what rounding
  dropped, to be added to the next step's gradient.

Each step is a single fp32 operation in both implementations (the C file is
compiled without fused multiply-add), hence the same bits. Symmetric
(no zero point, -127..127) so that sums of dequantised copies stay
unbiased. Imports only torch.
"""
from typing import Optional, Tuple

import torch

try:
    from . import _cpu_codec
except ImportError:  # pragma: no cover - depends on the install
    _cpu_codec = None

__all__ = ['quantize', 'dequantize', 'num_blocks', 'uses_c_kernel']

# What the C kernels take (INT8_MAX_BLOCK in csrc/cpu_codec.c).
_C_MAX_BLOCK = 4096


def num_blocks(numel: int, block: int) -> int:
    """Scales a tensor of ``numel`` values has in blocks of ``block``."""
    return -(-numel // block)


def uses_c_kernel(x: torch.Tensor, block: int) -> bool:
    """Whether :func:`quantize` / :func:`dequantize` of ``x`` run in C."""
    return (_cpu_codec is not None and hasattr(_cpu_codec, 'int8_encode')
            and x.device.type == 'cpu' and 1 <= block <= _C_MAX_BLOCK
            and torch.get_num_threads() == 1)


def _check(x: torch.Tensor, block: int) -> None:
    if x.dtype is not torch.float32 or not x.is_contiguous() or x.dim() != 1:
        raise ValueError('int8 quantisation takes a contiguous 1-D fp32 '
                         f'tensor, but got {x.dtype} of shape '
                         f'{tuple(x.shape)}')
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f'block should be an int >= 1, but got {block!r}')


def quantize(x: torch.Tensor,
             block: int,
             prescale: float = 1.0,
             residual: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x * prescale (+ residual)`` blockwise to int8.

    Args:
        x (Tensor): 1-D contiguous fp32 values (a bucket, or a shard).
        block (int): Values per scale.
        prescale (float): Multiplies ``x`` first (``1 / world_size``: the
            average is taken before any rounding). Defaults to 1.
        residual (Tensor, optional): fp32, like ``x``: added before
            rounding and overwritten with what rounding dropped (error
            feedback). Defaults to None.
        out, scales (Tensor, optional): Where to write the int8 values
            (``x.numel()``) and the fp32 scales (:func:`num_blocks`).

    Returns:
        tuple[Tensor, Tensor]: ``(q, scales)``.
    """
    _check(x, block)
    n = x.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.int8, device=x.device)
    if scales is None:
        scales = torch.empty(num_blocks(n, block), dtype=torch.float32,
                             device=x.device)
    if residual is not None:
        _check(residual, block)
        if residual.numel() != n:
            raise ValueError(f'residual has {residual.numel()} values, x '
                             f'{n}')
    if uses_c_kernel(x, block):
        _cpu_codec.int8_encode(
            x.data_ptr(), out.data_ptr(), scales.data_ptr(),
            0 if residual is None else residual.data_ptr(), n, block,
            float(prescale))
        return out, scales
    return _quantize_torch(x, block, prescale, residual, out, scales)


def _quantize_torch(x, block, prescale, residual, out, scales):
    """The rule of the module docstring in torch ops (any device)."""
    n = x.numel()
    v = x * prescale if prescale != 1 else x.clone()
    if residual is not None:
        v = v + residual
    pad = num_blocks(n, block) * block - n
    blocks = torch.nn.functional.pad(v, (0, pad)).view(-1, block)
    amax = blocks.abs().amax(dim=1)
    torch.div(amax, 127.0, out=scales)
    q = (blocks / scales[:, None]).nan_to_num(nan=0.0, posinf=torch.inf,
                                               neginf=-torch.inf)
    q = q.round().clamp(-127, 127)
    if residual is not None:
        residual.copy_((blocks - q * scales[:, None]).view(-1)[:n])
    out.copy_(q.view(-1)[:n])
    return out, scales


def dequantize(q: torch.Tensor,
               scales: torch.Tensor,
               block: int,
               out: Optional[torch.Tensor] = None,
               accumulate: bool = False) -> torch.Tensor:
    """``q * scale`` per block in fp32, into ``out`` (added to it when
    ``accumulate``: summing the ranks' copies of a shard)."""
    n = q.numel()
    if out is None:
        if accumulate:
            raise ValueError('accumulate needs an out tensor to add to')
        out = torch.empty(n, dtype=torch.float32, device=q.device)
    _check(out, block)
    if uses_c_kernel(out, block) and q.is_contiguous():
        _cpu_codec.int8_decode(q.data_ptr(), scales.data_ptr(),
                               out.data_ptr(), n, block, accumulate)
        return out
    return _dequantize_torch(q, scales, block, out, accumulate)


def _dequantize_torch(q, scales, block, out, accumulate):
    n = q.numel()
    pad = num_blocks(n, block) * block - n
    value = (torch.nn.functional.pad(q, (0, pad)).view(-1, block).float() *
             scales[:, None]).view(-1)[:n]
    if accumulate:
        out.add_(value)
    else:
        out.copy_(value)
    return out
