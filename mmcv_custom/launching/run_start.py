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
* **Another run's weights only when named.** A ``last_checkpoint`` that
  names a file outside the run's checkpoint folder (copied in, or a work
  dir copied without its newest checkpoint) is never followed: the run's
  own newest intact checkpoint is resumed, or, without one, the start is
  refused offering both ways. ``--resume PATH`` names the checkpoint to
  continue: taken where the run has saved nothing yet; where it has, the
  run's own newer checkpoints are not overwritten (refused, or moved aside
  with ``--overwrite``); a restart continues the run's own newest.
* **One run per work dir.** Every checkpoint says which run saved it
  (:mod:`mmcv_custom.engine.run_identity`); the checkpoint ``--resume``
  would take is refused, naming both runs (their ids, seeds, configs and
  start times), when it is another run's than the folder's other
  checkpoints (one copied in with its digest).
* **Never through a link.** MMEngine opens two names of the work dir for
  writing in place: ``last_checkpoint`` (at every save) and the config it
  dumps (``<config name>.py``, at start). Where either is a symbolic or
  hard link (a work dir copied with ``cp -rs``), that would overwrite the
  file it points to: it is replaced by a file of the run's own with the
  same contents (what it pointed to is left as it is), and the log says
  so. Everything else the project writes there goes through a temporary
  name and a rename (:mod:`mmcv_custom.integrity.files`), which replaces
  a link rather than writing through it.

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

from ..engine.validation_record import RECORD_FILE
from ..integrity import atomic_write_text, checkpoint_candidates, link_of
from ..integrity.checkpoint_choice import (checkpoint_folder,
                                           find_resume_checkpoint,
                                           foreign_checkpoint,
                                           recorded_outside)
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
        own_copies (list[str]): Links under names the run writes
            (``last_checkpoint``), to replace by files of the run's own.
    """
    load_from: Optional[str] = None
    resume: bool = False
    notes: List[Tuple[int, str]] = field(default_factory=list)
    problems: List[Problem] = field(default_factory=list)
    supersede: List[str] = field(default_factory=list)
    superseded_dir: Optional[str] = None
    load_from_after: Optional[str] = None
    own_copies: List[str] = field(default_factory=list)

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
    """Plan to move ``checkpoints`` (newest first), ``last_checkpoint``
    and ``last_validation`` into ``superseded_<newest>/``, a name every
    rank computes alike."""
    base = SUPERSEDED_PREFIX + osp.splitext(
        osp.basename(osp.normpath(checkpoints[0])))[0]
    target, n = osp.join(folder, base), 2
    while osp.lexists(target):
        target, n = osp.join(folder, f'{base}_{n}'), n + 1
    paths = [p for c in checkpoints for p in _belongings(folder, c)]
    records = [
        name for name in ('last_checkpoint', RECORD_FILE)
        if osp.lexists(osp.join(cfg.work_dir, name))
    ]
    paths += [osp.join(cfg.work_dir, name) for name in records]
    plan.supersede, plan.superseded_dir = paths, target
    names = [osp.basename(osp.normpath(c)) for c in checkpoints]
    shown = (', '.join(names)
             if len(names) <= 4 else f'{names[-1]} ... {names[0]}')
    its = f' and its {" and ".join(records)}' if records else ''
    plan.note(f'--overwrite: moved {len(names)} checkpoint'
              f'{"s" if len(names) > 1 else ""} of this work dir ({shown}, '
              f'with their digests and hook state files){its} into '
              f'{target}; delete that folder when you no longer need them')


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


def _foreign_problem(cfg, folder: str, chosen: str, why: str) -> Problem:
    name = osp.basename(osp.normpath(chosen))
    return Problem(
        f'--resume: {why}: continuing it here would mix two runs in one work '
        'dir', f'to continue this work dir\'s own run, move {name} (with '
        f'its {name}.* files) out of {folder}; to continue the other run, '
        f'give it a work dir of its own: --work-dir NEW --resume {chosen}')


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
               overwrite: bool = False,
               resume_from: Optional[str] = None) -> StartPlan:
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
        resume_from (str, optional): The checkpoint ``--resume PATH``
            names (implies ``resume``).

    Returns:
        StartPlan: With :attr:`StartPlan.problems` set when the run must
        not start.
    """
    resume = resume or bool(resume_from)
    load_from = cfg.get('load_from') or None
    folder = checkpoint_folder(cfg)
    plan = StartPlan(load_from=load_from, resume=False)
    _own_names(plan, cfg)
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
    if resume_from and not (saved and restart):
        return _resume_named(plan, cfg, folder, saved, resume_from, overwrite)
    if not saved:
        return _resume_without_checkpoints(plan, cfg, folder, resume)
    if resume and overwrite and load_from and not restart:
        return _go_back(plan, cfg, folder, saved, load_from)
    choice = find_resume_checkpoint(cfg.work_dir, folder)
    if choice.path is None:
        plan.problems.append(_damaged_problem(folder, choice.refused))
        return plan
    foreign = foreign_checkpoint(choice.path, saved)
    if foreign is not None:
        plan.problems.append(
            _foreign_problem(cfg, folder, choice.path, foreign))
        return plan
    for text in choice.notes:
        plan.note(text)
    plan.load_from, plan.resume = choice.path, True
    named = resume_from or load_from
    if named and not _same(named, choice.path):
        if resume_from:
            what, why = (f'--resume {named} was for the first start',
                         'it is taken while the run has saved nothing')
        else:
            what, why = (f'load_from={named!r} is not used',
                         'load_from seeds a run at its start only')
        plan.note(
            f'{what}: this run continues from its own newest checkpoint '
            f'{choice.path} ({why}; to go back to it, add --overwrite with '
            '--resume: the checkpoints after it are moved aside)',
            logging.INFO if restart else logging.WARNING)
    if overwrite and not restart:
        plan.note('--overwrite has nothing to move: --resume continues '
                  'from the newest checkpoint (set load_from to an older '
                  'one to go back to it)')
    return plan


