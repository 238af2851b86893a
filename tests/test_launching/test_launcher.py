"""tools' start-up on a CPU-only machine: gloo, CPU DDP settings, BN."""
import os
import socket
import weakref

import pytest
import torch.distributed as dist
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, MODEL_WRAPPERS
from torch.nn.parallel import DataParallel, DistributedDataParallel

from mmcv_custom.launching.cpu_start import prepare_launch
from mmcv_custom.launching.running import run_runner
from mmcv_custom.testing import run_ranks


def _cfg():
    norm = dict(type='SyncBN', requires_grad=True)
    return Config(
        dict(
            model=dict(
                backbone=dict(norm_cfg=norm),
                heads=[
                    dict(norm_cfg=dict(norm)),
                    dict(norm_cfg=dict(type='GN'))
                ])))


def test_cpu_launch_none_keeps_single_process_and_uses_bn():
    cfg = prepare_launch(_cfg(), 'none', cuda=False)
    assert cfg.launcher == 'none'
    assert cfg.model.backbone.norm_cfg.type == 'BN'
    assert [h.norm_cfg.type for h in cfg.model.heads] == ['BN', 'GN']
    assert 'model_wrapper_cfg' not in cfg


def test_gpu_launch_is_left_to_mmengine():
    cfg = prepare_launch(_cfg(), 'pytorch', cuda=True)
    assert cfg.model.backbone.norm_cfg.type == 'SyncBN'
    assert 'model_wrapper_cfg' not in cfg


def _slurm(rank, world_size, port):
    # A process launched by srun: only SLURM_* and MASTER_ADDR are set.
    os.environ.update(
        SLURM_PROCID='0',
        SLURM_NTASKS='1',
        SLURM_LOCALID='0',
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=port)
    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        os.environ.pop(key, None)
    cfg = Config(dict(model=dict(), find_unused_parameters=True))
    prepare_launch(cfg, 'slurm', cuda=False)
    result = (dist.get_backend(), dist.get_world_size(), os.environ['RANK'],
              cfg.model_wrapper_cfg.to_dict(), cfg.env_cfg.dist_cfg.backend)
    dist.destroy_process_group()
    return result


def _outside_process_group(fn, *args):
    """Run ``fn`` in a forked process that has no process group yet."""
    import tempfile

    import torch
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _save, args=(fn, args, d), nprocs=1, start_method='fork')
        return torch.load(os.path.join(d, 'out.pt'), weights_only=False)


def _save(rank, fn, args, folder):
    import torch
    torch.save(fn(rank, 1, *args), os.path.join(folder, 'out.pt'))


def test_slurm_launch_on_cpu_starts_gloo_from_slurm_variables():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = str(s.getsockname()[1])
    backend, size, rank, wrapper, dist_backend = _outside_process_group(
        _slurm, port)
    assert (backend, size, rank, dist_backend) == ('gloo', 1, '0', 'gloo')
    assert wrapper == dict(
        type='MMDistributedDataParallel',
        find_unused_parameters=True,
        device_ids=None)


# ---------------------------------------------------------------------------
# Model wrappers on CPU: DDP and its subclasses only, refused by name before
# the process group starts.


class _MyDDP(DistributedDataParallel):
    """A user's DDP subclass, registered under its own name."""


MODEL_WRAPPERS.register_module(module=_MyDDP, force=True)

_NOT_DDP = ('is not supported without CUDA: the tools then train on a gloo '
            'process group with a CPU DistributedDataParallel '
            '(device_ids=None), so the wrapper must be '
            'MMDistributedDataParallel or MMSeparateDistributedDataParallel '
            'or a subclass of torch.nn.parallel.DistributedDataParallel, '
            'but {} is not.')


def _wrapped(wrapper_type):
    return Config(
        dict(model=dict(), model_wrapper_cfg=dict(type=wrapper_type)))


