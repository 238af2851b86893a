"""InternViT recipes: configs, model statistics, few-shot splits, and the
tiny config trained on 2 gloo ranks."""
import importlib.util
import os
import os.path as osp
import re
import socket
import subprocess
import sys

import pytest
from mmengine.config import Config

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
RECIPES = osp.join(ROOT, 'configs', 'intern_vit')


def _load(relpath):
    spec = importlib.util.spec_from_file_location(
        osp.basename(relpath)[:-3], osp.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stats(name):
    from mmengine.registry import DefaultScope
    cfg = Config.fromfile(osp.join(RECIPES, name))
    with DefaultScope.overwrite_default_scope('mmseg'):
        return _load('tools/analysis_tools/model_stats.py').stats(cfg)


@pytest.mark.parametrize('name,published', [
    ('upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py', 5.9e9),
    ('upernet_intern-vit-300m_8xb2-80k_ade20k-504x504.py', 304e6),
])
def test_recipe_sizes_match_the_published_models(name, published):
    s = _stats(name)  # built on the meta device
    assert abs(s['vit_params'] - published) / published < 0.01
    assert s['trainable'] == s['params']  # full tuning
    assert s['fp32_bytes'] == 4 * s['trainable']
    assert s['hook_bytes'] == 2 * s['trainable']  # bf16_compress


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
    # A linear probe trains one 1x1 convolution to 150 classes.
    assert linear['trainable'] == 3200 * 150 + 150


def test_recipe_table():
    names = sorted(os.listdir(RECIPES))
    fewshot = [n for n in names if re.search(r'-1of\d+-', n)]
    assert len(fewshot) == 5
    for name in names:
        cfg = Config.fromfile(osp.join(RECIPES, name))
        backbone = cfg.model.backbone
        assert 'mmcv_custom.models' in cfg.custom_imports.imports
        if 'frozen' in name:
            assert backbone['freeze'] and 'constructor' not in cfg.optim_wrapper
        elif 'tiny' not in name:
            assert not backbone['freeze']
            assert cfg.optim_wrapper.constructor == (
                'LayerDecayOptimWrapperConstructor')
            assert cfg.optim_wrapper.paramwise_cfg.layer_decay_rate == 0.95
        if '-6b_' in name:
            assert backbone.drop_path_rate == 0.4
            assert cfg.comm_hook == dict(type='bf16_compress')
        if name in fewshot:
            n = re.search(r'-1of(\d+)-', name).group(1)
            assert cfg.train_dataloader.dataset.ann_file == (
                f'splits/train_1of{n}.txt')


def test_fewshot_splits_are_nested_and_deterministic(tmp_path):
    write_splits = _load(
        'tools/dataset_converters/ade20k_fewshot_splits.py').write_splits
    folder = tmp_path / 'images' / 'training'
    folder.mkdir(parents=True)
    for i in range(100):
        (folder / f'ADE_train_{i:08d}.jpg').touch()
    paths = write_splits(str(tmp_path), seed=3)
    subsets = {
        k: open(p).read().split()
        for k, p in paths.items()
    }
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
    config = osp.join(RECIPES,
                      'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')
    out = subprocess.run([
        'bash', osp.join(ROOT, 'tools', 'dist_train.sh'), config, '2',
        '--work-dir', str(tmp_path / 'work'), '--cfg-options',
        'train_cfg.max_iters=20', 'train_cfg.val_interval=20',
        'default_hooks.logger.interval=10',
        'train_dataloader.dataset.generate.num_train=64',
        'val_dataloader.dataset.generate.num_train=64',
        'train_dataloader.dataset.generate.num_val=16',
        'val_dataloader.dataset.generate.num_val=16'
    ], cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHON=sys.executable, PORT=port))
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
