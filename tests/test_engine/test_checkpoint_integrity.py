"""Checkpoints written whole or not at all, verified before use, and what
``--resume`` and ``load_from`` do with damaged, missing or foreign ones:
through the real ``tools/train.py`` and MMEngine's own save and load."""
import glob
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

import mmcv_custom  # noqa: F401  (installs the backend and the loader)
from mmcv_custom import integrity
from mmcv_custom.integrity.checkpoint_choice import choose_resume_checkpoint

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TRAIN = osp.join(ROOT, 'tools', 'train.py')
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')
# One process, 6 iterations, a checkpoint every 2, no validation.
FAST = [
    'train_cfg.max_iters=6', 'train_cfg.val_interval=100',
    'default_hooks.checkpoint.interval=2', 'default_hooks.logger.interval=1',
    'train_dataloader.dataset.num_samples=256', 'comm_hook.type=allreduce'
]


def _train(work_dir, *extra, resume=False, cwd=None, fast=FAST):
    """``tools/train.py`` on the MLP demo; ``resume``: True for
    ``--resume``, a path for ``--resume PATH``."""
    args = [sys.executable, TRAIN, MLP, '--work-dir', str(work_dir)]
    if resume is True:
        args.append('--resume')
    elif resume:
        args += ['--resume', str(resume)]
    out = subprocess.run(
        args + ['--cfg-options', *fast, *extra],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=600)
    return out.returncode, out.stdout + out.stderr


def _log_file(work_dir):
    """The text of the newest run's log file in ``work_dir``."""
    logs = sorted(glob.glob(osp.join(str(work_dir), '*', '*.log')))
    with open(logs[-1]) as f:
        return f.read()


def _flip(path, offset=4096, count=4096):
    """Invert ``count`` bytes at ``offset``: same size, other contents."""
    with open(path, 'r+b') as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


# -- the write-then-rename and digest primitives -----------------------------
def test_atomic_write_leaves_the_file_and_its_digest(tmp_path):
    path = str(tmp_path / 'iter_2.pth')
    integrity.atomic_write_bytes(path, b'abc' * 1000)
    assert open(path, 'rb').read() == b'abc' * 1000
    digest = open(path + '.sha256').read()
    assert digest.endswith('  iter_2.pth\n')  # sha256sum -c reads it
    assert subprocess.run(['sha256sum', '-c', 'iter_2.pth.sha256'],
                          cwd=tmp_path,
                          capture_output=True).returncode == 0
    assert integrity.verify_file(path).status == 'ok'
    assert sorted(os.listdir(tmp_path)) == ['iter_2.pth', 'iter_2.pth.sha256']
    _flip(path, 10, 1)
    result = integrity.verify_file(path)
    assert result.status == 'damaged'
    assert result.message.startswith(f'{path} is damaged: its SHA-256 is ')
    with pytest.raises(
            integrity.CheckpointDamagedError,
            match='beside it is elsewhere.pth'):
        integrity.require_intact(path, lambda: 'elsewhere.pth')
    os.remove(path + '.sha256')
    assert integrity.verify_file(path).status == 'no_digest'


def test_temporary_names_never_collide_and_never_look_like_checkpoints(
        tmp_path):
    path = str(tmp_path / 'iter_6.pth')
    names = {integrity.temporary_name(path) for _ in range(100)}
    assert len(names) == 100
    for name in names:
        base = osp.basename(name)
        assert integrity.is_temporary_name(base)
        assert base.startswith('.iter_6.pth.') and base.endswith('.tmp')
    # A leftover of either kind is not a checkpoint candidate.
    for name in list(names)[:2] + [path + '.partial']:
        open(name, 'w').close()
    assert integrity.checkpoint_candidates(str(tmp_path)) == []


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(
        tmp_path, monkeypatch):
    path = str(tmp_path / 'iter_2.pth')
    integrity.atomic_write_bytes(path, b'old')

    def refuse(src, dst):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(os, 'replace', refuse)
    with pytest.raises(OSError, match='No space left'):
        integrity.atomic_write_bytes(path, b'new')
    monkeypatch.undo()
    assert open(path, 'rb').read() == b'old'
    # The old digest went first (it must not vouch for new bytes); the
    # file without one still loads, unverified.
    assert sorted(os.listdir(tmp_path)) == ['iter_2.pth']
    assert integrity.verify_file(path).status == 'no_digest'


