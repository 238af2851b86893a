"""Train one config under several DDP communication hooks and compare them.

A compressing hook is only worth its bandwidth if the model still converges
as it does with the fp32 all-reduce. This tool trains the same config, with
the same seed and data order, once per ``--variants`` entry (the default: the
fp32 ``allreduce`` baseline, ``int8_compress`` with error feedback and
``int8_compress`` without it), each through ``tools/dist_train.sh`` on
``--nproc`` ranks, in ``<work-dir>/<variant>``. Runs go one after another
(each on ``PORT`` when it is set, as ``tools/dist_train.sh`` takes it,
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
import ast
import glob
import json
import math
import os
import os.path as osp
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from mmcv_custom.analysis import (Progress, check_output, check_work_dir,
                                  format_eta, read_config, rendezvous_port)
from mmcv_custom.integrity import checkpoint_candidates
from mmcv_custom.launcher import free_port

__all__ = [
    'VARIANTS', 'parse_args', 'read_scalars', 'read_comm_hook', 'summarize',
    'format_table', 'verdict', 'plot', 'train_options', 'TrainLog', 'main'
]

HERE = osp.dirname(osp.abspath(__file__))
ROOT = osp.dirname(osp.dirname(HERE))
DIST_TRAIN = osp.join(ROOT, 'tools', 'dist_train.sh')
BASELINE = 'allreduce'

# variant -> (comm_hook type, takes block_size / error_feedback, EF value)
VARIANTS = {
    'allreduce': ('allreduce', False, None),
    'fp16_compress': ('fp16_compress', False, None),
    'bf16_compress': ('bf16_compress', False, None),
    'int8_ef': ('int8_compress', True, True),
    'int8_noef': ('int8_compress', True, False),
}
DEFAULT_VARIANTS = ['allreduce', 'int8_ef', 'int8_noef']
_LABELS = {
    'allreduce': 'fp32 all-reduce',
    'fp16_compress': 'fp16',
    'bf16_compress': 'bf16',
    'int8_ef': 'int8 + error feedback',
    'int8_noef': 'int8, no error feedback',
}
_COLORS = {
    'allreduce': 'black',
    'fp16_compress': 'tab:green',
    'bf16_compress': 'tab:purple',
    'int8_ef': 'tab:blue',
    'int8_noef': 'tab:red',
}


def _hook_options(variant: str, block_size: int) -> List[str]:
    """The ``--cfg-options`` that select ``variant``'s hook. Only the int8
    variants get ``block_size``/``error_feedback``: the other hooks' states
    reject keys they do not take."""
    hook_type, quantizes, feedback = VARIANTS[variant]
    options = [f'comm_hook.type={hook_type}']
    if quantizes:
        options += [
            f'comm_hook.block_size={block_size}',
            f'comm_hook.error_feedback={feedback}'
        ]
    return options


def _runs(work_dir: str) -> List[str]:
    """Run folders (``YYYYmmdd_HHMMSS``) under ``work_dir`` that hold a
    ``vis_data/scalars.json``, oldest first."""
    return sorted(
        osp.dirname(osp.dirname(p)) for p in glob.glob(
            osp.join(work_dir, '2*_*', 'vis_data', 'scalars.json')))


def read_scalars(path: str) -> dict:
    """Loss curve, validations and telemetry from one ``scalars.json``.

    MMEngine's ``LocalVisBackend`` writes one JSON object per line: training
    lines carry ``loss`` (the mean over the logger's window) and ``iter``;
    validation lines carry the metrics (``mIoU``...) and ``step``. A line
    cut short by a killed run is skipped rather than failing the report.

    Returns:
        dict: ``iters``, ``loss``, ``val`` (a list of ``{'step', 'mIoU',
        ...}``), ``comm_ratio`` and ``comm_MB`` (last logged value, or None).
    """
    iters, losses, val = [], [], []
    comm_ratio = comm_mb = None
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if 'loss' in entry:
                iters.append(entry.get('iter', entry.get('step')))
                losses.append(float(entry['loss']))
                comm_ratio = entry.get('comm_ratio', comm_ratio)
                comm_mb = entry.get('comm_MB', comm_mb)
            elif 'mIoU' in entry:
                val.append(entry)
    return dict(
        iters=iters,
        loss=losses,
        val=val,
        comm_ratio=comm_ratio,
        comm_MB=comm_mb)


def read_comm_hook(run: str) -> Optional[dict]:
    """The ``comm_hook`` a run was trained with, from the config MMEngine
    dumped beside its scalars (``<run>/vis_data/config.py``, overrides
    applied), or None if it has none.

    Read with :mod:`ast`, not executed: a run folder may come from anywhere,
    and the dump spells the dict out as ``dict(key=literal, ...)``.
    """
    path = osp.join(run, 'vis_data', 'config.py')
    if not osp.isfile(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == 'comm_hook'):
            value = node.value
            try:
                if (isinstance(value, ast.Call)
                        and isinstance(value.func, ast.Name)
                        and value.func.id == 'dict' and not value.args):
                    return {
                        k.arg: ast.literal_eval(k.value)
                        for k in value.keywords
                    }
                return ast.literal_eval(value)
            except ValueError:
                return None
    return None


def _mismatch(variant: str, hook: Optional[dict]) -> Optional[str]:
    """Why ``hook`` (a run's own ``comm_hook``) is not ``variant``'s, or
    None when it is (or the run does not say)."""
    if not isinstance(hook, dict):
        return None
    hook_type, quantizes, feedback = VARIANTS[variant]
    if hook.get('type') != hook_type:
        return (f"{variant!r} should be comm_hook type {hook_type!r}, but "
                f"the run used {hook.get('type')!r}")
    if quantizes and hook.get('error_feedback', True) != feedback:
        return (f'{variant!r} should have error_feedback={feedback}, but '
                f"the run used {hook.get('error_feedback', True)}")
    return None


def _smooth(values: List[float], weight: float) -> List[float]:
    """TensorBoard's debiased exponential moving average: early points are
    not pulled towards zero, so curves of different runs compare from the
    first logged iteration."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i) if weight else v)
    return out


def _auto_smooth(runs: Dict[str, dict]) -> float:
    """An EMA weight whose lag is about 3% of the longest curve: a fixed
    weight that suits 60 logged points would drag a 20-point curve far
    behind its raw values."""
    points = max([len(r['loss']) for r in runs.values() if r] or [1])
    lag = points / 30
    return lag / (1 + lag)


def summarize(runs: Dict[str, dict], smooth: float) -> List[dict]:
    """One row per variant (in ``runs``' order): the final mIoU, its
    difference to ``allreduce`` in points, comm_ratio, final smoothed loss.
    A variant whose run failed (``None`` in ``runs``) keeps its row, with
    its values empty."""
    base = runs.get(BASELINE)
    base_miou = base['val'][-1]['mIoU'] if base and base['val'] else None
    rows = []
    for variant, run in runs.items():
        row = dict(
            variant=variant,
            mIoU=None,
            delta_mIoU=None,
            comm_ratio=None,
            final_loss=None,
            final_iter=None)
        if run is not None:
            if run['val']:
                row['mIoU'] = run['val'][-1]['mIoU']
                if base_miou is not None:
                    row['delta_mIoU'] = row['mIoU'] - base_miou
            if run['loss']:
                row['final_loss'] = _smooth(run['loss'], smooth)[-1]
                row['final_iter'] = run['iters'][-1]
            row['comm_ratio'] = run['comm_ratio']
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return '-' if value is None else format(value, spec)


def format_table(rows: List[dict]) -> str:
    """The rows as a Markdown table."""
    lines = [
        '| variant | final mIoU | vs fp32 (points) | comm_ratio | '
        'final loss (smoothed) |', '|---|---|---|---|---|'
    ]
    for row in rows:
        lines.append(f"| `{row['variant']}` | {_fmt(row['mIoU'], '.2f')} | "
                     f"{_fmt(row['delta_mIoU'], '+.2f')} | "
                     f"{_fmt(row['comm_ratio'], '.3f')} | "
                     f"{_fmt(row['final_loss'], '.4f')} |")
    return '\n'.join(lines)


def verdict(rows: List[dict], tolerance: float) -> Optional[str]:
    """PASS/FAIL for ``int8_ef`` against ``allreduce``, and where
    ``int8_noef`` lands (informational), or None when the runs compared
    do not include both."""
    by = {row['variant']: row for row in rows}
    lines = []
    ef = by.get('int8_ef')
    if ef and BASELINE in by:
        if ef['delta_mIoU'] is None:
            lines.append(
                'int8_ef within {:g} mIoU point(s) of fp32 '
                'all-reduce: FAIL (no mIoU to compare)'.format(tolerance))
        else:
            ok = abs(ef['delta_mIoU']) <= tolerance
            lines.append(f'int8_ef within {tolerance:g} mIoU point(s) of fp32 '
                         f"all-reduce: {'PASS' if ok else 'FAIL'} "
                         f"({ef['delta_mIoU']:+.2f})")
    noef = by.get('int8_noef')
    if noef and noef['delta_mIoU'] is not None:
        lines.append(f"int8_noef vs fp32 all-reduce: "
                     f"{noef['delta_mIoU']:+.2f} mIoU points" +
                     (f" (int8_noef - int8_ef: "
                      f"{noef['delta_mIoU'] - ef['delta_mIoU']:+.2f})"
                      if ef and ef['delta_mIoU'] is not None else ''))
    return '\n'.join(lines) or None


def plot(runs: Dict[str, dict],
         rows: List[dict],
         path: str,
         title: str,
         smooth: float,
         tolerance: float = 1.0) -> None:
    """Three panels: loss curves (smoothed, raw faint), smoothed loss
    relative to fp32's, final mIoU per variant."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(
        1, 3, figsize=(16, 4.6), gridspec_kw=dict(width_ratios=[5, 5, 3]))
    done = {v: r for v, r in runs.items() if r is not None and r['loss']}
    base = done.get(BASELINE)
    base_smooth = dict(zip(base['iters'], _smooth(base['loss'], smooth))) \
        if base else {}
    for variant, run in done.items():
        color = _COLORS.get(variant)
        label = _LABELS.get(variant, variant)
        smoothed = _smooth(run['loss'], smooth)
        ax1.plot(run['iters'], run['loss'], color=color, alpha=0.25, lw=0.8)
        ax1.plot(run['iters'], smoothed, color=color, lw=1.8, label=label)
        if base_smooth and variant != BASELINE:
            pairs = [(i, 100 * (s / base_smooth[i] - 1))
                     for i, s in zip(run['iters'], smoothed)
                     if i in base_smooth]
            ax2.plot([p[0] for p in pairs], [p[1] for p in pairs],
                     color=color,
                     lw=1.8,
                     label=label)
    ax1.set(
        yscale='log',
        xlabel='iteration',
        ylabel='training loss',
        title=f'Loss (EMA {smooth:.2f}; raw faint)')
    ax1.legend(fontsize=8)
    ax2.axhline(0.0, color='black', lw=0.8)
    ax2.set(
        xlabel='iteration',
        ylabel='smoothed loss vs fp32 all-reduce (%)',
        title='Loss relative to fp32 all-reduce')
    if base_smooth and len(done) > 1:
        ax2.legend(fontsize=8)
    scored = [r for r in rows if r['mIoU'] is not None]
    names = [_LABELS.get(r['variant'], r['variant']) for r in scored]
    values = [r['mIoU'] for r in scored]
    bars = ax3.bar(
        range(len(scored)),
        values,
        color=[_COLORS.get(r['variant']) for r in scored],
        alpha=0.85)
    for bar, value in zip(bars, values):
        ax3.text(
            bar.get_x() + bar.get_width() / 2,
            value,
            f'{value:.2f}',
            ha='center',
            va='bottom',
            fontsize=8)
    base_row = next((r for r in scored if r['variant'] == BASELINE), None)
    if base_row:
        # Lines, not a shaded band: a band would hide behind the bars.
        for edge in (-tolerance, tolerance):
            ax3.axhline(
                base_row['mIoU'] + edge,
                color='grey',
                ls='--',
                lw=1,
                label=f'fp32 +/- {tolerance:g} point' if edge < 0 else None)
        ax3.legend(fontsize=8, loc='lower right')
    if values:
        low = min(values +
                  ([base_row['mIoU'] - tolerance] if base_row else []))
        ax3.set_ylim(max(0, low - 3), min(100, max(values) + 2))
    ax3.set_xticks(range(len(scored)))
    ax3.set_xticklabels(names, rotation=20, ha='right', fontsize=8)
    ax3.set(ylabel='mIoU (last validation)', title='Final mIoU')
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_from(parser, args) -> Dict[str, str]:
    """``--from-work-dirs``: ``{variant: work dir}``, every one holding a
    run with a ``scalars.json``."""
    if args.from_work_dirs:
        dirs = {}
        for item in args.from_work_dirs:
            variant, sep, folder = item.partition('=')
            if not sep or not folder:
                parser.error(f'--from-work-dirs expects VARIANT=DIR, but got '
                             f'{item!r}')
            if variant not in VARIANTS:
                parser.error(f'--from-work-dirs: unknown variant '
                             f'{variant!r}; valid variants: '
                             f"{', '.join(VARIANTS)}")
            if variant in dirs:
                parser.error(f'--from-work-dirs names {variant!r} twice')
            dirs[variant] = folder
    else:
        dirs = {v: osp.join(args.work_dir, v) for v in args.variants}
    for variant, folder in dirs.items():
        if not _runs(folder):
            parser.error(f'--from-work-dirs: no run with '
                         f'vis_data/scalars.json under {folder} (for '
                         f'{variant!r})')
    return dirs


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f'should be an int >= 1, but got {text!r}')
    return value


def _interval(cfg, key: str) -> Optional[int]:
    """The int at dotted ``key`` of ``cfg``, or None where it has none."""
    node = cfg
    for part in key.split('.'):
        node = node.get(part) if hasattr(node, 'get') else None
        if node is None:
            return None
    return node if isinstance(node, int) else None


#: What ``--max-iters`` lowers to N where the config's value is longer.
_INTERVALS = ('train_cfg.val_interval', 'default_hooks.checkpoint.interval')


def _max_iters_options(cfg, max_iters: int) -> List[str]:
    """The ``--cfg-options`` of ``--max-iters``: the run's length, and
    the validation and checkpoint intervals at most that long."""
    options = [f'train_cfg.max_iters={max_iters}']
    for key in _INTERVALS:
        value = _interval(cfg, key)
        if value is not None and value > max_iters:
            options.append(f'{key}={max_iters}')
    return options


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='\n'.join(__doc__.splitlines()[2:]))
    parser.add_argument('config', help='the config to train')
    parser.add_argument(
        '--variants',
        nargs='+',
        default=DEFAULT_VARIANTS,
        choices=list(VARIANTS),
        metavar='VARIANT',
        help=f"hooks to compare, from: {', '.join(VARIANTS)} "
        f"(default: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument(
        '--block-size',
        type=int,
        default=256,
        help='int8 elements per fp32 scale (default: 256)')
    parser.add_argument('--nproc', type=int, default=2, help='ranks per run')
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
        type=_positive_int,
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
    for option in args.cfg_options:
        if option.startswith('comm_hook'):
            parser.error(f'--cfg-options {option}: comm_hook is set by the '
                         'tool per variant (use --variants, --block-size)')
        if '=' not in option:
            parser.error(f'--cfg-options expects KEY=VALUE, but got '
                         f'{option!r}')
        if (args.max_iters is not None
                and option.startswith('train_cfg.max_iters=')):
            parser.error(f'--cfg-options {option}: give the length once, '
                         'as --max-iters or in --cfg-options')
    if args.max_iters is not None and args.from_work_dirs is not None:
        parser.error('--max-iters sets how long runs train, but '
                     '--from-work-dirs trains none')
    args.max_iters_options = ([] if args.max_iters is None else
                              _max_iters_options(cfg, args.max_iters))
    if args.work_dir is None:
        args.work_dir = osp.join('work_dirs', 'compare_comm_convergence',
                                 osp.splitext(osp.basename(args.config))[0])
    if args.from_work_dirs is not None:
        args.run_dirs = _parse_from(parser, args)
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


def train_options(args, variant: str) -> List[str]:
    """The ``--cfg-options`` of ``variant``'s run: its hook, the log
    interval, the seed, ``--max-iters``' and the user's own (last, so
    they win)."""
    options = _hook_options(variant, args.block_size)
    options.append(f'default_hooks.logger.interval={args.log_interval}')
    if args.seed is not None:
        options.append(f'randomness.seed={args.seed}')
    return options + args.max_iters_options + args.cfg_options


#: MMEngine's training log line: ``Iter(train) [ 50/600]  ... loss: 0.51``.
_TRAIN_LINE = re.compile(r'Iter\(train\)\s*\[\s*(\d+)/(\d+)\]')
_LOSS = re.compile(r'\bloss: (\S+)')


class TrainLog:
    """The training iterations a run has logged, read from its log file
    as it grows (MMEngine's logger line, on rank 0's output).

    Args:
        path (str): The run's log file (``dist_train.log``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b''

    def poll(self) -> Optional[Tuple[int, int, Optional[float]]]:
        """The newest training line since the last call, as
        ``(iteration, max_iters, loss or None)``; None if none came."""
        try:
            with open(self.path, 'rb') as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return None
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b'\n')
        newest = None
        for raw in lines:
            line = raw.decode('utf-8', 'replace')
            match = _TRAIN_LINE.search(line)
            if match is None:
                continue
            loss = _LOSS.search(line, match.end())
            try:
                value = float(loss.group(1)) if loss else None
            except ValueError:
                value = None
            newest = (int(match.group(1)), int(match.group(2)), value)
        return newest


#: Seconds between two looks at a training run's log.
_POLL_S = 2.0


def _wait(proc: subprocess.Popen, log: str, variant: str) -> int:
    """Wait for ``proc``, reporting its iterations from ``log`` (done of
    total, loss, ETA) on stderr; its exit code."""
    watch, progress = TrainLog(log), None
    start = time.monotonic()
    try:
        while True:
            try:
                code = proc.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                code = None
            seen = watch.poll()
            if seen is not None:
                done, total, loss = seen
                if progress is None:
                    # From the first logged iteration on: start-up (data,
                    # model, process group) is not training speed.
                    progress = Progress(
                        max(total, 1),
                        label=variant,
                        step_time=False,
                        done=done,
                        since=start)
                progress.update(done,
                                '' if loss is None else f'loss {loss:.4g}')
            if code is not None:
                return code
    except BaseException:
        # Ctrl-C or any error here: the run does not outlive the tool.
        proc.terminate()
        proc.wait()
        raise
    finally:
        if progress is not None:
            progress.close()


def _train(args, variant: str, number: str) -> Optional[str]:
    """Train ``variant`` (run ``number``, e.g. ``'2/3'``); its new run
    folder, or None if it failed (its log,
    ``<work-dir>/<variant>/dist_train.log``, says why)."""
    work_dir = args.run_dirs[variant]
    try:
        os.makedirs(work_dir, exist_ok=True)
    except OSError as e:
        print(
            f'[{variant}] FAILED: cannot create {work_dir} '
            f'({e.strerror})',
            file=sys.stderr,
            flush=True)
        return None
    before = set(_runs(work_dir))
    cmd = [
        'bash', DIST_TRAIN, args.config,
        str(args.nproc), '--work-dir', work_dir, '--cfg-options',
        *train_options(args, variant)
    ]
    port = args.port or free_port()
    log = osp.join(work_dir, 'dist_train.log')
    print(
        f'[{variant}] run {number} starts: PORT={port} {" ".join(cmd[1:])}',
        file=sys.stderr,
        flush=True)
    start = time.time()
    with open(log, 'w') as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PORT=port))
        code = _wait(proc, log, variant)
    new = [r for r in _runs(work_dir) if r not in before]
    if code != 0 or not new:
        print(
            f'[{variant}] FAILED (exit code {code}) after '
            f'{time.time() - start:.0f} s; log: {log}',
            file=sys.stderr,
            flush=True)
        return None
    print(
        f'[{variant}] run {number} done in {time.time() - start:.0f} s: '
        f'{new[-1]}',
        file=sys.stderr,
        flush=True)
    return new[-1]


