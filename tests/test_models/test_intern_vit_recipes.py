"""InternViT recipes: configs, model statistics, few-shot splits, and the
tiny config trained on 2 gloo ranks."""
import os
import os.path as osp
import re
import socket
import subprocess
import sys

import pytest
from mmengine.config import Config

from mmcv_custom.analysis import stats
from tests.tool_utils import load_script

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
RECIPES = osp.join(ROOT, 'configs', 'intern_vit')


def _load(relpath):
    return load_script(osp.join(ROOT, relpath), osp.basename(relpath)[:-3])


def _stats(name):
    from mmengine.registry import DefaultScope
    cfg = Config.fromfile(osp.join(RECIPES, name))
    with DefaultScope.overwrite_default_scope('mmseg'):
        return stats(cfg)


@pytest.mark.parametrize('name,published', [
    ('upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py', 5.9e9),
    ('upernet_intern-vit-300m_8xb2-80k_ade20k-504x504.py', 304e6),
])
def test_recipe_sizes_match_the_published_models(name, published):
    s = _stats(name)  # built on the meta device
    assert abs(s['vit_params'] - published) / published < 0.01
    assert s['trainable'] == s['params']  # full tuning
    # The backbone trains in bf16 (as InternVL), the heads in fp32: DDP
    # sends the backbone's gradients in bf16 already, and bf16_compress
    # halves only the heads'.
    assert s['bf16_params'] == s['backbone_params']
    heads = s['params'] - s['backbone_params']
    assert s['grad_bytes'] == 2 * s['backbone_params'] + 4 * heads
    assert s['hook_bytes'] == 2 * s['trainable']  # bf16_compress
    assert s['param_bytes'] == s['grad_bytes']  # all trainable
    assert s['optim_bytes'] == 2 * s['grad_bytes']


@pytest.mark.parametrize('name', sorted(os.listdir(RECIPES)))
def test_every_recipe_builds(name):
    s = _stats(name)
    assert 0 < s['trainable'] <= s['params']
    assert s['hook_bytes'] == 2 * s['trainable']  # all use bf16_compress


def test_frozen_recipes_send_only_the_head():
    full = _stats('upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py')
    frozen = _stats('upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py')
    linear = _stats('linear_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py')
    assert frozen['trainable'] == full['params'] - full['vit_params']
    # A linear probe trains a BN over the 3200 channels (weight and bias)
    # and one 1x1 convolution to 150 classes.
    assert linear['trainable'] == 3200 * 150 + 150 + 2 * 3200
    assert _stats(LINEAR_300M)['trainable'] == 1024 * 150 + 150 + 2 * 1024


def test_fewshot_recipes_tune_everything_with_the_linear_head():
    s = _stats('linear_intern-vit-6b_8xb2-5k_ade20k-1of16-504x504.py')
    assert s['trainable'] == s['params']
    assert s['params'] - s['backbone_params'] == 3200 * 150 + 150 + 2 * 3200


def test_recipe_table():
    names = sorted(os.listdir(RECIPES))
    fewshot = [n for n in names if re.search(r'-1of\d+-', n)]
    assert len(fewshot) == 5
    for name in names:
        cfg = Config.fromfile(osp.join(RECIPES, name))
        backbone = cfg.model.backbone
        assert 'mmcv_custom.models' in cfg.custom_imports.imports
        if 'frozen' in name:
            # InternVL's frozen recipes keep its layer-decay constructor at
            # decay 1.0 (no weight decay on the head's norms and biases).
            assert backbone['freeze']
            assert cfg.optim_wrapper.paramwise_cfg.layer_decay_rate == 1.0
        elif 'tiny' not in name:
            assert not backbone['freeze']
            assert cfg.optim_wrapper.constructor == (
                'LayerDecayOptimWrapperConstructor')
            assert cfg.optim_wrapper.paramwise_cfg.layer_decay_rate == 0.95
        if '-6b_' in name:
            assert backbone.drop_path_rate == 0.4
            assert backbone.dtype == 'bfloat16'
            assert cfg.comm_hook == dict(type='bf16_compress')
        if name in fewshot:
            n = re.search(r'-1of(\d+)-', name).group(1)
            assert cfg.train_dataloader.dataset.ann_file == (
                f'splits/train_1of{n}.txt')
            assert name.startswith('linear_intern-vit-6b_')


