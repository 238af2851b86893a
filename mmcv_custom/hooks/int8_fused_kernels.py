"""The Triton kernels of :mod:`.int8_fused` (see there for the rule and
why each operation is written as it is). Imported only when they are first
used: Triton takes seconds to import, and every rank imports the hooks.
Imports torch's companion Triton and nothing of the project."""
import triton
import triton.language as tl

__all__ = [
    'quantize_kernel', 'dequantize_kernel', 'quantize_table_kernel',
    'dequantize_table_kernel'
]


@triton.jit
def _rule(v, nan):
    """Scales and q of a tile of blocks (one block a row), as
    int8_codec's rule: NaN scale for a block holding a NaN, q 0 where
    ``v / scale`` is NaN, rounded half to even, clamped."""
    amax = tl.max(tl.abs(v), axis=1)
    scale = tl.math.div_rn(amax, 127.0)
    scale = tl.where(nan, float('nan'), scale)
    q = tl.math.div_rn(v, scale[:, None])
    q = tl.where(q != q, 0.0, q)
    # Clamped before rounding, which for this range is the same as
    # after; then rounded half to even by the sum with 1.5 * 2^23 (whose
    # ulp is 1), keeping the sign of a zero as torch.round does.
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    r = (q + 12582912.0) - 12582912.0
    q = tl.where(r == 0.0, q * 0.0, r)
    return scale, q


@triton.jit
def _tile(n, block, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A program's consecutive blocks of ``block`` values (one a row):
    their numbers, each value's index, and which indices hold values."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    idx = rows[:, None] * block + cols[None, :]
    return rows, idx, (cols[None, :] < block) & (idx < n)


@triton.jit
def quantize_kernel(x_ptr, res_ptr, q_ptr, s_ptr, n, block, blocks, prescale,
                    HAS_RES: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
    rows, idx, mask = _tile(n, block, ROWS, COLS)
    v = tl.load(x_ptr + idx, mask=mask, other=0.0) * prescale
    if HAS_RES:
        v = v + tl.load(res_ptr + idx, mask=mask, other=0.0)
    nan = tl.sum((v != v).to(tl.int32), axis=1) > 0
    scale, q = _rule(v, nan)
    if HAS_RES:
        e = v - q * scale[:, None]
        tl.store(
            res_ptr + idx,
            tl.where(tl.abs(e) < float('inf'), e, 0.0),
            mask=mask)
    tl.store(q_ptr + idx, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < blocks)


@triton.jit
def dequantize_kernel(q_ptr, s_ptr, out_ptr, n, block, blocks,
                      ACC: tl.constexpr, ROWS: tl.constexpr,
                      COLS: tl.constexpr):
    rows, idx, mask = _tile(n, block, ROWS, COLS)
    q = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + rows, mask=rows < blocks, other=0.0)
    value = q * s[:, None]
    if ACC:
        value = tl.load(out_ptr + idx, mask=mask, other=0.0) + value
    tl.store(out_ptr + idx, value, mask=mask)


@triton.jit
def _table_rows(rows_ptr, nrows, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A tile's table rows: their offsets and the mask of their
    values (the columns int8_codec.BlockTable documents)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < nrows
    src = tl.load(rows_ptr + r * 5, mask=live, other=0)
    res = tl.load(rows_ptr + r * 5 + 1, mask=live, other=0)
    length = tl.load(rows_ptr + r * 5 + 2, mask=live, other=0)
    payload = tl.load(rows_ptr + r * 5 + 3, mask=live, other=0)
    scale_at = tl.load(rows_ptr + r * 5 + 4, mask=live, other=0)
    cols = tl.arange(0, COLS)
    mask = live[:, None] & (cols[None, :] < length[:, None])
    return live, src, res, payload, scale_at, cols, mask


@triton.jit
def quantize_table_kernel(x_ptr, res_ptr, dst_ptr, rows_ptr, nrows, prescale,
                          MODE: tl.constexpr, ROWS: tl.constexpr,
                          COLS: tl.constexpr):
    live, src, res, payload, scale_at, cols, mask = _table_rows(
        rows_ptr, nrows, ROWS, COLS)
    v = tl.load(
        x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0) * prescale
    at = res[:, None] + cols[None, :]
    if MODE == 1:
        v = v + tl.load(res_ptr + at, mask=mask, other=0.0)
    nan = tl.sum(((v != v) & mask).to(tl.int32), axis=1) > 0
    scale, q = _rule(v, nan)
    if MODE != 0:
        e = v - q * scale[:, None]
        e = tl.where(tl.abs(e) < float('inf'), e, 0.0)
        if MODE == 2:
            e = tl.load(res_ptr + at, mask=mask, other=0.0) + e
        tl.store(res_ptr + at, e, mask=mask)
    tl.store(
        dst_ptr + payload[:, None] + cols[None, :],
        q.to(tl.int8).to(tl.uint8, bitcast=True),
        mask=mask)
    bits = scale.to(tl.int32, bitcast=True)
    for k in tl.static_range(4):
        tl.store(
            dst_ptr + scale_at + k, ((bits >> (8 * k)) & 255).to(tl.uint8),
            mask=live)


@triton.jit
def dequantize_table_kernel(src_ptr, out_ptr, rows_ptr, nrows,
                            ACC: tl.constexpr, ROWS: tl.constexpr,
                            COLS: tl.constexpr):
    live, at, _, payload, scale_at, cols, mask = _table_rows(
        rows_ptr, nrows, ROWS, COLS)
    bits = tl.zeros([ROWS], dtype=tl.int32)
    for k in tl.static_range(4):
        byte = tl.load(src_ptr + scale_at + k, mask=live, other=0)
        bits = bits | (byte.to(tl.int32) << (8 * k))
    scale = bits.to(tl.float32, bitcast=True)
    q = tl.load(
        src_ptr + payload[:, None] + cols[None, :], mask=mask, other=0).to(
            tl.int8, bitcast=True).to(tl.float32)
    value = q * scale[:, None]
    out = out_ptr + at[:, None] + cols[None, :]
    if ACC:
        value = tl.load(out, mask=mask, other=0.0) + value
    tl.store(out, value, mask=mask)
