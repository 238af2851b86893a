"""A 2-rank run that loses a rank to SIGKILL restarts by itself
(``MAX_RESTARTS`` of ``tools/dist_train.sh``: torchrun's
``--max-restarts``), resumes from the newest intact checkpoint and ends
where an uninterrupted run ends."""
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

from mmcv_custom import integrity
from mmcv_custom.launcher import free_port

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DIST_TRAIN = osp.join(ROOT, 'tools', 'dist_train.sh')
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')
FAST = [
    'train_cfg.max_iters=8', 'train_cfg.val_interval=100',
    'default_hooks.checkpoint.interval=2', 'default_hooks.logger.interval=1',
    'train_dataloader.dataset.num_samples=256'
]


def _config(tmp_path, kill=None):
    hooks = ["dict(type='CommHookRegistrationHook')"]
    if kill is not None:
        at_iter, rank = kill
        hooks.append(f"dict(type='KillOnceHook', at_iter={at_iter}, "
                     f"rank={rank}, marker={str(tmp_path / 'killed')!r})")
    path = tmp_path / 'config.py'
    path.write_text(
        f'_base_ = [{MLP!r}]\n'
        "custom_imports = dict(imports=['mmcv_custom', 'mmcv_custom.demo', "
        "'tests.fault_hooks'], allow_failed_imports=False)\n"
        f"custom_hooks = [{', '.join(hooks)}]\n")
    return str(path)


def _dist_train(config, work_dir, restarts, *extra):
    env = dict(os.environ, PYTHON=sys.executable, PORT=free_port(),
               MAX_RESTARTS=str(restarts))
    out = subprocess.run(
        ['bash', DIST_TRAIN, config, '2', '--work-dir', str(work_dir),
         '--cfg-options', *FAST, *extra], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def _weights(path):
    return torch.load(path, map_location='cpu',
                      weights_only=False)['state_dict']


@pytest.mark.slow
def test_a_killed_rank_restarts_and_ends_like_the_uninterrupted_run(
        tmp_path):
    killed = tmp_path / 'killed_run'
    killed.mkdir()
    code, log = _dist_train(_config(killed, kill=(5, 1)), killed / 'work', 2)
    assert code == 0, log[-4000:]
    assert (killed / 'killed').is_file()  # it did die once
    assert 'restart 1 after a failure: resuming from the newest intact ' \
        'checkpoint' in log
    assert 'resumed epoch: 0, iter: 4' in log
    final = killed / 'work' / 'iter_8.pth'
    assert integrity.verify_file(str(final)).status == 'ok'

    whole = tmp_path / 'whole_run'
    whole.mkdir()
    code, log = _dist_train(_config(whole), whole / 'work', 0)
    assert code == 0, log[-4000:]
    a, b = _weights(final), _weights(whole / 'work' / 'iter_8.pth')
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_max_restarts_must_be_a_count(tmp_path):
    code, log = _dist_train(MLP, tmp_path / 'work', 'two')
    assert code == 2
    assert log == ('dist_train.sh: MAX_RESTARTS=two: expected a whole '
                   'number >= 0 (restarts after a failure)\n')
