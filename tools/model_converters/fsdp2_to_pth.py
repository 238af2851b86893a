"""Consolidate a sharded (FSDP2Strategy) checkpoint into one ordinary file.

    python tools/model_converters/fsdp2_to_pth.py SRC_DIR DST

SRC_DIR is a checkpoint directory written by ``FSDP2Strategy`` (e.g.
``work_dirs/<config>/iter_200.pth/``), by any number of ranks, under full
or hybrid sharding (the summary says which). DST gets the
model's full weights and the run's meta in MMEngine's single-file format
(``{'meta': ..., 'state_dict': ...}``), what ``load_from``, DDP configs
and ``tools/test.py`` take. The optimizer state is left out: resume reads
the directory itself. Runs in one process, without a process group; the
non-tensor contents are read with torch's safe loader.

SRC_DIR is checked against its ``SHA256SUMS`` first: a missing, truncated
or altered shard is named, with the newest intact checkpoint beside it.
A SRC_DIR without ``SHA256SUMS`` (written before sharded checkpoints had
digests, or copied without it) cannot be verified: it is refused unless
``--unverified`` is given, and then DST is written without a digest, so
that no digest vouches for bytes nobody checked (its missing or truncated
shards are still found, from the sizes DCP's ``.metadata`` records). DST
is written whole or not at all (a temporary name, then a rename), with its
digest ``DST.sha256`` beside it when SRC_DIR was verified; DST may be
neither SRC_DIR nor inside it, nor an existing directory.

Exit status 2, with one line and nothing written: a bad command line, or
a SRC_DIR refused (missing, not a sharded checkpoint, damaged, unverified,
unsafe); 1: writing DST failed (a full disk), nothing left behind.

``tools/test.py`` also takes SRC_DIR directly.
"""
import argparse
import os
import os.path as osp
import sys

import torch

from mmcv_custom.analysis import convert_file
from mmcv_custom.engine.fsdp2_mesh import describe_sharding
from mmcv_custom.integrity import CheckpointDamagedError, atomic_write_stream
from mmcv_custom.integrity.sharded_checkpoint import (
    MANIFEST_FILE, consolidate_sharded_checkpoint, damaged_message,
    verify_sharded_checkpoint)

__all__ = ['convert', 'UnverifiedSourceError', 'main']

PROG = osp.basename(__file__)  # as argparse names it, for every error


class UnverifiedSourceError(ValueError):
    """SRC_DIR has no ``SHA256SUMS`` and ``--unverified`` was not given."""


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


def _verifiable(src: str, unverified: bool) -> bool:
    """Whether ``src`` has a ``SHA256SUMS`` (checked, shard by shard, by
    the consolidation); without one, its shards' presence and sizes are
    checked here (no shard is hashed: there is nothing to compare with),
    and it is refused unless ``unverified``.

    Raises:
        CheckpointDamagedError: A shard that ``.metadata`` names is
            missing or truncated.
        UnverifiedSourceError: No ``SHA256SUMS``, and not ``unverified``.
    """
    if not osp.isdir(src) or osp.exists(osp.join(src, MANIFEST_FILE)):
        return True  # the consolidation names what is wrong, if anything
    found = verify_sharded_checkpoint(src)
    if found.status == 'damaged':
        raise CheckpointDamagedError(damaged_message(found, src))
    if found.status != 'no_digest':
        return True  # 'missing': not a sharded checkpoint, said later
    if not unverified:
        raise UnverifiedSourceError(
            f'{src} has no {MANIFEST_FILE} (written before sharded '
            'checkpoints had digests, or copied without it), so its shards '
            f'cannot be verified: copy {MANIFEST_FILE} from where it was '
            'written, or consolidate it unverified (--unverified: DST then '
            'gets no digest)')
    return False


def _prepare(src: str, dst: str, unverified: bool = False):
    """Check DST, verify and read SRC: everything that may refuse the
    command, before anything is written. ``(checkpoint, verified)``."""
    _check_destination(src, dst)
    verified = _verifiable(src, unverified)
    return consolidate_sharded_checkpoint(src), verified


def _write(src: str, dst: str, checkpoint: dict, verified: bool) -> str:
    """Write DST (with a digest only when SRC was verified); returns the
    summary."""
    state = checkpoint['state_dict']
    folder = osp.dirname(osp.abspath(dst))
    os.makedirs(folder, exist_ok=True)
    # (Unverified: no digest, and an older conversion's is removed.)
    # Whole or not at all, with its digest: the bytes are hashed on their
    # way to the disk, never held in memory.
    atomic_write_stream(
        dst, lambda f: torch.save(checkpoint, f), digest=verified)
    numel = sum(v.numel() for v in state.values())
    sharded = checkpoint['meta'].get('sharded') or {}
    saved_by = sharded.get('world_size', '?')
    wrote = (f'wrote {dst} (and its digest {dst}.sha256)' if verified else
             f'wrote {dst} without a digest: {src} has no {MANIFEST_FILE}, '
             'so nothing vouches for its shards (--unverified)')
    return (f'{src}: {len(state)} tensors, {numel:,} numbers, saved by '
            f'{saved_by} ranks at iteration {checkpoint["meta"].get("iter")}'
            f' ({describe_sharding(sharded)})\n{wrote}; use it as '
            f'load_from={dst!r}')


def convert(src: str, dst: str, unverified: bool = False) -> str:
    """Consolidate ``src`` into ``dst``; returns the summary.

    Raises:
        UnverifiedSourceError: ``src`` has no ``SHA256SUMS`` and
            ``unverified`` is False; also ``CheckpointDamagedError`` and
            the reader's errors, before anything is written.
        OSError: Writing ``dst`` failed; nothing is left behind.
    """
    checkpoint, verified = _prepare(src, dst, unverified)
    return _write(src, dst, checkpoint, verified)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument('src', help='sharded checkpoint directory')
    parser.add_argument('dst', help='output .pth')
    parser.add_argument(
        '--unverified',
        action='store_true',
        help=f'consolidate a SRC without {MANIFEST_FILE} (its shards cannot '
        'be verified); DST is then written without a digest')
    args = parser.parse_args(argv)
    # Refused (exit 2): not a sharded checkpoint, damaged, unverified,
    # unsafe; a write that fails (exit 1) leaves DST untouched.
    return convert_file(PROG, args.dst,
                        lambda: _prepare(args.src, args.dst, args.unverified),
                        lambda prepared: _write(args.src, args.dst, *prepared))


if __name__ == '__main__':
    sys.exit(main())
