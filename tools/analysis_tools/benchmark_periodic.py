"""Average step and bytes across nodes of the periodic hooks, on emulated
nodes, beside allreduce's.

``post_local_sgd`` and ``diloco`` cross the link between nodes once every
``period`` steps, after the optimizer step, so a single timed step says
nothing of them (``benchmark_step_time.py`` refuses them for that). This
tool trains the config through the real trainer (``tools/dist_train.sh``)
on ``--nodes`` emulated nodes of ``--ranks-per-node`` ranks
(``mmcv_custom.launching.emulated_cluster``: network namespaces, every
node's link shaped both ways by tc's tbf), for every hook setting at every
link rate, side by side in one invocation, and reports per row:

* ``step``: the AVERAGE step, the mean of the per-iteration time over
  whole periods after the first (the synchronising steps included; a
  median would hide them), from the longer of two runs; ``short run``:
  the same from the shorter one, a check on the noise;
* ``x unshaped allreduce``: that over allreduce's step on the unshaped
  link, issue 45's reference;
* ``link`` and ``payload``: what each node's link sent per step, from its
  interface counters, the difference of two runs of ``n1 < n2``
  iterations over ``n2 - n1`` (start-up traffic cancels), and that less
  the headers; ``model``: the payload the hook's record (a periodic one)
  or the cost model (a per-step one) predicts; ``inner``: what a rank
  sends inside its node per step (never on the link);
* ``x allreduce bytes`` and a verdict on issue 45's targets for each
  periodic row (diloco: at most 1/12 of allreduce's bytes; post_local_sgd:
  at most 1/period; both: average step at most 1.25 x unshaped allreduce).

Why two runs and one run's own windows, not two wall times: see
:mod:`mmcv_custom.analysis.periodic_bench`. Runs are whole periods after
``start_iter``: ``--lengths A B`` periods (``--window`` iterations stand
for a per-step hook's period). Validation and checkpoints are off.

``--hooks`` names each setting as ``NAME`` or ``NAME:KEY=VALUE,...``
(``KEY`` dotted for a nested key, ``VALUE`` a Python literal or a bare
word), checked as a ``comm_hook`` config before anything starts: a bad one
is a usage error (one line, exit code 2). The runs' logs and work dirs go
under ``--work-dir``; every namespace and link is removed on exit, a failed
run included (exit code 1, naming the run and its logs).

Examples:
    python tools/analysis_tools/benchmark_periodic.py --json p.json
    python tools/analysis_tools/benchmark_periodic.py --ranks-per-node 2 \\
        --hooks allreduce diloco:period=25 diloco:period=100 --rates 5 \\
        unshaped --lengths 2 4
"""
import argparse
import os.path as osp
import sys
import time

from mmcv_custom.analysis.cli import (LINK_RATES, cfg_options, check_output,
                                      check_work_dir, link_rate,
                                      positive_float, positive_int,
                                      read_config)
from mmcv_custom.analysis.periodic_bench import (DEFAULT_HOOKS, measure,
                                                 parse_hook_setting, predict,
                                                 report_lines, run_plan,
                                                 summarize, write_json)
from mmcv_custom.analysis.step_time import rate_label
from mmcv_custom.launching.emulated_cluster.node_options import (
    add_node_options, check_node_options)

