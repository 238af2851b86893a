"""The one-pass CPU cast (``mmcv_custom._cpu_codec``) against torch's casts.

The hooks use the C kernel on CPU when it is built and torch runs one
thread (as in these tests, see ``conftest.py``), and torch's ops otherwise;
both must give the same bits, so switching between them never changes a
training run. Every kernel set this CPU can run is tested (the module picks
the best at import; older CPUs get the others). NaN is compared as NaN:
torch's own vectorised and scalar bf16 casts already disagree on its
payload.
"""
import pytest
import torch

from mmcv_custom.hooks import cast

codec = cast._cpu_codec
KERNEL_SETS = codec.supported() if codec is not None else ()

HALF = [torch.float16, torch.bfloat16]
KIND = {torch.float16: 0, torch.bfloat16: 1}
# Reciprocals of world sizes and of FSDP-style split factors.
SCALES = [1.0, 0.5, 0.125, 1 / 3, 1 / 6]


def assert_same_bits(got, want):
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int16 if got.element_size() == 2 else torch.int32
    mismatch = (got.view(bits) != want.view(bits)) & ~nan
    assert not mismatch.any(), (
        f'{int(mismatch.sum())} of {got.numel()} differ, first at '
        f'{int(mismatch.nonzero()[0])}: got {got[mismatch][0].item()!r}, '
        f'want {want[mismatch][0].item()!r}')


def fp32_inputs(numel, seed=0):
    """Values over the whole fp32 range, with what a cast must get right:
    zeros, infinities, NaN, fp32 subnormals, the fp16 and bf16 overflow
    thresholds, and exact ties between two half-precision neighbours."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(
        numel, generator=gen) * torch.pow(
            10.0,
            torch.randint(-40, 38, (numel, ), generator=gen).float())
    special = torch.tensor([
        0.0, -0.0,
        float('inf'), -float('inf'),
        float('nan'), 1e-39, -1e-40, 65504.0, 65519.0, 65520.0, -65520.0, 6e-8,
        2.9e-8, 3.4e38, 3.39e38
    ])
    # Ties: exactly halfway between bf16 neighbours, with even and odd
    # lower neighbours (round to nearest even must pick differently), and
    # the same for fp16 (13 dropped bits).
    ties = torch.tensor(
        [0x3F808000, 0x3F818000, 0xBF808000, 0x3F801000, 0x3F803000],
        dtype=torch.int64).to(torch.int32).view(torch.float32)
    fill = torch.cat([special, ties])
    x[:min(numel, fill.numel())] = fill[:numel]
    return x


@pytest.fixture(params=KERNEL_SETS)
def kernel_set(request):
    best = codec.isa()
    codec.use(request.param)
    yield request.param
    codec.use(best)


def test_kernel_is_built():
    # ``make install`` builds it (setup.py, optional extension); if this
    # fails the hooks still work, on torch's slower two-pass casts.
    assert codec is not None, cast.cpu_codec()
    assert cast.cpu_codec().startswith('C kernel')
    assert codec.isa() == KERNEL_SETS[-1] and KERNEL_SETS[0] == 'generic'


def skip_without_fp16(dtype):
    if dtype is torch.float16 and not codec.has_fp16():
        x = torch.zeros(1)
        with pytest.raises(RuntimeError, match='no fp16 conversion'):
            codec.encode(x.data_ptr(), x.data_ptr(), 1, 1.0, 0)
        assert not cast._use_cpu_codec(x, x.half())
        pytest.skip('this kernel set leaves fp16 to torch (checked above)')


@pytest.mark.parametrize('dtype', HALF)
@pytest.mark.parametrize('scale', SCALES)
def test_decode_every_half_value_like_torch(dtype, scale, kernel_set):
    skip_without_fp16(dtype)
    # All 65536 bit patterns, so every exponent, subnormal, inf and NaN.
    half = torch.arange(
        -2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    got = torch.empty(half.numel())
    cast._cpu_codec.decode(half.data_ptr(), got.data_ptr(), half.numel(),
                           scale, KIND[dtype])
    assert_same_bits(got, half.float().mul_(scale))


# Lengths around the vector widths (8 and 16 floats) and the decode block
# (4096) test the tails.
@pytest.mark.parametrize('numel', [1, 7, 8, 15, 16, 17, 31, 33, 4097, 100_003])
@pytest.mark.parametrize('dtype', HALF)
@pytest.mark.parametrize('scale', SCALES)
def test_encode_like_torch(numel, dtype, scale, kernel_set):
    skip_without_fp16(dtype)
    x = fp32_inputs(numel)
    got = torch.empty(numel, dtype=dtype)
    cast._cpu_codec.encode(x.data_ptr(), got.data_ptr(), numel, scale,
                           KIND[dtype])
    assert_same_bits(got, x.mul(scale).to(dtype))


@pytest.mark.parametrize('dtype', HALF)
@pytest.mark.parametrize('divisor', [1, 2, 3, 8])
def test_hook_paths_agree_bit_for_bit(dtype, divisor, monkeypatch):
    """``compress`` / ``decompress`` as the hooks call them, with the C
    kernel and with torch's ops (spanning several fallback chunks and
    several decode blocks)."""
    numel = 2 * cast._CPU_CHUNK + 5
    assert cast._use_cpu_codec(
        torch.empty(numel), torch.empty(numel, dtype=dtype))
    x = fp32_inputs(numel, seed=1)

    def round_trip():
        half = cast.compress(x.clone(), divisor, dtype)
        out = torch.empty(numel)
        return half, cast.decompress(half, out, divisor)

    c_half, c_out = round_trip()
    monkeypatch.setattr(cast, '_cpu_codec', None)
    assert not cast._use_cpu_codec(x, c_half)
    t_half, t_out = round_trip()
    assert_same_bits(c_half, t_half)
    assert_same_bits(c_out, t_out)


def test_empty_and_bad_arguments():
    codec.encode(0, 0, 0, 1.0, 1)  # nothing to do, no address needed
    x = torch.zeros(4)
    with pytest.raises(ValueError, match='numel must be >= 0, got -1'):
        codec.encode(x.data_ptr(), x.data_ptr(), -1, 1.0, 1)
    with pytest.raises(ValueError, match=r'kind must be 0 \(fp16\) or 1'):
        codec.encode(x.data_ptr(), x.data_ptr(), 4, 1.0, 2)
    with pytest.raises(ValueError, match='null address'):
        codec.decode(0, x.data_ptr(), 4, 1.0, 1)
    with pytest.raises(ValueError, match="'sse9' is not one this CPU runs"):
        codec.use('sse9')
