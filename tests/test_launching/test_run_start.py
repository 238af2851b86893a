"""Where a run starts (``mmcv_custom.launching.run_start``) and what its work
dir lock does (``mmcv_custom.launching.work_dir_lock``), on real checkpoint
files with their digests and real processes holding the lock. The same rules
through ``tools/train.py`` are in ``test_never_backwards.py``."""
import logging
import os
import os.path as osp
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from mmengine.config import Config

from mmcv_custom import integrity
from mmcv_custom.integrity.checkpoint_choice import checkpoint_folder
from mmcv_custom.launching.run_start import apply_start_plan, plan_start
from mmcv_custom.launching.work_dir_lock import (LOCK_FILE, WorkDirBusy,
                                                 WorkDirLock)


def _save(path, step=0):
    """A small torch checkpoint written as MMEngine's backend writes one:
    through a temporary name, with its digest."""
    os.makedirs(osp.dirname(path), exist_ok=True)
    integrity.atomic_write_stream(
        path, lambda f: torch.save({
            'meta': {
                'iter': step
            },
            'state_dict': {}
        }, f))


def _run(folder, steps=(2, 4), state_files=True):
    """A work dir after a run that saved ``steps``: checkpoints, their
    digests, two ranks' hook state files and ``last_checkpoint``."""
    for step in steps:
        path = osp.join(folder, f'iter_{step}.pth')
        _save(path, step)
        if state_files:
            for rank in range(2):
                integrity.atomic_write_bytes(
                    f'{path}.comm_hook_rank{rank}.pth', b'state')
    with open(osp.join(folder, 'last_checkpoint'), 'w') as f:
        f.write(osp.join(folder, f'iter_{steps[-1]}.pth'))


def _cfg(work_dir, load_from=None, out_dir=None):
    checkpoint = dict(type='CheckpointHook', interval=2)
    if out_dir:
        checkpoint['out_dir'] = str(out_dir)
    return Config(
        dict(
            work_dir=str(work_dir),
            load_from=load_from,
            default_hooks=dict(checkpoint=checkpoint)))


def _flip(path):
    with open(path, 'r+b') as f:
        f.seek(100)
        data = f.read(50)
        f.seek(100)
        f.write(bytes(b ^ 0xFF for b in data))


# -- a new start -------------------------------------------------------------
def test_a_new_run_over_saved_checkpoints_is_refused(tmp_path):
    work = tmp_path / 'work'
    _run(str(work))
    before = sorted(os.listdir(work))
    plan = plan_start(_cfg(work), resume=False)
    [problem] = plan.problems
    assert problem.what == (
        f"work_dir '{work}' already holds the checkpoints of a run (the "
        'newest: iter_4.pth): a new run there would overwrite them with '
        'older iterations')
    assert problem.fix == (
        'continue that run with --resume; or choose another --work-dir; or '
        'add --overwrite to start again there (its checkpoints are then '
        f'moved into {work}/superseded_...)')
    assert plan.supersede == []
    assert sorted(os.listdir(work)) == before
    # A fine-tuning start (load_from elsewhere) is refused the same way.
    other = tmp_path / 'other' / 'iter_8.pth'
    _save(str(other))
    assert plan_start(_cfg(work, str(other)), resume=False).problems
    # Nothing saved yet: it starts, seeded by load_from.
    fresh = plan_start(_cfg(tmp_path / 'new', str(other)), resume=False)
    assert (fresh.problems, fresh.load_from, fresh.resume,
            fresh.notes) == ([], str(other), False, [])


def test_a_checkpoint_folder_of_its_own_counts_too(tmp_path):
    """``default_hooks.checkpoint.out_dir``: MMEngine saves into
    ``<out_dir>/<work dir's name>``; ``last_checkpoint`` stays in the
    work dir."""
    work, out = tmp_path / 'work', tmp_path / 'disk'
    cfg = _cfg(work, out_dir=out)
    folder = checkpoint_folder(cfg)
    assert folder == str(out / 'work')
    _run(folder)
    os.makedirs(work)
    os.replace(osp.join(folder, 'last_checkpoint'), work / 'last_checkpoint')
    [problem] = plan_start(cfg, resume=False).problems
    assert f'(its checkpoint folder {folder})' in problem.what
    plan = plan_start(cfg, resume=True)
    assert (plan.problems, plan.load_from,
            plan.resume) == ([], osp.join(folder, 'iter_4.pth'), True)


