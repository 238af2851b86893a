"""A run writes only what it owns and continues only its own run, through
the real ``tools/train.py`` and ``tools/dist_train.sh``: no file is
written through a link (the lock, ``last_checkpoint``, the dumped config,
checkpoints, digests, hook state files, the validation record, the
metrics' result parts), a ``last_checkpoint`` naming another run's file is
not followed, another run's checkpoint copied in is refused naming both
runs, and a validation lost to a killed rank is run when the run resumes,
with nothing left in the directory it was started from."""
import os
import os.path as osp
import shutil
import subprocess

import pytest

from mmcv_custom import integrity
from mmcv_custom.integrity.checkpoint_choice import run_of
from mmcv_custom.launching.work_dir_lock import LOCK_FILE, WorkDirLock
from tests.test_engine.test_checkpoint_integrity import MLP
from tests.test_engine.test_checkpoint_integrity import _train as train
from .test_restart import _dist_train

# One process, a checkpoint every 2 iterations, a validation at the end.
QUICK = [
    'train_cfg.max_iters=6', 'train_cfg.val_interval=6',
    'default_hooks.checkpoint.interval=2', 'default_hooks.logger.interval=1',
    'train_dataloader.dataset.num_samples=256',
    'val_dataloader.dataset.num_samples=64', 'comm_hook.type=allreduce'
]


def _train(work_dir, *extra, resume=False):
    return train(work_dir, *extra, resume=resume, fast=QUICK)


def _contents(folder):
    """Every file under ``folder`` (links followed) with its bytes."""
    found = {}
    for here, _, names in os.walk(folder):
        for name in names:
            path = osp.join(here, name)
            with open(path, 'rb') as f:
                found[osp.relpath(path, folder)] = f.read()
    return found


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Two runs of the MLP demo, 6 iterations each (checkpoints 2, 4, 6;
    validated at 6): ``mine`` with seed 0, ``other`` with seed 1."""
    base = tmp_path_factory.mktemp('runs')
    for name, seed in (('mine', 0), ('other', 1)):
        code, log = _train(base / name, f'randomness.seed={seed}')
        assert code == 0, log[-3000:]
    return base / 'mine', base / 'other'


def _victim(tmp_path, name='victim'):
    path = tmp_path / name
    path.write_text('a file of the user, outside the work dir\n')
    return path


# -- links ------------------------------------------------------------------
def test_a_linked_lock_refuses_the_start_and_writes_nothing(tmp_path):
    work = tmp_path / 'work'
    work.mkdir()
    victim = _victim(tmp_path)
    (work / LOCK_FILE).symlink_to(victim)
    # A start refused a moment later anyway (load_from is missing).
    code, log = _train(work, 'load_from=/nowhere/iter_2.pth')
    assert code == 2, log[-3000:]
    assert log.strip() == (
        f'train.py: error: {work}/{LOCK_FILE} is a symbolic link to '
        f"{victim}: the work dir's lock file is never written through a "
        'link (the run writes its pid and command into it, which would '
        f'overwrite what the link points to). Fix: remove it (rm {work}/'
        f'{LOCK_FILE}: what it points to is left as it is), or choose '
        'another --work-dir')
    assert victim.read_text() == 'a file of the user, outside the work dir\n'
    assert (work / LOCK_FILE).is_symlink()  # the user's to remove
    # A hard link: one file with two names, refused the same way.
    (work / LOCK_FILE).unlink()
    os.link(victim, work / LOCK_FILE)
    with pytest.raises(integrity.LinkedFileError) as refused:
        WorkDirLock(str(work)).acquire()
    assert str(refused.value).startswith(
        f'{work}/{LOCK_FILE} is a hard link: the same file has 2 names: the '
        "work dir's lock file is never written through a link")
    assert victim.read_text() == 'a file of the user, outside the work dir\n'
    # A folder of that name.
    (work / LOCK_FILE).unlink()
    (work / LOCK_FILE).mkdir()
    with pytest.raises(integrity.LinkedFileError, match='not a plain file'):
        WorkDirLock(str(work)).acquire()


def test_a_work_dir_copied_as_links_writes_through_none(runs, tmp_path):
    """``cp -rs``: every file of the copy is a link into the original run,
    and links planted under the other names the run writes point at a
    user's file. The resumed copy trains on; the original run and the
    user's file are byte for byte as they were."""
    mine, _ = runs
    copy = tmp_path / 'copy'
    subprocess.run(['cp', '-rs', str(mine), str(copy)], check=True)
    victim = _victim(tmp_path)
    planted = [
        'iter_8.pth.sha256', 'iter_8.pth.comm_hook_rank0.pth',
        'iter_8.pth.comm_hook_rank0.pth.sha256', '.dist_test'
    ]
    for name in planted:
        (copy / name).symlink_to(victim)
    # iter_6 gone from the copy (its digest's link stays): the copy resumes
    # iter_4 and saves iter_6 again, under the linked digest's name.
    (copy / 'iter_6.pth').unlink()
    original = _contents(mine)
    code, log = _train(
        copy, 'train_cfg.max_iters=8', 'train_cfg.val_interval=4', resume=True)
    assert code == 0, log[-3000:]
    for name in ('last_checkpoint', 'mlp_2xb32-300iter_synthetic.py'):
        assert (f'WARNING - {copy}/{name} is a symbolic link to {mine}/{name}'
                ': ') in log
        assert ('so it was replaced by a file of this run\'s own with the '
                'same contents (what it pointed to is left as it is)') in log
    assert 'resumed epoch: 0, iter: 4' in log
    assert _contents(mine) == original
    assert victim.read_text() == 'a file of the user, outside the work dir\n'
    # What the run wrote is its own, under every name it wrote.
    for name in ('iter_6.pth', 'iter_6.pth.sha256', 'iter_8.pth',
                 'iter_8.pth.sha256', 'last_checkpoint', 'last_validation',
                 'mlp_2xb32-300iter_synthetic.py'):
        assert integrity.link_of(str(copy / name)) is None, name
    for step in (6, 8):
        assert integrity.verify_file(str(copy /
                                         f'iter_{step}.pth')).status == 'ok'
    assert (copy / 'last_checkpoint').read_text() == str(copy / 'iter_8.pth')
    assert not any(osp.lexists(copy / name) for name in planted[1:])
    # --overwrite moves the links aside (not what they point to).
    code, log = _train(copy, 'train_cfg.max_iters=2', '--overwrite')
    assert code == 0, log[-3000:]
    aside = copy / 'superseded_iter_8'
    assert (aside / 'iter_4.pth').is_symlink()
    assert _contents(mine) == original
    assert victim.read_text() == 'a file of the user, outside the work dir\n'


