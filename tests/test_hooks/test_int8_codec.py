"""Blockwise int8 quantisation (``mmcv_custom.hooks.int8_codec``): the C
kernels of every kernel set this CPU runs against the torch rule, bit for
bit, on the values a quantiser must get right; and the rule itself on cases
worked out by hand."""
import types

import pytest
import torch

from mmcv_custom.hooks import int8_codec
from mmcv_custom.hooks.int8_codec import (_dequantize_torch, _quantize_torch,
                                          dequantize, num_blocks, quantize)

codec = int8_codec._cpu_codec
KERNEL_SETS = codec.supported() if codec is not None else ()
needs_c = pytest.mark.skipif(codec is None, reason='C codec not built')


@pytest.fixture(params=KERNEL_SETS or ['none'])
def kernel_set(request):
    if codec is None:
        pytest.skip('C codec not built')
    best = codec.isa()
    codec.use(request.param)
    yield request.param
    codec.use(best)


def _same_bits(got, want):
    if got.dtype is torch.float32:
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        got, want = got[~nan].view(torch.int32), want[~nan].view(torch.int32)
    mismatch = got != want
    assert not mismatch.any(), (
        f'{int(mismatch.sum())} of {got.numel()} differ, first at '
        f'{int(mismatch.nonzero()[0])}')


