"""Which checkpoint a run loads or resumes from, checked before any work.

``load_from`` and ``--resume`` name a checkpoint, or leave the choice to
``<work_dir>/last_checkpoint``; either can point at a file that is missing,
damaged, unsafe or, for a work dir that was moved or copied, another run's.
:func:`check_checkpoint_file` refuses such a file before the process group
starts, naming the newest intact checkpoint beside it, and
:func:`find_resume_checkpoint` picks what ``--resume`` continues from, saying
why when it is not what ``last_checkpoint`` names.

This module builds on both :mod:`~mmcv_custom.integrity.checkpoint` (safe
loading) and :mod:`~mmcv_custom.integrity.sharded_checkpoint` (sharded
directories), since a run may load either kind; neither imports it.
"""
import os
import os.path as osp
from typing import List, NamedTuple, Optional, Tuple

import torch

from .checkpoint import (DCP_METADATA_FILE, SHARDED_META_FILE,
                         UnsafeCheckpointError, check_checkpoint,
                         is_sharded_checkpoint, readable_checkpoint)
from .files import checkpoint_candidates, require_intact, verify_file
from .sharded_checkpoint import (newest_intact_checkpoint,
                                 verify_sharded_checkpoint)

__all__ = [
    'check_checkpoint_file', 'resolve_resume_checkpoint', 'checkpoint_folder',
    'newest_intact', 'unusable_reason', 'ResumeChoice',
    'find_resume_checkpoint', 'choose_resume_checkpoint', 'recorded_outside',
    'outside_note', 'RUN_KEY', 'run_of', 'foreign_checkpoint'
]

#: The key of a checkpoint's ``meta`` that says which run saved it
#: (:class:`mmcv_custom.engine.run_identity.RunIdentityHook`).
RUN_KEY = 'run'


def check_checkpoint_file(path: str, source: str) -> None:
    """Fail before any work starts if a checkpoint the run will load is
    missing, or holds what torch's safe loader would refuse.

    Args:
        path (str): A local file or sharded checkpoint directory. A URL
            or another ``scheme://`` name that MMEngine fetches itself is
            not checked here (torch's safe loader still refuses unsafe
            contents when it is loaded).
        source (str): Where ``path`` came from, for the message, e.g.
            ``'load_from'``.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        UnsafeCheckpointError: ``path`` holds objects off the allow-list
            (see :func:`check_checkpoint`).
    """
    if '://' in path:
        return
    if is_sharded_checkpoint(path):
        # The tensors are DCP shards (read by the strategy's safe planner);
        # meta.pth is an ordinary torch file.
        path = osp.join(path, SHARDED_META_FILE)
    if not osp.isfile(path):
        if osp.isdir(path):
            what = ('a directory, not a checkpoint file nor a complete '
                    f'sharded checkpoint (which holds {DCP_METADATA_FILE} and '
                    f'{SHARDED_META_FILE})')
        else:
            what = 'no such file'
        raise FileNotFoundError(
            f'{source}={path!r}: {what} (relative paths are from the '
            f'current directory, {os.getcwd()})')
    require_intact(path, lambda: newest_intact(path))
    try:
        check_checkpoint(path)
    except RuntimeError as e:
        if isinstance(e, UnsafeCheckpointError):
            raise
        # torch's reader on a truncated or overwritten file.
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(
            f'{source}={path!r} is not a readable torch checkpoint: it is '
            f'damaged or truncated ({first})') from None


