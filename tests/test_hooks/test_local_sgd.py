"""``post_local_sgd`` and ``diloco`` (issue 45) at the torch level, on real
gloo ranks: the schedule, the averages across nodes against hand
computations, the outer formats' rounding, the bytes each step counts and
the state that resumes a run bit for bit mid-period.

Two starts of the ranks: 4 ranks as 2 nodes x 2 and 2 ranks (2 nodes x 1,
and 1 node x 2). The model is tiny and has BatchNorm, so the buffers'
average is seen too.
"""
import io
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.comm import CommCounter, build_comm_hook
from mmcv_custom.testing import run_ranks

PERIOD = 3
LOCAL_SGD = dict(type='post_local_sgd', period=PERIOD, start_iter=2)
DILOCO_FP32 = dict(type='diloco', period=PERIOD, outer_format='fp32')
# The outer step that is the nodes' plain average.
DILOCO_AVERAGE = dict(DILOCO_FP32, outer_lr=1.0, outer_momentum=0.0)
# The streaming form: 2 fragments, each exchange applied a step later.
STREAM = dict(
    type='diloco',
    period=4,
    fragments=2,
    overlap=1,
    inner=dict(type='int8_compress', block_size=32))


def _net():
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).float().clone() for t in tensors])


def _params(net):
    return _flat(p for p in net.parameters() if p.requires_grad)


def _buffers(net):
    return _flat(b for b in net.buffers() if b.is_floating_point())


class _Run:
    """A DDP model with the hook of ``cfg`` registered as the run does it
    (DDP's buffer broadcast off, the module and optimizer attached)."""

    def __init__(self, cfg, ranks_per_node, seed=0):
        torch.manual_seed(seed)
        self.net = _net()
        self.ddp = DDP(self.net)
        self.ddp.broadcast_buffers = False
        self.counter = CommCounter()
        self.spec = build_comm_hook(
            dict(cfg, topology=dict(ranks_per_node=ranks_per_node)),
            counter=self.counter,
            param_names={
                p: n
                for n, p in self.net.named_parameters()
            })
        self.ddp.register_comm_hook(self.spec.state, self.spec.hook)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        self.state = self.spec.state
        self.state.attach(self.net, self.opt)
        # What every rank starts from (DDP broadcast rank 0's).
        self.start = _params(self.net)

    def backward(self, rank):
        """Forward and backward of this rank's batch of the step about to
        be counted (the same batch for a resumed run)."""
        gen = torch.Generator().manual_seed(1000 * self.state.steps + rank)
        x = torch.randn(16, 8, generator=gen)
        self.opt.zero_grad()
        nn.functional.mse_loss(self.ddp(x), x[:, :4] * 2).backward()

    def step(self, rank):
        """One step; what the parameters and buffers were before the
        step's synchronisation and after it, its report and its bytes."""
        self.backward(rank)
        self.opt.step()
        before, buffers_before = _params(self.net), _buffers(self.net)
        report = self.state.after_step()
        sent = self.counter.pop()[1] + self.state.pop_sent()
        return dict(
            steps=self.state.steps,
            before=before,
            after=_params(self.net),
            buffers_before=buffers_before,
            buffers_after=_buffers(self.net),
            report=None if report is None else tuple(report[:2]),
            sent=sent)

    def train(self, rank, steps):
        return [self.step(rank) for _ in range(steps)]

    def saved(self):
        """The keeper's state, as a file holds it (copied: the optimizer's
        tensors are the live ones)."""
        buf = io.BytesIO()
        torch.save(self.spec.state_keeper.state_dict(), buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)


def _refusal(keeper, saved):
    try:
        keeper.check_state_dict(saved)
    except ValueError as e:
        return str(e)
    return None


def _round_trip(rank, cfg, saved_at, until):
    """``cfg`` trained to ``until`` steps, its state saved after
    ``saved_at``; a fresh run (other weights, no optimizer state) restored
    from it and trained to ``until`` as well."""
    whole = _Run(cfg, 2)
    first = whole.train(rank, saved_at)
    saved = whole.saved()
    rest = whole.train(rank, until - saved_at)
    resumed = _Run(cfg, 2, seed=99)
    checked = _refusal(resumed.spec.state_keeper, saved)
    resumed.spec.state_keeper.load_state_dict(saved)
    return dict(
        history=first + rest,
        rest=rest,
        saved=saved,
        checked=checked,
        resumed=resumed.train(rank, until - saved_at)), resumed


