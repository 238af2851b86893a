"""End to end through tools/demo.py: the path `make demo` takes."""
import os.path as osp
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')


def _demo(*args, cwd):
    return subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', 'demo.py'), *args],
        capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.slow
def test_demo_trains_evaluates_and_summarizes(tmp_path):
    out = _demo('--work-dir', str(tmp_path / 'work'), '--cfg-options',
                'train_cfg.max_iters=20', 'train_cfg.val_interval=20',
                'default_hooks.logger.interval=10', cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout[out.stdout.index('Demo summary'):]
    assert ("type='bf16_compress' (bf16_compress_hook), wrapper=None, "
            'state: CompressState(predivide_factor=default (fp16 only), '
            'check_finite=False); process group: 2 ranks, backend gloo'
            ) in summary
    assert '(iter 20)' in summary
    assert "'mIoU'" in summary
    assert (tmp_path / 'work' / 'iter_20.pth').is_file()
    # The toy data was generated where the user ran the demo.
    assert (tmp_path / 'data' / 'toy_shapes' / 'toy_shapes.json').is_file()


@pytest.mark.slow
def test_mmengine_only_demo_and_cfg_options_switch_the_hook(tmp_path):
    out = _demo('--config', MLP, '--no-eval', '--work-dir', str(tmp_path),
                '--cfg-options', 'train_cfg.max_iters=20',
                'train_cfg.val_interval=20', 'comm_hook.type=powerSGD',
                'comm_hook.wrapper=fp16', 'comm_hook.start_powerSGD_iter=5',
                cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "type='powerSGD' (powerSGD_hook), wrapper='fp16'" in out.stdout
    assert "'regression/mse'" in out.stdout
