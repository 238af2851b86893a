"""The checkpoints of
:class:`~mmcv_custom.engine.fsdp2_strategy.FSDP2Strategy`: sharded
directories written and read through ``torch.distributed.checkpoint``
(DCP), vouched for by a manifest.

``iter_N.pth/`` holds every rank's model and optimizer shards in DCP
format, rank 0's ``meta.pth`` (meta, message hub, schedulers) and
``SHA256SUMS``. A save goes to a temporary directory that rank 0 names and
is renamed once every rank has finished and the manifest is written, so a
directory of the final name is always complete and vouched for. Loading
checks the manifest first and reads non-tensor entries with torch's safe
loader (DCP's own unpickles them with ``weights_only=False``).

Kept apart from the strategy, which decides what to shard: this module is
about files, and everything in it runs on every rank together.
"""
import hashlib
import io
import os
import os.path as osp
import re
import shutil
import time
from typing import Callable, Dict, Optional, Union

import mmengine
import torch
import torch.distributed as dist

from ..hooks.sharded import fsdp_replicas
from ..integrity import (CheckpointDamagedError, atomic_write_bytes,
                         digest_path, file_sha256, remove_entry,
                         remove_stale_temporaries, temporary_name)
from ..integrity.checkpoint import (SHARDED_META_FILE, is_sharded_checkpoint,
                                    load_checkpoint_file)
from ..integrity.sharded_checkpoint import (MANIFEST_FILE, damaged_message,
                                            safe_dcp_load,
                                            verify_sharded_checkpoint,
                                            write_manifest)
from .fsdp2_mesh import describe_sharding, sharding_record
from .fsdp2_units import broadcast_rank0_buffers

__all__ = ['ShardedCheckpointMixin']


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


class ShardedCheckpointMixin:
    """Save, load and resume of sharded checkpoint directories, for
    :class:`~mmcv_custom.engine.fsdp2_strategy.FSDP2Strategy`.

    A mixin in front of MMEngine's ``DDPStrategy``, whose
    ``save_checkpoint``, ``load_checkpoint``, ``load_model_state_dict`` and
    ``resume`` it replaces. It uses what the strategy has: ``model``,
    ``optim_wrapper``, ``param_schedulers``, ``rank``, ``world_size``,
    ``distributed``, ``logger``, ``seed``, ``broadcast_buffers`` and the
    randomness and scheduler methods of MMEngine's strategies.
    """

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
            broadcast_rank0_buffers(self.model)
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
            sharded=self._sharding_now())
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
                remove_entry(old)
            except OSError as e:
                # The new checkpoint is in place; a leftover costs disk
                # only, and a later run's save of this name removes it.
                self.logger.warning(f'Could not remove {old}, the previous '
                                    f'{osp.basename(filename)}: {e}')

    def _sharding_now(self) -> dict:
        """The ``meta['sharded']`` of this run's checkpoints: the world
        size, DCP, and full or hybrid sharding (nodes x ranks), as the
        model is sharded."""
        return dict(
            world_size=self.world_size,
            format='dcp',
            **sharding_record(self.world_size, fsdp_replicas(self.model)))

    def _log_layout(self, filename: str, checkpoint: dict, what: str) -> None:
        """Say under which sharding ``filename`` was saved and which it is
        read into (``what``: the model, or the model and optimizer), the
        change included: DCP reshards, so a checkpoint of hybrid
        sharding resumes under full sharding, on another number of nodes,
        and back."""
        saved = describe_sharding((checkpoint.get('meta') or {}).get('sharded')
                                  or {})
        now = describe_sharding(self._sharding_now())
        if saved == now:
            self.logger.info(f'Loaded {what} of {filename}, saved under '
                             f'the same layout: {now}.')
        else:
            self.logger.info(
                f'Loaded {what} of {filename} across layouts: saved under '
                f'{saved}, now {now} (DCP resharded it).')

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
        collective. How it was verified is said once (INFO): against its
        ``SHA256SUMS``, or, without one, not at all."""
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
        if results[0].status in ('ok', 'no_digest'):
            # Each rank hashed its part: none damaged, all of it verified.
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
            self._log_layout(filename, checkpoint, 'the model')
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
        self._log_layout(
            filename, checkpoint, 'the model and optimizer'
            if resume_optimizer and self._optimizers() else 'the model')
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
