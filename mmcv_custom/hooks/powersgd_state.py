"""PowerSGD state that survives DDP's bucket layouts and checkpoints.

PyTorch's ``PowerSGDState`` keys its error feedback and warm-start matrices by
*bucket index*, in the layout of that bucket. DDP lays buckets out once for
the first iteration and again after it, and a resumed run builds a fresh DDP
whose first layout differs from the one the checkpoint was taken in. Restored
as is, every residual lands on the wrong parameters.

:class:`PowerSGDStateKeeper` keeps the state correct across layouts: it wraps
the hook, notices when a bucket's parameters change, and moves each
parameter's residual and warm-start ``Q`` into the bucket that now holds it.
The same per-parameter form is what :meth:`PowerSGDStateKeeper.state_dict`
saves, keyed by parameter name, so it can be laid out again for whatever
buckets a resumed run builds. :class:`BatchedPowerSGDStateKeeper` does the
same for batched PowerSGD, whose warm start belongs to a whole bucket.
Imports only torch and numpy (which PyTorch's PowerSGD needs anyway).
"""
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD

from .powersgd import factor_layout
from .state import HookStateKeeper
from .util import named_after

__all__ = ['PowerSGDStateKeeper', 'BatchedPowerSGDStateKeeper']

_VERSION = 1
# PowerSGDState settings that must match for saved residuals to mean the same.
_SETTINGS = ('matrix_approximation_rank', 'min_compression_rate',
             'use_error_feedback', 'warm_start')


class _Layout:
    """Where each parameter's state sits inside one bucket's flat tensors.

    Mirrors PowerSGD's own bookkeeping: residuals follow the bucket buffer
    (parameters in bucket order); ``Q`` matrices exist only for compressed
    parameters, grouped by matrix shape in order of first appearance.
    """

    def __init__(self, state: powerSGD.PowerSGDState,
                 params: List[torch.Tensor]) -> None:
        self.ids = tuple(id(p) for p in params)
        self.error = {}  # id -> (offset, numel)
        self.q = {}  # id -> (offset, numel)
        slots, self.p_size, self.q_size = factor_layout(
            [p.shape for p in params], state.matrix_approximation_rank,
            state.min_compression_rate)
        offset = 0
        for p, slot in zip(params, slots):
            self.error[id(p)] = (offset, p.numel())
            offset += p.numel()
            if slot is not None:
                self.q[id(p)] = slot