def _four_ranks(rank, world_size):
    """Every 2 nodes x 2 ranks case in one start of the ranks; the node
    gathers its slices in pieces of 100 values (a 6B model's whole fp32
    copy would not fit beside it), so every case here crosses pieces."""
    from mmcv_custom.hooks import local_sgd
    local_sgd._GATHER_VALUES = 100
    out = {}
    # post_local_sgd: syncs after steps 5, 8 and 11; saved mid-period.
    out['local_sgd'], local_run = _round_trip(rank, LOCAL_SGD, 6, 11)
    # DiLoCo with int8 inside the node (its error feedback is saved too)
    # and int8 across: syncs after steps 3, 6 and 9.
    diloco = dict(
        type='diloco',
        period=PERIOD,
        inner=dict(type='int8_compress', block_size=32))
    out['diloco'], diloco_run = _round_trip(rank, diloco, 4, 9)
    saved = out['local_sgd']['saved']
    keeper = local_run.spec.state_keeper
    other_period = _Run(dict(LOCAL_SGD, period=PERIOD + 1), 2)
    other_period.state.attach(local_run.net, local_run.opt)
    missing = dict(saved, params=dict(saved['params']))
    del missing['params']['0.weight']
    out['refusals'] = dict(
        algorithm=_refusal(diloco_run.spec.state_keeper, saved),
        layout=_refusal(keeper, dict(saved, layout=[[0], [1], [2], [3]])),
        period=_refusal(other_period.spec.state_keeper, saved),
        missing=_refusal(keeper, missing),
        garbage=_refusal(keeper, None))
    out['inner_saved'] = sorted(out['diloco']['saved']['inner'])
    # Streaming DiLoCo: 2 fragments at steps 2 and 4 of each period of 4,
    # each applied a step later; saved after step 6, with fragment 0's
    # exchange in flight; the last step synchronises every fragment.
    out['stream'], stream_run = _round_trip(rank, STREAM, 6, 11)
    out['stream_in_flight'] = [(p['fragment'], p['apply_at'])
                               for p in out['stream']['saved']['in_flight']]
    stream_run.state.sync()
    out['stream_final'] = _params(stream_run.net)
    out['stream_average'] = dict(
        history=_Run(dict(DILOCO_AVERAGE, period=4, fragments=2), 2).train(
            rank, 4))
    for case in ('local_sgd', 'diloco', 'stream'):
        out[case].pop('saved')
    # The hierarchical form on 4 nodes of one rank: pairs of nodes every
    # 2 steps, all 4 every 4.
    run = _Run(dict(type='post_local_sgd', period=4, group_periods={2: 2}), 1)
    out['hierarchy'] = dict(
        history=run.train(rank, 6), describe=run.spec.describe())
    # After step 6 only the pairs met: a run ending there still has to
    # bring all nodes together.
    out['hierarchy']['pending'] = run.state.pending()
    out['hierarchy']['history'] += run.train(rank, 2)
    try:
        _Run(dict(type='post_local_sgd', period=4, group_periods={2: 3}), 1)
    except ValueError as e:
        out['hierarchy']['refused'] = str(e)
    return out


