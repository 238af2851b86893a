"""``post_local_sgd`` and ``diloco`` in real Runners on 2 gloo ranks,
stated as 2 nodes of 1 rank (``run_ranks`` sets no launcher variables that
claim a node): the schedule, the buffers, the telemetry and the resume."""
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from torch import nn

from mmcv_custom.comm.config import comm_hook_config
from mmcv_custom.demo import MLPRegressor
from mmcv_custom.engine.comm_hook_registration_hook import \
    CommHookRegistrationHook
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner

TWO_NODES = dict(ranks_per_node=1)
# outer_format int8 (the default): the pseudo-gradient crosses in blocks
# of 256 values with one fp32 scale each.
DILOCO = dict(type='diloco', period=3, topology=TWO_NODES)
LOCAL_SGD = dict(
    type='post_local_sgd', period=3, start_iter=2, topology=TWO_NODES)
# Trainable values of _BNRegressor: three Linear layers and a BatchNorm.
PARAMS = (32 * 32 + 32) * 2 + 32 * 8 + 8 + 2 * 32
BN_STATS = 2 * 32  # running mean and variance, fp32
# Bytes a diloco synchronisation sends across the nodes (one rank a node:
# nothing is exchanged inside it): the pseudo-gradient in int8 with an
# fp32 scale per 256 values, and the BatchNorm statistics in fp32.
SYNC = PARAMS + 4 * -(-PARAMS // 256) + 4 * BN_STATS
SGD_ACCUMULATING = dict(
    optimizer=dict(type='SGD', lr=0.1), accumulative_counts=2)


class _BNRegressor(MLPRegressor):
    """The demo regressor with a BatchNorm after its first layer: running
    statistics that each rank computes on its own batches."""

    def __init__(self):
        super().__init__(hidden=32, depth=2)
        self.net.insert(1, nn.BatchNorm1d(32))


class _Stop(Exception):
    """Ends a run after a checkpoint, as a preempted job ends."""


def _flat(tensors):
    return torch.cat([t.detach().float().flatten() for t in tensors])


def _gather(flat, world_size):
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return gathered


class _Watch(Hook):
    """After every iteration, after the CheckpointHook: whether the ranks
    hold the same parameters, this rank's ``comm_MB`` and ``cross_MB``;
    raises :class:`_Stop` after iteration ``stop_at``."""

    priority = 'LOWEST'

    def __init__(self, stop_at=None):
        self.stop_at = stop_at
        self.same, self.comm_mb, self.cross_mb = [], [], []

    def after_train_iter(self,
                         runner,
                         batch_idx,
                         data_batch=None,
                         outputs=None):
        a, b = _gather(_flat(runner.model.module.parameters()), 2)
        self.same.append(torch.equal(a, b))
        scalars = runner.message_hub.log_scalars
        for key, seen in (('comm_MB', self.comm_mb), ('cross_MB',
                                                      self.cross_mb)):
            if f'train/{key}' in scalars:
                seen.append(round(scalars[f'train/{key}'].current() * 2**20))
        if runner.iter + 1 == self.stop_at:
            raise _Stop


def _train(rank,
           world_size,
           work_dir,
           comm_hook,
           max_iters=10,
           resume=False,
           stop_at=None,
           optim_wrapper=None):
    """Train to ``max_iters`` (or stop after ``stop_at``, the checkpoint
    of that iteration saved); every rank's parameters and buffers, flat,
    and what this rank saw and logged."""
    runner, records = build_runner(
        work_dir,
        comm_hook,
        max_iters=max_iters,
        model=_BNRegressor(),
        optim_wrapper=optim_wrapper,
        checkpoint=dict(type='CheckpointHook', interval=4, by_epoch=False),
        resume=resume)
    watch = _Watch(stop_at)
    runner.register_hook(watch)
    try:
        runner.train()
    except _Stop:
        pass
    module = runner.model.module
    return dict(
        same=watch.same,
        comm_bytes=watch.comm_mb,
        cross_bytes=watch.cross_mb,
        broadcast_buffers=runner.model.broadcast_buffers,
        lines=records.lines,
        params=_gather(_flat(module.parameters()), world_size),
        buffers=_gather(_flat(module.buffers()), world_size))


def _copy_run(src, dst):
    """A copy of the work dir ``src`` whose ``last_checkpoint`` points into
    the copy (a resume of each copy leaves the original as it was)."""
    shutil.copytree(src, dst)
    last = os.path.join(dst, 'last_checkpoint')
    with open(last) as f:
        path = f.read().strip()
    with open(last, 'w') as f:
        f.write(path.replace(str(src), str(dst)))
    return str(dst)


def _resumed_as_whole(resumed, whole, algorithm, work):
    """Every rank restored its own state from the checkpoint at 4, then
    went on as the run that did not stop: equal where it was equal, and
    the same parameters and buffers, bit for bit, at the end."""
    assert ('INFO', f'Restored the {algorithm} state (each rank\'s own '
            'parameters, buffers and optimizer state, and the step in the '
            f'period) of all 2 ranks from the files beside {work}/'
            'iter_4.pth.') in resumed['lines']
    assert resumed['same'] == whole['same'][4:]
    for key in ('params', 'buffers'):
        for rank in range(2):
            assert torch.equal(resumed[key][rank], whole[key][rank])


def _messages(result, level):
    return [m for lvl, m in result['lines'] if lvl == level]


def _not_restoring(result):
    return [m for m in _messages(result, 'WARNING') if 'Not restoring' in m]


def _fresh(period):
    """What a diloco fresh start at step 4 says of itself."""
    return ('every rank goes on from the checkpoint\'s weights and optimizer '
            'state (rank 0\'s), DiLoCo\'s global parameters taken from them, '
            'its outer momentum and error feedback from zero; the next '
            f'synchronisation is after step 6 (the periods of {period} steps '
            'keep their places).')


@pytest.fixture(scope='module')
def diloco_whole(tmp_path_factory):
    """The uninterrupted diloco run: 10 iterations, period 3, a checkpoint
    every 4 (at 4 and 8: mid-period)."""
    work = tmp_path_factory.mktemp('diloco_whole')
    return run_ranks(_train, str(work), DILOCO, 10)


@pytest.fixture(scope='module')
def diloco_stopped(tmp_path_factory):
    """The same run stopped after iteration 4 (its checkpoint saved), as
    a preempted job stops: each test resumes a copy. (A run of
    ``max_iters=4`` would not do: its last iteration synchronises.)"""
    work = tmp_path_factory.mktemp('diloco_stopped')
    run_ranks(_train, str(work), DILOCO, 10, False, 4)
    return work


def test_diloco_trains_in_periods_across_two_nodes(diloco_whole):
    rank0, rank1 = diloco_whole
    infos, warnings = _messages(rank0, 'INFO'), _messages(rank0, 'WARNING')
    registered = [m for m in infos if m.startswith('Registered DDP')]
    assert len(registered) == 1
    assert "type='diloco'" in registered[0]
    assert ('topology: 2 nodes x 1 rank (ranks (0,) on node 0, (1,) on '
            'node 1); no exchange inside the node (one rank a node)'
            ) in registered[0]
    assert ('diloco: the model is synchronised across the 2 nodes every 3 '
            'optimizer steps and at the last iteration; DDP\'s buffer '
            'broadcast before each forward is off') in '\n'.join(infos)
    # Saves at 4 and 8 fall mid-period; validation every 100 iterations
    # happens only at the last, synchronised.
    assert [m for m in warnings if m.startswith('diloco: ')] == [
        "diloco: the CheckpointHook's save every 4 iterations does not fall "
        'at the end of a period of 3 steps: there each node holds its own '
        "model, so the checkpoint holds node 0's (a resume is still bit for "
        'bit: every rank saves its own state), not the synchronised one. An '
        'interval of a multiple of 3 avoids it.'
    ]
    # The ranks part after every step and meet at the end of each period
    # and at the last iteration.
    assert rank0['same'] == [False, False, True] * 3 + [True]
    assert rank0['broadcast_buffers'] is False
    # cross_MB: the synchronisations, nothing between them (one rank a
    # node: no exchange inside it), averaged over the last period (3
    # steps); comm_MB the same here.
    assert rank0['cross_bytes'] == [0, 0] + [round(SYNC / 3)] * 7 + [
        round(2 * SYNC / 3)
    ]
    assert rank0['comm_bytes'] == rank0['cross_bytes']
    logged = [m for m in infos if m.startswith('Epoch(train) [1][10/')]
    assert 'cross_MB: 0.0017' in logged[0] and 'sync_wait: ' in logged[0]
    # The last iteration synchronised parameters and statistics alike.
    for key in ('params', 'buffers'):
        assert torch.equal(rank0[key][0], rank0[key][1])
        assert torch.equal(rank1[key][0], rank0[key][0])


def test_diloco_resumes_mid_period_bit_for_bit(diloco_whole, diloco_stopped,
                                               tmp_path):
    """The checkpoint at 4 falls one step into the second period: every
    rank restores its own parameters, buffers, optimizer state, the step
    and the outer state, so the schedule and the weights go on as if the
    run had not stopped."""
    work = _copy_run(diloco_stopped, tmp_path / 'run')
    resumed = run_ranks(_train, work, DILOCO, 10, True)[0]
    whole = diloco_whole[0]
    _resumed_as_whole(resumed, whole, 'diloco', work)


def test_post_local_sgd_resumes_mid_period_bit_for_bit(tmp_path):
    """Two steps over the world (start_iter=2), then periods of 3: the
    checkpoint at 4 falls two steps into the first one."""
    whole = run_ranks(_train, str(tmp_path / 'whole'), LOCAL_SGD, 10)[0]
    # Equal while DDP averages over the world; then synchronised after
    # steps 5 and 8, and at the last.
    assert whole['same'] == [
        True, True, False, False, True, False, False, True, False, True
    ]
    # Syncs after steps 5, 8, 11...: no interval of saves meets them all.
    assert ("post_local_sgd: the CheckpointHook's save every 4 iterations "
            'does not fall at the end of a period of 3 steps after '
            'start_iter=2: ') in '\n'.join(_messages(whole, 'WARNING'))
    assert ('An interval of a multiple of 3, with a start_iter of a multiple '
            'of 3, avoids it.') in '\n'.join(_messages(whole, 'WARNING'))
    part = str(tmp_path / 'part')
    run_ranks(_train, part, LOCAL_SGD, 10, False, 4)
    resumed = run_ranks(_train, part, LOCAL_SGD, 10, True)[0]
    _resumed_as_whole(resumed, whole, 'post_local_sgd', part)


def test_streaming_diloco_resumes_with_an_exchange_in_flight(tmp_path):
    """Two fragments at steps 2 and 4 of each period of 4, each applied a
    step later and mixed in: the checkpoint at 4 saves fragment 1's
    exchange sent after step 4 (applied after 5) with the state; the
    resumed run ends with the same bits, and the last iteration leaves
    every rank the common model."""
    stream = dict(DILOCO, period=4, fragments=2, overlap=1)
    whole = run_ranks(_train, str(tmp_path / 'whole'), stream, 10)[0]
    assert ('diloco: the model is synchronised across the 2 nodes every 4 '
            'optimizer steps, in 2 fragments at staggered steps of the '
            'period, each exchange running beside the next 1 step and mixed '
            'in with mix=0.5 and at the last iteration') in '\n'.join(
                _messages(whole, 'INFO'))
    assert whole['same'] == [False] * 9 + [True]
    part = str(tmp_path / 'part')
    run_ranks(_train, part, stream, 10, False, 4)
    resumed = run_ranks(_train, part, stream, 10, True)[0]
    _resumed_as_whole(resumed, whole, 'diloco', part)


def test_diloco_starts_afresh_from_another_hooks_checkpoint(tmp_path):
    """int8_compress's state is not diloco's: every rank goes on from the
    checkpoint's weights, and the periods keep their places (the next
    synchronisation after step 6, two steps on)."""
    part = str(tmp_path / 'part')
    run_ranks(_train, part, dict(type='int8_compress'), 4)
    resumed = run_ranks(_train, part, DILOCO, 10, True)[0]
    assert _not_restoring(resumed) == [
        'Not restoring the diloco communication-hook state (all ranks: the '
        "resumed checkpoint holds the state of comm_hook type='int8_compress'"
        ", wrapper=None, not of type='diloco', wrapper=None). Every rank "
        'starts it afresh at step 4: ' + _fresh(3)
    ]
    assert resumed['same'] == [False, True, False, False, True, True]
    assert torch.equal(resumed['params'][0], resumed['params'][1])


def test_diloco_refuses_the_state_of_another_period(diloco_stopped, tmp_path):
    work = _copy_run(diloco_stopped, tmp_path / 'run')
    resumed = run_ranks(_train, work, dict(DILOCO, period=2), 10, True)[0]
    # Each rank names its own file.
    refused = '; '.join(
        f'rank {r}: {work}/iter_4.pth.comm_hook_rank{r}.pth: it was saved '
        'under other settings (period=3 then, 2 now)' for r in range(2))
    assert _not_restoring(resumed) == [
        f'Not restoring the diloco communication-hook state ({refused}). '
        'Every rank starts it afresh at step 4: ' + _fresh(2)
    ]
    assert resumed['same'] == [False, True] * 3


def test_steps_are_counted_where_the_optimizer_stepped(tmp_path):
    """With two iterations a step, a period of 3 steps is 6 iterations:
    the ranks part at each step and meet at iteration 6 and at the last;
    iterations that only accumulate change nothing and send nothing."""
    rank0 = run_ranks(_train, str(tmp_path), DILOCO, 10, False, None,
                      SGD_ACCUMULATING)[0]
    assert rank0['same'] == [
        True, False, False, False, False, True, True, False, False, True
    ]
    # Averaged over the last period's 6 iterations.
    assert rank0['comm_bytes'] == [0] * 5 + [round(SYNC / 6)] * 4 + [
        round(2 * SYNC / 6)
    ]
    assert ("diloco: the CheckpointHook's save every 4 iterations does not "
            'fall at the end of a period of 3 steps (6 iterations): there '
            'each node holds its own model') in '\n'.join(
                _messages(rank0, 'WARNING'))
    assert 'An interval of a multiple of 6 avoids it.' in '\n'.join(
        _messages(rank0, 'WARNING'))


def _one_node(rank, world_size, work_dir):
    runner, _ = build_runner(
        work_dir,
        dict(LOCAL_SGD, topology=dict(ranks_per_node=2)),
        max_iters=1)
    with pytest.raises(ValueError) as raised:
        runner.train()
    return str(raised.value)


def test_post_local_sgd_on_one_node_is_refused_on_every_rank(tmp_path):
    messages = run_ranks(_one_node, str(tmp_path))
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        'comm_hook post_local_sgd on one node (1 node x 2 ranks')
    assert ('averages nothing across nodes: the gradients of every step '
            'are averaged over all ranks already') in messages[0]


def test_diloco_under_fsdp2_is_refused():
    with pytest.raises(ValueError) as raised:
        comm_hook_config(dict(type='diloco', period=4), 'full')
    assert 'diloco' in str(raised.value) and 'DDP' in str(raised.value)


@pytest.mark.parametrize('cfg,error,message', [
    (dict(type='diloco', period=0), ValueError,
     'comm_hook diloco: period should be an int >= 1, but got 0'),
    (dict(type='post_local_sgd', period=0), ValueError,
     'comm_hook post_local_sgd: period should be an int >= 1, but got 0'),
    (dict(type='diloco', period=3, outer_momentum=1.0), ValueError,
     'comm_hook diloco: outer_momentum should be in [0, 1) (the paper uses '
     '0.9), but got 1.0'),
    (dict(type='diloco'), TypeError,
     "comm_hook type 'diloco' needs period: the optimizer steps between "
     'synchronisations across nodes, an int >= 1 (e.g. period=25)'),
])
def test_bad_settings_are_refused_when_the_hook_is_built(cfg, error, message):
    with pytest.raises(error) as raised:
        CommHookRegistrationHook(comm_hook=cfg)
    assert str(raised.value) == message