# InternVL's ADE20K recipes (segmentation/configs/intern_vit_6b/ of
# OpenGVLab/InternVL: full_tuning, head_tuning, linear_probing), resolved.
INTERN_VIT_6B = dict(
    type='InternViT',
    pretrain_size=224,
    img_size=504,
    patch_size=14,
    embed_dims=3200,
    depth=48,
    num_heads=25,
    mlp_ratio=4.,
    qkv_bias=False,
    qk_norm=True,
    norm='rms',
    init_values=0.1,
    pretrained='pretrained/intern_vit_6b_224px.pth')
INTERN_VIT_300M = dict(
    INTERN_VIT_6B,
    pretrain_size=448,
    embed_dims=1024,
    depth=24,
    num_heads=16,
    qkv_bias=True,
    qk_norm=False,
    norm='ln',
    pretrained='pretrained/intern_vit_300m_448px.pth')
FULL_6B = 'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py'
FULL_6B_FSDP2 = 'upernet_intern-vit-6b_8xb2-fsdp2-80k_ade20k-504x504.py'
HEAD_6B = 'upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py'
LINEAR_6B = 'linear_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py'
FULL_300M = 'upernet_intern-vit-300m_8xb2-80k_ade20k-504x504.py'
HEAD_300M = 'upernet_intern-vit-300m-frozen_8xb2-80k_ade20k-504x504.py'
LINEAR_300M = 'linear_intern-vit-300m-frozen_8xb2-80k_ade20k-504x504.py'
# name: (architecture, out_indices, frozen, drop path, UperNet or linear
#        head width, auxiliary head's input, weight decay, layer decay,
#        iterations, warm-up iterations)
INTERN_VL_RECIPES = {
    FULL_6B: (INTERN_VIT_6B, (11, 23, 35, 47), False, 0.4, 3200, 2, 0.05, 0.95,
              80000, 1500),
    # The same recipe, sharded by FSDP2 instead of DDP.
    FULL_6B_FSDP2: (INTERN_VIT_6B, (11, 23, 35, 47), False, 0.4, 3200, 2, 0.05,
                    0.95, 80000, 1500),
    HEAD_6B: (INTERN_VIT_6B, (11, 23, 35, 47), True, 0.0, 3200, 1, 0.05, 1.0,
              80000, 1500),
    LINEAR_6B:
    (INTERN_VIT_6B, (44, ), True, 0.0, 3200, None, 0.0, 1.0, 80000, 1500),
    # 300M: InternVL publishes no segmentation recipe; the 6B settings with
    # quarters of 24 blocks, the probe four blocks from the end and the
    # drop path this project chose for a 24-block ViT.
    FULL_300M: (INTERN_VIT_300M, (5, 11, 17, 23), False, 0.1, 1024, 2, 0.05,
                0.95, 80000, 1500),
    HEAD_300M: (INTERN_VIT_300M, (5, 11, 17, 23), True, 0.0, 1024, 1, 0.05,
                1.0, 80000, 1500),
    LINEAR_300M:
    (INTERN_VIT_300M, (21, ), True, 0.0, 1024, None, 0.0, 1.0, 80000, 1500),
}
# Few shot (few_shot/linear_intern_vit_6b_504_{k}k_ade20k_bs16_lr4e-5_1of{n}):
# the linear head on the last block of a fully tuned 6B, shorter schedules
# and warm-ups for smaller subsets.
INTERN_VL_RECIPES.update({
    f'linear_intern-vit-6b_8xb2-{iters // 1000}k_ade20k-1of{n}-504x504.py':
    (INTERN_VIT_6B, (47, ), False, 0.4, 3200, None, 0.05, 0.95, iters, warmup)
    for n, iters, warmup in ((1, 80000, 1500), (2, 40000, 800),
                             (4, 20000, 400), (8, 10000, 200), (16, 5000, 100))
})


def test_every_ade20k_recipe_is_checked_against_intern_vl():
    names = {n for n in os.listdir(RECIPES) if 'ade20k' in n}
    assert names == set(INTERN_VL_RECIPES)


