"""The MMEngine runner hook that puts a config's ``comm_hook`` on the model."""
import os
from typing import List, Optional, Tuple

import torch
from mmengine.dist import is_main_process
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer
from mmengine.model import MMSeparateDistributedDataParallel, is_model_wrapper
from mmengine.registry import HOOKS
from mmengine.runner import find_latest_checkpoint
from torch.nn.parallel import DistributedDataParallel

from ..comm.auto import AUTO
from ..comm.builder import CommHookConfig, build_comm_hook
from ..comm.config import comm_hook_config
from ..comm.telemetry import CommCounter
from ..hooks.sharded import fsdp_modules, fsdp_replicas
from ..hooks.validation import require_int
from .auto_comm import CHECKPOINT_KEY as AUTO_CHECKPOINT_KEY
from .auto_comm import AutoComm
from .fsdp2_comm import FSDP2CommMixin, codec_note, describe_cfg
from .hook_state_files import HookStateFiles
from .nonfinite_guard import NonFiniteGradientsError, NonFiniteGuard
from .periodic_sync import PeriodicSync
from .process_group import launcher_claim

__all__ = ['CommHookRegistrationHook', 'NonFiniteGradientsError']


class _Unknown(float):
    """NaN that formats as ``unknown``: what the log line shows for a
    scalar nobody counted, while JSON, TensorBoard & co. get a number."""

    def __new__(cls):
        return super().__new__(cls, 'nan')

    def __format__(self, spec: str) -> str:
        return 'unknown'

    def __reduce__(self):
        # Copies (the log processor deep-copies its tags) stay unknown.
        return _Unknown, ()

    def __repr__(self) -> str:
        return 'unknown'

    __str__ = __repr__


_UNKNOWN = _Unknown()


class _UnknownScalar(HistoryBuffer):
    """A message-hub scalar that is unknown at every iteration: MMEngine's
    log processor prints its current value (or mean) as ``unknown``."""

    def current(self):
        return _UNKNOWN

    def mean(self, window_size: Optional[int] = None):
        return _UNKNOWN

    def statistics(self, method_name: str, *arg, **kwargs):
        return _UNKNOWN


def _update_unknown(hub, key: str) -> None:
    """One more unknown value of ``key`` (NaN in the buffer's data)."""
    if not isinstance(hub.log_scalars.get(key), _UnknownScalar):
        hub.log_scalars[key] = _UnknownScalar()
    hub.log_scalars[key].update(float('nan'))


def _unknown_traffic_note(spec) -> str:
    """Once on rank 0: why ``comm_MB`` is unknown, and the fix."""
    return (f"comm_hook type={spec.type!r}: the bytes it sends are unknown "
            '(its hook has no HookRecord with count_bytes_sent), so comm_MB '
            "and comm_ratio show 'unknown'. Give the hook a record where it "
            'is registered, e.g. @COMM_HOOKS.register_module(record='
            'HookRecord(count_bytes_sent=sends_bucket())) from '
            'mmcv_custom.comm (docs/en/advanced_guides/own_hooks.md).')


