"""The InternViT backbone: shapes, sizes, checkpoints, freezing."""
import logging
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.comm import CommCounter, build_comm_hook
from mmcv_custom.models import InternViT, resize_pos_embed
from mmcv_custom.testing import run_ranks

TINY = dict(img_size=56, embed_dims=32, depth=4, num_heads=4)


def _tiny(**kwargs):
    torch.manual_seed(0)
    model = InternViT(**dict(TINY, **kwargs))
    model.init_weights()
    return model


@pytest.mark.parametrize('out_indices,fpn,shapes', [
    ((3, ), False, [(2, 32, 4, 4)]),
    ((-1, ), False, [(2, 32, 4, 4)]),
    ((0, 1, 2, 3), False, [(2, 32, 4, 4)] * 4),
    ((0, 1, 2, 3), True, [(2, 32, 16, 16), (2, 32, 8, 8), (2, 32, 4, 4),
                          (2, 32, 2, 2)]),
])
def test_output_shapes(out_indices, fpn, shapes):
    model = _tiny(out_indices=out_indices, with_fpn=fpn)
    outs = model(torch.randn(2, 3, 56, 56))
    assert [tuple(o.shape) for o in outs] == shapes


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r'depth 4, but got \[4\]'):
        InternViT(**TINY, out_indices=(4, ))
    with pytest.raises(ValueError, match='four out_indices'):
        InternViT(**TINY, out_indices=(3, ), with_fpn=True)
    with pytest.raises(ValueError, match="'rms' or 'ln', but got 'bn'"):
        InternViT(**TINY, out_indices=(3, ), norm='bn')


@pytest.mark.parametrize(
    'kwargs,published',
    [
        # InternViT-6B: about 5.9e9 parameters.
        (dict(img_size=504, out_indices=(47, )), 5.9e9),
        # InternViT-300M: about 304e6 parameters.
        (dict(
            img_size=504,
            embed_dims=1024,
            depth=24,
            num_heads=16,
            qkv_bias=True,
            qk_norm=False,
            norm='ln',
            out_indices=(23, )), 304e6),
    ])
def test_published_sizes_on_the_meta_device(kwargs, published):
    with torch.device('meta'):
        model = InternViT(**kwargs)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - published) / published < 0.01


def test_position_embeddings_resize_bicubically_keeping_the_class_token():
    pos = torch.randn(1, 1 + 16 * 16, 8)
    out = resize_pos_embed(pos, 36)
    assert out.shape == (1, 1 + 36 * 36, 8)
    assert torch.equal(out[:, 0], pos[:, 0])
    grid = pos[:, 1:].reshape(1, 16, 16, 8).permute(0, 3, 1, 2)
    expected = F.interpolate(
        grid, size=(36, 36), mode='bicubic', align_corners=False)
    assert torch.allclose(out[:, 1:],
                          expected.permute(0, 2, 3, 1).reshape(1, -1, 8))
    assert resize_pos_embed(pos, 16) is pos
    with pytest.raises(ValueError, match='square grid'):
        resize_pos_embed(torch.randn(1, 1 + 15, 8), 4)


def test_public_checkpoint_loads_with_module_nesting(tmp_path):
    # Pre-trained at 28 px (a 2 x 2 grid), fine-tuned at 56 px (4 x 4).
    source = _tiny(img_size=28, out_indices=(3, ))
    state = {k: v.clone() for k, v in source.state_dict().items()}
    path = tmp_path / 'internvit.pth'
    torch.save({'module': state}, path)

    model = InternViT(
        **TINY, out_indices=(3, ), pretrain_size=28, pretrained=str(path))
    model.init_weights()
    assert torch.equal(model.blocks[2].attn.qkv.weight,
                       source.blocks[2].attn.qkv.weight)
    assert torch.equal(model.blocks[0].attn.q_norm.weight,
                       source.blocks[0].attn.q_norm.weight)
    assert model.pos_embed.shape == (1, 17, 32)
    assert torch.equal(model.pos_embed[:, 0], source.pos_embed[:, 0])


