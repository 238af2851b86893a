"""Start training where MMEngine's own start-up cannot: CPUs.

MMEngine's ``init_dist`` calls ``torch.cuda.set_device``, its DDP wrapper
passes ``device_ids=[LOCAL_RANK]``, and SyncBN needs CUDA; all three fail on
a CPU-only machine. The tools call :func:`prepare_launch` before building
the runner: with CUDA it leaves everything to MMEngine (NCCL, unchanged
behaviour); without, it starts a gloo process group itself (the runner skips
``init_dist`` when a group exists; see
:func:`~mmcv_custom.engine.process_group.init_gloo`), makes the DDP wrapper
CPU-friendly and turns SyncBN into BN. It also refuses, before the process
group starts, a ``model_wrapper_cfg`` or a FlexibleRunner strategy that a CPU
run cannot use.
"""
import logging
from typing import Optional

import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.logging import print_log

from ..engine.process_group import init_gloo, is_launch_rank0

__all__ = [
    'check_cpu_wrapper', 'check_cpu_strategy', 'uses_fsdp2', 'prepare_launch'
]

#: MMEngine's DDP wrappers, named in errors. A CPU launch takes any
#: subclass of torch's DistributedDataParallel, as these two are
#: (MMSeparateDistributedDataParallel wraps each trainable submodule in an
#: MMDistributedDataParallel).
_CPU_WRAPPERS = ('MMDistributedDataParallel',
                 'MMSeparateDistributedDataParallel')


def check_cpu_wrapper(cfg: Config) -> None:
    """Raise if ``cfg.model_wrapper_cfg`` is not a DDP a CPU launch can run.

    Without CUDA the tools start gloo and give the wrapper
    ``device_ids=None`` and ``find_unused_parameters``, arguments of
    DistributedDataParallel. FSDP, DataParallel or another wrapper would
    fail later with an unrelated ``TypeError``, after the process group
    started. The type is resolved as the Runner resolves it, through
    MMEngine's ``MODEL_WRAPPERS`` registry.

    Raises:
        KeyError: the type is not registered.
        ValueError: the type is not MMDistributedDataParallel,
            MMSeparateDistributedDataParallel or a subclass of
            ``torch.nn.parallel.DistributedDataParallel``.
    """
    wrapper_cfg = cfg.get('model_wrapper_cfg')
    if not wrapper_cfg:
        return
    wrapper_type = wrapper_cfg.get('type', 'MMDistributedDataParallel')
    if isinstance(wrapper_type, str):
        from mmengine.registry import MODEL_WRAPPERS
        wrapper_cls = MODEL_WRAPPERS.get(wrapper_type)  # as Runner does
        if wrapper_cls is None:
            raise KeyError(
                f'model_wrapper_cfg type {wrapper_type!r} is not in '
                "MMEngine's MODEL_WRAPPERS registry; on CPU use one of "
                f'{", ".join(_CPU_WRAPPERS)}')
        shown = wrapper_type
    else:
        wrapper_cls = wrapper_type
        shown = (f'{wrapper_cls.__module__}.{wrapper_cls.__qualname__}'
                 if isinstance(wrapper_cls, type) else repr(wrapper_cls))
    name = getattr(wrapper_cls, '__name__', repr(wrapper_cls))
    if isinstance(wrapper_cls, type) and issubclass(
            wrapper_cls, torch.nn.parallel.DistributedDataParallel):
        return
    raise ValueError(
        f'model_wrapper_cfg type {shown!r} is not supported without '
        'CUDA: the tools then train on a gloo process group with a CPU '
        'DistributedDataParallel (device_ids=None), so the wrapper must be '
        f'{" or ".join(_CPU_WRAPPERS)} or a subclass of '
        f'torch.nn.parallel.DistributedDataParallel, but {name} is not. '
        'Remove model_wrapper_cfg, or run it on GPUs.')


# FlexibleRunner strategies that run on a CPU process group.
_CPU_STRATEGIES = ('DDPStrategy', 'FSDP2Strategy')


def _strategy_type(cfg: Config) -> Optional[str]:
    """The FlexibleRunner strategy's type name, or None for MMEngine's
    default Runner (which takes ``model_wrapper_cfg`` instead)."""
    if cfg.get('runner_type') != 'FlexibleRunner':
        return None
    strategy = cfg.get('strategy') or {}
    kind = strategy.get('type', 'DDPStrategy')
    return kind if isinstance(kind, str) else kind.__name__


def uses_fsdp2(cfg: Config) -> bool:
    """Whether ``cfg`` trains with FSDP2Strategy (FlexibleRunner), which
    reads and writes sharded checkpoint directories itself."""
    return _strategy_type(cfg) == 'FSDP2Strategy'