def _two_ranks(rank, world_size):
    """Every 2-rank case in one start of the ranks: 2 nodes x 1 rank,
    then 1 node x 2."""
    out = {}
    run = _Run(DILOCO_FP32, 1)
    out['fp32'] = dict(start=run.start, history=run.train(rank, 2 * PERIOD))
    # A fresh start after 5 steps: the global parameters are taken again
    # from the model at the next step's exchange.
    run.spec.state_keeper.start_fresh(5)
    state = run.state
    fresh = dict(
        steps=state.steps,
        synced_at=state.synced_at,
        cleared=state.global_params is None and state.momentum is None)
    run.backward(rank)
    fresh['taken'] = state.global_params.clone()
    fresh['model'] = _params(run.net)
    out['fresh'] = fresh
    for name, cfg in (('average', DILOCO_AVERAGE),
                      ('local_sgd', dict(LOCAL_SGD, start_iter=0)),
                      ('int8', dict(DILOCO_FP32, outer_format='int8')),
                      ('bf16', dict(DILOCO_FP32, outer_format='bf16'))):
        run = _Run(cfg, 1)
        out[name] = dict(history=run.train(rank, PERIOD))
        if name == 'int8':
            residual = run.state.residual
            out[name]['residual'] = (None
                                     if residual is None else residual.clone())
    # One node of both ranks: DiLoCo is Lookahead over the node's
    # average; post_local_sgd would average nothing.
    run = _Run(dict(type='diloco', period=PERIOD), 2)
    out['one_node'] = dict(
        start=run.start,
        history=run.train(rank, PERIOD),
        describe=run.spec.describe())
    try:
        _Run(LOCAL_SGD, 2)
    except ValueError as e:
        out['one_node_local_sgd'] = str(e)
    return out


@pytest.fixture(scope='module')
def four():
    results = run_ranks(_four_ranks, world_size=4)
    return {name: [res[name] for res in results] for name in results[0]}


@pytest.fixture(scope='module')
def two():
    results = run_ranks(_two_ranks, world_size=2)
    return {name: [res[name] for res in results] for name in results[0]}


def _sizes():
    net = _net()
    params = sum(p.numel() for p in net.parameters())
    buffers = sum(b.numel() for b in net.buffers() if b.is_floating_point())
    return params, buffers


def _at(runs, steps):
    """Each rank's record of the step that brought the count to
    ``steps``."""
    return [
        next(h for h in run['history'] if h['steps'] == steps) for run in runs
    ]


def test_post_local_sgd_averages_the_nodes_every_period(four):
    """Identical everywhere during start_iter; then identical inside each
    node and apart across nodes; after each period's sync the same bits
    on every rank, the exact mean of the two nodes, buffers averaged over
    all four ranks."""
    runs = four['local_sgd']
    for record in zip(*(run['history'] for run in runs)):
        steps = record[0]['steps']
        after = [r['after'] for r in record]
        synced = steps > LOCAL_SGD['start_iter'] and (
            steps - LOCAL_SGD['start_iter']) % PERIOD == 0
        assert all(r['report'] is not None for r in record) == synced
        if steps <= LOCAL_SGD['start_iter'] or synced:
            for a in after[1:]:
                assert torch.equal(after[0], a), steps
        else:
            # The node's gradients are averaged inside it only.
            assert torch.equal(after[0], after[1]), steps
            assert torch.equal(after[2], after[3]), steps
            assert not torch.equal(after[0], after[2]), steps
        if synced:
            node_0, node_1 = record[0]['before'], record[2]['before']
            # Halving is exact in fp32: the sum of halves is the mean.
            assert torch.equal(after[0], (node_0 + node_1) / 2), steps
            buffers = [r['buffers_after'] for r in record]
            for b in buffers[1:]:
                assert torch.equal(buffers[0], b), steps
            mean = sum(r['buffers_before'] for r in record) / 4
            torch.testing.assert_close(buffers[0], mean, rtol=0, atol=1e-6)


def test_post_local_sgd_sync_bytes(four):
    """Each rank sends its half of the node's parameters across (fp32)
    and the buffers; it gathers the other half inside the node."""
    params, buffers = _sizes()
    half = math.ceil(params / 2)
    for run in four['local_sgd']:
        reports = [h['report'] for h in run['history'] if h['report']]
        assert len(reports) == 3
        for cross, intra in reports:
            assert cross == 4 * half + 4 * buffers
            # An all-gather of 2 slices of 4 * half bytes counts half.
            assert intra == 2 * 4 * half // 2


