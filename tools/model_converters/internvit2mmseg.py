"""Convert a released InternViT checkpoint to what our configs load.

    python tools/model_converters/internvit2mmseg.py SRC DST --sha256 HEX

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
name.

SRC is verified first, because DST's digest will vouch for its bytes:
every file the conversion reads (SRC, or the shards an index names and the
conversion reads) must match the SHA-256 its publisher lists, given with
``--sha256 HEX`` (once per shard of an index), or a ``.sha256`` beside it
(``sha256sum``'s format: one this project wrote, or one you made right
after the download). Released weights carry no ``.sha256`` of ours, so
without either the conversion is refused, unless ``--unverified`` accepts
a SRC that cannot be verified: DST is then written without a digest (it
loads as any external file does, said once), never with one that would
vouch for bytes nobody checked. DST is written whole or not at all (a
temporary name, then a rename); it may be neither SRC nor an existing
directory.

The conversion is ``mmcv_custom.models.backbones.intern_vit_conversion``'s
(``convert``, ``verify_source``); this script is its command line.

Prints the detected layout, the counts and how SRC was verified. Exit
status 2, with one line and nothing written: a bad command line, or a SRC
refused (missing, unreadable, damaged, unverified, not an InternViT);
1: writing DST failed (a full disk), nothing left behind.
"""
import argparse
import os.path as osp
import re
import sys

from mmcv_custom.analysis import convert_file
from mmcv_custom.models.backbones.intern_vit_conversion import (
    prepare_conversion, write_conversion)

__all__ = ['main']

PROG = osp.basename(__file__)  # as argparse names it, for every error
_HEX = re.compile(r'[0-9a-fA-F]{64}')


def _sha256(text: str) -> str:
    """An argparse type: a SHA-256 as 64 hex digits, lower case."""
    if not _HEX.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(
            f'{text!r} is not a SHA-256: give the 64 hex digits that '
            'sha256sum prints and Hugging Face lists for each file')
    return text.strip().lower()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        'src',
        help='released checkpoint (.pth, .bin, '
        '.safetensors, *.index.json)')
    parser.add_argument('dst', help='output .pth')
    parser.add_argument(
        '--sha256',
        type=_sha256,
        action='append',
        default=[],
        metavar='HEX',
        help="the SHA-256 SRC's publisher lists (Hugging Face: on the "
        "file's page); for an *.index.json, once per shard")
    parser.add_argument(
        '--unverified',
        action='store_true',
        help='convert a SRC that has no digest to verify it against; DST '
        'is then written without a digest')
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.unverified and args.sha256:
        parser.error('--sha256 verifies SRC and --unverified converts it '
                     'unverified: give one of them')
    # Refused (exit 2): an unknown layout (UnknownCheckpointLayoutError),
    # another backbone (NotInternViTError), an unsafe, damaged or
    # unverified file; a write that fails (exit 1) leaves DST untouched.
    return convert_file(
        PROG, args.dst, lambda: prepare_conversion(args.src, args.dst, args.
                                                   sha256, args.unverified),
        lambda converted: write_conversion(args.src, args.dst, converted))


if __name__ == '__main__':
    sys.exit(main())
