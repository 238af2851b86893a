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
  dropped, to be added to the next step's gradient; 0 where that is not
  finite (a block with a NaN or inf leaves nothing worth keeping, and a
  NaN kept would poison every later step).

Blocks are either consecutive (:func:`quantize`, :func:`dequantize`) or
listed in a :class:`BlockTable`, each at its own offsets
(:func:`quantize_blocks`, :func:`dequantize_blocks`): that is how the DDP
hook cuts a bucket into per-parameter blocks and packs them by the rank
that owns them, in the same single pass.

Each step is a single fp32 operation in both implementations (the C file is
compiled without fused multiply-add), hence the same bits. On CUDA, with
Triton and ``MMCV_CUSTOM_INT8_FUSED=1``, a third implementation of the same
rule runs each direction in one kernel (:mod:`.int8_fused`), opt-in until a
GPU run has checked it bit for bit. Symmetric
(no zero point, -127..127) so that sums of dequantised copies stay
unbiased. Imports only torch.
"""
from typing import Dict, Optional, Tuple

import torch

from . import int8_fused
from .util import ceil_div

try:
    from .. import _cpu_codec
except ImportError:  # pragma: no cover - depends on the install
    _cpu_codec = None

__all__ = [
    'quantize', 'dequantize', 'num_blocks', 'uses_c_kernel', 'BlockTable',
    'quantize_blocks', 'dequantize_blocks', 'C_MAX_BLOCK', 'codec_in_use'
]

#: The largest block the C kernels take, as the C module says
#: (INT8_MAX_BLOCK); larger blocks, and every block without the C module,
#: run in torch's ops.
C_MAX_BLOCK = getattr(_cpu_codec, 'INT8_MAX_BLOCK', 0)


def num_blocks(numel: int, block: int) -> int:
    """Scales a tensor of ``numel`` values has in blocks of ``block``."""
    return ceil_div(numel, block)


def uses_c_kernel(x: torch.Tensor, block: int) -> bool:
    """Whether :func:`quantize` / :func:`dequantize` of ``x`` run in C."""
    return (_cpu_codec is not None and hasattr(_cpu_codec, 'int8_encode')
            and x.device.type == 'cpu' and 1 <= block <= C_MAX_BLOCK
            and torch.get_num_threads() == 1)


def codec_in_use(device: torch.device, block: int) -> str:
    """Say which implementation quantizes blocks of ``block`` values on
    ``device`` (for the log line that registers an int8 hook), chosen as
    :func:`quantize` chooses: the C kernel, else the fused kernels where
    asked for and able to run, else torch's ops. Where
    ``MMCV_CUSTOM_INT8_FUSED=1`` asks for the fused kernels and they do not
    run, it says so and why, so that the switch is never ignored without a
    word.

    Raises:
        ValueError: ``MMCV_CUSTOM_INT8_FUSED`` holds a value other than 1
            or 0 (:func:`.int8_fused.enabled`).
    """
    device = torch.device(device)
    asked = int8_fused.enabled()
    has_c = _cpu_codec is not None and hasattr(_cpu_codec, 'int8_encode')
    if device.type == 'cpu' and has_c and 1 <= block <= C_MAX_BLOCK:
        used = 'the C kernel'
        said = f'C kernel ({_cpu_codec.isa()}) when single-threaded'
    elif asked and int8_fused.unavailable_on(device) is None:
        return f'fused Triton kernels ({int8_fused.ENV}=1)'
    else:
        used = "torch's ops"
        said = 'torch ops'
        if device.type == 'cpu':
            said += (' (mmcv_custom._cpu_codec not built)' if not has_c else
                     f" (block_size={block} is over the C kernel's "
                     f'{C_MAX_BLOCK})')
    if not asked:
        return said
    why = int8_fused.unavailable_on(device) or 'but the C kernel comes first'
    return (f'{said}; {int8_fused.ENV}=1 asked for the fused kernels, {why}: '
            f'{device.type.upper()} buckets use {used}')


def _check(x: torch.Tensor, block: int) -> None:
    if x.dtype is not torch.float32 or not x.is_contiguous() or x.dim() != 1:
        raise ValueError('int8 quantisation takes a contiguous 1-D fp32 '
                         f'tensor, but got {x.dtype} of shape '
                         f'{tuple(x.shape)}')
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f'block should be an int >= 1, but got {block!r}')


def quantize(
    x: torch.Tensor,
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
        scales = torch.empty(
            num_blocks(n, block), dtype=torch.float32, device=x.device)
    if residual is not None:
        _check(residual, block)
        if residual.numel() != n:
            raise ValueError(f'residual has {residual.numel()} values, x '
                             f'{n}')
    if uses_c_kernel(x, block):
        _cpu_codec.int8_encode(x.data_ptr(), out.data_ptr(), scales.data_ptr(),
                               0 if residual is None else residual.data_ptr(),
                               n, block, float(prescale))
        return out, scales
    if _fused(x):
        int8_fused.quantize(x, block, prescale, residual, out, scales)
        return out, scales
    return _quantize_torch(x, block, prescale, residual, out, scales)


def _fused(x: torch.Tensor) -> bool:
    """Whether :mod:`.int8_fused`'s kernels are asked for and run here."""
    return int8_fused.enabled() and int8_fused.usable(x)


