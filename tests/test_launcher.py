"""tools' start-up on a CPU-only machine: gloo, CPU DDP settings, BN."""
import os
import socket

import torch.distributed as dist
from mmengine.config import Config

from mmcv_custom.launcher import prepare_launch


def _cfg():
    norm = dict(type='SyncBN', requires_grad=True)
    return Config(
        dict(
            model=dict(
                backbone=dict(norm_cfg=norm),
                heads=[dict(norm_cfg=dict(norm)),
                       dict(norm_cfg=dict(type='GN'))])))


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
    os.environ.update(SLURM_PROCID='0', SLURM_NTASKS='1', SLURM_LOCALID='0',
                      MASTER_ADDR='127.0.0.1', MASTER_PORT=port)
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
    import torch.multiprocessing as mp
    import tempfile
    import torch
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
    assert wrapper == dict(type='MMDistributedDataParallel',
                           find_unused_parameters=True, device_ids=None)
