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
from mmcv_custom.comm.sharded import check_sharded_cfg
from mmcv_custom.engine.fsdp2_mesh import plan_sharding
from mmcv_custom.hooks.sharded import fsdp_replicas, install_reduce_scatter
from mmcv_custom.integrity.sharded_checkpoint import \
    consolidate_sharded_checkpoint
from mmcv_custom.launching.preflight.config_values import comm_hook_problems
from mmcv_custom.registry import CommCounter
from mmcv_custom.testing import run_ranks
from tests.test_engine.test_fsdp2 import _Net, _train


# -- FSDP2 on a (replicate, shard) mesh, one step -----------------------------
def _one_step(rank, world_size):
    """One step of ``_Net`` sharded fully and hybrid (2 x 2), each with
    FSDP2's own reduction and with the project's reduce-scatter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(
        'cpu', (2, 2), mesh_dim_names=('replicate', 'shard'))
    out = {}
    for hybrid in (False, True):
        for install in (False, True):
            torch.manual_seed(0)
            model = _Net()
            fully_shard(model.a, mesh=mesh if hybrid else None)
            fully_shard(model, mesh=mesh if hybrid else None)
            counter = CommCounter()
            if install:
                assert install_reduce_scatter(model, None, counter) == 2
            torch.manual_seed(rank)
            model(torch.randn(4, 8) * 100).sum().backward()
            out[hybrid, install] = ({
                n: p.grad.full_tensor()
                for n, p in model.named_parameters()
            }, fsdp_replicas(model), counter.pop())
    return out


def test_hybrid_gradients_are_those_of_full_sharding():
    for out in run_ranks(_one_step, world_size=4):
        full, replicas, _ = out[False, False]
        assert replicas == 1
        for install in (False, True):
            hybrid, replicas, (baseline, sent) = out[True, install]
            assert replicas == 2
            for name, grad in full.items():
                # The same mean, summed in another order: fp32 rounding.
                assert torch.allclose(
                    hybrid[name],
                    grad,
                    rtol=1e-6,
                    atol=1e-6 * grad.abs().max()), (name, install)
            # The mean over every rank, not over the node (twice that).
            assert not torch.allclose(hybrid['a.weight'], 2 * full['a.weight'])
        # Installed, it counts the reduce-scatter inside the node: dim 0
        # padded to 2 ranks, fp32.
        assert baseline == sent == 4 * (16 * 8 + 16 + 4 * 16 + 4)


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
        out.append((plan.hybrid, plan.describe, plan.warn))
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
    ('full', None, {}, (False, 'full: sharded over the 4 ranks', False)),
    ('hybrid', 2, {},
     (True, 'hybrid: sharded over the 2 ranks of each node, replicated '
      f'over 2 nodes (2 nodes x 2 ranks {_NODES})', False)),
    ('auto', None, _TORCHRUN,
     (True, 'hybrid: sharded over the 2 ranks of each node, replicated '
      "over 2 nodes (sharding='auto': several nodes of several ranks, 2 "
      f'nodes x 2 ranks {_NODES})', False)),
    ('auto', None, {},
     (False, "full: sharded over the 4 ranks (sharding='auto': the "
      'launcher did not say which node ranks [0, 1, 2, 3] run on)', False)),
    ('auto', 4, {},
     (False, "full: sharded over the 4 ranks (sharding='auto': one node of "
      '4 ranks)', False)),
    ('hybrid', 4, {},
     (False, "full: sharded over the 4 ranks (sharding='hybrid', but one "
      'node of 4 ranks: nothing to replicate across, so full sharding)',
      True)),
    ('hybrid', 1, {},
     (False, "full: sharded over the 4 ranks (sharding='hybrid', but one "
      'rank a node, 4 nodes: nothing to replicate across, so full '
      'sharding)', True)),
    ('auto', None, _CYCLIC,
     (False, "full: sharded over the 4 ranks (sharding='auto': the nodes "
      'are not blocks of consecutive ranks, 2 nodes x 2 ranks (ranks (0, '
      '2) on node 0, (1, 3) on node 1))', False)),
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
    "comm_hook type='bf16_compress' does not run under hybrid sharding "
    "(FSDP2Strategy sharding='hybrid', or 'auto' on several nodes of "
    'several ranks): there FSDP2 reduce-scatters inside the node and '
    'all-reduces the shards across nodes uncompressed, '
    "which runs with comm_hook type='allreduce' or no comm_hook; a "
    'compressed cross-node all-reduce is not there yet. Use '
    "comm_hook=dict(type='allreduce'), remove comm_hook, or keep this hook "
    "with sharding='full'.")


def test_only_the_exact_reduction_runs_under_hybrid():
    check_sharded_cfg(dict(type='allreduce'), hybrid=True)
    check_sharded_cfg(dict(type='bf16_compress'))
    with pytest.raises(ValueError) as info:
        check_sharded_cfg(dict(type='bf16_compress'), hybrid=True)
    assert str(info.value) == _NOT_UNDER_HYBRID
    with pytest.raises(ValueError, match="type='auto' does not run under"):
        check_sharded_cfg(dict(type='auto'), hybrid=True)
    # The preflight: before any rank starts.
    cfg = Config(
        dict(
            runner_type='FlexibleRunner',
            strategy=dict(type='FSDP2Strategy', sharding='hybrid'),
            comm_hook=dict(type='bf16_compress')))
    assert [p.what for p in comm_hook_problems(cfg)] == [_NOT_UNDER_HYBRID]
    cfg.strategy.sharding = 'full'
    assert comm_hook_problems(cfg) == []


# -- a real FlexibleRunner on 2 emulated nodes x 2 ranks ----------------------
_HYBRID = dict(
    strategy=dict(type='FSDP2Strategy', sharding='hybrid', ranks_per_node=2),
    comm_hook=dict(type='allreduce'))


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
        assert r['comm_ratio'] == [1.0] * 3
    # DCP writes each replicated shard once, spread over the ranks; the
    # manifest covers every file it wrote.
    ckpt = osp.join(work, 'iter_3.pth')
    with open(osp.join(ckpt, 'SHA256SUMS')) as f:
        listed = {line.split()[1] for line in f}
    assert listed == set(os.listdir(ckpt)) - {'SHA256SUMS'}
    assert {f'__{rank}_0.distcp' for rank in range(4)} <= listed
    log = _log_of(work)
    assert ('and the whole EncoderDecoder over 4 ranks (gloo); hybrid: '
            'sharded over the 2 ranks of each node, replicated over 2 nodes '
            f'(2 nodes x 2 ranks {_NODES}); reshard_after_forward=True') in log
    assert ("type='allreduce' (FSDP2 reduce-scatter in the gradients' own "
            "dtype, averaged before the cast, topology: hybrid sharding: "
            "flat inside the node, then FSDP2's own all-reduce across the 2 "
            "nodes in the gradients' dtype; comm_MB counts the "
            'reduce-scatter inside the node only, not the all-reduce across '
            'nodes)') in log


def _resume_from_iter_2(whole, work, **overrides):
    """``whole``'s iteration-2 checkpoint resumed in ``work`` up to 3."""
    os.makedirs(work)
    shutil.copytree(
        osp.join(whole, 'iter_2.pth'), osp.join(work, 'iter_2.pth'))
    with open(osp.join(work, 'last_checkpoint'), 'w') as f:
        f.write(osp.join(work, 'iter_2.pth'))
    results = _train4(work, 3, True, **overrides)
    assert results[0]['iter'] == 3
    return results, consolidate_sharded_checkpoint(
        osp.join(work, 'iter_3.pth'))['state_dict']


