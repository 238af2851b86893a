"""The converters verify their input, write their output whole and never
over their input, and never give a digest to an output whose input they
could not verify.

``tools/model_converters/internvit2mmseg.py`` converts InternViTs only,
from a SRC verified by ``--sha256`` (what a publisher lists) or a
``.sha256`` beside it, or, with ``--unverified``, into a DST without a
digest. ``tools/model_converters/fsdp2_to_pth.py`` refuses a sharded
checkpoint without ``SHA256SUMS`` unless ``--unverified``, and then
writes no digest either. Exit status 2 for a refusal, 1 for a failed
write.

Real files through the tools' ``main(argv)``: a tiny InternViT as the
checkpoint tests build it, a segmentor with a ResNet-18 backbone under
MMSegmentation's key names (what the toy FCN config saves), random bytes,
folders, a sharded checkpoint written by DCP itself (damaged the way
disks and copies do it), and a write cut short by a file size limit.
(``fsdp2_to_pth.py``'s checks of checkpoints saved by ``FSDP2Strategy``
on 2 ranks are in ``tests/test_engine/test_sharded_integrity.py``.)
"""
import hashlib
import io
import os
import os.path as osp
import resource
import signal
import struct
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mmcv_custom.integrity import atomic_write_bytes, verify_file
from mmcv_custom.integrity.sharded_checkpoint import (MANIFEST_FILE,
                                                      write_manifest)
from mmcv_custom.models import InternViT
from tests.tool_utils import load_script

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'model_converters', 'internvit2mmseg.py')
FSDP2_TOOL = osp.join(ROOT, 'tools', 'model_converters', 'fsdp2_to_pth.py')
TINY = dict(
    img_size=56, embed_dims=32, depth=2, num_heads=4, out_indices=(0, 1))
NOT_INTERNVIT = ('not an InternViT (which has a 4-D patch_embed.proj.weight '
                 'and blocks.N.attn.qkv.weight of shape (3C, C)): nothing '
                 'written')


def _run(capsys, *argv, tool=TOOL):
    name = osp.splitext(osp.basename(tool))[0]
    code = load_script(tool, name).main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _sha256(path) -> str:
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def _internvit():
    torch.manual_seed(0)
    return InternViT(**TINY).state_dict()


def _resnet18_segmentor():
    """The toy FCN's state dict, by MMSegmentation's names (ResNetV1c:
    deep stem, two basic blocks per stage), tensors kept tiny."""
    state = {}
    for i in (0, 3, 6):
        state[f'backbone.stem.{i}.weight'] = torch.zeros(8, 3, 3, 3)
        state[f'backbone.stem.{i + 1}.weight'] = torch.ones(8)
    for stage in range(1, 5):
        for block in range(2):
            key = f'backbone.layer{stage}.{block}'
            for conv in (1, 2):
                state[f'{key}.conv{conv}.weight'] = torch.zeros(8, 8, 3, 3)
                state[f'{key}.bn{conv}.weight'] = torch.ones(8)
                state[f'{key}.bn{conv}.running_mean'] = torch.zeros(8)
            if stage > 1 and block == 0:
                state[f'{key}.downsample.0.weight'] = torch.zeros(8, 8, 1, 1)
    state['decode_head.conv_seg.weight'] = torch.zeros(4, 8, 1, 1)
    return {'meta': {}, 'state_dict': state}