@HOOKS.register_module()
class CommHookRegistrationHook(FSDP2CommMixin, Hook):
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
      not distributed, so a typo fails on a one-GPU debugging run too. The
      checked config (:func:`~mmcv_custom.comm.config.comm_hook_config`)
      is what the rest reads: nothing checks it again.
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
      (that, over what DDP would send without the hook: the buckets' own
      dtype); under DDP also ``comm_wait``, the seconds the step waited for
      communication after its last gradient was computed (from the last
      bucket's hand-over to the last reduction's completion: what the
      hook left exposed, see
      :meth:`~mmcv_custom.comm.telemetry.CommCounter.pop_wait`). Counted
      in Python as buckets pass, as the hook's
      :class:`~mmcv_custom.comm.records.HookRecord` says: no collective, no
      synchronisation. A hook whose record does not count its bytes (a
      plugin's without ``count_bytes_sent``) shows ``comm_MB: unknown`` and
      ``comm_ratio: unknown`` (NaN for the visualizer backends), and rank 0
      says once how to give it a record. Then warns,
      once per occurrence, about buckets whose fp16 average is not finite
      (``check_finite``), naming the bucket and its parameters, and stops
      the run (:class:`NonFiniteGradientsError`, before any checkpoint of
      that iteration is saved) when the parameters themselves turned
      non-finite or after ``max_nonfinite_iters`` such iterations in a row.
    * Hooks whose record names a state keeper (PowerSGD, batched
      PowerSGD, int8's error feedback): every rank saves the hook's state
      beside each checkpoint and a resumed run restores it on all ranks or
      on none (see :mod:`mmcv_custom.engine.hook_state_files`).

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
        max_nonfinite_iters (int, optional): Stop after this many
            iterations in a row with non-finite averaged gradients, while
            the parameters stay finite (a loss scaler skipping the steps).
            A dynamic loss scaler needs a few such steps to settle, hence
            the default of 10 (an int >= 1). None never stops for that
            reason; the run always stops when the parameters turn
            non-finite.
    """

    priority = 'VERY_HIGH'

    def __init__(self,
                 comm_hook: Optional[dict] = None,
                 telemetry: bool = True,
                 max_nonfinite_iters: Optional[int] = 10) -> None:
        # Checked for DDP here, so that a bad argument fails when the hook
        # is built; before_run adds FSDP2's checks where the model is so.
        self._arg_config = (None if comm_hook is None else
                            comm_hook_config(comm_hook))
        if not isinstance(telemetry, bool):
            raise TypeError('telemetry should be True or False, but got '
                            f'{telemetry!r}')
        if max_nonfinite_iters is not None:
            require_int('max_nonfinite_iters', max_nonfinite_iters, minimum=1)
        self._hook_arg = comm_hook
        self._telemetry = telemetry
        self._guard = NonFiniteGuard(max_nonfinite_iters)
        # The run's comm_hook, checked once (in before_run).
        self._config: Optional[CommHookConfig] = None
        self._checked = False
        self._registered = False
        # (where, spec, counter, parameter names by id) per DDP module.
        self._installed: list = []
        # Saves and restores the state of hooks with a state keeper.
        self._state_files: Optional[HookStateFiles] = None
        self._loaded_record = None
        # This rank's bytes since registration, for the tools' summary.
        self._baseline_total = 0
        self._sent_total: Optional[int] = 0
        # comm_hook auto: its trials and decision; its counters by module.
        self._auto: Optional[AutoComm] = None
        self._counters: list = []
        self._loaded_auto = None
        # post_local_sgd and diloco: their step after each optimizer step.
        self._periodic: Optional[PeriodicSync] = None

    def _resolve_cfg(self, runner):
        """The config's ``comm_hook`` (a dict), else the argument's (as
        checked in ``__init__``), else None."""
        from_config = runner.cfg.get('comm_hook', None)
        if from_config is not None and not isinstance(from_config, dict):
            # Let the checker name the bad value.
            comm_hook_config(from_config)
        if from_config is not None:
            from_config = dict(from_config)
        if (from_config is not None and self._hook_arg is not None
                and from_config != dict(self._hook_arg)):
            raise ValueError(
                'comm_hook is set twice with different values: the config '
                f'says {describe_cfg(from_config)}, the '
                'CommHookRegistrationHook argument says '
                f'{describe_cfg(dict(self._hook_arg))}. Keep one.')
        return from_config if from_config is not None else self._arg_config

    def before_run(self, runner) -> None:
        if self._checked:
            return
        cfg = self._resolve_cfg(runner)
        if cfg is None:
            runner.logger.warning(
                'CommHookRegistrationHook is enabled but the config sets no '
                "`comm_hook` (e.g. comm_hook = dict(type='bf16_compress')); "
                'DDP keeps its default full-precision all-reduce.')
        elif fsdp_modules(runner.model):
            # FSDP2 (FSDP2Strategy): only types with a sharded form (and
            # under hybrid sharding, only those that run there).
            self._config = comm_hook_config(
                cfg, 'hybrid' if fsdp_replicas(runner.model) > 1 else 'full')
        else:
            self._config = comm_hook_config(cfg)
            # Raises for FSDP1, DeepSpeed & co. before any heavy work.
            self._ddp_modules(runner.model)
        self._checked = True

    def before_train(self, runner) -> None:
        if self._registered or self._config is None:
            return
        self._registered = True
        if fsdp_modules(runner.model):
            self._install_sharded(runner)
            return
        targets = self._ddp_modules(runner.model)
        if not targets:
            runner.logger.info(
                f'comm_hook={describe_cfg(self._config.given)} not '
                f'registered: the model ({type(runner.model).__name__}) is '
                'not distributed '
                '(neither wrapped in DistributedDataParallel nor sharded by '
                'FSDP2), so there is no gradient reduction to change.')
            return

        config = self._config
        if config.type == AUTO:
            self._auto = AutoComm(config, self._loaded_auto)
            decision = self._auto.kept(runner)
            if decision is None:
                self._counters = [
                    CommCounter() if self._telemetry else None for _ in targets
                ]
                self._auto.start(
                    runner, targets, lambda i, config: self._build(
                        targets[i][1], config, self._counters[i]))
                self._installed = [
                    (name, spec, counter, self._names(name, ddp))
                    for (name, ddp), spec, counter in zip(
                        targets, self._auto.active(), self._counters)
                ]
                return
            config = self._auto.chosen()
        self._register(runner, targets, config)

    def _follow_auto(self) -> None:
        """During ``auto``'s trials: what is installed is the hook under
        trial (its fp16 range guard); counters and names stay."""
        self._installed = [
            (name, spec, counter, names)
            for (name, _, counter,
                 names), spec in zip(self._installed, self._auto.active())
        ]

    def _step_auto(self, runner) -> None:
        """Time ``auto``'s iteration; on its decision, build the chosen
        hook afresh on each module and hand it the buckets (under FSDP2,
        the chosen reduce-scatter stays installed: it keeps no state)."""
        decided = self._auto.after_iter(runner)
        self._follow_auto()
        if not decided:
            return
        if fsdp_modules(runner.model):
            _, spec, counter, ids = self._installed[0]
            self._register_sharded(runner, spec,
                                   len(fsdp_modules(runner.model)), counter,
                                   ids)
            return
        targets = self._ddp_modules(runner.model)
        config = self._auto.chosen()
        specs = [
            self._build(ddp, config, counter)
            for (_, ddp), counter in zip(targets, self._counters)
        ]
        self._auto.settle(specs)
        self._register(runner, targets, config, specs)

    def _build(self, ddp, config: CommHookConfig,
               counter: Optional[CommCounter]):
        """``config``'s hook built for the DDP module ``ddp``."""
        param = next(ddp.module.parameters(), None)
        return build_comm_hook(
            config,
            process_group=ddp.process_group,
            device=param.device if param is not None else None,
            counter=counter,
            param_names={
                p: n
                for n, p in ddp.module.named_parameters()
            },
            node_claim=launcher_claim())

    @staticmethod
    def _names(name: str, ddp) -> dict:
        """id(parameter) -> its name in the model, for the log."""
        prefix = f'{name}.' if name else ''
        return {id(p): prefix + n for n, p in ddp.module.named_parameters()}

    def _register(self,
                  runner,
                  targets,
                  config: CommHookConfig,
                  specs=None) -> None:
        """Register ``config``'s hook on each DDP module (or, given ``specs``,
        hand ``auto``'s buckets to them), log what was registered and set
        up its state files."""
        keepers = {}
        self._installed = []
        for i, (name, ddp) in enumerate(targets):
            if specs is None:
                counter = CommCounter() if self._telemetry else None
                spec = self._build(ddp, config, counter)
                ddp.register_comm_hook(spec.state, spec.hook)
            else:
                spec, counter = specs[i], self._counters[i]
            if spec.state_keeper is not None:
                keepers[name] = spec.state_keeper
            self._installed.append(
                (name, spec, counter, self._names(name, ddp)))

        if specs is None:
            self._periodic = PeriodicSync.install(runner, targets,
                                                  self._installed)
        # On every rank: a bad MMCV_CUSTOM_INT8_FUSED stops them alike.
        param = next(targets[0][1].module.parameters(), None)
        casts = codec_note(self._installed[0][1], param)
        if is_main_process():
            ddp = targets[0][1]
            group = ddp.process_group
            where = type(runner.model).__name__
            if isinstance(runner.model, MMSeparateDistributedDataParallel):
                where += ' submodules ' + ', '.join(
                    name for name, *_ in self._installed)
            spec = self._installed[0][1]
            chosen = (
                f' (chosen by comm_hook auto, {describe_cfg(config.given)})'
                if self._auto else '')
            runner.logger.info(
                f'Registered DDP communication hook on {where}{chosen}: '
                f'{spec.describe()}; process group: {group.size()} '
                f'ranks, backend {torch.distributed.get_backend(group)}'
                f'{casts}.')
            for name, installed, *_ in self._installed:
                for note in installed.notes:
                    runner.logger.warning(f'{name}: {note}' if name else note)
            if any(counter is not None and not counter.bytes_sent_known
                   for _, _, counter, _ in self._installed):
                runner.logger.warning(_unknown_traffic_note(spec))

        if keepers:
            self._state_files = HookStateFiles(keepers, config)
            self._state_files.start()
            if runner.iter > 0 and specs is None:
                self._state_files.restore(runner, self._loaded_record,
                                          self._resumed_checkpoint(runner))

    def after_train_iter(self,
                         runner,
                         batch_idx: int,
                         data_batch=None,
                         outputs=None) -> None:
        if not self._installed:
            return
        if self._periodic is not None:
            self._periodic.after_train_iter(runner)
        self._check_finite(runner)
        if self._auto is not None and self._auto.trying:
            self._step_auto(runner)
        if self._state_files is not None:
            self._state_files.save_if_due(runner, by_epoch=False)
        if self._telemetry:
            baseline_bytes, bytes_sent = 0, 0
            # None under FSDP2 (no buckets) and on accumulation steps.
            waits = [
                w for w in (counter.pop_wait()
                            for _, _, counter, _ in self._installed)
                if w is not None
            ]
            if waits:
                # Several DDP modules (MMSeparateDistributedDataParallel)
                # reduce one after the other: their waits add up.
                runner.message_hub.update_scalar('train/comm_wait', sum(waits))
            for _, _, counter, _ in self._installed:
                baseline, sent = counter.pop()
                baseline_bytes += baseline
                bytes_sent = None if sent is None or bytes_sent is None else (
                    bytes_sent + sent)
            self._baseline_total += baseline_bytes
            self._sent_total = None if bytes_sent is None or (
                self._sent_total is None) else self._sent_total + bytes_sent
            hub = runner.message_hub
            if bytes_sent is None:
                for key in ('train/comm_MB', 'train/comm_ratio'):
                    _update_unknown(hub, key)
            else:
                ratio = (
                    bytes_sent / baseline_bytes if baseline_bytes else None)
                if self._periodic is not None:
                    bytes_sent, ratio = self._periodic.over_period(
                        bytes_sent, baseline_bytes)
                hub.update_scalar('train/comm_MB', bytes_sent / 2**20)
                if ratio is not None:
                    hub.update_scalar('train/comm_ratio', ratio)

    def traffic(self) -> Optional[Tuple[int, Optional[int]]]:
        """``(baseline, sent)``: the bytes this rank handed its comm hooks
        (what DDP would all-reduce without them) and the bytes the hooks
        sent, over the iterations of this run so far; ``sent`` is None when
        the hook's traffic is unknown (its record does not count it). None
        without telemetry."""
        if not self._telemetry:
            return None
        return self._baseline_total, self._sent_total

    # -- hook state in checkpoints (see hook_state_files.py) --------------
    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._loaded_record = checkpoint.get('comm_hook_state')
        self._loaded_auto = checkpoint.get(AUTO_CHECKPOINT_KEY)

    def before_train_iter(self,
                          runner,
                          batch_idx: int,
                          data_batch=None) -> None:
        if self._auto is not None:
            self._auto.before_iter()

    def after_train_epoch(self, runner) -> None:
        if self._state_files is not None:
            self._state_files.save_if_due(runner, by_epoch=True)

    def after_train(self, runner) -> None:
        # The last save may have made the CheckpointHook drop a checkpoint.
        if self._state_files is not None:
            self._state_files.prune()

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self._auto is not None:
            self._auto.record(checkpoint)
        if self._state_files is not None:
            self._state_files.record(checkpoint)

    def after_failure(self, runner) -> None:
        """Called by :func:`mmcv_custom.launching.running.run_runner` when
        the run fails: a save that failed (a full disk) leaves no state
        files."""
        if self._state_files is None:
            return
        removed = self._state_files.discard_unsaved()
        files = [
            os.path.basename(p) for p in removed if not p.endswith('.sha256')
        ]
        if files:
            ranks = f'{len(files)} rank{"s" if len(files) > 1 else ""}'
            runner.logger.warning(
                'The checkpoint save failed: removed the communication-hook '
                f'state files of {ranks} written for it '
                f'({", ".join(files)}) and their digests.')

    @staticmethod
    def _resumed_checkpoint(runner) -> Optional[str]:
        """The file MMEngine's ``load_or_resume`` resumed from."""
        load_from = getattr(runner, '_load_from', None)
        return load_from or find_latest_checkpoint(runner.work_dir)

    # -- non-finite averages ------------------------------------------------
    def _check_finite(self, runner) -> None:
        """See :class:`~.nonfinite_guard.NonFiniteGuard`."""
        self._guard.check(
            runner, self._installed,
            lambda: [(name + '.' if name else '') + n
                     for name, ddp in self._ddp_modules(runner.model)
                     for n, p in ddp.module.named_parameters()
                     if not bool(torch.isfinite(p.detach()).all())])

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
