"""The fp16 range guard's runner side: each non-finite average named once,
and the run stopped before a checkpoint of bad weights.

:class:`~mmcv_custom.hooks.half.CompressState` notes the buckets whose
average is not finite (``check_finite``); after each iteration
:class:`NonFiniteGuard` warns about each, naming its parameters, with
advice that fits the hook's settings, and stops the run when the
parameters themselves turned non-finite or after ``max_nonfinite_iters``
such iterations in a row.
"""
from typing import Callable, List, Optional

import torch
from mmengine.dist import get_world_size, is_main_process

from ..hooks.half import CompressState

__all__ = ['NonFiniteGuard', 'NonFiniteGradientsError']

_NONFINITE_ADVICE = (
    "In fp16 the sum of the ranks' shares overflows above 65504: use "
    'predivide_factor=<world size> or bf16_compress, or check the loss '
    '(with AMP, the loss scaler skips such steps).')
# bf16 has fp32's range: the all-reduce itself cannot overflow.
_NONFINITE_ADVICE_BF16 = (
    'bf16 has the range of fp32, so the gradients were not finite before '
    'the all-reduce: check the loss and the learning rate (with AMP, the '
    'loss scaler skips such steps).')

# fp16 already divides everything before the all-reduce: only the mean
# itself can be out of range.
_NONFINITE_ADVICE_FP16_MEAN = (
    'fp16 already divides by the world size before the all-reduce, so the '
    'average itself exceeds 65504 or the gradients were not finite: use '
    'bf16_compress, or check the loss (with AMP, the loss scaler skips '
    'such steps).')


def _nonfinite_advice(spec, world_size: int) -> str:
    """What to do about non-finite averages, for this hook's settings."""
    if spec.type == 'bf16_compress':
        return _NONFINITE_ADVICE_BF16
    state = spec.state
    if (isinstance(state, CompressState)
            and state.factors(torch.float16, world_size)[0] >= world_size):
        return _NONFINITE_ADVICE_FP16_MEAN
    return _NONFINITE_ADVICE


class NonFiniteGradientsError(RuntimeError):
    """Training stopped: the all-reduced gradients stay non-finite."""


def _first_names(names: List[str], shown: int = 5) -> str:
    """``'a, b, c, d, e and 3 more'``: parameter names for a log line."""
    more = f' and {len(names) - shown} more' if len(names) > shown else ''
    return ', '.join(names[:shown]) + more


class NonFiniteGuard:
    """Counts iterations in a row with non-finite averages, and stops.

    Args:
        max_nonfinite_iters (int, optional): Stop after this many
            iterations in a row; None: only when the parameters turn
            non-finite.
    """

    def __init__(self, max_nonfinite_iters: Optional[int]) -> None:
        self.max_nonfinite_iters = max_nonfinite_iters
        self.streak = 0

    def check(self, runner, installed: list,
              broken_params: Callable[[], List[str]]) -> None:
        """Warn about each non-finite bucket; stop when it does not pass.

        The averages are the same on every rank, so every rank decides the
        same way at the same iteration, and the registration hook runs
        before the CheckpointHook: a stopped run saves nothing after the
        bad step.

        Args:
            runner: The runner.
            installed (list): ``(name, spec, counter, names by id)`` per
                DDP module.
            broken_params (Callable): The names of the parameters that are
                no longer finite (asked only after a bad iteration).
        """
        bad, advice = False, _NONFINITE_ADVICE
        world_size = get_world_size()
        for name, spec, _, names in installed:
            state = spec.state
            if not (isinstance(state, CompressState) and state.check_finite):
                continue
            for index, params in state.pop_nonfinite():
                bad = True
                shown = _first_names([names.get(id(p), '?') for p in params])
                where = f' of {name}' if name else ''
                runner.logger.warning(
                    f'Iteration {runner.iter + 1}: non-finite gradients '
                    f'after the {spec.type} all-reduce in DDP bucket '
                    f'{index}{where} (parameters: {shown}). '
                    f'{_nonfinite_advice(spec, world_size)}')
                advice = _nonfinite_advice(spec, world_size)
        if not bad:
            self.streak = 0
            return
        self.streak += 1
        broken = broken_params()
        if broken:
            self._stop(
                runner, advice, f'Iteration {runner.iter + 1}: the '
                'optimizer applied non-finite gradients, and the parameters '
                f'{_first_names(broken)} are no longer finite, so '
                'training cannot recover. Stopped before saving a '
                'checkpoint of these weights.')
        limit = self.max_nonfinite_iters
        if limit is not None and self.streak >= limit:
            self._stop(
                runner, advice, f'Iteration {runner.iter + 1}: gradients '
                'were not finite after the all-reduce in '
                f'{self.streak} '
                'iterations in a row (max_nonfinite_iters='
                f'{limit}); the parameters are still finite (the loss '
                'scaler skipped those steps), but training is not '
                'progressing.')

    @staticmethod
    def _stop(runner, advice: str, message: str) -> None:
        message = f'{message} {advice}'
        # Every rank stops (they see the same averages); one says why,
        # in the log file (the tools' failure report prints it once:
        # failure_cause keeps the record off their console).
        if is_main_process():
            runner.logger.error(message, extra={'failure_cause': True})
        raise NonFiniteGradientsError(message)