def test_overwrite_moves_the_earlier_run_aside(tmp_path):
    work = tmp_path / 'work'
    _run(str(work))
    # load_from is one of the checkpoints moved: it follows them.
    load_from = str(work / 'iter_2.pth')
    plan = plan_start(_cfg(work, load_from), resume=False, overwrite=True)
    assert plan.problems == []
    moved = str(work / 'superseded_iter_4')
    assert plan.superseded_dir == moved
    assert plan.notes == [
        (logging.WARNING,
         '--overwrite: moved 2 checkpoints of this work dir (iter_4.pth, '
         'iter_2.pth, with their digests and hook state files) and its '
         f'last_checkpoint into {moved}; delete that folder when you no '
         'longer need them')
    ]
    apply_start_plan(plan, main_process=True)
    assert plan.load_from == osp.join(moved, 'iter_2.pth')
    assert plan.resume is False
    assert os.listdir(work) == ['superseded_iter_4']
    assert sorted(os.listdir(moved)) == sorted(
        [f'iter_{s}.pth{x}' for s in (2, 4) for x in ('', '.sha256')] + [
            f'iter_{s}.pth.comm_hook_rank{r}.pth{x}' for s in (2, 4)
            for r in (0, 1) for x in ('', '.sha256')
        ] + ['last_checkpoint'])
    # Moved whole: still verified by their digests.
    assert integrity.verify_file(osp.join(moved, 'iter_4.pth')).status == 'ok'
    # Again, after a second run saved iter_2: a folder of its own.
    _run(str(work), steps=(2, ))
    again = plan_start(_cfg(work), resume=False, overwrite=True)
    assert again.superseded_dir == str(work / 'superseded_iter_2')
    _run(str(work / 'superseded_iter_2'), steps=(2, ))
    third = plan_start(_cfg(work), resume=False, overwrite=True)
    assert third.superseded_dir == str(work / 'superseded_iter_2_2')


# -- resume and restarts -----------------------------------------------------
def test_the_runs_own_checkpoint_wins_over_load_from(tmp_path):
    """The tester's case: a fine-tuning run (load_from another run's
    iter_4) restarted after it saved iter_2 and iter_4 of its own."""
    other = tmp_path / 'other' / 'iter_4.pth'
    _save(str(other))
    work = tmp_path / 'work'
    _run(str(work))
    cfg = _cfg(work, str(other))
    restarted = plan_start(cfg, resume=False, restart=1)
    assert (restarted.problems, restarted.load_from,
            restarted.resume) == ([], str(work / 'iter_4.pth'), True)
    assert restarted.notes == [
        (logging.INFO, 'restart 1 after a failure: resuming from the '
         'newest intact checkpoint'),
        (logging.INFO, f"load_from='{other}' is not used: this run "
         f"continues from its own newest checkpoint {work / 'iter_4.pth'} "
         '(load_from seeds a run at its start only; to go back to it, add '
         '--overwrite with --resume: the checkpoints after it are moved '
         'aside)')
    ]
    # A manual --resume: the same, as a warning.
    resumed = plan_start(cfg, resume=True)
    assert resumed.load_from == str(work / 'iter_4.pth')
    assert resumed.notes[0][0] == logging.WARNING
    # The latest damaged: the newest intact one, still not load_from.
    _flip(str(work / 'iter_4.pth'))
    fallback = plan_start(cfg, resume=True)
    assert fallback.load_from == str(work / 'iter_2.pth')
    assert 'iter_4.pth is damaged' in fallback.notes[0][1]


