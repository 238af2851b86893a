"""Where a training run starts, so that it never goes backwards.

A fine-tuning run names ``load_from`` in its config for the whole of its
life, and its job scripts pass ``--resume`` on every launch; restarts
(torchrun's, ``tools/slurm_train.sh``'s, a Slurm requeue) launch it again
with the same arguments. MMEngine resumes from ``load_from`` whenever it is
set, so a restarted fine-tuning run went back to the other run's
checkpoint, restored that run's optimizer, iteration and generators, and
overwrote its own newer checkpoints, with exit code 0. The rules here:

* **The run's own newest intact checkpoint wins.** Whenever the run's
  checkpoint folder
  (:func:`~mmcv_custom.integrity.checkpoint_choice.checkpoint_folder`)
  holds a checkpoint, a restart or ``--resume`` continues from the newest
  intact one
  (:func:`~mmcv_custom.integrity.checkpoint_choice.find_resume_checkpoint`),
  and ``load_from`` is left out with one line saying so. ``load_from`` seeds a
  run only at its start.
* **A restart before the first save starts again as the run started**:
  from ``load_from``'s weights at iteration 0, not by resuming
  ``load_from``. An explicit ``--resume`` with ``load_from`` and no
  checkpoint of the run's own resumes from ``load_from``, as in MMEngine
  (how a run is moved to a new work dir).
* **A new run does not overwrite an older one.** Starting without
  ``--resume`` where checkpoints are already saved is refused (exit 2) with
  the ways out: ``--resume``, another ``--work-dir``, or ``--overwrite``,
  which moves those checkpoints (with their digests, hook state files and
  ``last_checkpoint``) into ``superseded_<newest>/`` in the checkpoint
  folder: kept, and never taken for the new run's. ``--resume --overwrite``
  with ``load_from`` set to an older checkpoint goes back to it the same
  way: the checkpoints after it are moved aside.
* **Nothing to resume from is an error**: when every checkpoint is damaged,
  the run stops (exit 2) naming each one and why, instead of training from
  iteration 0 over them.

:func:`plan_start` only reads the file system, the same way on every rank
before the process group exists; :func:`apply_start_plan` moves files, on
global rank 0 once the group exists, and the other ranks wait for it.
"""
import logging
import os
import os.path as osp
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..integrity import checkpoint_candidates
from ..integrity.checkpoint_choice import (checkpoint_folder,
                                           find_resume_checkpoint)
from .preflight import Problem

__all__ = ['StartPlan', 'plan_start', 'apply_start_plan', 'SUPERSEDED_PREFIX']

#: The folder ``--overwrite`` moves older checkpoints into:
#: ``superseded_<newest of them>``, beside them.
SUPERSEDED_PREFIX = 'superseded_'
_STEP = re.compile(r'^(?:iter|epoch)_(\d+)\.pth$')


@dataclass
class StartPlan:
    """How the run starts: what MMEngine loads and what is moved first.

    Attributes:
        load_from (str, optional): ``cfg.load_from`` for the runner.
        resume (bool): ``cfg.resume``: continue ``load_from``'s iteration,
            optimizer and schedules (else: its weights only).
        notes (list[tuple[int, str]]): ``(logging level, line)`` for the
            run's log and console, said once on rank 0.
        problems (list[Problem]): Why the run must not start (the
            preflight reports them with its own).
        supersede (list[str]): Paths to move into :attr:`superseded_dir`.
        superseded_dir (str, optional): Where they go.
        load_from_after (str, optional): ``load_from`` once moved (when it
            is one of the superseded checkpoints).
    """
    load_from: Optional[str] = None
    resume: bool = False
    notes: List[Tuple[int, str]] = field(default_factory=list)
    problems: List[Problem] = field(default_factory=list)
    supersede: List[str] = field(default_factory=list)
    superseded_dir: Optional[str] = None
    load_from_after: Optional[str] = None

    def note(self, text: str, level: int = logging.WARNING) -> None:
        self.notes.append((level, text))


