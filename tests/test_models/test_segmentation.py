"""The segmentation pieces: toy dataset, configs, and the tools end to end."""
import glob
import json
import os
import os.path as osp
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from mmengine.config import Config
from PIL import Image

import mmcv_custom.datasets  # noqa: F401  (registers ToyShapesDataset)
from mmcv_custom import check_comm_hook_cfg
from mmcv_custom.datasets.toy_shapes import CLASSES, generate_toy_shapes
from mmcv_custom.launching.ports import free_port
from mmcv_custom.testing import run_ranks
from tests.tool_utils import toy_set

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DIST_TRAIN = osp.join(ROOT, 'tools', 'dist_train.sh')
DEMO = osp.join(ROOT, 'configs', 'fcn',
                'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
CONFIGS = sorted(
    p for p in glob.glob(
        osp.join(ROOT, 'configs', '**', '*.py'), recursive=True)
    if '_base_' not in p)
# {algorithm}_{backbone}_{N}xb{B}-{extra-}{iters}_{dataset}-{crop}.py
NAME = re.compile(r'^[a-z0-9]+_[a-z0-9-]+_\d+xb\d+-([a-z0-9-]+-)?\d+[a-z]*'
                  r'_[a-z0-9-]+-\d+x\d+\.py$')


def _tree(root):
    out = {}
    for path in sorted(glob.glob(osp.join(root, '*_dir', '*', '*.png'))):
        with open(path, 'rb') as f:
            out[osp.relpath(path, root)] = f.read()
    return out


def test_toy_dataset_is_deterministic_in_mmseg_layout(tmp_path):
    a = _tree(
        generate_toy_shapes(str(tmp_path / 'a'), num_train=12, num_val=4))
    b = _tree(
        generate_toy_shapes(str(tmp_path / 'b'), num_train=12, num_val=4))
    assert a == b
    assert len([k for k in a if k.startswith('img_dir/train/')]) == 12
    assert len([k for k in a if k.startswith('ann_dir/val/')]) == 4
    labels = np.stack([
        np.array(
            Image.open(tmp_path / 'a' / 'ann_dir' / 'train' / f'{i:04d}.png'))
        for i in range(12)
    ])
    assert labels.shape == (12, 64, 64)
    assert set(np.unique(labels)) == set(range(len(CLASSES)))
    image = np.array(
        Image.open(tmp_path / 'a' / 'img_dir' / 'train' / '0000.png'))
    assert image.shape == (64, 64, 3)


def test_toy_dataset_regenerates_when_its_parameters_change(tmp_path):
    root = str(tmp_path / 'toy')
    generate_toy_shapes(root, num_train=4, num_val=2)
    generate_toy_shapes(root, num_train=6, num_val=2, seed=3)
    assert len(glob.glob(osp.join(root, 'img_dir', 'train', '*'))) == 6
    with open(osp.join(root, 'toy_shapes.json')) as f:
        assert json.load(f)['seed'] == 3


def _generate(rank, world_size, root):
    generate_toy_shapes(root, num_train=40, num_val=8)
    return _tree(root)


def test_every_rank_may_generate_at_once(tmp_path):
    root = str(tmp_path / 'toy')
    first, second = run_ranks(_generate, root, world_size=2)
    reference = _tree(generate_toy_shapes(str(tmp_path / 'ref'), 40, 8))
    assert first == second == reference
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith('.toy')]
    assert leftovers == []


def test_dataset_builds_through_the_mmseg_registry(tmp_path):
    from mmengine.registry import DefaultScope
    from mmseg.registry import DATASETS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmseg'):
        dataset = DATASETS.build(
            dict(
                type='ToyShapesDataset',
                data_root=str(tmp_path / 'toy'),
                generate=dict(num_train=5, num_val=3),
                data_prefix=dict(
                    img_path='img_dir/val', seg_map_path='ann_dir/val'),
                pipeline=[
                    dict(type='LoadImageFromFile'),
                    dict(type='LoadAnnotations'),
                    dict(type='PackSegInputs')
                ]))
        sample = dataset[0]
    assert len(dataset) == 3
    assert dataset.metainfo['classes'] == CLASSES
    assert tuple(sample['inputs'].shape) == (3, 64, 64)
    assert tuple(sample['data_samples'].gt_sem_seg.data.shape) == (1, 64, 64)


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.relpath(p, ROOT))
def test_config_loads_with_a_valid_comm_hook(path):
    cfg = Config.fromfile(path)
    if 'demo' not in path:
        assert NAME.match(osp.basename(path)), osp.basename(path)
    check_comm_hook_cfg(cfg.comm_hook)
    assert dict(type='CommHookRegistrationHook') in cfg.custom_hooks
    assert 'mmcv_custom' in cfg.custom_imports.imports


