"""Read InternViT checkpoints in any released layout, as our key names.

InternViT weights are published in four layouts, and a file in one layout
loads nothing into a backbone that expects another. This module tells them
apart by their keys and renames them to :class:`InternViT`'s names, so that
``InternViT(pretrained=...)`` and ``tools/model_converters/internvit2mmseg.py``
share one conversion (see ``docs/en/user_guides/intern_vit.md``):

* ``backbone``: our names, which are also InternVL's segmentation backbone's
  (``patch_embed.proj``, ``pos_embed``, ``cls_token``, ``blocks.{i}...``,
  pyramid ``up1``..``up4``), e.g. ``intern_vit_6b_224px.pth``; optionally
  under ``module``, ``state_dict`` or ``model``.
* ``hf``: Hugging Face ``InternVisionModel`` (``embeddings.*``,
  ``encoder.layers.{i}...``, LayerScale as bare ``ls1``/``ls2`` vectors).
* ``chat``: the same inside an InternVL-Chat checkpoint, under
  ``vision_model.``; the language model and projector are left out.
* ``segmentor``: a whole InternVL (MMSegmentation 0.x) or MMSegmentation 1.x
  segmentor, usually under ``state_dict``: ``backbone.*`` plus
  ``decode_head.*`` and ``auxiliary_head.*``, whose UPerHead / FCNHead module
  names are the same in both MMSegmentation versions, so the heads pass
  through unchanged.

Files: ``.pth`` / ``.bin`` (read with torch's safe loader through
:func:`mmcv_custom.integrity.checkpoint.load_checkpoint_file`) and
``.safetensors`` (needs the ``safetensors`` package, imported only for such
a file), or a Hugging Face ``*.index.json`` naming the shards of a large
checkpoint.
Resizing to a model's grid and patch size is the model's business
(:meth:`InternViT.load_public_state_dict`), not this module's.

The layouts are told apart by their prefixes only, so a segmentor of
another backbone (the toy FCN's ResNet-18: ``backbone.layer1...``) is a
``segmentor`` too; :func:`check_internvit` looks at the backbone itself
(a 4-D patch embedding and blocks whose attention has a ``(3C, C)`` qkv)
and names what it is instead.
"""
import json
import os.path as osp
import pickle
import re
from typing import Dict, List, NamedTuple

import torch

__all__ = [
    'LAYOUTS', 'ConvertedCheckpoint', 'UnknownCheckpointLayoutError',
    'NotInternViTError', 'check_internvit', 'convert_checkpoint',
    'detect_layout', 'load_internvit_checkpoint', 'read_state_file'
]

#: Layout name -> what it is, for messages.
LAYOUTS: Dict[str, str] = {
    'backbone': 'InternViT backbone (our / InternVL segmentation names)',
    'hf': 'Hugging Face InternVisionModel (embeddings.*, encoder.layers.*)',
    'chat': 'InternVL-Chat (vision_model.* in the Hugging Face layout)',
    'segmentor': 'segmentor (backbone.*, decode_head.*, auxiliary_head.*)',
}

_CONTAINERS = ('module', 'state_dict', 'model')
_HEADS = ('decode_head.', 'auxiliary_head.')
_BACKBONE_ROOTS = ('cls_token', 'pos_embed')
_BACKBONE_PREFIXES = ('patch_embed.', 'blocks.', 'up1.', 'up2.', 'up3.',
                      'up4.')
_HF_PREFIXES = ('embeddings.', 'encoder.layers.')
_HF_RENAMES = {
    'embeddings.class_embedding': 'cls_token',
    'embeddings.position_embedding': 'pos_embed',
    'embeddings.patch_embedding.weight': 'patch_embed.proj.weight',
    'embeddings.patch_embedding.bias': 'patch_embed.proj.bias',
}
# A bare LayerScale vector in the HF layout is our module's ``gamma``.
_HF_LAYER = re.compile(r'^encoder\.layers\.(\d+)\.(.+)$')


class UnknownCheckpointLayoutError(ValueError):
    """A checkpoint's keys match none of :data:`LAYOUTS`."""


class NotInternViTError(ValueError):
    """A checkpoint of a known layout whose backbone is not an InternViT."""


class ConvertedCheckpoint(NamedTuple):
    """A checkpoint renamed to our key names.

    Attributes:
        layout (str): One of :data:`LAYOUTS`.
        backbone (dict): The backbone's tensors under ``InternViT`` names.
        heads (dict): ``decode_head.*`` / ``auxiliary_head.*`` tensors of a
            segmentor checkpoint (empty for the other layouts).
        ignored (list): Keys left out on purpose (a chat model's language
            model and projector, a segmentor's other parts).
    """
    layout: str
    backbone: Dict[str, torch.Tensor]
    heads: Dict[str, torch.Tensor]
    ignored: List[str]

    def summary(self) -> str:
        """One line: the layout and the counts."""
        text = (f'{self.layout} layout ({LAYOUTS[self.layout]}): '
                f'{len(self.backbone)} backbone tensors')
        if self.layout == 'segmentor':
            text += f', {len(self.heads)} head tensors'
        if self.ignored:
            text += f', {len(self.ignored)} other tensors left out'
        return text


