"""Shard a model with PyTorch's FSDP2 under MMEngine's ``FlexibleRunner``.

MMEngine 0.10's ``FSDPStrategy`` wraps FSDP1, which refuses CPUs and keeps
flat parameters; PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``)
shards each parameter as a ``DTensor`` and runs on gloo/CPU and NCCL/CUDA
alike. This strategy only decides *what* to shard and how checkpoints are
written; the sharding engine is PyTorch's. A config uses it with::

    runner_type = 'FlexibleRunner'
    strategy = dict(type='FSDP2Strategy')
    comm_hook = dict(type='bf16_compress')  # the reduce-scatter's format

How gradients are reduced is the ``comm_hook`` key's business, read by
:class:`~mmcv_custom.engine.CommHookRegistrationHook` as for DDP (see
:mod:`mmcv_custom.hooks.sharded`); the strategy refuses a ``reduce_dtype`` of
its own so that there is one place to say it.

Checkpoints are directories (MMEngine's CheckpointHook already handles
those, as it does DeepSpeed's): ``iter_N.pth/`` holds every rank's model
and optimizer shards in ``torch.distributed.checkpoint`` (DCP) format,
rank 0's ``meta.pth`` (meta, message hub, schedulers) and ``SHA256SUMS``.
A save goes to a temporary directory that rank 0 names and is renamed once
every rank has finished and the manifest is written, so a directory of the
final name is always complete and vouched for. Loading checks the
manifest first and reads non-tensor entries with torch's safe loader
(DCP's own unpickles them with ``weights_only=False``). User guide:
``docs/en/user_guides/fsdp2.md``.

This module holds the strategy; what it shards (units, ``mp_policy``) is
in :mod:`~mmcv_custom.engine.fsdp2_units`, over which ranks (full or
hybrid sharding) in :mod:`~mmcv_custom.engine.fsdp2_mesh`, and its
checkpoints' save and load in :mod:`~mmcv_custom.engine.fsdp2_checkpoint`.
"""
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from mmengine._strategy import DDPStrategy
from mmengine.dist import is_distributed
from mmengine.registry import STRATEGIES
from torch import nn

from ..hooks.hybrid import CrossNodeAllReduce, install_cross_node, mark_hybrid
from .fsdp2_args import check_strategy_args
from .fsdp2_checkpoint import ShardedCheckpointMixin
from .fsdp2_mesh import fit_on_node, hybrid_mesh, plan_sharding
from .fsdp2_units import (broadcast_rank0_buffers, parse_mp_policy,
                          select_units, unit_parameters)
from .process_group import init_gloo

__all__ = ['FSDP2Strategy', 'select_units', 'unit_parameters']

# Entry points besides forward() that gather a unit's parameters (the
# methods of MMSegmentation's decode heads the segmentor calls).
_FORWARD_METHODS = ('loss', 'predict')


