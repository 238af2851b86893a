"""Validation result parts inside the work dir, and no validation lost to
a restart.

Two faults of a distributed validation, seen when a rank is killed during
the run's last one:

* **Result parts outside the run.** MMEngine's metrics gather every rank's
  results through files: without a ``collect_dir`` it makes
  ``.dist_test/tmp*/part_<rank>.pkl`` in the directory the run was started
  from, and a killed rank leaves them there (MMSegmentation's ``IoUMetric``
  does not pass ``collect_dir`` on, so a config cannot set it). Here every
  evaluator's CPU-collected metrics gather in
  ``<work_dir>/.dist_test/<run timestamp>/``, a folder of this launch
  alone; what an earlier, killed launch left there is removed when the
  next one starts.
* **A validation lost to a restart.** The CheckpointHook saves iteration
  N before the validation of iteration N runs. A run killed during that
  validation resumes from iteration N, and MMEngine's loop validates only
  after an iteration it trains: the last validation is never run, and a
  restarted run "finishes" without its final metrics. Each validation
  done during training is recorded in ``<work_dir>/last_validation``
  (written by rank 0 through a temporary name); a resumed run whose
  iteration (epoch) is a validation point that the record does not cover
  runs that validation before it trains on, saying why.
"""
import json
import os
import os.path as osp
from typing import Optional

from mmengine.dist import is_main_process
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.runner import EpochBasedTrainLoop

from ..integrity import atomic_write_text, remove_entry

__all__ = [
    'ValidationRecordHook', 'run_lost_validation', 'trained_by_epoch',
    'trained_steps', 'last_step', 'RECORD_FILE', 'PARTS_FOLDER'
]

#: The record of the last validation done during training, in the work dir.
RECORD_FILE = 'last_validation'
#: Where the metrics' result parts gather, in the work dir.
PARTS_FOLDER = '.dist_test'


@HOOKS.register_module()
class ValidationRecordHook(Hook):
    """Keep the metrics' result parts in the work dir and record each
    validation done during training (see the module's description).

    ``tools/train.py`` and ``tools/test.py`` register it on every runner
    (:func:`mmcv_custom.launching.running.run_runner`); with
    MMSegmentation's own tools, add ``dict(type='ValidationRecordHook')``
    to ``custom_hooks``.

    Args:
        remove_leftovers (bool): Remove what earlier, killed launches left
            in the parts folder when this one starts. A training owns its
            work dir (it holds the lock); ``tools/test.py`` evaluating a
            checkpoint while that run trains in the same work dir passes
            False, so that neither removes the other's parts mid-gather.
            Defaults to True.
    """

    # Its before_train runs last: a lost validation runs once every other
    # hook has set up the run.
    priority = 'VERY_LOW'

    def __init__(self, remove_leftovers: bool = True) -> None:
        self._resumed = False
        self._remove_leftovers = remove_leftovers

    # -- the result parts ------------------------------------------------
    def before_run(self, runner) -> None:
        if self._remove_leftovers and is_main_process():
            _remove_leftovers(
                osp.join(runner.work_dir, PARTS_FOLDER), runner.timestamp)

    def before_val_epoch(self, runner) -> None:
        _collect_in_work_dir(runner, runner.val_loop)

    def before_test_epoch(self, runner) -> None:
        _collect_in_work_dir(runner, runner.test_loop)

    def after_test_epoch(self, runner, metrics=None) -> None:
        _remove_empty_parts(runner)

    # -- the record ------------------------------------------------------
    def after_val_epoch(self, runner, metrics=None) -> None:
        _remove_empty_parts(runner)
        loop = getattr(runner, '_train_loop', None)
        if not is_main_process() or loop is None or isinstance(loop, dict):
            return  # a validation outside training (runner.val())
        atomic_write_text(
            osp.join(runner.work_dir, RECORD_FILE),
            json.dumps(
                dict(
                    step=trained_steps(runner),
                    by_epoch=trained_by_epoch(runner))))

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        # Called for load_from too; only a resume continues a run.
        self._resumed = bool(getattr(runner, '_resume', False))

    def before_train(self, runner) -> None:
        if self._resumed:
            run_lost_validation(runner)


def run_lost_validation(runner) -> bool:
    """Run the validation of the resumed iteration (epoch) when it is due
    there and ``last_validation`` does not record it (see the module's
    description), saying why on rank 0; whether it ran. Every rank reads
    the same record, so every rank decides alike."""
    loop = runner.train_loop
    if runner.val_loop is None:
        return False
    step, last = trained_steps(runner), last_step(loop)
    due = step >= loop.val_begin and (step % loop.val_interval == 0
                                      or step == last)
    if step <= 0 or not due or _recorded(runner) >= step:
        return False
    what = 'epoch' if trained_by_epoch(runner) else 'iteration'
    then = ('its final one'
            if step >= last else f'before training on from {what} {step}')
    if is_main_process():
        runner.logger.warning(
            f'The validation after {what} {step} did not finish before the '
            f'run stopped ({RECORD_FILE} in the work dir does not record '
            f'it; a rank killed during it?): running it now, {then}.')
    runner.val_loop.run()
    return True


def trained_by_epoch(runner) -> bool:
    """Whether the run's training loop counts epochs (else iterations)."""
    return isinstance(runner.train_loop, EpochBasedTrainLoop)


def trained_steps(runner) -> int:
    """The epochs (iterations) trained so far, as the loop counts."""
    return runner.epoch if trained_by_epoch(runner) else runner.iter


def last_step(loop) -> int:
    """The loop's ``max_epochs`` (``max_iters``)."""
    return loop.max_epochs if isinstance(
        loop, EpochBasedTrainLoop) else loop.max_iters


def _recorded(runner) -> int:
    """The step of the last validation the record holds; -1 without one
    (or one of the other kind of loop, or unreadable)."""
    try:
        with open(osp.join(runner.work_dir, RECORD_FILE)) as f:
            record = json.load(f)
        if record.get('by_epoch') == trained_by_epoch(runner):
            return int(record['step'])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return -1


def _collect_in_work_dir(runner, loop) -> None:
    """Point the loop's CPU-collecting metrics at this launch's folder in
    the work dir (a metric given a ``collect_dir`` of its own keeps it)."""
    evaluator = getattr(loop, 'evaluator', None)
    folder = osp.join(runner.work_dir, PARTS_FOLDER, runner.timestamp)
    for metric in getattr(evaluator, 'metrics', ()):
        if (getattr(metric, 'collect_device', None) == 'cpu'
                and getattr(metric, 'collect_dir', None) is None):
            metric.collect_dir = folder


def _remove_empty_parts(runner) -> None:
    """Rank 0, once the parts are gathered (and their launch folder
    removed): the parts folder too, while nothing else is in it."""
    if is_main_process():
        try:
            os.rmdir(osp.join(runner.work_dir, PARTS_FOLDER))
        except OSError:
            pass  # absent, or holds another launch's parts


def _remove_leftovers(parts: str, keep: Optional[str]) -> None:
    """Remove what killed launches left in ``parts`` (not ``keep``, this
    launch's); a link of that name is removed, never followed."""
    if osp.islink(parts):
        os.remove(parts)
        return
    try:
        names = os.listdir(parts)
    except OSError:
        return
    for name in names:
        if name == keep:
            continue
        try:
            remove_entry(osp.join(parts, name))
        except OSError:
            pass