def _step(path: str) -> Optional[int]:
    found = _STEP.match(osp.basename(osp.normpath(path)))
    return int(found.group(1)) if found else None


def _same(a: str, b: str) -> bool:
    return osp.abspath(osp.normpath(a)) == osp.abspath(osp.normpath(b))


def _belongings(folder: str, checkpoint: str) -> List[str]:
    """``checkpoint`` and what travels with it: its digest and every
    rank's hook state file (with theirs), all named after it."""
    name = osp.basename(osp.normpath(checkpoint))
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(
        osp.join(folder, n) for n in names
        if n == name or n.startswith(name + '.'))


def _supersede(plan: StartPlan, cfg, folder: str,
               checkpoints: List[str]) -> None:
    """Plan to move ``checkpoints`` (newest first) and ``last_checkpoint``
    into ``superseded_<newest>/``, a name every rank computes alike."""
    base = SUPERSEDED_PREFIX + osp.splitext(
        osp.basename(osp.normpath(checkpoints[0])))[0]
    target, n = osp.join(folder, base), 2
    while osp.exists(target):
        target, n = osp.join(folder, f'{base}_{n}'), n + 1
    paths = [p for c in checkpoints for p in _belongings(folder, c)]
    last = osp.join(cfg.work_dir, 'last_checkpoint')
    if osp.isfile(last):
        paths.append(last)
    plan.supersede, plan.superseded_dir = paths, target
    names = [osp.basename(osp.normpath(c)) for c in checkpoints]
    shown = (', '.join(names)
             if len(names) <= 4 else f'{names[-1]} ... {names[0]}')
    plan.note(f'--overwrite: moved {len(names)} checkpoint'
              f'{"s" if len(names) > 1 else ""} of this work dir ({shown}, '
              'with their digests and hook state files) and its '
              f'last_checkpoint into {target}; delete that folder when you '
              'no longer need them')


def _fresh_start_problem(cfg, folder: str, newest: str) -> Problem:
    where = ('' if _same(folder, cfg.work_dir) else
             f' (its checkpoint folder {folder})')
    return Problem(
        f'work_dir {cfg.work_dir!r}{where} already holds the checkpoints '
        f'of a run (the newest: {osp.basename(osp.normpath(newest))}): a '
        'new run there would overwrite them with older iterations',
        'continue that run with --resume; or choose another --work-dir; '
        'or add --overwrite to start again there (its checkpoints are '
        f'then moved into {folder}/{SUPERSEDED_PREFIX}...)')


def _damaged_problem(folder: str, refused) -> Problem:
    lines = '; '.join(why for _, why in refused)
    return Problem(
        f'--resume: no checkpoint in {folder} can be resumed from '
        f'({len(refused)} found, each refused: {lines})',
        'restore an intact copy of one of them (each .sha256 says what it '
        'held), or add --overwrite to start again at iteration 0 (they are '
        f'then moved into {folder}/{SUPERSEDED_PREFIX}...)')


