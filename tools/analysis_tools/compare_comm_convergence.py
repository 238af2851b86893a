"""Train one config under several DDP communication hooks and compare them.

A compressing hook is only worth its bandwidth if the model still converges
as it does with the fp32 all-reduce. This tool trains the same config, with
the same seed and data order, once per ``--variants`` entry (the default: the
fp32 ``allreduce`` baseline, ``int8_compress`` with error feedback and
``int8_compress`` without it), each through ``tools/dist_train.sh`` on
``--nproc`` ranks, in ``<work-dir>/<variant>``. Every registered hook is
a variant (a plugin's too: the config's ``custom_imports`` and each
``--import MODULE``, which every run imports as well, are imported
first), under the settings its record names (``int8_compress`` as
``int8_ef`` and ``int8_noef``, PowerSGD compressing from its second step,
``post_local_sgd`` and ``diloco`` every 5, 25 and 100 steps, on several
nodes only: see ``select_variants``), with its record's label and colour
in the plot (see :mod:`mmcv_custom.analysis.convergence`). Runs go one
after another (each on ``PORT`` when it is set, as ``dist_train.sh`` takes it,
else each on a free port), so that they do not compete for the same cores.

It then reads every run's own record, ``<run>/vis_data/scalars.json``, and

* prints a Markdown table: final mIoU (the last validation), its difference
  to the fp32 all-reduce in points, the wire bytes relative to fp32
  (``comm_ratio``, logged by ``CommHookRegistrationHook``) and the final
  smoothed loss;
* prints a verdict: ``int8_ef`` within ``--tolerance`` mIoU points of
  ``allreduce`` (PASS/FAIL), and how far ``int8_noef`` lands;
* writes a PNG: the loss curves side by side (smoothed, raw faint), the
  smoothed loss relative to fp32's (where a drift shows first), and the
  final mIoU per variant;
* writes a JSON summary with the curves and the table.

``--max-iters N`` shortens every run for a quick look: it sets
``train_cfg.max_iters``, and lowers the validation and checkpoint
intervals to N where the config's are longer (MMEngine validates and
saves at the last iteration anyway, so every run ends with an mIoU). The
learning-rate schedule is left as the config has it: a shortened run is
cut, not compressed, the same way for every variant.

While a run trains, its iterations are reported from its log (done of
total, the loss, an ETA) on stderr, with a line when each run starts and
one when it ends; the table goes to stdout.

``--from-work-dirs`` skips training and reads existing runs: those under
``<work-dir>/<variant>``, or the ones named as ``VARIANT=DIR``. Either way
each run's own ``comm_hook`` is read back from the config MMEngine dumped
beside its scalars and kept in the summary; a run that does not match its
variant's name (say, ``int8_ef`` trained without error feedback) is warned
about, since a mislabelled curve is the easy mistake when re-plotting.

Run it from the repository root: the configs' data paths are relative.

Arguments and ``PORT`` are checked before any run starts (a bad value, or
a ``PORT`` another process listens on, is a usage error, exit code 2). A
run that fails is named with its log; the others are still trained and
reported, and the exit code is 1. A FAIL verdict is reported,
not turned into an exit code: the runs themselves worked.

Examples:
    python tools/analysis_tools/compare_comm_convergence.py \\
        configs/fcn/fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py \\
        --block-size 4096 --work-dir work_dirs/convergence_fcn
    # A quick look: 100 iterations a run
    python tools/analysis_tools/compare_comm_convergence.py \\
        configs/fcn/fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py \\
        --max-iters 100 --work-dir work_dirs/convergence_fcn_quick
    # Re-plot runs trained before, without training:
    python tools/analysis_tools/compare_comm_convergence.py \\
        configs/fcn/fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py \\
        --work-dir work_dirs/convergence_fcn --from-work-dirs
"""
import argparse
import json
import math
import os
import os.path as osp
import sys

from mmcv_custom.analysis import check_output, check_work_dir, read_config
from mmcv_custom.analysis.cli import positive_int
from mmcv_custom.analysis.convergence import (auto_smooth, format_table,
                                              max_iters_options, plot,
                                              summarize, variants, verdict)
from mmcv_custom.analysis.convergence_runs import (check_run_options, collect,
                                                   from_work_dirs,
                                                   select_variants,
                                                   train_options)
from mmcv_custom.analysis.plugins import (add_import_option,
                                          custom_imports_options,
                                          plugin_parser)
