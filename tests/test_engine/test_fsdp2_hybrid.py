"""Hybrid sharding (HSDP) in FSDP2Strategy, on real gloo ranks: 4 ranks as
2 emulated nodes x 2 ranks (``ranks_per_node=2`` stated, or torchrun's
environment set per rank).

Layers: FSDP2 on a 2-D mesh against full sharding on one step of a small
model, with FSDP2's own reduction and with the project's reduce-scatter
installed; the sharding decided from the node layout (log line, errors);
``comm_hook`` checks under hybrid; the tiny InternViT UperNet config
trained by a real FlexibleRunner (resume bit for bit, a hybrid checkpoint
loaded under full sharding).
"""
import glob
import os
import os.path as osp
import shutil

import pytest
import torch
from mmengine.config import Config

import mmcv_custom  # noqa: F401  (registers the strategy and the hook)
from mmcv_custom.comm import CommCounter
from mmcv_custom.comm.sharded import build_sharded_comm, check_sharded_cfg
from mmcv_custom.engine.fsdp2_mesh import plan_sharding
from mmcv_custom.hooks.hybrid import (CrossNodeAllReduce, HybridInt8State,
                                      HybridInt8StateKeeper,
                                      Int8CrossNodeAllReduce,
                                      install_cross_node, mark_hybrid)
from mmcv_custom.hooks.sharded import fsdp_replicas, install_reduce_scatter
from mmcv_custom.integrity.sharded_checkpoint import \
    consolidate_sharded_checkpoint
from mmcv_custom.launching.preflight.config_values import comm_hook_problems
from mmcv_custom.testing import run_ranks
from tests.test_engine.test_fsdp2 import _Net, _train


# -- FSDP2 over each node, the shards averaged across nodes, one step --------
def _hybrid_net(hook_of, install=False, dtype=torch.float32):
    """``_Net`` (in ``dtype``) sharded over this rank's node (2 x 2), its
    shards averaged across nodes by ``hook_of(cross-node group)``; with the
    project's reduce-scatter inside the node when ``install``."""
    from torch.distributed.fsdp import fully_shard

    from mmcv_custom.engine.fsdp2_mesh import ShardingPlan, hybrid_mesh
    from mmcv_custom.hooks.topology import blocks_layout
    node, cross = hybrid_mesh(
        ShardingPlan(blocks_layout(4, 2), 'hybrid'), 'cpu')
    torch.manual_seed(0)
    model = _Net().to(dtype)
    fully_shard(model.a, mesh=node)
    fully_shard(model, mesh=node)
    mark_hybrid(model, cross)
    if install:
        assert install_reduce_scatter(model, None) == 2
    assert install_cross_node(model, hook_of(cross)) == 2
    return model


def _grads(model, rank, steps=1, scale=100):
    out = []
    for step in range(steps):
        torch.manual_seed(rank + 10 * step)
        x = torch.randn(4, 8) * scale
        dtype = next(model.parameters()).dtype
        model(x.to(dtype)).sum().backward()
        out.append({
            n: p.grad.full_tensor().clone()
            for n, p in model.named_parameters()
        })
        model.zero_grad()
    return out


def _one_step(rank, world_size):
    """One step of ``_Net`` sharded fully, and hybrid (2 x 2) with the
    exact cross-node all-reduce (FSDP2's reduce-scatter inside the node,
    or the project's), with bf16 and with int8 on the wire; and of ``_Net``
    in bf16 (a bf16 backbone's shards) with int8 and error feedback."""
    from torch.distributed.fsdp import fully_shard
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = _Net().to(dtype)
        fully_shard(model.a)
        fully_shard(model)
        out['full', dtype] = (_grads(model, rank)[0], fsdp_replicas(model))
    counter = CommCounter()
    model = _hybrid_net(
        lambda g: Int8CrossNodeAllReduce(g, HybridInt8State(4), counter),
        dtype=torch.bfloat16)
    out['bf16 model'] = (_grads(model,
                                rank)[0], fsdp_replicas(model), counter.pop())
    cases = dict(
        exact=lambda g, c: CrossNodeAllReduce(g, None, c),
        installed=lambda g, c: CrossNodeAllReduce(g, None, c),
        bf16=lambda g, c: CrossNodeAllReduce(g, torch.bfloat16, c),
        int8=lambda g, c: Int8CrossNodeAllReduce(
            g, HybridInt8State(4, error_feedback=False), c))
    for name, make in cases.items():
        counter = CommCounter()
        model = _hybrid_net(
            lambda g: make(g, counter), install=name == 'installed')
        out[name] = (_grads(model,
                            rank)[0], fsdp_replicas(model), counter.pop())
    return out


