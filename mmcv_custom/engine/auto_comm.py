"""The runner side of ``comm_hook = dict(type='auto')``: the trials timed
iteration by iteration, the table the decision came from in the log, and
the decision kept with every checkpoint.

The hook math and the rule are :mod:`mmcv_custom.comm.auto`; this module
gives them what only a runner has: when an iteration starts and ends, the
checkpoint a run resumed from, and the logger. A resumed run keeps the
hook its checkpoint's run chose (and, through the hook state files, that
hook's state bit for bit), unless the world size, the ranks per node or
the ``auto`` settings changed: then the choice was made for another run,
and this one tries again and says why.
"""
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from mmengine.dist import is_main_process

from ..comm.auto import (DECIDING_KEYS, AutoDecision, AutoDispatch, AutoTrials,
                         auto_hook, build_candidates, describe_candidates)
from ..comm.builder import CommHookConfig
from ..comm.config import comm_hook_config
from .process_group import launcher_claim

__all__ = ['AutoComm', 'CHECKPOINT_KEY']

#: Where a checkpoint keeps the decision.
CHECKPOINT_KEY = 'comm_hook_auto'


def _layout() -> List[int]:
    """The world size and the ranks per node every rank's launcher names
    (0 where they do not all name the same): what a decision holds for.
    Collective."""
    claim = launcher_claim()
    local = claim.local_size if claim is not None else 0
    if not (dist.is_available() and dist.is_initialized()):
        return [1, local]
    both = torch.tensor([local, -local], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    agreed = int(both[0]) if int(both[0]) == -int(both[1]) else 0
    return [dist.get_world_size(), agreed]


def _cycle(runner) -> int:
    """Iterations per optimizer step (``accumulative_counts``): one turn
    of the trials."""
    return getattr(runner.optim_wrapper, '_accumulative_counts', 1)


class AutoComm:
    """``auto`` in one run: see the module docstring.

    Args:
        config (CommHookConfig): The run's ``auto`` config, checked with
            its candidates (:func:`~mmcv_custom.comm.config.
            comm_hook_config`), which are built from it as they are.
        loaded (dict, optional): What the checkpoint loaded holds under
            :data:`CHECKPOINT_KEY`. Defaults to None.
    """

    def __init__(self, config: CommHookConfig, loaded=None) -> None:
        self.config = config
        self.settings = config.as_dict()
        self.trials: Optional[AutoTrials] = None
        self.dispatchers: List[AutoDispatch] = []
        self.decision: Optional[AutoDecision] = None
        self._loaded = loaded
        # World size and ranks per node, agreed on in kept().
        self._layout: List[int] = []
        self._started: Optional[float] = None
        self._pending = 0
        # FSDP2: (spec, reduce-scatter) per candidate, and what installs
        # one; None under DDP, whose dispatcher follows the trials itself.
        self._sharded: list = []
        self._switch: Optional[Callable[[int], None]] = None

    def kept(self, runner) -> Optional[AutoDecision]:
        """The decision of the checkpoint this run resumed from, where it
        holds for this run; else None (after saying why on rank 0).
        Collective: every rank calls it, before :meth:`start` or
        :meth:`start_sharded`."""
        self._layout = layout = _layout()
        if runner.iter == 0 or self._loaded is None:
            # A new run, or load_from (weights only): decide for this run.
            return None
        saved = AutoDecision.from_dict(self._loaded)
        why = None
        settings = {k: self.settings[k] for k in DECIDING_KEYS}
        if saved is None:
            why = 'the decision saved with the checkpoint cannot be read'
        elif saved.layout != layout:
            why = (f'it was made on {saved.layout[0]} ranks, '
                   f'{saved.layout[1] or "unnamed"} per node, and this run '
                   f'has {layout[0]}, {layout[1] or "unnamed"} per node')
        elif saved.settings != settings:
            why = (f'it was made with {saved.settings}, and this run asks '
                   f'for {settings}')
        if why is not None:
            if is_main_process():
                runner.logger.warning(
                    f'comm_hook auto: trying the hooks again: {why}.')
            return None
        self.decision = saved
        if is_main_process():
            runner.logger.info(
                f'comm_hook auto: keeping {saved.key} as chosen before this '
                f'run resumed (from the table below); the checkpoint holds '
                'its choice.\n' + '\n'.join(saved.lines()))
        return saved

    def chosen(self) -> CommHookConfig:
        """The decision's config, as checked with the candidates; one a
        checkpoint holds that is none of them, checked here."""
        for candidate, checked in self.config.candidates:
            if candidate.key == self.decision.key:
                return checked
        return comm_hook_config(
            dict(self.decision.config), self.config.sharding)

    def start(self, runner, targets: List[Tuple[str, object]],
              build: Callable[[object, dict], object]) -> None:
        """Build every candidate on every DDP module and register the one
        hook that hands buckets to the candidate under trial.

        Args:
            runner: The runner.
            targets (list): ``(name, ddp)`` per DDP module.
            build (Callable): ``(i, config)`` -> the checked ``config``
                built for the ``i``-th module (a ``CommHookSpec``).
        """
        candidates, configs = zip(*self.config.candidates)
        kept = None
        built = []
        for i in range(len(targets)):
            kept, specs = build_candidates(
                candidates, lambda cfg, i=i: build(i, cfg), configs=configs)
            built.append(specs)
        self.trials = AutoTrials(kept, self.settings, self._layout)
        for (_, ddp), specs in zip(targets, built):
            dispatch = AutoDispatch(self.trials, specs)
            ddp.register_comm_hook(dispatch, auto_hook)
            self.dispatchers.append(dispatch)
        self._announce(runner)

    def start_sharded(self, runner, build: Callable[[CommHookConfig], tuple],
                      install: Callable[[object], None]) -> None:
        """FSDP2: build every candidate's reduce-scatter (those the config
        was checked with: the ones that run under FSDP2) and install the
        first; each turn installs the next (FSDP2 takes a new one between
        iterations), the decision the chosen one.

        Args:
            runner: The runner.
            build (Callable): checked config -> ``(spec, reduce_scatter,
                two_level)``. Collective for a two-level form.
            install (Callable): Installs a reduce-scatter on the model.
        """
        candidates, configs = zip(*self.config.candidates)
        kept, built = build_candidates(
            candidates, build, two_level=lambda b: b[2], configs=configs)
        self.trials = AutoTrials(kept, self.settings, self._layout)
        self._sharded = built
        self._switch = lambda i: install(built[i][1])
        self._switch(self.trials.current)
        self._announce(runner)

    def _announce(self, runner) -> None:
        """Rank 0 says what is tried, when, and whether the run is long
        enough."""
        if not is_main_process():
            return
        kept = self.trials.candidates
        cycle = _cycle(runner)
        need = self.trials.iterations * cycle
        runner.logger.info(
            f'comm_hook auto: trying {len(kept)} hooks of class '
            f"{self.settings['max_loss']!r} or below in turns, "
            f"{1 + self.settings['trial_iters']} rounds of "
            f"{'an iteration' if cycle == 1 else f'{cycle} iterations'} "
            f'each (the first round untimed), from iteration '
            f'{runner.iter + 1} to {runner.iter + need}; then keeping the '
            "fastest by the class rule (a lossier class only "
            f"{self.settings['min_gain']:.0%} or more faster): "
            f'{describe_candidates(kept)}.')
        left = runner.max_iters - runner.iter
        if left < need:
            runner.logger.warning(
                f'comm_hook auto: the trials take {need} iterations but the '
                f'run has {left} left, so it ends before choosing. Run '
                f'longer, lower trial_iters, or name a hook.')

    @property
    def trying(self) -> bool:
        """Whether the trials are on."""
        return self.trials is not None and self.trials.decision is None

    def active(self) -> list:
        """The built hook now taking each DDP module's buckets (under
        FSDP2: the one spec of the reduce-scatter installed)."""
        if self._sharded:
            return [self._sharded[self.trials.current][0]]
        return [d.active for d in self.dispatchers]

    def before_iter(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def after_iter(self, runner) -> bool:
        """Time the iteration; True when the trials just decided (the
        caller then builds the chosen hook and :meth:`settle` s).

        A turn is an accumulation cycle (``accumulative_counts``
        iterations, the last one the only one that sends): timed by the
        iteration, a candidate whose turn fell on an iteration that only
        accumulates would look free.
        """
        if not self.trying or self._started is None:
            return False
        self._pending += 1
        if self._pending < _cycle(runner):
            return False
        seconds = time.perf_counter() - self._started
        self._pending, self._started = 0, None
        decided = self.trials.step_done(seconds)
        if self._switch is not None:
            self._switch(self.trials.current)
        if not decided:
            return False
        self.decision = self.trials.decision
        if is_main_process():
            runner.logger.info(
                f'comm_hook auto: chose {self.decision.key} '
                f'({self.decision.klass}) after iteration {runner.iter + 1}, '
                'from the slowest rank\'s median step of each:\n' +
                '\n'.join(self.decision.lines()))
        return True

    def settle(self, specs: list) -> None:
        """Hand every bucket to the chosen hook, one built per module."""
        for dispatch, spec in zip(self.dispatchers, specs):
            dispatch.settle(spec)

    def record(self, checkpoint: dict) -> None:
        """Keep the decision with a checkpoint (none during the trials:
        a run resumed then tries again)."""
        if self.decision is not None:
            checkpoint[CHECKPOINT_KEY] = self.decision.to_dict()