from mmcv_custom.integrity import checkpoint_candidates
from mmcv_custom.launching.ports import rendezvous_port

HERE = osp.dirname(osp.abspath(__file__))
ROOT = osp.dirname(osp.dirname(HERE))
DIST_TRAIN = osp.join(ROOT, 'tools', 'dist_train.sh')
DEFAULT_VARIANTS = ['allreduce', 'int8_ef', 'int8_noef']

__all__ = ['parse_args', 'train_options', 'main']


def _parser() -> argparse.ArgumentParser:
    known = list(variants())  # a plugin's hooks too: imported first
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='\n'.join(__doc__.splitlines()[2:]))
    parser.add_argument('config', help='the config to train')
    parser.add_argument(
        '--variants',
        nargs='+',
        default=DEFAULT_VARIANTS,
        choices=known + ['all'],
        metavar='VARIANT',
        help=f"hooks to compare, from: {', '.join(known)}; or all "
        f"(default: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument(
        '--block-size',
        type=int,
        default=256,
        help='int8 elements per fp32 scale (default: 256)')
    parser.add_argument('--nproc', type=int, default=2, help='ranks per run')
    parser.add_argument(
        '--ranks-per-node',
        type=int,
        metavar='N',
        help='start the --nproc ranks as nodes of N ranks on this machine '
        '(a torchrun per node), so that topology=\'auto\' runs the hooks\' '
        'two-level forms (default: --nproc, one node)')
    parser.add_argument(
        '--work-dir',
        help='runs go to <work-dir>/<variant> (default: '
        'work_dirs/compare_comm_convergence/<config name>)')
    parser.add_argument(
        '--seed',
        type=int,
        help='randomness.seed for every run (default: the config\'s)')
    parser.add_argument(
        '--max-iters',
        type=positive_int,
        metavar='N',
        help='train N iterations a run instead of the config\'s '
        'train_cfg.max_iters, for a quick look; validation and checkpoint '
        'intervals longer than N become N')
    parser.add_argument(
        '--log-interval',
        type=int,
        help='iterations per logged loss (default: 10, or N / 2 for '
        '--max-iters N below 20; the configs log every 50, too coarse for '
        'a curve)')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=[],
        metavar='KEY=VALUE',
        help='passed on to tools/train.py for every run (comm_hook.* is '
        'set by the tool)')
    parser.add_argument(
        '--from-work-dirs',
        nargs='*',
        metavar='VARIANT=DIR',
        help='do not train: read existing runs, under <work-dir>/<variant> '
        'for --variants, or the given VARIANT=DIR pairs (then --variants '
        'is not used); the latest run in each folder counts')
    parser.add_argument(
        '--smooth',
        type=float,
        help='EMA weight for the smoothed curves, in [0, 1) (default: '
        'from the number of logged points, lagging about 3%% of the run)')
    parser.add_argument(
        '--tolerance',
        type=float,
        default=1.0,
        help='mIoU points int8_ef may differ from fp32 (default: 1)')
    parser.add_argument(
        '--plot', help='PNG path (default: <work-dir>/convergence.png)')
    parser.add_argument(
        '--json', help='summary path (default: <work-dir>/summary.json)')
    parser.add_argument('--title', help='figure title (default: config name)')
    add_import_option(parser, 'its hooks are variants; every run imports it')
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = plugin_parser(_parser, argv)
    args = parser.parse_args(argv)
    # Everything is checked before the first run: a typo fails in a second,
    # not after half an hour of training.
    cfg = read_config(parser, 'config', args.config)
    if len(set(args.variants)) != len(args.variants):
        parser.error(f"--variants lists a variant twice: "
                     f"{' '.join(args.variants)}")
    if args.block_size < 1:
        parser.error(f'--block-size should be at least 1, but got '
                     f'{args.block_size}')
    if args.nproc < 1:
        parser.error(f'--nproc should be at least 1, but got {args.nproc}')
    if args.ranks_per_node is None:
        args.ranks_per_node = args.nproc
    elif not (1 <= args.ranks_per_node <= args.nproc
              and args.nproc % args.ranks_per_node == 0):
        parser.error(f'--ranks-per-node should divide --nproc '
                     f'({args.nproc}) into whole nodes (a divisor from 1 to '
                     f'{args.nproc}), but got {args.ranks_per_node}')
    for note in select_variants(parser, args):  # 'all'; periodic on 1 node
        print(note, file=sys.stderr)
    if args.log_interval is None:
        args.log_interval = 10 if args.max_iters is None else min(
            10, max(1, args.max_iters // 2))
    elif args.log_interval < 1:
        parser.error(f'--log-interval should be at least 1, but got '
                     f'{args.log_interval}')
    if args.seed is not None and not 0 <= args.seed < 2**32:
        # What numpy's generator takes (MMEngine seeds it too): beyond, every
        # run would fail after its start-up.
        parser.error(f'--seed should be an int from 0 to {2**32 - 1}, but '
                     f'got {args.seed}')
    if args.smooth is not None and not (0 <= args.smooth < 1):
        parser.error(f'--smooth should be in [0, 1), but got {args.smooth}')
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        parser.error(f'--tolerance should be >= 0, but got {args.tolerance}')
    check_run_options(parser, args)
    # Every run imports --import's modules too (the config's it reads).
    args.cfg_options = args.cfg_options + custom_imports_options(
        cfg, args.imports)
    if args.max_iters is not None and args.from_work_dirs is not None:
        parser.error('--max-iters sets how long runs train, but '
                     '--from-work-dirs trains none')
    args.max_iters_options = ([] if args.max_iters is None else
                              max_iters_options(cfg, args.max_iters))
    if args.work_dir is None:
        args.work_dir = osp.join('work_dirs', 'compare_comm_convergence',
                                 osp.splitext(osp.basename(args.config))[0])
    if args.from_work_dirs is not None:
        args.run_dirs = from_work_dirs(parser, args)
        args.variants = list(args.run_dirs)
        args.port = None
    else:
        args.port = rendezvous_port(parser)
        args.run_dirs = {v: osp.join(args.work_dir, v) for v in args.variants}
        # Never over the runs of an earlier comparison (tools/train.py
        # would refuse each of them, one run after another).
        earlier = [
            osp.join(v, osp.basename(found[0]))
            for v, found in ((v, checkpoint_candidates(d))
                             for v, d in args.run_dirs.items()) if found
        ]
        if earlier:
            parser.error(f'--work-dir {args.work_dir} holds the runs of an '
                         f'earlier comparison ({", ".join(earlier)}): read '
                         'them with --from-work-dirs, or choose another '
                         '--work-dir')
        check_work_dir(parser, '--work-dir', args.work_dir)
    if args.plot is None or args.json is None:
        os.makedirs(args.work_dir, exist_ok=True)
    args.plot = args.plot or osp.join(args.work_dir, 'convergence.png')
    args.json = args.json or osp.join(args.work_dir, 'summary.json')
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error('the plot needs matplotlib, which is not installed '
                     '(pip install matplotlib)')
    check_output(parser, '--plot', args.plot)
    check_output(parser, '--json', args.json)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    known = variants()
    runs, folders, hooks, failed = collect(args, DIST_TRAIN)
    if args.smooth is None:
        args.smooth = auto_smooth(runs)
    rows = summarize(runs, args.smooth)
    blocks = sorted({
        h.get('block_size', 256)
        for v, h in hooks.items()
        if isinstance(h, dict) and known[v].takes_block_size
    })
    title = args.title or (
        osp.splitext(osp.basename(args.config))[0] +
        (f": int8 block {', '.join(map(str, blocks))}" if blocks else ''))
    print()
    print(format_table(rows))
    said = verdict(rows, args.tolerance)
    if said:
        print()
        print(said)
    plot(runs, rows, args.plot, title, args.smooth, args.tolerance)
    summary = dict(
        config=args.config,
        nproc=args.nproc,
        block_size=args.block_size,
        seed=args.seed,
        cfg_options=args.cfg_options,
        smooth=args.smooth,
        tolerance=args.tolerance,
        verdict=said,
        rows=rows,
        runs={
            v:
            dict(
                folder=folders.get(v),
                comm_hook=hooks.get(v),
                **(runs[v] or {}))
            for v in args.variants
        },
        failed=failed)
    if args.from_work_dirs is not None:
        # Read, not trained here: the block size and options are the runs'
        # own (see runs.*.comm_hook), which this tool did not set.
        summary.update(
            block_size=None, cfg_options=None, seed=None, nproc=None)
    with open(args.json, 'w') as f:
        json.dump(summary, f, indent=1)
    print(f'\nplot: {args.plot}\nsummary: {args.json}')
    if failed:
        for variant in failed:
            print(
                f'{variant}: training failed; log: '
                f"{osp.join(args.run_dirs[variant], 'dist_train.log')}",
                file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
