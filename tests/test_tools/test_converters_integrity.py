"""``tools/model_converters/internvit2mmseg.py`` converts InternViTs only,
writes its output whole (with its digest) and never over its input.

Real files through the tool's ``main(argv)``: a tiny InternViT as the
checkpoint tests build it, a segmentor with a ResNet-18 backbone under
MMSegmentation's key names (what the toy FCN config saves), random bytes,
folders. (``fsdp2_to_pth.py``'s own checks are in
``tests/test_engine/test_sharded_integrity.py``, beside the sharded
checkpoints.)
"""
import os
import os.path as osp

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mmcv_custom.integrity import atomic_write_bytes, verify_file
from mmcv_custom.models import InternViT
from tests.tool_utils import load_script

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'model_converters', 'internvit2mmseg.py')
TINY = dict(
    img_size=56, embed_dims=32, depth=2, num_heads=4, out_indices=(0, 1))
NOT_INTERNVIT = ('not an InternViT (which has a 4-D patch_embed.proj.weight '
                 'and blocks.N.attn.qkv.weight of shape (3C, C)): nothing '
                 'written')


def _run(capsys, *argv):
    code = load_script(TOOL, 'internvit2mmseg').main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


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
    dst = tmp_path / 'vit_mmseg.pth'
    for _ in range(2):  # the second replaces the first, digest and all
        code, out, err = _run(capsys, src, dst)
        assert code == 0, err
        assert f'(and its digest {dst}.sha256)' in out
        assert sorted(os.listdir(tmp_path)) == [
            'vit.pth', 'vit_mmseg.pth', 'vit_mmseg.pth.sha256'
        ]
        assert verify_file(str(dst)).status == 'ok'
    model = InternViT(**TINY, pretrained=str(dst))
    model.init_weights()
    assert torch.equal(model.blocks[1].attn.qkv.weight,
                       _internvit()['blocks.1.attn.qkv.weight'])


def test_a_resnet_segmentor_is_refused_by_name(tmp_path, capsys):
    src = tmp_path / 'fcn_r18.pth'
    torch.save(_resnet18_segmentor(), src)
    code, out, err = _run(capsys, src, tmp_path / 'out.pth')
    assert (code, out) == (1, '')
    assert err == (f'internvit2mmseg: error: {src} holds a ResNet-like '
                   'backbone (keys like backbone.layer1.0.conv1.weight), '
                   f'{NOT_INTERNVIT}\n')
    assert os.listdir(tmp_path) == ['fcn_r18.pth']


def test_a_backbone_of_unknown_kind_is_refused_too(tmp_path, capsys):
    # InternViT's prefixes (blocks.), but separate q/k/v and no patch
    # embedding: not one.
    src = tmp_path / 'other.pth'
    torch.save({'blocks.0.attn.q.weight': torch.zeros(4, 4)}, src)
    code, _, err = _run(capsys, src, tmp_path / 'out.pth')
    assert code == 1
    assert err == (f'internvit2mmseg: error: {src} holds a backbone (keys '
                   f'like blocks.0.attn.q.weight), {NOT_INTERNVIT}\n')
    # The right names with a qkv that is not (3C, C) for the embedding's C.
    state = _internvit()
    state['blocks.0.attn.qkv.weight'] = torch.zeros(96, 16)
    torch.save(state, src)
    assert _run(capsys, src, tmp_path / 'out.pth')[0] == 1
    assert os.listdir(tmp_path) == ['other.pth']


@pytest.mark.parametrize('spelling', ['same', 'dotted'])
def test_dst_equal_to_src_is_refused_and_src_kept(tmp_path, capsys, spelling):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    before = src.read_bytes()
    dst = src if spelling == 'same' else tmp_path / 'x' / '..' / 'vit.pth'
    code, out, err = _run(capsys, src, dst)
    assert (code, out) == (1, '')
    assert err == (f'internvit2mmseg: error: DST {dst} is SRC itself: the '
                   'converted checkpoint would replace the released one; '
                   f'give DST a name of its own, e.g. '
                   f'{osp.splitext(dst)[0]}_mmseg.pth\n')
    assert src.read_bytes() == before
    assert os.listdir(tmp_path) == ['vit.pth']


def test_dst_that_is_a_folder_is_refused(tmp_path, capsys):
    src = tmp_path / 'vit.pth'
    torch.save(_internvit(), src)
    code, _, err = _run(capsys, src, tmp_path)
    assert code == 1
    assert err == (f'internvit2mmseg: error: DST {tmp_path} is an existing '
                   'directory; DST should be the path of the .pth file to '
                   f'write, e.g. {tmp_path}/backbone.pth\n')
    assert os.listdir(tmp_path) == ['vit.pth']


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_a_folder_or_random_bytes_as_src_is_named(tmp_path, capsys):
    dst = tmp_path / 'out.pth'
    folder = tmp_path / 'weights'
    folder.mkdir()
    code, _, err = _run(capsys, folder, dst)
    assert code == 1
    assert err == (f'internvit2mmseg: error: checkpoint {folder} is a '
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
    assert err == (f'internvit2mmseg: error: checkpoint {sharded} is a '
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
    code, _, err = _run(capsys, noise, dst)
    assert code == 1
    assert err.startswith(f'internvit2mmseg: error: {noise} is not a '
                          'readable torch checkpoint (truncated, or not '
                          'written by torch.save): ')
    assert err.count('\n') == 1
    assert not osp.exists(dst)


def test_a_src_that_fails_its_digest_is_named(tmp_path, capsys):
    import io
    src = tmp_path / 'vit.pth'
    buffer = io.BytesIO()
    torch.save(_internvit(), buffer)
    data = bytearray(buffer.getvalue())
    atomic_write_bytes(str(src), bytes(data))
    data[-300] ^= 0xFF  # one byte, same size
    src.write_bytes(bytes(data))
    code, _, err = _run(capsys, src, tmp_path / 'out.pth')
    assert code == 1
    assert err.startswith(f'internvit2mmseg: error: {src} is damaged: its '
                          'SHA-256 is ')
    assert sorted(os.listdir(tmp_path)) == ['vit.pth', 'vit.pth.sha256']
