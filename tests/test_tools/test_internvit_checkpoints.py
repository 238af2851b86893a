"""InternViT checkpoints in every released layout, loaded and converted.

A tiny InternViT with weights set here is written in each layout (ours,
Hugging Face, InternVL-Chat ``vision_model.``, a whole segmentor under
``state_dict``) as ``.pth``, ``.bin`` and ``.safetensors``; loading it via
``pretrained=`` or through ``tools/model_converters/internvit2mmseg.py``
must give the same outputs, bit for bit.
"""
import hashlib
import json
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mmcv_custom.models import InternViT
from mmcv_custom.models.backbones import (UnknownCheckpointLayoutError,
                                          convert_checkpoint)
from mmcv_custom.models.backbones.intern_vit_conversion import convert
from tests.tool_utils import load_script

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'model_converters', 'internvit2mmseg.py')
TINY = dict(
    img_size=56, embed_dims=32, depth=4, num_heads=4, out_indices=(0, 1, 2, 3))
TOY_CONFIG = osp.join(
    ROOT, 'configs', 'intern_vit',
    'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')


def _tool():
    return load_script(TOOL, 'internvit2mmseg')


def _randomise(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + 0.1)
    return model


def _source(**kwargs):
    return _randomise(InternViT(**dict(TINY, **kwargs))).eval()


def _to_hf(state):
    """Our names -> Hugging Face InternVisionModel's (written out here,
    independently of the converter)."""
    out = {}
    for key, value in state.items():
        if key.startswith('up'):
            continue  # no pyramid in a pre-trained model
        key = {
            'cls_token': 'embeddings.class_embedding',
            'pos_embed': 'embeddings.position_embedding'
        }.get(key, key)
        key = key.replace('patch_embed.proj.', 'embeddings.patch_embedding.')
        if key.startswith('blocks.'):
            key = 'encoder.layers.' + key[len('blocks.'):]
            key = key.replace('.ls1.gamma',
                              '.ls1').replace('.ls2.gamma', '.ls2')
        out[key] = value
    return out


def _layout(state, layout):
    """The checkpoint dict of ``layout`` and whether it is nested."""
    if layout == 'ours':
        return {k: v for k, v in state.items() if not k.startswith('up')}
    if layout == 'ours-module':
        return {'module': _layout(state, 'ours')}
    if layout == 'hf':
        return _to_hf(state)
    if layout == 'chat':
        chat = {f'vision_model.{k}': v for k, v in _to_hf(state).items()}
        chat['mlp1.0.weight'] = torch.ones(4)
        chat['language_model.model.embed_tokens.weight'] = torch.ones(3, 2)
        return chat
    # InternVL's MMSegmentation 0.x segmentor: backbone with pyramid.
    seg = {f'backbone.{k}': v for k, v in state.items()}
    seg['decode_head.conv_seg.weight'] = torch.ones(4, 8, 1, 1)
    seg['auxiliary_head.conv_seg.weight'] = torch.ones(4, 8, 1, 1)
    return {'meta': {'mmseg_version': '0.30.0'}, 'state_dict': seg}


def _digest(path) -> str:
    """What a publisher lists for the file (Hugging Face: "SHA256")."""
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def _write(checkpoint, path):
    if path.endswith('.safetensors'):
        flat = checkpoint
        while any(isinstance(v, dict) for v in flat.values()):
            flat = next(v for k, v in flat.items()
                        if k in ('module', 'state_dict'))
        save_file({k: v.clone().contiguous() for k, v in flat.items()}, path)
    else:
        torch.save(checkpoint, path)
    return path


LAYOUTS = ['ours', 'ours-module', 'hf', 'chat', 'segmentor']
EXPECTED = {
    'ours': 'backbone',
    'ours-module': 'backbone',
    'hf': 'hf',
    'chat': 'chat',
    'segmentor': 'segmentor'
}