def plan_start(cfg,
               resume: bool,
               restart: int = 0,
               overwrite: bool = False) -> StartPlan:
    """Decide where the run of ``cfg`` starts (see the module's rules).

    Reads files only, so every rank decides alike before the process
    group exists.

    Args:
        cfg (Config): The merged config (``work_dir`` set; ``load_from``
            as the user gave it).
        resume (bool): ``--resume`` was given.
        restart (int): How many times the run was restarted after a
            failure (:func:`mmcv_custom.engine.process_group.restart_count`).
        overwrite (bool): ``--overwrite`` was given.

    Returns:
        StartPlan: With :attr:`StartPlan.problems` set when the run must
        not start.
    """
    load_from = cfg.get('load_from') or None
    folder = checkpoint_folder(cfg)
    plan = StartPlan(load_from=load_from, resume=False)
    saved = checkpoint_candidates(folder)
    if restart:
        plan.note(
            f'restart {restart} after a failure: ' +
            ('resuming from the newest intact checkpoint' if saved else
             'no checkpoint saved yet, so starting again as the run '
             'started'), logging.INFO)
    if not (resume or restart):
        if saved and not overwrite:
            plan.problems.append(_fresh_start_problem(cfg, folder, saved[0]))
        elif saved:
            _supersede(plan, cfg, folder, saved)
            if load_from and any(_same(load_from, p) for p in plan.supersede):
                plan.load_from_after = osp.join(plan.superseded_dir,
                                                osp.basename(load_from))
        return plan
    if not saved:
        return _resume_without_checkpoints(plan, cfg, folder, resume)
    if resume and overwrite and load_from and not restart:
        return _go_back(plan, cfg, folder, saved, load_from)
    choice = find_resume_checkpoint(cfg.work_dir, folder)
    if choice.path is None:
        plan.problems.append(_damaged_problem(folder, choice.refused))
        return plan
    for text in choice.notes:
        plan.note(text)
    plan.load_from, plan.resume = choice.path, True
    if load_from and not _same(load_from, choice.path):
        plan.note(
            f'load_from={load_from!r} is not used: this run continues '
            f'from its own newest checkpoint {choice.path} (load_from seeds '
            'a run at its start only; to go back to it, add --overwrite '
            'with --resume: the checkpoints after it are moved aside)',
            logging.INFO if restart else logging.WARNING)
    if overwrite and not restart:
        plan.note('--overwrite has nothing to move: --resume continues '
                  'from the newest checkpoint (set load_from to an older '
                  'one to go back to it)')
    return plan


def _resume_without_checkpoints(plan: StartPlan, cfg, folder: str,
                                resume: bool) -> StartPlan:
    """A restart or ``--resume`` where the run has saved nothing yet."""
    if not resume:
        # A restart before the first save: as the run started.
        return plan
    if plan.load_from:
        plan.resume = True
        plan.note(
            f'--resume: resuming from load_from={plan.load_from!r}: '
            f'{folder} holds no checkpoint of this run', logging.INFO)
    elif not osp.isdir(cfg.work_dir):
        plan.note(f'--resume: the work dir {cfg.work_dir} does not exist, '
                  'so there is nothing to resume: starting a new run at '
                  'iteration 0 (check --work-dir if you meant to continue '
                  'a run)')
    else:
        plan.note(f'--resume: no checkpoint in {folder}: starting at '
                  'iteration 0')
    return plan


def _go_back(plan: StartPlan, cfg, folder: str, saved: List[str],
             load_from: str) -> StartPlan:
    """``--resume --overwrite`` with ``load_from``: resume from it, with
    the checkpoints after it moved aside."""
    plan.resume = True
    step = _step(load_from)
    later = [
        c for c in saved if not _same(c, load_from) and (
            step is None or _step(c) is None or _step(c) > step)
    ]
    if later:
        _supersede(plan, cfg, folder, later)
        plan.note(f'--overwrite: going back to {load_from}')
    else:
        plan.note(f'--overwrite has nothing to move: no checkpoint after '
                  f'{load_from} in {folder}')
    return plan


def apply_start_plan(plan: StartPlan, main_process: bool) -> None:
    """Move what ``plan`` supersedes (on the main process), then let every
    rank go on once it is done (a barrier when a process group exists).
    ``plan.load_from`` then names where ``load_from`` is."""
    import torch.distributed as dist
    if plan.supersede and main_process:
        os.makedirs(plan.superseded_dir)
        for path in plan.supersede:
            os.replace(path, osp.join(plan.superseded_dir, osp.basename(path)))
    if plan.supersede and dist.is_available() and dist.is_initialized():
        dist.barrier()
    if plan.load_from_after:
        plan.load_from = plan.load_from_after