@pytest.mark.slow
def test_hybrid_resumes_bit_for_bit_and_loads_under_full(hybrid_run):
    root, whole, results = hybrid_run
    done = consolidate_sharded_checkpoint(osp.join(whole, 'iter_3.pth'))
    done = done['state_dict']
    before = consolidate_sharded_checkpoint(osp.join(whole, 'iter_2.pth'))
    before = before['state_dict']
    resumed, weights = _resume_from_iter_2(whole, str(root / 'part'),
                                           **_HYBRID)
    assert resumed[0]['losses'] == results[0]['losses']
    assert weights.keys() == done.keys()
    for key, value in done.items():
        assert torch.equal(value, weights[key]), key
    # The same checkpoint resumed under full sharding over the 4 ranks
    # (DCP reshards it): the same step, the same means summed in another
    # order. AdamW divides by the gradients' root mean square, so where a
    # gradient is near zero the rounding shows in the update; the scale of
    # the mean is checked exactly on _Net above.
    full = str(root / 'full')
    fully, weights = _resume_from_iter_2(
        whole,
        full,
        comm_hook=dict(type='allreduce'),
        strategy=dict(type='FSDP2Strategy', sharding='full'))
    assert 'full: sharded over the 4 ranks' in _log_of(full)
    assert fully[0]['local_numel'] < 0.3 * fully[0]['numel']
    assert fully[0]['losses'][2] == pytest.approx(results[0]['losses'][2])
    for key, value in done.items():
        step = (value - before[key]).abs().max()
        assert (weights[key] - value).abs().max() <= 0.05 * step, key


@pytest.mark.slow
def test_the_runner_hook_refuses_a_compressing_hook_under_hybrid(tmp_path):
    """Under sharding='auto' the preflight cannot know; the runner hook,
    which sees the mesh, refuses before the first iteration."""
    from torch.multiprocessing import ProcessRaisedException
    with pytest.raises(ProcessRaisedException) as info:
        _train4(
            str(tmp_path / 'w'),
            1,
            strategy=dict(
                type='FSDP2Strategy', sharding='auto', ranks_per_node=2),
            comm_hook=dict(type='bf16_compress'))
    assert _NOT_UNDER_HYBRID in str(info.value)
    assert not glob.glob(str(tmp_path / 'w' / 'iter_*'))