@pytest.mark.parametrize('name', sorted(INTERN_VL_RECIPES))
def test_recipes_reproduce_intern_vl(name):
    (arch, out_indices, frozen, drop_path, width, aux_index, weight_decay,
     layer_decay, iters, warmup) = INTERN_VL_RECIPES[name]
    cfg = Config.fromfile(osp.join(RECIPES, name))
    model = cfg.model
    backbone = model.backbone
    assert {k: backbone[k] for k in arch} == arch
    assert tuple(backbone.out_indices) == out_indices
    assert backbone['freeze'] is frozen  # ConfigDict.freeze: a method
    assert backbone.drop_path_rate == drop_path
    assert backbone.with_fpn is (len(out_indices) == 4)
    if not frozen:
        assert backbone.with_cp is True
    head, aux = model.decode_head, model.auxiliary_head
    if aux_index is None:  # InternVL's FCNHead(num_convs=0, with_norm=True)
        assert (head.type, head.in_channels, head.in_index, head.with_norm,
                head.norm_cfg,
                head.dropout_ratio) == ('LinearHead', width, 0, True,
                                        dict(
                                            type='SyncBN',
                                            requires_grad=True), 0.0)
        assert 'channels' not in head
        assert aux is None
    else:
        assert (head.type, head.in_channels, head.in_index, head.channels,
                head.pool_scales,
                head.dropout_ratio) == ('UPerHead', [width] * 4, [0, 1, 2, 3],
                                        1536, (1, 2, 3, 6), 0.1)
        assert (aux.type, aux.in_channels, aux.in_index, aux.channels,
                aux.num_convs, aux.concat_input, aux.dropout_ratio,
                aux.loss_decode.loss_weight) == ('FCNHead', width, aux_index,
                                                 1536, 1, False, 0.1, 0.4)
    for h in (head, aux) if aux else (head, ):
        assert h.num_classes == 150
    assert model.test_cfg == dict(
        mode='slide', crop_size=(504, 504), stride=(322, 322))
    assert cfg.optim_wrapper.optimizer == dict(
        type='AdamW', lr=4e-5, betas=(0.9, 0.999), weight_decay=weight_decay)
    assert cfg.optim_wrapper.constructor == 'LayerDecayOptimWrapperConstructor'
    assert cfg.optim_wrapper.paramwise_cfg == dict(
        num_layers=arch['depth'], layer_decay_rate=layer_decay)
    # MMCV's poly with linear warm-up: both from iteration 0, multiplied.
    assert cfg.param_scheduler == [
        dict(
            type='LinearLR',
            start_factor=1e-6,
            by_epoch=False,
            begin=0,
            end=warmup),
        dict(
            type='PolyLR',
            eta_min=0.0,
            power=1.0,
            begin=0,
            end=iters,
            by_epoch=False)
    ]
    assert cfg.train_cfg.max_iters == iters
    assert cfg.train_dataloader.batch_size == 2  # x 8 GPUs
    assert cfg.crop_size == (504, 504)
    assert model.data_preprocessor.size == (504, 504)


def _upernet_params(c, k=1536, classes=150):
    """UperNet (pool scales 1, 2, 3, 6) plus the FCN auxiliary head on
    ``c``-channel inputs with ``k`` channels: convolutions without bias,
    each followed by a BN (weight and bias)."""
    bn = 2 * k
    seg = k * classes + classes
    ppm = 4 * (c * k + bn)
    bottleneck = (c + 4 * k) * k * 9 + bn
    laterals = 3 * (c * k + bn)
    fpn = 3 * (k * k * 9 + bn)
    fpn_bottleneck = 4 * k * k * 9 + bn
    aux = c * k * 9 + bn + seg
    return ppm + bottleneck + laterals + fpn + fpn_bottleneck + seg + aux


@pytest.mark.parametrize('name,heads', [
    (FULL_6B, 356_951_340),
    (HEAD_6B, 356_951_340),
    (FULL_300M, 273_392_940),
])
def test_upernet_recipe_head_sizes(name, heads):
    s = _stats(name)
    width = 3200 if '-6b' in name else 1024
    assert heads == _upernet_params(width)
    assert s['params'] - s['backbone_params'] == heads