# _Net's shards on each rank of a 2-rank node: a (16 x 8 + 16, dim 0 padded
# to 2 ranks) and the root (4 x 16 + 4), fp32.
_SHARD = (16 * 8 + 16) // 2 + (4 * 16 + 4) // 2


def test_hybrid_gradients_are_those_of_full_sharding():
    for out in run_ranks(_one_step, world_size=4):
        full, replicas = out['full', torch.float32]
        assert replicas == 1
        # bf16 shards: rounded to int8 and the result to bf16, its baseline
        # 2 bytes a value.
        bf16, _ = out['full', torch.bfloat16]
        hybrid, replicas, (baseline, _) = out['bf16 model']
        largest = max(g.float().abs().max() for g in bf16.values())
        assert replicas == 2 and baseline == 2 * _SHARD
        for name, grad in bf16.items():
            assert hybrid[name].dtype is torch.bfloat16
            assert torch.allclose(
                hybrid[name].float(),
                grad.float(),
                rtol=2e-2,
                atol=2e-2 * largest), name
        for case, tolerance in (('exact', 1e-6), ('installed', 1e-6),
                                ('bf16', 1e-2), ('int8', 2e-2)):
            hybrid, replicas, (baseline, sent) = out[case]
            assert replicas == 2
            # int8's blocks span parameters: its rounding follows the
            # largest gradient of the unit.
            largest = max(g.abs().max() for g in full.values())
            for name, grad in full.items():
                # The same mean, summed in another order (fp32 rounding),
                # or rounded on the wire.
                assert torch.allclose(
                    hybrid[name],
                    grad,
                    rtol=tolerance,
                    atol=tolerance * largest), (name, case)
            # The mean over every rank, not over the node (twice that).
            assert not torch.allclose(hybrid['a.weight'], 2 * full['a.weight'])
            # Counted: the shard all-reduced across the nodes, as it is,
            # in bf16, or as int8 segments (2 chunks of the shard, each its
            # scales per 4 values and values padded to 4 bytes) that an
            # all-to-all and an all-gather carry.
            assert baseline == 4 * _SHARD, case
            chunks = [(16 * 8 + 16) // 4, (4 * 16 + 4) // 4]
            assert sent == dict(
                exact=4 * _SHARD,
                installed=4 * _SHARD,
                bf16=2 * _SHARD,
                int8=sum(2 * (4 * -(-c // 4) + -(-c // 4) * 4)
                         for c in chunks))[case], case


def _int8_steps(rank, world_size, steps):
    """``steps`` steps of int8 with error feedback in fp32 and in bf16, and
    without; each with its state saved. And the exact means."""
    exact = _grads(
        _hybrid_net(lambda g: CrossNodeAllReduce(g)), rank, steps, 1)
    out = {}
    for case, feedback, dtype in (('fp32', True, torch.float32),
                                  ('bf16', True, torch.bfloat16),
                                  ('none', False, torch.float32)):
        state = HybridInt8State(16, feedback, dtype)
        model = _hybrid_net(lambda g: Int8CrossNodeAllReduce(g, state))
        out[case] = (_grads(model, rank, steps,
                            1), HybridInt8StateKeeper(state,
                                                      (2, 2)).state_dict())
    return exact, out


def _drift(grads, exact) -> tuple:
    """How far the sum of ``grads`` over the steps is from the exact means'
    sum, and one step's rounding."""
    applied = {n: sum(g[n] for g in grads) for n in grads[0]}
    true = {n: sum(g[n] for g in exact) for n in exact[0]}
    drift = max((applied[n] - true[n]).abs().max() for n in true)
    return drift, max((grads[0][n] - exact[0][n]).abs().max() for n in true)


def test_int8_error_feedback_keeps_what_rounding_dropped():
    """Summed over steps, what int8 applied plus the residuals left equals
    the sum of the exact means: error feedback loses nothing for good. In
    bf16 (half the memory) the residual itself is rounded to 8 significant
    bits, 1/256 of int8's rounding; without feedback the rounding adds
    up."""
    for exact, out in run_ranks(_int8_steps, 4, world_size=4):
        for case, dtype in (('fp32', torch.float32), ('bf16', torch.bfloat16)):
            grads, saved = out[case]
            drift, one = _drift(grads, exact)
            # One step's rounding at most (block scale / 2), not four.
            assert drift <= 1.5 * one, case
            assert set(saved['residuals']) == {'', 'a'}
            assert saved['layout'] == (2, 2) and saved['block_size'] == 16
            assert {r.dtype for r in saved['residuals'].values()} == {dtype}
        grads, saved = out['none']
        assert saved['residuals'] == {}
        drift, one = _drift(grads, exact)
        assert drift > 1.5 * one


def test_int8_state_is_refused_on_another_layout():
    state = HybridInt8State(16)
    state.residuals = {'a': torch.ones(8)}
    saved = HybridInt8StateKeeper(state, (2, 2)).state_dict()
    HybridInt8StateKeeper(HybridInt8State(16), (2, 2)).check_state_dict(saved)
    with pytest.raises(ValueError) as info:
        HybridInt8StateKeeper(HybridInt8State(16),
                              (4, 1)).check_state_dict(saved)
    assert str(info.value) == (
        'it was saved on 2 nodes x 2 ranks, this run has 4 nodes x 1 ranks: '
        'its shards are other slices of the parameters')
    with pytest.raises(ValueError, match='its block_size is 16, this run'):
        HybridInt8StateKeeper(HybridInt8State(32),
                              (2, 2)).check_state_dict(saved)
    with pytest.raises(ValueError) as info:
        HybridInt8StateKeeper(
            HybridInt8State(16, True, torch.bfloat16),
            (2, 2)).check_state_dict(saved)
    assert str(info.value) == ('its residuals are float32, this run keeps '
                               'them in bfloat16 (residual_dtype)')
    keeper = HybridInt8StateKeeper(HybridInt8State(16), (2, 2))
    keeper.load_state_dict(saved)
    assert torch.equal(keeper.state.residuals['a'], torch.ones(8))
    # A residual of another size is never silently dropped or reused.
    with pytest.raises(ValueError, match='its shard now needs 12'):
        keeper.state.residual('a', 12, torch.device('cpu'))


# -- the sharding decided from the layout ------------------------------------
def _plans(rank, world_size, cases):
    """Each case's plan (or error) on this rank, the launcher's word set
    as the case says."""
    out = []
    for sharding, ranks_per_node, environ, _ in cases:
        for name in _TORCHRUN:
            os.environ.pop(name, None)
        os.environ.update({k: str(v(rank)) for k, v in environ.items()})
        try:
            plan = plan_sharding(sharding, ranks_per_node)
        except ValueError as e:
            out.append(('error', str(e)))
            continue
        out.append((plan.hybrid, plan.describe))
    return out


_TORCHRUN = dict(  # torchrun's word: 2 nodes x 2 ranks, in node blocks
    GROUP_RANK=lambda r: r // 2,
    LOCAL_RANK=lambda r: r % 2,
    LOCAL_WORLD_SIZE=lambda r: 2)
_CYCLIC = dict(  # ranks 0, 2 on node 0 and 1, 3 on node 1
    GROUP_RANK=lambda r: r % 2,
    LOCAL_RANK=lambda r: r // 2,
    LOCAL_WORLD_SIZE=lambda r: 2)
_NODES = "(ranks (0, 1) on node 0, (2, 3) on node 1)"

#: (sharding, ranks_per_node, the launcher's word, the plan or the error)
_CASES = [
    ('full', None, {}, (False, 'full: sharded over the 4 ranks')),
    ('hybrid', 2, {},
     (True, 'hybrid: sharded over the 2 ranks of each node, replicated '
      f'over 2 nodes (2 nodes x 2 ranks {_NODES})')),
    ('auto', None, _TORCHRUN,
     (True, 'hybrid: sharded over the 2 ranks of each node, replicated '
      "over 2 nodes (sharding='auto': several nodes of several ranks, 2 "
      f'nodes x 2 ranks {_NODES})')),
    ('auto', None, {},
     (False, "full: sharded over the 4 ranks (sharding='auto': the "
      'launcher did not say which node ranks [0, 1, 2, 3] run on)')),
    ('auto', 4, {},
     (False, "full: sharded over the 4 ranks (sharding='auto': one node of "
      '4 ranks)')),
    ('hybrid', 4, {},
     ('error', "FSDP2Strategy sharding='hybrid' shards inside each node and "
      'replicates across nodes, so it needs several nodes of several ranks, '
      'but the 4 ranks run on one node (ranks_per_node=4): there is nothing '
      "to replicate across. Use sharding='auto' (full sharding here, hybrid "
      "on several nodes of several ranks) or sharding='full'")),
    ('hybrid', 1, {},
     ('error', "FSDP2Strategy sharding='hybrid' shards inside each node and "
      'replicates across nodes, so it needs several nodes of several ranks, '
      'but each of the 4 nodes runs one rank (ranks_per_node=1): there is '
      "nothing to shard inside a node. Use sharding='auto' (full sharding "
      "here, hybrid on several nodes of several ranks) or sharding='full'")),
    ('auto', None, _CYCLIC,
     (False, "full: sharded over the 4 ranks (sharding='auto': the nodes "
      'are not blocks of consecutive ranks, 2 nodes x 2 ranks (ranks (0, '
      '2) on node 0, (1, 3) on node 1))')),
    ('hybrid', 3, {},
     ('error', 'FSDP2Strategy ranks_per_node=3 does not divide the 4 ranks '
      'into whole nodes: give a divisor of 4, or leave ranks_per_node out '
      'to take the layout from the launcher')),
    ('hybrid', None, {},
     ('error', "FSDP2Strategy sharding='hybrid' needs to know which ranks "
      'share a node, but the launcher did not say which node ranks [0, 1, '
      "2, 3] run on: state it, e.g. strategy=dict(type='FSDP2Strategy', "
      "sharding='hybrid', ranks_per_node=8), or use sharding='full'")),
    ('hybrid', None, _CYCLIC,
     ('error', "FSDP2Strategy sharding='hybrid' needs the ranks of each "
      'node to be consecutive (rank = node * ranks_per_node + local rank, '
      'as the (replicate, shard) device mesh lays them out), but the '
      'launcher placed them as 2 nodes x 2 ranks (ranks (0, 2) on node 0, '
      "(1, 3) on node 1): launch them in node blocks (Slurm's "
      "--distribution=block, torchrun), or use sharding='full'")),
    ('hybrid', 4, _TORCHRUN,
     ('error', 'FSDP2Strategy says ranks_per_node=4 (1 node x 4 ranks '
      '(ranks (0, 1, 2, 3) on node 0)), but the launcher placed the ranks '
      f'as 2 nodes x 2 ranks {_NODES}: remove ranks_per_node to follow the '
      'launcher, or launch the ranks as stated')),
]


def test_sharding_follows_the_node_layout():
    results = run_ranks(_plans, _CASES, world_size=4)
    for i, case in enumerate(_CASES):
        # Every rank decides the same, or raises the same.
        assert [r[i] for r in results] == [case[-1]] * 4, case[:2]


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(sharding='hsdp'), ValueError,
     "FSDP2Strategy sharding should be one of 'full', 'hybrid', 'auto', but "
     "got 'hsdp'"),
    (dict(sharding='hybrid', ranks_per_node=0), ValueError,
     'FSDP2Strategy ranks_per_node should be an int >= 1, but got 0'),
    (dict(sharding='hybrid', ranks_per_node='8'), TypeError,
     "FSDP2Strategy ranks_per_node should be an int >= 1, but got str: '8'"),
    (dict(ranks_per_node=8), ValueError,
     "FSDP2Strategy ranks_per_node=8 is for sharding='hybrid' or 'auto'; "
     "sharding='full' shards over every rank whatever the nodes: remove "
     "ranks_per_node, or set sharding='hybrid'"),
])
def test_sharding_arguments_are_checked(kwargs, error, message):
    from mmcv_custom.engine import FSDP2Strategy
    with pytest.raises(error) as info:
        FSDP2Strategy(**kwargs)
    assert str(info.value) == message