def read_state_file(path: str):
    """Read a ``.pth`` / ``.bin`` (safe torch load) or ``.safetensors`` file,
    or the shards named by a Hugging Face ``*.index.json``.

    From a sharded InternVL-Chat checkpoint only the ``vision_model.``
    tensors are read (the language model is most of its size).

    Raises:
        FileNotFoundError: ``path`` (or a shard it names) does not exist.
        IsADirectoryError: ``path`` is a directory (an FSDP2 sharded
            checkpoint, say).
        ValueError: A ``.safetensors`` or torch file cannot be read (not
            one, truncated, random bytes); the message names ``path``.
        UnsafeCheckpointError: A torch file holds objects off the allow-list.
    """
    if osp.isdir(path):
        from mmcv_custom.integrity.checkpoint import is_sharded_checkpoint
        hint = (': an FSDP2 sharded checkpoint; make it one file first with '
                'tools/model_converters/fsdp2_to_pth.py'
                if is_sharded_checkpoint(path) else '')
        raise IsADirectoryError(
            f'checkpoint {path} is a directory, not a checkpoint file{hint}')
    if not osp.isfile(path):
        raise FileNotFoundError(f'checkpoint {path} does not exist')
    if path.endswith('.index.json'):
        return _read_shards(path)
    if path.endswith('.safetensors'):
        # Only here: nothing else needs the package.
        from safetensors.torch import load_file
        try:
            return load_file(path, device='cpu')
        except Exception as e:  # SafetensorError derives from Exception
            raise ValueError(f'{path} is not a readable safetensors file '
                             f'({e})') from e
    from mmcv_custom.integrity import CheckpointDamagedError
    from mmcv_custom.integrity.checkpoint import (UnsafeCheckpointError,
                                                  load_checkpoint_file)
    try:
        return load_checkpoint_file(path, map_location='cpu')
    except (UnsafeCheckpointError, CheckpointDamagedError):
        raise  # they name the file, and what is wrong with it
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f'{path} is not a readable torch checkpoint (truncated, or not '
            f'written by torch.save): {first}') from None


def _read_shards(index_path: str) -> Dict[str, torch.Tensor]:
    with open(index_path) as f:
        weight_map = json.load(f).get('weight_map')
    if not isinstance(weight_map, dict):
        raise UnknownCheckpointLayoutError(
            f'{index_path} should map tensor names to shard files under '
            "'weight_map', but has none")
    wanted = [k for k in weight_map if k.startswith('vision_model.')]
    wanted = set(wanted or weight_map)
    folder = osp.dirname(index_path)
    state = {}
    for shard in sorted({weight_map[k] for k in wanted}):
        shard_path = osp.join(folder, shard)
        if shard.endswith('.safetensors') and osp.isfile(shard_path):
            from safetensors import safe_open
            with safe_open(shard_path, framework='pt', device='cpu') as f:
                state.update(
                    (k, f.get_tensor(k)) for k in f.keys() if k in wanted)
        else:
            state.update((k, v)
                         for k, v in read_state_file(shard_path).items()
                         if k in wanted)
    return state


def _unwrap(checkpoint) -> dict:
    if not isinstance(checkpoint, dict):
        raise UnknownCheckpointLayoutError(
            'a checkpoint should be a dict of tensors, but got '
            f'{type(checkpoint).__name__}')
    while True:
        inner = next(
            (checkpoint[k]
             for k in _CONTAINERS if isinstance(checkpoint.get(k), dict)),
            None)
        if inner is None:
            return checkpoint
        checkpoint = inner


def detect_layout(state: dict) -> str:
    """The layout (a key of :data:`LAYOUTS`) of an unwrapped state dict.

    Raises:
        UnknownCheckpointLayoutError: No layout's keys are there; the
            message shows the first few keys.
    """
    keys = list(state)
    if any(k.startswith('vision_model.') for k in keys):
        return 'chat'
    if any(k.startswith('backbone.') for k in keys):
        return 'segmentor'
    if any(k.startswith(_HF_PREFIXES) for k in keys):
        return 'hf'
    if any(
            k in _BACKBONE_ROOTS or k.startswith(_BACKBONE_PREFIXES)
            for k in keys):
        return 'backbone'
    raise UnknownCheckpointLayoutError(
        'unknown checkpoint layout: expected one of '
        f'{", ".join(LAYOUTS)} ({len(keys)} keys, first {keys[:5]})')


