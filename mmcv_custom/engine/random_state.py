"""Every rank's random generators saved with the checkpoint and restored
on resume, so that a resumed run draws the numbers the uninterrupted one
would have drawn.

MMEngine seeds the generators once, at start (``randomness=dict(seed=...)``).
A resumed run starts from that seed again, so its augmentations
(``RandomFlip``: NumPy, Python's ``random``) and dropout (torch) differ from
the run it continues (measured: ``docs/en/user_guides/launching.md``).

* **Saved when a checkpoint is due**, on every rank, before the
  CheckpointHook writes it (this hook's priority is higher): the states
  are gathered to rank 0 and stored in the checkpoint (``random_states``,
  a few kB per rank, read by the safe loader).
* **Restored where the uninterrupted run stood.** An iteration-based
  resume replays the data loader over the steps already trained (MMEngine
  skips data that way), and that replay draws from the generators. So the
  states go back after the replay, just before the first new batch is
  fetched, by a thin wrapper around the loop's data iterator; an
  epoch-based resume restores them before the epoch's loader starts.
* **All or nothing, said once.** A checkpoint saved by another number of
  ranks, or without states (older runs), is not restored; rank 0 logs one
  warning saying the run is not bit for bit, and so it does when the
  training loader's ``num_workers`` differs (the workers' seeds follow
  from their count).
"""
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from mmengine.dist import get_rank, get_world_size, is_main_process
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.runner import IterBasedTrainLoop

from .hook_state_files import HookStateFiles

__all__ = ['RandomStateHook']

_KEY = 'random_states'


def _capture() -> dict:
    state = dict(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch=torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def _restore(state: dict) -> None:
    random.setstate(_as_tuple(state['python']))
    np.random.set_state(state['numpy'])
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


def _as_tuple(value):
    """Python's state as ``random.setstate`` wants it (tuples, not the
    lists a round trip may leave)."""
    if isinstance(value, list):
        return tuple(_as_tuple(v) for v in value)
    return value


def _num_workers(runner) -> Optional[int]:
    loader = getattr(runner.train_loop, 'dataloader', None)
    return getattr(loader, 'num_workers', None)


class _RestoreAfter:
    """The loop's data iterator, which restores the saved states once the
    resume's replay of ``skip`` batches is over."""

    def __init__(self, inner, skip: int, restore) -> None:
        self.inner, self.skip, self.restore = inner, skip, restore

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        if self.skip > 0:
            self.skip -= 1
            if self.skip == 0:
                self.restore()
        return batch

    def __getattr__(self, name):
        return getattr(self.inner, name)


@HOOKS.register_module()
class RandomStateHook(Hook):
    """Save and restore every rank's random generators with checkpoints.

    ``tools/train.py`` adds it to every run; with MMSegmentation's own
    tool, add ``dict(type='RandomStateHook')`` to ``custom_hooks``.
    """

    priority = 'LOW'  # before the CheckpointHook (VERY_LOW) writes

    def __init__(self) -> None:
        self._pending = None
        self._saved = None
        self._resumed = False

    # -- saving ---------------------------------------------------------
    def _gather_if_due(self, runner, by_epoch: bool) -> None:
        if HookStateFiles._checkpoint_due(runner, by_epoch) is None:
            return
        states = [_capture()]
        if dist.is_available() and dist.is_initialized():
            states = [None] * get_world_size()
            dist.all_gather_object(states, _capture())
        if is_main_process():
            self._pending = dict(
                world_size=len(states),
                ranks=states,
                num_workers=_num_workers(runner))

    def after_train_iter(self,
                         runner,
                         batch_idx,
                         data_batch=None,
                         outputs=None) -> None:
        self._gather_if_due(runner, by_epoch=False)

    def after_train_epoch(self, runner) -> None:
        self._gather_if_due(runner, by_epoch=True)

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self._pending is not None:
            checkpoint[_KEY] = self._pending
            self._pending = None

    # -- restoring ------------------------------------------------------
    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        # Called for load_from too; only a resume continues a run.
        if getattr(runner, '_resume', False):
            self._resumed = True
            self._saved = checkpoint.get(_KEY)

    def before_train(self, runner) -> None:
        if not self._resumed:
            return
        saved, self._saved = self._saved, None
        why = None
        if not isinstance(saved, dict) or 'ranks' not in saved:
            why = 'the resumed checkpoint holds no random states (saved ' \
                  'before they were kept)'
        elif saved.get('world_size') != get_world_size():
            why = (f"the resumed checkpoint holds the random states of "
                   f"{saved.get('world_size')} ranks, this run has "
                   f'{get_world_size()}')
        if why is not None:
            if is_main_process():
                runner.logger.warning(
                    f'Not restoring the random generators: {why}. The run '
                    'continues with freshly seeded ones: augmentations and '
                    'dropout differ from the uninterrupted run (not bit for '
                    'bit).')
            return
        workers = _num_workers(runner)
        if saved.get('num_workers') != workers and is_main_process():
            runner.logger.warning(
                f"The training loader has num_workers={workers}, the "
                f"resumed run had {saved.get('num_workers')}: its workers "
                'draw other random numbers, so augmentations differ from '
                'the uninterrupted run (not bit for bit).')
        state = saved['ranks'][get_rank()]

        def restore():
            _restore(state)
            if is_main_process():
                runner.logger.info(
                    f'Restored the random generators of all '
                    f'{get_world_size()} ranks as they were at iteration '
                    f'{runner.iter}.')

        loop = runner.train_loop
        if isinstance(loop, IterBasedTrainLoop) and runner.iter > 0:
            loop.dataloader_iterator = _RestoreAfter(loop.dataloader_iterator,
                                                     runner.iter, restore)
        else:
            restore()