# -- comm_hook under hybrid sharding -----------------------------------------
_NOT_UNDER_HYBRID = (
    "comm_hook type='powerSGD' has no form under hybrid sharding "
    "(FSDP2Strategy sharding='hybrid', or 'auto' on several nodes of "
    "several ranks): there each rank's gradient shard, a flat slice of a "
    "unit's parameters, crosses the nodes in one all-reduce, and this hook "
    'reduces DDP buckets of whole gradients (PowerSGD needs their '
    "matrices). Use one of 'allreduce', 'fp16_compress', 'bf16_compress', "
    "'int8_compress', or train this hook with DDP (the default Runner).")


def test_which_comm_hooks_run_under_hybrid():
    for cfg in (dict(type='allreduce'), dict(type='bf16_compress'),
                dict(type='int8_compress'), dict(type='auto')):
        check_sharded_cfg(cfg, hybrid=True)
    # int8's error feedback: a shard's residual under hybrid sharding, a
    # whole gradient's under full sharding (refused).
    with pytest.raises(
            ValueError,
            match='error_feedback=True has no form '
            'under full sharding'):
        check_sharded_cfg(dict(type='int8_compress'))
    with pytest.raises(ValueError) as info:
        check_sharded_cfg(dict(type='powerSGD'), hybrid=True)
    assert str(info.value) == _NOT_UNDER_HYBRID
    # int8's residual in bf16: hybrid sharding's key, and only there.
    bf16 = dict(type='int8_compress', residual_dtype='bfloat16')
    check_sharded_cfg(bf16, hybrid=True)
    spec = build_sharded_comm(bf16, hybrid=True)
    assert spec.residual_dtype is torch.bfloat16
    assert ("with error feedback of each rank's shard kept in bf16;"
            in spec.describe())
    for cfg, hybrid, message in (
        (bf16, False, "comm_hook int8_compress residual_dtype='bfloat16' is "
         "hybrid sharding's (FSDP2Strategy sharding='hybrid', or 'auto' on "
         'several nodes of several ranks), where the error feedback of each '
         "rank's shard is kept; under full sharding int8 keeps none and "
         'under DDP its residual is fp32. Remove residual_dtype, or shard '
         'hybrid.'),
        (dict(bf16, residual_dtype='fp16'), True,
         "comm_hook int8_compress residual_dtype should be one of "
         "'float32', 'bfloat16', but got 'fp16'"),
        (dict(bf16, error_feedback=False), True,
         "comm_hook int8_compress residual_dtype='bfloat16' with "
         'error_feedback=False changes nothing: there is no residual. '
         'Remove one of them.'),
        (dict(type='bf16_compress', residual_dtype='bfloat16'), True,
         "comm_hook residual_dtype='bfloat16' is int8_compress's key (its "
         "error feedback under hybrid sharding), not type='bf16_compress''s:"
         ' remove it'),
    ):
        with pytest.raises(ValueError) as info:
            check_sharded_cfg(cfg, hybrid=hybrid)
        assert str(info.value) == message
    # Under DDP: an unknown key, saying where it belongs.
    from mmcv_custom.comm.builder import check_comm_hook_cfg
    with pytest.raises(
            Exception,
            match="residual_dtype is int8_compress's "
            'under hybrid FSDP2 sharding only'):
        check_comm_hook_cfg(bf16)
    # The preflight: before any rank starts.
    cfg = Config(
        dict(
            runner_type='FlexibleRunner',
            strategy=dict(type='FSDP2Strategy', sharding='hybrid'),
            comm_hook=dict(type='powerSGD')))
    assert [p.what for p in comm_hook_problems(cfg)] == [_NOT_UNDER_HYBRID]
    cfg.comm_hook = dict(type='int8_compress')
    assert comm_hook_problems(cfg) == []
    cfg.strategy.sharding = 'auto'
    assert comm_hook_problems(cfg) == []
    cfg.strategy.sharding = 'full'
    (problem, ) = comm_hook_problems(cfg)
    assert 'error_feedback=True has no form under full sharding' in (
        problem.what)
    cfg.comm_hook = dict(type='powerSGD')
    for sharding in ('full', 'auto'):
        cfg.strategy.sharding = sharding
        (problem, ) = comm_hook_problems(cfg)
        assert problem.what.startswith(
            "comm_hook type='powerSGD' has no "), sharding


