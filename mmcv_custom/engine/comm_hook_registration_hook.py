"""The MMEngine runner hook that puts a config's ``comm_hook`` on the model."""
import os
import os.path as osp
from typing import List, Optional, Tuple

import torch
from mmengine.dist import get_rank, get_world_size, is_main_process
from mmengine.hooks import CheckpointHook, Hook
from mmengine.model import MMSeparateDistributedDataParallel, is_model_wrapper
from mmengine.registry import HOOKS
from torch.nn.parallel import DistributedDataParallel

from ..ddp_hooks import CompressState, cpu_codec
from ..registry import CommCounter, build_comm_hook, check_comm_hook_cfg

__all__ = ['CommHookRegistrationHook']


def _state_path(checkpoint: str, rank: int) -> str:
    """Where ``rank`` keeps its hook state for ``checkpoint``."""
    return osp.abspath(f'{checkpoint}.comm_hook_rank{rank}.pth')


def _describe_cfg(cfg: dict) -> str:
    return 'dict(' + ', '.join(f'{k}={v!r}' for k, v in cfg.items()) + ')'


@HOOKS.register_module()
class CommHookRegistrationHook(Hook):
    """Register the config's DDP communication hook before training starts.

    Registered in MMEngine's root ``HOOKS`` registry, so it builds under
    MMSegmentation's scope as well as in plain MMEngine and any other
    OpenMMLab codebase. A config turns it on with::

        custom_imports = dict(imports=['mmcv_custom'],
                              allow_failed_imports=False)
        custom_hooks = [dict(type='CommHookRegistrationHook')]
        comm_hook = dict(type='bf16_compress')

    (``configs/_base_/comm_hook.py`` holds the first two lines.)

    What it does, and when:

    * ``before_run`` (every ``train()``, ``val()`` and ``test()``): checks the
      ``comm_hook`` config and the model wrapper once, even when the run is
      not distributed, so a typo fails on a one-GPU debugging run too.
    * ``before_train`` (after resuming, before the first backward): builds
      the hook and registers it once on the ``DistributedDataParallel``
      model; on each inner DDP module of
      ``MMSeparateDistributedDataParallel``, each with its own state. A
      ``val()`` or ``test()`` run registers nothing, since it has no
      backward.
    * Logs one line on rank 0 saying exactly what was registered.
    * ``after_train_iter``: publishes this rank's traffic through the
      message hub, so it shows in the log line and in the visualizer
      backends (TensorBoard...): ``comm_MB`` (MiB sent through the hook in
      the iteration; 0 on gradient-accumulation steps) and ``comm_ratio``
      (that, over what an fp32 all-reduce would have sent). Counted in
      Python as buckets pass: no collective, no synchronisation. Then warns,
      once per occurrence, about buckets whose fp16 average is not finite,
      naming the bucket and its parameters.

    A model that is not distributed gets one INFO line and trains on; a
    model wrapped by something other than DDP (FSDP, DeepSpeed) is an error,
    since those reduce gradients without DDP communication hooks.

    Args:
        comm_hook (dict, optional): The hook config, for runners built
            without a config file. Defaults to None, meaning the config's
            top-level ``comm_hook``. Setting both to different values is an
            error.
        telemetry (bool): Publish ``comm_MB`` and ``comm_ratio``. Defaults
            to True.
    """

    priority = 'VERY_HIGH'

    def __init__(self,
                 comm_hook: Optional[dict] = None,
                 telemetry: bool = True) -> None:
        if comm_hook is not None:
            check_comm_hook_cfg(comm_hook)
        if not isinstance(telemetry, bool):
            raise TypeError('telemetry should be True or False, but got '
                            f'{telemetry!r}')
        self._hook_arg = comm_hook
        self._telemetry = telemetry
        self._cfg: Optional[dict] = None
        self._checked = False
        self._registered = False
        # (where, spec, counter, parameter names by id) per DDP module.
        self._installed: list = []
        # Submodule name -> PowerSGDRelayout, for stateful hooks.
        self._relayouts: dict = {}
        self._loaded_info = None
        self._due_checkpoint: Optional[str] = None
        # (CheckpointHook, checkpoint steps it kept before its last save).
        self._kept_before: Optional[tuple] = None

    def _resolve_cfg(self, runner) -> Optional[dict]:
        from_config = runner.cfg.get('comm_hook', None)
        if from_config is not None and not isinstance(from_config, dict):
            # Let the checker name the bad value.
            check_comm_hook_cfg(from_config)
        if from_config is not None:
            from_config = dict(from_config)
        if (from_config is not None and self._hook_arg is not None
                and from_config != dict(self._hook_arg)):
            raise ValueError(
                'comm_hook is set twice with different values: the config '
                f'says {_describe_cfg(from_config)}, the '
                'CommHookRegistrationHook argument says '
                f'{_describe_cfg(dict(self._hook_arg))}. Keep one.')
        return from_config if from_config is not None else self._hook_arg

    def before_run(self, runner) -> None:
        if self._checked:
            return
        self._cfg = self._resolve_cfg(runner)
        if self._cfg is None:
            runner.logger.warning(
                'CommHookRegistrationHook is enabled but the config sets no '
                "`comm_hook` (e.g. comm_hook = dict(type='bf16_compress')); "
                'DDP keeps its default full-precision all-reduce.')
        else:
            check_comm_hook_cfg(self._cfg)
            # Raises for FSDP, DeepSpeed & co. before any heavy work starts.
            self._ddp_modules(runner.model)
        self._checked = True

    def before_train(self, runner) -> None:
        if self._registered or self._cfg is None:
            return
        self._registered = True
        targets = self._ddp_modules(runner.model)
        if not targets:
            runner.logger.info(
                f'comm_hook={_describe_cfg(self._cfg)} not registered: the '
                f'model ({type(runner.model).__name__}) is not wrapped in '
                'DistributedDataParallel, so there is no gradient all-reduce '
                'to change.')
            return

        for name, ddp in targets:
            param = next(ddp.module.parameters(), None)
            device = param.device if param is not None else None
            counter = CommCounter() if self._telemetry else None
            spec = build_comm_hook(
                self._cfg,
                process_group=ddp.process_group,
                device=device,
                counter=counter,
                param_names={
                    p: n
                    for n, p in ddp.module.named_parameters()
                })
            if spec.relayout is not None:
                self._relayouts[name] = spec.relayout
            ddp.register_comm_hook(spec.state, spec.hook)
            prefix = f'{name}.' if name else ''
            names = {
                id(p): prefix + n
                for n, p in ddp.module.named_parameters()
            }
            self._installed.append((name, spec, counter, names))

        if self._relayouts and runner.iter > 0:
            self._restore(runner)

        if is_main_process():
            ddp = targets[0][1]
            group = ddp.process_group
            where = type(runner.model).__name__
            if isinstance(runner.model, MMSeparateDistributedDataParallel):
                where += ' submodules ' + ', '.join(
                    name for name, *_ in self._installed)
            spec = self._installed[0][1]
            casts = ''
            # ``device``: the parameters' device, from the loop above.
            if (device is not None and device.type == 'cpu'
                    and (spec.wrapper or isinstance(spec.state,
                                                    CompressState))):
                casts = f'; CPU casts: {cpu_codec()}'
            runner.logger.info(
                f'Registered DDP communication hook on {where}: '
                f'{spec.describe()}; process group: {group.size()} '
                f'ranks, backend {torch.distributed.get_backend(group)}'
                f'{casts}.')

    def after_train_iter(self,
                         runner,
                         batch_idx: int,
                         data_batch=None,
                         outputs=None) -> None:
        if not self._installed:
            return
        self._maybe_save_state(runner, by_epoch=False)
        if self._telemetry:
            fp32_bytes, wire_bytes = 0, 0
            for _, _, counter, _ in self._installed:
                fp32, wire = counter.pop()
                fp32_bytes += fp32
                wire_bytes = None if wire is None or wire_bytes is None else (
                    wire_bytes + wire)
            if wire_bytes is not None:
                runner.message_hub.update_scalar('train/comm_MB',
                                                 wire_bytes / 2**20)
                if fp32_bytes:
                    runner.message_hub.update_scalar(
                        'train/comm_ratio', wire_bytes / fp32_bytes)
        for name, spec, _, names in self._installed:
            state = spec.state
            if not (isinstance(state, CompressState) and state.check_finite):
                continue
            for index, params in state.pop_nonfinite():
                shown = [names.get(id(p), '?') for p in params]
                more = (f' and {len(shown) - 5} more'
                        if len(shown) > 5 else '')
                where = f' of {name}' if name else ''
                runner.logger.warning(
                    f'Iteration {runner.iter + 1}: non-finite gradients '
                    f'after the {spec.type} all-reduce in DDP bucket '
                    f'{index}{where} (parameters: '
                    f'{", ".join(shown[:5])}{more}). In fp16 the sum of '
                    'the ranks\' shares overflows above 65504: use '
                    'predivide_factor=<world size> or bf16_compress, or '
                    'check the loss (with AMP, the loss scaler skips such '
                    'steps).')

    # -- hook state in checkpoints --------------------------------------
    # MMEngine writes checkpoints on rank 0 only, but PowerSGD's error
    # feedback differs on every rank and is as large as the gradients. So
    # every rank writes its own file beside the checkpoint when the
    # CheckpointHook is about to save, and the checkpoint records them.

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._loaded_info = checkpoint.get('comm_hook_state')

    def after_train_epoch(self, runner) -> None:
        self._maybe_save_state(runner, by_epoch=True)

    def after_train(self, runner) -> None:
        # The last save may have made the CheckpointHook drop a checkpoint.
        self._prune_state_files()

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        # Only checkpoints the CheckpointHook saves on schedule have every
        # rank's file (a best-metric checkpoint between them has none).
        if self._relayouts and self._due_checkpoint is not None:
            checkpoint['comm_hook_state'] = dict(
                type=self._cfg.get('type'),
                wrapper=self._cfg.get('wrapper'),
                world_size=get_world_size(),
                files=[
                    self._state_file(rank) for rank in range(get_world_size())
                ])

    def _checkpoint_due(self, runner, by_epoch: bool):
        """``(CheckpointHook, file)`` when that hook saves now, else None."""
        for hook in runner.hooks:
            if not isinstance(hook, CheckpointHook) or (
                    hook.by_epoch != by_epoch):
                continue
            if by_epoch:
                due = hook.every_n_epochs(runner, hook.interval,
                                          hook.save_begin) or (
                                              hook.save_last
                                              and hook.is_last_train_epoch(
                                                  runner))
                step = runner.epoch + 1
            else:
                due = hook.every_n_train_iters(
                    runner, hook.interval, hook.save_begin) or (
                        hook.save_last and hook.is_last_train_iter(runner))
                step = runner.iter + 1
            if due:
                return hook, osp.join(hook.out_dir,
                                      hook.filename_tmpl.format(step))
        return None

    def _state_file(self, rank: int) -> Optional[str]:
        checkpoint = self._due_checkpoint
        if checkpoint is None:
            return None
        return _state_path(checkpoint, rank)

    def _maybe_save_state(self, runner, by_epoch: bool) -> None:
        self._due_checkpoint = None
        if not self._relayouts:
            return
        self._prune_state_files()
        due = self._checkpoint_due(runner, by_epoch)
        if due is None:
            return
        hook, self._due_checkpoint = due
        # The CheckpointHook may delete an old checkpoint (max_keep_ckpts)
        # when it saves this one; its state files go at the next call.
        self._kept_before = (hook, set(getattr(hook, 'keep_ckpt_ids', ())))
        path = self._state_file(get_rank())
        os.makedirs(osp.dirname(path), exist_ok=True)
        torch.save(
            {
                name: relayout.state_dict()
                for name, relayout in self._relayouts.items()
            }, path)

    def _prune_state_files(self) -> None:
        """Delete this rank's state files of the checkpoints the
        CheckpointHook removed (``max_keep_ckpts``) since the last save.

        Exactly those: state files of other runs in the same folder stay, as
        their checkpoints do. Every rank keeps the CheckpointHook's list of
        kept checkpoints, though only rank 0 deletes the checkpoint files.
        """
        if self._kept_before is None:
            return
        hook, before = self._kept_before
        self._kept_before = None
        rank = get_rank()
        for step in before - set(getattr(hook, 'keep_ckpt_ids', ())):
            path = _state_path(
                osp.join(hook.out_dir, hook.filename_tmpl.format(step)), rank)
            if osp.isfile(path):
                os.remove(path)

    def _restore(self, runner) -> None:
        info = self._loaded_info
        rank, world_size = get_rank(), get_world_size()
        fresh = ('; PowerSGD starts afresh (new error feedback and warm '
                 'start), as after its warm-up')
        if info is None:
            runner.logger.warning(
                'The resumed checkpoint has no communication-hook state'
                + fresh)
            return
        if (info.get('type'), info.get('wrapper')) != (
                self._cfg.get('type'), self._cfg.get('wrapper')):
            runner.logger.warning(
                f"The resumed checkpoint holds the state of comm_hook "
                f"type={info.get('type')!r}, wrapper={info.get('wrapper')!r}"
                f", not of type={self._cfg.get('type')!r}, "
                f"wrapper={self._cfg.get('wrapper')!r}" + fresh)
            return
        if info.get('world_size') != world_size:
            runner.logger.warning(
                f"The resumed checkpoint holds hook state of "
                f"{info.get('world_size')} ranks, this run has {world_size}"
                + fresh)
            return
        path = info['files'][rank]
        if not osp.isfile(path):
            # The work dir may have moved: look beside the checkpoint name.
            moved = osp.join(runner.work_dir, osp.basename(path))
            path = moved if osp.isfile(moved) else path
        try:
            saved = torch.load(path, map_location='cpu', weights_only=True)
            for name, relayout in self._relayouts.items():
                relayout.load_state_dict(saved[name])
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            runner.logger.warning(
                f'Could not restore the communication-hook state of rank '
                f'{rank} from {path}: {e}' + fresh)
            return
        if is_main_process():
            runner.logger.info(
                f'Restored the {self._cfg.get("type")} state (error '
                'feedback, warm start, iteration counter) of every rank '
                f'from {osp.dirname(path)}.')

    @staticmethod
    def _ddp_modules(model) -> List[Tuple[str, DistributedDataParallel]]:
        """The DDP modules to register on; empty when not distributed."""
        if isinstance(model, MMSeparateDistributedDataParallel):
            # It has no reducer of its own: each trainable submodule is a
            # DDP of its own (frozen ones are left unwrapped).
            return [(name, m) for name, m in model.module.named_children()
                    if isinstance(m, DistributedDataParallel)]
        if isinstance(model, DistributedDataParallel):
            return [('', model)]
        if is_model_wrapper(model):
            raise TypeError(
                'comm_hook needs a DistributedDataParallel model, but the '
                f'model is wrapped by {type(model).__name__}, which does '
                'not reduce gradients through DDP communication hooks. '
                'Remove comm_hook, or use model_wrapper_cfg='
                "dict(type='MMDistributedDataParallel').")
        return []
