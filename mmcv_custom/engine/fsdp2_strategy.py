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
"""
import hashlib
import io
import os
import os.path as osp
import re
import shutil
import time
from typing import Callable, Dict, Optional, Sequence, Union

import mmengine
import torch
import torch.distributed as dist
from mmengine._strategy import DDPStrategy
from mmengine.dist import is_distributed
from mmengine.registry import STRATEGIES
from torch import nn

from ..integrity import (CheckpointDamagedError, atomic_write_bytes,
                         digest_path, file_sha256, remove_stale_temporaries,
                         temporary_name)
from ..integrity.checkpoint import (SHARDED_META_FILE, is_sharded_checkpoint,
                                    load_checkpoint_file)
from ..integrity.sharded_checkpoint import (MANIFEST_FILE, damaged_message,
                                            safe_dcp_load,
                                            verify_sharded_checkpoint,
                                            write_manifest)
from .process_group import init_gloo

__all__ = ['FSDP2Strategy', 'select_units', 'unit_parameters']

_DTYPES = {
    'float32': torch.float32,
    'bfloat16': torch.bfloat16,
    'float16': torch.float16
}
_DEFAULT_SHARD_MODULES = ('InternViTBlock', 'InternViT')
# Entry points besides forward() that gather a unit's parameters (the
# methods of MMSegmentation's decode heads the segmentor calls).
_FORWARD_METHODS = ('loss', 'predict')


def _parse_mp_policy(mp_policy: Optional[dict]):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if not isinstance(mp_policy, dict):
        raise TypeError('FSDP2Strategy mp_policy should be a dict such as '
                        "dict(param_dtype='bfloat16'), but got "
                        f'{type(mp_policy).__name__}: {mp_policy!r}')
    mp_policy = dict(mp_policy)
    if 'reduce_dtype' in mp_policy:
        raise ValueError(
            'FSDP2Strategy mp_policy: reduce_dtype is set by the comm_hook '
            "key, the one place that chooses how gradients are reduced: "
            "e.g. comm_hook = dict(type='bf16_compress') sends bf16, "
            "dict(type='allreduce') the gradients' own dtype. Remove "
            f"reduce_dtype={mp_policy['reduce_dtype']!r}.")
    known = ('param_dtype', 'output_dtype', 'cast_forward_inputs')
    unknown = sorted(set(mp_policy) - set(known))
    if unknown:
        raise TypeError(f'FSDP2Strategy mp_policy got unknown keys '
                        f'{unknown}; valid keys: {list(known)}')
    kwargs = {}
    for key in ('param_dtype', 'output_dtype'):
        value = mp_policy.get(key)
        if value is None:
            continue
        if value not in _DTYPES:
            raise ValueError(f'FSDP2Strategy mp_policy {key} should be one '
                             f'of {sorted(_DTYPES)} or None, but got '
                             f'{value!r}')
        kwargs[key] = _DTYPES[value]
    if 'cast_forward_inputs' in mp_policy:
        value = mp_policy['cast_forward_inputs']
        if not isinstance(value, bool):
            raise TypeError('FSDP2Strategy mp_policy cast_forward_inputs '
                            f'should be True or False, but got {value!r}')
        kwargs['cast_forward_inputs'] = value
    return MixedPrecisionPolicy(**kwargs)


def select_units(
        model: nn.Module,
        shard_modules: Optional[Sequence[Union[str, type]]] = None) -> list:
    """The modules :class:`FSDP2Strategy` shards as units of their own.

    Every module of ``model`` (not the model itself) whose class is in
    ``shard_modules``, by class or class name; None means InternViT's
    blocks and the InternViT backbone where the model has them. Shared
    with ``tools/analysis_tools/model_stats.py``, which counts what each
    unit gathers.

    Returns:
        list[tuple[str, nn.Module]]: ``(name, module)``, children before
        their parents (the order to shard them in).

    Raises:
        ValueError: An entry of an explicit ``shard_modules`` matches no
            module; the message lists the model's module classes.
    """
    explicit = shard_modules is not None
    wanted = tuple(shard_modules) if explicit else _DEFAULT_SHARD_MODULES

    def matches(module, spec):
        if isinstance(spec, type):
            return isinstance(module, spec)
        return type(module).__name__ == spec

    found = {spec: 0 for spec in wanted}
    units = []
    for name, module in model.named_modules():
        if module is model:
            continue
        for spec in wanted:
            if matches(module, spec):
                found[spec] += 1
                units.append((name, module))
                break
    missing = [
        s if isinstance(s, str) else s.__name__ for s, n in found.items()
        if n == 0
    ]
    if explicit and missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f'FSDP2Strategy shard_modules {missing} match no module of '
            f'the model; its module classes are: {", ".join(present)}')
    # named_modules() is parents first: shard the deepest first.
    return units[::-1]


def unit_parameters(model: nn.Module, units: list) -> list:
    """What each unit of ``units`` (:func:`select_units`' order) and then
    the root gathers and reduces: its parameters not in a unit below it.

    Returns:
        list[tuple[str, nn.Module, list]]: ``(name, module, [(parameter
        name within the module, parameter), ...])``, the root last with
        name ``''``.
    """
    claimed = set()
    out = []
    for name, module in units + [('', model)]:
        own = [(n, p) for n, p in module.named_parameters()
               if id(p) not in claimed]
        claimed.update(id(p) for _, p in own)
        out.append((name, module, own))
    return out


def _broadcast_buffers(module: nn.Module, *args) -> None:
    """Give every rank rank 0's buffers: one broadcast per dtype. A forward
    pre-hook of the root, and run before each save."""
    by_dtype = {}
    for buffer in module.buffers():
        if buffer.numel():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.broadcast(flat, src=0)
        for buffer, value in zip(buffers,
                                 flat.split([b.numel() for b in buffers])):
            buffer.copy_(value.view_as(buffer))


def _hash_own_shards(folder: str, rank: int) -> Dict[str, str]:
    """The SHA-256 of the DCP files rank ``rank`` wrote into ``folder``.

    DCP's ``FileSystemWriter`` names each rank's files ``__<rank>_<i>``
    ``.distcp``. Each rank reads back its own files: the ranks (and, across
    machines, their disks) share the reading, so a save costs the time of
    one rank's shards, not of all of them on rank 0. Rank 0 hashes what
    no rank claimed (``.metadata``, and every file should DCP ever name
    them otherwise), so the manifest is complete either way.
    """
    prefix = f'__{rank}_'
    return {
        name: file_sha256(osp.join(folder, name))
        for name in sorted(os.listdir(folder))
        if name.startswith(prefix) and name.endswith('.distcp')
    }


@STRATEGIES.register_module()
class FSDP2Strategy(DDPStrategy):
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
        **kwargs: Of MMEngine's ``DDPStrategy`` (``sync_bn``...).
    """

    def __init__(self,
                 *,
                 shard_modules: Optional[Sequence[Union[str, type]]] = None,
                 reshard_after_forward: bool = True,
                 mp_policy: Optional[dict] = None,
                 broadcast_buffers: bool = True,
                 **kwargs) -> None:
        if 'model_wrapper' in kwargs:
            raise TypeError(
                'FSDP2Strategy takes no model_wrapper: fully_shard changes '
                'the model in place instead of wrapping it.')
        super().__init__(**kwargs)
        if shard_modules is not None:
            if isinstance(shard_modules, (str, type)) or not all(
                    isinstance(m, (str, type)) for m in shard_modules):
                raise TypeError(
                    'FSDP2Strategy shard_modules should be a list of module '
                    "classes or class names, e.g. ['InternViTBlock'], but "
                    f'got {shard_modules!r}')
            shard_modules = tuple(shard_modules)
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                'FSDP2Strategy reshard_after_forward should be True or '
                f'False, but got {reshard_after_forward!r}')
        if not isinstance(broadcast_buffers, bool):
            raise TypeError('FSDP2Strategy broadcast_buffers should be True '
                            f'or False, but got {broadcast_buffers!r}')
        self.broadcast_buffers = broadcast_buffers
        self.shard_modules = shard_modules
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = _parse_mp_policy(mp_policy)

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
        for _, module in units:
            fully_shard(
                module,
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
            model, mp_policy=self.mp_policy, reshard_after_forward=False)
        if self.broadcast_buffers and any(True for _ in model.buffers()):
            model.register_forward_pre_hook(_broadcast_buffers)
        shown = ''.join(f'{n} {k}, ' for k, n in counts.items())
        self.logger.info(
            f'FSDP2Strategy: sharded {shown}and the whole {root} over '
            f'{self.world_size} ranks ({dist.get_backend()}); '
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

    # -- checkpoints ---------------------------------------------------------
    def _optimizers(self) -> list:
        wrapper = getattr(self, 'optim_wrapper', None)
        if wrapper is None:
            return []
        if hasattr(wrapper, 'optim_wrappers'):  # OptimWrapperDict
            return [w.optimizer for w in wrapper.optim_wrappers.values()]
        return [wrapper.optimizer]

    def _wrapper_extras(self) -> dict:
        """What an optim wrapper saves besides its optimizer (AMP's loss
        scaler)."""
        wrapper = getattr(self, 'optim_wrapper', None)
        if wrapper is None or hasattr(wrapper, 'optim_wrappers'):
            return {}
        state = wrapper.state_dict()
        return {
            k: v
            for k, v in state.items() if k not in ('state', 'param_groups')
        }

    def save_checkpoint(self,
                        filename: str,
                        *,
                        save_optimizer: bool = True,
                        save_param_scheduler: bool = True,
                        extra_ckpt: Optional[dict] = None,
                        callback: Optional[Callable] = None) -> None:
        """Write the sharded checkpoint directory ``filename`` (all ranks).

        Model and optimizer shards go through DCP from every rank; the rest
        (``meta``, ``message_hub``, ``param_schedulers`` and what hooks add
        in ``before_save_checkpoint``) into ``meta.pth`` from rank 0; then
        ``SHA256SUMS`` (each rank hashes its own shards, see
        :func:`_hash_own_shards`). Written under a temporary name that
        rank 0 chooses (:func:`~mmcv_custom.integrity.temporary_name`: no
        leftover of any earlier save, file or directory, can be in its
        way) and renamed at the end; a failed save removes it. What a
        killed save left of ``filename`` is removed first
        (:func:`~mmcv_custom.integrity.remove_stale_temporaries`).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.broadcast_buffers and self.distributed:
            _broadcast_buffers(self.model)
        optimizers = self._optimizers() if save_optimizer else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        state = {'model': model_sd}
        if optimizers:
            state['optimizer'] = optim_sd

        extra = dict(extra_ckpt or {})
        extra['meta'] = dict(extra.get('meta') or {})
        extra['meta'].update(
            seed=self.seed,
            time=time.strftime('%Y%m%d_%H%M%S', time.localtime()),
            mmengine=mmengine.__version__,
            sharded=dict(world_size=self.world_size, format='dcp'))
        if save_optimizer:
            extra['optim_wrapper_extras'] = self._wrapper_extras()
        if save_param_scheduler and hasattr(self, 'param_schedulers'):
            extra['param_schedulers'] = self.scheduler_state_dict()
        if callback is not None:
            callback(extra)

        main = self.rank == 0
        if main:
            for path in remove_stale_temporaries(filename):
                self.logger.info(f'Removed {path}, left by a save that did '
                                 'not finish (its process is gone).')
        tmp = self._from_rank0(temporary_name(filename) if main else None)
        dcp.save(state, checkpoint_id=tmp)
        error, digests = None, {}
        try:
            digests = _hash_own_shards(tmp, self.rank)
        except OSError as e:
            error = e
        everyone = self._gather((digests, error is not None))
        if main:
            try:
                self._finish_save(filename, tmp, extra, everyone)
            except Exception as e:  # every rank must hear of it
                error = e
        # All ranks stop together, not rank 0 alone with the others
        # training on into a collective it will never join.
        failed = self._any_rank(error is not None)
        if failed and main:
            # Every rank is past its writing: the directory is ours alone.
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f'Saving {filename} failed on rank 0 (see its log); nothing '
                'of that name was written (the temporary directory '
                f'{osp.basename(tmp)} was removed).')

    def _finish_save(self, filename: str, tmp: str, extra: dict,
                     everyone: list) -> None:
        """Rank 0, once every rank's shards are on disk: ``meta.pth``, the
        manifest, then the rename of ``tmp`` to ``filename``."""
        ranks = [r for r, (_, failed) in enumerate(everyone) if failed]
        if ranks:
            raise RuntimeError(
                f'Saving {filename}: rank(s) {ranks} could not read back '
                f'the shards they wrote into {tmp} (see their logs)')
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        with buffer.getbuffer() as data:
            atomic_write_bytes(
                osp.join(tmp, SHARDED_META_FILE), data, digest=False)
            digests = {SHARDED_META_FILE: hashlib.sha256(data).hexdigest()}
        for own, _ in everyone:
            digests.update(own)
        for name in sorted(os.listdir(tmp)):
            if name not in digests and name != MANIFEST_FILE:
                digests[name] = file_sha256(osp.join(tmp, name))
        write_manifest(tmp, digests)
        old = None
        if osp.lexists(filename):
            # Moved aside, not removed, until the new one is in place.
            old = temporary_name(filename)
            os.replace(filename, old)
        try:
            # A digest of a file that was here would vouch for nothing.
            os.remove(digest_path(filename))
        except FileNotFoundError:
            pass
        try:
            os.replace(tmp, filename)
        except OSError:
            if old is not None:
                os.replace(old, filename)  # the previous one, as it was
            raise
        if old is not None:
            try:
                if osp.isdir(old) and not osp.islink(old):
                    shutil.rmtree(old)
                else:
                    os.remove(old)
            except OSError as e:
                # The new checkpoint is in place; a leftover costs disk
                # only, and a later run's save of this name removes it.
                self.logger.warning(f'Could not remove {old}, the previous '
                                    f'{osp.basename(filename)}: {e}')

    def _distributed_now(self) -> bool:
        return bool(self.distributed and dist.is_initialized())

    def _from_rank0(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self._distributed_now():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj) -> list:
        """Every rank's ``obj``, by rank, on every rank."""
        if not self._distributed_now():
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a barrier as well)."""
        if not (self.distributed and dist.is_initialized()):
            return flag
        from mmengine.device import get_device
        value = torch.tensor([int(flag)], device=get_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _barrier(self) -> None:
        if self._distributed_now():
            dist.barrier()

    def _require_intact(self, filename: str) -> None:
        """Check a sharded checkpoint directory against its ``SHA256SUMS``
        before DCP reads it, the ranks sharing the hashing; all ranks raise
        the same :class:`~mmcv_custom.integrity.CheckpointDamagedError`
        (the bad file, and the newest intact checkpoint beside it, which
        rank 0 looks for) rather than DCP's traceback from inside a
        collective. A directory without a manifest loads, said once."""
        if not osp.isdir(filename):
            return
        part = ((self.rank, self.world_size) if self._distributed_now() else
                (0, 1))
        results = self._gather(verify_sharded_checkpoint(filename, part))
        damaged = [r for r in results if r.status == 'damaged']
        if damaged:
            message = self._from_rank0(
                damaged_message(damaged[0], filename) if self.rank ==
                0 else None)
            raise CheckpointDamagedError(message)
        if results[0].status == 'no_digest':
            self.logger.info(results[0].message)

    def _load_sharded(self, filename: str, with_optimizer: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (get_state_dict,
                                                             set_state_dict)
        optimizers = self._optimizers() if with_optimizer else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        state = {'model': model_sd}
        if optimizers:
            state['optimizer'] = optim_sd
        safe_dcp_load(state, filename)
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state['model'],
            optim_state_dict=state.get('optimizer', {}))

    def load_checkpoint(self,
                        filename: str,
                        *,
                        map_location: Union[str, Callable] = 'cpu',
                        strict: bool = False,
                        revise_keys: list = [(r'^module.', '')],
                        callback: Optional[Callable] = None) -> dict:
        """Load weights: from a sharded checkpoint directory (any number of
        ranks), or from an ordinary single-file checkpoint (a DDP run's,
        a converted InternVL segmentor), sharded on load."""
        self.logger.info(f'Load checkpoint from {filename}')
        self._require_intact(filename)
        if is_sharded_checkpoint(filename):
            self._load_sharded(filename, with_optimizer=False)
            checkpoint = load_checkpoint_file(
                osp.join(filename, SHARDED_META_FILE))
            if callback is not None:
                callback(checkpoint)
            return checkpoint
        if osp.isdir(filename):
            raise FileNotFoundError(
                f'{filename} is a directory but not a complete sharded '
                f'checkpoint (no .metadata or {SHARDED_META_FILE}): '
                'a save that did not finish leaves a hidden temporary '
                'directory (.NAME.<pid>-<random>.tmp), never one of the '
                'final name.')
        from mmengine.runner.checkpoint import _load_checkpoint
        checkpoint = _load_checkpoint(filename, map_location='cpu')
        if callback is not None:
            callback(checkpoint)
        state_dict = checkpoint.pop('state_dict', checkpoint)
        self.load_model_state_dict(
            state_dict, strict=strict, revise_keys=revise_keys)
        return checkpoint

    def load_model_state_dict(self,
                              state_dict: dict,
                              *,
                              strict: bool = False,
                              revise_keys: list = [(r'^module.', '')]) -> None:
        """Load a full (unsharded) state dict into the sharded model."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict)
        for pattern, replacement in revise_keys:
            state_dict = {
                re.sub(pattern, replacement, k): v
                for k, v in state_dict.items()
            }
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(
                f'Checkpoint does not match the model: missing keys '
                f'{missing}, unexpected keys {unexpected}')
        if missing or unexpected:
            self.logger.warning(
                f'Checkpoint: missing keys {missing}, unexpected keys '
                f'{unexpected}')
        state_dict = {k: v for k, v in state_dict.items() if k in own}
        set_model_state_dict(
            self.model,
            state_dict,
            options=StateDictOptions(full_state_dict=True, strict=False))

    def resume(self,
               filename: str,
               *,
               resume_optimizer: bool = True,
               resume_param_scheduler: bool = True,
               map_location: Union[str, Callable] = 'default',
               callback: Optional[Callable] = None) -> dict:
        """Resume model, optimizer, schedulers and meta from a sharded
        checkpoint directory; the world size may differ from the save's
        (DCP reshards)."""
        self.logger.info(f'Resume checkpoint from {filename}')
        self._require_intact(filename)
        if not is_sharded_checkpoint(filename):
            raise ValueError(
                f'FSDP2Strategy resumes from a sharded checkpoint directory '
                f'written by FSDP2Strategy, but {filename} is not one. To '
                'start from an ordinary checkpoint (a DDP run\'s), use '
                'load_from without --resume: it loads the weights.')
        self._load_sharded(filename, with_optimizer=resume_optimizer)
        checkpoint = load_checkpoint_file(
            osp.join(filename, SHARDED_META_FILE))
        if callback is not None:
            callback(checkpoint)
        extras = checkpoint.pop('optim_wrapper_extras', None)
        if resume_optimizer and extras:
            wrapper = self.optim_wrapper
            full = wrapper.optimizer.state_dict()
            full.update(extras)
            wrapper.load_state_dict(full)
        if resume_param_scheduler and hasattr(self, 'param_schedulers'):
            self.load_scheduler_state_dict(checkpoint.pop('param_schedulers'))
        resumed_seed = checkpoint['meta'].get('seed', None)
        current_seed = self._randomness.get('seed')
        if resumed_seed is not None and resumed_seed != current_seed:
            if current_seed is not None:
                self.logger.warning(
                    f'The random seed in the checkpoint ({resumed_seed}) '
                    f'differs from the one in `randomness` ({current_seed})'
                    '; using the checkpoint\'s.')
            self._randomness.update(seed=resumed_seed)
            self._set_randomness(**self._randomness)
        accumulative_counts = getattr(self.optim_wrapper,
                                      '_accumulative_counts', 1)
        if accumulative_counts > 1:
            self.optim_wrapper.initialize_count_status(
                self.model, checkpoint['meta']['iter'],
                self.dispatch_kwargs['max_iters'])
        return checkpoint