def test_a_restart_before_the_first_save_starts_as_the_run_did(tmp_path):
    other = tmp_path / 'other' / 'iter_4.pth'
    _save(str(other))
    work = tmp_path / 'work'
    os.makedirs(work)
    plan = plan_start(_cfg(work, str(other)), resume=False, restart=2)
    assert (plan.problems, plan.load_from, plan.resume) == ([], str(other),
                                                            False)
    assert plan.notes == [(logging.INFO,
                           'restart 2 after a failure: no checkpoint saved '
                           'yet, so starting again as the run started')]
    # --resume with load_from and nothing saved: MMEngine's resume of it.
    moved = plan_start(_cfg(work, str(other)), resume=True)
    assert (moved.load_from, moved.resume) == (str(other), True)
    assert moved.notes == [(logging.INFO,
                            f"--resume: resuming from load_from='{other}': "
                            f'{work} holds no checkpoint of this run')]


def test_resume_into_a_work_dir_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / 'typo'
    plan = plan_start(_cfg(missing), resume=True)
    assert (plan.problems, plan.load_from, plan.resume) == ([], None, False)
    assert plan.notes == [(logging.WARNING,
                           f'--resume: the work dir {missing} does not '
                           'exist, so there is nothing to resume: starting '
                           'a new run at iteration 0 (check --work-dir if '
                           'you meant to continue a run)')]
    os.makedirs(missing)
    assert plan_start(
        _cfg(missing), resume=True).notes == [
            (logging.WARNING,
             f'--resume: no checkpoint in {missing}: starting at iteration 0')
        ]


def test_resume_stops_when_every_checkpoint_is_refused(tmp_path):
    work = tmp_path / 'work'
    _run(str(work))
    _flip(str(work / 'iter_4.pth'))
    os.remove(work / 'iter_2.pth.sha256')  # among files that have one
    before = {n: os.stat(work / n).st_mtime_ns for n in os.listdir(work)}
    for restart in (0, 1):
        plan = plan_start(_cfg(work), resume=True, restart=restart)
        [problem] = plan.problems
        assert problem.what.startswith(
            f'--resume: no checkpoint in {work} can be resumed from (2 '
            f'found, each refused: {work}/iter_4.pth is damaged: its '
            'SHA-256 is ')
        assert (f'; {work}/iter_2.pth has no .sha256 digest, but the '
                'checkpoints beside it carry digests (e.g. '
                'iter_4.pth)') in problem.what
        assert problem.fix.startswith('restore an intact copy of one of '
                                      'them')
    assert {
        n: os.stat(work / n).st_mtime_ns
        for n in os.listdir(work)
    } == before


def test_resume_overwrite_goes_back_to_an_older_checkpoint(tmp_path):
    work = tmp_path / 'work'
    _run(str(work), steps=(2, 4, 6))
    back = str(work / 'iter_2.pth')
    plan = plan_start(_cfg(work, back), resume=True, overwrite=True)
    assert (plan.problems, plan.load_from, plan.resume) == ([], back, True)
    assert plan.notes[-1] == (logging.WARNING,
                              f'--overwrite: going back to {back}')
    apply_start_plan(plan, main_process=True)
    assert sorted(
        n for n in os.listdir(work)
        if not n.endswith('.pth') and '.' not in n) == ['superseded_iter_6']
    assert sorted(os.listdir(work / 'superseded_iter_6'))[:2] == [
        'iter_4.pth', 'iter_4.pth.comm_hook_rank0.pth'
    ]
    # A restart of that run now resumes iter_2, the newest there is.
    again = plan_start(
        _cfg(work, back), resume=True, overwrite=True, restart=1)
    assert (again.load_from, again.supersede) == (back, [])


# -- digests where they are kept ---------------------------------------------
def test_a_file_without_a_digest_among_files_with_one_is_refused(tmp_path):
    work = tmp_path / 'work'
    _run(str(work), state_files=False)
    os.remove(work / 'iter_4.pth.sha256')
    result = integrity.verify_file(str(work / 'iter_4.pth'))
    assert result.status == 'damaged'
    assert result.message == (
        f'{work}/iter_4.pth has no .sha256 digest, but the checkpoints '
        'beside it carry digests (e.g. iter_2.pth), so it cannot be '
        'verified: its digest was lost (a copy without it, a crash between '
        'the file and its digest) or it was put there by hand. Refused as '
        f'if damaged; if you trust its bytes, cd {work} && sha256sum '
        'iter_4.pth > iter_4.pth.sha256')
    # Where no file has one (an external load_from): loads, unverified.
    alone = tmp_path / 'downloads' / 'model.pth'
    os.makedirs(alone.parent)
    torch.save({}, alone)
    assert integrity.verify_file(str(alone)).status == 'no_digest'
    # The way out the message gives works.
    subprocess.run(
        'sha256sum iter_4.pth > iter_4.pth.sha256',
        shell=True,
        cwd=work,
        check=True)
    assert integrity.verify_file(str(work / 'iter_4.pth')).status == 'ok'


