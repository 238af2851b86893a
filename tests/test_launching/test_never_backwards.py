"""A run never goes backwards, through the real ``tools/train.py`` and
``tools/dist_train.sh``: a restarted fine-tuning run keeps its own newer
checkpoints, a new run does not overwrite an older one, two trainings do
not share a work dir, ``--resume`` stops when nothing can be resumed, and
a save that fails on a full disk leaves nothing behind. (The rules
themselves, file by file: ``test_run_start.py``.)"""
import os
import os.path as osp
import signal
import subprocess
import sys
import time

import pytest
import torch

from mmcv_custom import integrity
from mmcv_custom.launching.ports import free_port
from mmcv_custom.launching.work_dir_lock import LOCK_FILE
from tests.test_engine.test_checkpoint_integrity import (FAST, MLP, ROOT,
                                                         TRAIN, _flip, _train)
from .test_restart import _config, _dist_train, _weights

DIST_TRAIN = osp.join(ROOT, 'tools', 'dist_train.sh')


def _files(folder):
    """Every file under ``folder`` with its modification time."""
    found = {}
    for here, _, names in os.walk(folder):
        for name in names:
            path = osp.join(here, name)
            found[osp.relpath(path, folder)] = os.stat(path).st_mtime_ns
    return found


@pytest.mark.slow
def test_a_restarted_fine_tuning_run_keeps_its_own_checkpoints(tmp_path):
    """The tester's case: ``MAX_RESTARTS=1``, ``load_from`` another run's
    ``iter_4.pth``, a rank SIGKILLed after this run saved its own
    ``iter_4.pth``. The restart continues this run (not the other one),
    overwrites none of its checkpoints with older iterations, and ends
    bit for bit where the uninterrupted fine-tuning run ends."""
    other = tmp_path / 'other'
    code, log = _train(other, 'train_cfg.max_iters=4')
    assert code == 0, log[-3000:]
    seed = str(other / 'iter_4.pth')
    untouched = _files(other)
    final = {}
    for name, kill in (('killed', (5, 1)), ('whole', None)):
        folder = tmp_path / name
        folder.mkdir()
        code, log = _dist_train(
            _config(folder, kill=kill), folder / 'work', 1 if kill else 0,
            f'load_from={seed}')
        assert code == 0, log[-4000:]
        final[name] = _weights(folder / 'work' / 'iter_8.pth')
        if kill:
            assert (folder / 'killed').is_file()
            assert 'dist_train.sh: local rank 1 was killed by SIGKILL; ' \
                'restarting every rank (restart 1 of 1)' in log
            assert 'restart 1 after a failure: resuming from the newest ' \
                'intact checkpoint' in log
            assert (f"load_from='{seed}' is not used: this run continues "
                    f"from its own newest checkpoint {folder / 'work'}/"
                    'iter_4.pth') in log
            assert 'resumed epoch: 0, iter: 4' in log
            assert f'Load checkpoint from {seed}' not in log.split(
                'restarting every rank')[1]
    a, b = final['killed'], final['whole']
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert _files(other) == untouched  # the other run is left alone


def test_a_new_run_does_not_overwrite_an_older_one(tmp_path):
    work = tmp_path / 'work'
    code, log = _train(work)
    assert code == 0, log[-3000:]
    saved = _files(work)
    # Again without --resume: refused, exit 2, nothing written.
    code, log = _train(work)
    assert code == 2, log[-3000:]
    assert log.strip() == (
        f"train.py: error: work_dir '{work}' already holds the checkpoints "
        'of a run (the newest: iter_6.pth): a new run there would '
        'overwrite them with older iterations. Fix: continue that run with '
        '--resume; or choose another --work-dir; or add --overwrite to '
        f'start again there (its checkpoints are then moved into {work}/'
        'superseded_...)')
    assert _files(work) == saved
    # --resume when every checkpoint is refused: exit 2, each named.
    for step in (2, 4, 6):
        _flip(str(work / f'iter_{step}.pth'))
    saved = _files(work)
    code, log = _train(work, 'train_cfg.max_iters=8', resume=True)
    assert code == 2, log[-3000:]
    assert log.startswith(f'train.py: error: --resume: no checkpoint in '
                          f'{work} can be resumed from (3 found, each '
                          f'refused: {work}/iter_6.pth is damaged: ')
    for step in (4, 2):
        assert f'; {work}/iter_{step}.pth is damaged: ' in log
    assert 'Fix: restore an intact copy of one of them' in log
    assert _files(work) == saved
    # --overwrite: starts again; the damaged ones are kept aside.
    code, log = _train(work, '--overwrite')
    assert code == 0, log[-3000:]
    assert (f'--overwrite: moved 3 checkpoints of this work dir (iter_6.pth, '
            'iter_4.pth, iter_2.pth, with their digests and hook state '
            'files) and its last_checkpoint and last_validation into '
            f'{work}/superseded_iter_6') in log
    assert sorted(os.listdir(work / 'superseded_iter_6')) == sorted(
        [f'iter_{s}.pth{x}' for s in (2, 4, 6)
         for x in ('', '.sha256')] + ['last_checkpoint', 'last_validation'])
    for step in (2, 4, 6):
        assert integrity.verify_file(str(work / f'iter_{step}.pth')).status \
            == 'ok'
    assert not (work / LOCK_FILE).exists()