# -- another run's checkpoints ----------------------------------------------
def test_last_checkpoint_naming_another_runs_file_is_not_followed(
        runs, tmp_path):
    mine, other = runs
    work = tmp_path / 'work'
    shutil.copytree(mine, work)
    theirs = other / 'iter_6.pth'
    (work / 'iter_6.pth').unlink()
    (work / 'iter_6.pth.sha256').unlink()
    (work / 'last_checkpoint').write_text(str(theirs))
    original = _contents(other)
    code, log = _train(work, resume=True)
    assert code == 0, log[-3000:]
    assert (f'WARNING - {work}/last_checkpoint names {theirs}, outside this '
            f"run's checkpoint folder {work}, which has no iter_6.pth: that "
            "is another run's checkpoint (or this work dir was moved without "
            'it), and it is not continued unless named: --resume '
            f'{theirs}') in log
    assert (f'WARNING - resuming from {work}/iter_4.pth, the newest intact '
            'checkpoint in the work dir') in log
    assert 'resumed epoch: 0, iter: 4' in log
    assert run_of(str(work / 'iter_6.pth'))['seed'] == 0  # its own, again
    assert _contents(other) == original
    # Named, another run's checkpoint is taken only where it mixes with
    # nothing of this work dir's.
    code, log = _train(work, resume=theirs)
    assert code == 2, log[-3000:]
    assert log.strip() == (
        f"train.py: error: --resume {theirs}: work_dir '{work}' holds "
        'checkpoints of its own run (the newest: iter_6.pth), which '
        f'continuing {theirs} there would overwrite or mix with. Fix: '
        '--resume alone continues iter_6.pth; add --overwrite to continue '
        f'{theirs} there (the checkpoints of this work dir are then moved '
        f'into {work}/superseded_...); or choose another --work-dir')
    # Nothing of its own: refused, offering both ways.
    empty = tmp_path / 'empty'
    empty.mkdir()
    (empty / 'last_checkpoint').write_text(str(theirs))
    code, log = _train(empty, resume=True)
    assert code == 2, log[-3000:]
    assert log.strip() == (
        f'train.py: error: --resume: {empty} holds no checkpoint of this '
        f'run, but {empty}/last_checkpoint names {theirs}, outside it: '
        "another run's checkpoint, or this work dir was moved without its "
        f'checkpoints. Fix: to continue from it, name it: --resume {theirs}; '
        f'to start a new run here at iteration 0, remove {empty}/'
        'last_checkpoint')
    assert _contents(other) == original


