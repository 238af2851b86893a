"""The run's side of ``post_local_sgd`` and ``diloco``: what the runner
hook does for them beyond registering their DDP hook.

* **Buffers.** DDP broadcasts rank 0's buffers before every forward, a
  collective across the nodes each step (11 KB for the FCN toy): it is
  turned off, and the floating-point buffers (BatchNorm's statistics) are
  averaged over every rank at each synchronisation instead. SyncBatchNorm
  (GPU runs) is put on the node's group, for the same reason.
* **The step.** After every optimizer step (not after the iterations that
  only accumulate gradients), every rank counts it and, at the end of a
  period, synchronises: before the CheckpointHook saves and before
  validation (this hook's priority is higher). The run's last iteration
  synchronises whatever the period, so the model it ends with, saves and
  evaluates is the nodes' common one.
* **State.** Each rank's own parameters, buffers and optimizer state go
  into its hook state file (:mod:`.hook_state_files`,
  :class:`~mmcv_custom.hooks.local_sgd_keeper.PeriodicStateKeeper`), so a
  resume mid-period is bit for bit.
* **Telemetry.** ``cross_MB``: the MiB this rank sent across the nodes per
  step, averaged over the last period (the synchronisation included);
  ``sync_wait``: the seconds the synchronisations took, averaged the same
  way; ``comm_MB`` and ``comm_ratio`` count the inner exchange and the
  synchronisation, averaged the same way (a synchronisation's bytes fall
  on one step in ``period``).
"""
import collections
from typing import List, Optional

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.runner import IterBasedTrainLoop
from torch.nn import SyncBatchNorm

from ..hooks.local_sgd import PeriodicState

__all__ = ['PeriodicSync']

_SAVE = "the CheckpointHook's save"


def _aligned(interval: int, period: int, start: int, accumulate: int) -> bool:
    """Whether every ``interval``-th iteration ends a period (periods of
    optimizer steps, ``accumulate`` iterations each, after ``start``)."""
    return interval % (period * accumulate) == 0 and start % period == 0


def _accumulate(runner) -> int:
    """Iterations per optimizer step (gradient accumulation)."""
    return max(
        int(getattr(runner.optim_wrapper, '_accumulative_counts', 1)), 1)


