"""InternViT follows its parameters' dtype after ``.to()`` and friends.

The build-time ``dtype`` only sets where the parameters start; InternVL's
``ToBFloat16Hook`` (``backbone.to(torch.bfloat16)``), ``.half()``,
``.double()`` or ``.float()`` afterwards must still give a backbone that
runs, with features in fp32 for the fp32 heads (float64 from a float64
backbone). Same weights throughout, so the casts can be compared with the
fp32 model, within tolerances set by each format's rounding.
"""
import pytest
import torch

pytest.importorskip('mmseg')
from mmengine.registry import DefaultScope  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

from mmcv_custom.models import InternViT  # noqa: E402  registers it
from mmcv_custom.testing import run_ranks  # noqa: E402

# Four blocks, all four returned, so the pyramid (with its fp32 channel
# norms) sees one output each.
TINY = dict(
    type='InternViT',
    img_size=28,
    embed_dims=32,
    depth=4,
    num_heads=2,
    out_indices=(0, 1, 2, 3))
PYRAMID = dict(with_fpn=True, with_final_norm=True)

# Relative error (norm of the difference over the norm of the fp32 output)
# allowed per dtype: a few units of each format's rounding (bf16 2**-8,
# fp16 2**-11, fp32 2**-24) grown over four blocks.
REL_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float64: 1e-5}


def _build(**kwargs):
    torch.manual_seed(0)
    with DefaultScope.overwrite_default_scope('mmseg'):
        vit = MODELS.build(dict(TINY, **kwargs))
    assert isinstance(vit, InternViT)
    vit.init_weights()
    return vit.eval()


def _rel_err(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _check_against_fp32(vit, ref, dtype, out_dtype, size=28):
    """``vit`` (cast to ``dtype``) against the fp32 ``ref``, same weights:
    it runs on an fp32 input, as the data preprocessor hands it over, and
    returns ``out_dtype`` features close to the fp32 ones."""
    assert {p.dtype for p in vit.parameters()} == {dtype}
    assert vit.dtype is dtype
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        outs, refs = vit(x), ref(x)
    assert [o.dtype for o in outs] == [out_dtype] * len(refs)
    assert [o.shape for o in outs] == [r.shape for r in refs]
    for out, exact in zip(outs, refs):
        assert torch.isfinite(out).all()
        assert _rel_err(out, exact) < REL_TOL[dtype]
    return outs


CASTS = {
    'double': (lambda m: m.double(), torch.float64, torch.float64),
    'to(bfloat16)':
    (lambda m: m.to(torch.bfloat16), torch.bfloat16, torch.float32),
    'bfloat16': (lambda m: m.bfloat16(), torch.bfloat16, torch.float32),
    # Half convolutions, attention and RMSNorm run on CPU in the torch this
    # project pins (2.13), so fp16 is held to the same contract as bf16:
    # it runs and hands fp32 features to the heads.
    'half': (lambda m: m.half(), torch.float16, torch.float32),
}


@pytest.mark.parametrize('pyramid', [False, True], ids=['plain', 'pyramid'])
@pytest.mark.parametrize('cast', list(CASTS))
def test_forward_follows_a_cast_after_construction(cast, pyramid):
    extra = PYRAMID if pyramid else {}
    ref = _build(**extra)
    vit = _build(**extra)
    to, dtype, out_dtype = CASTS[cast]
    to(vit)
    _check_against_fp32(vit, ref, dtype, out_dtype)


@pytest.mark.parametrize('cast', ['double', 'bfloat16'])
def test_another_input_size_resizes_pos_embed_in_the_new_dtype(cast):
    # 42 / 14 = 3 patches a side against the built 2: the position
    # embeddings are interpolated at forward time, in the cast dtype.
    ref, vit = _build(), _build()
    to, dtype, out_dtype = CASTS[cast]
    to(vit)
    outs = _check_against_fp32(vit, ref, dtype, out_dtype, size=42)
    assert outs[0].shape[-2:] == (3, 3)


def test_double_matches_fp32_closely_and_trains_in_float64():
    ref, vit = _build(**PYRAMID), _build(**PYRAMID)
    vit.double()
    x = torch.randn(2, 3, 28, 28)
    outs = vit(x)
    with torch.no_grad():
        refs = ref(x)
    for out, exact in zip(outs, refs):
        # Only fp32's rounding in the reference separates the two.
        torch.testing.assert_close(out.float(), exact, rtol=1e-4, atol=1e-5)
    sum(o.square().mean() for o in outs).backward()
    assert {p.grad.dtype
            for p in vit.parameters()
            if p.grad is not None} == {torch.float64}


def test_float_after_a_bf16_build_is_an_fp32_model():
    vit = _build(dtype='bfloat16')
    assert vit.dtype is torch.bfloat16  # the build-time dtype still applies
    ref = _build()
    ref.load_state_dict(vit.state_dict())  # the bf16 weights, widened
    vit.float()
    assert {p.dtype for p in vit.parameters()} == {torch.float32}
    assert vit.dtype is torch.float32
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        outs, refs = vit(x), ref(x)
    for out, exact in zip(outs, refs):
        assert out.dtype is torch.float32
        torch.testing.assert_close(out, exact)


def _segmentor():
    torch.manual_seed(0)
    cfg = dict(
        type='EncoderDecoder',
        backbone=dict(TINY, out_indices=(3, )),
        decode_head=dict(
            type='LinearHead',
            in_channels=32,
            in_index=0,
            num_classes=3,
            dropout_ratio=0.0,
            norm_cfg=dict(type='BN', requires_grad=True)))
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = MODELS.build(cfg)
    model.init_weights()
    return model.eval()


def test_bf16_backbone_cast_by_a_hook_feeds_fp32_heads():
    # What InternVL's ToBFloat16Hook does: the backbone alone, after build.
    model = _segmentor()
    model.backbone.to(torch.bfloat16)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        logits = model(x, mode='tensor')
    assert logits.dtype is torch.float32
    assert torch.isfinite(logits).all()


def test_a_float64_segmentor_stays_float64():
    # ``.double()`` on the whole model: float64 features for float64 heads.
    model = _segmentor()
    ref = _segmentor()
    model.double()
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        logits, exact = model(x, mode='tensor'), ref(x, mode='tensor')
    assert logits.dtype is torch.float64
    torch.testing.assert_close(logits.float(), exact, rtol=1e-4, atol=1e-5)


def _fsdp2_bf16_forward(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    ref, vit = _build(), _build()  # fp32, the same weights on every rank
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in vit.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(vit, mp_policy=policy)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        outs, refs = vit(x), ref(x)
    return ([o.dtype
             for o in outs], max(_rel_err(o, r) for o, r in zip(outs, refs)))


def test_fsdp2_param_dtype_bf16_on_an_fp32_build():
    # FSDP2 keeps fp32 shards and gathers bf16 parameters just before the
    # forward (and casts the input to bf16): the dtype read at forward time
    # is bf16, where a build-time fp32 would cast the input back to fp32.
    for dtypes, err in run_ranks(_fsdp2_bf16_forward, world_size=2):
        assert dtypes == [torch.float32] * 4
        assert err < REL_TOL[torch.bfloat16]
