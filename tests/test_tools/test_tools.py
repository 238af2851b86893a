"""End to end through tools/demo.py: the path `make demo` takes, and the
MMEngine-only MLP demo."""
import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

from mmcv_custom.demo import SyntheticRegressionDataset
from mmcv_custom.launching.ports import free_port
from tests.tool_utils import load_script

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')


def _demo(*args, cwd, env=None):
    return subprocess.run(
        [sys.executable,
         osp.join(ROOT, 'tools', 'demo.py'), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env)


# A small toy set (the config's own is 400 + 100 images, which every rank
# draws before training and the validation and test go through): the
# summary reads the same either way.
SMALL_TOY_SET = [
    f'{split}_dataloader.dataset.generate.{key}={n}'
    for split in ('train', 'val', 'test')
    for key, n in (('num_train', 32), ('num_val', 16))
]


@pytest.mark.slow
def test_demo_trains_evaluates_and_summarizes(tmp_path):
    out = _demo(
        '--cfg-options',
        'train_cfg.max_iters=20',
        'train_cfg.val_interval=20',
        'default_hooks.logger.interval=10',
        *SMALL_TOY_SET,
        cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout[out.stdout.index('Demo summary'):]
    assert ("type='bf16_compress' (bf16_compress_hook), wrapper=None, "
            'state: CompressState(divides by the world size before the bf16 '
            'cast, check_finite=False), topology: flat (one node of 2 '
            'ranks); process group: 2 ranks, backend gloo') in summary
    # Both evaluations of the last checkpoint, each named.
    # (Labels padded to the longest, 'validation (iter 20)'.)
    metrics = r"\{'aAcc': [\d.]+, 'mIoU': [\d.]+, 'mAcc': [\d.]+\}"
    assert re.search(
        r'^  validation \(iter 20\) : ' + metrics + r' \(during training\)$',
        summary, re.M), summary
    assert re.search(
        rf"^  {'test':<20} : " + metrics +
        r' \(tools/dist_test.sh of iter_20.pth\)$', summary, re.M), summary
    # `make demo` writes where docs/en/get_started.md says.
    work_dir = tmp_path / 'work_dirs' / 'demo'
    assert f"  {'work dir':<20} : {work_dir}\n" in summary
    assert (work_dir / 'iter_20.pth').is_file()
    # The toy data was generated where the user ran the demo.
    assert (tmp_path / 'data' / 'toy_shapes' / 'toy_shapes.json').is_file()


@pytest.fixture(scope='module')
def demo():
    return load_script(osp.join(ROOT, 'tools', 'demo.py'), '_demo_tool')


def _fake_run(folder, scalars, log='', name='20261204_135515'):
    """A run folder as MMEngine leaves it: ``<name>/<name>.log`` and
    ``<name>/vis_data/scalars.json``."""
    run = folder / name
    (run / 'vis_data').mkdir(parents=True)
    (run / f'{name}.log').write_text(log)
    (run / 'vis_data' / 'scalars.json').write_text(''.join(
        json.dumps(s) + '\n' for s in scalars))
    return run


_HOOK_LOG = ('2026/12/04 13:55:15 - mmengine - INFO - Registered DDP '
             "communication hook on MMDistributedDataParallel: type='bf16_"
             "compress' (bf16_compress_hook), wrapper=None, state: "
             'CompressState(divides by the world size before the bf16 cast,'
             ' check_finite=False); process group: 2 ranks, backend gloo.\n')


def test_demo_summary_names_validation_and_test(demo, tmp_path):
    train = tmp_path / 'demo'
    _fake_run(
        train, [
            dict(loss=0.2178, step=50),
            dict(loss=0.0574, step=600),
            dict(aAcc=98.15, mIoU=90.0512, mAcc=94.04, step=600),
        ],
        log=_HOOK_LOG)
    run = _fake_run(train / 'eval', [], name='20261204_135610')
    (run / '20261204_135610.json').write_text(
        json.dumps(dict(aAcc=98.16, mIoU=90.12, mAcc=94.1, time=0.1)))
    summary = demo.summarize(
        str(train), str(train / 'eval'), 42.4,
        str(train / 'iter_600.pth')).splitlines()
    assert summary[2:9] == [
        'Demo summary',
        '  comm hook             : ' +
        _HOOK_LOG.split(' - INFO - ')[1].strip(),
        '  loss                  : 0.2178 (iter 50) -> 0.0574 (iter 600)',
        "  validation (iter 600) : {'aAcc': 98.15, 'mIoU': 90.05, 'mAcc': "
        '94.04} (during training)',
        "  test                  : {'aAcc': 98.16, 'mIoU': 90.12, 'mAcc': "
        '94.1} (tools/dist_test.sh of iter_600.pth)',
        '  wall time             : 42.4 s (training and test)',
        f'  work dir              : {train}',
    ]


def test_demo_summary_without_a_test_says_no_eval(demo, tmp_path):
    # `--no-eval`: the validation during training is shown as such, and
    # nothing is called eval or test.
    train = tmp_path / 'mlp'
    _fake_run(
        train, [
            dict(loss=0.3, step=50),
            dict(loss=0.01, step=300),
            {
                'regression/mse': 0.009123,
                'step': 300
            },
        ],
        log=_HOOK_LOG)
    summary = demo.summarize(str(train), None, 10.0)
    assert ("  validation (iter 300) : {'regression/mse': 0.009123} (during "
            'training)') in summary
    labels = [line.split(' : ')[0].strip() for line in summary.splitlines()]
    assert labels[3:] == [
        'comm hook', 'loss', 'validation (iter 300)', 'wall time', 'work dir',
        '=' * 72
    ]
    assert '  wall time             : 10.0 s (training)' in summary
    # A config that never validated shows neither.
    quiet = tmp_path / 'quiet'
    _fake_run(quiet, [dict(loss=0.3, step=50)], log=_HOOK_LOG)
    assert 'validation' not in demo.summarize(str(quiet), None, 1.0)


def test_synthetic_validation_set_samples_the_training_function():
    train = SyntheticRegressionDataset(
        num_samples=256, seed=0, function_seed=0)
    val = SyntheticRegressionDataset(num_samples=64, seed=1, function_seed=0)
    other = SyntheticRegressionDataset(num_samples=64, seed=1, function_seed=1)
    assert not torch.equal(train.inputs[:64], val.inputs)
    assert torch.equal(val.inputs, other.inputs)
    # Recover the training set's projection (targets = tanh(x @ P / sqrt
    # 32)) and predict the validation targets with it.
    x, t = train.inputs.double(), train.targets.double()
    proj = torch.linalg.lstsq(x, torch.atanh(t) * 32**0.5).solution
    predicted = torch.tanh(val.inputs.double() @ proj / 32**0.5)
    torch.testing.assert_close(
        predicted, val.targets.double(), rtol=0, atol=1e-4)
    assert (other.targets - val.targets).abs().mean() > 0.1


@pytest.mark.slow
def test_mlp_demo_learns_the_function_in_its_own_work_dir(tmp_path):
    port = free_port()
    out = _demo(
        '--config',
        MLP,
        '--cfg-options',
        'train_cfg.max_iters=100',
        'train_cfg.val_interval=100',
        'comm_hook.type=powerSGD',
        'comm_hook.wrapper=fp16',
        'comm_hook.start_powerSGD_iter=5',
        cwd=str(tmp_path),
        env=dict(os.environ, PORT=port))
    assert out.returncode == 0, out.stderr[-3000:]
    # Both runs on the PORT given (PORT=... make demo), as dist_train.sh.
    assert f'demo: training on PORT={port}\n' in out.stderr
    assert f'demo: evaluation on PORT={port}\n' in out.stderr
    assert "type='powerSGD' (powersgd_hook), wrapper='fp16'" in out.stdout
    # Tested by tools/dist_test.sh on the validation set, shown to four
    # significant digits (an MSE of 0.03 is not 0.0).
    assert re.search(
        rf"  {'test':<21} : " + r"\{'regression/mse': 0\.0\d{3,4}\} "
        r'\(tools/dist_test.sh of iter_100.pth\)', out.stdout), out.stdout
    assert '(training and test)' in out.stdout
    # Not work_dirs/demo, where `make demo` keeps the segmenter.
    work_dir = tmp_path / 'work_dirs' / 'mlp_2xb32-300iter_synthetic'
    assert (work_dir / 'iter_100.pth').is_file()
    assert not (tmp_path / 'work_dirs' / 'demo').exists()
    scalars = glob.glob(str(work_dir / '2*' / 'vis_data' / 'scalars.json'))
    mse = [
        json.loads(ln)['regression/mse'] for ln in open(scalars[0])
        if 'regression/mse' in ln
    ]
    # The validation set samples the function the MLP trained on, so its
    # MSE is far below that of predicting the mean (the variance of the
    # targets, about 0.37); measured 0.036 after 100 iterations.
    val = SyntheticRegressionDataset(num_samples=512, seed=1, function_seed=0)
    assert len(mse) == 1 and mse[0] < 0.2 * float(val.targets.var())