def resolve_resume_checkpoint(
        work_dir: str,
        load_from: Optional[str] = None,
        folder: Optional[str] = None) -> Tuple[Optional[str], Optional[str]]:
    """The checkpoint ``--resume`` should continue from, and why if moved.

    MMEngine resumes from ``load_from`` or, without it, from the absolute
    path its CheckpointHook wrote into ``<work_dir>/last_checkpoint``. A
    work dir that was moved or copied still names the original location
    there: a moved one fails to load, and a copied one silently continues
    the *original* run. A checkpoint of that name inside the run's
    checkpoint folder is what the user means, so it wins when the recorded
    one lies elsewhere; without one, the recorded file is another run's and
    is not taken (``None``, with a note saying how to name it).

    Args:
        work_dir (str): The run's work dir (holds ``last_checkpoint``).
        load_from (str, optional): Returned as it is when given.
        folder (str, optional): Where the run's checkpoints are: the work
            dir, unless the CheckpointHook has an ``out_dir`` (see
            :func:`checkpoint_folder`). Defaults to ``work_dir``.

    Returns:
        tuple: ``(path or None, note or None)``; the note says what was
        changed and why, for the log.
    """
    if load_from:
        return load_from, None
    folder = folder or work_dir
    recorded_file = osp.join(work_dir, 'last_checkpoint')
    if not osp.isfile(recorded_file):
        return None, None
    with open(recorded_file) as f:
        recorded = f.read().strip()
    if not recorded:
        return None, None
    local = osp.join(folder, osp.basename(recorded))
    same_dir = osp.abspath(osp.dirname(recorded)) == osp.abspath(folder)
    if same_dir or '://' in recorded:
        return recorded, None
    if not osp.exists(local):
        # Another run's checkpoint (a work dir copied without its newest
        # file, or a last_checkpoint copied in): never continued unnamed.
        return None, outside_note(recorded_file, recorded, folder)
    how = ('was moved' if not osp.exists(recorded) else
           'is a copy of another run (which is left alone)')
    return local, (f'{recorded_file} names {recorded}, outside this work dir; '
                   f'the work dir {how}, so resuming from {local}.')


def recorded_outside(work_dir: str, folder: str) -> Optional[str]:
    """The checkpoint ``<work_dir>/last_checkpoint`` names when it lies
    outside ``folder`` with no checkpoint of its name there; else None."""
    path, note = resolve_resume_checkpoint(work_dir, folder=folder)
    if path is not None or note is None:
        return None
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        return f.read().strip()


def outside_note(recorded_file: str, recorded: str, folder: str) -> str:
    """What is said of a ``last_checkpoint`` that names another run's
    checkpoint: it is not resumed without being named."""
    return (f'{recorded_file} names {recorded}, outside this run\'s '
            f'checkpoint folder {folder}, which has no '
            f'{osp.basename(recorded)}: that is another run\'s checkpoint '
            '(or this work dir was moved without it), and it is not '
            f'continued unless named: --resume {recorded}')


def checkpoint_folder(cfg) -> str:
    """Where ``cfg``'s run writes its checkpoints: MMEngine's
    CheckpointHook writes into ``<out_dir>/<last folder of work_dir>``
    when ``default_hooks.checkpoint.out_dir`` is set, else into the work
    dir (``last_checkpoint`` stays in the work dir either way)."""
    work_dir = cfg.get('work_dir')
    hook = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    out_dir = hook.get('out_dir') if isinstance(hook, dict) else None
    if not out_dir or '://' in str(out_dir):
        return work_dir
    return osp.join(str(out_dir), osp.basename(osp.abspath(work_dir)))


def newest_intact(path: str) -> Optional[str]:
    """The newest checkpoint beside ``path`` (not ``path`` itself) that
    passes its digest (a sharded directory: its ``SHA256SUMS``); None if
    there is none."""
    return newest_intact_checkpoint(path)


def unusable_reason(path: str) -> Optional[str]:
    """Why ``path`` cannot be resumed from (missing, damaged, without the
    digest its siblings have, unreadable); None if it can."""
    if not osp.exists(path):
        return f'{path}: no such file'
    if osp.isdir(path):
        if not is_sharded_checkpoint(path):
            return f'{path} is an incomplete sharded checkpoint'
        result = verify_sharded_checkpoint(path)
        return None if result.usable else result.message
    result = verify_file(path)
    if not result.usable:
        return result.message
    if not readable_checkpoint(path):
        return f'{path} is not a readable torch checkpoint (truncated?)'
    return None


class ResumeChoice(NamedTuple):
    """What :func:`find_resume_checkpoint` found.

    Attributes:
        path (str, optional): The checkpoint to resume from; None when
            there is none to take.
        notes (list[str]): Warnings that explain the choice.
        refused (list[tuple[str, str]]): ``(checkpoint, why)`` of each
            checkpoint of the folder that cannot be resumed from, newest
            first; when every one is refused, ``path`` is None and these
            say why.
    """
    path: Optional[str]
    notes: List[str]
    refused: List[Tuple[str, str]]