def _own_names(plan: StartPlan, cfg) -> None:
    """Plan to replace the links under the names MMEngine writes in place
    in the work dir (see the module's rules); a folder there stops the
    start."""
    filename = getattr(cfg, 'filename', None)
    dumped = osp.basename(filename) if filename else None
    for name, what in (('last_checkpoint', 'MMEngine writes the name of '
                        'the newest checkpoint into that file at every '
                        'save'), (dumped, 'MMEngine writes the run\'s config '
                                  'there when the run starts')):
        path = osp.join(cfg.work_dir, name) if name else None
        why = link_of(path) if path else None
        if why is None:
            continue
        if osp.isdir(path):
            plan.problems.append(
                Problem(
                    f'{why}: {what}', 'move that folder out of the work '
                    'dir, or choose another --work-dir'))
            continue
        plan.own_copies.append(path)
        plan.note(f'{why}: {what}, which would overwrite what it points to, '
                  'so it was replaced by a file of this run\'s own with the '
                  'same contents (what it pointed to is left as it is)')


def _resume_named(plan: StartPlan, cfg, folder: str, saved: List[str],
                  named: str, overwrite: bool) -> StartPlan:
    """``--resume PATH`` on a first start, or on a restart before the run
    saved anything."""
    plan.resume, plan.load_from = True, named
    if cfg.get('load_from') and not _same(cfg.load_from, named):
        plan.note(
            f'load_from={cfg.load_from!r} is not used: --resume names '
            f'{named}', logging.INFO)
    if not saved or _same(named, saved[0]):
        return plan
    if overwrite:
        return _go_back(plan, cfg, folder, saved, named)
    where = ('' if _same(folder, cfg.work_dir) else
             f' (its checkpoint folder {folder})')
    newest = osp.basename(osp.normpath(saved[0]))
    plan.problems.append(
        Problem(
            f'--resume {named}: work_dir {cfg.work_dir!r}{where} holds '
            f'checkpoints of its own run (the newest: {newest}), which '
            f'continuing {named} there would overwrite or mix with',
            f'--resume alone continues {newest}; add --overwrite to continue '
            f'{named} there (the checkpoints of this work dir are then moved '
            f'into {folder}/{SUPERSEDED_PREFIX}...); or choose another '
            '--work-dir'))
    return plan


def _resume_without_checkpoints(plan: StartPlan, cfg, folder: str,
                                resume: bool) -> StartPlan:
    """A restart or ``--resume`` where the run has saved nothing yet."""
    if not resume:
        # A restart before the first save: as the run started.
        return plan
    elsewhere = recorded_outside(cfg.work_dir, folder)
    if elsewhere and not plan.load_from:
        last = osp.join(cfg.work_dir, 'last_checkpoint')
        plan.problems.append(
            Problem(
                f'--resume: {folder} holds no checkpoint of this run, but '
                f'{last} names {elsewhere}, outside it: another run\'s '
                'checkpoint, or this work dir was moved without its '
                'checkpoints', f'to continue from it, name it: --resume '
                f'{elsewhere}; to start a new run here at iteration 0, '
                f'remove {last}'))
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
    # Another folder's checkpoint: this folder's go aside, whatever their
    # steps (one work dir holds one run).
    inside = _same(osp.dirname(osp.normpath(load_from)), folder)
    later = [
        c for c in saved if not _same(c, load_from) and (
            not inside or step is None or _step(c) is None or _step(c) > step)
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
    if main_process:
        for path in plan.own_copies:
            _replace_link(path)
    if plan.supersede and main_process:
        os.makedirs(plan.superseded_dir)
        for path in plan.supersede:
            os.replace(path, osp.join(plan.superseded_dir, osp.basename(path)))
    if plan.supersede and dist.is_available() and dist.is_initialized():
        dist.barrier()
    if plan.load_from_after:
        plan.load_from = plan.load_from_after


def _replace_link(path: str) -> None:
    """Put a file of its own under ``path`` (a link), with what it read;
    a link that leads nowhere is removed."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        os.remove(path)
        return
    atomic_write_text(path, text)
