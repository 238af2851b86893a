"""Hook state files at the edges: moved, copied, broken, foreign, unsafe.

Every case resumes a real 2-rank PowerSGD run from its checkpoint at
iteration 4 after changing the files the way an accident or a user would,
and checks what each rank ended with: every rank restored, or every rank
started afresh (one warning on rank 0 naming the rank and the reason), and
training goes on in sync.
"""
import argparse
import os
import shutil

import pytest
import torch

from mmcv_custom.integrity import write_digest
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner, train_and_gather

POWERSGD = dict(
    type='powerSGD', start_powerSGD_iter=2, matrix_approximation_rank=1)
CKPT = dict(type='CheckpointHook', interval=4, by_epoch=False)


def _runner(work_dir, comm_hook, max_iters, resume, load_from=None):
    return build_runner(
        work_dir,
        comm_hook,
        max_iters=max_iters,
        checkpoint=CKPT,
        resume=resume,
        load_from=load_from)


def _train(rank,
           world_size,
           work_dir,
           comm_hook,
           max_iters,
           resume,
           load_from=None):
    runner, records = _runner(work_dir, comm_hook, max_iters, resume,
                              load_from)
    return train_and_gather(runner, records, world_size)


def _probe(rank, world_size, work_dir, comm_hook):
    """Resume from ``iter_4.pth`` without training further: what state did
    this rank start with? ``(restored, PowerSGD's step counter, log
    lines)``."""
    runner, records = _runner(work_dir, comm_hook, 4, True,
                              f'{work_dir}/iter_4.pth')
    runner.train()
    hook = next(
        h for h in runner.hooks
        if type(h).__name__ == 'CommHookRegistrationHook')
    relayout = hook._state_files.keepers['']
    lines = [(lvl, m) for lvl, m in records.lines
             if 'communication-hook state' in m or m.startswith('Restored')]
    return bool(relayout._pending), relayout.state.iter, lines


@pytest.fixture(scope='module')
def stopped(tmp_path_factory):
    """A run that stopped at iteration 4, and the uninterrupted one."""
    root = tmp_path_factory.mktemp('state')
    whole, _ = run_ranks(_train, str(root / 'whole'), POWERSGD, 10, False)[0]
    run_ranks(_train, str(root / 'part'), POWERSGD, 4, False)
    return root / 'part', whole


def _copy(stopped, tmp_path, name='run'):
    work = tmp_path / name
    shutil.copytree(stopped[0], work)
    return work


def _state_file(work, rank):
    return work / f'iter_4.pth.comm_hook_rank{rank}.pth'


def test_checkpoint_records_relative_names_and_identity(stopped):
    checkpoint = torch.load(stopped[0] / 'iter_4.pth', weights_only=False)
    record = checkpoint['comm_hook_state']
    assert record['files'] == [
        'iter_4.pth.comm_hook_rank0.pth', 'iter_4.pth.comm_hook_rank1.pth'
    ]
    assert record['step'] == 4 and len(record['run']) == 32
    for rank in range(2):
        saved = torch.load(_state_file(stopped[0], rank), weights_only=True)
        assert (saved['run'], saved['step'], saved['rank']) == (record['run'],
                                                                4, rank)
    assert not list(stopped[0].glob('*.partial'))


def test_moved_work_dir_resumes_its_own_state_bit_for_bit(stopped, tmp_path):
    moved = tmp_path / 'moved'
    shutil.move(str(_copy(stopped, tmp_path)), moved)
    resumed, lines = run_ranks(_train, str(moved), POWERSGD, 10, True,
                               str(moved / 'iter_4.pth'))[0]
    assert ('INFO', 'Restored the powerSGD state (error feedback, warm '
            'start, iteration counter) of all 2 ranks from the files '
            f'beside {moved}/iter_4.pth.') in lines
    assert torch.equal(resumed[0], stopped[1][0])


