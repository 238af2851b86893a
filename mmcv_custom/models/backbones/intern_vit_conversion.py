"""Convert a released InternViT checkpoint into a file our configs load,
verifying first what it reads: the library behind
``tools/model_converters/internvit2mmseg.py``, whose docstring and
``docs/en/user_guides/intern_vit.md`` say what is written and how SRC is
verified.

The reading and the renaming of the released layouts are
:mod:`~mmcv_custom.models.backbones.intern_vit_checkpoint`'s (shared with
``InternViT(pretrained=...)``); this module adds what only a conversion
needs: checking that every file it reads is the one its publisher
released (DST's digest will vouch for those bytes), and writing DST whole
or not at all. Everything that may refuse the conversion happens in
:func:`prepare_conversion`, before anything is written.
"""
import json
import os
import os.path as osp
from typing import List, NamedTuple, Sequence

import torch

from ...integrity import (CheckpointDamagedError, atomic_write_stream,
                          digest_path, file_sha256, verify_file)
from .intern_vit_checkpoint import (NotInternViTError, check_internvit,
                                    load_internvit_checkpoint)

__all__ = [
    'UnverifiedSourceError', 'PreparedConversion', 'verify_source',
    'prepare_conversion', 'write_conversion', 'convert'
]

_INDEX = '.index.json'


class UnverifiedSourceError(ValueError):
    """SRC has nothing to verify it against and ``--unverified`` was not
    given."""


class PreparedConversion(NamedTuple):
    """What :func:`prepare_conversion` read, ready to be written by
    :func:`write_conversion`."""
    state: dict
    meta: dict
    use: str
    summary: str
    verified: str  # how SRC was verified; '' if it was not


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


def _shards_read(index: str) -> List[str]:
    """The shard files the conversion reads from a Hugging Face index:
    those holding ``vision_model.*`` tensors if any do, else all of them
    (what ``intern_vit_checkpoint``'s reader takes; from a chat model the
    language model's shards are never read, so never hashed)."""
    try:
        with open(index) as f:
            content = json.load(f)
    except ValueError as e:
        raise ValueError(f'{index} is not a readable index (JSON): '
                         f'{e}') from None
    weight_map = content.get('weight_map') if isinstance(content,
                                                         dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f'{index} should map tensor names to shard files '
                         "under 'weight_map', but does not")
    wanted = [k for k in weight_map if k.startswith('vision_model.')]
    folder = osp.dirname(index)
    return [
        osp.join(folder, name)
        for name in sorted({weight_map[k]
                            for k in wanted or weight_map})
    ]


def _not_published(file: str, actual: str, published: Sequence[str],
                   shard: bool) -> str:
    given = ', '.join(f'{h[:16]}...' for h in sorted(published))
    if shard:
        return (f'{file} matches none of the SHA-256 given: its SHA-256 is '
                f'{actual[:16]}..., --sha256 gave {given} (a bad download or '
                'copy, or its own --sha256 is missing)')
    return (f'{file} is not the file whose SHA-256 you gave: its SHA-256 is '
            f'{actual[:16]}..., --sha256 gave {given} (a bad download or '
            'copy, or the digest of another file)')


def _unverified_message(src: str, missing: List[str]) -> str:
    if missing == [src]:
        return (f'{src} has no digest to verify it against: give the '
                'SHA-256 its publisher lists (--sha256 HEX; Hugging Face '
                "shows it on the file's page), or put a "
                f'{osp.basename(src)}.sha256 beside it (sha256sum\'s '
                'format), or convert it unverified (--unverified: DST then '
                'gets no digest)')
    names = ', '.join(osp.basename(f) for f in missing[:3])
    more = f' and {len(missing) - 3} more' if len(missing) > 3 else ''
    return (f'{src}: {len(missing)} of the shards it reads have no digest '
            f'to verify them against ({names}{more}): give the SHA-256 its '
            'publisher lists for each (--sha256 HEX once per shard; Hugging '
            "Face shows it on each file's page), or put SHARD.sha256 beside "
            "each (sha256sum's format), or convert it unverified "
            '(--unverified: DST then gets no digest)')