@pytest.mark.parametrize(
    'path', [
        DEMO,
        osp.join(ROOT, 'configs', 'upernet',
                 'upernet_r50_4xb4-bf16-compress-160k_ade20k-512x512.py'),
        osp.join(
            ROOT, 'configs', 'upernet',
            'upernet_vit-b16-mln_8xb2-bf16-compress-160k_ade20k-512x512.py'),
    ],
    ids=['toy-fcn', 'upernet-r50', 'upernet-vit-b16'])
def test_config_builds_its_model(path):
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    cfg = Config.fromfile(path)
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = MODELS.build(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    assert params > 1e5


# ---------------------------------------------------------------------------
# End to end through tools/, as a user runs them.

HOOKS = {
    'allreduce': dict(type='allreduce'),
    'bf16_compress': dict(type='bf16_compress'),
    'powerSGD-bf16':
    dict(type='powerSGD', wrapper='bf16', start_powerSGD_iter=4),
}
SHORT = [
    'train_cfg.max_iters=10',
    'train_cfg.val_interval=10',
    'default_hooks.checkpoint.interval=5',
    'default_hooks.logger.interval=1',
] + toy_set(64, 16)


def _tool(args, cwd, **env):
    full_env = dict(os.environ, PYTHON=sys.executable, PORT=free_port(), **env)
    return subprocess.run(
        args,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600)


def _hook_options(cfg):
    return [f'comm_hook.{key}={value}' for key, value in cfg.items()]


def _scalars(work_dir):
    runs = sorted(
        glob.glob(osp.join(work_dir, '2*_*', 'vis_data', 'scalars.json')))
    return [json.loads(ln) for ln in open(runs[-1])]


#: The run whose config forgot the runner hook (tools/train.py adds it).
FORGOT = 'allreduce'


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """The demo config trained for 10 iterations with each hook, on 2 gloo
    ranks through tools/dist_train.sh, sharing one generated toy dataset;
    the ``allreduce`` run from a config that forgot the runner hook in its
    ``custom_hooks`` (test_train_tool_adds_the_runner_hook_a_config_forgot).
    (fp16_compress through the tools: test_console.py's failure.)"""
    cwd = tmp_path_factory.mktemp('runs')
    forgot = cwd / 'forgot_hook.py'
    forgot.write_text(f'_base_ = [{DEMO!r}]\n'
                      'custom_hooks = []\n'
                      f'comm_hook = {HOOKS[FORGOT]!r}\n')
    results = {}
    for name, hook in HOOKS.items():
        work_dir = str(cwd / name)
        config = str(forgot) if name == FORGOT else DEMO
        # PowerSGD's as a user writes a hook on the command line: one
        # dict of several keys (MMEngine's DictAction alone recursed until
        # a RecursionError on it).
        options = ([_dict_option(hook)]
                   if name == 'powerSGD-bf16' else _hook_options(hook))
        out = _tool([
            'bash', DIST_TRAIN, config, '2', '--work-dir', work_dir,
            '--cfg-options', *SHORT, *options
        ], cwd)
        results[name] = (work_dir, out)
    return cwd, results


def _dict_option(hook):
    keys = ', '.join(f'{key}={value!r}' for key, value in hook.items())
    return f'comm_hook=dict({keys})'


@pytest.mark.slow
@pytest.mark.parametrize('name', list(HOOKS))
def test_dist_train_with_each_hook(trained, name):
    _, results = trained
    work_dir, out = results[name]
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    expected = {
        'allreduce': "type='allreduce' (allreduce_hook), wrapper=None",
        'bf16_compress': "type='bf16_compress' (bf16_compress_hook)",
        'powerSGD-bf16': "type='powerSGD' (powersgd_hook), wrapper='bf16'",
    }[name]
    assert expected in log
    assert 'process group: 2 ranks, backend gloo' in log
    assert 'SyncBN needs GPUs' in log
    assert osp.isfile(osp.join(work_dir, 'iter_10.pth'))
    scalars = _scalars(work_dir)
    assert [s['step'] for s in scalars if 'loss' in s] == list(range(1, 11))
    assert any('mIoU' in s for s in scalars)


@pytest.mark.slow
def test_bf16_losses_follow_fp32(trained):
    """Same seed, same data order: per-iteration losses of bf16_compress
    stay within 2% of full-precision all-reduce over 10 steps (measured: a
    few 1e-4 relative)."""
    _, results = trained
    exact = [
        s['loss'] for s in _scalars(results['allreduce'][0]) if 'loss' in s
    ]
    half = [
        s['loss'] for s in _scalars(results['bf16_compress'][0]) if 'loss' in s
    ]
    assert len(exact) == len(half) == 10
    rel = [abs(h - e) / e for h, e in zip(half, exact)]
    assert max(rel) < 0.02, rel
    assert exact[-1] < exact[0]


@pytest.mark.slow
def test_unsafe_checkpoint_is_refused_with_a_clear_message(trained, tmp_path):
    import argparse
    cwd, results = trained
    bad = str(tmp_path / 'bad.pth')
    checkpoint = torch.load(
        osp.join(results['bf16_compress'][0], 'iter_10.pth'))
    checkpoint['meta']['args'] = argparse.Namespace(lr=1)
    torch.save(checkpoint, bad)
    for cmd in ([
            sys.executable,
            osp.join(ROOT, 'tools', 'test.py'), DEMO, bad
    ], [
            sys.executable,
            osp.join(ROOT, 'tools', 'train.py'), DEMO, '--resume',
            '--cfg-options', f'load_from={bad}', f'work_dir={tmp_path}'
    ]):
        out = _tool(cmd, cwd)
        assert out.returncode != 0
        assert f'Refusing to load {bad}: it contains argparse.Namespace' in (
            out.stderr)


@pytest.mark.slow
def test_stock_mmseg_train_tool_with_custom_imports(tmp_path):
    import mmseg
    stock = osp.join(osp.dirname(mmseg.__file__), '.mim', 'tools', 'train.py')
    out = _tool([
        sys.executable, stock, DEMO, '--work-dir',
        str(tmp_path / 'work'), '--cfg-options', *SHORT,
        'train_cfg.max_iters=4', 'train_cfg.val_interval=4'
    ],
                str(tmp_path),
                PYTHONPATH=ROOT)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert ("comm_hook=dict(type='bf16_compress') not registered: the model "
            '(EncoderDecoder) is not distributed (neither wrapped in '
            'DistributedDataParallel nor sharded by FSDP2)') in log
    assert 'mIoU' in log


@pytest.mark.slow
def test_train_tool_adds_the_runner_hook_a_config_forgot(trained):
    """A config that sets comm_hook but left CommHookRegistrationHook out
    of custom_hooks gets it added, with one log line; the others (which
    have it) get nothing added."""
    _, results = trained
    for name, (_, out) in results.items():
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-3000:]
        added = log.count('CommHookRegistrationHook in custom_hooks: added it')
        assert added == (name == FORGOT), (name, added)
    log = results[FORGOT][1].stdout + results[FORGOT][1].stderr
    assert "type='allreduce' (allreduce_hook), wrapper=None" in log