class PeriodicSync:
    """Steps the periodic states of a run's DDP modules (see the module's
    docstring). Made by :meth:`install`, None for other hooks.

    Args:
        entries (list): ``(name, ddp, spec, counter)`` per DDP module with
            a periodic hook.
        accumulate (int): Iterations per optimizer step.
    """

    def __init__(self, entries: list, accumulate: int = 1) -> None:
        self.entries = entries
        period = entries[0][2].state.period
        # The last period: per optimizer step, and per iteration.
        self._cross = collections.deque(maxlen=period)
        self._waits = collections.deque(maxlen=period)
        self._sent = collections.deque(maxlen=period * accumulate)
        self._baseline = collections.deque(maxlen=period * accumulate)

    @classmethod
    def install(cls, runner, targets, installed) -> Optional['PeriodicSync']:
        """Set up the modules whose hook is periodic, before any restore
        (the state keeper restores into the modules attached here)."""
        entries = [(name, ddp, spec, counter)
                   for (name, ddp), (_, spec, counter,
                                     _) in zip(targets, installed)
                   if isinstance(spec.state, PeriodicState)]
        if not entries:
            return None
        # The optimizer wrapper's state: the optimizer's, and an AMP loss
        # scaler's (its skips differ between nodes between synchronisations).
        optimizer = runner.optim_wrapper
        for i, (_, ddp, spec, _) in enumerate(entries):
            state: PeriodicState = spec.state
            ddp.broadcast_buffers = False
            for module in ddp.module.modules():
                if isinstance(module, SyncBatchNorm):
                    module.process_group = state.groups.intra
            # One wrapper holds every module's optimizer state: saved once.
            state.attach(ddp.module, optimizer if i == 0 else None)
        sync = cls(entries, _accumulate(runner))
        if is_main_process():
            sync._log_start(runner)
        return sync

    def _log_start(self, runner) -> None:
        state: PeriodicState = self.entries[0][2].state
        kind = state.algorithm
        after = (f'after optimizer step {state.start_iter} + k x '
                 f'{state.period}' if state.start_iter else
                 f'every {state.period} optimizer steps')
        stream = ''
        if getattr(state, 'streaming', False):
            stream = (f', in {state.fragments} fragment'
                      f'{"s" if state.fragments > 1 else ""} at staggered '
                      'steps of the period' +
                      (f', each exchange running beside the next '
                       f'{state.overlap} step'
                       f'{"s" if state.overlap > 1 else ""} and mixed in '
                       f'with mix={state.mix}' if state.overlap else ''))
        runner.logger.info(
            f'{kind}: the model is synchronised across the '
            f'{state.num_nodes} node{"s" if state.num_nodes > 1 else ""} '
            f'{after}{stream} and at the last iteration; DDP\'s buffer '
            'broadcast before each forward is off, and the floating-point '
            'buffers (BatchNorm statistics) are averaged over all ranks at '
            'each synchronisation; each rank saves its own parameters, '
            'buffers and optimizer state beside each checkpoint.')
        if state.num_nodes == 1:
            runner.logger.warning(
                f'{kind} on one node: DiLoCo with one worker, a Lookahead '
                'optimizer (the outer step applied to the inner steps\' '
                'progress); nothing is sent across nodes.')
        accumulate = _accumulate(runner)
        for what, interval in self._intervals(runner):
            if not _aligned(interval, state.period, state.start_iter,
                            accumulate):
                runner.logger.warning(
                    self._misaligned_note(state, what, interval, accumulate))

    @staticmethod
    def _misaligned_note(state: PeriodicState, what: str, interval: int,
                         accumulate: int) -> str:
        """Why ``what`` every ``interval`` iterations sees each node's own
        model, and the interval that would not."""
        kind, period, start = state.algorithm, state.period, state.start_iter
        iters = period * accumulate
        steps = (f'{period} steps ({iters} iterations)'
                 if accumulate > 1 else f'{period} steps')
        after = f' after start_iter={start}' if start else ''
        effect = ('the checkpoint holds node 0\'s (a resume is still bit for '
                  'bit: every rank saves its own state), not the synchronised '
                  'one' if what == _SAVE else
                  'each rank evaluates its node\'s model on its share of the '
                  'data')
        fix = ''
        if start % period:
            fix = f', with a start_iter of a multiple of {period},'
        return (f'{kind}: {what} every {interval} iterations does not fall '
                f'at the end of a period of {steps}{after}: there each node '
                f'holds its own model, so {effect}. An interval of a '
                f'multiple of {iters}{fix} avoids it.')

    @staticmethod
    def _intervals(runner) -> List[tuple]:
        """What acts on the model every N iterations: the CheckpointHook's
        saves and the validation, each as ``(what, N)``."""
        out = [(_SAVE, hook.interval) for hook in runner.hooks
               if isinstance(hook, CheckpointHook) and not hook.by_epoch
               and hook.interval > 0]
        loop = runner.train_loop
        val = getattr(loop, 'val_interval', None)
        if isinstance(loop, IterBasedTrainLoop) and val and getattr(
                runner, '_val_loop', None) is not None:
            out.append(('validation', val))
        # One at the last iteration only sees the synchronised model.
        return [(what, n) for what, n in out if n < runner.max_iters]

    def after_train_iter(self, runner) -> None:
        """Count the step and synchronise when due; publish the traffic."""
        wrapper = runner.optim_wrapper
        if hasattr(wrapper, 'should_update') and not wrapper.should_update():
            return
        last = runner.iter + 1 >= runner.max_iters
        cross, seconds = 0, 0.0
        for _, _, spec, counter in self.entries:
            state: PeriodicState = spec.state
            report = state.after_step()
            if report is not None:
                seconds += report.seconds
            # The last iteration ends mid-period (or, streaming, with
            # fragments synchronised steps ago): meet now (pending local
            # steps imply the warm-up is over).
            if last and state.pending() > 0:
                seconds += state.sync().seconds
            sent = state.pop_sent()
            cross += state.pop_cross()
            if counter is not None:
                counter.bytes_sent += sent
        self._cross.append(cross)
        self._waits.append(seconds)
        hub = runner.message_hub
        hub.update_scalar('train/cross_MB',
                          sum(self._cross) / len(self._cross) / 2**20)
        hub.update_scalar('train/sync_wait',
                          sum(self._waits) / len(self._waits))

    def over_period(self, sent: int, baseline: int) -> tuple:
        """This iteration's bytes sent and baseline, added to the last
        period's: ``(mean bytes sent per iteration, sent / baseline)``
        over it (ratio None without a baseline), what ``comm_MB`` and
        ``comm_ratio`` show, as ``cross_MB``: the synchronisation's bytes
        fall on one step in ``period``."""
        self._sent.append(sent)
        self._baseline.append(baseline)
        total = sum(self._baseline)
        return (sum(self._sent) / len(self._sent),
                sum(self._sent) / total if total else None)
