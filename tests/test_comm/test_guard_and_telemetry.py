"""The fp16 range guard and the traffic telemetry, on real gloo ranks."""
import glob
import os.path as osp
import threading
import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.comm.telemetry import CommCounter, add_baseline_count
from mmcv_custom.hooks.half import (CompressState, default_predivide_factor,
                                    fp16_compress_hook)
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner


def test_default_predivide_factor_splits_like_fsdp():
    assert [default_predivide_factor(n)
            for n in (1, 2, 4, 8, 16, 64, 6)] == [1, 2, 2, 4, 4, 8, 4]


def test_predivide_factor_must_be_positive():
    with pytest.raises(ValueError, match='but got 0'):
        CompressState(predivide_factor=0)


class _One(nn.Module):

    def __init__(self, n):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return (self.p * x).sum()


def _reduce(rank, world_size, value, predivide_factor):
    state = CompressState(None, predivide_factor, check_finite=True)
    model = DDP(_One(3))
    model.register_comm_hook(state, fp16_compress_hook)
    model(torch.tensor([value, 1.0, -1.0])).backward()
    found = [(index, [tuple(p.shape) for p in params])
             for index, params in state.pop_nonfinite()]
    return model.module.p.grad, found, state.pop_nonfinite()


def test_overflow_of_the_sum_is_detected_and_avoidable():
    # 4 ranks of 4.8e4: the mean fits fp16, the default split (2 before, 2
    # after) sums 4 x 2.4e4 = 9.6e4 in fp16, which overflows.
    grad, found, again = run_ranks(_reduce, 4.8e4, None, world_size=4)[0]
    assert torch.isinf(grad[0])
    assert found == [(0, [(3, )])]  # bucket 0, naming its parameter
    assert again == []  # reported once per occurrence
    # Dividing everything before the reduction avoids it.
    grad, found, _ = run_ranks(_reduce, 4.8e4, 4, world_size=4)[0]
    assert grad[0] == 4.8e4 and found == []


def test_predivide_factor_above_the_world_size_carries_larger_means():
    # 98304 = 3 * 2**15 on 2 ranks: the mean itself is above fp16's 65504,
    # so dividing by the world size before the cast overflows; dividing by
    # 4 sends 24576 per rank (sum 49152) and the last factor of 2 is
    # applied in fp32 after the reduction. So any factor > 0 is allowed.
    grad, found, _ = run_ranks(_reduce, 98304.0, None, world_size=2)[0]
    assert torch.isinf(grad[0]) and found == [(0, [(3, )])]
    grad, found, _ = run_ranks(_reduce, 98304.0, 4, world_size=2)[0]
    assert grad[0] == 98304 and found == []


def test_underflow_is_what_the_split_protects_against():
    # 1e-7 on every rank: divided by 4 before the cast it is below half the
    # smallest fp16 subnormal (6e-8) and flushes to zero; divided by 2 it
    # survives, to within the subnormal spacing.
    grad, found, _ = run_ranks(_reduce, 1e-7, 4, world_size=4)[0]
    assert grad[0] == 0 and found == []
    grad, found, _ = run_ranks(_reduce, 1e-7, None, world_size=4)[0]
    assert abs(float(grad[0]) - 1e-7) < 2**-24 and found == []


# The demo MLP with hidden=32, depth=2: Linear(32, 32), Linear(32, 32),
# Linear(32, 8).
WEIGHTS = [(32, 32), (32, 32), (8, 32)]
BIASES = [32, 32, 8]
NUMEL = sum(r * c for r, c in WEIGHTS) + sum(BIASES)  # 2376
# PowerSGD, rank 1, min_compression_rate 2: every weight is sent as its two
# factors (rows + cols numbers); the biases are not worth compressing.
POWERSGD_NUMEL = sum(r + c for r, c in WEIGHTS) + sum(BIASES)  # 240
# Batched: the one bucket as a 49 x 49 matrix (49**2 >= 2376), two factors.
BATCHED_NUMEL = 2 * 49


def _telemetry(rank, world_size, work_dir, comm_hook):
    runner, records = build_runner(work_dir, comm_hook, max_iters=6)
    runner.train()
    hub = runner.message_hub
    logged = [m for _, m in records.lines if 'comm_MB:' in m]
    return (hub.get_scalar('train/comm_MB').data[0].tolist(),
            hub.get_scalar('train/comm_ratio').data[0].tolist(), logged)


