"""Let torch's safe loader read MMEngine checkpoints, and nothing more.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``: it only
rebuilds tensors, containers and globals on an allow-list. MMEngine 0.10.7
calls ``torch.load`` without ``weights_only``, and its checkpoints also hold
the message hub's ``HistoryBuffer`` objects, numpy arrays and dtypes, so
``--resume`` fails with "Weights only load failed". Turning safe loading off
would let any checkpoint run code on load. Instead,
:func:`allow_mmengine_checkpoints` (run on ``import mmcv_custom``) adds
exactly the globals MMEngine's own checkpoints need to torch's allow-list;
anything else in a file is still refused, and :func:`check_checkpoint` names
it before a run starts. The per-rank communication-hook state files load the
same way (:func:`load_checkpoint_file`).

``builtins.getattr`` is on the list because MMEngine pickles the statistics
methods of ``HistoryBuffer`` as ``getattr(HistoryBuffer, 'min')``. The safe
loader still only *calls* allow-listed functions, so an attribute fetched
this way cannot be executed.
"""
import builtins
import logging
import os
import os.path as osp
import pickle
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

from .integrity import checkpoint_candidates, require_intact, verify_file

__all__ = [
    'SAFE_CHECKPOINT_GLOBALS', 'allow_mmengine_checkpoints',
    'check_checkpoint', 'check_checkpoint_file', 'load_checkpoint_file',
    'resolve_resume_checkpoint', 'is_sharded_checkpoint', 'SHARDED_META_FILE',
    'UnsafeCheckpointError', 'readable_checkpoint', 'newest_intact',
    'choose_resume_checkpoint', 'say_unverified_once', 'checkpoint_folder',
    'unusable_reason', 'ResumeChoice', 'find_resume_checkpoint'
]


def _numpy_globals() -> List:
    reconstruct = np._core.multiarray._reconstruct if hasattr(
        np, '_core') else np.core.multiarray._reconstruct
    scalar = np._core.multiarray.scalar if hasattr(
        np, '_core') else np.core.multiarray.scalar
    found = [np.ndarray, np.dtype, reconstruct, scalar]
    # numpy >= 1.25 gives every dtype a class of its own (Float64DType...).
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:
        found += [
            getattr(dtypes, n) for n in dir(dtypes) if n.endswith('DType')
        ]
    return found


def _name(obj) -> str:
    return f'{obj.__module__}.{obj.__qualname__}'


#: Name -> object of every global an MMEngine checkpoint may contain.
SAFE_CHECKPOINT_GLOBALS: Dict[str, object] = {
    _name(obj): obj
    for obj in [HistoryBuffer, builtins.getattr, *_numpy_globals()]
}

#: The file of a sharded (FSDP2Strategy) checkpoint directory that holds
#: everything but the tensors: meta, message hub, schedulers.
SHARDED_META_FILE = 'meta.pth'
# What torch.distributed.checkpoint writes last, once every rank's shards
# are on disk.
_DCP_METADATA = '.metadata'


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory of
    :class:`~mmcv_custom.engine.FSDP2Strategy` (DCP shards and
    ``meta.pth``)."""
    return (osp.isdir(path) and osp.isfile(osp.join(path, _DCP_METADATA))
            and osp.isfile(osp.join(path, SHARDED_META_FILE)))


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint holds objects outside :data:`SAFE_CHECKPOINT_GLOBALS`."""


def allow_mmengine_checkpoints() -> None:
    """Add :data:`SAFE_CHECKPOINT_GLOBALS` to torch's safe-loading list.

    Idempotent. Does nothing on a torch without ``add_safe_globals`` (older
    than 2.4), which loads everything anyway.
    """
    add = getattr(torch.serialization, 'add_safe_globals', None)
    if add is not None:
        add(list(SAFE_CHECKPOINT_GLOBALS.values()))


