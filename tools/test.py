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

import mmcv_custom  # noqa: F401  (safe loading of MMEngine checkpoints)
from mmcv_custom.launching.cpu_start import prepare_launch
from mmcv_custom.launching.preflight import (PreflightError, check_preflight,
                                             exit_on_problems)
from mmcv_custom.launching.running import run_runner
from mmcv_custom.launching.tool_main import (add_launch_arguments,
                                             load_consolidated,
                                             parse_tool_args, run_tool,
                                             start_tool)


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
    add_launch_arguments(
        parser,
        cfg_options_help='override some settings in the used config, the '
        'key-value pair in xxx=yyy format will be merged into config file.')
    parser.add_argument(
        '--tta', action='store_true', help='Test time augmentation')
    return parse_tool_args(parser)


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
    cfg = start_tool('test.py', args)

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
        # Written by FSDP2Strategy, evaluated with an ordinary (DDP) config.
        load_consolidated(stack, cfg, args.checkpoint, 'evaluating')
        run_runner(cfg, 'test')


if __name__ == '__main__':
    run_tool(main, 'test.py')