class PowerSGDStateKeeper(HookStateKeeper):
    """Keep a ``PowerSGDState`` per parameter across bucket layouts.

    Args:
        state (PowerSGDState): The state the hook runs with.
        names (dict): Parameter -> name, e.g.
            ``{p: n for n, p in ddp.module.named_parameters()}``; names are
            what :meth:`state_dict` is keyed by.

    Example:
        >>> relayout = PowerSGDStateKeeper(state, names)
        >>> ddp.register_comm_hook(state, relayout.wrap(powerSGD_hook))
        >>> torch.save(relayout.state_dict(), path)        # later
        >>> relayout.load_state_dict(torch.load(path))     # new run
    """

    def __init__(self, state: powerSGD.PowerSGDState,
                 names: Dict[torch.Tensor, str]) -> None:
        self.state = state
        self._names = {id(p): n for p, n in names.items()}
        self._ids = {n: pid for pid, n in self._names.items()}
        self._numel = {n: p.numel() for p, n in names.items()}
        self._layouts: Dict[int, _Layout] = {}
        # Parameter id -> index of the bucket that holds its state.
        self._where: Dict[int, int] = {}
        # Parameter id -> {'error': Tensor, 'q': Tensor or None}, for
        # parameters whose state is not in any bucket right now.
        self._pending: Dict[int, dict] = {}

    # -- keeping buckets right -------------------------------------------
    def wrap(self, hook: Callable) -> Callable:
        """``hook`` with the state laid out for each bucket first.

        Wrap PowerSGD's hook directly (inside any half-precision wrapper), so
        that the state is built in the dtype PowerSGD computes in.
        """

        def _relayout_hook(state, bucket: dist.GradBucket):
            self._prepare(bucket)
            return hook(state, bucket)

        return named_after(_relayout_hook, hook)

    def _prepare(self, bucket: dist.GradBucket) -> None:
        index = bucket.index()
        params = bucket.parameters()
        old = self._layouts.get(index)
        if old is not None and old.ids == tuple(id(p) for p in params):
            return
        if old is not None:
            self._evict(index, old)
        layout = _Layout(self.state, params)
        self._layouts[index] = layout
        self._install(index, layout, params, bucket.buffer())

    def _evict(self, index: int, layout: _Layout) -> None:
        """Move bucket ``index``'s state into per-parameter form."""
        for pid in layout.ids:
            if self._where.get(pid) != index:
                continue  # already taken by its new bucket
            del self._where[pid]
            entry = self._slice(index, layout, pid)
            if entry is not None:
                self._pending[pid] = entry
        for table in (self.state.error_dict, self.state.p_memory_dict,
                      self.state.q_memory_dict):
            table.pop(index, None)
        del self._layouts[index]

    def _slice(self, index: int, layout: _Layout, pid: int) -> Optional[dict]:
        error = self.state.error_dict.get(index)
        q = self.state.q_memory_dict.get(index)
        if error is None and q is None:
            return None
        entry = dict(error=None, q=None)
        if error is not None:
            off, numel = layout.error[pid]
            entry['error'] = error[off:off + numel].clone()
        if q is not None and pid in layout.q and q.numel() == layout.q_size:
            off, numel = layout.q[pid]
            entry['q'] = q[off:off + numel].clone()
        return entry

    def _take(self, pid: int) -> Optional[dict]:
        """A parameter's state: pending, or still in its old bucket."""
        if pid in self._pending:
            return self._pending.pop(pid)
        index = self._where.pop(pid, None)
        if index is None:
            return None
        # Its old bucket has not been laid out again yet; it gives the
        # parameter up now.
        return self._slice(index, self._layouts[index], pid)

    def _install(self, index: int, layout: _Layout, params,
                 buffer: torch.Tensor) -> None:
        entries = {pid: self._take(pid) for pid in layout.ids}
        for pid in layout.ids:
            self._where[pid] = index
        if not any(entries.values()):
            return  # nothing known yet: PowerSGD starts this bucket itself
        # What PowerSGD computes in: the bucket as it receives it (half
        # precision under a wrapper).
        ref = buffer
        errors, have_all_q = [], True
        q = torch.empty(layout.q_size, dtype=ref.dtype, device=ref.device)
        for p in params:
            entry = entries[id(p)] or {}
            error = entry.get('error')
            errors.append(
                error.to(ref.device, ref.dtype) if error is not None else torch
                .zeros(p.numel(), dtype=ref.dtype, device=ref.device))
            if id(p) in layout.q:
                off, numel = layout.q[id(p)]
                saved = entry.get('q')
                if saved is None or saved.numel() != numel:
                    have_all_q = False
                else:
                    q[off:off + numel].copy_(saved)
        if any(
                entry and entry.get('error') is not None
                for entry in entries.values()):
            self.state.error_dict[index] = torch.cat(errors)
        if have_all_q and layout.q_size:
            # P is recomputed from Q before use; only its size matters (a
            # bucket without P memory would draw new random Qs).
            self.state.q_memory_dict[index] = q
            self.state.p_memory_dict[index] = torch.empty(
                layout.p_size, dtype=ref.dtype, device=ref.device)

    # -- checkpoints -------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state, per parameter name, on the CPU."""
        per_param = {}
        for pid, entry in self._pending.items():
            per_param[self._names.get(pid, str(pid))] = entry
        for pid, index in self._where.items():
            entry = self._slice(index, self._layouts[index], pid)
            if entry is not None:
                per_param[self._names.get(pid, str(pid))] = entry
        cpu = {
            name: {
                k: (v.cpu() if v is not None else None)
                for k, v in entry.items()
            }
            for name, entry in per_param.items()
        }
        return dict(
            version=_VERSION,
            iter=self.state.iter,
            total_numel_before_compression=(
                self.state.total_numel_before_compression),
            total_numel_after_compression=(
                self.state.total_numel_after_compression),
            rng=self.state.rng.get_state(),
            settings={k: getattr(self.state, k)
                      for k in _SETTINGS},
            params=cpu)

    def check_state_dict(self, saved) -> None:
        """Raise ``ValueError`` naming why ``saved`` cannot be restored.

        Looks at everything :meth:`load_state_dict` will use, and changes
        nothing, so that every rank can try first and all restore only
        when all can (see the runner hook).
        """
        if not isinstance(saved, dict):
            raise ValueError(f'expected a dict, found {type(saved).__name__}')
        if saved.get('version') != _VERSION:
            raise ValueError(f'PowerSGD state version {saved.get("version")}'
                             f' is not {_VERSION}')
        mine = {k: getattr(self.state, k) for k in _SETTINGS}
        if saved.get('settings') != mine:
            raise ValueError(f'PowerSGD settings differ: saved '
                             f'{saved.get("settings")}, now {mine}')
        for key in ('iter', 'total_numel_before_compression',
                    'total_numel_after_compression'):
            if not isinstance(saved.get(key), int):
                raise ValueError(f'{key} is {saved.get(key)!r}, not an int')
        params = saved.get('params')
        if not isinstance(params, dict):
            raise ValueError('it holds no per-parameter state')
        unknown = sorted(set(params) - set(self._ids))
        if unknown:
            raise ValueError('the saved PowerSGD state has parameters this '
                             f'model does not: {unknown[:5]}')
        for name, entry in params.items():
            error = entry.get('error') if isinstance(entry, dict) else 0
            if not (error is None or (isinstance(error, torch.Tensor)
                                      and error.numel() == self._numel[name])):
                raise ValueError(f'the error feedback of {name} does not '
                                 'fit the parameter')
            if not (entry.get('q') is None
                    or isinstance(entry.get('q'), torch.Tensor)):
                raise ValueError(f'the warm start of {name} is not a tensor')
        try:
            np.random.RandomState().set_state(saved.get('rng'))
        except (TypeError, ValueError) as e:
            raise ValueError(f'its random generator state is unusable ({e})')

    def load_state_dict(self, saved: dict) -> None:
        """Restore :meth:`state_dict`'s output before the first step.

        Raises:
            ValueError: See :meth:`check_state_dict`; nothing is changed
                then, and the caller decides whether to start fresh.
        """
        self.check_state_dict(saved)
        self.state.iter = saved['iter']
        self.state.total_numel_before_compression = saved[
            'total_numel_before_compression']
        self.state.total_numel_after_compression = saved[
            'total_numel_after_compression']
        self.state.rng.set_state(saved['rng'])
        self._clear()
        self._pending = {
            self._ids[name]: entry
            for name, entry in saved['params'].items()
        }

    #: What a restore brings back, for the log.
    RESTORED = 'error feedback, warm start, iteration counter'
    FEEDBACK_KEY = 'use_error_feedback'

    def fresh_note(self, steps_done: int) -> str:
        """What :meth:`start_fresh` means for the run, for the log."""
        start = self.state.start_powerSGD_iter
        then = (f'compression goes on at once (the run is past '
                f'start_powerSGD_iter={start})' if steps_done >= start else
                f'its warm-up of plain all-reduces goes on until step '
                f'{start} (start_powerSGD_iter)')
        return ('error feedback from zero and new warm-start matrices; ' +
                then)

    def start_fresh(self, steps_done: int) -> None:
        """Forget every residual and warm start, keeping the step count.

        For a resumed run whose saved state cannot be used: PowerSGD's
        warm-up (``start_powerSGD_iter`` plain all-reduces) protects the
        first steps of a *new* run, so it is not run again; compression
        resumes at once past it, from zero error feedback and new random
        warm-start matrices drawn from ``random_seed``.

        Args:
            steps_done (int): Gradient-synchronising steps already taken
                (iterations divided by the accumulation count).
        """
        self._clear()
        self._pending = {}
        self.state.iter = steps_done

    def _clear(self) -> None:
        for table in (self.state.error_dict, self.state.p_memory_dict,
                      self.state.q_memory_dict):
            table.clear()
        self._layouts.clear()
        self._where.clear()