@STRATEGIES.register_module()
class FSDP2Strategy(ShardedCheckpointMixin, DDPStrategy):
    """Fully sharded data parallel training with PyTorch's FSDP2.

    Each module whose class is named in ``shard_modules`` becomes an FSDP2
    unit (its parameters are gathered for its forward and backward only),
    then the whole model does, for what is left (the heads, unless they
    are units of their own: their ``loss()`` and ``predict()``, which
    MMSegmentation's segmentors call, gather them too). A unit's own
    parameters must share one dtype (FSDP2 reduce-scatters each unit's
    gradients as one buffer); the strategy checks this before sharding and
    names the unit. InternViT's ``with_cp`` activation checkpointing
    recomputes a block inside its unit and composes with this.

    Not distributed (``launcher='none'``), nothing is sharded and the model
    runs as with MMEngine's single-device strategy; the checkpoints it
    writes and reads are the same sharded directories.

    Args:
        shard_modules (Sequence[str | type], optional): Module classes (or
            their names) that become units, e.g. ``['InternViTBlock',
            'InternViT']``. Defaults to None: InternViT's blocks and the
            InternViT backbone when the model has them, else only the whole
            model. A name that matches no module of the model is an error.
        reshard_after_forward (bool): Free the gathered parameters after
            each unit's forward (gathered again for backward): less memory,
            one more all-gather per unit. Not for the root (the whole
            model), whose backward follows its forward at once. Defaults to
            True.
        mp_policy (dict, optional): FSDP2's ``MixedPrecisionPolicy``:
            ``param_dtype`` and ``output_dtype`` (``'float32'``,
            ``'bfloat16'``, ``'float16'`` or None) and
            ``cast_forward_inputs``. ``reduce_dtype`` is the ``comm_hook``
            key's (an error here). Defaults to None: compute in the
            parameters' own dtype.
        broadcast_buffers (bool): Before each forward and each save, copy
            rank 0's buffers (BatchNorm statistics) to every rank, as DDP
            does before its forwards: FSDP2 shards parameters only, so with
            per-rank BN (CPUs, where SyncBN is unavailable) the ranks'
            statistics would drift apart, and validation would not use
            what the checkpoint keeps. Defaults to True.
        sharding (str): ``'full'``: every parameter sharded over every
            rank. ``'hybrid'``: sharded over the ranks of each node and
            replicated across nodes (HSDP): the all-gathers and the
            reduce-scatter stay on the node's fast link and only the
            gradient shards cross nodes, in one all-reduce whose format
            ``comm_hook`` picks (exact without one). ``'auto'``: hybrid on
            several nodes of several ranks where the node's shard fits the
            GPU (:func:`~.fsdp2_mesh.fit_on_node`), else full. The nodes
            are the launcher's (torchrun, Slurm, Open MPI) or
            ``ranks_per_node``'s; the log line says which sharding runs and
            why. Defaults to 'full'.
        ranks_per_node (int, optional): The ranks each node runs, for
            ``'hybrid'`` and ``'auto'`` where the launcher does not say
            (consecutive ranks share a node); checked against the
            launcher where it does. Defaults to None.
        **kwargs: Of MMEngine's ``DDPStrategy`` (``sync_bn``...).
    """

    def __init__(self,
                 *,
                 shard_modules: Optional[Sequence[Union[str, type]]] = None,
                 reshard_after_forward: bool = True,
                 mp_policy: Optional[dict] = None,
                 broadcast_buffers: bool = True,
                 sharding: str = 'full',
                 ranks_per_node: Optional[int] = None,
                 **kwargs) -> None:
        # Every argument, before MMEngine's constructor makes the work dir
        # (the preflight runs the same checks before any rank starts).
        check_strategy_args(
            dict(
                kwargs,
                shard_modules=shard_modules,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy,
                broadcast_buffers=broadcast_buffers,
                sharding=sharding,
                ranks_per_node=ranks_per_node))
        super().__init__(**kwargs)
        if shard_modules is not None:
            shard_modules = tuple(shard_modules)
        self.sharding = sharding
        self.ranks_per_node = ranks_per_node
        self.broadcast_buffers = broadcast_buffers
        self.shard_modules = shard_modules
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = parse_mp_policy(mp_policy)

    def prepare(self, model, *, optim_wrapper=None, **kwargs):
        # What the optimizer keeps per parameter decides whether a node's
        # shard fits (sharding='auto'); the model is wrapped before the
        # optimizer is built.
        self._optim_cfg = optim_wrapper
        return super().prepare(model, optim_wrapper=optim_wrapper, **kwargs)

    # -- process group -----------------------------------------------------
    def _setup_distributed(self,
                           launcher: str = 'pytorch',
                           backend: str = 'nccl',
                           **kwargs) -> None:
        if is_distributed():
            return
        if not torch.cuda.is_available():
            init_gloo(launcher)
            return
        super()._setup_distributed(launcher, backend, **kwargs)

    def convert_model(self, model: nn.Module) -> nn.Module:
        if not self.distributed:
            from mmengine.model import revert_sync_batchnorm
            return revert_sync_batchnorm(model)
        return super().convert_model(model)

    # -- sharding ------------------------------------------------------------
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        from mmengine.device import get_device
        from torch.distributed.fsdp import (FSDPModule, fully_shard,
                                            register_fsdp_forward_method)

        if isinstance(model, FSDPModule):
            return model
        model = self.convert_model(model.to(get_device()))
        if not self.distributed:
            self.logger.info(
                'FSDP2Strategy: not distributed, so nothing is sharded.')
            return model
        units = self._select_units(model)
        self._check_unit_dtypes(model, units)
        counts = {}
        for _, module in units:
            name = type(module).__name__
            counts[name] = counts.get(name, 0) + 1
        root = type(model).__name__
        plan = plan_sharding(self.sharding, self.ranks_per_node)
        if plan.hybrid and self.sharding == 'auto':
            device = torch.device(get_device())
            plan = fit_on_node(
                plan, model,
                torch.cuda.get_device_properties(device).total_memory
                if device.type == 'cuda' else None, self.world_size,
                getattr(self, '_optim_cfg', None), device.type)
        # None: FSDP2's default, a 1-D mesh over every rank.
        mesh, cross = (
            hybrid_mesh(plan, get_device()) if plan.hybrid else (None, None))
        for _, module in units:
            fully_shard(
                module,
                mesh=mesh,
                mp_policy=self.mp_policy,
                reshard_after_forward=self.reshard_after_forward)
            # MMSegmentation's segmentor calls its heads' loss() and
            # predict(), which call self.forward() directly: FSDP2's hooks
            # on __call__ would not gather the head's parameters.
            for method in _FORWARD_METHODS:
                if callable(getattr(type(module), method, None)):
                    register_fsdp_forward_method(module, method)
        # The root's forward spans the whole model and its backward starts
        # at once: resharding it after forward would only gather the heads
        # a second time.
        fully_shard(
            model,
            mesh=mesh,
            mp_policy=self.mp_policy,
            reshard_after_forward=False)
        if cross is not None:
            # Exact until a comm_hook says otherwise: without it every node
            # would train on its own gradients.
            mark_hybrid(model, cross)
            install_cross_node(model, CrossNodeAllReduce(cross))
        if self.broadcast_buffers and any(True for _ in model.buffers()):
            model.register_forward_pre_hook(broadcast_rank0_buffers)
        shown = ''.join(f'{n} {k}, ' for k, n in counts.items())
        self.logger.info(
            f'FSDP2Strategy: sharded {shown}and the whole {root} over '
            f'{self.world_size} ranks ({dist.get_backend()}); '
            f'{plan.describe}; '
            f'reshard_after_forward={self.reshard_after_forward}, '
            'param_dtype='
            f'{self.mp_policy.param_dtype or "as the parameters"}.')
        return model

    def _select_units(self, model: nn.Module) -> list:
        return select_units(model, self.shard_modules)

    @staticmethod
    def _check_unit_dtypes(model: nn.Module, units: list) -> None:
        """Each unit's own parameters (not in a unit below it) must share a
        dtype: FSDP2 reduce-scatters them as one buffer."""
        for name, _, own in unit_parameters(model, units):
            dtypes = {}
            for pname, param in own:
                dtypes.setdefault(param.dtype, pname)
            if len(dtypes) > 1:
                shown = ', '.join(f'{p} ({str(d).replace("torch.", "")})'
                                  for d, p in dtypes.items())
                raise ValueError(
                    f'FSDP2Strategy: unit {name or "(the whole model)"} '
                    f'holds parameters of several dtypes, e.g. {shown}; '
                    'FSDP2 reduces a unit\'s gradients as one buffer of one '
                    'dtype. Add the module class that holds the other '
                    'dtype to shard_modules (e.g. the bf16 backbone).')