def test_another_runs_checkpoint_copied_in_is_refused_naming_both(
        runs, tmp_path):
    mine, other = runs
    work = tmp_path / 'work'
    shutil.copytree(mine, work)
    for name in ('iter_8.pth', 'iter_8.pth.sha256'):
        shutil.copy(other / name.replace('8', '6'), work / name)
    (work / 'last_checkpoint').write_text(str(work / 'iter_8.pth'))
    theirs, own = run_of(str(work / 'iter_8.pth')), run_of(
        str(work / 'iter_4.pth'))
    assert theirs['id'] != own['id']
    code, log = _train(work, 'train_cfg.max_iters=10', resume=True)
    assert code == 2, log[-3000:]

    def described(run):
        return (f"run {run['id'][:8]} (seed {run['seed']}, config "
                f"mlp_2xb32-300iter_synthetic.py, started {run['started']})")

    assert log.strip() == (
        f'train.py: error: --resume: {work}/iter_8.pth belongs to another run '
        f'than the other checkpoints in {work}: it was saved by '
        f'{described(theirs)}, iter_6.pth by {described(own)}: continuing it '
        "here would mix two runs in one work dir. Fix: to continue this work "
        "dir's own run, move iter_8.pth (with its iter_8.pth.* files) out of "
        f'{work}; to continue the other run, give it a work dir of its own: '
        f'--work-dir NEW --resume {work}/iter_8.pth')
    assert 'seed 1' in described(theirs) and 'seed 0' in described(own)


# -- a validation lost to a killed rank ---------------------------------------
@pytest.mark.slow
def test_a_rank_killed_in_the_final_validation(tmp_path):
    """2 ranks, ``MAX_RESTARTS=1``: rank 1 is SIGKILLed in the middle of
    the final validation, after the last checkpoint. The restart runs that
    validation before it calls the run finished, the metrics' result parts
    stay in the work dir (removed with their launch), and nothing is
    written in the directory the run was started from."""
    config = tmp_path / 'config.py'
    marker = tmp_path / 'killed'
    config.write_text(
        f'_base_ = [{MLP!r}]\n'
        "custom_imports = dict(imports=['mmcv_custom', 'mmcv_custom.demo', "
        "'tests.fault_hooks'], allow_failed_imports=False)\n"
        "custom_hooks = [dict(type='CommHookRegistrationHook'), "
        f"dict(type='KillInValidationHook', rank=1, marker={str(marker)!r})]"
        '\n')
    started_in = tmp_path / 'cwd'
    started_in.mkdir()
    work = tmp_path / 'work'
    code, log = _dist_train(
        str(config), work, 1, fast=QUICK, timeout=300, cwd=started_in)
    assert code == 0, log[-4000:]
    assert marker.is_file()
    assert 'local rank 1 was killed by SIGKILL' in log
    assert ('WARNING - The validation after iteration 6 did not finish '
            'before the run stopped (last_validation in the work dir does '
            'not record it; a rank killed during it?): running it now, its '
            'final one.') in log
    assert ('the run is finished. To train it further, raise '
            'train_cfg.max_iters (--cfg-options train_cfg.max_iters=...) '
            'and --resume again. (Its final validation, lost when it '
            'stopped, ran now.)') in log
    after = log.split('restart 1 after a failure')[1]
    assert 'Iter(val) [1/1]    regression/mse: ' in after
    assert os.listdir(started_in) == []
    assert not osp.lexists(work / '.dist_test')
    assert (work / 'last_validation').read_text() == (
        '{"step": 6, "by_epoch": false}')