def test_fewshot_splits_are_nested_and_deterministic(tmp_path):
    write_splits = _load(
        'tools/dataset_converters/ade20k_fewshot_splits.py').write_splits
    folder = tmp_path / 'images' / 'training'
    folder.mkdir(parents=True)
    for i in range(100):
        (folder / f'ADE_train_{i:08d}.jpg').touch()
    paths = write_splits(str(tmp_path), seed=3)
    subsets = {k: open(p).read().split() for k, p in paths.items()}
    assert [len(subsets[k]) for k in (1, 2, 4, 8, 16)] == [100, 50, 25, 12, 6]
    for small, large in ((16, 8), (8, 4), (4, 2), (2, 1)):
        assert set(subsets[small]) <= set(subsets[large])
    again = write_splits(str(tmp_path), seed=3)
    assert {k: open(p).read().split() for k, p in again.items()} == subsets
    other = write_splits(str(tmp_path), seed=4)
    assert open(other[16]).read().split() != subsets[16]
    with pytest.raises(FileNotFoundError, match='images/training'):
        write_splits(str(tmp_path / 'nowhere'))


@pytest.mark.slow
def test_tiny_intern_vit_config_trains_on_two_gloo_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = str(s.getsockname()[1])
    config = osp.join(
        RECIPES, 'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')
    out = subprocess.run([
        'bash',
        osp.join(ROOT, 'tools', 'dist_train.sh'), config, '2', '--work-dir',
        str(tmp_path / 'work'), '--cfg-options', 'train_cfg.max_iters=20',
        'train_cfg.val_interval=20', 'default_hooks.logger.interval=10',
        'train_dataloader.dataset.generate.num_train=64',
        'val_dataloader.dataset.generate.num_train=64',
        'train_dataloader.dataset.generate.num_val=16',
        'val_dataloader.dataset.generate.num_val=16'
    ],
                         cwd=str(tmp_path),
                         capture_output=True,
                         text=True,
                         timeout=600,
                         env=dict(
                             os.environ, PYTHON=sys.executable, PORT=port))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "type='bf16_compress' (bf16_compress_hook)" in log
    assert 'Layer-wise lr decay 0.9 over 4 layers: 12 parameter groups' in log
    losses = [
        float(x) for x in re.findall(
            r'Iter\(train\) \[\s*\d+/20\].*? loss: ([\d.]+)', log)
    ]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert 'mIoU' in log


@pytest.mark.parametrize(
    'hw,resized',
    [
        ((512, 683), (504, 672)),  # a typical ADE20K image: 672 = 48 * 14
        ((683, 512), (672, 504)),
        ((300, 1500), (504, 2520)),  # wider than 4:1: no cap on the long side
        ((1000, 1001), (504, 518)),  # 504.5 -> 505, then up to 37 * 14
    ])
def test_ade20k_test_resize_is_intern_vl_s(tmp_path, hw, resized):
    """InternVL: short edge to 504 (SETR_Resize), then up to multiples of
    14 (ResizeToMultiple); labels keep their size for the metric."""
    import mmcv
    import mmseg.datasets  # noqa: F401  (registers the transforms)
    import numpy as np
    from mmengine.dataset import Compose
    from mmengine.registry import DefaultScope

    cfg = Config.fromfile(
        osp.join(RECIPES, 'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py'))
    assert cfg.test_dataloader.dataset.pipeline == cfg.test_pipeline
    img, seg = tmp_path / 'a.jpg', tmp_path / 'a.png'
    mmcv.imwrite(np.full(hw + (3, ), 128, np.uint8), str(img))
    mmcv.imwrite(np.ones(hw, np.uint8), str(seg))
    with DefaultScope.overwrite_default_scope('mmseg'):
        pipeline = Compose(cfg.test_pipeline)
        out = pipeline(
            dict(
                img_path=str(img),
                seg_map_path=str(seg),
                reduce_zero_label=True,
                seg_fields=[]))
    assert tuple(out['inputs'].shape[1:]) == resized
    assert out['data_samples'].gt_sem_seg.data.shape[1:] == hw
    assert out['data_samples'].ori_shape == hw


def test_6b_fsdp2_recipe_is_the_ddp_recipe_sharded():
    ddp = Config.fromfile(osp.join(RECIPES, FULL_6B))
    fsdp2 = Config.fromfile(osp.join(RECIPES, FULL_6B_FSDP2))
    assert fsdp2.runner_type == 'FlexibleRunner'
    assert fsdp2.strategy == dict(
        type='FSDP2Strategy',
        shard_modules=['InternViTBlock', 'InternViT', 'UPerHead', 'FCNHead'],
        reshard_after_forward=True,
        sharding='auto')
    for key in ('model', 'optim_wrapper', 'param_scheduler', 'train_cfg',
                'train_dataloader', 'val_dataloader', 'comm_hook'):
        assert fsdp2[key] == ddp[key], key
