"""Sharded (FSDP2Strategy) checkpoints that are whole, vouched for, and
named when damaged.

A real FSDP2Strategy on 2 gloo ranks saves a tiny model twice (iterations
2 and 4) into a folder that already holds what killed saves and converter
mistakes leave behind; the tests then damage copies of it the ways disks
and copies do (flipped bytes of the same size, a deleted shard, a
truncated one) and read them back through every reader: the strategy's
resume and load on 2 ranks, ``consolidate_sharded_checkpoint`` and
``tools/model_converters/fsdp2_to_pth.py``.
"""
import hashlib
import os
import os.path as osp
import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

# (Importing mmcv_custom registers the strategy.)
from mmcv_custom.integrity import (CheckpointDamagedError, atomic_write_bytes,
                                   verify_file)
from mmcv_custom.integrity.sharded_checkpoint import (
    MANIFEST_FILE, consolidate_sharded_checkpoint, consolidated_file,
    read_manifest, verify_sharded_checkpoint)
from mmcv_custom.testing import run_ranks
from tests.tool_utils import load_script

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'model_converters', 'fsdp2_to_pth.py')
# What a writer that is gone left: removed by the next save of its name.
# Above any pid_max (2**22), so never a live process.
DEAD = '.iter_4.pth.99999999-0123abcd.tmp'


class _Net(nn.Module):

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 64)
        self.b = nn.Linear(64, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _strategy(log_dir):
    from mmcv_custom.engine import FSDP2Strategy
    strategy = FSDP2Strategy(
        work_dir=log_dir,
        env_kwargs=dict(launcher='pytorch', randomness=dict(seed=0)))
    torch.manual_seed(0)
    strategy.prepare(
        _Net(),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)))
    return strategy


def _step(strategy):
    torch.manual_seed(1)
    loss = strategy.model(torch.randn(4, 8)).square().mean()
    strategy.optim_wrapper.update_params(loss)


def _save(rank, world_size, work, log_dir):
    strategy = _strategy(log_dir)
    for it in (2, 4):
        _step(strategy)
        strategy.save_checkpoint(
            osp.join(work, f'iter_{it}.pth'),
            extra_ckpt=dict(meta=dict(iter=it)))
    return {k: v.full_tensor() for k, v in strategy.model.state_dict().items()}


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp('sharded')
    work = root / 'work'
    work.mkdir()
    # A converter once wrote a FILE of the old temporary name; a save at
    # that step then failed with NotADirectoryError.
    (work / 'iter_4.pth.partial').write_bytes(b'a user file')
    (work / DEAD).mkdir()
    (work / DEAD / '__0_0.distcp').write_bytes(b'half a shard')
    # Named by this (live) process: another writer, in the middle of it.
    live = f'.iter_4.pth.{os.getpid()}-89abcdef.tmp'
    (work / live).mkdir()
    weights = run_ranks(_save, str(work), str(root / 'logs'))[0]
    return work, live, weights


def _copy(saved, tmp_path):
    work = tmp_path / 'work'
    shutil.copytree(saved[0], work)
    return work


def _flip(path, offset=64, count=4096):
    """Flip ``count`` bytes from ``offset`` (clamped to the file), keeping
    its size: what bit rot and a bad copy do."""
    with open(path, 'r+b') as f:
        size = f.seek(0, 2)
        offset = max(0, min(offset, size - count))
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
        assert f.seek(0, 2) == size