@pytest.mark.slow
def test_copied_powersgd_run_resumes_with_a_rank_file_missing_then_evaluate(
        trained, tmp_path):
    """Through tools/dist_train.sh --resume: a copied work dir resumes from
    its own checkpoint (its last_checkpoint still names the original), and
    with one rank's state file gone every rank starts the hook state
    afresh, says so once in the log file, and trains on, each iteration
    after the checkpoint logged once; then tools/test.py evaluates the
    resumed run's checkpoint."""
    cwd, results = trained
    original, out = results['powerSGD-bf16']
    assert out.returncode == 0
    before = sorted(os.listdir(original))
    copy = tmp_path / 'copy'
    shutil.copytree(original, copy)
    missing = copy / 'iter_10.pth.comm_hook_rank1.pth'
    missing.unlink()
    resumed = _tool([
        'bash',
        osp.join(ROOT, 'tools', 'dist_train.sh'), DEMO, '2', '--work-dir',
        str(copy), '--resume', '--cfg-options', *SHORT,
        'train_cfg.max_iters=15', 'train_cfg.val_interval=15',
        *_hook_options(HOOKS['powerSGD-bf16'])
    ], cwd)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    assert f'so resuming from {copy}/iter_10.pth' in log
    assert 'resumed epoch: 0, iter: 10' in log
    warning = ('Not restoring the powerSGD communication-hook state (rank 1: '
               f'{missing} is missing). Every rank starts it afresh at step '
               '10')
    assert log.count(warning) == 1
    (run, ) = [
        n for n in set(os.listdir(copy)) - set(before) if (copy / n).is_dir()
    ]
    (log_file, ) = (copy / run).glob('*.log')
    assert warning in log_file.read_text()
    steps = [s['step'] for s in _scalars(copy) if 'loss' in s]
    assert steps == list(range(11, 16))
    assert (copy / 'iter_15.pth').is_file()
    assert sorted(os.listdir(original)) == before  # the original untouched

    tested = _tool([
        sys.executable,
        osp.join(ROOT, 'tools', 'test.py'), DEMO,
        str(copy / 'iter_15.pth'), '--work-dir',
        str(copy / 'eval'), '--cfg-options', *SHORT
    ], cwd)
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert re.search(r'mIoU: \d+\.\d+', tested.stdout + tested.stderr)