# -- a real FlexibleRunner on 2 emulated nodes x 2 ranks ----------------------
# 'auto': hybrid on 2 nodes of 2 ranks, which only the ranks can tell (the
# preflight lets int8's error feedback through: it runs under hybrid, and
# the runner hook, which sees the mesh, lets it through only there). A
# topology changes nothing there, which the log says.
_HYBRID = dict(
    strategy=dict(type='FSDP2Strategy', sharding='auto', ranks_per_node=2),
    comm_hook=dict(type='int8_compress', topology='flat'))


def _train_overriding(rank, world_size, work_dir, max_iters, resume,
                      overrides):
    return _train(rank, world_size, work_dir, max_iters, resume, **overrides)


def _train4(work_dir, max_iters, resume=False, **overrides):
    """The tiny config trained by a FlexibleRunner on 4 gloo ranks."""
    return run_ranks(
        _train_overriding,
        work_dir,
        max_iters,
        resume,
        overrides,
        world_size=4,
        timeout=300)


@pytest.fixture(scope='module')
def hybrid_run(tmp_path_factory):
    root = tmp_path_factory.mktemp('hsdp')
    work = str(root / 'whole')
    return root, work, _train4(work, 3, **_HYBRID)


def _log_of(work):
    (log, ) = glob.glob(osp.join(work, '*', '*.log'))
    with open(log) as f:
        return f.read()