def test_copied_work_dir_never_reads_the_original_runs_files(
        stopped, tmp_path):
    original = _copy(stopped, tmp_path, 'original')
    copy = _copy(stopped, tmp_path, 'copy')
    # The original's files change (here: swapped between the ranks, each
    # with its digest); the copy must still resume from its own.
    a, b = _state_file(original, 0), _state_file(original, 1)
    for x, y in ((a, b), (a.with_name(a.name + '.sha256'),
                          b.with_name(b.name + '.sha256'))):
        tmp = original / 'swap'
        x.rename(tmp)
        y.rename(x)
        tmp.rename(y)
    resumed, lines = run_ranks(_train, str(copy), POWERSGD, 10, True,
                               str(copy / 'iter_4.pth'))[0]
    assert any(m.startswith('Restored the powerSGD state') for _, m in lines)
    assert torch.equal(resumed[0], stopped[1][0])
    # And the swapped files are refused as belonging to other ranks.
    outcome = run_ranks(_probe, str(original), POWERSGD)
    assert [o[:2] for o in outcome] == [(False, 4), (False, 4)]
    (warning, ) = [m for lvl, m in outcome[0][2] if lvl == 'WARNING']
    assert warning.startswith(
        'Not restoring the powerSGD communication-hook state (rank 0: '
        f'{a} holds the state of rank 1, not of rank 0; rank 1: {b} holds '
        'the state of rank 0, not of rank 1). Every rank starts it afresh')


def _unsafe(path):
    torch.save({'hooks': argparse.Namespace(x=1)}, path)


BREAKAGES = {
    'missing': (os.remove, 'is missing'),
    'empty': (lambda p: open(p, 'wb').close(), 'is unreadable ('),
    'truncated': (lambda p: open(p, 'r+b').truncate(100), 'is unreadable ('),
    'random bytes':
    (lambda p: open(p, 'wb').write(os.urandom(4096)), 'is unreadable ('),
    'unsafe pickle': (_unsafe, 'it contains argparse.Namespace, which is '
                      'not on the allow-list of safe checkpoint contents'),
    # A format the safe loader cannot even scan (old pickle protocol).
    'another torch file': (lambda p: torch.save({'run': 'x'}, p),
                           'is not a communication-hook state file of this '
                           'mmcv_custom version'),
    'legacy pickle':
    (lambda p: torch.save({'a': 1}, p, _use_new_zipfile_serialization=False),
     'is unreadable ('),
}
# The breakages above come with a digest that matches (a file replaced
# together with its .sha256), so that the checks behind the digest are
# tested; these leave the digest as written.
STALE_DIGEST = {
    'flipped bytes': (lambda p: _flip(p, 4096), 'is damaged: its SHA-256 is '),
    'truncated, digest kept':
    (lambda p: open(p, 'r+b').truncate(100), 'is damaged: its SHA-256 is '),
}


def _flip(path, offset):
    with open(path, 'r+b') as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize('breakage', list(BREAKAGES) + list(STALE_DIGEST))
def test_one_broken_rank_file_makes_every_rank_start_afresh(
        stopped, tmp_path, breakage):
    work = _copy(stopped, tmp_path)
    path = _state_file(work, 1)
    damage, reason = {**BREAKAGES, **STALE_DIGEST}[breakage]
    damage(str(path))
    if breakage in BREAKAGES and path.exists():
        write_digest(str(path))
    outcome = run_ranks(_probe, str(work), POWERSGD)
    # Neither rank restored; both count the 4 steps already taken, so
    # PowerSGD compresses at once instead of re-running its warm-up.
    assert [o[:2] for o in outcome] == [(False, 4), (False, 4)]
    (warning, ) = [m for lvl, m in outcome[0][2] if lvl == 'WARNING']
    assert warning.startswith('Not restoring the powerSGD communication-'
                              'hook state (rank 1: ')
    assert f'{path} {reason}' in warning or (
        breakage == 'unsafe pickle'
        and f'Refusing to load {path}: {reason}' in warning)
    assert 'weights_only=False' not in warning  # never advise unsafe loads
    assert warning.endswith(
        'Every rank starts it afresh at step 4: error feedback from zero '
        'and new warm-start matrices; compression goes on at once (the run '
        'is past start_powerSGD_iter=2).')
    assert outcome[1][2] == []  # rank 1 logs nothing of its own


