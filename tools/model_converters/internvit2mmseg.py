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

Prints the detected layout and the counts; a missing file or an unknown
layout is a one-line error and exit status 1.
"""
import argparse
import os
import os.path as osp
import sys

import torch

sys.path.insert(0,
                osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))
from mmcv_custom.models.backbones.intern_vit_checkpoint import (  # noqa: E402
    load_internvit_checkpoint)


def convert(src: str, dst: str) -> str:
    """Convert ``src`` into ``dst``; returns the summary line."""
    converted = load_internvit_checkpoint(src)
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
    torch.save(dict(state_dict=state, meta=meta), dst)
    return (f'{src}: {converted.summary()}\n'
            f'wrote {len(state)} tensors to {dst}; use it as {use}')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('src',
                        help='released checkpoint (.pth, .bin, '
                        '.safetensors, *.index.json)')
    parser.add_argument('dst', help='output .pth')
    args = parser.parse_args(argv)
    try:
        print(convert(args.src, args.dst))
    except (OSError, EOFError, ValueError, RuntimeError) as e:
        # A missing file, an unknown layout (UnknownCheckpointLayoutError),
        # an unsafe or unreadable file: one line, no traceback.
        message = str(e).strip().splitlines() or [type(e).__name__]
        print(f'internvit2mmseg: error: {message[0]}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
