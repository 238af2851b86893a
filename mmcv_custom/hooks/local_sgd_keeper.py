"""What ``post_local_sgd`` and ``diloco`` save beside a checkpoint, per rank.

Between synchronisations every node trains its own model: MMEngine's
checkpoint (rank 0's model and optimizer, loaded by every rank) describes
rank 0's node only. To resume bit for bit mid-period, every rank saves its
own parameters, buffers and optimizer state, and the algorithm's state: the
step (so the schedule goes on where it stood), DiLoCo's global parameters,
outer momentum and error feedback (this rank's slice of each), and the
inner exchange's own state (int8's error feedback, PowerSGD's). A file of
another algorithm, node layout or setting is refused, and the run starts
the algorithm afresh from the checkpoint's weights
(:mod:`mmcv_custom.engine.hook_state_files` decides that for all ranks
together). Torch only.
"""
from typing import Dict, Optional

import torch

from . import diloco_stream
from .local_sgd import DiLoCoState, PeriodicState
from .state import HookStateKeeper

__all__ = ['PeriodicStateKeeper']

# Version of the saved dict.
_FORMAT = 1


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to('cpu', copy=True)


def _settings(state: PeriodicState) -> dict:
    """The settings a saved state only means something under."""
    out = dict(period=state.period, start_iter=state.start_iter)
    if getattr(state, 'group_periods', None):
        out['group_periods'] = sorted(state.group_periods.items())
    if isinstance(state, DiLoCoState):
        out.update(
            outer_format=state.outer_format,
            block_size=state.block_size,
            error_feedback=state.error_feedback)
        if state.streaming:  # a plain run's files keep their settings
            out.update(
                fragments=state.fragments,
                overlap=state.overlap,
                mix=state.mix)
    return out


