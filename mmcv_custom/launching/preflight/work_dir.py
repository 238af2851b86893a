"""The work dir, and the CheckpointHook's ``out_dir`` when it has one:
writable (nothing is left behind), and, for training, room on the
checkpoints' disk for one save.
"""
import os
import os.path as osp
import shutil
import tempfile
from typing import List, Optional, Tuple

from mmengine.config import Config

from ...engine.process_group import LAUNCH_ENV
from ...integrity import LinkedFileError
from ..work_dir_lock import WorkDirBusy, WorkDirLock
from .checkpoint_size import checkpoint_size, format_size
from .problems import Problem

__all__ = ['work_dir_problems', 'take_work_dir']

# How often a folder that another rank made and removed meanwhile is
# looked for again.
_VANISHING_TRIES = 5


def _world_size(launcher: str) -> int:
    """The ranks of this launch, from its launcher's environment (1 when
    it says none)."""
    env = LAUNCH_ENV.get(launcher)
    value = os.environ.get(env.world, '') if env else ''
    return int(value) if value.strip().isdigit() else 1


def _fix(key: str, which: str = '') -> str:
    """What to do about an unusable folder: another ``--work-dir``, or
    another value of ``key``; ``which`` says what it needs."""
    if key == 'work_dir':
        return f'choose another --work-dir{which}'
    return f'set {key} to another folder{which} (--cfg-options {key}=PATH)'


def _folder_problems(key: str,
                     folder: str) -> Tuple[List[Problem], Optional[str]]:
    """Whether ``folder`` (a work dir, or the checkpoint folder) can be
    made and written; returns the problems and its nearest existing
    folder (None with a problem)."""
    fix = _fix(key)
    what = 'work dir' if key == 'work_dir' else 'folder'
    for _ in range(_VANISHING_TRIES):
        existing = _nearest_existing(folder)
        if not osp.isdir(existing):
            return [
                Problem(
                    f'{key} {folder!r}: {existing} is a file, not a folder, '
                    f'so the {what} cannot be '
                    f'{"used" if existing == osp.abspath(folder) else "made"}',
                    fix)
            ], None
        try:
            # A real write (read-only mounts, ACLs), removed at once.
            os.rmdir(tempfile.mkdtemp(prefix='.preflight-', dir=existing))
        except OSError as e:
            if isinstance(e, FileNotFoundError) and not osp.isdir(existing):
                # Another rank's lock made the folder and removed it
                # again (its start was refused): look again.
                continue
            return [_unwritable(key, folder, existing, e)], None
        return [], existing
    return [
        Problem(
            f'{key} {folder!r}: it kept disappearing while it was checked '
            '(another process makes and removes it)', fix)
    ], None


def _unwritable(key: str, folder: str, existing: str,
                error: OSError) -> Problem:
    """The problem of a folder nothing can be written in: ``folder``
    itself, or ``existing``, where the missing part of it would be made."""
    cause = error.strerror or str(error)
    if isinstance(error, FileNotFoundError):
        # "No such file or directory" for a folder that is there: a
        # virtual file system (/proc) that makes no new entries.
        cause += (f': {existing} exists, but its file system takes no new '
                  'folders')
    if existing == osp.abspath(folder):
        what = f'cannot write in it ({cause})'
    else:
        what = f'cannot be made: making a folder in {existing} fails ({cause})'
    return Problem(f'{key} {folder!r}: {what}',
                   _fix(key, ', one you can write to'))


def _nearest_existing(folder: str) -> str:
    """``folder`` itself, or the nearest folder above it that exists."""
    existing = osp.abspath(folder)
    while not osp.exists(existing):
        existing = osp.dirname(existing)
    return existing


def _free_bytes(existing: str) -> int:
    """Free space on the disk of ``existing``, or of the nearest folder
    above it when another rank removed it meanwhile."""
    for _ in range(_VANISHING_TRIES):
        try:
            return shutil.disk_usage(existing).free
        except FileNotFoundError:
            existing = _nearest_existing(existing)
    return shutil.disk_usage(_nearest_existing(existing)).free


def work_dir_problems(cfg: Config,
                      mode: str,
                      launcher: str = 'none',
                      comm_hook=None) -> List[Problem]:
    """The work dir, and the checkpoint folder (``out_dir``) when it is
    elsewhere: writable, and (training) room for one save (``comm_hook``:
    the config's, as the preflight checked it; see
    :func:`~.checkpoint_size.checkpoint_size`)."""
    work_dir = cfg.get('work_dir')
    if not isinstance(work_dir, str) or not work_dir or '://' in work_dir:
        return []
    problems, existing = _folder_problems('work_dir', work_dir)
    if problems or mode != 'train':
        return problems
    key = 'work_dir'
    hook = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    out_dir = hook.get('out_dir') if isinstance(hook, dict) else None
    if out_dir and '://' not in str(out_dir):
        key = 'default_hooks.checkpoint.out_dir'
        problems, existing = _folder_problems(key, str(out_dir))
        if problems:
            return problems
        fix = f'free space there, or set {key} to a disk with room'
    else:
        fix = 'free space there, or choose another --work-dir on a disk ' \
              'with room'
    need = checkpoint_size(cfg, _world_size(launcher), launcher, comm_hook)
    if need is None:
        return []
    free = _free_bytes(existing)
    if need.total <= free:
        return []
    where = work_dir if key == 'work_dir' else out_dir
    return [
        Problem(
            f'{key} {where!r}: {format_size(free)} free on its disk, but '
            f'one checkpoint of this run takes about '
            f'{format_size(need.total)} ({need.describe()})', fix)
    ]


def take_work_dir(lock: Optional[WorkDirLock]) -> Optional[Problem]:
    """Take the work dir's lock (global rank 0; None elsewhere): the
    problem when another run holds it, the lock file is a link, or the
    work dir cannot be made or written (said as the preflight says it:
    the lock is taken before the other checks, so that no run looks at
    the work dir's checkpoints while another writes them)."""
    if lock is None:
        return None
    try:
        lock.acquire()
    except WorkDirBusy as e:
        return Problem(
            str(e), 'wait for that run to end or stop it, or choose another '
            '--work-dir')
    except LinkedFileError as e:
        return Problem(
            str(e), f'remove it (rm {lock.path}: what it points to is left '
            'as it is), or choose another --work-dir')
    except OSError as e:
        problems, _ = _folder_problems('work_dir', lock.work_dir)
        return problems[0] if problems else _unwritable(
            'work_dir', lock.work_dir, lock.work_dir, e)
    return None
