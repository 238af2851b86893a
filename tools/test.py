"""Evaluate a checkpoint, the MMSegmentation way, on GPUs or CPUs.

Same arguments as MMSegmentation 1.x's ``tools/test.py``; without CUDA a
distributed launch runs on gloo (see :mod:`mmcv_custom.launching.cpu_start`).
What the run needs is checked first, every problem in one message (exit
status 2; :mod:`mmcv_custom.launching.preflight`): the test data, the work
dir, and the checkpoint, which must exist and hold only what is on the
safe-loading allow-list (:mod:`mmcv_custom.integrity.checkpoint`). ``--out``
is created on every rank, since each writes its predictions there.

CHECKPOINT may also be a sharded checkpoint directory of FSDP2Strategy
(``iter_N.pth/``): an FSDP2 config reads it on any number of ranks; any
other config evaluates its consolidated weights (as
``tools/model_converters/fsdp2_to_pth.py`` writes them).

Examples:
    python tools/test.py CONFIG CHECKPOINT
    bash tools/dist_test.sh CONFIG CHECKPOINT 8 --out results/
"""
import argparse
import contextlib
import os
import sys

from mmengine.config import DictAction
from mmengine.logging import print_log

import mmcv_custom  # noqa: F401  (safe loading of MMEngine checkpoints)
from mmcv_custom.engine.process_group import is_launch_rank0
from mmcv_custom.integrity import CheckpointDamagedError
from mmcv_custom.integrity.checkpoint import is_sharded_checkpoint
from mmcv_custom.integrity.sharded_checkpoint import consolidated_file
from mmcv_custom.launching.console import ToolConsole, report_failure
from mmcv_custom.launching.cpu_start import prepare_launch, uses_fsdp2
from mmcv_custom.launching.lifetime import die_with_launcher
from mmcv_custom.launching.preflight import (PreflightError, check_preflight,
                                             checked_config, exit_on_problems)
from mmcv_custom.launching.running import run_runner


def parse_args():
    parser = argparse.ArgumentParser(description='Test (and eval) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument(
        'checkpoint',
        help='checkpoint file, or a sharded (FSDP2) checkpoint directory')
    parser.add_argument(
        '--work-dir',
        help='if specified, the evaluation metric results will be dumped '
        'into the directory as json')
    parser.add_argument(
        '--out',
        type=str,
        help='The directory to save output prediction for offline evaluation')
    parser.add_argument(
        '--show', action='store_true', help='show prediction results')
    parser.add_argument(
        '--show-dir',
        help='directory where painted images will be saved. '
        'If specified, it will be automatically saved '
        'to the work_dir/timestamp/show_dir')
    parser.add_argument(
        '--wait-time', type=float, default=2, help='the interval of show (s)')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override some settings in the used config, the key-value pair '
        'in xxx=yyy format will be merged into config file.')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    parser.add_argument(
        '--tta', action='store_true', help='Test time augmentation')
    parser.add_argument(
        '--verbose',
        action='store_true',
        help='print the environment, the full config, the hook table and '
        'third-party warnings on the console too (the log file always has '
        'them)')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args()
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def trigger_visualization_hook(cfg, args):
    default_hooks = cfg.default_hooks
    if 'visualization' not in default_hooks:
        raise RuntimeError(
            'VisualizationHook must be included in default_hooks to use '
            '--show or --show-dir; refer to the default_runtime.py of '
            'MMSegmentation for an example.')
    visualization_hook = default_hooks['visualization']
    visualization_hook['draw'] = True
    if args.show:
        visualization_hook['show'] = True
        visualization_hook['wait_time'] = args.wait_time
    if args.show_dir:
        visualizer = cfg.visualizer
        visualizer['save_dir'] = args.show_dir
    return cfg


def main():
    args = parse_args()
    # A rank ends with its launcher (torchrun, srun), SIGKILL included.
    die_with_launcher(args.launcher)
    # A header, the progress and a summary; the rest in the log file.
    console = ToolConsole('test.py', verbose=args.verbose).start()
    console.work_dir = args.work_dir
    try:
        cfg = checked_config(args.config, args.cfg_options, args.work_dir)
    except PreflightError as e:
        exit_on_problems(e, 'test.py', args.launcher)
    console.work_dir = cfg.work_dir

    # The checkpoint, the test data and the work dir, all named at once,
    # before the model, the process group or the runner exists.
    try:
        check_preflight(
            cfg,
            'test',
            test_checkpoint=args.checkpoint,
            launcher=args.launcher)
    except PreflightError as e:
        # Every rank stops; one per node says why (exit 2, as for usage).
        exit_on_problems(e, 'test.py', args.launcher)
    cfg.load_from = args.checkpoint
    missing = [
        key for key in ('test_dataloader', 'test_cfg', 'test_evaluator')
        if cfg.get(key) is None
    ]
    if missing:
        raise ValueError(
            f'{args.config} sets no {", ".join(missing)}, which this tool '
            'evaluates with. Add them to the config (to test on the '
            'validation set: test_dataloader = val_dataloader, test_cfg = '
            'dict(), test_evaluator = val_evaluator).')

    if args.show or args.show_dir:
        cfg = trigger_visualization_hook(cfg, args)
    if args.tta:
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
    if args.out is not None:
        cfg.test_evaluator['output_dir'] = args.out
        cfg.test_evaluator['keep_results'] = True
        # MMSegmentation's IoUMetric creates output_dir on rank 0 only, but
        # every rank writes its share of the predictions there: without
        # this, the other ranks fail on a directory that does not exist
        # yet.
        os.makedirs(args.out, exist_ok=True)

    prepare_launch(cfg, args.launcher)
    with contextlib.ExitStack() as stack:
        if is_sharded_checkpoint(args.checkpoint) and not uses_fsdp2(cfg):
            # Written by FSDP2Strategy, evaluated with an ordinary (DDP)
            # config.
            cfg.load_from = stack.enter_context(
                consolidated_file(args.checkpoint))
            if is_launch_rank0():
                print_log(
                    f'{args.checkpoint} is a sharded checkpoint: '
                    'evaluating its consolidated weights.',
                    logger='current')
        run_runner(cfg, 'test')


if __name__ == '__main__':
    try:
        main()
    except CheckpointDamagedError as e:
        # One line that names the damaged file and the newest intact one.
        sys.exit(report_failure(e, 'test.py', plain=True))
    except (Exception, KeyboardInterrupt) as e:
        # The cause once, from the first rank that failed; the traceback
        # in the log file.
        sys.exit(report_failure(e, 'test.py'))
