"""The two-level (node-aware) forms of int8, fp16 and bf16 (issue 30), on
real gloo ranks: 2 nodes x 2 ranks and 3 x 2, as a config's ``topology``
builds them."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.comm import CommCounter, build_comm_hook
from mmcv_custom.comm.builder import check_comm_hook_cfg
from mmcv_custom.comm.sharded import build_sharded_comm
from mmcv_custom.hooks.topology import NodeClaim
from mmcv_custom.testing import run_ranks

TWO_BY_TWO = dict(ranks_per_node=2)


class Net(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _blocks_claim(rank, per_node):
    return NodeClaim(rank // per_node, rank % per_node, per_node)


def _train(rank,
           world_size,
           cfg,
           steps=6,
           cap=25,
           claim=None,
           state_in=None,
           start=0):
    """Train ``steps`` steps from step ``start``; the gradients each step
    applied, the exact mean of the raw ones, and the hook's state. At
    ``cap=1e-4`` (MB), DDP's buckets from its second step on are fc2,
    fc1.bias and fc1.weight: a bucket closes once it is over the cap."""
    torch.manual_seed(0)
    net = Net()
    if state_in is not None:
        net.load_state_dict(state_in['model'])
    model = DDP(net, bucket_cap_mb=cap)
    counter = CommCounter()
    names = {p: n for n, p in net.named_parameters()}
    spec = build_comm_hook(
        cfg, counter=counter, param_names=names, node_claim=claim)
    if state_in is not None and spec.state_keeper is not None:
        spec.state_keeper.load_state_dict(state_in['hook'])
    model.register_comm_hook(spec.state, spec.hook)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    applied, exact, counts = [], [], []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 16, generator=gen)
        y = x[:, :4] * 2 - x[:, 4:8]
        optim.zero_grad()
        raw = torch.autograd.grad(
            nn.functional.mse_loss(net(x), y), list(net.parameters()))
        means = [g.clone() for g in raw]
        for g in means:
            dist.all_reduce(g)
            g /= world_size
        exact.append(means)
        nn.functional.mse_loss(model(x), y).backward()
        applied.append([p.grad.clone() for p in net.parameters()])
        counts.append(counter.pop())
        optim.step()
    keeper = spec.state_keeper
    return dict(
        applied=applied,
        exact=exact,
        counts=counts,
        describe=spec.describe(),
        model={
            k: v.clone()
            for k, v in net.state_dict().items()
        },
        hook=keeper.state_dict() if keeper is not None else None)


INT8 = dict(type='int8_compress', block_size=32)


def _four_ranks(rank, world_size):
    """Every 2 x 2 case in one start of the ranks (each start costs
    seconds): name -> this rank's result."""

    def with_topology(topology, **cfg):
        return dict(INT8, topology=topology, **cfg)

    out = dict(
        one=_train(rank, world_size, with_topology(TWO_BY_TWO)),
        many=_train(rank, world_size, with_topology(TWO_BY_TWO), cap=1e-4),
        flat=_train(rank, world_size, with_topology('flat')),
        per_node_1=_train(rank, world_size,
                          with_topology(dict(ranks_per_node=1))),
        per_node_4=_train(rank, world_size,
                          with_topology(dict(ranks_per_node=4))),
        fp16=_train(rank, world_size,
                    dict(type='fp16_compress', topology=TWO_BY_TWO), 3),
        bf16=_train(rank, world_size,
                    dict(type='bf16_compress', topology=TWO_BY_TWO), 3))
    # Resumed after 3 steps from this rank's own state (the model is the
    # same on every rank), in a new DDP model that lays its buckets out
    # afresh.
    first = _train(rank, world_size, with_topology(TWO_BY_TWO), 3)
    out['resumed'] = _train(
        rank,
        world_size,
        with_topology(TWO_BY_TWO),
        3,
        state_in=first,
        start=3)
    describe = {}
    for name, cfg, claim in (('auto', INT8, _blocks_claim(rank, 2)),
                             ('silent', INT8, None), ('plain',
                                                      dict(type='allreduce'),
                                                      _blocks_claim(rank, 2))):
        describe[name] = build_comm_hook(cfg, node_claim=claim).describe()
    try:
        # The launcher placed the ranks round robin.
        build_comm_hook(
            with_topology(TWO_BY_TWO),
            node_claim=NodeClaim(rank % 2, rank // 2, 2))
    except ValueError as e:
        describe['contradicted'] = str(e)
    out['describe'] = describe
    return out


@pytest.fixture(scope='module')
def four():
    results = run_ranks(_four_ranks, world_size=4)
    return {name: [res[name] for res in results] for name in results[0]}


def _same_everywhere(results):
    for res in results[1:]:
        for a, b in zip(results[0]['applied'], res['applied']):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def _same_bits(one, other):
    for a, b in zip(one, other):
        for x, y in zip(a['applied'], b['applied']):
            for p, q in zip(x, y):
                assert torch.equal(p, q)


def _close_to_exact(res, tolerance):
    for applied, exact in zip(res['applied'], res['exact']):
        for a, e in zip(applied, exact):
            scale = e.abs().max().clamp(min=1e-6)
            assert (a - e).abs().max() / scale < tolerance


def test_two_level_int8_averages_within_its_rounding_and_layouts_agree(four):
    """The same on every rank, within the codec's error of the exact mean,
    and one bucket or one per parameter (DDP's rebuilt layout included)
    train to the same bits."""
    _same_everywhere(four['one'])
    # Two roundings of blocks of 32, each at most half a step of
    # max/127: well under 2 % of the largest gradient.
    _close_to_exact(four['one'][0], 0.02)
    _same_bits(four['one'], four['many'])
    assert ('topology: two-level, 2 nodes x 2 ranks (ranks (0, 1) on node '
            '0, (2, 3) on node 1)') in four['one'][0]['describe']


def _three_nodes(rank, world_size):
    return _train(rank, world_size, dict(INT8, topology=TWO_BY_TWO), 3)


def test_three_nodes_of_two_ranks():
    results = run_ranks(_three_nodes, world_size=6)
    _same_everywhere(results)
    _close_to_exact(results[0], 0.02)
    assert 'two-level, 3 nodes x 2 ranks' in results[0]['describe']


def test_two_level_int8_sends_a_node_share_across_and_keeps_the_sum(four):
    """The byte count is what crosses nodes: each rank's half of the node
    sums, so about half the flat form's; and with error feedback the
    applied gradients plus the ranks' residuals add up to the true means
    (nothing lost, only delayed)."""
    two, flat = four['one'], four['flat']
    assert 'topology: flat (as set)' in flat[0]['describe']
    for a, b in zip(two, flat):
        (_, sent_two), (_, sent_flat) = a['counts'][-1], b['counts'][-1]
        # 676 values in blocks of 32: the flat form counts ~764 bytes;
        # across nodes the two-level form sends each rank's half of them.
        assert 0.4 * sent_flat < sent_two < 0.6 * sent_flat
    names = [n for n, _ in Net().named_parameters()]
    for i, name in enumerate(names):
        applied = sum(step[i] for step in two[0]['applied'])
        true = sum(step[i] for step in two[0]['exact'])
        kept = sum(res['hook']['params'][name] for res in two)
        torch.testing.assert_close(
            applied + kept.view_as(applied), true, rtol=0, atol=1e-5)


def test_two_level_int8_resumes_bit_for_bit(four):
    for whole, resumed in zip(four['one'], four['resumed']):
        _same_bits([dict(applied=whole['applied'][3:])], [resumed])


@pytest.mark.parametrize('hook', ['fp16', 'bf16'])
def test_two_level_half_precision_is_the_average_to_its_rounding(four, hook):
    two = four[hook]
    _same_everywhere(two)
    _close_to_exact(two[0], 0.01)
    # One all-reduce of each rank's half of the node's sum, in 2 bytes.
    numel = 16 * 32 + 32 + 32 * 4 + 4
    assert two[0]['counts'][-1] == (4 * numel, numel // 2 * 2)


def test_one_rank_a_node_or_one_node_is_the_flat_hook_bit_for_bit(four):
    for name, said in (('per_node_1', 'one rank a node'), ('per_node_4',
                                                           'one node')):
        assert f'topology: flat ({said}' in four[name][0]['describe']
        _same_bits(four['flat'], four[name])


def test_auto_follows_the_launcher_and_falls_back_flat_with_the_reason(four):
    said = four['describe'][0]
    assert 'topology: two-level, 2 nodes x 2 ranks' in said['auto']
    assert ('topology: flat (the launcher did not say which node ranks '
            '[0, 1, 2, 3] run on)') in said['silent']
    # allreduce has no two-level form: 'auto' is flat, and says so.
    assert ('topology: flat (this hook has no two-level form)'
            in said['plain'])


def test_a_stated_layout_the_launcher_contradicts_fails_on_every_rank(four):
    for said in four['describe']:
        assert 'but the launcher placed' in said['contradicted']


@pytest.mark.parametrize('topology, error, words', [
    ('nodes', ValueError, "should be 'auto', 'flat' or dict(ranks_per_node"),
    (2, TypeError, 'but got int: 2'),
    (dict(ranks=2), TypeError, 'takes the one key ranks_per_node'),
    (dict(ranks_per_node=0), ValueError, 'ranks_per_node should be an int'),
    (dict(ranks_per_node='8'), TypeError, 'ranks_per_node should be an int'),
])
def test_bad_topologies_are_refused_before_anything_is_built(
        topology, error, words):
    with pytest.raises(error) as raised:
        check_comm_hook_cfg(dict(type='int8_compress', topology=topology))
    assert words in str(raised.value)


def test_a_hook_without_a_two_level_form_refuses_a_stated_topology():
    with pytest.raises(ValueError) as raised:
        check_comm_hook_cfg(dict(type='powerSGD', topology=TWO_BY_TWO))
    assert str(raised.value) == (
        "comm_hook type 'powerSGD' has no two-level form, so "
        "topology={'ranks_per_node': 2} cannot apply. Two-level forms: "
        "bf16_compress, fp16_compress, int8_compress; leave topology out "
        "(or 'flat') for this hook.")
    for fine in ('auto', 'flat'):
        check_comm_hook_cfg(dict(type='powerSGD', topology=fine))
    with pytest.raises(ValueError, match='no two-level form yet'):
        build_sharded_comm(dict(type='bf16_compress', topology=TWO_BY_TWO))


def _fail_on_rank_1(rank, world_size):
    from mmcv_custom.hooks import worker
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=1e-4)
    spec = build_comm_hook(dict(INT8, topology=TWO_BY_TWO))
    failing = False

    def hook(state, bucket):
        if failing and rank == 1 and bucket.index() == 1:

            def boom():
                raise RuntimeError('injected on rank 1')

            return worker.run_on_comm_worker(boom, bucket)
        return spec.hook(state, bucket)

    model.register_comm_hook(spec.state, hook)
    x = torch.randn(8, 16)
    model(x).sum().backward()  # DDP's first step: one bucket
    failing = True
    try:
        model(x).sum().backward()
    except Exception as exc:  # noqa: B902 - what each rank raised
        return f'{type(exc).__name__}: {exc}'
    return 'no error'


def test_a_hook_failing_on_one_rank_raises_on_every_rank():
    """Rank 1 fails alone in the middle of a step: it raises, and every
    other rank, left waiting in a collective of either level, raises as
    soon as the connections close (run_ranks fails a hang after 60 s)."""
    results = run_ranks(_fail_on_rank_1, world_size=4, timeout=60)
    assert 'injected on rank 1' in results[1]
    for rank in (0, 2, 3):
        assert 'no error' not in results[rank], results