class BatchedPowerSGDStateKeeper(PowerSGDStateKeeper):
    """:class:`PowerSGDStateKeeper` for :func:`batched_powersgd_hook`.

    Its error feedback follows the bucket buffer as PowerSGD's does and is
    kept per parameter the same way. Its warm-start matrix ``Q`` compresses
    the whole bucket as one square matrix, so it means something only for
    a bucket of the same parameters in the same order: it is kept per
    bucket *composition*, put back whenever DDP builds a bucket of exactly
    those parameters, and otherwise drawn afresh (never reused for other
    parameters, as the hook alone would when the shapes happen to match).
    A resumed DDP lays out its first step's buckets as a new run does, so
    the saved matrices come back from its second step on.
    """

    def __init__(self, state: powerSGD.PowerSGDState,
                 names: Dict[torch.Tensor, str]) -> None:
        super().__init__(state, names)
        # Parameter ids of a bucket, in order -> its warm-start Q.
        self._bucket_q: Dict[tuple, torch.Tensor] = {}

    def _slice(self, index: int, layout: _Layout, pid: int) -> Optional[dict]:
        error = self.state.error_dict.get(index)
        if error is None:
            return None
        off, numel = layout.error[pid]
        return dict(error=error[off:off + numel].clone(), q=None)

    def _evict(self, index: int, layout: _Layout) -> None:
        q = self.state.q_memory_dict.get(index)
        if q is not None:
            self._bucket_q[layout.ids] = q
        super()._evict(index, layout)

    def _install(self, index: int, layout: _Layout, params,
                 buffer: torch.Tensor) -> None:
        super()._install(index, layout, params, buffer)
        q = self._bucket_q.pop(layout.ids, None)
        if q is not None:
            self.state.q_memory_dict[index] = q.to(buffer.device, buffer.dtype)

    def state_dict(self) -> dict:
        out = super().state_dict()
        known = dict(self._bucket_q)
        for index, layout in self._layouts.items():
            q = self.state.q_memory_dict.get(index)
            if q is not None:
                known[layout.ids] = q
        out['bucket_q'] = [([self._names[pid] for pid in ids], q.cpu())
                           for ids, q in known.items()]
        return out

    def check_state_dict(self, saved) -> None:
        super().check_state_dict(saved)
        bucket_q = saved.get('bucket_q')
        if not isinstance(bucket_q, list) or not all(
                isinstance(item, (list, tuple)) and len(item) == 2
                and isinstance(item[1], torch.Tensor)
                and set(item[0]) <= set(self._ids) for item in bucket_q):
            raise ValueError('its batched warm-start matrices are not '
                             'tensors of this model\'s buckets')

    def load_state_dict(self, saved: dict) -> None:
        super().load_state_dict(saved)
        self._bucket_q = {
            tuple(self._ids[name] for name in names): q
            for names, q in saved['bucket_q']
        }

    def _clear(self) -> None:
        super()._clear()
        self._bucket_q = {}