def _finite_or_zero(e: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(e), e, torch.zeros_like(e))


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
    q = (blocks / scales[:, None]).nan_to_num(
        nan=0.0, posinf=torch.inf, neginf=-torch.inf)
    q = q.round().clamp(-127, 127)
    if residual is not None:
        residual.copy_(
            _finite_or_zero(blocks - q * scales[:, None]).view(-1)[:n])
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
        _cpu_codec.int8_decode(q.data_ptr(), scales.data_ptr(), out.data_ptr(),
                               n, block, accumulate)
        return out
    if _fused(out) and q.is_contiguous():
        int8_fused.dequantize(q, scales, block, out, accumulate)
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


# Columns of a BlockTable row, and the residual modes. The torch ops need
# them without the C module too; with it, they must be the C module's own.
_SRC, _RES, _LEN, _PAYLOAD, _SCALE = range(5)
_MODES = {None: 0, 'feed': 1, 'collect': 2}


def _check_c_constants(codec) -> None:
    """Refuse a C module built for another table layout (a stale build)."""
    ours = dict(
        T_SRC=_SRC,
        T_RES=_RES,
        T_LEN=_LEN,
        T_PAYLOAD=_PAYLOAD,
        T_SCALE=_SCALE,
        T_COLS=5,
        INT8_NO_RESIDUAL=_MODES[None],
        INT8_FEED=_MODES['feed'],
        INT8_COLLECT=_MODES['collect'])
    theirs = {name: getattr(codec, name, None) for name in ours}
    if theirs != ours:
        raise ImportError(
            f'{codec.__file__} was built for another block table layout '
            f'({theirs}, expected {ours}); rebuild it with `make install` '
            '(or pip install -e .)')


if _cpu_codec is not None and hasattr(_cpu_codec, 'int8_encode'):
    _check_c_constants(_cpu_codec)


class BlockTable:
    """Blocks at their own offsets, for :func:`quantize_blocks` and
    :func:`dequantize_blocks`.

    Each row is one block: ``(src, res, length, payload, scale)``, the
    offsets of its values in the fp32 source (or, decoding, the fp32
    output), of its residual, and the byte offsets of its int8 payload and
    fp32 scale in a packed byte buffer. A table is built once per layout
    and reused every step; the extents it records let every call check
    that its tensors are large enough before any kernel runs.

    Args:
        rows (Tensor): int64 of shape ``(blocks, 5)``; lengths >= 1,
            offsets >= 0.
    """

    def __init__(self, rows: torch.Tensor) -> None:
        rows = rows.to(torch.int64).contiguous().reshape(-1, 5).cpu()
        if len(rows) and (rows[:, _LEN].min() < 1 or rows.min() < 0):
            raise ValueError('a block table needs lengths >= 1 and offsets '
                             '>= 0')
        self.rows = rows
        lengths = rows[:, _LEN]
        self.numel = int(lengths.sum())
        self.max_len = int(lengths.max()) if len(rows) else 0

        def extent(column, width):
            return int((rows[:, column] + width).max()) if len(rows) else 0

        self.src_extent = extent(_SRC, lengths)
        self.res_extent = extent(_RES, lengths)
        self.byte_extent = max(extent(_PAYLOAD, lengths), extent(_SCALE, 4))
        self._index: Dict[torch.device, tuple] = {}
        self._rows: Dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`rows` on ``device``, copied there once (what a kernel
        reads them from)."""
        if device not in self._rows:
            self._rows[device] = self.rows.to(device)
        return self._rows[device]

    def residual_index(self, device: torch.device) -> torch.Tensor:
        """The residual offset of every value, block after block in row
        order (e.g. where a compact per-value result goes in a bucket)."""
        return self._indices(device)[2]

    def _indices(self, device: torch.device) -> tuple:
        """Per-element index tensors for the torch path, built once per
        device: block of each value, and its source, residual and payload
        positions; and each block's 4 scale bytes."""
        if device not in self._index:
            rows = self.rows
            lengths = rows[:, _LEN]
            block = torch.repeat_interleave(torch.arange(len(rows)), lengths)
            first = torch.cumsum(lengths, 0) - lengths
            pos = torch.arange(self.numel) - first[block]
            self._index[device] = tuple(
                t.to(device)
                for t in (block, rows[block, _SRC] + pos,
                          rows[block, _RES] + pos, rows[block, _PAYLOAD] + pos,
                          rows[:, _SCALE, None] + torch.arange(4)))
        return self._index[device]


def _check_bytes(buf: torch.Tensor, table: BlockTable, name: str) -> None:
    if (buf.dtype is not torch.uint8 or not buf.is_contiguous()
            or buf.numel() < table.byte_extent):
        raise ValueError(f'{name} should be a contiguous uint8 tensor of at '
                         f'least {table.byte_extent} bytes, but got '
                         f'{buf.dtype} of shape {tuple(buf.shape)}')