def _damage(shard, how):
    if how == 'flipped':
        _flip(shard)
    elif how == 'deleted':
        os.remove(shard)
    else:
        with open(shard, 'r+b') as f:
            f.truncate(osp.getsize(shard) // 2)


def _expected(shard, how):
    if how == 'deleted':
        return f'{shard} is missing: {MANIFEST_FILE} lists it'
    if how == 'truncated':
        return f'{shard} is damaged: truncated to '
    return f'{shard} is damaged: its SHA-256 is '


# -- saving -------------------------------------------------------------------
def test_a_save_writes_a_manifest_of_every_file(saved):
    work, _, _ = saved
    for it in (2, 4):
        ckpt = work / f'iter_{it}.pth'
        names = sorted(n for n in os.listdir(ckpt) if n != MANIFEST_FILE)
        assert names == [
            '.metadata', '__0_0.distcp', '__1_0.distcp', 'meta.pth'
        ]
        expected = ''.join(
            f'{hashlib.sha256((ckpt / n).read_bytes()).hexdigest()}  {n}\n'
            for n in names)
        assert (ckpt / MANIFEST_FILE).read_text() == expected
        assert verify_sharded_checkpoint(str(ckpt)).status == 'ok'
        if shutil.which('sha256sum'):  # the format is sha256sum's
            subprocess.run(['sha256sum', '-c', '--quiet', MANIFEST_FILE],
                           cwd=str(ckpt),
                           check=True)


def test_leftovers_do_not_break_a_save_and_only_dead_ones_go(saved):
    work, live, _ = saved
    # The user's file of the old temporary name is untouched, the dead
    # writer's directory removed, the live writer's kept, and nothing of
    # this save's own is left.
    assert sorted(os.listdir(work)) == sorted(
        [live, 'iter_2.pth', 'iter_4.pth', 'iter_4.pth.partial'])
    assert (work / 'iter_4.pth.partial').read_bytes() == b'a user file'


def test_consolidated_weights_are_the_saved_ones(saved, tmp_path):
    work = _copy(saved, tmp_path)
    checkpoint = consolidate_sharded_checkpoint(str(work / 'iter_4.pth'))
    assert checkpoint['meta']['iter'] == 4
    assert checkpoint['state_dict'].keys() == saved[2].keys()
    for key, value in saved[2].items():
        assert torch.equal(checkpoint['state_dict'][key], value), key


# -- reading a damaged checkpoint ---------------------------------------------
@pytest.mark.parametrize('how', ['flipped', 'deleted', 'truncated'])
def test_a_damaged_shard_is_named_with_the_intact_one_beside_it(
        saved, tmp_path, monkeypatch, how):
    _copy(saved, tmp_path)
    monkeypatch.chdir(tmp_path)  # relative paths stay relative
    shard = 'work/iter_4.pth/__1_0.distcp'
    _damage(shard, how)
    with pytest.raises(CheckpointDamagedError) as info:
        consolidate_sharded_checkpoint('work/iter_4.pth')
    message = str(info.value)
    assert '\n' not in message
    assert message.startswith(_expected(shard, how))
    assert message.endswith(
        '; the newest intact checkpoint beside it is work/iter_2.pth')


def test_the_alternative_is_checked_too(saved, tmp_path):
    work = _copy(saved, tmp_path)
    _flip(work / 'iter_4.pth' / '__0_0.distcp')
    _flip(work / 'iter_2.pth' / 'meta.pth', offset=0, count=16)
    with pytest.raises(
            CheckpointDamagedError, match='; no intact checkpoint beside it$'):
        consolidate_sharded_checkpoint(str(work / 'iter_4.pth'))
    # Single files count by their digest: iter_3 (intact) is newer than
    # iter_2; iter_5, newer still, fails its digest.
    atomic_write_bytes(str(work / 'iter_3.pth'), b'intact')
    atomic_write_bytes(str(work / 'iter_5.pth'), b'intact')
    (work / 'iter_5.pth').write_bytes(b'changed')
    assert verify_file(str(work / 'iter_5.pth')).status == 'damaged'
    with pytest.raises(CheckpointDamagedError) as info:
        consolidate_sharded_checkpoint(str(work / 'iter_4.pth'))
    assert str(info.value).endswith(
        f'the newest intact checkpoint beside it is {work}/iter_3.pth')


def test_a_checkpoint_older_than_manifests_still_loads(saved, tmp_path):
    from mmengine.logging import MMLogger
    work = _copy(saved, tmp_path)
    ckpt = str(work / 'iter_4.pth')
    os.remove(osp.join(ckpt, MANIFEST_FILE))
    # Beside checkpoints with manifests, one without is not trusted...
    with pytest.raises(
            CheckpointDamagedError,
            match=rf'^{re.escape(ckpt)} has no {MANIFEST_FILE}, but the '
            r'checkpoints beside it carry digests \(e\.g\. iter_2\.pth\)'):
        consolidate_sharded_checkpoint(ckpt)
    # ... where none has one (a run older than manifests), it loads.
    os.remove(osp.join(work, 'iter_2.pth', MANIFEST_FILE))
    log = str(tmp_path / 'info.log')
    MMLogger.get_instance('test_sharded_integrity', log_file=log)
    for _ in range(2):
        assert consolidate_sharded_checkpoint(ckpt)['meta']['iter'] == 4
    with open(log) as f:
        said = [line for line in f if f'{ckpt} has no {MANIFEST_FILE}' in line]
    assert len(said) == 1 and 'loaded unverified' in said[0]
    # Without digests, DCP's own .metadata still tells a missing or a
    # truncated shard.
    shard = osp.join(ckpt, '__0_0.distcp')
    with open(shard, 'r+b') as f:
        f.truncate(100)
    with pytest.raises(
            CheckpointDamagedError,
            match=rf'^{re.escape(shard)} is damaged: truncated '
            r'to 100 bytes, but \.metadata places data up to '
            r'byte [\d,]+ .*; the newest intact checkpoint beside '
            rf'it is {re.escape(str(work))}/iter_2\.pth$'):
        consolidate_sharded_checkpoint(ckpt)
    os.remove(shard)
    with pytest.raises(
            CheckpointDamagedError,
            match=rf'^{re.escape(shard)} is missing: \.metadata '
            'names it'):
        consolidate_sharded_checkpoint(ckpt)


def test_a_consolidated_copy_is_verified_once_never_called_unverified(
        saved, tmp_path):
    """Issue 42: what a DDP config loads of a sharded checkpoint (a
    temporary file, through MMEngine's loader) was called "loaded
    unverified" though its SHA256SUMS had been checked."""
    from mmengine.logging import MMLogger

    from mmcv_custom.engine.checkpoint_io import load_verified
    work = _copy(saved, tmp_path)
    ckpt = str(work / 'iter_4.pth')
    log = str(tmp_path / 'info.log')
    MMLogger.get_instance('test_consolidated_copy', log_file=log)
    with consolidated_file(ckpt) as file:
        assert verify_file(file).status == 'ok'
        assert load_verified(file)['meta']['iter'] == 4
    assert not osp.exists(osp.dirname(file))
    with open(log) as f:
        text = f.read()
    assert text.count(f'{ckpt}: {len(read_manifest(ckpt))} files, SHA-256 '
                      'verified (SHA256SUMS)') == 1
    assert 'unverified' not in text
    # Without digests anywhere: the directory loads unverified, said of it
    # once; the copy is not named.
    for name in ('iter_2.pth', 'iter_4.pth'):
        os.remove(osp.join(work, name, MANIFEST_FILE))
    with consolidated_file(ckpt) as file:
        load_verified(file)
    with open(log) as f:
        said = [line for line in f if 'unverified' in line]
    assert len(said) == 1 and said[0].rstrip().endswith(
        f'{ckpt} has no {MANIFEST_FILE} (written before sharded checkpoints '
        'had digests): loaded unverified')


def _load_all(rank, world_size, log_dir, paths):
    """Resume from each of ``paths`` (load_checkpoint for the last);
    returns what each gave: the iteration or the error's text."""
    strategy = _strategy(log_dir)
    out = []
    for i, path in enumerate(paths):
        try:
            if i < len(paths) - 1:
                checkpoint = strategy.resume(path)
            else:
                checkpoint = strategy.load_checkpoint(path)
            out.append(checkpoint['meta']['iter'])
        except CheckpointDamagedError as e:
            out.append(str(e))
    return out


def test_resume_and_load_name_the_damaged_shard_on_every_rank(saved, tmp_path):
    paths = []
    for how in ('flipped', 'deleted', 'truncated'):
        work = tmp_path / how
        shutil.copytree(saved[0], work)
        _damage(work / 'iter_4.pth' / '__0_0.distcp', how)
        paths.append(str(work / 'iter_4.pth'))
    paths = [str(saved[0] / 'iter_4.pth')] + paths
    results = run_ranks(_load_all, str(tmp_path / 'logs'), paths)
    assert results[0] == results[1]  # every rank stops, and alike
    assert results[0][0] == 4
    for (how, message), path in zip(
            zip(('flipped', 'deleted', 'truncated'), results[0][1:]),
            paths[1:]):
        assert message.startswith(
            _expected(osp.join(path, '__0_0.distcp'), how)), message
        assert message.endswith('; the newest intact checkpoint beside it '
                                f'is {osp.dirname(path)}/iter_2.pth')


# -- tools/model_converters/fsdp2_to_pth.py -----------------------------------
def _tool_run(capsys, *argv):
    code = load_script(TOOL, 'fsdp2_to_pth').main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_converter_writes_dst_whole_with_its_digest(saved, tmp_path, capsys):
    work = _copy(saved, tmp_path)
    dst = str(tmp_path / 'out' / 'model.pth')
    code, out, err = _tool_run(capsys, str(work / 'iter_4.pth'), dst)
    assert code == 0, err
    assert f'wrote {dst} (and its digest {dst}.sha256)' in out
    assert sorted(os.listdir(tmp_path /
                             'out')) == ['model.pth', 'model.pth.sha256']
    assert verify_file(dst).status == 'ok'
    state = torch.load(dst, weights_only=True)['state_dict']
    assert torch.equal(state['a.weight'], saved[2]['a.weight'])


@pytest.mark.parametrize('where', ['same', 'same-slash', 'inside', 'folder'])
def test_converter_refuses_dst_over_src_and_leaves_nothing(
        saved, tmp_path, capsys, where):
    work = _copy(saved, tmp_path)
    src = str(work / 'iter_4.pth')
    dst = {
        'same': src,
        'same-slash': src + '/',
        'inside': osp.join(src, 'model.pth'),
        'folder': str(work)
    }[where]
    before = {p: os.listdir(p) for p in (work, src)}
    code, out, err = _tool_run(capsys, src, dst)
    assert code == 2 and out == ''  # refused: a usage error
    assert err.count('\n') == 1
    expected = {
        'same':
        f'DST {dst} is SRC itself: writing it would replace the '
        'sharded checkpoint',
        'same-slash':
        f'DST {dst} is SRC itself',
        'inside':
        f'DST {dst} is inside SRC {src}',
        'folder':
        f'DST {dst} is an existing directory; DST should be the '
        'path of the .pth file to write'
    }[where]
    assert err.startswith(f'fsdp2_to_pth.py: error: {expected}')
    assert {p: os.listdir(p) for p in (work, src)} == before
    assert verify_sharded_checkpoint(src).status == 'ok'


def test_converter_names_a_damaged_shard(saved, tmp_path, capsys):
    work = _copy(saved, tmp_path)
    shard = str(work / 'iter_4.pth' / '__1_0.distcp')
    _flip(shard)
    dst = str(tmp_path / 'model.pth')
    code, out, err = _tool_run(capsys, str(work / 'iter_4.pth'), dst)
    assert code == 2  # refused input
    assert err.startswith(f'fsdp2_to_pth.py: error: {shard} is damaged: ')
    assert err.endswith('; the newest intact checkpoint beside it is '
                        f'{work}/iter_2.pth\n')
    assert err.count('\n') == 1
    assert sorted(os.listdir(tmp_path)) == ['work']  # no DST, no leftover


def test_a_manifest_that_is_not_one_is_named(saved, tmp_path):
    work = _copy(saved, tmp_path)
    ckpt = work / 'iter_4.pth'
    (ckpt / MANIFEST_FILE).write_text('not a digest  meta.pth\n')
    with pytest.raises(ValueError, match='line 1 is not'):
        read_manifest(str(ckpt))
    result = verify_sharded_checkpoint(str(ckpt))
    assert result.status == 'damaged'
    assert result.message.startswith(
        f'{ckpt / MANIFEST_FILE} is damaged (line 1 is not')