def test_an_internvit_converts_with_its_digest_and_nothing_else(
        tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    # Apart from SRC: a released file without a digest beside converted
    # files with one would be refused on loading, as in a work dir.
    out_dir = tmp_path / 'out'
    dst = out_dir / 'vit_mmseg.pth'
    for _ in range(2):  # the second replaces the first, digest and all
        code, out, err = _run(capsys, src, dst, '--sha256', _sha256(src))
        assert code == 0, err
        assert f'{src}: its SHA-256 matches --sha256\n' in out
        assert f'(and its digest {dst}.sha256)' in out
        assert sorted(os.listdir(tmp_path)) == ['out', 'vit.pth']
        assert sorted(
            os.listdir(out_dir)) == ['vit_mmseg.pth', 'vit_mmseg.pth.sha256']
        assert verify_file(str(dst)).status == 'ok'
    model = InternViT(**TINY, pretrained=str(dst))
    model.init_weights()
    assert torch.equal(model.blocks[1].attn.qkv.weight,
                       _internvit()['blocks.1.attn.qkv.weight'])


def test_a_resnet_segmentor_is_refused_by_name(tmp_path, capsys):
    src = tmp_path / 'fcn_r18.pth'
    torch.save(_resnet18_segmentor(), src)
    code, out, err = _run(capsys, src, tmp_path / 'out.pth', '--sha256',
                          _sha256(src))
    assert (code, out) == (2, '')
    assert err == (f'internvit2mmseg.py: error: {src} holds a ResNet-like '
                   'backbone (keys like backbone.layer1.0.conv1.weight), '
                   f'{NOT_INTERNVIT}\n')
    assert os.listdir(tmp_path) == ['fcn_r18.pth']


def test_a_backbone_of_unknown_kind_is_refused_too(tmp_path, capsys):
    # InternViT's prefixes (blocks.), but separate q/k/v and no patch
    # embedding: not one.
    src = tmp_path / 'other.pth'
    torch.save({'blocks.0.attn.q.weight': torch.zeros(4, 4)}, src)
    code, _, err = _run(capsys, src, tmp_path / 'out.pth', '--unverified')
    assert code == 2
    assert err == (f'internvit2mmseg.py: error: {src} holds a backbone (keys '
                   f'like blocks.0.attn.q.weight), {NOT_INTERNVIT}\n')
    # The right names with a qkv that is not (3C, C) for the embedding's C.
    state = _internvit()
    state['blocks.0.attn.qkv.weight'] = torch.zeros(96, 16)
    torch.save(state, src)
    assert _run(capsys, src, tmp_path / 'out.pth', '--unverified')[0] == 2
    assert os.listdir(tmp_path) == ['other.pth']


@pytest.mark.parametrize('spelling', ['same', 'dotted'])
def test_dst_equal_to_src_is_refused_and_src_kept(tmp_path, capsys, spelling):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    before = src.read_bytes()
    dst = src if spelling == 'same' else tmp_path / 'x' / '..' / 'vit.pth'
    code, out, err = _run(capsys, src, dst)
    assert (code, out) == (2, '')
    assert err == (f'internvit2mmseg.py: error: DST {dst} is SRC itself: the '
                   'converted checkpoint would replace the released one; '
                   f'give DST a name of its own, e.g. '
                   f'{osp.splitext(dst)[0]}_mmseg.pth\n')
    assert src.read_bytes() == before
    assert os.listdir(tmp_path) == ['vit.pth']


def test_dst_that_is_a_folder_is_refused(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    code, _, err = _run(capsys, src, tmp_path)
    assert code == 2
    assert err == (f'internvit2mmseg.py: error: DST {tmp_path} is an existing '
                   'directory; DST should be the path of the .pth file to '
                   f'write, e.g. {tmp_path}/backbone.pth\n')
    assert os.listdir(tmp_path) == ['vit.pth']


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_a_folder_or_random_bytes_as_src_is_named(tmp_path, capsys):
    dst = tmp_path / 'out.pth'
    folder = tmp_path / 'weights'
    folder.mkdir()
    code, _, err = _run(capsys, folder, dst)
    assert code == 2
    assert err == (f'internvit2mmseg.py: error: checkpoint {folder} is a '
                   'directory, not a checkpoint file\n')
    # An FSDP2 checkpoint directory: said what it is, and what to do.
    sharded = tmp_path / 'iter_4.pth'
    dcp.save({'model': {
        'w': torch.ones(2)
    }},
             checkpoint_id=str(sharded),
             no_dist=True)
    torch.save({'meta': {'iter': 4}}, sharded / 'meta.pth')
    code, _, err = _run(capsys, sharded, dst)
    assert err == (f'internvit2mmseg.py: error: checkpoint {sharded} is a '
                   'directory, not a checkpoint file: an FSDP2 sharded '
                   'checkpoint; make it one file first with '
                   'tools/model_converters/fsdp2_to_pth.py\n')
    noise = tmp_path / 'noise.pth'
    noise.write_bytes(
        torch.randint(
            0,
            256, (4096, ),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(0)).numpy().tobytes())
    code, _, err = _run(capsys, noise, dst, '--unverified')
    assert code == 2
    assert err.startswith(f'internvit2mmseg.py: error: {noise} is not a '
                          'readable torch checkpoint (truncated, or not '
                          'written by torch.save): ')
    assert err.count('\n') == 1
    assert not osp.exists(dst)


def test_a_src_that_fails_its_digest_is_named(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    buffer = io.BytesIO()
    torch.save(_internvit(), buffer)
    data = bytearray(buffer.getvalue())
    atomic_write_bytes(str(src), bytes(data))
    data[-300] ^= 0xFF  # one byte, same size
    src.write_bytes(bytes(data))
    # Refused whatever else is said: --unverified accepts a file nothing
    # vouches for, not one its digest says is damaged.
    for extra in ([], ['--unverified']):
        code, _, err = _run(capsys, src, tmp_path / 'out.pth', *extra)
        assert code == 2
        assert err.startswith(f'internvit2mmseg.py: error: {src} is damaged: '
                              'its SHA-256 is ')
        assert sorted(os.listdir(tmp_path)) == ['vit.pth', 'vit.pth.sha256']


# -- internvit2mmseg.py: verifying what a publisher released ----------------
UNVERIFIED = ('has no digest to verify it against: give the SHA-256 its '
              'publisher lists (--sha256 HEX; Hugging Face shows it on the '
              "file's page), or put a vit.pth.sha256 beside it (sha256sum's "
              'format), or convert it unverified (--unverified: DST then gets '
              'no digest)')


def test_a_src_with_nothing_to_verify_it_is_refused(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    code, out, err = _run(capsys, src, tmp_path / 'out.pth')
    assert (code, out) == (2, '')
    assert err == f'internvit2mmseg.py: error: {src} {UNVERIFIED}\n'
    assert os.listdir(tmp_path) == ['vit.pth']


def test_a_sha256sum_file_beside_src_verifies_it(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    # What `sha256sum vit.pth > vit.pth.sha256` writes.
    (tmp_path / 'vit.pth.sha256').write_text(f'{_sha256(src)}  vit.pth\n')
    dst = tmp_path / 'out' / 'vit_mmseg.pth'
    code, out, err = _run(capsys, src, dst)
    assert code == 0, err
    assert f'{src}: its SHA-256 matches vit.pth.sha256\n' in out
    assert verify_file(str(dst)).status == 'ok'


def test_a_sha256_of_another_file_is_refused(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    wrong = hashlib.sha256(b'another file').hexdigest()
    code, out, err = _run(capsys, src, tmp_path / 'out.pth', '--sha256',
                          wrong.upper())  # as some pages print it
    assert (code, out) == (2, '')
    assert err == (f'internvit2mmseg.py: error: {src} is not the file whose '
                   f'SHA-256 you gave: its SHA-256 is {_sha256(src)[:16]}..., '
                   f'--sha256 gave {wrong[:16]}... (a bad download or copy, '
                   'or the digest of another file)\n')
    assert os.listdir(tmp_path) == ['vit.pth']


def test_unverified_writes_no_digest_and_drops_a_stale_one(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    out_dir = tmp_path / 'out'
    dst = out_dir / 'vit_mmseg.pth'
    # An earlier, verified conversion of another file to the same name.
    other = tmp_path / 'other.pth'
    torch.save(_internvit(), other)
    assert _run(capsys, other, dst, '--sha256', _sha256(other))[0] == 0
    assert sorted(
        os.listdir(out_dir)) == ['vit_mmseg.pth', 'vit_mmseg.pth.sha256']
    code, out, err = _run(capsys, src, dst, '--unverified')
    assert code == 0, err
    assert out.splitlines()[1:] == [
        f'{src}: not verified (--unverified)',
        f'wrote {len(_internvit())} tensors to {dst} without a digest: '
        'nothing vouches for its source; use it as '
        f"model.backbone.pretrained='{dst}'"
    ]
    assert os.listdir(out_dir) == ['vit_mmseg.pth']
    assert verify_file(str(dst)).status == 'no_digest'
    # It loads as any file without a digest does.
    model = InternViT(**TINY, pretrained=str(dst))
    model.init_weights()
    assert torch.equal(model.blocks[0].attn.qkv.weight,
                       _internvit()['blocks.0.attn.qkv.weight'])


def test_unverified_still_checks_a_digest_it_finds(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    (tmp_path / 'vit.pth.sha256').write_text(f'{_sha256(src)}  vit.pth\n')
    dst = tmp_path / 'out' / 'vit_mmseg.pth'
    code, out, err = _run(capsys, src, dst, '--unverified')
    assert code == 0, err
    # Verified after all: the output gets its digest.
    assert f'{src}: its SHA-256 matches vit.pth.sha256\n' in out
    assert verify_file(str(dst)).status == 'ok'


# -- fsdp2_to_pth.py: a sharded checkpoint with or without SHA256SUMS ---------
WEIGHTS = {
    'a.weight': torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8),
    'a.bias': torch.ones(64),
}


def _sharded(folder, manifest=True):
    """``folder/iter_4.pth/`` as FSDP2Strategy lays it out (DCP's files of
    the model and optimizer, ``meta.pth``, ``SHA256SUMS`` of them all),
    written by DCP in this process."""
    ckpt = folder / 'iter_4.pth'
    dcp.save(
        {
            'model': dict(WEIGHTS),
            'optimizer': {
                'state': {
                    'a.weight': {
                        'momentum_buffer': torch.zeros(64, 8)
                    }
                }
            }
        },
        checkpoint_id=str(ckpt),
        no_dist=True)
    torch.save({'meta': {
        'iter': 4,
        'sharded': {
            'world_size': 1
        }
    }}, ckpt / 'meta.pth')
    if manifest:
        write_manifest(
            str(ckpt),
            {name: _sha256(ckpt / name)
             for name in os.listdir(ckpt)})
    return ckpt


def _flip_shard(ckpt):
    """Flip the bytes of four of ``a.weight``'s numbers (100 to 103) in
    its shard, keeping its size: what bit rot and a bad copy do, and what
    loads without a word where nothing records the shard's digest.
    Returns the shard."""
    shard = next(ckpt / n for n in os.listdir(ckpt) if n.endswith('.distcp'))
    data = bytearray(shard.read_bytes())
    start = data.index(struct.pack('<4f', 100, 101, 102, 103))
    for i in range(start, start + 16):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


NO_MANIFEST = ('has no SHA256SUMS (written before sharded checkpoints had '
               'digests, or copied without it), so its shards cannot be '
               'verified: copy SHA256SUMS from where it was written, or '
               'consolidate it unverified (--unverified: DST then gets no '
               'digest)')


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_fsdp2_to_pth_verified_gets_a_digest(tmp_path, capsys):
    ckpt = _sharded(tmp_path)
    dst = tmp_path / 'out' / 'model.pth'
    code, out, err = _run(capsys, ckpt, dst, tool=FSDP2_TOOL)
    assert code == 0, err
    assert out == (f'{ckpt}: 2 tensors, 576 numbers, saved by 1 ranks at '
                   'iteration 4 (one process, not sharded)\nwrote '
                   f'{dst} (and its digest {dst}.sha256); '
                   f"use it as load_from='{dst}'\n")
    assert verify_file(str(dst)).status == 'ok'
    state = torch.load(dst, weights_only=True)['state_dict']
    assert torch.equal(state['a.weight'], WEIGHTS['a.weight'])


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_fsdp2_to_pth_refuses_a_damaged_checkpoint_without_manifest(
        tmp_path, capsys):
    # The tester's case: a shard's bytes flipped, no SHA256SUMS to tell.
    ckpt = _sharded(tmp_path, manifest=False)
    _flip_shard(ckpt)
    dst = tmp_path / 'out' / 'model.pth'
    code, out, err = _run(capsys, ckpt, dst, tool=FSDP2_TOOL)
    assert (code, out) == (2, '')
    assert err == f'fsdp2_to_pth.py: error: {ckpt} {NO_MANIFEST}\n'
    assert sorted(os.listdir(tmp_path)) == ['iter_4.pth']
    # Asked for: written, without a digest that would vouch for the damage.
    code, out, err = _run(capsys, ckpt, dst, '--unverified', tool=FSDP2_TOOL)
    assert code == 0, err
    assert out.splitlines()[1] == (
        f'wrote {dst} without a digest: {ckpt} has no SHA256SUMS, so nothing '
        f"vouches for its shards (--unverified); use it as load_from='{dst}'")
    assert os.listdir(dst.parent) == ['model.pth']
    assert verify_file(str(dst)).status == 'no_digest'
    # What it holds is the damage: nothing could have told.
    state = torch.load(dst, weights_only=True)['state_dict']
    changed = (state['a.weight'] != WEIGHTS['a.weight']).flatten()
    assert changed.nonzero().flatten().tolist() == [100, 101, 102, 103]


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_fsdp2_to_pth_unverified_drops_a_stale_digest_and_keeps_checks(
        tmp_path, capsys):
    ckpt = _sharded(tmp_path)
    dst = tmp_path / 'out' / 'model.pth'
    assert _run(capsys, ckpt, dst, tool=FSDP2_TOOL)[0] == 0
    os.remove(ckpt / MANIFEST_FILE)
    code, _, err = _run(capsys, ckpt, dst, '--unverified', tool=FSDP2_TOOL)
    assert code == 0, err
    # The earlier digest must not vouch for the new, unverified bytes.
    assert os.listdir(dst.parent) == ['model.pth']
    # What can still be checked without a manifest still is: a shard that
    # is missing, or shorter than .metadata says.
    shard = _flip_shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err = _run(capsys, ckpt, dst, '--unverified', tool=FSDP2_TOOL)
    assert code == 2
    assert err.startswith(f'fsdp2_to_pth.py: error: {shard} is damaged: '
                          'truncated to 100 bytes')
    # And --unverified accepts nothing damaged where a manifest says so.
    ckpt = _sharded(tmp_path / 'out')
    shard = _flip_shard(ckpt)
    code, _, err = _run(
        capsys, ckpt, tmp_path / 'x.pth', '--unverified', tool=FSDP2_TOOL)
    assert code == 2
    assert err.startswith(f'fsdp2_to_pth.py: error: {shard} is damaged: its '
                          'SHA-256 is ')


# -- a write that fails: exit status 1, nothing left --------------------------
def _limit_file_size():
    # As a full disk or a quota: writes past 1 KiB fail (EFBIG), instead
    # of the signal that would kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, 1 << 10))


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
@pytest.mark.parametrize('tool', ['internvit2mmseg', 'fsdp2_to_pth'])
def test_a_failed_write_is_exit_status_1_and_leaves_nothing(tmp_path, tool):
    if tool == 'fsdp2_to_pth':
        src, extra, path = _sharded(tmp_path), [], FSDP2_TOOL
    else:
        src = tmp_path / 'vit.pth'
        torch.save(_internvit(), src)
        extra, path = ['--sha256', _sha256(src)], TOOL
    out_dir = tmp_path / 'out'
    out_dir.mkdir()
    dst = out_dir / 'model.pth'
    run = subprocess.run(
        [sys.executable, path,
         str(src), str(dst), *extra],
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size,
        timeout=120)
    assert (run.returncode, run.stdout) == (1, ''), run.stderr[-2000:]
    assert run.stderr.splitlines()[-1] == (
        f'{tool}.py: error: cannot write {dst} (File too large): nothing '
        'written')
    assert os.listdir(out_dir) == []


def test_converter_usage_errors(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    tool = load_script(TOOL, 'internvit2mmseg')
    cases = [
        (['--sha256', 'abc'], "argument --sha256: 'abc' is not a SHA-256: "
         'give the 64 hex digits that sha256sum prints and Hugging Face '
         'lists for each file'),
        (['--sha256', _sha256(src), '--unverified'],
         '--sha256 verifies SRC and --unverified converts it unverified: '
         'give one of them'),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exited:
            tool.main([str(src), str(tmp_path / 'out.pth'), *extra])
        assert exited.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ''
        assert captured.err.splitlines()[-1] == (
            f'internvit2mmseg.py: error: {message}')
    # Two digests for one file: which one it should match is unclear.
    code, _, err = _run(capsys, src, tmp_path / 'out.pth', '--sha256',
                        _sha256(src), '--sha256',
                        _sha256(src)[::-1])
    assert code == 2
    assert err == (f'internvit2mmseg.py: error: --sha256 given 2 times, but '
                   f'{src} is one file: give its one SHA-256\n')
    assert os.listdir(tmp_path) == ['vit.pth']