def check_cpu_strategy(cfg: Config) -> None:
    """Raise before gloo starts if the FlexibleRunner strategy needs CUDA.

    MMEngine's ``FSDPStrategy`` wraps FSDP1, which refuses CPUs ("FSDP
    needs a non-CPU accelerator device"), and the DeepSpeed and
    ColossalAI strategies need GPUs too; without this check the run fails
    after the process group started, in their words.

    Raises:
        ValueError: The strategy is not one of ``_CPU_STRATEGIES``.
    """
    kind = _strategy_type(cfg)
    if kind is None or kind in _CPU_STRATEGIES:
        return
    hint = (" Use strategy=dict(type='FSDP2Strategy') (PyTorch's FSDP2, "
            'which runs on CPUs) instead.' if 'FSDP' in kind else '')
    raise ValueError(
        f'strategy type {kind!r} needs CUDA, but there is none: on CPUs '
        f'the tools run {" or ".join(_CPU_STRATEGIES)} on a gloo process '
        f'group.{hint}')


def _sync_bn_to_bn(node) -> int:
    """Replace ``type='SyncBN'`` in a config tree in place; count them."""
    count = 0
    if isinstance(node, dict):
        if node.get('type') == 'SyncBN':
            node['type'] = 'BN'
            count += 1
        for value in node.values():
            count += _sync_bn_to_bn(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            count += _sync_bn_to_bn(value)
    return count


def prepare_launch(cfg: Config,
                   launcher: str,
                   cuda: Optional[bool] = None) -> Config:
    """Prepare ``cfg`` and the process group for ``launcher``.

    Args:
        cfg (Config): The training config; changed in place.
        launcher (str): ``'none'``, ``'pytorch'``, ``'slurm'`` or ``'mpi'``.
        cuda (bool, optional): Whether to use GPUs. Defaults to None,
            meaning ``torch.cuda.is_available()``.

    Returns:
        Config: ``cfg``.

    Raises:
        KeyError, ValueError: Without CUDA, a distributed launch with a
            ``model_wrapper_cfg`` that is not a DDP (see
            :func:`check_cpu_wrapper`); raised before the process group
            starts.
    """
    cfg.launcher = launcher
    if _strategy_type(cfg) is not None and cfg.get('model_wrapper_cfg'):
        # FlexibleRunner.from_cfg never reads it: refuse rather than train
        # with something else than the config says.
        raise ValueError(
            'model_wrapper_cfg is not used with runner_type='
            "'FlexibleRunner': the strategy "
            f'({_strategy_type(cfg)}) wraps or shards the model. Remove '
            'model_wrapper_cfg, or set the wrapper through the strategy '
            "(e.g. strategy=dict(type='DDPStrategy', model_wrapper=...)).")
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return cfg
    if launcher != 'none':
        # Before the process group: every rank fails alike, at once.
        check_cpu_wrapper(cfg)
        check_cpu_strategy(cfg)
        if not dist.is_initialized():
            init_gloo(launcher)
    # One line per run, not per rank.
    main_process = is_launch_rank0()
    if _sync_bn_to_bn(cfg.get('model')) and main_process:
        print_log(
            'No CUDA: SyncBN needs GPUs, so the model uses BN instead '
            '(statistics per rank; DDP broadcasts rank 0\'s buffers).',
            logger='current',
            level=logging.WARNING)
    if launcher == 'none':
        return cfg
    env_cfg = dict(cfg.get('env_cfg') or {})
    env_cfg['dist_cfg'] = dict(env_cfg.get('dist_cfg') or {}, backend='gloo')
    cfg.env_cfg = env_cfg
    strategy = _strategy_type(cfg)
    if strategy is not None:
        # FlexibleRunner: the strategy wraps the model, no model wrapper.
        if main_process:
            print_log(
                f'No CUDA: started a gloo process group of '
                f'{dist.get_world_size()} ranks on CPU ({strategy}).',
                logger='current')
        return cfg
    wrapper_cfg = cfg.get('model_wrapper_cfg') or dict(
        type='MMDistributedDataParallel')
    wrapper_cfg.setdefault('find_unused_parameters',
                           cfg.get('find_unused_parameters', False))
    # CPU modules take no device_ids. Without SyncBN, keep DDP's default
    # broadcast_buffers=True so every rank uses rank 0's BN statistics, as
    # the saved checkpoint will.
    wrapper_cfg['device_ids'] = None
    cfg.model_wrapper_cfg = wrapper_cfg
    if main_process:
        print_log(
            f'No CUDA: started a gloo process group of '
            f'{dist.get_world_size()} ranks on CPU (DDP without device_ids).',
            logger='current')
    return cfg