PROG = 'benchmark_periodic'
_DEFAULT_CONFIG = osp.join('configs', 'fcn',
                           'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
_DIST_TRAIN = osp.join(
    osp.dirname(osp.dirname(osp.abspath(__file__))), 'dist_train.sh')


def _setting(text):
    try:
        return parse_hook_setting(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser():
    parser = argparse.ArgumentParser(
        prog=PROG,
        description='Average step and bytes across nodes per hook setting '
        'on emulated nodes, through the real trainer (needs root or an '
        'unprivileged user namespace).')
    parser.add_argument(
        'config',
        nargs='?',
        default=_DEFAULT_CONFIG,
        help=f'training config (default: {_DEFAULT_CONFIG})')
    add_node_options(
        parser,
        ranks_per_node_help='ranks on each emulated node, an int >= 1 '
        '(default: 1)')
    parser.add_argument(
        '--hooks',
        nargs='+',
        type=_setting,
        default=None,
        metavar='HOOK',
        help='hook settings, each NAME or NAME:KEY=VALUE[,KEY=VALUE...] '
        '(e.g. diloco:period=100,outer_format=bf16; '
        'post_local_sgd:period=25,inner.type=bf16_compress); allreduce is '
        f'added first if missing (default: {" ".join(DEFAULT_HOOKS)})')
    parser.add_argument(
        '--rates',
        type=link_rate,
        nargs='+',
        default=[25.0, 5.0, None],
        help=f"link rates in Mbit/s ({LINK_RATES}), and 'unshaped' (the "
        'reference of x unshaped allreduce; default: 25 5 unshaped)')
    parser.add_argument(
        '--lengths',
        type=positive_int,
        nargs=2,
        default=[2, 6],
        metavar=('A', 'B'),
        help='the two runs, in periods after start_iter (the first period '
        'is the warm-up the average leaves out): 2 <= A < B (default: 2 6)')
    parser.add_argument(
        '--window',
        type=positive_int,
        default=4,
        help="a per-step hook's period here: iterations per logged window "
        '(default: 4)')
    parser.add_argument(
        '--timeout',
        type=positive_float,
        default=None,
        metavar='SEC',
        help='stop a run that takes longer than SEC seconds (default: no '
        'limit)')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=[],
        metavar='KEY=VALUE',
        help='override config keys in every run, as in tools/train.py')
    parser.add_argument(
        '--work-dir',
        default='work_dirs/periodic_bench',
        help='the runs\' work dirs and node logs go to '
        'WORK_DIR/<rate>/<hook>/iters<N> (default: work_dirs/periodic_bench)')
    parser.add_argument('--json', help='write the rows and settings here')
    return parser


def parse_args(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    check_node_options(parser, args)
    a, b = args.lengths
    if not 2 <= a < b:
        parser.error(f'--lengths should be A B with 2 <= A < B (the first '
                     f'period is warm-up), but got {a} {b}')
    if len(set(args.rates)) != len(args.rates):
        parser.error('--rates repeats a rate: '
                     f'{" ".join(rate_label(r) for r in args.rates)}')
    if args.hooks is None:
        args.hooks = [parse_hook_setting(h) for h in DEFAULT_HOOKS]
    texts = [h.text for h in args.hooks]
    if len(set(texts)) != len(texts):
        parser.error(f'--hooks repeats a setting: {" ".join(texts)}')
    if 'allreduce' not in texts:
        args.hooks.insert(0, parse_hook_setting('allreduce'))
    if args.json:
        check_output(parser, '--json', args.json)
    args.options = cfg_options(parser, args.cfg_options)
    read_config(parser, 'config', args.config, args.options)
    check_work_dir(parser, '--work-dir', args.work_dir)
    return args


def _folder(text: str) -> str:
    return ''.join(c if c.isalnum() or c in '._-' else '_' for c in text)


def main(argv=None):
    args = parse_args(argv)
    from mmcv_custom.analysis.progress import Progress
    from mmcv_custom.launching.emulated_cluster import (EmulatedCluster,
                                                        check_available)
    reason = check_available()
    if reason is not None:
        print(f'{PROG}: cannot emulate nodes here: {reason}', file=sys.stderr)
        return 1
    start = time.monotonic()
    plans = {
        h.text: run_plan(h, args.lengths, args.window)
        for h in args.hooks
    }
    # Before any node starts: a model the cost model cannot read fails now.
    models = {
        h.text:
        predict(args.config, args.options, h, args.nodes, args.ranks_per_node)
        for h in args.hooks
    }
    work = [(rate, h) for rate in args.rates for h in args.hooks]
    rows = []
    with EmulatedCluster(
            args.nodes, ranks_per_node=args.ranks_per_node) as cluster, \
            Progress(len(work), weights=[
                plans[h.text].n1 + plans[h.text].n2 for _, h in work
            ]) as progress:
        for rate, hook in work:
            cluster.set_bandwidth(rate)
            folder = osp.join(args.work_dir, _folder(rate_label(rate)),
                              _folder(hook.text))
            try:
                row = measure(cluster, hook, plans[hook.text], _DIST_TRAIN,
                              args.config, folder, args.cfg_options,
                              args.timeout)
            except RuntimeError as e:
                print(f'{PROG}: {e}; removed the cluster', file=sys.stderr)
                return 1
            rows.append(
                dict(
                    row,
                    rate=rate_label(rate),
                    type=hook.hook_type,
                    periodic=hook.periodic,
                    period=hook.period,
                    model_bytes=models[hook.text]['link'],
                    inner_bytes=models[hook.text]['inner']))
            progress.advance(f'{rate_label(rate)}, {hook.text}')
            if args.json:  # what is done survives a later failure
                write_json(args.json, summarize(rows), _meta(args, start))
    meta = _meta(args, start)
    rows = summarize(rows)
    for line in report_lines(rows, meta):
        print(line)
    print(f"\n{PROG}: {len(rows)} rows in {meta['seconds'] / 60:.1f} min")
    if args.json:
        write_json(args.json, rows, meta)
    return 0


def _meta(args, start):
    return dict(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        config=args.config,
        lengths=args.lengths,
        window=args.window,
        cfg_options=args.cfg_options,
        seconds=round(time.monotonic() - start, 1))


if __name__ == '__main__':
    sys.exit(main())