@pytest.mark.slow
def test_flexible_runner_trains_hybrid(hybrid_run):
    _, work, results = hybrid_run
    for r in results:
        assert r['losses'][-1] < r['losses'][0]
        # Each rank holds about half (sharded over its node's 2 ranks).
        assert 0.45 * r['numel'] < r['local_numel'] < 0.55 * r['numel']
        # int8 with one fp32 scale per 256 values against fp32 shards.
        assert all(0.25 < x < 0.26 for x in r['comm_ratio'])
        # What crosses the nodes: about the rank's shard (half the model),
        # once, at a byte a value.
        assert all(0.5 * r['numel'] < x * 2**20 < 0.5 * r['numel'] * 1.02
                   for x in r['comm_MB'])
    # DCP writes each replicated shard once, spread over the ranks; the
    # manifest covers every file it wrote.
    ckpt = osp.join(work, 'iter_3.pth')
    with open(osp.join(ckpt, 'SHA256SUMS')) as f:
        listed = {line.split()[1] for line in f}
    assert listed == set(os.listdir(ckpt)) - {'SHA256SUMS'}
    assert {f'__{rank}_0.distcp' for rank in range(4)} <= listed
    # Every rank's residual, beside the checkpoint.
    assert sorted(glob.glob(ckpt + '.comm_hook_rank*.pth')) == [
        f'{ckpt}.comm_hook_rank{r}.pth' for r in range(4)
    ]
    log = _log_of(work)
    assert ('and the whole EncoderDecoder over 4 ranks (gloo); hybrid: '
            'sharded over the 2 ranks of each node, replicated over 2 nodes '
            "(sharding='auto': several nodes of several ranks, 2 nodes x 2 "
            f'ranks {_NODES}, memory not checked on cpu); '
            'reshard_after_forward=True') in log
    assert ("type='int8_compress' (hybrid sharding: FSDP2 reduce-scatters "
            "inside the node in the gradients' dtype, then each shard "
            'crosses the nodes in one all-reduce in int8, one fp32 scale per '
            "256 values, with error feedback of each rank's shard; comm_MB "
            'counts that all-reduce across the 2 nodes, not the '
            'reduce-scatter inside the node); process group: 4 ranks as 2 '
            'nodes x 2, backend gloo; int8 codec: ') in log
    assert ("WARNING - comm_hook topology='flat' changes nothing under "
            'hybrid sharding: the all-reduce that crosses the nodes already '
            'runs among one rank a node') in log