def test_every_step_counts_the_inner_exchange_and_the_sync(four):
    """counter.pop() + state.pop_sent() of a step: the bucket's
    all-reduce (over the world during start_iter, inside the node after),
    and on a sync step what the sync sent."""
    params, _ = _sizes()
    for run in four['local_sgd']:
        history = run['history']
        for h in history:
            cross, intra = h['report'] or (0, 0)
            assert h['sent'] == 4 * params + cross + intra, h['steps']
        # One whole period (steps 6 to 8) sums the same way.
        period = [h for h in history if 6 <= h['steps'] <= 8]
        sync = period[-1]['report']
        assert sum(h['sent'] for h in period) == (
            PERIOD * 4 * params + sum(sync))


def _outer(global_params, locals_, lr, mu, momentum=None):
    """DiLoCo's outer step by hand: the pseudo-gradient's mean over the
    nodes (each node's share divided by their number first, as sent),
    then torch.optim.SGD's Nesterov momentum."""
    delta = sum((global_params - local) / len(locals_) for local in locals_)
    momentum = delta.clone() if momentum is None else momentum * mu + delta
    return global_params - lr * (delta + mu * momentum), momentum


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient(two):
    """Two outer steps (the second with the first's momentum) against the
    same computed by hand from the ranks' parameters; the buffers are the
    ranks' mean."""
    runs = two['fp32']
    assert torch.equal(runs[0]['start'], runs[1]['start'])
    global_params, momentum = runs[0]['start'], None
    for steps in (PERIOD, 2 * PERIOD):
        record = _at(runs, steps)
        expected, momentum = _outer(global_params,
                                    [r['before'] for r in record], 0.7, 0.9,
                                    momentum)
        assert torch.equal(record[0]['after'], record[1]['after'])
        torch.testing.assert_close(
            record[0]['after'], expected, rtol=0, atol=1e-6)
        mean = (record[0]['buffers_before'] + record[1]['buffers_before']) / 2
        assert torch.equal(record[0]['buffers_after'], mean)
        global_params = record[0]['after']
    # Between syncs each node trains its own model.
    before = _at(runs, PERIOD + 1)
    assert not torch.equal(before[0]['after'], before[1]['after'])


def test_diloco_with_outer_lr_1_and_no_momentum_is_the_plain_average(two):
    average, local_sgd = _at(two['average'],
                             PERIOD), _at(two['local_sgd'], PERIOD)
    # The same local steps on both: the syncs see the same parameters.
    for a, b in zip(average, local_sgd):
        assert torch.equal(a['before'], b['before'])
    mean = (average[0]['before'] + average[1]['before']) / 2
    assert torch.equal(local_sgd[0]['after'], mean)
    for a in average:
        torch.testing.assert_close(a['after'], mean, rtol=0, atol=1e-6)


def _pseudo_gradients(two, name):
    start = two['fp32'][0]['start']
    record = _at(two[name], PERIOD)
    return record, [start - r['before'] for r in record]


def test_diloco_int8_outer_format_rounds_within_its_step(two):
    """Every rank the same bits; each node's share rounded to its block's
    int8 step (max / 127, half of it at most), what rounding dropped kept
    for the next sync; what crosses: the all-gather of the int8 values
    and one fp32 scale a block, and the buffers."""
    record, deltas = _pseudo_gradients(two, 'int8')
    fp32 = _at(two['fp32'], PERIOD)
    assert torch.equal(record[0]['after'], record[1]['after'])
    for r, f in zip(record, fp32):
        assert torch.equal(r['before'], f['before'])
    # One block-rounding per node of its halved pseudo-gradient, through
    # the first outer step ((1 + momentum) x lr times the mean).
    drop = sum(d.abs().max() / 2 / 254 for d in deltas)
    error = (record[0]['after'] - fp32[0]['after']).abs().max()
    assert 0 < error <= 0.7 * 1.9 * drop + 1e-6
    for residual, d in zip(two['int8'], deltas):
        residual = residual['residual']
        assert residual is not None and residual.abs().max() > 0
        assert residual.abs().max() <= d.abs().max() / 2 / 254 + 1e-7
    params, buffers = _sizes()
    nodes, block = 2, 256
    gathered = math.ceil(nodes * (params + 4 * math.ceil(params / block)) / 2)
    for r in record:
        assert r['report'] == (gathered + 4 * buffers, 0)


