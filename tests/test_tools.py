"""End to end through tools/: the same path `make demo` takes."""
import os.path as osp
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


@pytest.mark.slow
def test_demo_trains_on_two_gloo_ranks_with_bf16(tmp_path):
    out = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', 'demo.py'), '--work-dir',
         str(tmp_path), '--cfg-options', 'train_cfg.max_iters=60',
         'train_cfg.val_interval=60', 'default_hooks.logger.interval=20'],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout[out.stdout.index('Demo summary'):]
    assert ("type='bf16_compress' (bf16_compress_hook), wrapper=None; "
            'process group: 2 ranks, backend gloo') in summary
    assert '(iter 60)' in summary
    assert "'regression/mse'" in summary
    assert list(tmp_path.glob('iter_60.pth'))


@pytest.mark.slow
def test_cfg_options_switch_the_hook(tmp_path):
    out = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', 'demo.py'), '--work-dir',
         str(tmp_path), '--cfg-options', 'train_cfg.max_iters=20',
         'train_cfg.val_interval=20', 'comm_hook.type=powerSGD',
         'comm_hook.wrapper=fp16', 'comm_hook.start_powerSGD_iter=5'],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "type='powerSGD' (powerSGD_hook), wrapper='fp16'" in out.stdout