def _check_floats(x: torch.Tensor, extent: int, name: str) -> None:
    if (x.dtype is not torch.float32 or not x.is_contiguous()
            or x.numel() < extent):
        raise ValueError(f'{name} should be a contiguous fp32 tensor of at '
                         f'least {extent} values, but got {x.dtype} of '
                         f'shape {tuple(x.shape)}')


def _table_in_c(x: torch.Tensor, table: BlockTable) -> bool:
    return (uses_c_kernel(x, table.max_len)
            and hasattr(_cpu_codec, 'int8_encode_table'))


def quantize_blocks(x: torch.Tensor,
                    table: BlockTable,
                    dst: torch.Tensor,
                    prescale: float = 1.0,
                    residual: Optional[torch.Tensor] = None,
                    residual_mode: str = 'feed') -> None:
    """Quantise the blocks of ``table``: each block's values of
    ``x * prescale`` as int8 into ``dst`` at its payload offset, and its
    fp32 scale at its scale offset (any byte offset), by the rule of the
    module docstring.

    Args:
        x (Tensor): fp32 values, read at each block's source offset.
        table (BlockTable): The blocks.
        dst (Tensor): uint8, written at the payload and scale offsets.
        prescale (float): Multiplies the values first. Defaults to 1.
        residual (Tensor, optional): fp32, read and written at each block's
            residual offset. Defaults to None.
        residual_mode (str): ``'feed'``: added to the values before
            rounding, then replaced by what rounding dropped (error
            feedback). ``'collect'``: what rounding dropped is added to it
            and the values are left alone (the owner of a shard keeping
            what re-quantizing the shard's sum drops).
    """
    if residual_mode not in ('feed', 'collect'):
        raise ValueError("residual_mode should be 'feed' or 'collect', but "
                         f'got {residual_mode!r}')
    _check_floats(x, table.src_extent, 'x')
    _check_bytes(dst, table, 'dst')
    if residual is not None:
        _check_floats(residual, table.res_extent, 'residual')
    mode = _MODES[None if residual is None else residual_mode]
    if not len(table):
        return
    if _table_in_c(x, table):
        _cpu_codec.int8_encode_table(
            x.data_ptr(), dst.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            table.rows.data_ptr(), len(table), float(prescale), mode)
        return
    if _fused(x):
        int8_fused.quantize_table(x, table, dst, prescale, residual, mode)
        return
    _quantize_blocks_torch(x, table, dst, prescale, residual, mode)


def _quantize_blocks_torch(x, table, dst, prescale, residual, mode):
    """:func:`quantize_blocks` in torch ops (any device); ``mode`` 0, 1 or
    2: no residual, feed, collect."""
    block, src, res, payload, scale_bytes = table._indices(x.device)
    v = x[src] * prescale
    if mode == 1:
        v = v + residual[res]
    a = v.abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    amax = torch.zeros(
        len(table), dtype=torch.float32,
        device=x.device).scatter_reduce_(0, block, a, 'amax')
    nan = torch.zeros_like(amax).index_add_(0, block,
                                            torch.isnan(v).float()) > 0
    scales = torch.where(nan, torch.full_like(amax, float('nan')),
                         torch.div(amax, 127.0))
    s = scales[block]
    q = v / s
    q = torch.where(torch.isnan(q), torch.zeros_like(q), q)
    q = q.round().clamp(-127, 127)
    if mode:
        e = _finite_or_zero(v - q * s)
        residual[res] = e if mode == 1 else residual[res] + e
    dst[payload] = q.to(torch.int8).view(torch.uint8)
    dst[scale_bytes] = scales.view(torch.uint8).view(-1, 4)


def dequantize_blocks(src: torch.Tensor,
                      table: BlockTable,
                      out: torch.Tensor,
                      accumulate: bool = False) -> torch.Tensor:
    """``payload * scale`` of each block of ``table``, read from the bytes
    of ``src``, into the fp32 ``out`` at the block's source offset (added to
    it when ``accumulate``). Returns ``out``."""
    _check_bytes(src, table, 'src')
    _check_floats(out, table.src_extent, 'out')
    if not len(table):
        return out
    if _table_in_c(out, table):
        _cpu_codec.int8_decode_table(src.data_ptr(), out.data_ptr(),
                                     table.rows.data_ptr(), len(table),
                                     bool(accumulate))
        return out
    if _fused(out):
        int8_fused.dequantize_table(src, table, out, accumulate)
        return out
    return _dequantize_blocks_torch(src, table, out, accumulate)


def _dequantize_blocks_torch(src, table, out, accumulate):
    """:func:`dequantize_blocks` in torch ops (any device)."""
    block, dst_index, _, payload, scale_bytes = table._indices(out.device)
    scales = src[scale_bytes].contiguous().view(torch.float32).view(-1)
    value = src[payload].view(torch.int8).float() * scales[block]
    out[dst_index] = out[dst_index] + value if accumulate else value
    return out
