"""Per-rank communication-hook state beside MMEngine checkpoints.

MMEngine writes a checkpoint on rank 0 only, but PowerSGD's error feedback
differs on every rank and is as large as the gradients. So every rank
writes its own file beside the checkpoint (``iter_8.pth`` gets
``iter_8.pth.comm_hook_rank0.pth``, ``...rank1.pth`` ...) just before the
CheckpointHook saves, and the checkpoint records which files belong to it.

Rules, each for a failure seen in practice:

* **Found relative to the checkpoint.** A resumed run looks for the files in
  the resumed checkpoint's own folder, by its own name; nothing absolute is
  stored, so a work dir that was copied or moved resumes its own state.
* **Proof of ownership.** Every save carries the run's id (drawn on rank 0
  when training starts, shared with all ranks) and the step, in the
  checkpoint and in each rank's file. A file of another run or another
  save is refused, never restored.
* **All ranks agree.** Each rank tries to read and check its file; the
  outcomes are gathered, and either every rank restores or every rank
  starts afresh. A rank alone on another state would make the ranks issue
  different collectives (gloo aborts, NCCL hangs) or train on mixed state.
  Rank 0 logs one warning naming each rank that failed and why.
* **Safe loading.** The files go through the same allow-list as
  checkpoints (:func:`mmcv_custom.integrity.checkpoint.load_checkpoint_file`).
* **Atomic writes, with a digest.** A file is written under a temporary
  name and renamed (:mod:`mmcv_custom.integrity`), so a run killed while
  saving never leaves a truncated file under the real name, and its
  ``.sha256`` is checked when it is read: a damaged file is refused, by
  name, like any other.
* **No files without their checkpoint.** The files are written before the
  checkpoint: when its save then fails (a full disk), the run removes them
  as it stops (:meth:`HookStateFiles.discard_unsaved`), and the next run
  removes any a killed save left (:func:`remove_orphan_state_files`).
"""
import io
import os
import os.path as osp
import re
import uuid
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from mmengine.dist import get_rank, get_world_size, is_main_process
from mmengine.hooks import CheckpointHook

from ..comm.builder import CommHookConfig
from ..hooks.state import HookStateKeeper
from ..integrity import CheckpointDamagedError, atomic_write_bytes, digest_path
from ..integrity.checkpoint import UnsafeCheckpointError, load_checkpoint_file

__all__ = [
    'HookStateFiles', 'state_file_path', 'remove_orphan_state_files',
    'STATE_FILE_PATTERN'
]

# Version of the record in the checkpoint and of the files. Version 1
# (absolute paths, no identity) is refused with a warning.
_FORMAT = 2

#: A state file's name: the checkpoint's, then the rank (and ``.sha256``
#: for its digest).
STATE_FILE_PATTERN = re.compile(
    r'^(?P<checkpoint>.+)\.comm_hook_rank\d+\.pth(?:\.sha256)?$')


def state_file_path(checkpoint: str, rank: int) -> str:
    """Where ``rank`` keeps its hook state for ``checkpoint``: beside it."""
    return f'{checkpoint}.comm_hook_rank{rank}.pth'


def _remove(paths) -> List[str]:
    removed = []
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            continue  # gone already, or not ours to remove
        removed.append(path)
    return removed