# -- the lock ----------------------------------------------------------------
_HOLD = ('import sys, time\n'
         'from mmcv_custom.launching.work_dir_lock import WorkDirLock\n'
         'lock = WorkDirLock(sys.argv[1]).acquire()\n'
         'print("held", flush=True)\n'
         'time.sleep(120)\n')


def _holder(work_dir):
    proc = subprocess.Popen(
        [sys.executable, '-c', _HOLD,
         str(work_dir), 'tools/train.py'],
        stdout=subprocess.PIPE,
        text=True)
    assert proc.stdout.readline().strip() == 'held'
    return proc


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    work = tmp_path / 'work'
    holder = _holder(work)
    try:
        with pytest.raises(WorkDirBusy) as busy:
            WorkDirLock(str(work)).acquire()
        message = str(busy.value)
        assert message.startswith(
            f"work_dir '{work}' is in use by another training (pid "
            f'{holder.pid} on {socket.gethostname()}, started ')
        assert message.endswith(f'tools/train.py): it holds {work}/'
                                f'{LOCK_FILE}')
    finally:
        holder.kill()
        holder.wait()
    # Killed: the kernel released its lock; the file tells who it was.
    lock = WorkDirLock(str(work)).acquire()
    try:
        assert lock.stale_note() == (
            f"took over the lock of work_dir '{work}' from pid {holder.pid} "
            f'on {socket.gethostname()}, started '
            f"{lock.previous['started']}, running "
            f"{lock.previous['command']} (that process is gone), which "
            'ended without releasing it: it was killed, or its machine went '
            'down')
    finally:
        lock.release()
    assert os.listdir(work) == []  # released: the file is gone


def test_a_released_lock_leaves_nothing_and_is_taken_again(tmp_path):
    work = tmp_path / 'made' / 'work'
    with WorkDirLock(str(work)) as lock:
        assert lock.held and osp.isfile(lock.path)
        assert lock.previous == {} and lock.stale_note() is None
        other = subprocess.run([
            sys.executable, '-c', 'import sys\n'
            'from mmcv_custom.launching.work_dir_lock import WorkDirLock\n'
            'WorkDirLock(sys.argv[1]).acquire()\n',
            str(work)
        ],
                               capture_output=True,
                               text=True)
        assert other.returncode == 1
        assert (f'WorkDirBusy: work_dir {str(work)!r} is in use by another '
                f'training (pid {os.getpid()} on ') in other.stderr
    # The work dir it made and left empty goes with it.
    assert not osp.exists(work)
    holder = _holder(work)
    holder.send_signal(signal.SIGTERM)
    holder.wait()
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            WorkDirLock(str(work)).acquire().release()
            break
        except WorkDirBusy:
            time.sleep(0.1)
    else:
        pytest.fail('the lock of a terminated holder was not released')


def test_a_slurm_requeue_counts_as_a_restart(monkeypatch):
    from mmcv_custom.engine.process_group import restart_count
    for name in ('TORCHELASTIC_RESTART_COUNT', 'MMCV_CUSTOM_RESTART_COUNT',
                 'SLURM_RESTART_COUNT'):
        monkeypatch.delenv(name, raising=False)
    assert restart_count() == 0
    # slurm_train.sh's first attempt of a job Slurm requeued twice.
    monkeypatch.setenv('MMCV_CUSTOM_RESTART_COUNT', '0')
    monkeypatch.setenv('SLURM_RESTART_COUNT', '2')
    assert restart_count() == 2