def test_diloco_bf16_outer_format_rounds_within_its_step(two):
    record, deltas = _pseudo_gradients(two, 'bf16')
    fp32 = _at(two['fp32'], PERIOD)
    assert torch.equal(record[0]['after'], record[1]['after'])
    # Each half rounded to bf16 (2^-9 relative), and their sum: within
    # 2^-7 of the shares' magnitudes, through the outer step.
    bound = 0.7 * 1.9 * 2**-7 * sum(d.abs() / 2 for d in deltas) + 1e-7
    error = (record[0]['after'] - fp32[0]['after']).abs()
    assert error.max() > 0
    assert (error <= bound).all()
    params, buffers = _sizes()
    for r in record:
        assert r['report'] == (2 * params + 4 * buffers, 0)


def test_diloco_on_one_node_is_lookahead_and_sends_nothing_across(two):
    """One node of 2 ranks: the gradients averaged over both every step,
    so the ranks never differ; the outer step pulls the model back
    towards where the period started. Nothing crosses nodes: the buffers'
    average counts inside the node."""
    runs = two['one_node']
    assert 'topology: 1 node x 2 ranks' in runs[0]['describe']
    for a, b in zip(runs[0]['history'], runs[1]['history']):
        assert torch.equal(a['after'], b['after'])
    params, buffers = _sizes()
    record = _at(runs, PERIOD)
    expected, _ = _outer(runs[0]['start'], [record[0]['before']], 0.7, 0.9)
    torch.testing.assert_close(record[0]['after'], expected, rtol=0, atol=1e-6)
    for r in record:
        assert r['report'] == (0, 2 * 4 * math.ceil(params / 2) // 2 +
                               4 * buffers)


def test_post_local_sgd_on_one_node_is_refused_on_every_rank(two):
    for said in two['one_node_local_sgd']:
        assert 'averages nothing across nodes' in said
        assert 'plain DDP' in said


def test_diloco_on_two_nodes_of_two_with_int8_inside(four):
    """The ranks of a node agree every step, all four after each sync;
    each rank sends its half's int8 pseudo-gradient across and gathers
    the other half inside the node."""
    params, buffers = _sizes()
    half = math.ceil(params / 2)
    gathered = math.ceil(2 * (half + 4 * math.ceil(half / 256)) / 2)
    runs = four['diloco']
    for record in zip(*(run['history'] for run in runs)):
        after = [r['after'] for r in record]
        assert torch.equal(after[0], after[1])
        assert torch.equal(after[2], after[3])
        if record[0]['steps'] % PERIOD:
            assert not torch.equal(after[0], after[2])
            assert all(r['report'] is None for r in record)
        else:
            assert torch.equal(after[0], after[2])
            for r in record:
                assert r['report'] == (gathered + 4 * buffers, 4 * half)


@pytest.mark.parametrize('case', ['local_sgd', 'diloco', 'stream'])
def test_resumed_mid_period_bit_for_bit(four, case):
    """Saved mid-period, restored into a fresh model (other weights) and
    optimizer (no state): the rest of the run (two more syncs) the same
    bits on every rank. DiLoCo's file holds its inner int8's error
    feedback too."""
    if case == 'diloco':
        assert four['inner_saved'][0] == ['intra']
    for run in four[case]:
        assert run['checked'] is None
        assert len(run['rest']) == len(run['resumed'])
        for whole, resumed in zip(run['rest'], run['resumed']):
            assert whole['steps'] == resumed['steps']
            assert whole['report'] == resumed['report']
            for key in ('before', 'after', 'buffers_after'):
                assert torch.equal(whole[key],
                                   resumed[key]), (key, whole['steps'])


def test_a_state_of_another_run_is_refused_with_the_reason(four):
    said = four['refusals'][0]
    assert said['algorithm'] == ('it holds the state of post_local_sgd, not '
                                 'of diloco')
    assert said['layout'].startswith(
        'it was saved on the nodes [[0], [1], [2], [3]], this run has '
        '[[0, 1], [2, 3]] (2 nodes x 2 ranks')
    assert said['period'] == ('it was saved under other settings (period=3 '
                              'then, 4 now)')
    assert said['missing'] == 'its parameter 0.weight is missing'
    assert said['garbage'] == ('it holds no state of post_local_sgd or '
                               'diloco of this mmcv_custom version')