def main(argv=None) -> int:
    args = parse_args(argv)
    runs, folders, hooks, failed = {}, {}, {}, []
    started = time.time()
    for i, variant in enumerate(args.variants):
        if args.from_work_dirs is not None:
            folder = _runs(args.run_dirs[variant])[-1]
        else:
            folder = _train(args, variant, f'{i + 1}/{len(args.variants)}')
            left = len(args.variants) - i - 1
            if left:
                # The runs are alike: the ones left take as long.
                eta = (time.time() - started) / (i + 1) * left
                print(
                    f'{left} run(s) left, ETA {format_eta(eta)}',
                    file=sys.stderr,
                    flush=True)
        if folder is None:
            failed.append(variant)
            runs[variant] = None
            continue
        folders[variant] = folder
        hooks[variant] = read_comm_hook(folder)
        wrong = _mismatch(variant, hooks[variant])
        if wrong:
            print(f'warning: {folder}: {wrong}', file=sys.stderr)
        runs[variant] = read_scalars(
            osp.join(folder, 'vis_data', 'scalars.json'))
    if args.smooth is None:
        args.smooth = _auto_smooth(runs)
    rows = summarize(runs, args.smooth)
    blocks = sorted({
        h.get('block_size', 256)
        for v, h in hooks.items() if isinstance(h, dict) and VARIANTS[v][1]
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
