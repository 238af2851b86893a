"""End to end through tools/demo.py: the path `make demo` takes, and the
MMEngine-only MLP demo."""
import glob
import json
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

from mmcv_custom.demo import SyntheticRegressionDataset

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')


def _demo(*args, cwd):
    return subprocess.run(
        [sys.executable,
         osp.join(ROOT, 'tools', 'demo.py'), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd)


@pytest.mark.slow
def test_demo_trains_evaluates_and_summarizes(tmp_path):
    out = _demo(
        '--cfg-options',
        'train_cfg.max_iters=20',
        'train_cfg.val_interval=20',
        'default_hooks.logger.interval=10',
        cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout[out.stdout.index('Demo summary'):]
    assert (
        "type='bf16_compress' (bf16_compress_hook), wrapper=None, "
        'state: CompressState(predivide_factor=default (fp16 only), '
        'check_finite=False); process group: 2 ranks, backend gloo') in summary
    assert '(iter 20)' in summary
    assert "'mIoU'" in summary
    # `make demo` writes where docs/en/get_started.md says.
    work_dir = tmp_path / 'work_dirs' / 'demo'
    assert f'work dir  : {work_dir}\n' in summary
    assert (work_dir / 'iter_20.pth').is_file()
    # The toy data was generated where the user ran the demo.
    assert (tmp_path / 'data' / 'toy_shapes' / 'toy_shapes.json').is_file()


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
    out = _demo(
        '--config',
        MLP,
        '--cfg-options',
        'train_cfg.max_iters=100',
        'train_cfg.val_interval=100',
        'comm_hook.type=powerSGD',
        'comm_hook.wrapper=fp16',
        'comm_hook.start_powerSGD_iter=5',
        cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "type='powerSGD' (powersgd_hook), wrapper='fp16'" in out.stdout
    # Evaluated by tools/test.py on the validation set, shown to four
    # significant digits (an MSE of 0.03 is not 0.0).
    assert re.search(r"eval      : \{'regression/mse': 0\.0\d{3,4}\}",
                     out.stdout), out.stdout
    assert '(training and evaluation)' in out.stdout
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