def remove_orphan_state_files(folder: str) -> List[str]:
    """Remove the state files (and their digests) in ``folder`` whose
    checkpoint is not there: what a save that failed or was killed after
    them left. Returns the paths removed.

    Call it only while no save is under way in ``folder``: at the start of
    a run that holds the work dir's lock
    (:mod:`mmcv_custom.launching.work_dir_lock`), before training.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    present = set(names)
    orphans = []
    for name in sorted(names):
        found = STATE_FILE_PATTERN.match(name)
        if found and found.group('checkpoint') not in present:
            orphans.append(osp.join(folder, name))
    return _remove(orphans)


class _Refused(Exception):
    """Why this rank cannot restore; the text goes into the warning."""


def _describe(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f'rank {ranks[0]}'
    return 'ranks ' + ', '.join(map(str, ranks))


class HookStateFiles:
    """Save, prune and restore the state of stateful communication hooks.

    Args:
        keepers (dict): DDP submodule name ('' for the whole model) ->
            the :class:`~mmcv_custom.hooks.state.HookStateKeeper` of its
            hook, whose ``state_dict`` is what is saved.
        config (CommHookConfig): The ``comm_hook`` config, checked (its
            type and wrapper must match for saved state to be used).
    """

    def __init__(self, keepers: Dict[str, HookStateKeeper],
                 config: CommHookConfig) -> None:
        self.keepers = keepers
        self.config = config
        self.run_id: Optional[str] = None
        # (checkpoint path, step) while the CheckpointHook saves this
        # iteration, else None.
        self._due: Optional[tuple] = None
        # (CheckpointHook, checkpoint steps it kept before its last save).
        self._kept_before: Optional[tuple] = None

    def start(self) -> None:
        """Agree on this run's id (a collective: every rank calls it)."""
        ids = [uuid.uuid4().hex if get_rank() == 0 else None]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(ids, src=0)
        self.run_id = ids[0]

    # -- saving ----------------------------------------------------------
    def save_if_due(self, runner, by_epoch: bool) -> None:
        """Write this rank's file when the CheckpointHook saves now.

        Called before the CheckpointHook's own ``after_train_*`` (this
        project's runner hook has a higher priority).
        """
        self._due = None
        self.prune()
        due = self._checkpoint_due(runner, by_epoch)
        if due is None:
            return
        hook, checkpoint, step = due
        self._due = (checkpoint, step)
        # The CheckpointHook may delete an old checkpoint (max_keep_ckpts)
        # when it saves this one; its state files go at the next call.
        self._kept_before = (hook, set(getattr(hook, 'keep_ckpt_ids', ())))
        rank = get_rank()
        path = state_file_path(checkpoint, rank)
        os.makedirs(osp.dirname(path) or '.', exist_ok=True)
        payload = dict(
            format=_FORMAT,
            run=self.run_id,
            step=step,
            rank=rank,
            world_size=get_world_size(),
            hooks={
                name: keeper.state_dict()
                for name, keeper in self.keepers.items()
            })
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        atomic_write_bytes(path, buffer.getvalue())

    def discard_unsaved(self) -> List[str]:
        """Remove every rank's state files of the save under way when its
        checkpoint was not written (the run failed while saving it: a full
        disk); returns the paths removed. What another rank writes after
        this, the next run removes (:func:`remove_orphan_state_files`)."""
        if self._due is None:
            return []
        checkpoint, _ = self._due
        self._due = None
        if osp.exists(checkpoint):
            return []
        paths = []
        for rank in range(get_world_size()):
            path = state_file_path(checkpoint, rank)
            paths += [path, digest_path(path)]
        return _remove(paths)

    def record(self, checkpoint: dict) -> None:
        """Put the record of this save's files into ``checkpoint``.

        Only checkpoints the CheckpointHook saves on schedule get one (a
        best-metric checkpoint between them has no state files).
        """
        if self._due is None:
            return
        path, step = self._due
        checkpoint['comm_hook_state'] = dict(
            format=_FORMAT,
            type=self.config.type,
            wrapper=self.config.wrapper,
            world_size=get_world_size(),
            run=self.run_id,
            step=step,
            # Names only: the files are looked up beside the checkpoint.
            files=[
                osp.basename(state_file_path(path, r))
                for r in range(get_world_size())
            ])

    @staticmethod
    def _checkpoint_due(runner, by_epoch: bool):
        """``(CheckpointHook, path, step)`` when that hook saves now."""
        for hook in runner.hooks:
            if not isinstance(hook, CheckpointHook) or (hook.by_epoch
                                                        != by_epoch):
                continue
            if by_epoch:
                due = hook.every_n_epochs(
                    runner, hook.interval,
                    hook.save_begin) or (hook.save_last
                                         and hook.is_last_train_epoch(runner))
                step = runner.epoch + 1
            else:
                due = hook.every_n_train_iters(
                    runner, hook.interval,
                    hook.save_begin) or (hook.save_last
                                         and hook.is_last_train_iter(runner))
                step = runner.iter + 1
            if due:
                return hook, osp.join(hook.out_dir,
                                      hook.filename_tmpl.format(step)), step
        return None

    def prune(self) -> None:
        """Delete this rank's state files of the checkpoints the
        CheckpointHook removed (``max_keep_ckpts``) since the last save.

        Exactly those: state files of other runs in the same folder stay, as
        their checkpoints do. Every rank keeps the CheckpointHook's list of
        kept checkpoints, though only rank 0 deletes the checkpoint files.
        """
        if self._kept_before is None:
            return
        hook, before = self._kept_before
        self._kept_before = None
        rank = get_rank()
        for step in before - set(getattr(hook, 'keep_ckpt_ids', ())):
            path = state_file_path(
                osp.join(hook.out_dir, hook.filename_tmpl.format(step)), rank)
            for name in (path, digest_path(path)):
                if osp.isfile(name):
                    os.remove(name)

    # -- resuming --------------------------------------------------------
    def restore(self, runner, record: Optional[dict],
                checkpoint: Optional[str]) -> None:
        """Restore every rank's state for ``checkpoint``, or none at all.

        A collective: every rank calls it, after the hooks are registered
        and before the first step.

        Args:
            runner: The MMEngine runner (for the log and the step count).
            record (dict, optional): The checkpoint's ``comm_hook_state``.
            checkpoint (str, optional): Path of the resumed checkpoint.
        """
        rank, world_size = get_rank(), get_world_size()
        payload, reason = None, None
        try:
            payload = self._read(record, checkpoint, rank, world_size)
        except _Refused as e:
            reason = str(e)
        reasons = [reason]
        if dist.is_available() and dist.is_initialized():
            reasons = [None] * world_size
            dist.all_gather_object(reasons, reason)
        hook_type = self.config.type
        if not any(reasons):
            for name, keeper in self.keepers.items():
                keeper.load_state_dict(payload['hooks'][name])
            if is_main_process():
                what = next(iter(self.keepers.values())).RESTORED
                runner.logger.info(
                    f'Restored the {hook_type} state ({what}) of all '
                    f'{world_size} ranks from the files beside {checkpoint}.')
            return

        accumulate = getattr(runner.optim_wrapper, '_accumulative_counts', 1)
        steps = runner.iter // max(int(accumulate), 1)
        for keeper in self.keepers.values():
            keeper.start_fresh(steps)
        if not is_main_process():
            return
        by_reason: Dict[str, list] = {}
        for r, why in enumerate(reasons):
            if why:
                by_reason.setdefault(why, []).append(r)
        if len(by_reason) == 1 and len(next(iter(
                by_reason.values()))) == (world_size) and world_size > 1:
            why = '; '.join(by_reason)
            whys = f'all ranks: {why}'
        else:
            whys = '; '.join(f'{_describe(ranks)}: {why}'
                             for why, ranks in by_reason.items())
        fresh = next(iter(self.keepers.values())).fresh_note(steps)
        runner.logger.warning(
            f'Not restoring the {hook_type} communication-hook state '
            f'({whys}). Every rank starts it afresh at step {steps}: '
            f'{fresh}.')

    def _read(self, record, checkpoint, rank: int, world_size: int):
        """This rank's checked payload, or :class:`_Refused` saying why."""
        if record is None:
            raise _Refused('the resumed checkpoint holds no '
                           'communication-hook state')
        if not isinstance(record, dict) or record.get('format') != _FORMAT:
            raise _Refused(
                'the resumed checkpoint records its hook state in a format '
                'this version does not read (an older mmcv_custom, whose '
                'files do not prove which checkpoint they belong to)')
        saved = (record.get('type'), record.get('wrapper'))
        if saved != (self.config.type, self.config.wrapper):
            raise _Refused(
                f'the resumed checkpoint holds the state of comm_hook '
                f'type={saved[0]!r}, wrapper={saved[1]!r}, not of '
                f'type={self.config.type!r}, '
                f'wrapper={self.config.wrapper!r}')
        if record.get('world_size') != world_size:
            raise _Refused(f"the resumed checkpoint holds the state of "
                           f"{record.get('world_size')} ranks, this run has "
                           f'{world_size}')
        if not checkpoint:
            raise _Refused('the resumed checkpoint file is not known, so '
                           'its state files cannot be found')
        path = state_file_path(checkpoint, rank)
        if not osp.isfile(path):
            raise _Refused(f'{path} is missing')
        try:
            payload = load_checkpoint_file(path)
        except (UnsafeCheckpointError, CheckpointDamagedError) as e:
            raise _Refused(str(e)) from None
        except Exception as e:  # truncated, empty, not a torch file...
            first = (str(e).strip().splitlines() or [''])[0]
            raise _Refused(f'{path} is unreadable ({type(e).__name__}: '
                           f'{first})') from None
        if not isinstance(payload, dict) or payload.get('format') != _FORMAT:
            raise _Refused(f'{path} is not a communication-hook state file '
                           'of this mmcv_custom version')
        mine = (record.get('run'), record.get('step'), rank)
        found = (payload.get('run'), payload.get('step'), payload.get('rank'))
        if found[:2] != mine[:2]:
            raise _Refused(
                f'{path} belongs to another save (run {found[0]}, step '
                f'{found[1]}), not to {osp.basename(checkpoint)} (run '
                f'{mine[0]}, step {mine[1]})')
        if found[2] != rank:
            raise _Refused(f'{path} holds the state of rank {found[2]}, not '
                           f'of rank {rank}')
        hooks = payload.get('hooks')
        for name, keeper in self.keepers.items():
            try:
                keeper.check_state_dict(
                    hooks.get(name) if isinstance(hooks, dict) else None)
            except ValueError as e:
                raise _Refused(f'{path}: {e}') from None
        return payload