def _resume_from_iter_2(whole, work, **overrides):
    """``whole``'s iteration-2 checkpoint (with its hook state files)
    resumed in ``work`` up to 3."""
    os.makedirs(work)
    shutil.copytree(
        osp.join(whole, 'iter_2.pth'), osp.join(work, 'iter_2.pth'))
    for state in glob.glob(osp.join(whole, 'iter_2.pth.comm_hook_rank*')):
        shutil.copy(state, work)
    with open(osp.join(work, 'last_checkpoint'), 'w') as f:
        f.write(osp.join(work, 'iter_2.pth'))
    results = _train4(work, 3, True, **overrides)
    assert results[0]['iter'] == 3
    return results, consolidate_sharded_checkpoint(
        osp.join(work, 'iter_3.pth'))['state_dict']


@pytest.mark.slow
def test_hybrid_resumes_bit_for_bit_with_its_residuals(hybrid_run):
    root, whole, results = hybrid_run
    done = consolidate_sharded_checkpoint(osp.join(whole, 'iter_3.pth'))
    done = done['state_dict']
    resumed, weights = _resume_from_iter_2(whole, str(root / 'part'),
                                           **_HYBRID)
    # The residuals came back (copied with the checkpoint): bit for bit.
    assert ('Restored the int8_compress state (error feedback of each '
            "unit's shard) of all 4 ranks") in _log_of(str(root / 'part'))
    assert resumed[0]['losses'] == results[0]['losses']
    assert weights.keys() == done.keys()
    for key, value in done.items():
        assert torch.equal(value, weights[key]), key
    # Under full sharding, and back: test_fsdp2_layouts.py.


