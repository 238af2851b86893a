"""Scaling casts between a bucket's fp32 buffer and its fp16/bf16 copy.

The compressing hooks (:mod:`.half`) and the FSDP2 reduce-scatter
(:mod:`.sharded`) send a bucket as ``buffer / divisor`` rounded to half
precision and write the result back, scaled, into the fp32 buffer. On GPUs
one fused torch kernel does each direction. On CPU torch cannot scale and
cast in one pass, so the optional C kernel ``mmcv_custom._cpu_codec``
(built from ``csrc/cpu_codec.c`` by setup.py) does it when it was built
and torch runs one intra-op thread; otherwise torch's ops do, a chunk at a
time. Both give the same bits.
"""
from typing import Optional

import torch

try:
    # Optional one-pass CPU cast, built from csrc/cpu_codec.c by setup.py.
    # It is plain C that imports nothing; without it torch's ops are used.
    from .. import _cpu_codec
except ImportError:  # pragma: no cover - depends on the install
    _cpu_codec = None

__all__ = ['compress', 'decompress', 'cpu_codec']

# Elements per step of the torch fallback on CPU: 1 MiB of fp32, so that the
# scaled chunk is still in this core's cache when it is cast.
_CPU_CHUNK = 2**18

_CODEC_KIND = {torch.float16: 0, torch.bfloat16: 1}


def cpu_codec() -> str:
    """Say what casts buckets to and from half precision on CPU (for logs).

    ``'C kernel (<kernel set>) when single-threaded'`` when the one-pass
    kernel ``mmcv_custom._cpu_codec`` was built at install, and
    ``'torch ops (...)'`` when it was not (no C compiler). The kernel scales
    and casts in one pass, which torch's CPU ops cannot, and is
    single-threaded: it runs when torch does (``torch.get_num_threads() ==
    1``, what torchrun and MMEngine set for each rank). With more intra-op
    threads torch's multi-threaded ops do the casts instead.
    """
    if _cpu_codec is None:
        return 'torch ops (mmcv_custom._cpu_codec not built)'
    fp16 = '' if _cpu_codec.has_fp16() else ', bf16 only'
    return f'C kernel ({_cpu_codec.isa()}{fp16}) when single-threaded'


def _use_cpu_codec(fp32: torch.Tensor, half: torch.Tensor) -> bool:
    """Whether the C kernel can take this pair (it sees raw addresses)."""
    return (_cpu_codec is not None and fp32.device.type == 'cpu'
            and half.device.type == 'cpu' and fp32.dtype is torch.float32
            and fp32.is_contiguous() and half.is_contiguous()
            and half.numel() == fp32.numel()
            and (half.dtype is torch.bfloat16 or
                 (half.dtype is torch.float16 and _cpu_codec.has_fp16()))
            and torch.get_num_threads() == 1)


def compress(buffer: torch.Tensor,
             divisor: float,
             dtype: torch.dtype,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``buffer / divisor`` rounded to ``dtype`` (into ``out`` if given).

    The quotient is computed in fp32 (as a product with ``1 / divisor``,
    which equals the division exactly for the power-of-two world sizes
    and is within one fp32 rounding of it otherwise) and only then rounded
    to half. ``buffer`` may be overwritten: the hooks write the result into
    it later.
    """
    if out is None:
        out = torch.empty(buffer.numel(), dtype=dtype, device=buffer.device)
    scale = 1.0 / divisor
    if buffer.device.type != 'cpu':
        # On GPUs one fused kernel reads fp32 and writes half.
        torch.mul(buffer, scale, out=out)
    elif _use_cpu_codec(buffer, out):
        _cpu_codec.encode(buffer.data_ptr(), out.data_ptr(), buffer.numel(),
                          scale, _CODEC_KIND[dtype])
    else:
        # Torch on CPU cannot scale and convert in one pass (a converting
        # multiply goes through a temporary), so scale a chunk in place and
        # cast it while it is still in cache.
        for start in range(0, buffer.numel(), _CPU_CHUNK):
            chunk = buffer[start:start + _CPU_CHUNK]
            if scale != 1:
                chunk.mul_(scale)
            out[start:start + _CPU_CHUNK].copy_(chunk)
    return out


def decompress(half: torch.Tensor,
               buffer: torch.Tensor,
               divisor: float = 1) -> torch.Tensor:
    """Write ``half / divisor`` into the fp32 ``buffer`` and return it.

    In place into the bucket's own buffer instead of a new fp32 tensor: no
    second full-size copy at peak memory (pytorch/pytorch#45968).
    """
    scale = 1.0 / divisor
    if _use_cpu_codec(buffer, half):
        _cpu_codec.decode(half.data_ptr(), buffer.data_ptr(), buffer.numel(),
                          scale, _CODEC_KIND[half.dtype])
        return buffer
    buffer.copy_(half)
    if scale != 1:
        buffer.mul_(scale)
    return buffer
