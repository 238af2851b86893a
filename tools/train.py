"""Train with MMEngine's Runner, the MMSegmentation way, on GPUs or CPUs.

Same arguments as MMSegmentation 1.x's ``tools/train.py``. Additionally:

* ``mmcv_custom`` is imported, so ``comm_hook`` configs work without
  ``custom_imports``; a config that sets ``comm_hook`` but forgot the runner
  hook in ``custom_hooks`` gets it added (with one log line);
* a run never goes backwards (:mod:`mmcv_custom.launching.run_start`): a
  restart (``MAX_RESTARTS=N tools/dist_train.sh``, ``tools/slurm_train.sh``'s
  loop, a Slurm requeue) or ``--resume`` continues from the run's own
  newest intact checkpoint, whatever ``load_from`` says (it seeds a run at
  its start only); ``--resume PATH`` names a checkpoint to continue (the
  only way to continue another run's: a ``last_checkpoint`` naming one is
  not followed, and one copied in is refused naming both runs); a new run
  where checkpoints are saved is refused unless
  ``--overwrite`` (they are moved aside); ``--resume`` with nothing
  resumable stops, naming each checkpoint; global rank 0 holds the work
  dir's lock (:mod:`mmcv_custom.launching.work_dir_lock`) until the run
  ends, and a rank ends with its launcher
  (:mod:`mmcv_custom.launching.lifetime`);
* everything the run needs is checked first, before the model, the
  process group or the runner exists
  (:mod:`mmcv_custom.launching.preflight`): the training and validation
  data, the pretrained files, the checkpoint the run will load (missing,
  failing its ``.sha256`` digest, or holding what torch's safe loader
  refuses) and the work dir (writable, room for a save); every problem
  is said in one message, with what to do, and the run exits with
  status 2;
* ``load_from`` logs how many of the model's tensors it fills, and stops
  the run below ``load_from_min_match`` (default 0.5) of them;
* every rank's random generators are saved with each checkpoint and
  restored on resume (``RandomStateHook``), so a resumed run draws what
  the uninterrupted one would have;
* without CUDA, a distributed launch starts a gloo process group and a
  CPU DDP, and SyncBN becomes BN; a ``model_wrapper_cfg`` other than a DDP
  is refused by name (see :mod:`mmcv_custom.launching.cpu_start`);
* ``runner_type='FlexibleRunner'`` configs are built by MMEngine's
  ``RUNNERS`` (FSDP2Strategy, see :mod:`mmcv_custom.engine.fsdp2_strategy`);
  an ordinary config given a sharded checkpoint as ``load_from`` loads its
  consolidated weights.

Examples:
    python tools/train.py CONFIG
    bash tools/dist_train.sh CONFIG 8 \
        --cfg-options comm_hook.type=fp16_compress
"""
import argparse
import contextlib
import logging
import os
from typing import Optional

import torch
from mmengine.config import Config
from mmengine.logging import print_log

import mmcv_custom  # noqa: F401  (registers the runner hook and hooks)
from mmcv_custom.engine.hook_state_files import remove_orphan_state_files
from mmcv_custom.engine.process_group import is_launch_rank0, restart_count
from mmcv_custom.integrity.checkpoint_choice import checkpoint_folder
from mmcv_custom.launching.cpu_start import prepare_launch
from mmcv_custom.launching.preflight import (PreflightError, check_preflight,
                                             exit_on_problems)
from mmcv_custom.launching.preflight.work_dir import take_work_dir
from mmcv_custom.launching.run_start import apply_start_plan, plan_start
from mmcv_custom.launching.running import run_runner
from mmcv_custom.launching.tool_main import (add_launch_arguments,
                                             load_consolidated,
                                             parse_tool_args, run_tool,
                                             start_tool)
from mmcv_custom.launching.work_dir_lock import WorkDirLock

RUNNER_HOOK = 'CommHookRegistrationHook'


def parse_args():
    parser = argparse.ArgumentParser(description='Train a model')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume',
        nargs='?',
        const=True,
        default=False,
        metavar='PATH',
        help='resume from the newest intact checkpoint in the work_dir; with '
        'PATH, from that checkpoint (the only way to continue another '
        "run's checkpoint: a last_checkpoint naming a file outside the "
        'work dir is not followed)')
    parser.add_argument(
        '--overwrite',
        action='store_true',
        default=False,
        help='start again in a work dir that holds checkpoints of an earlier '
        'run: they are moved into superseded_<newest>/ there (with '
        '--resume and an older load_from: go back to it, moving the '
        'checkpoints after it)')
    parser.add_argument(
        '--amp',
        action='store_true',
        default=False,
        help='enable automatic-mixed-precision training')
    add_launch_arguments(
        parser,
        cfg_options_help='override some settings in the used config, the '
        'key-value pair in xxx=yyy format will be merged into config file. '
        'If the value to be overwritten is a list, it should be like '
        'key="[a,b]" or key=a,b It also allows nested list/tuple values, '
        'e.g. key="[(a,b),(c,d)]" Note that the quotation marks are '
        'necessary and that no white space is allowed.')
    return parse_tool_args(parser)


