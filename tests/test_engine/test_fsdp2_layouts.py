"""FSDP2Strategy across layouts: what the preflight refuses before any rank
starts (bad strategy arguments, a sharding the nodes cannot hold, a
checkpoint of the other kind), and sharded checkpoints carried between
full and hybrid sharding and between numbers of ranks, on real gloo ranks
and a real FlexibleRunner.

Layers: the strategy's argument checks, shared by its constructor and the
preflight; the sharding decided from the launcher's environment (torchrun,
Slurm, Open MPI), the same as the ranks decide it; ``tools/train.py`` as a
user runs it (exit 2, one message, nothing written); a hybrid run's
checkpoint (2 emulated nodes x 2 ranks, ``ranks_per_node=2``) resumed
under full sharding on 2 ranks, that one back under hybrid sharding, and
converted.
"""
import os
import os.path as osp
import shutil
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config

import mmcv_custom  # noqa: F401  (registers the strategy and the hook)
from mmcv_custom.engine.fsdp2_mesh import plan_sharding
from mmcv_custom.integrity.sharded_checkpoint import \
    consolidate_sharded_checkpoint
from mmcv_custom.launching.preflight import Problem
from mmcv_custom.launching.preflight.strategy import strategy_problems
from mmcv_custom.testing import run_ranks
from tests.test_engine.test_fsdp2 import ROOT, TINY_FSDP2, _cfg
from tests.test_engine.test_fsdp2_hybrid import _log_of

TRAIN = osp.join(ROOT, 'tools', 'train.py')
CONVERT = osp.join(ROOT, 'tools', 'model_converters', 'fsdp2_to_pth.py')


def _fsdp2(**strategy) -> Config:
    return Config(
        dict(
            runner_type='FlexibleRunner',
            strategy=dict(type='FSDP2Strategy', **strategy)))


# -- the strategy's arguments -------------------------------------------------
_UNKNOWN = (
    "FSDP2Strategy got unknown keys ['shard_module'] (did you mean "
    "'shard_modules'?); valid keys: shard_modules, reshard_after_forward, "
    'mp_policy, broadcast_buffers, sharding, ranks_per_node, and '
    "MMEngine's DDPStrategy's sync_bn, work_dir, experiment_name, "
    'env_kwargs, log_kwargs, auto_scale_lr')


def test_every_bad_argument_is_named_at_once():
    """The preflight names each bad value (the constructor raises the
    first): the same checks, the same words."""
    from mmcv_custom.engine import FSDP2Strategy
    bad = dict(
        shard_module=['InternViTBlock'],
        reshard_after_forward='yes',
        sharding='hsdp',
        mp_policy=dict(reduce_dtype='bfloat16'))
    assert [p.what for p in strategy_problems(_fsdp2(**bad), 'none')] == [
        _UNKNOWN,
        "FSDP2Strategy reshard_after_forward should be True or False, but "
        "got 'yes'",
        "FSDP2Strategy sharding should be one of 'full', 'hybrid', 'auto', "
        "but got 'hsdp'",
        'FSDP2Strategy mp_policy: reduce_dtype is set by the comm_hook key, '
        'the one place that chooses how gradients are reduced: e.g. '
        "comm_hook = dict(type='bf16_compress') sends bf16, "
        "dict(type='allreduce') the gradients' own dtype. Remove "
        "reduce_dtype='bfloat16'."
    ]
    with pytest.raises(TypeError) as info:
        FSDP2Strategy(**bad)
    assert str(info.value) == _UNKNOWN
    for args, message in (
        (dict(sharding='hybrid', ranks_per_node=0),
         'FSDP2Strategy ranks_per_node should be an int >= 1, but got 0'),
        (dict(sharding='hybrid', ranks_per_node='8'),
         "FSDP2Strategy ranks_per_node should be an int >= 1, but got str: "
         "'8'"),
        (dict(ranks_per_node=8),
         "FSDP2Strategy ranks_per_node=8 is for sharding='hybrid' or 'auto'"
         "; sharding='full' shards over every rank whatever the nodes: "
         "remove ranks_per_node, or set sharding='hybrid'"),
        (dict(shard_modules='InternViTBlock'),
         'FSDP2Strategy shard_modules should be a list of module classes or '
         "class names, e.g. ['InternViTBlock'], but got 'InternViTBlock'"),
    ):
        assert strategy_problems(_fsdp2(**args), 'none') == [Problem(message)]
    # Other strategies are not ours to check; MMEngine's own keys pass.
    assert strategy_problems(
        Config(dict(strategy=dict(type='DDPStrategy', sharding='x'))),
        'pytorch') == []
    assert strategy_problems(_fsdp2(sync_bn='torch'), 'none') == []