def test_start_fresh_keeps_the_step_and_retakes_the_global_params(two):
    for fresh in two['fresh']:
        assert (fresh['steps'], fresh['synced_at']) == (5, 5)
        assert fresh['cleared']
        assert torch.equal(fresh['taken'], fresh['model'])


def test_hierarchical_post_local_sgd_averages_pairs_then_all(four):
    """PyTorch's HierarchicalModelAverager by nodes: ``group_periods={2:
    2}`` with ``period=4`` on 4 nodes averages each pair of nodes after
    steps 2 and 6 (the pairs' means, the pairs apart) and all 4 after 4
    and 8; a group size that does not divide the nodes is refused on
    every rank."""
    runs = four['hierarchy']
    assert 'group_periods={2: 2}' in runs[0]['describe']
    assert [r['pending'] for r in runs] == [2] * 4
    for step in range(8):
        after = [r['history'][step]['after'] for r in runs]
        before = [r['history'][step]['before'] for r in runs]
        if (step + 1) % 4 == 0:
            for a in after[1:]:
                assert torch.equal(a, after[0])
            torch.testing.assert_close(
                after[0], sum(before) / 4, rtol=0, atol=1e-6)
        elif (step + 1) % 2 == 0:
            for pair in ((0, 1), (2, 3)):
                i, j = pair
                assert torch.equal(after[i], after[j])
                assert torch.equal(after[i], (before[i] + before[j]) / 2)
            assert not torch.equal(after[0], after[2])
        else:
            assert all(r['history'][step]['report'] is None for r in runs)
    assert [r.get('refused') for r in runs] == [
        'comm_hook post_local_sgd group_periods={2: 3}: groups of 3 nodes '
        'should divide the 4 nodes into several whole groups (4 nodes x 1 '
        'rank (ranks (0,) on node 0, (1,) on node 1, ...))'
    ] * 4


def test_streaming_saves_the_exchange_in_flight_and_ends_common(four):
    """Saved after step 6, where fragment 0's exchange (sent after step 6)
    is applied after step 7: the file holds its result (the resumed run
    above applies the same bits); after the last synchronisation every
    rank holds the same parameters."""
    assert four['stream_in_flight'] == [[(0, 7)]] * 4
    final = four['stream_final']
    for other in final[1:]:
        assert torch.equal(other, final[0])
    # Reports at the sends (after steps 2, 4, 6, ...) and the applies a
    # step later: every step from the second.
    history = four['stream'][0]['history']
    assert [h['steps'] for h in history if h['report'] is not None] == \
        list(range(2, 12))


def test_streaming_fragments_meet_at_their_own_steps(four):
    """``outer_lr=1``, no momentum, no overlap: a fragment's
    synchronisation is the nodes' average of it. Each rank's slice is
    half the node's (2 ranks a node), each fragment half of that: after
    step 2 fragment 0 of both slices is the mean of the nodes and the
    same on every rank, fragment 1 still the node's own; after step 4
    fragment 1 too."""
    runs = four['stream_average']
    numel = runs[0]['history'][0]['before'].numel()
    chunk = -(-numel // 2)
    size = -(-chunk // 2)
    first = torch.zeros(numel, dtype=torch.bool)
    for start in (0, chunk):
        first[start:min(start + size, numel)] = True
    second = ~first
    for step, met, apart in ((2, first, second), (4, second, first)):
        before = [r['history'][step - 1]['before'] for r in runs]
        after = [r['history'][step - 1]['after'] for r in runs]
        mean = (before[0] + before[2]) / 2  # ranks 0 and 2: the two nodes
        for a in after:
            torch.testing.assert_close(a[met], mean[met], rtol=0, atol=1e-6)
        assert torch.equal(after[0][apart], before[0][apart])
        assert not torch.equal(after[0][apart], after[2][apart])
