"""Train with MMEngine's Runner, the MMSegmentation way, on GPUs or CPUs.

Same arguments as MMSegmentation 1.x's ``tools/train.py``. Additionally:

* ``mmcv_custom`` is imported, so ``comm_hook`` configs work without
  ``custom_imports``; a config that sets ``comm_hook`` but forgot the runner
  hook in ``custom_hooks`` gets it added (with one log line);
* everything the run needs is checked first, before the model, the
  process group or the runner exists (:mod:`mmcv_custom.preflight`): the
  training and validation data, the pretrained files, the checkpoint the
  run will load (``load_from``, in the config or from ``--cfg-options``,
  else with ``--resume`` the latest in the work dir: missing, failing its
  ``.sha256`` digest, or holding what torch's safe loader refuses) and
  the work dir (writable, room for a checkpoint); every problem is said in
  one message, with what to do, and the run exits with status 2;
  ``--resume`` whose latest checkpoint is
  missing, damaged or unreadable (or whose ``last_checkpoint`` is empty)
  takes the newest intact one, and with none starts at iteration 0, each
  with a warning (in the log file too);
* ``load_from`` logs how many of the model's tensors it fills, and stops
  the run below ``load_from_min_match`` (default 0.5) of them;
* every rank's random generators are saved with each checkpoint and
  restored on resume (``RandomStateHook``), so a resumed run draws what
  the uninterrupted one would have;
* a restart after a failure (``MAX_RESTARTS=N tools/dist_train.sh ...``:
  torchrun's ``--max-restarts``; ``tools/slurm_train.sh`` likewise) resumes
  by itself from the newest intact checkpoint;
* without CUDA, a distributed launch starts a gloo process group and a
  CPU DDP, and SyncBN becomes BN; a ``model_wrapper_cfg`` other than a DDP
  is refused by name (see :mod:`mmcv_custom.launcher`);
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
import sys

import torch
from mmengine.config import Config, DictAction
from mmengine.logging import print_log

import mmcv_custom  # noqa: F401  (registers the runner hook and hooks)
from mmcv_custom.checkpoint import (choose_resume_checkpoint,
                                    is_sharded_checkpoint)
from mmcv_custom.engine.console import ToolConsole, report_failure
from mmcv_custom.integrity import CheckpointDamagedError
from mmcv_custom.launcher import (is_launch_rank0, prepare_launch,
                                  restart_count, run_runner, uses_fsdp2)
from mmcv_custom.preflight import (PreflightError, check_preflight,
                                   checked_config, exit_on_problems)
from mmcv_custom.sharded_checkpoint import consolidated_file

RUNNER_HOOK = 'CommHookRegistrationHook'


def parse_args():
    parser = argparse.ArgumentParser(description='Train a model')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume',
        action='store_true',
        default=False,
        help='resume from the latest checkpoint in the work_dir automatically')
    parser.add_argument(
        '--amp',
        action='store_true',
        default=False,
        help='enable automatic-mixed-precision training')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override some settings in the used config, the key-value pair '
        'in xxx=yyy format will be merged into config file. If the value to '
        'be overwritten is a list, it should be like key="[a,b]" or key=a,b '
        'It also allows nested list/tuple values, e.g. key="[(a,b),(c,d)]" '
        'Note that the quotation marks are necessary and that no white space '
        'is allowed.')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    parser.add_argument(
        '--verbose',
        action='store_true',
        help='print the environment, the full config, the hook table and '
        'third-party warnings on the console too (the log file always has '
        'them)')
    # torch.distributed.launch passed --local_rank; torchrun sets LOCAL_RANK.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args()
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def _hook_type(hook) -> str:
    """A custom_hooks entry's type name: a config's ``type``, or the
    class name of a Hook object (which MMEngine takes as well)."""
    if isinstance(hook, dict):
        kind = hook.get('type')
        return kind if isinstance(kind, str) else getattr(kind, '__name__', '')
    return type(hook).__name__


def add_random_state_hook(cfg: Config) -> None:
    """Keep every rank's random generators with the checkpoints (see
    :mod:`mmcv_custom.engine.random_state`), unless the config has it."""
    hooks = cfg.get('custom_hooks') or []
    if not any(
            _hook_type(h) in ('RandomStateHook', 'mmcv_custom.RandomStateHook')
            for h in hooks):
        cfg.custom_hooks = list(hooks) + [dict(type='RandomStateHook')]


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
    # A header, the progress and a summary; the rest in the log file.
    console = ToolConsole('train.py', verbose=args.verbose).start()
    console.work_dir = args.work_dir
    try:
        cfg = checked_config(args.config, args.cfg_options, args.work_dir)
    except PreflightError as e:
        exit_on_problems(e, 'train.py', args.launcher)
    console.work_dir = cfg.work_dir

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

    restart = restart_count()
    if restart and not args.resume:
        # A restart after a failure (torchrun's --max-restarts, or the
        # Slurm script's loop) continues the run it restarts.
        args.resume = True
    cfg.resume = args.resume
    # What the runner will load: load_from (fine-tuning, or the checkpoint
    # to resume from), else with --resume the latest one in the work dir.
    checkpoint = cfg.get('load_from')
    notes = []
    resume_from = None
    if not checkpoint and args.resume:
        # MMEngine's choice (what <work_dir>/last_checkpoint names), unless
        # the work dir was moved or copied (then its own copy), or that
        # checkpoint is missing, damaged or unreadable (then the newest
        # intact one); none: a fresh start, said as a warning.
        checkpoint, notes = choose_resume_checkpoint(cfg.work_dir)
        if restart:
            notes.insert(
                0, f'restart {restart} after a failure: resuming '
                'from the newest intact checkpoint')
        resume_from = checkpoint
        # The notes go to the log file (and console) once the runner's
        # logger exists: run_runner logs them on rank 0.
    # Data, pretrained files, that checkpoint and the work dir, all named
    # at once, before the model, the process group or the runner exists.
    try:
        check_preflight(
            cfg,
            'train',
            resume_checkpoint=resume_from,
            launcher=args.launcher)
    except PreflightError as e:
        # Every rank stops; one per node says why (exit 2, as for usage).
        exit_on_problems(e, 'train.py', args.launcher)
    if resume_from:
        cfg.load_from = resume_from  # what MMEngine resumes from
    elif args.resume and not checkpoint:
        cfg.resume = False
    add_comm_hook_runner_hook(cfg)
    add_random_state_hook(cfg)
    prepare_launch(cfg, args.launcher)
    sharded = (
        checkpoint and is_sharded_checkpoint(checkpoint)
        and not uses_fsdp2(cfg))
    if sharded and args.resume:
        raise ValueError(
            f'{checkpoint} is a sharded checkpoint of FSDP2Strategy: it '
            'resumes under an FSDP2 config only (its optimizer state is '
            'sharded). To start this config from its weights, use '
            f'--cfg-options load_from={checkpoint} without --resume.')
    with contextlib.ExitStack() as stack:
        if sharded:
            # Fine-tuning an ordinary config from a sharded run.
            cfg.load_from = stack.enter_context(consolidated_file(checkpoint))
            if is_launch_rank0():
                print_log(
                    f'{checkpoint} is a sharded checkpoint: loading '
                    'its consolidated weights.',
                    logger='current')
        run_runner(cfg, 'train', notes)


if __name__ == '__main__':
    try:
        main()
    except CheckpointDamagedError as e:
        # One line that names the damaged file and the newest intact one.
        sys.exit(report_failure(e, 'train.py', plain=True))
    except (Exception, KeyboardInterrupt) as e:
        # The cause once, from the first rank that failed; the traceback
        # in the log file.
        sys.exit(report_failure(e, 'train.py'))