# -- the sharding, on the nodes the launcher states ---------------------------
_TORCHRUN = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE',
             'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT')
_SLURM = ('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID', 'SLURM_NODEID',
          'SLURM_TASKS_PER_NODE')
_MPI = ('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
        'OMPI_COMM_WORLD_LOCAL_RANK', 'OMPI_COMM_WORLD_LOCAL_SIZE')


def _torchrun(world, local_world, rank=0):
    """Rank ``rank``'s environment under torchrun, ``local_world`` ranks a
    node (None: LOCAL_WORLD_SIZE and GROUP_RANK unset)."""
    env = dict(
        RANK=rank,
        LOCAL_RANK=rank % (local_world or world),
        WORLD_SIZE=world,
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=29500)
    if local_world is not None:
        env.update(
            LOCAL_WORLD_SIZE=local_world, GROUP_RANK=rank // local_world)
    return {k: str(v) for k, v in env.items()}


def _one_node(world, source):
    return ("FSDP2Strategy sharding='hybrid' shards inside each node and "
            'replicates across nodes, so it needs several nodes of several '
            f'ranks, but the {world} ranks run on one node ({source}): there '
            "is nothing to replicate across. Use sharding='auto' (full "
            'sharding here, hybrid on several nodes of several ranks) or '
            "sharding='full'")


def _one_rank_a_node(world, source):
    return ("FSDP2Strategy sharding='hybrid' shards inside each node and "
            'replicates across nodes, so it needs several nodes of several '
            f'ranks, but each of the {world} nodes runs one rank ({source}): '
            "there is nothing to shard inside a node. Use sharding='auto' "
            '(full sharding here, hybrid on several nodes of several ranks) '
            "or sharding='full'")


_LAUNCHER = 'as the launcher placed them'
_2X2 = '2 nodes x 2 ranks (ranks (0, 1) on node 0, (2, 3) on node 1)'

#: (launcher, its environment, strategy arguments, the problem or None)
_LAYOUTS = [
    ('pytorch', _torchrun(4,
                          4), dict(sharding='hybrid'), _one_node(4,
                                                                 _LAUNCHER)),
    ('pytorch', _torchrun(4, 1), dict(sharding='hybrid'),
     _one_rank_a_node(4, _LAUNCHER)),
    ('pytorch', _torchrun(1,
                          1), dict(sharding='hybrid'), _one_node(1,
                                                                 _LAUNCHER)),
    ('pytorch', _torchrun(4, None), dict(sharding='hybrid', ranks_per_node=4),
     _one_node(4, 'ranks_per_node=4')),
    ('pytorch', _torchrun(4, None), dict(sharding='hybrid', ranks_per_node=1),
     _one_rank_a_node(4, 'ranks_per_node=1')),
    ('pytorch', _torchrun(4, None), dict(sharding='hybrid'),
     "FSDP2Strategy sharding='hybrid' needs to know which ranks share a "
     'node, but the launcher did not say which node ranks [0, 1, 2, 3] run '
     "on: state it, e.g. strategy=dict(type='FSDP2Strategy', "
     "sharding='hybrid', ranks_per_node=8), or use sharding='full'"),
    # Ranks that do not divide into nodes: 6 on nodes of 4.
    ('pytorch', _torchrun(6, 4), dict(sharding='hybrid'),
     "FSDP2Strategy sharding='hybrid' needs to know which ranks share a "
     'node, but the nodes run uneven numbers of ranks (node 0: 4, node 1: '
     "2): state it, e.g. strategy=dict(type='FSDP2Strategy', "
     "sharding='hybrid', ranks_per_node=8), or use sharding='full'"),
    ('slurm',
     dict(
         SLURM_PROCID='0',
         SLURM_NTASKS='6',
         SLURM_LOCALID='0',
         SLURM_NODEID='0',
         SLURM_TASKS_PER_NODE='4,2'), dict(sharding='hybrid'),
     "FSDP2Strategy sharding='hybrid' needs to know which ranks share a "
     'node, but the nodes run uneven numbers of ranks (node 0: 4, node 1: '
     "2): state it, e.g. strategy=dict(type='FSDP2Strategy', "
     "sharding='hybrid', ranks_per_node=8), or use sharding='full'"),
    ('pytorch', _torchrun(4, 2), dict(sharding='hybrid', ranks_per_node=3),
     'FSDP2Strategy ranks_per_node=3 does not divide the 4 ranks into whole '
     'nodes: give a divisor of 4, or leave ranks_per_node out to take the '
     'layout from the launcher'),
    # ranks_per_node contradicting the launcher, either way.
    ('pytorch', _torchrun(4, 2), dict(sharding='auto', ranks_per_node=4),
     'FSDP2Strategy says ranks_per_node=4 (1 node x 4 ranks (ranks (0, 1, 2, '
     f'3) on node 0)), but the launcher placed the ranks as {_2X2}: remove '
     'ranks_per_node to follow the launcher, or launch the ranks as stated'),
    ('pytorch', _torchrun(4, 4), dict(sharding='hybrid', ranks_per_node=2),
     f'FSDP2Strategy says ranks_per_node=2 ({_2X2}), but the launcher placed '
     'the ranks as 1 node x 4 ranks (ranks (0, 1, 2, 3) on node 0): remove '
     'ranks_per_node to follow the launcher, or launch the ranks as stated'),
    # What holds.
    ('pytorch', _torchrun(4, 2), dict(sharding='hybrid'), None),
    ('pytorch', _torchrun(4, 2), dict(sharding='hybrid',
                                      ranks_per_node=2), None),
    ('pytorch', _torchrun(4, 4), dict(sharding='auto'), None),
    ('pytorch', _torchrun(6, 4), dict(sharding='auto'), None),
    ('slurm',
     dict(
         SLURM_PROCID='3',
         SLURM_NTASKS='4',
         SLURM_LOCALID='1',
         SLURM_NODEID='1',
         SLURM_TASKS_PER_NODE='2(x2)'), dict(sharding='hybrid'), None),
    ('mpi',
     dict(
         OMPI_COMM_WORLD_RANK='0',
         OMPI_COMM_WORLD_SIZE='4',
         OMPI_COMM_WORLD_LOCAL_RANK='0',
         OMPI_COMM_WORLD_LOCAL_SIZE='2'), dict(sharding='hybrid'), None),
    # One process shards nothing (tools/test.py of a hybrid config).
    ('none', {}, dict(sharding='hybrid'), None),
]


@pytest.mark.parametrize('launcher,environ,args,expected', _LAYOUTS)
def test_the_sharding_is_checked_on_the_launchers_nodes(
        launcher, environ, args, expected, monkeypatch):
    for name in _TORCHRUN + _SLURM + _MPI:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    problems = strategy_problems(_fsdp2(**args), launcher)
    assert problems == ([Problem(expected)] if expected else [])


def _plan_or_error(rank, world_size, cases):
    out = []
    for environ, args in cases:
        for name in _TORCHRUN[3:5]:
            os.environ.pop(name, None)
        os.environ.update(environ(rank))
        try:
            out.append(
                plan_sharding(args['sharding'],
                              args.get('ranks_per_node')).describe)
        except ValueError as e:
            out.append(str(e))
    return out


def test_the_ranks_decide_what_the_preflight_said(monkeypatch):
    """One decision, in two places: what 4 real ranks decide from every
    rank's launcher word is what the preflight said from rank 0's."""
    cases = [(lambda r, n=n: _torchrun(4, n, r), dict(sharding=s))
             for n in (4, 1, 2) for s in ('hybrid', 'auto')]
    results = run_ranks(_plan_or_error, cases, world_size=4)
    assert all(r == results[0] for r in results)
    for (environ, args), decided in zip(cases, results[0]):
        for name, value in environ(0).items():
            monkeypatch.setenv(name, value)
        problems = strategy_problems(_fsdp2(**args), 'pytorch')
        if decided.startswith('FSDP2Strategy'):  # an error
            assert problems == [Problem(decided)], args
        else:
            assert problems == [], (args, decided)
    assert results[0][:4] == [
        _one_node(4, _LAUNCHER),
        "full: sharded over the 4 ranks (sharding='auto': one node of 4 "
        'ranks)',
        _one_rank_a_node(4, _LAUNCHER),
        "full: sharded over the 4 ranks (sharding='auto': one rank a node, "
        '4 nodes)',
    ]
    assert results[0][4].startswith('hybrid: sharded over the 2 ranks of ')
    assert results[0][5].startswith('hybrid: sharded over the 2 ranks of ')


# -- through tools/train.py, as a user runs it --------------------------------
def _train_py(tmp_path, work, environ, *options, resume=None):
    """tools/train.py on the tiny FSDP2 config as one rank of a torchrun
    launch (its environment ``environ``), in work dir ``work``; the
    preflight stops it before the process group, so no other rank is
    needed."""
    env = {
        k: v
        for k, v in os.environ.items() if k not in _TORCHRUN + _SLURM + _MPI
    }
    env.update(environ)
    args = [
        sys.executable, TRAIN, TINY_FSDP2, '--launcher', 'pytorch',
        '--work-dir',
        str(tmp_path / work)
    ]
    if resume:
        args += ['--resume', resume]
    return subprocess.Popen(
        args + ['--cfg-options', 'comm_hook.type=allreduce', *options],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True)


def test_train_py_stops_every_rank_before_any_work(tmp_path):
    """Exit 2 on every rank, one message from local rank 0, nothing
    written: a sharding the launcher's one node cannot hold and a
    checkpoint of the other kind (an ordinary file under --resume), said
    together. (Each bad strategy argument's words: the tests above, on the
    preflight that train.py runs.)"""
    plain = tmp_path / 'iter_2.pth'
    torch.save(
        dict(meta=dict(iter=2), state_dict={'w': torch.ones(2)}), str(plain))
    runs = [
        _train_py(
            tmp_path,
            'a',
            _torchrun(4, 4, rank),
            'strategy.sharding=hybrid',
            resume=str(plain)) for rank in (0, 1)
    ]
    spoke, quiet = [(r.wait(timeout=300), ) + r.communicate() for r in runs]
    assert quiet == (2, '', '')
    assert spoke[0] == 2, spoke[2]
    assert spoke[1] == ''
    assert spoke[2].splitlines() == [
        'train.py: error: 2 problems, found before building the model or '
        'starting the process group:',
        f'  1. {_one_node(4, _LAUNCHER)}',
        f"  2. {plain} is an ordinary checkpoint (one file, a DDP run's): an "
        'FSDP2 config resumes only a sharded checkpoint directory that '
        'FSDP2Strategy wrote. Fix: to start this config from its weights, '
        f'use --cfg-options load_from={plain} without --resume',
    ]
    assert sorted(os.listdir(tmp_path)) == ['iter_2.pth']


# -- checkpoints across layouts, on a real FlexibleRunner ---------------------
_HYBRID_2X2 = dict(
    strategy=dict(type='FSDP2Strategy', sharding='hybrid', ranks_per_node=2),
    comm_hook=dict(type='allreduce'))
# 2 emulated nodes of 1 rank: 'auto' shards fully, and says why.
_FULL_2 = dict(
    strategy=dict(type='FSDP2Strategy', sharding='auto', ranks_per_node=1),
    comm_hook=dict(type='allreduce'))


def _full_state(runner) -> dict:
    """The model's and the optimizer's whole state (every rank calls it;
    rank 0's copy is returned)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(runner.model, options=options)
    optim = get_optimizer_state_dict(
        runner.model, runner.optim_wrapper.optimizer, options=options)
    # Copies: a buffer's entry is the buffer itself, which training moves.
    return torch.utils._pytree.tree_map(
        lambda t: t.clone() if torch.is_tensor(t) else t,
        dict(model=model, optim=optim.get('state', {})))


def _run(rank, world_size, work_dir, max_iters, resume, overrides):
    """Train (or resume) the tiny config; the whole state where training
    started (after the resume) and where it ended."""
    from mmengine.hooks import Hook
    from mmengine.runner import FlexibleRunner
    os.chdir(osp.dirname(work_dir))
    cfg = _cfg(work_dir, max_iters, **overrides)
    cfg.resume = resume
    runner = FlexibleRunner.from_cfg(cfg)
    seen = {}

    class _Start(Hook):

        def before_run(self, runner):
            seen['start'] = _full_state(runner)

    runner.register_hook(_Start())
    runner.train()
    seen['end'] = _full_state(runner)
    seen['iter'] = runner.iter
    seen['losses'] = list(runner.message_hub.get_scalar('train/loss').data[0])
    return seen if rank == 0 else None


def _resume(checkpoint, work, max_iters, world_size, **overrides):
    """``checkpoint`` copied into a fresh ``work`` and resumed there."""
    os.makedirs(work)
    name = osp.basename(checkpoint)
    shutil.copytree(checkpoint, osp.join(work, name))
    with open(osp.join(work, 'last_checkpoint'), 'w') as f:
        f.write(osp.join(work, name))
    return run_ranks(
        _run,
        work,
        max_iters,
        True,
        overrides,
        world_size=world_size,
        timeout=300)[0]


@pytest.fixture(scope='module')
def hybrid_saved(tmp_path_factory):
    """Two iterations on 2 emulated nodes x 2 ranks, iter_2.pth saved."""
    root = tmp_path_factory.mktemp('layouts')
    work = str(root / 'hybrid')
    out = run_ranks(
        _run, work, 2, False, _HYBRID_2X2, world_size=4, timeout=300)[0]
    return root, work, out


def _assert_same_state(a, b):
    assert a['model'].keys() == b['model'].keys()
    for key, value in a['model'].items():
        assert torch.equal(value, b['model'][key]), key
    assert a['optim'].keys() == b['optim'].keys()
    for key, state in a['optim'].items():
        for name, value in state.items():
            assert torch.equal(value, b['optim'][key][name]), (key, name)


def test_a_hybrid_checkpoint_records_its_layout_and_converts(
        hybrid_saved, tmp_path):
    _, work, _ = hybrid_saved
    ckpt = osp.join(work, 'iter_2.pth')
    meta = consolidate_sharded_checkpoint(ckpt)['meta']
    assert meta['sharded'] == dict(
        world_size=4,
        format='dcp',
        sharding='hybrid',
        nodes=2,
        ranks_per_node=2)
    dst = str(tmp_path / 'model.pth')
    out = subprocess.run([sys.executable, CONVERT, ckpt, dst],
                         capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert (' numbers, saved by 4 ranks at iteration 2 (hybrid sharding (2 '
            'nodes x 2 ranks))\n') in out.stdout
    converted = torch.load(dst, weights_only=True)['state_dict']
    _, _, saved = hybrid_saved
    for key, value in saved['end']['model'].items():
        assert torch.equal(converted[key], value), key


@pytest.mark.slow
def test_hybrid_to_full_on_2_ranks_and_back(hybrid_saved):
    """Hybrid 2 x 2 resumed under full sharding on 2 ranks (2 nodes of 1
    rank: 'auto' shards fully), and that run's checkpoint resumed under
    hybrid 2 x 2 again: each starts exactly where the checkpoint was, its
    digests verified, its log saying the change."""
    root, work, saved = hybrid_saved
    full_work = str(root / 'full')
    full = _resume(osp.join(work, 'iter_2.pth'), full_work, 3, 2, **_FULL_2)
    _assert_same_state(full['start'], saved['end'])
    assert full['iter'] == 3 and len(full['losses']) == 3
    log = _log_of(full_work)
    assert ("full: sharded over the 2 ranks (sharding='auto': one rank a "
            'node, 2 nodes)') in log
    assert (f'{full_work}/iter_2.pth: 6 files, SHA-256 verified '
            '(SHA256SUMS)') in log
    assert (
        f'Loaded the model and optimizer of {full_work}/iter_2.pth '
        'across layouts: saved under hybrid sharding (2 nodes x 2 '
        'ranks), now full sharding over 2 ranks (DCP resharded it).') in log
    ckpt = osp.join(full_work, 'iter_3.pth')
    assert consolidate_sharded_checkpoint(ckpt)['meta']['sharded'] == dict(
        world_size=2, format='dcp', sharding='full')

    back_work = str(root / 'back')
    back = _resume(ckpt, back_work, 4, 4, **_HYBRID_2X2)
    _assert_same_state(back['start'], full['end'])
    assert back['iter'] == 4
    assert (f'Loaded the model and optimizer of {back_work}/iter_3.pth '
            'across layouts: saved under full sharding over 2 ranks, now '
            'hybrid sharding (2 nodes x 2 ranks) (DCP resharded it).'
            ) in _log_of(back_work)


@pytest.mark.slow
def test_hybrid_on_another_number_of_nodes(hybrid_saved):
    """Hybrid 2 x 2 resumed under hybrid 3 x 2 (6 ranks): it starts
    exactly where the checkpoint was, and says so."""
    root, work, saved = hybrid_saved
    more = str(root / 'three_nodes')
    out = _resume(osp.join(work, 'iter_2.pth'), more, 3, 6, **_HYBRID_2X2)
    _assert_same_state(out['start'], saved['end'])
    assert out['iter'] == 3
    log = _log_of(more)
    assert ('hybrid: sharded over the 2 ranks of each node, replicated over '
            '3 nodes') in log
    assert (f'Loaded the model and optimizer of {more}/iter_2.pth across '
            'layouts: saved under hybrid sharding (2 nodes x 2 ranks), now '
            'hybrid sharding (3 nodes x 2 ranks) (DCP resharded it).') in log