@pytest.mark.parametrize('ext', ['.pth', '.bin', '.safetensors'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_every_layout_loads_via_pretrained_and_the_converter(
        tmp_path, layout, ext):
    # A segmentor carries its pyramid (with final norms); a pre-trained
    # ViT does not, so those are compared without one.
    pyramid = dict(
        with_fpn=True, with_final_norm=True) if (layout
                                                 == 'segmentor') else {}
    source = _source(**pyramid)
    path = _write(
        _layout(source.state_dict(), layout), str(tmp_path / f'ckpt{ext}'))
    x = torch.randn(2, 3, 56, 56)
    expected = source(x)

    model = InternViT(**TINY, **pyramid, pretrained=path)
    model.init_weights()
    for out, ref in zip(model.eval()(x), expected):
        assert torch.equal(out, ref)

    dst = str(tmp_path / 'converted.pth')
    summary = convert(path, dst, sha256=[_digest(path)])
    assert f'{EXPECTED[layout]} layout' in summary
    converted = torch.load(dst, weights_only=True)
    assert converted['meta']['layout'] == EXPECTED[layout]
    if layout == 'segmentor':
        assert set(converted['state_dict']) == {
            f'backbone.{k}'
            for k in source.state_dict()
        } | {'decode_head.conv_seg.weight', 'auxiliary_head.conv_seg.weight'}
    model = InternViT(**TINY, **pyramid, pretrained=dst)
    model.init_weights()
    for out, ref in zip(model.eval()(x), expected):
        assert torch.equal(out, ref)


def test_layout_counts_and_what_is_left_out():
    state = _source().state_dict()
    chat = convert_checkpoint(_layout(state, 'chat'))
    assert chat.layout == 'chat' and len(chat.backbone) == len(state)
    assert sorted(chat.ignored) == [
        'language_model.model.embed_tokens.weight', 'mlp1.0.weight'
    ]
    assert chat.summary() == (
        'chat layout (InternVL-Chat (vision_model.* in the Hugging Face '
        f'layout)): {len(state)} backbone tensors, 2 other tensors left out')
    seg = convert_checkpoint(_layout(state, 'segmentor'))
    assert seg.layout == 'segmentor' and len(seg.heads) == 2
    assert 'segmentor' in seg.summary() and '2 head tensors' in seg.summary()


def test_layer_norm_variant_in_the_hf_layout_loads():
    # InternViT-300M's shape: LayerNorm blocks (with biases), qkv bias, no
    # query/key norm.
    kwargs = dict(qkv_bias=True, qk_norm=False, norm='ln')
    source = _source(**kwargs)
    hf = _to_hf(source.state_dict())
    assert 'encoder.layers.0.norm1.bias' in hf
    assert 'encoder.layers.0.attn.qkv.bias' in hf
    model = InternViT(**TINY, **kwargs)
    model.load_public_state_dict(hf)
    x = torch.randn(1, 3, 56, 56)
    assert torch.equal(model.eval()(x)[3], source(x)[3])


def test_a_whole_segmentor_converts_for_load_from(tmp_path):
    """InternVL's 0.x segmentor -> our UperNet config's model, every key."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint
    from mmseg.registry import MODELS
    cfg = Config.fromfile(TOY_CONFIG)
    init_default_scope('mmseg')
    torch.manual_seed(0)
    released = _randomise(MODELS.build(cfg.model))
    state = released.state_dict()
    # MMSegmentation 0.x and 1.x name UPerHead's and FCNHead's modules
    # alike, so InternVL's keys are our model's keys.
    src = str(tmp_path / 'internvl_seg.pth')
    torch.save({'meta': {}, 'state_dict': state}, src)
    dst = str(tmp_path / 'ours.pth')
    assert 'segmentor layout' in convert(src, dst, sha256=[_digest(src)])

    torch.manual_seed(1)
    ours = MODELS.build(cfg.model)
    load_checkpoint(ours, dst, map_location='cpu', strict=True)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_16px_patch_kernel_loads_into_patch_14(tmp_path):
    # Same 4 x 4 grid: 64 px in patches of 16, 56 px in patches of 14.
    source = _source(img_size=64, patch_size=16)
    path = str(tmp_path / 'p16.pth')
    torch.save(_layout(source.state_dict(), 'ours'), path)
    model = InternViT(**TINY, pretrained=path)
    model.init_weights()
    kernel = source.patch_embed.proj.weight
    assert model.patch_embed.proj.weight.shape == (32, 3, 14, 14)
    assert torch.equal(
        model.patch_embed.proj.weight,
        F.interpolate(
            kernel, size=(14, 14), mode='bicubic', align_corners=False))
    assert torch.equal(model.pos_embed, source.pos_embed)


def _block_params(model, index):
    return [
        n for n, _ in model.named_parameters()
        if n.startswith(f'blocks.{index}.')
    ]


def test_a_truncated_chat_vision_model_raises_with_counts(tmp_path):
    # InternVL-Chat keeps fewer blocks than the ViT has: never silent.
    source = _source()
    chat = {
        k: v
        for k, v in _layout(source.state_dict(), 'chat').items()
        if not k.startswith('vision_model.encoder.layers.3.')
    }
    path = _write(chat, str(tmp_path / 'chat.safetensors'))
    missing = len(_block_params(source, 3))
    loaded = len(source.state_dict()) - missing
    model = InternViT(**TINY, pretrained=path)
    with pytest.raises(
            RuntimeError,
            match=rf'chat layout\): {loaded} tensors loaded, '
            rf"{missing} ViT parameters missing \['blocks.3."):
        model.init_weights()
    model = InternViT(**TINY, pretrained=path, allow_partial=True)
    model.init_weights()
    assert torch.equal(model.blocks[2].mlp.fc2.weight,
                       source.blocks[2].mlp.fc2.weight)


def test_a_checkpoint_of_another_architecture_raises(tmp_path):
    source = _source(embed_dims=64)
    path = str(tmp_path / 'wide.pth')
    torch.save(_layout(source.state_dict(), 'ours'), path)
    model = InternViT(**TINY, pretrained=path)
    with pytest.raises(
            RuntimeError,
            match=r'of another shape '
            r"\['cls_token \(1, 1, 64\) vs \(1, 1, 32\)'"):
        model.init_weights()


def test_unknown_layout_and_missing_file_are_errors(tmp_path):
    path = str(tmp_path / 'other.pth')
    torch.save({'foo.weight': torch.zeros(2)}, path)
    with pytest.raises(
            UnknownCheckpointLayoutError,
            match=r"unknown checkpoint layout.*\['foo.weight'\]"):
        InternViT(**TINY, pretrained=path).init_weights()
    with pytest.raises(FileNotFoundError, match='nowhere.pth does not exist'):
        InternViT(
            **TINY, pretrained=str(tmp_path / 'nowhere.pth')).init_weights()


def test_converter_as_a_command(tmp_path):
    path = _write(
        _layout(_source().state_dict(), 'chat'),
        str(tmp_path / 'chat.safetensors'))
    dst = str(tmp_path / 'out' / 'backbone.pth')
    out = subprocess.run(
        [sys.executable, TOOL, path, dst, '--sha256',
         _digest(path)],
        capture_output=True,
        text=True,
        cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert 'chat layout' in out.stdout and '2 other tensors left out' in \
        out.stdout
    assert f"model.backbone.pretrained='{dst}'" in out.stdout

    bad = str(tmp_path / 'other.pth')
    torch.save({'foo.weight': torch.zeros(2)}, bad)
    out = subprocess.run([sys.executable, TOOL, bad, dst, '--unverified'],
                         capture_output=True,
                         text=True)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        'internvit2mmseg.py: error: unknown checkpoint layout')


def test_converter_names_a_missing_file(tmp_path, capsys):
    missing = str(tmp_path / 'nowhere.pth')
    assert _tool().main([missing, str(tmp_path / 'out.pth')]) == 2
    err = capsys.readouterr().err
    assert err == (f'internvit2mmseg.py: error: checkpoint {missing} does not '
                   'exist\n')
    assert not osp.exists(tmp_path / 'out.pth')
    broken = tmp_path / 'broken.safetensors'
    broken.write_bytes(b'not a safetensors file')
    assert _tool().main(
        [str(broken), str(tmp_path / 'out.pth'), '--unverified']) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'internvit2mmseg.py: error: {broken} is not a '
                          'readable safetensors file')
    assert err.count('\n') == 1


@pytest.mark.parametrize('ext', ['.safetensors', '.bin'])
def test_sharded_chat_checkpoint_reads_only_the_vision_model(tmp_path, ext):
    source = _source()
    chat = _layout(source.state_dict(), 'chat')
    names = sorted(chat)
    shards = {
        f'model-0000{i}-of-00002{ext}': dict((k, chat[k])
                                             for k in names[i - 1::2])
        for i in (1, 2)
    }
    for name, part in shards.items():
        _write(part, str(tmp_path / name))
    index = tmp_path / f'model{ext}.index.json'
    index.write_text(
        json.dumps({
            'metadata': {},
            'weight_map': {
                k: name
                for name, part in shards.items()
                for k in part
            }
        }))
    model = InternViT(**TINY, pretrained=str(index))
    model.init_weights()
    x = torch.randn(1, 3, 56, 56)
    assert torch.equal(model.eval()(x)[3], source(x)[3])
    summary = convert(
        str(index),
        str(tmp_path / 'out.pth'),
        sha256=[_digest(tmp_path / name) for name in shards])
    # The language model and projector are not even read.
    first_line = summary.splitlines()[0]
    assert first_line.endswith(f'{len(source.state_dict())} backbone tensors')


def _chat_download(tmp_path):
    """A sharded InternVL-Chat download: the vision model in two shards,
    the language model and projector in a third; its index and shards."""
    chat = _layout(_source().state_dict(), 'chat')
    vision = sorted(k for k in chat if k.startswith('vision_model.'))
    parts = [
        vision[0::2], vision[1::2],
        [k for k in chat if not k.startswith('vision_model.')]
    ]
    shards = []
    for i, keys in enumerate(parts, 1):
        shard = tmp_path / f'model-0000{i}-of-00003.safetensors'
        _write({k: chat[k] for k in keys}, str(shard))
        shards.append(shard)
    index = tmp_path / 'model.safetensors.index.json'
    index.write_text(
        json.dumps({
            'metadata': {},
            'weight_map': {
                k: shard.name
                for shard, keys in zip(shards, parts)
                for k in keys
            }
        }))
    return str(index), shards


def test_a_sharded_download_is_verified_shard_by_shard(tmp_path, capsys):
    index, shards = _chat_download(tmp_path)
    dst = tmp_path / 'out' / 'vit.pth'

    def run(*args):
        code = _tool().main([index, str(dst), *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    # Nothing to verify the two shards it reads against: refused, naming
    # them (not the language model's, which it never reads).
    code, out, err = run()
    assert (code, out) == (2, '')
    assert err == (
        f'internvit2mmseg.py: error: {index}: 2 of the shards it reads have '
        'no digest to verify them against (model-00001-of-00003.safetensors, '
        'model-00002-of-00003.safetensors): give the SHA-256 its publisher '
        "lists for each (--sha256 HEX once per shard; Hugging Face shows it "
        "on each file's page), or put SHARD.sha256 beside each (sha256sum's "
        'format), or convert it unverified (--unverified: DST then gets no '
        'digest)\n')
    # One shard's digest given, the other's forgotten.
    code, _, err = run('--sha256', _digest(shards[0]))
    assert code == 2
    assert err.startswith(
        f'internvit2mmseg.py: error: {shards[1]} matches none '
        'of the SHA-256 given: its SHA-256 is ')
    assert not dst.parent.exists()
    # Every shard's digest, as the download page lists them, in any order:
    # the third is never read, so never hashed.
    code, out, err = run(*[
        arg for shard in reversed(shards)
        for arg in ('--sha256', _digest(shard))
    ])
    assert code == 0, err
    assert (f'{index}: the SHA-256 of its 2 shards read match --sha256\n'
            in out)
    assert sorted(os.listdir(dst.parent)) == ['vit.pth', 'vit.pth.sha256']
    # Or a digest beside each shard it reads, as sha256sum writes them.
    for shard in shards[:2]:
        (tmp_path / f'{shard.name}.sha256'
         ).write_text(f'{_digest(shard)}  {shard.name}\n')
    code, out, err = run()
    assert code == 0, err
    assert (f'{index}: the SHA-256 of its 2 shards read match their .sha256 '
            'files\n' in out)
    # A flipped byte in a shard (same size): named, whatever is given.
    data = bytearray(shards[1].read_bytes())
    data[-5] ^= 0xFF
    digest = _digest(shards[1])
    shards[1].write_bytes(bytes(data))
    for args in ([], ['--unverified']):
        code, _, err = run(*args)
        assert code == 2
        assert err.startswith(f'internvit2mmseg.py: error: {shards[1]} is '
                              'damaged: its SHA-256 is ')
    os.remove(tmp_path / f'{shards[1].name}.sha256')
    code, _, err = run('--sha256', _digest(shards[0]), '--sha256', digest)
    assert code == 2
    assert f'{shards[1]} matches none of the SHA-256 given' in err
    # An index that names no shards, or is not JSON: one line.
    for text, why in (('{"weight_map": ["a"]}', 'should map tensor names '
                       "to shard files under 'weight_map', but does not"),
                      ('{"weight_map": {', 'is not a readable index (JSON): '
                       'Expecting property name')):
        with open(index, 'w') as f:
            f.write(text)
        code, _, err = run('--unverified')
        assert code == 2
        assert err.startswith(f'internvit2mmseg.py: error: {index} {why}')


INTERNVL_PYRAMID_INIT = dict(
    type='Kaiming',
    layer='ConvTranspose2d',
    mode='fan_out',
    nonlinearity='relu',
    distribution='normal')


@pytest.mark.parametrize('layout', ['ours', 'segmentor'])
def test_init_cfg_sets_what_the_checkpoint_leaves_new(tmp_path, layout):
    """The 6B recipes' init_cfg (InternVL's He-normal for the pyramid) is
    applied before ``pretrained``: a pre-trained ViT gets a fresh pyramid
    of InternVL's init, a whole segmentor keeps its own pyramid."""
    width = 256  # enough numbers for a std to within a few percent
    tiny = dict(TINY, embed_dims=width, depth=4, num_heads=4)
    source = _randomise(InternViT(**tiny, with_fpn=True)).eval()
    path = _write(
        _layout(source.state_dict(), layout), str(tmp_path / 'ckpt.pth'))
    torch.manual_seed(0)
    model = InternViT(
        **tiny, with_fpn=True, pretrained=path, init_cfg=INTERNVL_PYRAMID_INIT)
    model.init_weights()
    own, ref = model.state_dict(), source.state_dict()
    for key in ref:
        if not key.startswith('up'):
            assert torch.equal(own[key], ref[key]), key
    for conv in (model.up1[0], model.up1[3], model.up2[0]):
        if layout == 'segmentor':
            assert torch.equal(
                conv.weight, ref[[
                    k for k, v in model.named_parameters() if v is conv.weight
                ][0]])
            continue
        # InternVL: normal(0, sqrt(2 / fan_out)), fan_out = 2 * 2 * width.
        assert conv.weight.std().item() == pytest.approx(
            (2 / (4 * width))**0.5, rel=0.02)
        assert conv.weight.mean().abs().item() < 1e-3
        assert torch.equal(conv.bias, torch.zeros_like(conv.bias))


def test_6b_recipes_use_internvl_pyramid_init_and_the_toy_does_not():
    from mmengine.config import Config
    base = Config.fromfile(
        osp.join(ROOT, 'configs', 'intern_vit',
                 'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py'))
    assert base.model.backbone.init_cfg == INTERNVL_PYRAMID_INIT
    assert Config.fromfile(TOY_CONFIG).model.backbone.init_cfg is None