def _own_digest(file: str) -> bool:
    """Whether ``file`` has a ``.sha256`` of its own, which it matches.

    Only its own: whether a folder keeps digests is for loading to judge
    (a file without one where its neighbours have one is refused there),
    and a ``--sha256`` that matches verifies a file as well as one.

    Raises:
        CheckpointDamagedError: ``file`` differs from its ``.sha256``.
    """
    if not osp.isfile(digest_path(file)):
        return False
    found = verify_file(file)
    if found.status != 'ok':
        raise CheckpointDamagedError(found.message)
    return True


def verify_source(src: str,
                  sha256: Sequence[str] = (),
                  unverified: bool = False) -> str:
    """Check every file that converting ``src`` reads; says how they were
    verified, or '' when ``unverified`` let an unverifiable one pass.

    A ``.sha256`` beside a file is always checked; a file with none must
    match one of ``sha256``. An index itself needs no digest (Hugging
    Face lists none for it, and a damaged one names shards or tensors
    that are not there, which the reader refuses); its shards do.

    Raises:
        CheckpointDamagedError: A file differs from its ``.sha256`` or
            from every ``sha256`` given.
        UnverifiedSourceError: A file has nothing to verify it against,
            and ``unverified`` is False.
        ValueError: ``sha256`` holds more than one digest for one file.
    """
    index = src.endswith(_INDEX)
    if len(sha256) > 1 and not index:
        raise ValueError(f'--sha256 given {len(sha256)} times, but {src} is '
                         'one file: give its one SHA-256')
    if not osp.isfile(src):
        return ''  # missing or a directory: the reader says which
    if index:
        _own_digest(src)  # needs no digest (see above); one it has must match
    files = _shards_read(src) if index else [src]
    published = set(sha256)
    missing = []
    for file in files:
        if not osp.isfile(file):
            continue  # the reader names it
        own = _own_digest(file)
        if published:
            actual = file_sha256(file)
            if actual not in published:
                raise CheckpointDamagedError(
                    _not_published(file, actual, published, index))
        elif not own:
            missing.append(file)
    if missing:
        if not unverified:
            raise UnverifiedSourceError(_unverified_message(src, missing))
        return ''
    against = '--sha256' if published else (
        osp.basename(digest_path(src)) if not index else 'their .sha256 files')
    if index:
        return f'the SHA-256 of its {len(files)} shards read match {against}'
    return f'its SHA-256 matches {against}'


def prepare_conversion(src: str,
                       dst: str,
                       sha256: Sequence[str] = (),
                       unverified: bool = False) -> PreparedConversion:
    """Check DST, verify and read SRC: everything that may refuse the
    command, before anything is written."""
    _check_destination(src, dst)
    verified = verify_source(src, sha256, unverified)
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
    return PreparedConversion(state, meta, use, converted.summary(), verified)


def write_conversion(src: str, dst: str, converted: PreparedConversion) -> str:
    """Write DST (with a digest only when SRC was verified); returns the
    summary."""
    folder = osp.dirname(osp.abspath(dst))
    os.makedirs(folder, exist_ok=True)
    checkpoint = dict(state_dict=converted.state, meta=converted.meta)
    verified = bool(converted.verified)
    # (Unverified: no digest, and an older conversion's is removed.)
    atomic_write_stream(
        dst, lambda f: torch.save(checkpoint, f), digest=verified)
    count = len(converted.state)
    if verified:
        return (f'{src}: {converted.summary}\n'
                f'{src}: {converted.verified}\n'
                f'wrote {count} tensors to {dst} (and its digest '
                f'{dst}.sha256); use it as {converted.use}')
    return (f'{src}: {converted.summary}\n'
            f'{src}: not verified (--unverified)\n'
            f'wrote {count} tensors to {dst} without a digest: nothing '
            f'vouches for its source; use it as {converted.use}')


def convert(src: str,
            dst: str,
            sha256: Sequence[str] = (),
            unverified: bool = False) -> str:
    """Convert ``src`` into ``dst``; returns the summary.

    Raises:
        UnverifiedSourceError: See :func:`verify_source`; also its other
            errors, and the reader's (a missing, unreadable or foreign
            file), before anything is written.
        OSError: Writing ``dst`` failed; nothing is left behind.
    """
    return write_conversion(src, dst,
                            prepare_conversion(src, dst, sha256, unverified))