def test_partial_checkpoint_raises_unless_allowed():
    source = _tiny(out_indices=(3, ))
    state = {k: v.clone() for k, v in source.state_dict().items()}
    del state['blocks.3.ls2.gamma']
    state['head.weight'] = torch.zeros(2)  # not part of a backbone
    model = InternViT(**TINY, out_indices=(3, ))
    with pytest.raises(
            RuntimeError,
            match=r"1 ViT parameters missing "
            r"\['blocks.3.ls2.gamma'\], 1 unexpected "
            r"\['head.weight'\]"):
        model.load_public_state_dict({'module': state})
    with mock.patch(
            'mmcv_custom.models.backbones.intern_vit.print_log') as log:
        missing, unexpected = model.load_public_state_dict({'module': state},
                                                           allow_partial=True)
    assert missing == ['blocks.3.ls2.gamma']
    assert unexpected == ['head.weight']
    assert torch.equal(model.blocks[3].mlp.fc1.weight,
                       source.blocks[3].mlp.fc1.weight)
    (message, ), kwargs = log.call_args
    assert 'partial load (allow_partial=True)' in message
    assert kwargs['level'] == logging.WARNING


def test_pyramid_norm_is_a_channel_layer_norm_in_fp32():
    model = _tiny(
        out_indices=(0, 1, 2, 3), with_fpn=True, with_final_norm=True)
    norm = model.up1[1]
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 32, 5, 5) * 3 + 1
    mean = x.mean(1, keepdim=True)
    var = (x - mean).square().mean(1, keepdim=True)
    expected = (
        (x - mean) / torch.sqrt(var + 1e-6) * norm.weight[:, None, None] +
        norm.bias[:, None, None])
    assert torch.allclose(norm(x), expected, atol=1e-5)
    # bf16 in, bf16 out, computed in fp32 (as InternVL's).
    half = x.bfloat16()
    ref = F.layer_norm(half.float().permute(0, 2, 3, 1), (32, ), norm.weight,
                       norm.bias, 1e-6).permute(0, 3, 1, 2)
    assert torch.equal(norm(half), ref.bfloat16())
    # The final norms sit where InternVL's segmentation checkpoints have
    # them: up1.4, up2.1, up3.1, up4.1.
    names = {
        k.rsplit('.', 1)[0]
        for k in model.state_dict() if k.startswith('up')
    }
    assert names == {
        'up1.0', 'up1.1', 'up1.3', 'up1.4', 'up2.0', 'up2.1', 'up3.1', 'up4.1'
    }
    with pytest.raises(ValueError, match='needs with_fpn=True'):
        InternViT(**TINY, out_indices=(3, ), with_final_norm=True)


def test_frozen_backbone_has_no_trainable_parameters():
    model = _tiny(out_indices=(3, ), freeze=True, drop_path_rate=0.5)
    assert not [n for n, p in model.named_parameters() if p.requires_grad]
    model.train()
    assert not model.blocks.training  # no stochastic depth when frozen
    x = torch.randn(2, 3, 56, 56)
    assert torch.equal(model(x)[0], model(x)[0])
    # With the pyramid, only the new pyramid trains.
    model = _tiny(out_indices=(0, 1, 2, 3), with_fpn=True, freeze=True)
    trainable = {
        n.split('.')[0]
        for n, p in model.named_parameters() if p.requires_grad
    }
    assert trainable == {'up1', 'up2'}


def test_activation_checkpointing_changes_nothing_but_memory():
    x = torch.randn(2, 3, 56, 56)
    plain = _tiny(out_indices=(3, ))
    ckpt = _tiny(out_indices=(3, ), with_cp=True)
    ckpt.load_state_dict(plain.state_dict())
    for model in (plain, ckpt):
        model.train()
        model(x)[0].square().mean().backward()
    assert torch.allclose(plain.blocks[0].attn.qkv.weight.grad,
                          ckpt.blocks[0].attn.qkv.weight.grad)


def test_runs_under_bf16_autocast():
    model = _tiny(out_indices=(3, ))
    x = torch.randn(2, 3, 56, 56)
    exact = model(x)[0]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        half = model(x)[0]
    # The matmuls and attention ran in bf16: close, but not the same.
    assert torch.isfinite(half).all() and not torch.equal(half, exact)
    assert (half.float() - exact).norm() / exact.norm() < 2e-2


