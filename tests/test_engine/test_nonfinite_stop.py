"""fp16 overflow that does not stop: warn on isolated events, stop on
persistent ones, never save a checkpoint of non-finite weights."""
import pytest
import torch
from mmengine.model import BaseModel
from torch import nn
from torch.utils.data import Dataset

from mmcv_custom import CommHookRegistrationHook
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner

FP16 = dict(type='fp16_compress')


class _Linear(BaseModel):
    """``loss = sum(p * x)``: the gradient is the input, chosen per step."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(4))

    def forward(self, inputs, data_samples=None, mode='tensor'):
        loss = (self.p * torch.stack(list(inputs)).float()).sum()
        return dict(loss=loss) if mode == 'loss' else [loss]


class _Ramp(Dataset):
    """Inputs of 4 copies of ``small`` for the first ``first_big`` samples
    a rank reads, then of ``big``: with batch size 1, the overflow starts
    at iteration ``first_big + 1``, whatever the sampler's order."""
    metainfo = {}

    def __init__(self, first_big, small=1.0, big=1e5):
        self.first_big, self.small, self.big = first_big, small, big
        self.read = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        value = self.small if self.read < self.first_big else self.big
        self.read += 1
        return dict(inputs=torch.full((4, ), value), data_samples=0)


def _train(rank,
           world_size,
           work_dir,
           dataset,
           optim_wrapper=None,
           hook_args=None,
           max_iters=6):
    runner, records = build_runner(
        work_dir,
        FP16,
        model=_Linear(),
        dataset=dataset,
        batch_size=1,
        max_iters=max_iters,
        optim_wrapper=optim_wrapper,
        hook_args=hook_args,
        checkpoint=dict(type='CheckpointHook', interval=1, by_epoch=False))
    error = None
    try:
        runner.train()
    except Exception as e:  # what the user's run ends with
        error = (type(e).__name__, str(e))
    return error, records.lines, runner.iter


def test_weights_turned_non_finite_stop_the_run_before_any_save(tmp_path):
    # Iterations 1 and 2 are fine; iteration 3 averages 1e5 (> 65504).
    outcome = run_ranks(_train, str(tmp_path), _Ramp(first_big=2))
    for error, lines, _ in outcome:
        assert error[0] == 'NonFiniteGradientsError'
        assert error[1].startswith(
            'Iteration 3: the optimizer applied non-finite gradients, and '
            'the parameters p are no longer finite, so training cannot '
            'recover. Stopped before saving a checkpoint of these weights. '
            # 2 ranks divide by 2 before the all-reduce by default: the
            # advice is not to divide more.
            'fp16 already divides by the world size before the all-reduce, '
            'so the average itself exceeds 65504')
    _, lines, _ = outcome[0]
    assert [lvl for lvl, m in lines
            if 'non-finite' in m] == ['WARNING', 'ERROR']
    saved = sorted(p.name for p in tmp_path.glob('iter_*.pth'))
    assert saved == ['iter_1.pth', 'iter_2.pth']  # nothing from 3 on
    for name in saved:
        weights = torch.load(tmp_path / name)['state_dict']['p']
        assert torch.isfinite(weights).all()
    # The error reached the log file too, not only the traceback.
    (log, ) = tmp_path.glob('*/*.log')
    assert any(
        ' - ERROR - ' in line and 'Iteration 3: the optimizer applied' in line
        for line in log.read_text().splitlines())


# A loss scaler skips the overflowing steps and halves its scale each time:
# gradients of 2e4 x scale overflow fp16 for scales 16 down to 4 (3 steps),
# then fit. The parameters stay finite throughout.
AMP = dict(
    type='CPUAmpOptimWrapper',
    loss_scale=dict(init_scale=16.0, growth_interval=1000),
    optimizer=dict(type='SGD', lr=1e-6))


def test_isolated_overflows_warn_and_training_goes_on(tmp_path):
    outcome = run_ranks(_train, str(tmp_path), _Ramp(0, big=2e4), AMP)
    error, lines, last = outcome[0]
    assert error is None and last == 6
    warnings = [
        m for lvl, m in lines if lvl == 'WARNING' and 'non-finite' in m
    ]
    assert [w.split(':')[0] for w in warnings
            ] == ['Iteration 1', 'Iteration 2', 'Iteration 3']


def test_persistent_overflow_stops_at_the_limit(tmp_path):
    outcome = run_ranks(_train, str(tmp_path), _Ramp(0, big=2e4), AMP,
                        dict(max_nonfinite_iters=2))
    for error, _, _ in outcome:
        assert error == (
            'NonFiniteGradientsError',
            'Iteration 2: gradients were not finite after the all-reduce '
            'in 2 iterations in a row (max_nonfinite_iters=2); the '
            'parameters are still finite (the loss scaler skipped those '
            'steps), but training is not progressing. fp16 already '
            'divides by the world size before the all-reduce, so the '
            'average itself exceeds 65504 or the gradients were not finite: '
            'use bf16_compress, or check the loss (with AMP, the loss '
            'scaler skips such steps).')
    assert sorted(p.name
                  for p in tmp_path.glob('iter_*.pth')) == ['iter_1.pth']


@pytest.mark.parametrize('bad,error,got', [(0, ValueError, '0'),
                                           (-1, ValueError, '-1'),
                                           (2.5, TypeError, 'float: 2.5'),
                                           (True, TypeError, 'bool: True'),
                                           ('3', TypeError, "str: '3'")])
def test_max_nonfinite_iters_is_checked(bad, error, got):
    with pytest.raises(error) as e:
        CommHookRegistrationHook(max_nonfinite_iters=bad)
    assert str(e.value) == (
        f'max_nonfinite_iters should be an int >= 1, but got {got}')