def find_resume_checkpoint(work_dir: str,
                           folder: Optional[str] = None) -> ResumeChoice:
    """What ``--resume`` continues from, and why.

    MMEngine's own choice is what ``<work_dir>/last_checkpoint`` names
    (:func:`resolve_resume_checkpoint` corrects it for moved and copied
    work dirs). When that file is missing or empty, or names a checkpoint
    that is missing, fails its digest or cannot be read, the newest intact
    ``iter_N.pth``/``epoch_N.pth`` in ``folder`` is taken instead, and a
    note says so. Every rank reads the same files and decides alike.

    Args:
        work_dir (str): The run's work dir.
        folder (str, optional): Its checkpoint folder
            (:func:`checkpoint_folder`). Defaults to ``work_dir``.
    """
    folder = folder or work_dir
    notes: List[str] = []
    refused: List[Tuple[str, str]] = []
    recorded_file = osp.join(work_dir, 'last_checkpoint')
    path, moved = resolve_resume_checkpoint(work_dir, folder=folder)
    if moved:
        notes.append(moved)
    if path is None and moved is None and osp.isfile(recorded_file):
        notes.append(f'{recorded_file} is empty (a save interrupted while '
                     'writing it?)')
    elif path is not None and '://' not in path:
        why = unusable_reason(path)
        if why is None:
            return ResumeChoice(path, notes, refused)
        refused.append((path, why))
        notes.append(f'the latest checkpoint cannot be resumed from: {why}')
    elif path is not None:
        return ResumeChoice(path, notes, refused)
    seen = {osp.abspath(path)} if path else set()
    for candidate in checkpoint_candidates(folder):
        if osp.abspath(candidate) in seen:
            continue
        why = unusable_reason(candidate)
        if why is None:
            notes.append(f'resuming from {candidate}, the newest intact '
                         'checkpoint in the work dir')
            return ResumeChoice(candidate, notes, refused)
        refused.append((candidate, why))
    if refused:
        notes.append(f'no intact checkpoint in {folder}')
    else:
        notes.append(f'no checkpoint in {folder}: starting at iteration 0')
    return ResumeChoice(None, notes, refused)


def choose_resume_checkpoint(
        work_dir: str,
        folder: Optional[str] = None) -> Tuple[Optional[str], List[str]]:
    """:func:`find_resume_checkpoint` as ``(path or None, notes)``."""
    choice = find_resume_checkpoint(work_dir, folder)
    return choice.path, choice.notes


def run_of(path: str) -> Optional[dict]:
    """The identity of the run that saved ``path`` (``meta['run']``), read
    without loading its tensors (memory-mapped); None for a checkpoint
    saved without one or that cannot be read."""
    if is_sharded_checkpoint(path):
        path = osp.join(path, SHARDED_META_FILE)
    try:
        checkpoint = torch.load(
            path, map_location='cpu', weights_only=True, mmap=True)
    except Exception:
        return None
    meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
    found = meta.get(RUN_KEY) if isinstance(meta, dict) else None
    if isinstance(found, dict) and isinstance(found.get('id'), str):
        return found
    return None


def _described(run: dict) -> str:
    return (f"run {run['id'][:8]} (seed {run.get('seed')}, config "
            f"{run.get('config')}, started {run.get('started')})")


def foreign_checkpoint(chosen: str, saved: List[str]) -> Optional[str]:
    """Why ``chosen`` belongs to another run than the other checkpoints in
    ``saved`` (its folder's, newest first), or None.

    None also where nothing can tell: ``chosen`` or every other checkpoint
    saved without an identity, or ``chosen`` alone in its folder (a copied
    work dir continues the copy).
    """
    mine = run_of(chosen)
    if mine is None:
        return None
    other = None
    for path in saved:
        if osp.abspath(path) == osp.abspath(chosen):
            continue
        run = run_of(path)
        if run is None:
            continue
        if run['id'] == mine['id']:
            return None
        other = other or (path, run)
    if other is None:
        return None
    path, run = other
    return (f'{chosen} belongs to another run than the other checkpoints in '
            f'{osp.dirname(osp.abspath(chosen))}: it was saved by '
            f'{_described(mine)}, {osp.basename(path)} by {_described(run)}')
