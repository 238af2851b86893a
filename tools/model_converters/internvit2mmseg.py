"""Convert a released InternViT checkpoint to what our configs load.

    python tools/model_converters/internvit2mmseg.py SRC DST

SRC is a ``.pth``, ``.bin`` or ``.safetensors`` file (or the
``*.index.json`` of a sharded Hugging Face checkpoint) in any layout that
``mmcv_custom.models.backbones.intern_vit_checkpoint`` knows: ours /
InternVL's backbone, Hugging Face ``InternVisionModel``, InternVL-Chat
(``vision_model.``), or a whole InternVL (MMSegmentation 0.x) segmentor.
DST is written with ``torch.save`` as ``{'state_dict': ..., 'meta': ...}``:

* a segmentor checkpoint becomes a whole segmentor state dict
  (``backbone.*``, ``decode_head.*``, ``auxiliary_head.*``) for
  ``load_from=DST``;
* every other layout becomes a backbone state dict for
  ``model.backbone.pretrained=DST`` (or a backbone ``init_cfg`` of type
  ``Pretrained``).

The backbone must be an InternViT (its patch embedding and attention
blocks are checked): another segmentor, e.g. a ResNet FCN's, is refused by
name. A SRC with a ``.sha256`` digest beside it (one this project wrote)
is checked against it first. DST is written whole or not at all (a
temporary name, then a rename), with its digest ``DST.sha256`` beside it;
it may be neither SRC nor an existing directory.

Prints the detected layout and the counts; a missing, unreadable or
foreign file is a one-line error and exit status 1, with nothing written.
"""
import argparse
import os
import os.path as osp
import sys

import torch

from mmcv_custom.integrity import (CheckpointDamagedError, atomic_write_stream,
                                   verify_file)
from mmcv_custom.models.backbones.intern_vit_checkpoint import (
    NotInternViTError, check_internvit, load_internvit_checkpoint)


def _check_destination(src: str, dst: str) -> None:
    """Refuse a DST that is SRC (same real path) or a directory, before
    anything is read or written."""
    if osp.realpath(dst) == osp.realpath(src):
        raise ValueError(
            f'DST {dst} is SRC itself: the converted checkpoint would '
            'replace the released one; give DST a name of its own, e.g. '
            f'{osp.splitext(dst)[0]}_mmseg.pth')
    if osp.isdir(dst):
        raise IsADirectoryError(
            f'DST {dst} is an existing directory; DST should be the path of '
            f'the .pth file to write, e.g. {osp.join(dst, "backbone.pth")}')


def convert(src: str, dst: str) -> str:
    """Convert ``src`` into ``dst``; returns the summary line."""
    _check_destination(src, dst)
    # A SRC of this project's (with a .sha256 beside it) is checked first;
    # released files have none, and need no word about it.
    found = verify_file(src)
    if found.status == 'damaged':
        raise CheckpointDamagedError(found.message)
    converted = load_internvit_checkpoint(src)
    try:
        check_internvit(converted, src)
    except NotInternViTError as e:
        raise NotInternViTError(f'{e}: nothing written') from None
    if converted.layout == 'segmentor':
        state = {f'backbone.{k}': v for k, v in converted.backbone.items()}
        state.update(converted.heads)
        use = f'load_from={dst!r}'
    else:
        state = dict(converted.backbone)
        use = f'model.backbone.pretrained={dst!r}'
    meta = dict(layout=converted.layout, source=osp.basename(src))
    folder = osp.dirname(osp.abspath(dst))
    os.makedirs(folder, exist_ok=True)
    atomic_write_stream(
        dst, lambda f: torch.save(dict(state_dict=state, meta=meta), f))
    return (f'{src}: {converted.summary()}\n'
            f'wrote {len(state)} tensors to {dst} (and its digest '
            f'{dst}.sha256); use it as {use}')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        'src',
        help='released checkpoint (.pth, .bin, '
        '.safetensors, *.index.json)')
    parser.add_argument('dst', help='output .pth')
    args = parser.parse_args(argv)
    try:
        print(convert(args.src, args.dst))
    except (OSError, EOFError, ValueError, RuntimeError) as e:
        # A missing file, an unknown layout (UnknownCheckpointLayoutError),
        # another backbone (NotInternViTError), an unsafe, damaged or
        # unreadable file, a DST that would overwrite SRC: one line, no
        # traceback.
        message = str(e).strip().splitlines() or [type(e).__name__]
        print(f'internvit2mmseg: error: {message[0]}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
