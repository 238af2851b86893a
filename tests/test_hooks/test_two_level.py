"""The two-level (node-aware) forms of int8, fp16, bf16 and both PowerSGDs
(issue 30), on real gloo ranks: 2 nodes x 2 ranks and 3 x 2, as a config's
``topology`` builds them."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.analysis import cost as cc
from mmcv_custom.comm import COMM_HOOKS, CommCounter, build_comm_hook
from mmcv_custom.comm.builder import check_comm_hook_cfg
from mmcv_custom.comm.records import record_of
from mmcv_custom.comm.sharded import build_sharded_comm
from mmcv_custom.comm.traffic import sent_bytes
from mmcv_custom.hooks.topology import NodeClaim
from mmcv_custom.testing import run_ranks
from tests.test_hooks.test_int8_hook import Net

TWO_BY_TWO = dict(ranks_per_node=2)


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
# Rank 2 compresses fc1.weight (32 x 16) only; the rest goes as it is.
PSGD = dict(
    type='powerSGD',
    matrix_approximation_rank=2,
    start_powerSGD_iter=2,
    topology=TWO_BY_TWO)
# A rank as large as the matrices, and a rate that lets PyTorch's rule
# compress them: PowerSGD is then exact, up to fp32 rounding.
PSGD_EXACT = dict(PSGD, matrix_approximation_rank=16, min_compression_rate=0.1)
PSGD_BF16 = dict(PSGD, wrapper='bf16')
# New random Q each step, nothing carried over.
PSGD_COLD = dict(PSGD, warm_start=False, use_error_feedback=False)
BATCHED = dict(PSGD, type='batched_powerSGD')
# Each node rank's half of the 676-value bucket, 338 values, as a 19 x 19
# square whose last row is padding: rank 18 spans its columns, so PowerSGD
# is exact up to the rounding of Gram-Schmidt on 18 columns.
BATCHED_EXACT = dict(BATCHED, matrix_approximation_rank=18)


def _powersgd_cases(rank, world_size):
    """The PowerSGD cases of :func:`_four_ranks`."""
    out = dict(
        psgd_one=_train(rank, world_size, PSGD),
        psgd_many=_train(rank, world_size, PSGD, cap=1e-4),
        psgd_flat=_train(rank, world_size, dict(PSGD, topology='flat')),
        psgd_exact=_train(rank, world_size, PSGD_EXACT, 4),
        psgd_cold=_train(rank, world_size, PSGD_COLD, 4),
        psgd_bf16=_train(rank, world_size, PSGD_BF16),
        batched_one=_train(rank, world_size, BATCHED),
        batched_exact=_train(rank, world_size, BATCHED_EXACT, 4))
    for name, cfg in (('psgd', PSGD), ('psgd_bf16', PSGD_BF16), ('batched',
                                                                 BATCHED)):
        first = _train(rank, world_size, cfg, 3)
        out[f'{name}_resumed'] = _train(
            rank, world_size, cfg, 3, state_in=first, start=3)
        if name == 'psgd':
            # Each rank restores its node peer's state: the warm starts of
            # the matrices it compresses are the peer's zeros.
            states = [None] * world_size
            dist.all_gather_object(states, first['hook'])
            out['psgd_swapped'] = _train(
                rank,
                world_size,
                cfg,
                3,
                state_in=dict(first, hook=states[rank ^ 1]),
                start=3)
    return out


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
    out.update(_powersgd_cases(rank, world_size))
    out.update(_sharded_cases(rank, world_size))
    return out


def _sharded(rank, world_size, cfg, claim=None, steps=2):
    """FSDP2 (fully_shard on fc1 and the root) reducing as ``cfg`` says,
    set up as the runner hook does: each step's full gradients, the exact
    mean of the raw ones, and what the counter saw."""
    from torch.distributed.fsdp import fully_shard

    from mmcv_custom.comm.sharded import sharded_topology
    from mmcv_custom.hooks.sharded import install_reduce_scatter
    torch.manual_seed(0)
    net, plain = Net(), Net()
    plain.load_state_dict(net.state_dict())
    fully_shard(net.fc1)
    fully_shard(net)
    spec = build_sharded_comm(cfg)
    topology = sharded_topology(spec, claim)
    counter = CommCounter()
    install_reduce_scatter(net, spec.sent_dtype, counter, spec.int8_block_size,
                           topology.groups)
    applied, exact, counts = [], [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 16, generator=gen) * 10
        y = x[:, :4] * 2 - x[:, 4:8]
        raw = torch.autograd.grad(
            nn.functional.mse_loss(plain(x), y), list(plain.parameters()))
        for g in raw:
            dist.all_reduce(g)
            g /= world_size
        exact.append(list(raw))
        net.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        applied.append([p.grad.full_tensor() for p in net.parameters()])
        counts.append(counter.pop())
    return dict(
        applied=applied, exact=exact, counts=counts, describe=spec.describe())


SHARDED_INT8 = dict(INT8, error_feedback=False)


def _sharded_cases(rank, world_size):
    """The FSDP2 cases of :func:`_four_ranks`."""
    claim = _blocks_claim(rank, 2)
    return dict(
        sharded_two=_sharded(rank, world_size, SHARDED_INT8, claim),
        sharded_flat=_sharded(rank, world_size,
                              dict(SHARDED_INT8, topology='flat'), claim),
        sharded_bf16=_sharded(rank, world_size,
                              dict(type='bf16_compress', topology=TWO_BY_TWO)),
        sharded_fp16=_sharded(rank, world_size, dict(type='fp16_compress'),
                              claim),
        sharded_plain=_sharded(rank, world_size, dict(type='allreduce'),
                               claim))


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
    return dict(
        int8=_train(rank, world_size, dict(INT8, topology=TWO_BY_TWO), 3),
        psgd=_train(rank, world_size, PSGD_EXACT, 3),
        batched=_train(rank, world_size, BATCHED_EXACT, 3))


def test_three_nodes_of_two_ranks():
    """Every form among 3 peers across nodes: the same on every rank, and
    as near the mean as on 2 nodes."""
    results = run_ranks(_three_nodes, world_size=6)
    for name, tolerance in (('int8', 0.02), ('psgd', 1e-5), ('batched', 1e-3)):
        runs = [res[name] for res in results]
        _same_everywhere(runs)
        _close_to_exact(runs[0], tolerance)
        assert 'two-level, 3 nodes x 2 ranks' in runs[0]['describe']


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


def test_two_level_int8_counts_what_the_cost_model_derives(four):
    """The cost model lays the two-level exchange out as the hook does
    (block k to local rank k % G and node (k // G) % M, segments padded
    to 4 bytes): what crosses nodes is the same to the byte, on every
    step after the first."""
    specs = [
        cc.ParamSpec(tuple(p.shape), 'float32') for p in Net().parameters()
    ]
    buckets = cc.ddp_buckets(specs, 25)
    form = cc.Int8Cost(block_size=32).two_level(2, 2)
    crossing = [(c.kind, c.nbytes) for bucket in form.collectives(buckets, 4)
                for c in bucket if c.level == 'cross']
    counted = [res['counts'][-1][1] for res in four['one']]
    assert max(counted) == sent_bytes(crossing, 2)


@pytest.mark.parametrize('case, hook, settings', [
    ('one', 'int8_compress', dict(block_size=32)),
    ('flat', 'int8_compress', dict(block_size=32)),
    ('fp16', 'fp16_compress', {}),
    ('bf16', 'bf16_compress', {}),
    ('psgd_one', 'powerSGD', dict(powersgd_rank=2)),
    ('batched_one', 'batched_powerSGD', dict(powersgd_rank=2)),
])
def test_the_cost_model_sends_what_the_run_counts(four, case, hook, settings):
    """The cost model's "sent per step" is the bytes of the run's
    ``comm_MB``, on 2 nodes x 2 ranks (after the PowerSGDs' warm-up):
    for a two-level form what crosses nodes only, about half the flat
    form's. Where its ranks' shares differ (int8's blocks go to local
    ranks in turn, PowerSGD's whole tensors to owners), int8's is the
    largest share, as its collectives are padded to, and PowerSGD's the
    mean, as its shares are balanced."""
    specs = [
        cc.ParamSpec(tuple(p.shape), 'float32') for p in Net().parameters()
    ]
    cost = cc.hook_costs(**settings)[hook]
    if case != 'flat':
        cost = cost.two_level(2, 2)
    predicted = cc.predict_step(cost, cc.ddp_buckets(specs, 25),
                                cc.Cluster(2, 2, 1e9), 0.0, 0.0)
    counted = [res['counts'][-1][1] for res in four[case]]
    assert predicted.form == ('flat' if case == 'flat' else 'two-level')
    share = max(counted) if hook == 'int8_compress' else (sum(counted) /
                                                          len(counted))
    assert predicted.sent_bytes == share
    if case == 'one':
        flat = [res['counts'][-1][1] for res in four['flat']]
        assert 0.4 * max(flat) < predicted.sent_bytes < 0.6 * max(flat)


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
    for name, said in (('per_node_1', 'one rank a node, 4 nodes'),
                       ('per_node_4', 'one node of 4 ranks')):
        assert f'topology: flat ({said})' in four[name][0]['describe']
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


@pytest.mark.parametrize(
    'topology, error, words',
    [
        ('nodes', ValueError,
         "should be 'auto', 'flat' or dict(ranks_per_node"),
        (2, TypeError, 'but got int: 2'),
        (dict(ranks=2), TypeError, 'takes the one key ranks_per_node'),
        (dict(ranks_per_node=0), ValueError,
         'ranks_per_node should be an int'),
        (dict(ranks_per_node='8'), TypeError,
         'ranks_per_node should be an int'),
        # What --cfg-options comm_hook.topology=dict(ranks_per_node=2) gives.
        ('dict(ranks_per_node=2)', ValueError,
         "but got 'dict(ranks_per_node=2)'; on the command line give the key "
         'itself: --cfg-options comm_hook.topology.ranks_per_node=N'),
    ])
def test_bad_topologies_are_refused_before_anything_is_built(
        topology, error, words):
    with pytest.raises(error) as raised:
        check_comm_hook_cfg(dict(type='int8_compress', topology=topology))
    assert words in str(raised.value)


def test_a_hook_without_a_two_level_form_refuses_a_stated_topology():
    with pytest.raises(ValueError) as raised:
        check_comm_hook_cfg(dict(type='allreduce', topology=TWO_BY_TWO))
    # The registered hooks whose records name a two-level form: today
    # batched_powerSGD, bf16_compress, fp16_compress, int8_compress and
    # powerSGD.
    forms = sorted(name for name, hook in COMM_HOOKS.module_dict.items()
                   if record_of(hook).two_level)
    assert {
        'batched_powerSGD', 'bf16_compress', 'fp16_compress', 'int8_compress',
        'powerSGD'
    } <= set(forms)
    assert str(raised.value) == (
        "comm_hook type 'allreduce' has no two-level form, so "
        "topology={'ranks_per_node': 2} cannot apply. Two-level forms: "
        f"{', '.join(forms)}; leave topology out (or 'flat') for this hook.")
    for fine in ('auto', 'flat'):
        check_comm_hook_cfg(dict(type='allreduce', topology=fine))
        build_sharded_comm(dict(type='allreduce', topology=fine))
    with pytest.raises(ValueError, match="'allreduce' has no two-level"):
        build_sharded_comm(dict(type='allreduce', topology=TWO_BY_TWO))


def test_fsdp2_two_level_int8_is_the_mean_and_crosses_a_node_share(four):
    """FSDP2's reduce-scatter in two levels: the same on every rank, one
    int8 rounding off the mean (as the flat form), and across nodes
    exactly 1/G of the flat form's bytes (each chunk's segment goes to
    M peers instead of all W ranks)."""
    two, flat = four['sharded_two'], four['sharded_flat']
    _same_everywhere(two)
    _close_to_exact(two[0], 0.01)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(two[0]['applied'][0], flat[0]['applied'][0]))
    assert ('in int8, one fp32 scale per 32 values, no error feedback, '
            'averaged before the rounding, topology: two-level, 2 nodes x '
            '2 ranks') in two[0]['describe']
    assert 'topology: flat (as set)' in flat[0]['describe']
    for a, b in zip(two, flat):
        (base_two, sent_two), (base_flat, sent_flat) = (a['counts'][-1],
                                                        b['counts'][-1])
        assert base_two == base_flat
        assert sent_two * 2 == sent_flat


def test_fsdp2_two_level_half_precision_and_the_exact_type(four):
    """bf16 (stated) and fp16 (auto, from the launcher) in two levels:
    the mean to the wire's rounding; allreduce has no two-level form, so
    auto leaves it flat, and exact."""
    for name in ('sharded_bf16', 'sharded_fp16'):
        _same_everywhere(four[name])
        _close_to_exact(four[name][0], 0.01)
        assert 'topology: two-level, 2 nodes x 2 ranks' in (
            four[name][0]['describe'])
    plain = four['sharded_plain']
    assert 'topology: flat (this hook has no two-level form)' in (
        plain[0]['describe'])
    _close_to_exact(plain[0], 1e-6)


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


def test_two_level_powersgd_is_exact_where_its_rank_is_full(four):
    """At a rank as large as each matrix, both forms' approximations are
    the matrices themselves: the two-level average is the exact mean to
    fp32 rounding, the same on every rank, through the warm-up and the
    compressed steps."""
    for name, tolerance in (('psgd_exact', 1e-5), ('batched_exact', 1e-3)):
        _same_everywhere(four[name])
        _close_to_exact(four[name][0], tolerance)
    assert ('topology: two-level, 2 nodes x 2 ranks'
            in four['psgd_one'][0]['describe'])


def test_two_level_powersgd_follows_the_parameters_not_the_buckets(four):
    """One bucket or one per parameter (and DDP's rebuilt layout): every
    tensor has the same owner, sums in the same order and the same warm
    start, so the run is the same to the bit. At rank 2 it is lossy, but
    stays near the mean."""
    _same_everywhere(four['psgd_one'])
    _same_everywhere(four['batched_one'])
    _same_bits(four['psgd_one'], four['psgd_many'])
    for name in ('psgd_one', 'batched_one'):
        res = four[name][0]
        # The warm-up steps are plain means (two-level, in fp32).
        _close_to_exact(
            dict(applied=res['applied'][:2], exact=res['exact'][:2]), 1e-5)
        assert any(not torch.allclose(a, e, rtol=0, atol=1e-4)
                   for step in range(2, 6)
                   for a, e in zip(res['applied'][step], res['exact'][step]))


@pytest.mark.parametrize('name', ['psgd', 'psgd_bf16'])
def test_two_level_powersgd_resumes_bit_for_bit(four, name):
    """Error feedback, warm start, the generator and the step count, saved
    per parameter by the state keeper after 3 steps and restored into a
    new DDP model whose first buckets are laid out afresh; under the bf16
    wrapper too (the state in bf16, as PowerSGD computes)."""
    whole_runs = four['psgd_one' if name == 'psgd' else name]
    for whole, resumed in zip(whole_runs, four[f'{name}_resumed']):
        _same_bits([dict(applied=whole['applied'][3:])], [resumed])


def test_a_warm_start_the_rank_never_computed_is_drawn_afresh(four):
    """Restored where another node rank compressed a matrix (here: each
    rank given its peer's state), its warm start is the other rank's zero
    slot: drawn afresh, the matrix is still compressed, not zeroed for
    good (``P = M Q`` of a zero ``Q``)."""
    swapped = four['psgd_swapped']
    _same_everywhere(swapped)
    for step in swapped[0]['applied']:
        assert step[0].abs().max() > 0  # fc1.weight, the compressed one


def test_two_level_powersgd_without_warm_start_or_error_feedback(four):
    """New random factors every step, drawn alike by each owner's peers:
    in step on every rank, and no further from the mean than the mean's
    own size (rank 2 of 16, nothing carried over)."""
    _same_everywhere(four['psgd_cold'])
    _close_to_exact(four['psgd_cold'][0], 1.0)
    _same_everywhere(four['psgd_bf16'])


def test_two_level_batched_powersgd_resumes_compressing(four):
    """Batched PowerSGD's warm start belongs to a bucket's composition,
    which a resumed DDP's first layout changes (as in the flat form): not
    bit for bit, but it goes on compressing at once, in step on every
    rank, with what it sends across nodes unchanged."""
    _same_everywhere(four['batched_resumed'])
    for whole, resumed in zip(four['batched_one'], four['batched_resumed']):
        assert resumed['counts'][0] == whole['counts'][3]


@pytest.mark.parametrize('name', ['psgd_one', 'batched_one'])
def test_two_level_powersgd_error_feedback_keeps_the_sum(four, name):
    """Each owner keeps what its approximation missed of its node's sum:
    the applied gradients plus every rank's residual over the world size
    add up to the true means (nothing lost, only delayed)."""
    two = four[name]
    names = [n for n, _ in Net().named_parameters()]
    for i, param in enumerate(names):
        applied = sum(step[i] for step in two[0]['applied'])
        true = sum(step[i] for step in two[0]['exact'])
        kept = sum(res['hook']['params'][param]['error'] for res in two)
        torch.testing.assert_close(
            applied + kept.view_as(applied) / 4, true, rtol=0, atol=1e-5)


def test_two_level_powersgd_counts_what_crosses_nodes(four):
    """Each rank counts the all-reduces among its peers on the other
    nodes: during the warm-up its share of the node's sums, compressing
    its own tensors' factors and uncompressed tensors. A node's ranks
    together send what one rank of the flat form sends."""
    two, flat = four['psgd_one'], four['psgd_flat']
    numel = 16 * 32 + 32 + 32 * 4 + 4
    for step in (0, 5):
        node = sum(res['counts'][step][1] for res in two[:2])
        assert node == (4 * numel if step == 0 else flat[0]['counts'][step][1])
        # Each rank sends a part of it.
        assert all(0 < res['counts'][step][1] < node for res in two)


def test_the_cost_model_counts_what_fsdp2_s_forms_sent(four):
    """The cost model's FSDP2 forms (:mod:`mmcv_custom.analysis.cost.fsdp2`)
    on the same units (fc1, then the root's fc2) and layout, 2 nodes x 2
    ranks: what each step's reduce-scatters sent, as the counter saw it,
    flat and in two levels, to the byte."""
    from mmcv_custom.analysis.cost import (ParamSpec, hook_costs, shard_units,
                                           sharded_costs)
    from mmcv_custom.engine.fsdp2_units import unit_parameters
    net = Net()
    units = shard_units([(name, [
        (ParamSpec(tuple(p.shape)), True) for _, p in own
    ]) for name, _, own in unit_parameters(net, [('fc1', net.fc1)])])
    costs = sharded_costs(hook_costs(block_size=INT8['block_size']))
    for case, hook, two_level in [('sharded_two', 'int8_compress', True),
                                  ('sharded_flat', 'int8_compress', False),
                                  ('sharded_bf16', 'bf16_compress', True),
                                  ('sharded_fp16', 'fp16_compress', True),
                                  ('sharded_plain', 'allreduce', False)]:
        cost = costs[hook]
        if two_level:
            cost = cost.two_level(2, 2)
        for rank in four[case]:
            assert rank['counts'][-1][1] == cost.sent_bytes(units, 4), case
