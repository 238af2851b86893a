"""LinearHead: InternVL's linear probe (norm, dropout, 1x1 convolution)."""
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip('mmseg')
from mmengine.registry import DefaultScope  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

import mmcv_custom.models  # noqa: E402,F401  registers LinearHead

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TINY = osp.join(ROOT, 'configs', 'intern_vit',
                'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')


def _build(**kwargs):
    cfg = dict(
        type='LinearHead',
        in_channels=8,
        in_index=0,
        num_classes=5,
        dropout_ratio=0.0,
        norm_cfg=dict(type='BN', requires_grad=True))
    cfg.update(kwargs)
    with DefaultScope.overwrite_default_scope('mmseg'):
        return MODELS.build(cfg)


def test_builds_from_the_registry_with_a_bn_before_the_classifier():
    head = _build()
    assert isinstance(head.norm, torch.nn.BatchNorm2d)
    assert head.channels == 8
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    assert trainable == 8 * 5 + 5 + 2 * 8  # classifier + BN weight and bias
    assert sum(p.numel()
               for p in _build(with_norm=False).parameters()) == (8 * 5 + 5)


def test_forward_normalises_then_classifies_each_position():
    torch.manual_seed(0)
    head = _build(in_index=1).eval()
    x = torch.randn(2, 8, 3, 4) * 10 + 3
    head.norm.running_mean.copy_(torch.full((8, ), 3.))
    head.norm.running_var.copy_(torch.full((8, ), 100.))
    out = head([torch.zeros(2, 4, 3, 4), x])
    assert out.shape == (2, 5, 3, 4)
    normed = (x - 3) / torch.sqrt(torch.tensor(100. + head.norm.eps))
    expected = torch.nn.functional.conv2d(normed, head.conv_seg.weight,
                                          head.conv_seg.bias)
    torch.testing.assert_close(out, expected)


def test_trains_its_norm_and_classifier():
    head = _build(dropout_ratio=0.1).train()
    out = head([torch.randn(2, 8, 3, 4)])
    out.sum().backward()
    assert head.norm.weight.grad is not None
    assert head.conv_seg.weight.grad is not None


def test_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match='channels should equal in_channels'):
        _build(channels=4)
    with pytest.raises(TypeError, match='in_channels should be an int'):
        _build(in_channels=[8, 8])
    with pytest.raises(ValueError, match='needs a norm_cfg'):
        _build(norm_cfg=None)


@pytest.mark.slow
def test_tiny_linear_probe_trains_through_tools_train(tmp_path):
    """The linear recipe's head (SyncBN in the config) on the tiny ViT, one
    CPU process through tools/train.py (MMEngine reverts SyncBN to BN)."""
    config = tmp_path / 'linear_intern-vit-tiny_1xb8-6iter_toy-shapes-56x56.py'
    config.write_text(f"""_base_ = [{TINY!r}]
model = dict(
    backbone=dict(out_indices=(3, ), with_fpn=False),
    decode_head=dict(
        _delete_=True, type='LinearHead', in_channels=64, in_index=0,
        with_norm=True, norm_cfg=dict(type='SyncBN', requires_grad=True),
        dropout_ratio=0.0, num_classes=4,
        loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0)),
    auxiliary_head=None)
""")
    toy = str(tmp_path / 'toy')
    out = subprocess.run(
        [
            sys.executable,
            osp.join(ROOT, 'tools', 'train.py'),
            str(config), '--work-dir',
            str(tmp_path / 'work'), '--cfg-options', 'train_cfg.max_iters=6',
            'train_cfg.val_interval=6', 'default_hooks.logger.interval=2'
        ] + [
            f'{split}_dataloader.dataset.{key}' for split in ('train', 'val')
            for key in (f'data_root={toy}', 'generate.num_train=32',
                        'generate.num_val=8')
        ],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    losses = [
        float(x) for x in re.findall(
            r'Iter\(train\) \[\s*\d+/6\].*? loss: ([\d.]+)', log)
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert 'mIoU' in log
