"""Consolidate a sharded (FSDP2Strategy) checkpoint into one ordinary file.

    python tools/model_converters/fsdp2_to_pth.py SRC_DIR DST

SRC_DIR is a checkpoint directory written by ``FSDP2Strategy`` (e.g.
``work_dirs/<config>/iter_200.pth/``), by any number of ranks. DST gets the
model's full weights and the run's meta in MMEngine's single-file format
(``{'meta': ..., 'state_dict': ...}``), what ``load_from``, DDP configs
and ``tools/test.py`` take. The optimizer state is left out: resume reads
the directory itself. Runs in one process, without a process group; the
non-tensor contents are read with torch's safe loader.

SRC_DIR is checked against its ``SHA256SUMS`` first: a missing, truncated
or altered shard is named, with the newest intact checkpoint beside it.
DST is written whole or not at all (a temporary name, then a rename), with
its digest ``DST.sha256`` beside it; DST may be neither SRC_DIR nor inside
it, nor an existing directory.

``tools/test.py`` also takes SRC_DIR directly.
"""
import argparse
import os
import os.path as osp
import sys

import torch

from mmcv_custom.integrity import atomic_write_stream
from mmcv_custom.sharded_checkpoint import consolidate_sharded_checkpoint


def _check_destination(src: str, dst: str) -> None:
    """Refuse a DST that would overwrite or land inside SRC, or that is a
    directory, before anything is read or written."""
    real_src, real_dst = osp.realpath(src), osp.realpath(dst)
    if real_dst == real_src:
        raise ValueError(
            f'DST {dst} is SRC itself: writing it would replace the sharded '
            'checkpoint; give DST a name of its own, e.g. '
            f'{osp.splitext(dst.rstrip(os.sep))[0]}_consolidated.pth')
    if real_dst.startswith(real_src.rstrip(os.sep) + os.sep):
        raise ValueError(
            f'DST {dst} is inside SRC {src}: it would become part of the '
            'sharded checkpoint; write it beside SRC instead')
    if osp.isdir(dst):
        raise IsADirectoryError(
            f'DST {dst} is an existing directory; DST should be the path of '
            'the .pth file to write, e.g. '
            f'{osp.join(dst, "model.pth")}')


def convert(src: str, dst: str) -> str:
    """Consolidate ``src`` into ``dst``; returns the summary line."""
    _check_destination(src, dst)
    checkpoint = consolidate_sharded_checkpoint(src)
    state = checkpoint['state_dict']
    folder = osp.dirname(osp.abspath(dst))
    os.makedirs(folder, exist_ok=True)
    # Whole or not at all, with its digest: the bytes are hashed on their
    # way to the disk, never held in memory.
    atomic_write_stream(dst, lambda f: torch.save(checkpoint, f))
    numel = sum(v.numel() for v in state.values())
    saved_by = checkpoint['meta'].get('sharded', {}).get('world_size', '?')
    return (f'{src}: {len(state)} tensors, {numel:,} numbers, saved by '
            f'{saved_by} ranks at iteration {checkpoint["meta"].get("iter")}'
            f'\nwrote {dst} (and its digest {dst}.sha256); use it as '
            f'load_from={dst!r}')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('src', help='sharded checkpoint directory')
    parser.add_argument('dst', help='output .pth')
    args = parser.parse_args(argv)
    try:
        print(convert(args.src, args.dst))
    except (OSError, EOFError, ValueError, RuntimeError) as e:
        message = str(e).strip().splitlines() or [type(e).__name__]
        print(f'fsdp2_to_pth: error: {message[0]}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