def check_checkpoint(path: str) -> None:
    """Raise :class:`UnsafeCheckpointError` if ``path`` holds anything a
    safe load would refuse, naming it; nothing in the file is executed.

    Args:
        path (str): A checkpoint written by ``torch.save``.
    """
    scan = getattr(torch.serialization, 'get_unsafe_globals_in_checkpoint',
                   None)
    if scan is None:
        return
    allowed = set(SAFE_CHECKPOINT_GLOBALS) | {
        _name(g) if not isinstance(g, tuple) else g[1]
        for g in torch.serialization.get_safe_globals()
    }
    unsafe = sorted(set(scan(path)) - allowed)
    if unsafe:
        raise UnsafeCheckpointError(
            f'Refusing to load {path}: it contains {", ".join(unsafe)}, '
            'which is not on the allow-list of safe checkpoint contents '
            '(tensors, containers, MMEngine HistoryBuffer, numpy arrays and '
            'dtypes). If you trust this file, add those globals with '
            'torch.serialization.add_safe_globals([...]) before loading.')


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
                    f'sharded checkpoint (which holds {_DCP_METADATA} and '
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


def load_checkpoint_file(path: str, map_location='cpu'):
    """``torch.load`` a file of this project's kind, safely.

    The same allow-list as :func:`check_checkpoint`, and the same error:
    a file holding anything else raises :class:`UnsafeCheckpointError`
    naming it, never torch's own advice to turn safe loading off. Used for
    the per-rank communication-hook state files, which travel with their
    checkpoints and deserve the same suspicion.

    Raises:
        UnsafeCheckpointError: The file holds objects off the allow-list.
        CheckpointDamagedError: The file differs from its digest.
        OSError, RuntimeError, EOFError...: The file is missing, truncated
            or not a torch file at all (whatever ``torch.load`` raises).
    """
    require_intact(path)
    check_checkpoint(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # What the scan above did not name (an unsupported opcode, say):
        # still refused, in our words.
        raise UnsafeCheckpointError(
            f'Refusing to load {path}: a safe load failed '
            f'({str(e).splitlines()[0]}).') from None


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
    one lies elsewhere.

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
        # A CheckpointHook with its own out_dir, or a copy whose newest
        # checkpoint is gone: MMEngine's choice, but not silently.
        return recorded, (f'{recorded_file} names {recorded}, outside this '
                          f'work dir, which has no {osp.basename(recorded)}'
                          f'; resuming from {recorded}.')
    how = ('was moved' if not osp.exists(recorded) else
           'is a copy of another run (which is left alone)')
    return local, (f'{recorded_file} names {recorded}, outside this work dir; '
                   f'the work dir {how}, so resuming from {local}.')


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


_UNVERIFIED_SAID = set()


def say_unverified_once(path: str, message: str) -> None:
    """Log ``message`` (INFO) that ``path`` loads without a digest to
    check, once per file and process, however often it is loaded."""
    key = osp.abspath(path)
    if key not in _UNVERIFIED_SAID:
        _UNVERIFIED_SAID.add(key)
        from mmengine.logging import print_log
        print_log(message, logger='current', level=logging.INFO)


def readable_checkpoint(path: str) -> bool:
    """Whether torch can read ``path``'s structure (a truncated or
    overwritten file cannot), without loading its tensors."""
    try:
        check_checkpoint(path)
    except UnsafeCheckpointError:
        return True  # readable; refused later, by name
    except Exception:
        return False
    return True


def newest_intact(path: str) -> Optional[str]:
    """The newest checkpoint beside ``path`` (not ``path`` itself) that
    passes its digest (a sharded directory: its ``SHA256SUMS``); None if
    there is none."""
    from .sharded_checkpoint import newest_intact_checkpoint
    return newest_intact_checkpoint(path)


def unusable_reason(path: str) -> Optional[str]:
    """Why ``path`` cannot be resumed from (missing, damaged, without the
    digest its siblings have, unreadable); None if it can."""
    if not osp.exists(path):
        return f'{path}: no such file'
    if osp.isdir(path):
        if not is_sharded_checkpoint(path):
            return f'{path} is an incomplete sharded checkpoint'
        from .sharded_checkpoint import verify_sharded_checkpoint
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
    if path is None and osp.isfile(recorded_file):
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