def test_bytes_written_without_a_digest_keep_no_old_one(tmp_path):
    path = str(tmp_path / 'model.pth')
    integrity.atomic_write_bytes(path, b'checked')
    assert integrity.verify_file(path).status == 'ok'
    integrity.atomic_write_bytes(path, b'unchecked', digest=False)
    assert sorted(os.listdir(tmp_path)) == ['model.pth']
    assert integrity.verify_file(path).status == 'no_digest'


# -- links -------------------------------------------------------------------
def test_every_writer_replaces_a_link_and_never_writes_through_it(tmp_path):
    """Checkpoints and digests (MMEngine's backend), hook state files and
    the validation record all go through these writers: a symbolic or
    hard link under the name is replaced, what it points to is not
    touched."""
    from mmcv_custom.engine.checkpoint_io import AtomicLocalBackend
    victim = tmp_path / 'victim'
    work = tmp_path / 'work'
    work.mkdir()
    writes = {
        'iter_2.pth':
        lambda p: AtomicLocalBackend().put(b'weights', p),
        'state.pth':
        lambda p: integrity.atomic_write_bytes(p, b'state'),
        'last_validation':
        lambda p: integrity.atomic_write_text(p, '{}'),
        'streamed.pth':
        lambda p: integrity.atomic_write_stream(p, lambda f: f.write(
            b'streamed')),
    }
    for link in (os.symlink, os.link):
        for name, write in writes.items():
            victim.write_text('the user\'s\n')
            path = str(work / name)
            for each in (path, integrity.digest_path(path)):
                if osp.lexists(each):
                    os.remove(each)
                link(victim, each)
            write(path)
            assert victim.read_text() == 'the user\'s\n', (link, name)
            assert integrity.link_of(path) is None
            if name != 'last_validation':
                assert integrity.verify_file(path).status == 'ok'
                assert integrity.link_of(integrity.digest_path(path)) is None
    assert integrity.link_of(str(tmp_path / 'absent')) is None
    fifo = str(tmp_path / 'fifo')
    os.mkfifo(fifo)
    assert integrity.link_of(fifo) == f'{fifo} is not a plain file (a FIFO)'
    with pytest.raises(integrity.LinkedFileError, match='a FIFO'):
        integrity.open_own_file(fifo, os.O_RDWR)


def test_resume_path_with_overwrite_sets_this_runs_checkpoints_aside(tmp_path):
    other = tmp_path / 'other' / 'iter_8.pth'
    _save(str(other), 8)
    work = tmp_path / 'work'
    _run(str(work), steps=(2, 4))
    plan = plan_start(
        _cfg(work), resume=True, overwrite=True, resume_from=str(other))
    assert (plan.problems, plan.load_from, plan.resume) == ([], str(other),
                                                            True)
    assert sorted(osp.basename(p) for p in plan.supersede) == sorted([
        'iter_2.pth', 'iter_2.pth.sha256', 'iter_2.pth.comm_hook_rank0.pth',
        'iter_2.pth.comm_hook_rank0.pth.sha256',
        'iter_2.pth.comm_hook_rank1.pth',
        'iter_2.pth.comm_hook_rank1.pth.sha256', 'iter_4.pth',
        'iter_4.pth.sha256', 'iter_4.pth.comm_hook_rank0.pth',
        'iter_4.pth.comm_hook_rank0.pth.sha256',
        'iter_4.pth.comm_hook_rank1.pth',
        'iter_4.pth.comm_hook_rank1.pth.sha256', 'last_checkpoint'
    ])
    # Nothing saved here: taken as named. A restart: the run's own newest.
    fresh = tmp_path / 'fresh'
    fresh.mkdir()
    assert plan_start(
        _cfg(fresh), resume=True,
        resume_from=str(other)).load_from == str(other)
    again = plan_start(
        _cfg(work), resume=True, restart=1, resume_from=str(other))
    assert again.load_from == str(work / 'iter_4.pth')
    assert again.notes[-1] == (
        logging.INFO, f'--resume {other} was for the first start: this run '
        f'continues from its own newest checkpoint {work}/iter_4.pth '
        '(it is taken while the run has saved nothing; to go back to it, add '
        '--overwrite with --resume: the checkpoints after it are moved '
        'aside)')