def test_a_streamed_write_hashes_what_it_wrote(tmp_path):
    """What the converters use: torch.save straight into the temporary
    file, hashed on the way (the bytes are never held in memory)."""
    path = str(tmp_path / 'model.pth')
    state = {'w': torch.arange(100000, dtype=torch.float32)}
    integrity.atomic_write_stream(path, lambda f: torch.save(state, f))
    assert integrity.verify_file(path).status == 'ok'
    assert integrity.file_sha256(path) == open(path +
                                               '.sha256').read().split()[0]
    assert torch.equal(torch.load(path)['w'], state['w'])

    def dies_halfway(f):
        f.write(b'x' * 1000)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        integrity.atomic_write_stream(path, dies_halfway)
    # The old file stays, without a digest; nothing else is left.
    assert sorted(os.listdir(tmp_path)) == ['model.pth']
    assert torch.equal(torch.load(path)['w'], state['w'])


def test_the_next_write_removes_what_a_killed_writer_left(tmp_path):
    path = str(tmp_path / 'iter_4.pth')
    gone = subprocess.run(
        [sys.executable, '-c', 'import os; print(os.getpid())'],
        capture_output=True,
        text=True)
    dead_pid = int(gone.stdout)
    stale = tmp_path / f'.iter_4.pth.{dead_pid}-0123abcd.tmp'
    stale.write_bytes(b'half a checkpoint')
    alive = tmp_path / f'.iter_4.pth.{os.getppid()}-0123abcd.tmp'
    alive.write_bytes(b'a live writer')
    other = tmp_path / f'.iter_40.pth.{dead_pid}-0123abcd.tmp'
    other.write_bytes(b'another name')
    integrity.atomic_write_bytes(path, b'whole')
    names = sorted(os.listdir(tmp_path))
    assert stale.name not in names
    assert alive.name in names and other.name in names


def test_a_full_disk_leaves_no_checkpoint_under_its_name(tiny_disk):
    from mmengine.runner.checkpoint import save_checkpoint
    small = str(tiny_disk / 'iter_2.pth')
    save_checkpoint({'state_dict': {'w': torch.zeros(1000)}}, small)
    assert integrity.verify_file(small).status == 'ok'
    big = str(tiny_disk / 'iter_4.pth')
    with pytest.raises(OSError):
        save_checkpoint({'state_dict': {'w': torch.zeros(1 << 20)}}, big)
    # Nothing under the real name, no temporary file left, the older
    # checkpoint intact.
    assert sorted(os.listdir(tiny_disk)) == ['iter_2.pth', 'iter_2.pth.sha256']
    assert integrity.verify_file(small).status == 'ok'


def test_mmengine_saves_through_the_atomic_backend(tmp_path):
    from mmengine.fileio import get_file_backend
    from mmengine.runner.checkpoint import save_checkpoint

    from mmcv_custom.engine import AtomicLocalBackend
    backend = get_file_backend(str(tmp_path))
    assert isinstance(backend, AtomicLocalBackend)
    path = str(tmp_path / 'iter_2.pth')
    save_checkpoint({'state_dict': {'w': torch.ones(3)}}, path)
    assert integrity.verify_file(path).status == 'ok'
    backend.remove(path)  # max_keep_ckpts: the digest goes with the file
    assert os.listdir(tmp_path) == []


def test_mmengine_loader_refuses_a_damaged_file_by_name(tmp_path):
    from mmengine.runner.checkpoint import _load_checkpoint, save_checkpoint
    older = str(tmp_path / 'iter_2.pth')
    newer = str(tmp_path / 'iter_4.pth')
    for path in (older, newer):
        save_checkpoint({'state_dict': {'w': torch.ones(5000)}}, path)
    _flip(newer)
    with pytest.raises(integrity.CheckpointDamagedError) as raised:
        _load_checkpoint(newer)
    assert str(raised.value).startswith(f'{newer} is damaged: ')
    assert str(raised.value).endswith(
        f'; the newest intact checkpoint beside it is {older}')
    assert _load_checkpoint(older)['state_dict']['w'].sum() == 5000


# -- what --resume chooses ----------------------------------------------------
def _checkpoints(work_dir, steps=(2, 4, 6)):
    from mmengine.runner.checkpoint import save_checkpoint
    os.makedirs(work_dir, exist_ok=True)
    for step in steps:
        save_checkpoint({
            'meta': {
                'iter': step
            },
            'state_dict': {}
        }, osp.join(work_dir, f'iter_{step}.pth'))
    with open(osp.join(work_dir, 'last_checkpoint'), 'w') as f:
        f.write(osp.join(work_dir, f'iter_{steps[-1]}.pth'))