@pytest.mark.parametrize('wrapper_type,shown', [
    ('MMFullyShardedDataParallel', 'MMFullyShardedDataParallel'),
    ('DataParallel', 'DataParallel'),
    (DataParallel, 'torch.nn.parallel.data_parallel.DataParallel'),
])
def test_cpu_launch_refuses_a_wrapper_that_is_not_ddp(wrapper_type, shown):
    cfg = _wrapped(wrapper_type)
    with pytest.raises(ValueError) as info:
        prepare_launch(cfg, 'pytorch', cuda=False)
    name = shown.split('.')[-1]
    assert str(info.value) == (f'model_wrapper_cfg type {shown!r} ' +
                               _NOT_DDP.format(name) +
                               ' Remove model_wrapper_cfg, or run it on GPUs.')
    # Refused before the process group (the environment has no RANK or
    # MASTER_ADDR: starting one would have failed differently).
    assert not dist.is_initialized()
    assert 'device_ids' not in cfg.model_wrapper_cfg


def test_cpu_launch_refuses_an_unregistered_wrapper():
    with pytest.raises(
            KeyError,
            match=(
                "model_wrapper_cfg type 'NoSuchWrapper' is not in MMEngine's "
                'MODEL_WRAPPERS registry; on CPU use one of '
                'MMDistributedDataParallel, MMSeparateDistributedDataParallel'
            )):
        prepare_launch(_wrapped('NoSuchWrapper'), 'pytorch', cuda=False)
    assert not dist.is_initialized()


def test_wrappers_are_checked_only_where_the_tools_wrap_on_cpu():
    # One process: no wrapper at all. GPUs: MMEngine's own business.
    for launcher, cuda in (('none', False), ('pytorch', True)):
        cfg = prepare_launch(
            _wrapped('MMFullyShardedDataParallel'), launcher, cuda=cuda)
        assert cfg.model_wrapper_cfg == dict(type='MMFullyShardedDataParallel')


def _launch_with_wrappers(rank, world_size):
    """prepare_launch on a running 2-rank group with each kind of wrapper;
    the accepted ones are built around a real module, as the Runner will."""
    from mmcv_custom.demo import MLPRegressor
    out = {}
    for key, wrapper_type in (('MMDistributedDataParallel',
                               'MMDistributedDataParallel'),
                              ('MMSeparateDistributedDataParallel',
                               'MMSeparateDistributedDataParallel'),
                              ('_MyDDP', '_MyDDP'), ('class _MyDDP', _MyDDP),
                              ('MMFullyShardedDataParallel',
                               'MMFullyShardedDataParallel')):
        cfg = Config(
            dict(
                model=dict(),
                find_unused_parameters=True,
                model_wrapper_cfg=dict(type=wrapper_type)))
        try:
            prepare_launch(cfg, 'pytorch', cuda=False)
        except ValueError as e:
            out[key] = str(e)
            continue
        model = MLPRegressor(in_features=2, hidden=4, depth=1)
        wrapped = MODEL_WRAPPERS.build(
            dict(cfg.model_wrapper_cfg, module=model))
        settings = dict(cfg.model_wrapper_cfg)
        settings['type'] = getattr(settings['type'], '__name__',
                                   settings['type'])
        out[key] = (settings, type(wrapped).__name__)
    return out


def test_cpu_launch_takes_every_ddp_wrapper_on_two_ranks():
    for out in run_ranks(_launch_with_wrappers, world_size=2):
        for key in ('MMDistributedDataParallel',
                    'MMSeparateDistributedDataParallel', '_MyDDP',
                    'class _MyDDP'):
            name = key.split()[-1]
            assert out[key] == (dict(
                type=name, find_unused_parameters=True, device_ids=None), name)
        assert out['MMFullyShardedDataParallel'].startswith(
            "model_wrapper_cfg type 'MMFullyShardedDataParallel' is not "
            'supported without CUDA')


