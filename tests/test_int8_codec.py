"""Blockwise int8 quantisation (``mmcv_custom.int8_codec``): the C kernels
of every kernel set this CPU runs against the torch rule, bit for bit, on
the values a quantiser must get right; and the rule itself on cases worked
out by hand."""
import pytest
import torch

from mmcv_custom import int8_codec
from mmcv_custom.int8_codec import (_dequantize_torch, _quantize_torch,
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