@pytest.mark.parametrize(
    'comm_hook,wire_per_step',
    [
        (dict(type='allreduce'), [NUMEL * 4] * 6),
        (dict(type='bf16_compress'), [NUMEL * 2] * 6),
        (dict(type='fp16_compress'), [NUMEL * 2] * 6),
        (dict(type='allreduce', wrapper='fp16'), [NUMEL * 2] * 6),
        # Plain all-reduce until start_powerSGD_iter, then the factors.
        (dict(type='powerSGD', start_powerSGD_iter=3),
         [NUMEL * 4] * 3 + [POWERSGD_NUMEL * 4] * 3),
        (dict(type='powerSGD', wrapper='bf16', start_powerSGD_iter=3),
         [NUMEL * 2] * 3 + [POWERSGD_NUMEL * 2] * 3),
        (dict(type='batched_powerSGD', start_powerSGD_iter=3),
         [NUMEL * 4] * 3 + [BATCHED_NUMEL * 4] * 3),
        (dict(type='batched_powerSGD', wrapper='bf16', start_powerSGD_iter=3),
         [NUMEL * 2] * 3 + [BATCHED_NUMEL * 2] * 3),
    ])
def test_telemetry_counts_the_bytes_on_the_wire(tmp_path, comm_hook,
                                                wire_per_step):
    mb, ratio, logged = run_ranks(_telemetry, str(tmp_path), comm_hook)[0]
    assert mb == pytest.approx([w / 2**20 for w in wire_per_step])
    # Over what DDP would send without the hook: the fp32 buckets as is.
    assert ratio == pytest.approx([w / (NUMEL * 4) for w in wire_per_step])
    # In the normal log line.
    assert len(logged) == 6 and 'comm_ratio:' in logged[-1]


def _waits(rank, world_size, delay):
    """What CommCounter.pop_wait says of a real DDP backward whose hook
    completes ``delay`` seconds after the bucket is handed over (on
    another thread, as the comm worker and gloo complete them)."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 16))
    counter = CommCounter()

    def late(state, bucket):
        fut = torch.futures.Future()
        buffer = bucket.buffer()

        def finish():
            time.sleep(delay)
            fut.set_result(buffer)

        threading.Thread(target=finish).start()
        return fut

    model.register_comm_hook(None, add_baseline_count(late, counter))
    model(torch.randn(4, 16)).sum().backward()
    return counter.pop_wait(), counter.pop_wait()


def test_the_wait_is_the_communication_left_after_the_last_bucket():
    for delay in (0.0, 0.3):
        waited, again = run_ranks(_waits, delay)[0]
        assert delay <= waited < delay + 0.25
        assert again is None  # no bucket since


def _to_tensorboard(rank, world_size, work_dir):
    runner, _ = build_runner(
        work_dir,
        dict(type='bf16_compress'),
        max_iters=4,
        visualizer=dict(
            type='Visualizer',
            vis_backends=[dict(type='TensorboardVisBackend')]))
    runner.train()
    return runner.log_dir


def test_the_traffic_and_the_wait_reach_tensorboard(tmp_path):
    """With the [vis] extra (tensorboard) installed, MMEngine's
    TensorboardVisBackend gets comm_MB, comm_ratio and comm_wait as
    scalars, one per iteration, as the event file shows."""
    from tensorboard.backend.event_processing.event_accumulator import \
        EventAccumulator
    log_dir = run_ranks(_to_tensorboard, str(tmp_path))[0]
    events = glob.glob(
        osp.join(log_dir, '**', 'events.out.tfevents.*'), recursive=True)
    assert len(events) == 1, events
    acc = EventAccumulator(events[0])
    acc.Reload()
    scalars = {
        tag: [e.value for e in acc.Scalars(tag)]
        for tag in acc.Tags()['scalars']
    }
    assert scalars['comm_MB'] == pytest.approx([NUMEL * 2 / 2**20] * 4)
    assert scalars['comm_ratio'] == pytest.approx([0.5] * 4)
    waits = scalars['comm_wait']
    # Seconds the step waited: at least 0, and well under a toy step's
    # worth of seconds on gloo.
    assert len(waits) == 4 and all(0 <= w < 5 for w in waits)


def _overflowing_run(rank, world_size, work_dir):
    # A static loss scale of 1e6 pushes the gradients past fp16's range; the
    # AMP wrapper then skips the step, and the hook says where it happened.
    runner, records = build_runner(
        work_dir,
        dict(type='fp16_compress', predivide_factor=1),
        max_iters=2,
        optim_wrapper=dict(
            type='CPUAmpOptimWrapper',
            loss_scale=1e6,
            optimizer=dict(type='SGD', lr=0.1)))
    runner.train()
    return [
        m for lvl, m in records.lines if lvl == 'WARNING' and 'non-finite' in m
    ]


def test_nonfinite_bucket_is_named_once_per_occurrence(tmp_path):
    warnings = run_ranks(_overflowing_run, str(tmp_path))[0]
    assert len(warnings) == 2  # one bucket, two iterations
    assert warnings[0].startswith('Iteration 1: non-finite gradients after '
                                  "the fp16_compress all-reduce in DDP "
                                  'bucket 0')
    assert 'net.0.weight' in warnings[0]
    assert 'predivide_factor' in warnings[0]
