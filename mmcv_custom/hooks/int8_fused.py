"""The int8 codec in one pass per direction on a GPU: Triton kernels.

On a GPU, :mod:`.int8_codec`'s torch path quantizes in about a dozen
kernels (scale, pad, abs, amax, divide, round, clamp, residual, cast...),
each reading and writing the whole bucket, and its block-table path
gathers and scatters through index tensors as large as the bucket. These
kernels do the same rule (the module docstring of :mod:`.int8_codec`) in
one pass: each program loads a few blocks once, reduces their maxima in
registers and writes the int8 payload, the fp32 scales and the residual.

Bit for bit the torch path, by construction:

* the same fp32 operations in the same order: ``x * prescale``, ``+
  residual``, ``max |v| / 127``, ``v / scale``, round half to even,
  clamp, ``v - q * scale``;
* IEEE division (``tl.div_rn``; Triton's ``/`` is approximate on GPUs),
  rounding half to even (as ``torch.round``) by adding and subtracting
  ``1.5 * 2^23``, exact for the clamped range, and no fused multiply-add
  (``enable_fp_fusion=False``: ``v - q * scale`` is a product rounded,
  then a difference, as in torch);
* NaN, inf and all-zero blocks as torch treats them (a NaN scale, q 0,
  the residual 0 where it is not finite).

Used by :mod:`.int8_codec` for CUDA tensors when Triton imports and the
environment sets ``MMCV_CUSTOM_INT8_FUSED=1`` (any other value but ``0``
is refused, :func:`enabled`). It stays opt-in until a GPU
run has shown it bit for bit and at speed (``tools/device_check.sh``,
whose tests compare it with the torch path). Under ``TRITON_INTERPRET=1``
(set before this module is imported) the kernels run on CPU tensors,
through Triton's interpreter: how the suite checks them where there is no
GPU.

Imports torch and, optionally, Triton; nothing else of the project.
"""
import importlib
import importlib.util
import os
from typing import Optional

import torch

__all__ = [
    'AVAILABLE', 'ENV', 'enabled', 'unavailable_on', 'usable', 'quantize',
    'dequantize', 'quantize_table', 'dequantize_table'
]

#: The environment variable that turns the fused kernels on.
ENV = 'MMCV_CUSTOM_INT8_FUSED'
#: Whether Triton is installed (it is imported with the kernels, on first
#: use: :mod:`.int8_fused_kernels`).
AVAILABLE = importlib.util.find_spec('triton') is not None
# Values one program handles: a few blocks, loaded once.
_TILE = 4096
_OPTIONS = dict(enable_fp_fusion=False)


def enabled() -> bool:
    """Whether ``MMCV_CUSTOM_INT8_FUSED=1`` asks for the fused kernels.

    Raises:
        ValueError: The variable is set to something other than ``1`` or
            ``0`` (``yes``, ``true``, ``2``...): a switch that reads such a
            value as "off" would leave the user believing it is on.
    """
    value = os.environ.get(ENV, '')
    if value not in ('', '0', '1'):
        raise ValueError(
            f'{ENV} should be 1 (the int8 codec in fused Triton kernels, '
            f'on CUDA) or 0 (not), but got {value!r}')
    return value == '1'


def unavailable_on(device: torch.device) -> Optional[str]:
    """Why the kernels cannot run on ``device``, in words for the log
    (they need CUDA, or Triton's interpreter, and Triton installed); None
    where they can."""
    if (torch.device(device).type != 'cuda'
            and os.environ.get('TRITON_INTERPRET') != '1'):
        return 'which run on CUDA only'
    if not AVAILABLE:
        return 'but Triton is not installed'
    return None


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x``'s device."""
    return unavailable_on(x.device) is None


def _k():
    """The kernels' module, imported on first use."""
    return importlib.import_module(f'{__package__}.int8_fused_kernels')


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _shape(width: int):
    """``(ROWS, COLS)``: blocks per program and the block's width, a power
    of two (Triton's tiles are)."""
    cols = 1 << max(int(width) - 1, 0).bit_length()
    return max(1, _TILE // cols), cols


def quantize(x: torch.Tensor, block: int, prescale: float,
             residual: Optional[torch.Tensor], out: torch.Tensor,
             scales: torch.Tensor) -> None:
    """:func:`.int8_codec.quantize` in one kernel (tensors checked and
    allocated by the caller)."""
    n = x.numel()
    blocks = scales.numel()
    if not blocks:
        return
    rows, cols = _shape(block)
    _k().quantize_kernel[(_cdiv(blocks, rows), )](
        x,
        x if residual is None else residual,
        out,
        scales,
        n,
        block,
        blocks,
        float(prescale),
        HAS_RES=residual is not None,
        ROWS=rows,
        COLS=cols,
        **_OPTIONS)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int,
               out: torch.Tensor, accumulate: bool) -> None:
    """:func:`.int8_codec.dequantize` in one kernel."""
    blocks = scales.numel()
    if not blocks:
        return
    rows, cols = _shape(block)
    _k().dequantize_kernel[(_cdiv(blocks, rows), )](
        q,
        scales,
        out,
        q.numel(),
        block,
        blocks,
        ACC=bool(accumulate),
        ROWS=rows,
        COLS=cols,
        **_OPTIONS)


def quantize_table(x: torch.Tensor, table, dst: torch.Tensor, prescale: float,
                   residual: Optional[torch.Tensor], mode: int) -> None:
    """:func:`.int8_codec.quantize_blocks` in one kernel; ``mode`` 0, 1 or
    2: no residual, feed, collect."""
    rows, cols = _shape(table.max_len)
    _k().quantize_table_kernel[(_cdiv(len(table), rows), )](
        x,
        x if residual is None else residual,
        dst,
        table.rows_on(x.device),
        len(table),
        float(prescale),
        MODE=mode,
        ROWS=rows,
        COLS=cols,
        **_OPTIONS)


def dequantize_table(src: torch.Tensor, table, out: torch.Tensor,
                     accumulate: bool) -> None:
    """:func:`.int8_codec.dequantize_blocks` in one kernel."""
    rows, cols = _shape(table.max_len)
    _k().dequantize_table_kernel[(_cdiv(len(table), rows), )](
        src,
        out,
        table.rows_on(out.device),
        len(table),
        ACC=bool(accumulate),
        ROWS=rows,
        COLS=cols,
        **_OPTIONS)