def _hook_type(hook) -> str:
    """A custom_hooks entry's type name: a config's ``type``, or the
    class name of a Hook object (which MMEngine takes as well)."""
    if isinstance(hook, dict):
        kind = hook.get('type')
        return kind if isinstance(kind, str) else getattr(kind, '__name__', '')
    return type(hook).__name__


def add_random_state_hook(cfg: Config) -> None:
    """Keep every rank's random generators (see
    :mod:`mmcv_custom.engine.random_state`) and the run's identity (see
    :mod:`mmcv_custom.engine.run_identity`) with the checkpoints, unless
    the config has those hooks."""
    for name in ('RandomStateHook', 'RunIdentityHook'):
        hooks = cfg.get('custom_hooks') or []
        if not any(
                _hook_type(h) in (name, f'mmcv_custom.{name}') for h in hooks):
            cfg.custom_hooks = list(hooks) + [dict(type=name)]


def add_comm_hook_runner_hook(cfg: Config) -> None:
    """Add the runner hook when ``comm_hook`` is set but the hook is not."""
    if cfg.get('comm_hook') is None:
        return
    hooks = cfg.get('custom_hooks') or []
    if any(
            _hook_type(h) in (RUNNER_HOOK, f'mmcv_custom.{RUNNER_HOOK}')
            for h in hooks):
        return
    cfg.custom_hooks = list(hooks) + [dict(type=RUNNER_HOOK)]
    if is_launch_rank0():
        print_log(
            f'The config sets comm_hook but not {RUNNER_HOOK} in '
            'custom_hooks: added it.',
            logger='current',
            level=logging.INFO)


def main():
    args = parse_args()
    cfg = start_tool('train.py', args)

    if args.amp:
        optim_wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if optim_wrapper == 'AmpOptimWrapper':
            print_log(
                'AMP training is already enabled in your config.',
                logger='current',
                level=logging.WARNING)
        else:
            if optim_wrapper != 'OptimWrapper':
                raise ValueError('--amp is only supported with '
                                 "optim_wrapper type 'OptimWrapper', but got "
                                 f'{optim_wrapper!r}')
            # MMEngine's AmpOptimWrapper refuses CPUs.
            cfg.optim_wrapper.type = ('AmpOptimWrapper'
                                      if torch.cuda.is_available() else
                                      'CPUAmpOptimWrapper')
            cfg.optim_wrapper.loss_scale = 'dynamic'

    # Where the run starts (its own newest checkpoint wins over load_from;
    # a new run does not overwrite an older one): read the same way on
    # every rank, before the process group exists.
    named = args.resume if isinstance(args.resume, str) else None
    plan = plan_start(cfg, bool(args.resume), restart_count(), args.overwrite,
                      named)
    # One run per work dir, held by global rank 0 (which writes it) until
    # the run ends.
    lock = WorkDirLock(cfg.work_dir) if is_launch_rank0() else None
    try:
        busy = take_work_dir(lock)
        # Data, pretrained files, the checkpoint to load and the work dir,
        # all named at once, before the model, the process group or the
        # runner exists.
        if busy is not None:
            raise PreflightError([busy])
        cfg.load_from = plan.load_from
        check_preflight(
            cfg,
            'train',
            resume_checkpoint=plan.load_from if plan.resume else None,
            launcher=args.launcher,
            first=plan.problems)
    except PreflightError as e:
        if lock is not None:
            lock.release()
        # Every rank stops; one per node says why (exit 2, as for usage).
        exit_on_problems(e, 'train.py', args.launcher)
    try:
        _train(cfg, args, plan, lock)
    finally:
        if lock is not None:
            lock.release()


def _lock_notes(lock: Optional[WorkDirLock], restart: int) -> list:
    """What the log says about the lock: a file system without locks, or
    a holder that never released it (an earlier attempt of this run, on a
    restart)."""
    if lock is None:
        return []
    notes = []
    if lock.unsupported:
        notes.append((logging.WARNING, lock.unsupported))
    stale = lock.stale_note()
    if stale:
        notes.append((logging.INFO if restart else logging.WARNING, stale))
    return notes


def _train(cfg: Config, args, plan, lock: Optional[WorkDirLock]) -> None:
    """Everything after the preflight: the launch, the start plan's
    moves, the runner."""
    cfg.resume = plan.resume
    add_comm_hook_runner_hook(cfg)
    add_random_state_hook(cfg)
    prepare_launch(cfg, args.launcher)
    apply_start_plan(plan, is_launch_rank0())
    checkpoint = cfg.load_from = plan.load_from
    notes = _lock_notes(lock, restart_count()) + plan.notes
    if lock is not None and lock.held:
        # What a save that failed or was killed left (the lock keeps any
        # other run from saving here now).
        orphans = remove_orphan_state_files(checkpoint_folder(cfg))
        if orphans:
            notes.append(
                (logging.WARNING,
                 (f'removed {len(orphans)} communication-hook state files '
                  'whose checkpoint is missing (a save that failed or was '
                  f'killed): {", ".join(map(os.path.basename, orphans))}')))
    with contextlib.ExitStack() as stack:
        # Fine-tuning an ordinary config from a sharded run.
        load_consolidated(stack, cfg, checkpoint, 'loading')
        run_runner(cfg, 'train', notes)


if __name__ == '__main__':
    run_tool(main, 'train.py')