@pytest.mark.slow
def test_auto_tries_each_cross_node_form_under_hybrid(tmp_path):
    """``comm_hook`` auto under hybrid sharding: the candidates of full
    sharding, each the format of the cross-node all-reduce in its turn,
    then the kept one."""
    results = _train4(
        str(tmp_path / 'w'),
        5,
        strategy=dict(
            type='FSDP2Strategy', sharding='hybrid', ranks_per_node=2),
        comm_hook=dict(
            type='auto',
            max_loss='quantized',
            trial_iters=1,
            candidates=['bf16_compress', 'int8_compress']))
    ratios = [r['comm_ratio'] for r in results]
    assert ratios[0][:2] == pytest.approx([0.5, 0.254], abs=0.003)
    assert ratios[0][2:4] == ratios[0][:2]
    assert all(r == ratios[0] for r in ratios)
    log = _log_of(str(tmp_path / 'w'))
    assert 'int8_compress error_feedback=False' in log
    assert ('Registered the gradient reduction on the FSDP2 model (8 '
            'sharded modules, chosen by comm_hook auto, dict(type=') in log
    assert 'hybrid sharding: FSDP2 reduce-scatters inside the node' in log
    assert results[0]['iter'] == 5


def test_auto_keeps_hybrid_only_where_the_node_shard_fits():
    from mmcv_custom.engine.fsdp2_mesh import ShardingPlan, fit_on_node
    from mmcv_custom.hooks.topology import blocks_layout
    plan = ShardingPlan(
        blocks_layout(32, 8), 'hybrid: sharded over the 8 ranks of each '
        "node, replicated over 4 nodes (sharding='auto': several nodes)")
    model = torch.nn.Linear(1000, 1000)  # 1001000 fp32 parameters
    state = 1001000 * (4 + 4 + 8)  # parameters, gradients, AdamW's two
    gib = 2**30
    # 16 MB of state over 8 ranks: 2 MB a GPU; fits in 2.67 MB (3/4 of it).
    kept = fit_on_node(plan, model, int(state / 8 / 0.75) + 1, 32)
    assert kept.hybrid and kept.describe.endswith(
        "(sharding='auto': several nodes, the node's shard fits: "
        f'{state / 8 / gib:.2f} GiB of parameters, gradients and AdamW '
        f'states per GPU of {(state / 8 / 0.75 + 1) / gib:.1f} GiB)')
    full = fit_on_node(plan, model,
                       int(state / 8 / 0.75) - 1000, 32,
                       dict(optimizer=dict(type='AdamW', lr=1e-4)))
    assert not full.hybrid and full.describe.startswith(
        "full: sharded over the 32 ranks (sharding='auto': on 4 nodes hybrid "
        'sharding would keep 0.00 GiB of parameters, gradients and AdamW '
        'states per GPU, over 75% of its 0.0 GiB; full sharding keeps')
    # SGD without momentum keeps nothing per parameter: it fits again.
    sgd = fit_on_node(plan, model,
                      int(state / 8 / 0.75) - 1000, 32,
                      dict(optimizer=dict(type='SGD', lr=0.1)))
    assert sgd.hybrid and 'gradients and SGD states' in sgd.describe
    assert fit_on_node(plan, model, None,
                       32).describe.endswith(', memory not checked on cpu)')