class _Probe(nn.Module):
    """A frozen InternViT with a trainable linear head (linear probing)."""

    def __init__(self):
        super().__init__()
        self.backbone = InternViT(**TINY, out_indices=(3, ), freeze=True)
        self.head = nn.Conv2d(32, 4, 1)

    def forward(self, x):
        return self.head(self.backbone(x)[0]).mean()


def _probe_traffic(rank, world_size):
    torch.manual_seed(0)
    model = DDP(_Probe())
    counter = CommCounter()
    spec = build_comm_hook(dict(type='bf16_compress'), counter=counter)
    model.register_comm_hook(spec.state, spec.hook)
    model(torch.randn(2, 3, 56, 56)).backward()
    head = sum(p.numel() for p in model.module.head.parameters())
    return counter.pop(), head


def test_frozen_backbone_sends_no_gradients():
    (fp32_bytes, wire_bytes), head = run_ranks(_probe_traffic)[0]
    assert fp32_bytes == head * 4  # only the head's gradients
    assert wire_bytes == head * 2


class _Segmentor(nn.Module):

    def __init__(self, freeze=False):
        super().__init__()
        self.backbone = InternViT(**TINY, out_indices=(3, ), freeze=freeze)
        self.decode_head = nn.Conv2d(32, 4, 1)


def _groups(model, rate=0.5):
    from mmcv_custom import LayerDecayOptimWrapperConstructor
    constructor = LayerDecayOptimWrapperConstructor(
        dict(optimizer=dict(type='AdamW', lr=1.0, weight_decay=0.05)),
        dict(num_layers=4, layer_decay_rate=rate))
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g['lr'], g['weight_decay'],
             sorted(names[id(p)] for p in g['params']))
            for g in constructor(model).optimizer.param_groups]


def test_layer_decay_groups_and_learning_rates():
    groups = _groups(_Segmentor())
    by_name = {n: (lr, wd) for lr, wd, names in groups for n in names}
    # Embeddings are layer 0, block i is layer i + 1, the head layer 5.
    assert by_name['backbone.patch_embed.proj.weight'] == (0.5**5, 0.05)
    assert by_name['backbone.pos_embed'] == (0.5**5, 0.0)
    assert by_name['backbone.cls_token'] == (0.5**5, 0.0)
    assert by_name['backbone.blocks.0.attn.qkv.weight'] == (0.5**4, 0.05)
    assert by_name['backbone.blocks.3.mlp.fc1.weight'] == (0.5**1, 0.05)
    # Norms, LayerScale and biases: no weight decay.
    assert by_name['backbone.blocks.3.norm1.weight'] == (0.5**1, 0.0)
    assert by_name['backbone.blocks.2.ls1.gamma'] == (0.5**2, 0.0)
    assert by_name['backbone.blocks.1.mlp.fc1.bias'] == (0.5**3, 0.0)
    assert by_name['decode_head.weight'] == (1.0, 0.05)
    assert by_name['decode_head.bias'] == (1.0, 0.0)
    assert len(by_name) == sum(1 for _ in _Segmentor().parameters())


def test_layer_decay_leaves_frozen_parameters_out_and_checks_its_keys():
    groups = _groups(_Segmentor(freeze=True))
    names = [n for _, _, ns in groups for n in ns]
    assert sorted(names) == ['decode_head.bias', 'decode_head.weight']
    from mmcv_custom import LayerDecayOptimWrapperConstructor
    with pytest.raises(KeyError, match=r"\['layer_decay_rate'\]"):
        LayerDecayOptimWrapperConstructor(
            dict(optimizer=dict(type='AdamW', lr=1.0)), dict(num_layers=4))
    with pytest.raises(ValueError, match='but got 1.5'):
        LayerDecayOptimWrapperConstructor(
            dict(optimizer=dict(type='AdamW', lr=1.0)),
            dict(num_layers=4, layer_decay_rate=1.5))