@pytest.mark.parametrize(
    'damage, why',
    [
        ('flip', 'is damaged: its SHA-256 is'),
        ('truncate', 'is damaged: its SHA-256 is'),
        ('empty', 'is damaged: its SHA-256 is'),
        ('delete', 'iter_6.pth: no such file'),
        # Where its siblings have digests, one without is not trusted.
        ('truncate, no digest', 'has no .sha256 digest, but the checkpoints '
         'beside it carry digests'),
    ])
def test_resume_falls_back_to_the_newest_intact_checkpoint(
        tmp_path, damage, why):
    work = str(tmp_path)
    _checkpoints(work)
    latest = osp.join(work, 'iter_6.pth')
    if damage == 'flip':
        _flip(latest, 100, 50)
    elif damage.startswith('truncate'):
        os.truncate(latest, 100)
        if 'no digest' in damage:
            os.remove(latest + '.sha256')
    elif damage == 'empty':
        open(latest, 'w').close()
    else:
        os.remove(latest)
    # iter_4 is damaged too: iter_2 it is.
    _flip(osp.join(work, 'iter_4.pth'), 100, 50)
    path, notes = choose_resume_checkpoint(work)
    assert path == osp.join(work, 'iter_2.pth')
    assert notes[0].startswith('the latest checkpoint cannot be resumed '
                               'from: ')
    assert why in notes[0]
    assert notes[1] == (f'resuming from {path}, the newest intact '
                        'checkpoint in the work dir')


def test_resume_skips_an_unreadable_file_where_no_digests_are_kept(tmp_path):
    work = str(tmp_path)
    _checkpoints(work)
    for step in (2, 4, 6):
        os.remove(osp.join(work, f'iter_{step}.pth.sha256'))
    os.truncate(osp.join(work, 'iter_6.pth'), 100)
    path, notes = choose_resume_checkpoint(work)
    assert path == osp.join(work, 'iter_4.pth')
    assert notes[0] == ('the latest checkpoint cannot be resumed from: '
                        f'{work}/iter_6.pth is not a readable torch '
                        'checkpoint (truncated?)')


def test_resume_with_an_empty_last_checkpoint_or_none(tmp_path):
    work = str(tmp_path)
    _checkpoints(work)
    open(osp.join(work, 'last_checkpoint'), 'w').close()
    path, notes = choose_resume_checkpoint(work)
    assert path == osp.join(work, 'iter_6.pth')
    assert notes == [
        f'{work}/last_checkpoint is empty (a save interrupted while writing '
        'it?)', f'resuming from {path}, the newest intact checkpoint in the '
        'work dir'
    ]
    empty = str(tmp_path / 'nothing')
    os.makedirs(empty)
    assert choose_resume_checkpoint(empty) == (None, [
        f'no checkpoint in {empty}: starting at iteration 0'
    ])


# -- through tools/train.py ---------------------------------------------------
@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """The MLP demo trained 6 iterations in one process: iter_2/4/6."""
    work = tmp_path_factory.mktemp('mlp') / 'work'
    code, log = _train(work)
    assert code == 0, log[-3000:]
    return work


def _copy(trained, tmp_path):
    import shutil
    copy = tmp_path / 'work'
    shutil.copytree(trained, copy)
    with open(copy / 'last_checkpoint', 'w') as f:
        f.write(str(copy / 'iter_6.pth'))
    return copy


def test_every_checkpoint_has_a_digest(trained):
    for step in (2, 4, 6):
        path = str(trained / f'iter_{step}.pth')
        assert integrity.verify_file(path).status == 'ok'
    assert not [n for n in os.listdir(trained) if n.endswith('.tmp')]


def test_train_resumes_from_the_newest_intact_and_says_so(trained, tmp_path):
    work = _copy(trained, tmp_path)
    _flip(str(work / 'iter_6.pth'))
    code, log = _train(work, 'train_cfg.max_iters=8', resume=True)
    assert code == 0, log[-3000:]
    written = _log_file(work)
    for text in (log, written):
        assert (f'WARNING - the latest checkpoint cannot be resumed from: '
                f'{work}/iter_6.pth is damaged') in text
        assert (f'WARNING - resuming from {work}/iter_4.pth, the newest '
                'intact checkpoint in the work dir') in text
    assert 'resumed epoch: 0, iter: 4' in log
    assert integrity.verify_file(str(work / 'iter_8.pth')).status == 'ok'