def _from_hf(state: dict) -> Dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key in _HF_RENAMES:
            key = _HF_RENAMES[key]
        else:
            match = _HF_LAYER.match(key)
            if match:
                index, rest = match.groups()
                if rest in ('ls1', 'ls2'):
                    rest += '.gamma'
                key = f'blocks.{index}.{rest}'
        out[key] = value
    return out


def convert_checkpoint(checkpoint) -> ConvertedCheckpoint:
    """Detect the layout of a loaded checkpoint and rename it to ours.

    Args:
        checkpoint (dict): What :func:`read_state_file` returned (a state
            dict, optionally under ``module``, ``state_dict`` or ``model``).

    Returns:
        ConvertedCheckpoint: Keys the backbone does not know (in the
        ``backbone`` and ``hf`` layouts) are kept in ``backbone``, so that
        loading reports them.
    """
    state = _unwrap(checkpoint)
    layout = detect_layout(state)
    heads, ignored = {}, []
    if layout == 'backbone':
        backbone = dict(state)
    elif layout == 'hf':
        backbone = _from_hf(state)
    elif layout == 'chat':
        prefix = 'vision_model.'
        backbone = _from_hf({
            k[len(prefix):]: v
            for k, v in state.items() if k.startswith(prefix)
        })
        ignored = [k for k in state if not k.startswith(prefix)]
    else:
        backbone = {
            k[len('backbone.'):]: v
            for k, v in state.items() if k.startswith('backbone.')
        }
        heads = {k: v for k, v in state.items() if k.startswith(_HEADS)}
        ignored = [
            k for k in state
            if not k.startswith('backbone.') and k not in heads
        ]
    return ConvertedCheckpoint(layout, backbone, heads, ignored)


_QKV = re.compile(r'^blocks\.\d+\.attn\.qkv\.weight$')
# What a backbone that is not an InternViT most likely is, by its keys:
# (name, pattern of a telling key).
_OTHER_BACKBONES = (
    ('ResNet-like', re.compile(r'(^|\.)layer\d+\.\d+\.(conv|bn)\d')),
    ('Swin-like', re.compile(r'\.w_msa\.')),
    ('ConvNeXt-like',
     re.compile(r'(^|\.)(downsample_layers|stages)\.\d+'
                r'\..*(depthwise_conv|dwconv)')),
    ('MMSegmentation VisionTransformer-like',
     re.compile(r'(^|\.)layers\.\d+\.attn\.attn\.in_proj_weight$')),
    ('Hugging Face ViT-like',
     re.compile(r'\.attention\.attention\.query\.weight$')),
)


def _looks_internvit(backbone: Dict[str, torch.Tensor]) -> bool:
    patch = backbone.get('patch_embed.proj.weight')
    if getattr(patch, 'dim', lambda: 0)() != 4:
        return False
    width = patch.shape[0]
    qkv = [v for k, v in backbone.items() if _QKV.match(k)]
    return bool(qkv) and all(
        getattr(v, 'dim', lambda: 0)() == 2 and tuple(v.shape) == (3 * width,
                                                                   width)
        for v in qkv)


def check_internvit(converted: ConvertedCheckpoint, source: str) -> None:
    """Refuse a checkpoint whose backbone is not an InternViT.

    The layouts are recognised by their prefixes (``backbone.`` makes a
    segmentor), which a ResNet segmentor has as well. An InternViT has a
    4-D ``patch_embed.proj.weight`` of ``C`` output channels and blocks
    whose ``attn.qkv.weight`` is ``(3C, C)``, in every layout this module
    reads, once renamed.

    Args:
        converted (ConvertedCheckpoint): What :func:`convert_checkpoint`
            made of the file.
        source (str): The file, for the message.

    Raises:
        NotInternViTError: Names what the backbone looks like, with one
            of its keys (a segmentor's with its ``backbone.`` prefix).
    """
    backbone = converted.backbone
    if _looks_internvit(backbone):
        return
    prefix = 'backbone.' if converted.layout == 'segmentor' else ''
    what, example = 'a backbone', None
    for name, pattern in _OTHER_BACKBONES:
        example = next((k for k in backbone if pattern.search(k)), None)
        if example is not None:
            what = f'a {name} backbone'
            break
    if example is None:
        example = next(iter(backbone), None)
    keys = (f'keys like {prefix}{example}'
            if example is not None else 'no backbone tensors')
    raise NotInternViTError(
        f'{source} holds {what} ({keys}), not an InternViT (which has a '
        '4-D patch_embed.proj.weight and blocks.N.attn.qkv.weight of '
        'shape (3C, C))')


def load_internvit_checkpoint(path: str) -> ConvertedCheckpoint:
    """:func:`read_state_file` then :func:`convert_checkpoint`."""
    return convert_checkpoint(read_state_file(path))