class PeriodicStateKeeper(HookStateKeeper):
    """The :class:`~.state.HookStateKeeper` of both periodic algorithms.

    Args:
        state (PeriodicState): The hook's state, with its module attached
            (:meth:`~.local_sgd.PeriodicState.attach`) before anything is
            saved or restored.
        names (dict): Parameter -> name of the DDP model.
    """

    RESTORED = ('each rank\'s own parameters, buffers and optimizer state, '
                'and the step in the period')

    def fresh_note(self, steps_done: int) -> str:
        """What :meth:`start_fresh` means for the run, for the log. The
        periods keep their places (:meth:`~.local_sgd.PeriodicState.due`
        counts them from ``start_iter``, not from the resume), so the next
        synchronisation may come before a whole period."""
        state = self.state
        done = max(steps_done - state.start_iter, 0)
        sync = state.start_iter + (done // state.period + 1) * state.period
        outer = ''
        if isinstance(state, DiLoCoState):
            outer = (', DiLoCo\'s global parameters taken from them, its '
                     'outer momentum' +
                     (' and error feedback' if state.error_feedback else '') +
                     ' from zero')
        start = (f' after start_iter={state.start_iter}'
                 if state.start_iter else '')
        return (f'every rank goes on from the checkpoint\'s weights and '
                f'optimizer state (rank 0\'s){outer}; the next '
                f'synchronisation is after step {sync} (the periods of '
                f'{state.period} steps{start} keep their places)')

    @classmethod
    def file_bytes(cls,
                   params,
                   state_kwargs: dict,
                   *,
                   optimizer_states: int = 2) -> int:
        """The rank's trainable parameters, in their dtype, and
        ``optimizer_states`` copies of them for the optimizer (AdamW's two
        moments by default): every rank's differ within a period. DiLoCo's
        state of the rank's slice and the inner exchange's are their
        records' to count (the preflight adds them)."""
        trainable = sum(p.numel() * p.element_size() for p in params
                        if p.requires_grad)
        return trainable * (1 + optimizer_states)

    def __init__(self, state: PeriodicState, names: Dict[torch.Tensor,
                                                         str]) -> None:
        self.state = state
        self.names = names

    def _inners(self):
        state = self.state
        return [(key, inner.keeper)
                for key, inner in (('world', state.world_inner),
                                   ('intra', state.intra_inner))
                if inner is not None and inner.keeper is not None]

    def state_dict(self) -> dict:
        state = self.state
        module = state.module
        out = dict(
            format=_FORMAT,
            algorithm=state.algorithm,
            layout=[list(node) for node in state.groups.layout.nodes],
            settings=_settings(state),
            steps=state.steps,
            synced_at=state.synced_at,
            params={
                name: _cpu(p)
                for p, name in self.names.items() if p.requires_grad
            },
            buffers={
                name: _cpu(b)
                for name, b in module.named_buffers()
            },
            optimizer=(None if state.optimizer is None else
                       state.optimizer.state_dict()),
            inner={
                key: keeper.state_dict()
                for key, keeper in self._inners()
            })
        if isinstance(state, DiLoCoState):
            out['outer'] = None if state.global_params is None else dict(
                slice=[state.my_slice().start,
                       state.my_slice().stop],
                global_params=_cpu(state.global_params),
                momentum=_cpu(state.momentum),
                residual=(
                    None if state.residual is None else _cpu(state.residual)))
            if state.streaming:
                # The exchanges in flight, waited for: a resumed run
                # applies the same values at the same steps.
                out['in_flight'] = diloco_stream.pending_results(state)
        return out

    def check_state_dict(self, saved) -> None:
        state = self.state
        if not isinstance(saved, dict) or saved.get('format') != _FORMAT:
            raise ValueError('it holds no state of post_local_sgd or diloco '
                             'of this mmcv_custom version')
        if saved.get('algorithm') != state.algorithm:
            raise ValueError(f"it holds the state of {saved.get('algorithm')}"
                             f', not of {state.algorithm}')
        layout = [list(node) for node in state.groups.layout.nodes]
        if saved.get('layout') != layout:
            raise ValueError(
                f"it was saved on the nodes {saved.get('layout')}, this run "
                f'has {layout} ({state.groups.layout.describe()})')
        mine = _settings(state)
        if saved.get('settings') != mine:
            changed = ', '.join(
                f'{k}={saved["settings"].get(k)!r} then, {v!r} now'
                for k, v in mine.items()
                if saved['settings'].get(k) != v) if isinstance(
                    saved.get('settings'), dict) else 'unreadable'
            raise ValueError(f'it was saved under other settings ({changed})')
        params = saved.get('params')
        for p, name in self.names.items():
            if not p.requires_grad:
                continue
            got = params.get(name) if isinstance(params, dict) else None
            if not isinstance(got, torch.Tensor) or got.shape != p.shape:
                raise ValueError(f'its parameter {name} is ' + (
                    'missing' if got is None else
                    f'of shape {tuple(getattr(got, "shape", ()))}, the '
                    f'model\'s is {tuple(p.shape)}'))
        if (saved.get('optimizer') is None) != (state.optimizer is None):
            raise ValueError('it holds no optimizer state' if saved.get(
                'optimizer') is None else 'this run has no optimizer to '
                             'restore its optimizer state into')
        if isinstance(state, DiLoCoState) and saved.get('outer') is not None:
            part = state.my_slice()
            if saved['outer'].get('slice') != [part.start, part.stop]:
                raise ValueError(
                    f"its outer state covers {saved['outer'].get('slice')} "
                    f'of the parameters, this rank\'s slice is '
                    f'{[part.start, part.stop]}')
        for pending in saved.get('in_flight') or []:
            span = diloco_stream.fragment_span(state, pending['fragment'])
            if pending['result'].numel() != span.stop - span.start:
                raise ValueError(
                    f"its exchange in flight of fragment "
                    f"{pending['fragment']} holds {pending['result'].numel()}"
                    f' values, the fragment has {span.stop - span.start}')
        inner = saved.get('inner') or {}
        for key, keeper in self._inners():
            keeper.check_state_dict(inner.get(key))

    def load_state_dict(self, saved: dict) -> None:
        state = self.state
        with torch.no_grad():
            for p, name in self.names.items():
                if p.requires_grad:
                    p.copy_(saved['params'][name])
            buffers = saved['buffers']
            for name, b in state.module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        if state.optimizer is not None:
            state.optimizer.load_state_dict(saved['optimizer'])
        state.steps = saved['steps']
        state.synced_at = saved['synced_at']
        if isinstance(state, DiLoCoState):
            outer: Optional[dict] = saved.get('outer')
            device = next(state.module.parameters()).device
            if outer is None:
                state.global_params = None
            else:
                state.global_params = outer['global_params'].to(device)
                state.momentum = outer['momentum'].to(device)
                state.residual = (None if outer['residual'] is None else
                                  outer['residual'].to(device))
            diloco_stream.restore_pending(state, saved.get('in_flight', []),
                                          device)
        inner = saved.get('inner') or {}
        for key, keeper in self._inners():
            keeper.load_state_dict(inner[key])

    def start_fresh(self, steps_done: int) -> None:
        """Go on from the weights every rank holds (the checkpoint's): the
        step kept, a new period from here, DiLoCo's global parameters taken
        at the next step, no momentum, no error feedback."""
        state = self.state
        state.steps = state.synced_at = steps_done
        if isinstance(state, DiLoCoState):
            state.global_params = state.momentum = state.residual = None
            state.in_flight = []
        for _, keeper in self._inners():
            keeper.start_fresh(steps_done)