def test_train_with_nothing_to_resume_warns_and_starts(tmp_path):
    work = tmp_path / 'fresh'
    os.makedirs(work)
    code, log = _train(work, 'train_cfg.max_iters=2', resume=True)
    assert code == 0, log[-3000:]
    line = (f'WARNING - --resume: no checkpoint in {work}: starting at '
            'iteration 0')
    assert line in log and line in _log_file(work)
    assert 'Auto resumed' not in log
    assert (work / 'iter_2.pth').is_file()


def test_load_from_a_damaged_file_names_it_and_the_alternative(
        trained, tmp_path):
    work = _copy(trained, tmp_path)
    _flip(str(work / 'iter_6.pth'))
    code, log = _train(tmp_path / 'other', f'load_from={work}/iter_6.pth')
    assert code == 2  # a preflight problem (mmcv_custom.launching.preflight)
    assert (f'train.py: error: load_from: {work}/iter_6.pth is damaged: its '
            'SHA-256 is ') in log
    assert 'Traceback' not in log
    assert f'the newest intact checkpoint beside it is {work}/iter_4.pth' \
        in log
    assert not (tmp_path / 'other').exists()  # nothing started


def test_an_old_checkpoint_without_digest_loads_with_one_info(
        trained, tmp_path):
    """Where no digests are kept (a load_from from elsewhere, an older
    run), a file without one loads, said once; beside checkpoints that
    carry digests it is refused like a damaged one."""
    work = _copy(trained, tmp_path)
    os.remove(work / 'iter_6.pth.sha256')
    code, log = _train(tmp_path / 'other', f'load_from={work}/iter_6.pth',
                       'train_cfg.max_iters=1')
    assert code == 2
    assert (f'train.py: error: load_from: {work}/iter_6.pth has no .sha256 '
            'digest, but the checkpoints beside it carry digests (e.g. '
            'iter_2.pth), so it cannot be verified') in log
    assert f'the newest intact checkpoint beside it is {work}/iter_4.pth' \
        in log
    elsewhere = tmp_path / 'downloads'
    os.makedirs(elsewhere)
    os.replace(work / 'iter_6.pth', elsewhere / 'iter_6.pth')
    code, log = _train(tmp_path / 'other', f'load_from={elsewhere}/iter_6.pth',
                       'train_cfg.max_iters=1')
    assert code == 0, log[-3000:]
    assert log.count(f'INFO - {elsewhere}/iter_6.pth has no .sha256 digest '
                     'beside it') == 1
    assert (f'load_from {elsewhere}/iter_6.pth: 8 of the model\'s 8 tensors '
            'found (100%)') in _log_file(tmp_path / 'other')


def test_load_from_another_model_stops_with_the_counts(tmp_path):
    foreign = str(tmp_path / 'resnet.pth')
    torch.save(
        {
            'state_dict': {
                'backbone.layer1.0.conv1.weight': torch.zeros(4, 4, 3, 3),
                'backbone.layer1.0.bn1.weight': torch.zeros(4)
            }
        }, foreign)
    code, log = _train(tmp_path / 'work', f'load_from={foreign}')
    assert code == 1
    assert (f"LoadMismatchError: load_from {foreign}: 0 of the model's 8 "
            'tensors found (0%); 8 missing (') in log
    assert 'less than load_from_min_match=0.5 of the model; likely cause: ' \
        'it is a checkpoint of another model (its tensors start with ' \
        'backbone)' in log
    # Allowed on purpose: it trains, and the log file says what is missing.
    code, log = _train(tmp_path / 'work2', f'load_from={foreign}',
                       'load_from_min_match=0', 'train_cfg.max_iters=1')
    assert code == 0, log[-3000:]
    assert ("WARNING - load_from {}: 0 of the model's 8 tensors found (0%); "
            '8 missing ('.format(foreign)) in _log_file(tmp_path / 'work2')
    code, log = _train(tmp_path / 'work3', f'load_from={foreign}',
                       'load_from_min_match=2')
    assert code == 1
    assert 'load_from_min_match=2: expected a number from 0 to 1' in log