# Two ranks train a step with DDP; rank 0 then shuts down in the order the
# tools use (DDP model dropped, then shutdown_distributed) or the other
# way round. Rank 0 leaves a collective in flight whose tensor a gloo
# thread frees once rank 1 joins it, slowly (its __del__ sleeps without
# the GIL): the window in which the real hang was seen, made wide.
_SHUTDOWN_SCRIPT = """
import sys, threading, time
import torch, torch.distributed as dist
from torch import nn
from mmcv_custom.launching.running import shutdown_distributed

store, rank, order = sys.argv[1], int(sys.argv[2]), sys.argv[3]
freeing = threading.Event()

class Slow:
    def __del__(self):
        freeing.set()
        time.sleep(1)

def send():
    left = torch.zeros(4)
    left.slow = Slow()
    dist.all_reduce(left, async_op=True)

dist.init_process_group(
    'gloo', store=dist.FileStore(store, 2), rank=rank, world_size=2)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
model(torch.ones(2, 4)).sum().backward()
if rank == 0:
    send()
    assert freeing.wait(60)
else:
    time.sleep(1)
    dist.all_reduce(torch.zeros(4))
    order = 'tools'
print('shutting down', flush=True)
if order == 'tools':
    del model
    shutdown_distributed()
else:
    dist.destroy_process_group()
    del model
print('shut down', flush=True)
"""


@pytest.mark.parametrize('order, finishes', [('tools', True),
                                             ('reducer last', False)])
def test_shutdown_after_the_ddp_model_never_hangs(tmp_path, order, finishes):
    """The tools' order finishes. The control shows the hang it avoids:
    a reducer that holds the last reference to the group destroys it
    with the GIL held, while a gloo thread waits for the GIL to free
    what a collective left (see shutdown_distributed)."""
    import subprocess
    import sys
    import time
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ranks = [
        subprocess.Popen([
            sys.executable, '-c', _SHUTDOWN_SCRIPT,
            str(tmp_path / 'store'),
            str(rank), order
        ],
                         cwd=root,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT,
                         text=True) for rank in (0, 1)
    ]
    try:
        lines = []
        for line in ranks[0].stdout:  # until rank 0 begins to shut down
            lines.append(line)
            if line.startswith('shutting down'):
                break
        assert lines and lines[-1].startswith('shutting down'), lines
        # The sleep in __del__ is 1 s; done or stuck for good after 4 s.
        deadline = time.monotonic() + (60 if finishes else 4)
        while ranks[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (ranks[0].poll() == 0) is finishes
        if finishes:
            assert ranks[0].stdout.read() == 'shut down\n'
            assert ranks[1].wait(60) == 0
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()


# Per rank (a forked process): the DDP model of the run that failed.
_MODELS: list = []


@HOOKS.register_module(force=True)
class _FailsInTraining(Hook):
    """Remembers the model (weakly) and fails after the first step."""

    def before_train(self, runner):
        _MODELS.append(weakref.ref(runner.model))

    def after_train_iter(self, runner, *args, **kwargs):
        raise RuntimeError('planted failure')


def _fail_in_training(rank, world_size, work_dir):
    import mmcv_custom.demo  # noqa: F401  (registers MLPRegressor & co.)
    cfg = Config(
        dict(
            model=dict(type='MLPRegressor', hidden=8, depth=1),
            work_dir=work_dir,
            train_dataloader=dict(
                dataset=dict(
                    type='SyntheticRegressionDataset', num_samples=16),
                sampler=dict(type='InfiniteSampler'),
                batch_size=4,
                num_workers=0),
            optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
            train_cfg=dict(by_epoch=False, max_iters=3),
            launcher='pytorch',
            env_cfg=dict(dist_cfg=dict(backend='gloo')),
            model_wrapper_cfg=dict(
                type='MMDistributedDataParallel', device_ids=None),
            custom_hooks=[dict(type='_FailsInTraining')]))
    try:
        run_runner(cfg, 'train')
    except RuntimeError as e:
        return (str(e), type(_MODELS[-1]()).__name__, dist.is_initialized())


def test_a_failed_run_frees_its_model_before_the_group(tmp_path):
    """The error still propagates, with its traceback, yet the frames it
    passed no longer hold the runner: the DDP model is gone by the time
    the group is destroyed, as on success (see shutdown_distributed)."""
    assert run_ranks(
        _fail_in_training,
        str(tmp_path)) == [('planted failure', 'NoneType', False)] * 2