def _inputs(numel, seed=0):
    """Gradient-like values of many magnitudes, with exact ties between two
    int8 steps, zeros, fp32 subnormals, and blocks of one huge value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    x *= torch.exp2(torch.randint(-30, 30, (numel, ), generator=gen).float())
    x[::7] = 0.0
    x[3::11] = 1e-40  # subnormal
    x[5::13] = -1e-42
    # A block of 2 * 127 = 254 as its maximum has scale 2 exactly: odd
    # multiples of 1 are ties at q + 0.5.
    if numel >= 512:
        x[256:512] = torch.arange(256).float() - 127.0
        x[256] = 254.0
    return x


@needs_c
@pytest.mark.parametrize('block', [1, 3, 64, 256, 4096])
@pytest.mark.parametrize('prescale', [1.0, 0.5, 1 / 3])
@pytest.mark.parametrize('with_residual', [False, True])
def test_c_encode_is_the_torch_rule(kernel_set, block, prescale,
                                    with_residual):
    n = 10_000 + 37  # a partial last block
    x = _inputs(n)
    res_c = _inputs(n, seed=1) * 1e-3 if with_residual else None
    res_t = res_c.clone() if with_residual else None
    q_c, s_c = quantize(x, block, prescale, res_c)
    q_t, s_t = _quantize_torch(x, block, prescale, res_t,
                               torch.empty(n, dtype=torch.int8),
                               torch.empty(num_blocks(n, block)))
    _same_bits(s_c, s_t)
    _same_bits(q_c, q_t)
    if with_residual:
        _same_bits(res_c, res_t)


@needs_c
@pytest.mark.parametrize('block', [1, 3, 256])
@pytest.mark.parametrize('accumulate', [False, True])
def test_c_decode_is_the_torch_rule(kernel_set, block, accumulate):
    n = 5_000 + 11
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (n, ), generator=gen, dtype=torch.int8)
    scales = _inputs(num_blocks(n, block), seed=3).abs()
    base = _inputs(n, seed=4)
    got = dequantize(q, scales, block, base.clone(), accumulate)
    want = _dequantize_torch(q, scales, block, base.clone(), accumulate)
    _same_bits(got, want)


def test_the_rule_by_hand():
    # One block: max 254 -> scale 2; 3 / 2 = 1.5 and 5 / 2 = 2.5 are ties
    # (to even: 2 and 2); -1 / 2 = -0.5 -> -0.
    x = torch.tensor([254.0, 3.0, 5.0, -1.0])
    residual = torch.zeros(4)
    q, scales = quantize(x, 4, residual=residual)
    assert scales.tolist() == [2.0]
    assert q.tolist() == [127, 2, 2, 0]
    assert residual.tolist() == [0.0, -1.0, 1.0, -1.0]
    assert dequantize(q, scales, 4).tolist() == [254.0, 4.0, 4.0, 0.0]


def test_zero_and_non_finite_blocks():
    x = torch.tensor([0.0, 0.0, 1.0, float('inf'), 2.0, float('nan')])
    q, scales = quantize(x, 2)
    assert scales[0] == 0 and q[:2].tolist() == [0, 0]
    # inf / inf is NaN: 0, like 1 / inf.
    assert torch.isinf(scales[1]) and q[2:4].tolist() == [0, 0]
    assert torch.isnan(scales[2]) and q[4:].tolist() == [0, 0]
    out = dequantize(q, scales, 2)
    assert out[:2].tolist() == [0.0, 0.0]
    # Non-finite blocks come back non-finite: the run's checks see them.
    assert not torch.isfinite(out[2:]).any()


def test_error_bound_and_prescale():
    x = _inputs(4096, seed=5)
    q, scales = quantize(x, 256, prescale=0.25)
    back = dequantize(q, scales, 256)
    err = (back - x * 0.25).abs().view(-1, 256)
    assert (err <= scales[:, None] / 2 * (1 + 1e-6)).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match='block should be an int >= 1'):
        quantize(torch.ones(4), 0)
    with pytest.raises(ValueError, match='contiguous 1-D fp32'):
        quantize(torch.ones(4, dtype=torch.float64), 2)
    if codec is not None:
        with pytest.raises(ValueError, match=r'block must be in \[1, 4096\]'):
            codec.int8_encode(0, 0, 0, 0, 0, 0, 1.0)


# -- block tables: blocks at their own offsets --------------------------------
def _shuffled_table(n, seed=0, longest=300):
    """Blocks of 1 to ``longest`` values tiling ``[0, n)``, packed in a
    shuffled order, each as 4 scale bytes then its payload (so payloads
    and scales sit at every byte alignment)."""
    gen = torch.Generator().manual_seed(seed)
    pieces, start = [], 0
    while start < n:
        length = min(
            int(torch.randint(1, longest + 1, (1, ), generator=gen)),
            n - start)
        pieces.append((start, length))
        start += length
    rows, at = [], 0
    for k in torch.randperm(len(pieces), generator=gen).tolist():
        start, length = pieces[k]
        rows.append((start, start, length, at + 4, at))
        at += 4 + length
    return int8_codec.BlockTable(torch.tensor(rows)), at


@needs_c
@pytest.mark.parametrize('mode', [0, 1, 2])
def test_c_table_is_the_torch_rule(kernel_set, mode):
    n = 20_000
    x = _inputs(n)
    x[100] = float('nan')
    x[5000] = float('inf')
    table, nbytes = _shuffled_table(n)
    residual = _inputs(n, seed=1) * 1e-3
    got = {}
    for name, quant, dequant in (
        ('c', lambda *a: int8_codec.quantize_blocks(*a[:5], ('feed', 'feed',
                                                             'collect')[mode])
         if mode else int8_codec.quantize_blocks(*a[:4]),
         int8_codec.dequantize_blocks),
        ('torch', lambda *a: int8_codec._quantize_blocks_torch(*a, mode),
         int8_codec._dequantize_blocks_torch)):
        packed = torch.zeros(nbytes, dtype=torch.uint8)
        res = residual.clone()
        quant(x, table, packed, 0.5, res if mode else None)
        out = dequant(packed, table, torch.empty(n), False)
        summed = dequant(packed, table, _inputs(n, seed=2), True)
        got[name] = (packed, res, out, summed)
    for a, b in zip(got['c'], got['torch']):
        _same_bits(a, b)
    packed, res, out, _ = got['c']
    # A block with a NaN or inf keeps nothing in its residual.
    assert torch.isfinite(res).all()
    if mode == 0:
        assert torch.equal(res, residual)


def test_table_modes_by_hand():
    # Two blocks of one parameter, stored second-first: [254, 3] -> scale
    # 2, [5, -1] -> scale 5 / 127.
    x = torch.tensor([254.0, 3.0, 5.0, -1.0])
    table = int8_codec.BlockTable(
        torch.tensor([[2, 2, 2, 4, 0], [0, 0, 2, 10, 6]]))
    packed = torch.zeros(12, dtype=torch.uint8)
    residual = torch.full((4, ), 0.5)
    int8_codec.quantize_blocks(x, table, packed, 1.0, residual, 'collect')
    assert packed[6:10].clone().view(torch.float32).item() == 2.0
    assert packed[10:12].view(torch.int8).tolist() == [127, 2]  # 1.5 -> 2
    assert residual[:2].tolist() == [0.5, -0.5]  # 0.5 + (3 - 4)
    back = int8_codec.dequantize_blocks(packed, table, torch.zeros(4))
    assert back[:2].tolist() == [254.0, 4.0]
    # Feed adds the residual first, then replaces it.
    residual = torch.tensor([0.0, 1.0, 0.0, 0.0])
    int8_codec.quantize_blocks(x, table, packed, 1.0, residual, 'feed')
    assert packed[10:12].view(torch.int8).tolist() == [127, 2]  # 4 / 2
    assert residual[:2].tolist() == [0.0, 0.0]


def test_table_checks_its_tensors():
    table, nbytes = _shuffled_table(1000)
    x = torch.randn(1000)
    with pytest.raises(ValueError, match=f'at least {nbytes} bytes'):
        int8_codec.quantize_blocks(x, table,
                                   torch.zeros(nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match='at least 1000 values'):
        int8_codec.quantize_blocks(x[:999], table,
                                   torch.zeros(nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'feed' or 'collect'"):
        int8_codec.quantize_blocks(
            x,
            table,
            torch.zeros(nbytes, dtype=torch.uint8),
            residual=torch.zeros(1000),
            residual_mode='add')
    with pytest.raises(ValueError, match='lengths >= 1'):
        int8_codec.BlockTable(torch.tensor([[0, 0, 0, 0, 0]]))
    if codec is not None:
        rows = torch.tensor([[0, 0, 5000, 4, 0]])
        with pytest.raises(ValueError, match=r'length must be in \[1, 4096\]'):
            codec.int8_decode_table(1, 1, rows.data_ptr(), 1, False)


@pytest.mark.skipif(int8_codec._cpu_codec is None, reason='no C module')
def test_block_table_layout_is_the_c_modules_own():
    """The C module exports its table columns, residual modes and largest
    block; the Python side reads them, and refuses a build whose layout
    differs instead of passing it wrong offsets."""
    codec = int8_codec._cpu_codec
    assert int8_codec.C_MAX_BLOCK == codec.INT8_MAX_BLOCK >= 256
    int8_codec._check_c_constants(codec)
    stale = types.SimpleNamespace(
        **{n: getattr(codec, n)
           for n in dir(codec) if n.isupper()},
        __file__='/old/_cpu_codec.so')
    stale.T_SCALE, stale.T_PAYLOAD = codec.T_PAYLOAD, codec.T_SCALE
    with pytest.raises(
            ImportError,
            match='/old/_cpu_codec.so was built '
            'for another block table layout.*make install'):
        int8_codec._check_c_constants(stale)