def test_resume_into_a_work_dir_that_does_not_exist_says_so(tmp_path):
    work = tmp_path / 'typo'
    code, log = _train(work, 'train_cfg.max_iters=2', resume=True)
    assert code == 0, log[-3000:]
    line = (f'WARNING - --resume: the work dir {work} does not exist, so '
            'there is nothing to resume: starting a new run at iteration 0 '
            '(check --work-dir if you meant to continue a run)')
    assert line in log  # on the console, not only in the log file


def test_two_trainings_on_one_work_dir(tmp_path):
    work = tmp_path / 'work'
    first = subprocess.Popen([
        sys.executable, TRAIN, MLP, '--work-dir',
        str(work), '--cfg-options', *FAST, 'train_cfg.max_iters=100000',
        'default_hooks.checkpoint.interval=100000'
    ],
                             cwd=ROOT,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (work / LOCK_FILE).is_file() or not (
                work / LOCK_FILE).stat().st_size:
            assert time.time() < deadline and first.poll() is None
            time.sleep(0.2)
        code, log = _train(work, '--overwrite')
        assert code == 2
        assert log.startswith(
            f"train.py: error: work_dir '{work}' is in use by another "
            f'training (pid {first.pid} on ')
        assert log.strip().endswith(
            f'it holds {work}/{LOCK_FILE}. Fix: wait for that run to end or '
            'stop it, or choose another --work-dir')
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Killed: the next run takes the lock over, and says whose it was.
    code, log = _train(work, 'train_cfg.max_iters=2', '--overwrite')
    assert code == 0, log[-3000:]
    assert (f"took over the lock of work_dir '{work}' from pid "
            f'{first.pid} on ') in log
    assert '(that process is gone), which ended without releasing it' in log
    assert not (work / LOCK_FILE).exists()


@pytest.mark.slow
def test_a_save_that_fails_on_a_small_disk_leaves_nothing(
        tmp_path, small_disk):
    """2 ranks under int8_compress (a state file per rank beside each
    checkpoint), checkpoints in ``default_hooks.checkpoint.out_dir`` on a
    small tmpfs that fills up just before the save of ``iter_4.pth``: the
    run fails once, saying why, and leaves no file of that save."""
    folder = small_disk / 'work'
    hook = (f"dict(type='FillDiskHook', at_iter=4, folder={str(folder)!r})")
    env = dict(os.environ, FILL_DISK_KEEP=str(1300 * 1000))
    out = subprocess.run([
        'bash', DIST_TRAIN,
        _config(tmp_path, hook=hook), '2', '--work-dir',
        str(tmp_path / 'work'), '--cfg-options', *FAST,
        'comm_hook.type=int8_compress',
        f'default_hooks.checkpoint.out_dir={small_disk}'
    ],
                         cwd=ROOT,
                         env=dict(
                             env,
                             PYTHON=sys.executable,
                             PORT=free_port(),
                             MAX_RESTARTS='0'),
                         capture_output=True,
                         text=True,
                         timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 1, log[-3000:]
    assert log.count('No space left on device') == 1, log[-3000:]
    assert 'train.py: error on rank 0: OSError: [Errno 28] No space left ' \
        'on device' in log
    assert 'The checkpoint save failed: removed the communication-hook ' \
        'state files of 2 ranks written for it' in log
    names = sorted(os.listdir(folder))
    assert [n for n in names if n.startswith('iter_4')] == []
    assert [n for n in names if integrity.is_temporary_name(n)] == []
    assert 'iter_2.pth.comm_hook_rank1.pth' in names