def test_fresh_start_is_the_same_on_every_rank_and_trains_on(
        stopped, tmp_path):
    """One rank's file missing trains exactly as all files missing, and in
    sync (no collective mismatch, no abort)."""
    one = _copy(stopped, tmp_path, 'one')
    os.remove(_state_file(one, 0))
    both = _copy(stopped, tmp_path, 'both')
    os.remove(_state_file(both, 0))
    os.remove(_state_file(both, 1))
    a, _ = run_ranks(_train, str(one), POWERSGD, 8, True,
                     str(one / 'iter_4.pth'))[0]
    b, lines = run_ranks(_train, str(both), POWERSGD, 8, True,
                         str(both / 'iter_4.pth'))[0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], a[1])
    (warning, ) = [m for lvl, m in lines if lvl == 'WARNING']
    assert '(all ranks: ' not in warning  # each rank, its own path
    assert f"rank 0: {_state_file(both, 0)} is missing; rank 1: " in warning


def test_state_file_of_another_save_is_refused(stopped, tmp_path):
    work = _copy(stopped, tmp_path)
    other = tmp_path / 'other'
    run_ranks(_train, str(other), POWERSGD, 4, False)  # same step, new run
    for suffix in ('', '.sha256'):  # the file and its digest
        shutil.copy(f'{_state_file(other, 1)}{suffix}',
                    f'{_state_file(work, 1)}{suffix}')
    outcome = run_ranks(_probe, str(work), POWERSGD)
    assert [o[:2] for o in outcome] == [(False, 4), (False, 4)]
    (warning, ) = [m for lvl, m in outcome[0][2] if lvl == 'WARNING']
    assert ' belongs to another save (run ' in warning
    assert ', step 4), not to iter_4.pth (run ' in warning


def test_record_of_an_older_version_is_refused(stopped, tmp_path):
    work = _copy(stopped, tmp_path)
    checkpoint = torch.load(work / 'iter_4.pth', weights_only=False)
    checkpoint['comm_hook_state'] = dict(
        type='powerSGD',
        wrapper=None,
        world_size=2,
        files=[str(_state_file(work, r)) for r in range(2)])
    torch.save(checkpoint, work / 'iter_4.pth')
    write_digest(str(work / 'iter_4.pth'))
    outcome = run_ranks(_probe, str(work), POWERSGD)
    assert [o[:2] for o in outcome] == [(False, 4), (False, 4)]
    (warning, ) = [m for lvl, m in outcome[0][2] if lvl == 'WARNING']
    assert warning.startswith(
        'Not restoring the powerSGD communication-hook state (all ranks: '
        'the resumed checkpoint records its hook state in a format this '
        'version does not read')


def test_fresh_start_before_the_warm_up_ends_says_so(tmp_path):
    cfg = dict(POWERSGD, start_powerSGD_iter=6)
    work = str(tmp_path / 'run')
    run_ranks(_train, work, dict(type='allreduce'), 4, False)
    outcome = run_ranks(_probe, work, cfg)
    assert [o[:2] for o in outcome] == [(False, 4), (False, 4)]
    (warning, ) = [m for lvl, m in outcome[0][2] if lvl == 'WARNING']
    assert warning == (
        'Not restoring the powerSGD communication-hook state (all ranks: '
        'the resumed checkpoint holds no communication-hook state). Every '
        'rank starts it afresh at step 4: error feedback from zero and new '
        'warm-start matrices; its warm-up of plain all-reduces goes on '
        'until step 6 (start_powerSGD_iter).')


BATCHED = dict(POWERSGD, type='batched_powerSGD')


def test_batched_powersgd_state_is_saved_and_restored(tmp_path):
    work = str(tmp_path / 'run')
    run_ranks(_train, work, BATCHED, 4, False)
    outcome = run_ranks(_probe, work, BATCHED)
    assert [o[:2] for o in outcome] == [(True, 4), (True, 4)]
    assert outcome[0][2] == [
        ('INFO', 'Restored the batched_powerSGD state (error feedback, warm '
         'start, iteration counter) of all 2 ranks from the files beside '
         f'{work}/iter_4.pth.')
    ]
    saved = torch.load(
        f'{work}/iter_4.pth.comm_hook_rank0.pth',
        weights_only=True)['hooks']['']
    # Error feedback per parameter, and one warm start per bucket.
    assert {n
            for n, e in saved['params'].items() if e['error'] is not None} == {
                'net.0.weight', 'net.0.bias', 'net.2.weight', 'net.2.bias',
                'net.4.weight', 'net.4.bias'
            }
    assert len(saved['bucket_q']) >= 1
    resumed, _ = run_ranks(_train, work, BATCHED, 8, True)[0]
    assert torch.equal(resumed[0], resumed[1])
