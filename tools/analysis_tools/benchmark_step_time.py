"""Step time per comm hook on emulated nodes joined by a shaped link.

What a hook buys is time, and only a link slow enough for the gradients'
bytes to matter shows it (over loopback, bytes are free). This tool starts
``--nodes`` emulated nodes (``mmcv_custom.launching.emulated_cluster``: network
namespaces, ``--ranks-per-node`` ranks each (by torchrun where more than
one; they talk inside their node), every node's link shaped in both
directions by tc's tbf; rate yes, propagation delay no), and on them trains
a real model (default: the tiny InternViT UperNet on the toy data) with
every hook at every link rate, side by side in one run: rounds of (rate,
hook) blocks, the hooks interleaved within a rate and the rates within a
round, so that drift on a shared machine hits them all alike. A step is a
whole training step: forward, loss, backward (with the hook) and the
optimizer.

Reported per rate and hook:

* ``step``: the median step time;
* ``compute``: the same with a hook that sends nothing (``noop``);
* ``exposed``: the step minus the same hook's step on the unshaped link
  (what the link costs it);
* ``wire``: what the hook sends per rank (its tensor bytes times
  ``2 (N - 1) / N``, as a ring all-reduce sends) divided by the rate:
  the time the link needs, if nothing overlapped;
* ``bound``: the least exposed time the link allows, given when DDP hands
  each bucket over (measured on the ``noop`` steps) and the order it
  does: buckets go one after another over one link, each no sooner than
  it is ready; what is left after the backward pass ends is exposed;
* ``codec``: its record's codec per step, timed alone on a copy of the
  step's buckets (``—`` where the record names none);
* ``bound+codec``: the same bound when each bucket's share of the codec
  runs in its chain, before its bytes, on
  the shaped link minus on an unshaped one: where a hook's codec already
  runs past the end of the backward pass, every byte it adds is exposed.
  On a host with a core per rank, the codec cannot hide behind the
  backward pass; the verdict judges against this bound;
* ``link``: the bytes each node's link sent per step, from its
  interface counters (start-up traffic left out), beside ``predicted``:
  the cost model's, for the form each hook runs.

``--hooks`` names each hook in a form (``NAME``, ``NAME:flat``,
``NAME:two_level``; see :mod:`mmcv_custom.analysis.hook_forms`), so that
one run compares a hook's flat and two-level forms with ``allreduce``
(not ``post_local_sgd`` nor ``diloco``: they synchronise across nodes
after the optimizer step every ``period`` steps, which these timed steps
do not run yet; naming one is a usage error saying how to measure it);
a plugin's hook too (the config's ``custom_imports`` and each
``--import MODULE`` are imported first, here and on every node).

``exposed / wire`` against ``bound / wire`` says how well a hook overlaps
its communication with the backward pass; the targets of issue 18 are
checked in the verdict. Results go to a Markdown table, ``--json`` (read
by ``tools/analysis_tools/comm_cost_model.py --fit``) and ``--plot``
(missing folders under ``work_dirs/`` are created). Meanwhile each
(round, rate) block done is reported on stderr, with an ETA.

The nodes rendezvous inside the emulated network, each node in a network
namespace of its own, so their port clashes with nothing on this host:
``PORT`` (which ``tools/dist_train.sh`` reads) is not needed and not read.
Every argument is checked before a node starts (a bad one is a usage error:
one line, exit code 2).

Examples:
    python tools/analysis_tools/benchmark_step_time.py \\
        --json work_dirs/step_time.json --plot work_dirs/step_time.png
    python tools/analysis_tools/benchmark_step_time.py \\
        configs/fcn/fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py \\
        --bucket-cap-mb 1 --rates 100 300 unshaped
    # 2 nodes x 2 ranks: the flat and the two-level int8 side by side
    python tools/analysis_tools/benchmark_step_time.py \\
        configs/fcn/fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py \\
        --ranks-per-node 2 --hooks allreduce int8_compress:flat \\
        int8_compress:two_level --rates 50 unshaped
"""
import argparse
import os
import os.path as osp
import sys
import tempfile

from mmcv_custom.analysis.cli import (LINK_RATES, cfg_options, check_output,
                                      check_work_dir, link_rate,
                                      positive_float, positive_int,
                                      read_config)
from mmcv_custom.analysis.hook_forms import (FORMS, check_form_configs,
                                             parse_form_name)
from mmcv_custom.analysis.plugins import add_import_option, plugin_parser
from mmcv_custom.analysis.step_time import (hook_configs, log_tails,
                                            node_worker, rate_label,
                                            run_on_cluster)
from mmcv_custom.analysis.step_time_report import report_run
from mmcv_custom.comm.auto import auto_settings
from mmcv_custom.launching.emulated_cluster.node_options import (
    add_node_options, check_node_options)

_DEFAULT_CONFIG = osp.join(
    'configs', 'intern_vit',
    'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')

# -- the command line --------------------------------------------------------


def _parser():
    hooks = list(hook_configs())  # a plugin's too: imported first
    parser = argparse.ArgumentParser(
        description='Step time per comm hook on emulated nodes, side by '
        'side in one run (needs root or an unprivileged user namespace).')
    parser.add_argument(
        'config',
        nargs='?',
        default=_DEFAULT_CONFIG,
        help=f'training config (default: {_DEFAULT_CONFIG})')
    add_node_options(
        parser,
        ranks_per_node_help='ranks on each emulated node, an int >= 1 '
        '(default: 1; torchrun starts them where more than 1)')
    parser.add_argument(
        '--rates',
        type=link_rate,
        nargs='+',
        default=[50.0, 200.0, 1000.0, None],
        help=f"link rates in Mbit/s ({LINK_RATES}), and 'unshaped' "
        '(default: 50 200 1000 unshaped)')
    parser.add_argument(
        '--hooks',
        nargs='+',
        default=hooks,
        type=parse_form_name,
        metavar='HOOK',
        help='hooks to compare, each as NAME (its default form) or '
        f'NAME:FORM, FORM one of {", ".join(FORMS)} (topology=flat or '
        'auto; two_level needs --ranks-per-node >= 2), e.g. '
        'int8_compress:flat int8_compress:two_level (default: all of '
        f'{", ".join(hooks)}; the periodic ones, which synchronise '
        'across nodes every period steps, are not stepped here)')
    parser.add_argument(
        '--bucket-cap-mb',
        type=positive_float,
        default=None,
        help="DDP's bucket_cap_mb (default: a sixth of the "
        'gradients, so at least 4 buckets)')
    parser.add_argument(
        '--steps',
        type=positive_int,
        default=4,
        help='timed steps per (round, rate, hook)')
    parser.add_argument(
        '--rounds',
        type=positive_int,
        default=3,
        help='rounds over every (rate, hook)')
    parser.add_argument(
        '--threads',
        type=positive_int,
        default=None,
        help='torch threads per rank (default: cores / '
        'ranks, at least 1)')
    parser.add_argument(
        '--timeout',
        type=positive_float,
        default=None,
        metavar='SEC',
        help='stop every node and exit 124 after SEC seconds, with the '
        "end of each node's log (where each one was); also the nodes' "
        'collective timeout (default: no limit)')
    parser.add_argument(
        '--comm-only',
        action='store_true',
        help="the hooks' communication alone: the model's parameters' "
        'buckets, without its compute (a plain-sum loss: every bucket '
        'ready at once)')
    parser.add_argument(
        '--calibrate',
        action='store_true',
        help='measure a plain all-reduce at each rate too')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=None,
        metavar='KEY=VALUE',
        help='override config keys, as in tools/train.py')
    parser.add_argument(
        '--work-dir',
        default='work_dirs/step_time',
        help="the nodes' logs go to WORK_DIR/node<i>.log "
        '(default: work_dirs/step_time)')
    parser.add_argument(
        '--auto',
        nargs='*',
        default=None,
        metavar='KEY=VALUE',
        help="also run comm_hook = dict(type='auto', KEY=VALUE...) at each "
        'rate, deciding afresh there, and compare it with the fastest fixed '
        'hook it allows (e.g. --auto max_loss=half)')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument(
        '--plot', help='write a PNG of step time against '
        'link rate here')
    add_import_option(parser, 'its hooks are choices of --hooks (nodes too)')
    parser.add_argument('--node-worker', help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None):
    parser = plugin_parser(_parser, argv)
    args = parser.parse_args(argv)
    if args.node_worker:
        return args
    check_node_options(parser, args)
    if None not in args.rates:
        parser.error("--rates must include 'unshaped': exposed time is the "
                     'step on a shaped link minus the same step unshaped')
    if len(set(args.rates)) != len(args.rates):
        parser.error(f'--rates repeats a rate: {args.rates}')
    for name in ('noop', 'allreduce'):
        if name not in args.hooks:
            args.hooks.insert(0 if name == 'noop' else 1, name)
    args.hooks = list(dict.fromkeys(args.hooks))
    try:
        check_form_configs(args.hooks, args.ranks_per_node)
    except ValueError as e:
        parser.error(f'--hooks {e}')
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot needs matplotlib, which is not installed '
                         '(pip install matplotlib)')
    for option in ('json', 'plot'):
        if getattr(args, option):
            check_output(parser, f'--{option}', getattr(args, option))
    if args.auto is not None:
        try:
            args.auto = auto_settings(args.auto)
        except (TypeError, ValueError) as e:
            parser.error(f'--auto: {e}')
    args.cfg_options = cfg_options(parser, args.cfg_options)
    # Read here, not first on the nodes: a file that is not a config
    # fails in a second, with one line.
    read_config(parser, 'config', args.config, args.cfg_options)
    # The nodes' logs go there: now, not once the nodes are up.
    check_work_dir(parser, '--work-dir', args.work_dir)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.node_worker:
        node_worker(args.node_worker)
        return 0
    from mmcv_custom.launching import emulated_cluster as ec
    reason = ec.check_available()
    if reason is not None:
        print(
            f'benchmark_step_time: cannot emulate nodes here: {reason}',
            file=sys.stderr)
        return 1
    threads = args.threads or max(1, (os.cpu_count() or 1) //
                                  (args.nodes * args.ranks_per_node))
    calibrated = {}
    with tempfile.TemporaryDirectory() as folder, ec.EmulatedCluster(
            args.nodes, ranks_per_node=args.ranks_per_node) as cluster:
        for line in cluster.describe():
            print(line, flush=True)
        if args.calibrate:
            for mbit in args.rates:
                cluster.set_bandwidth(mbit)
                cal = ec.calibrate(cluster)
                calibrated[rate_label(mbit)] = cal.busbw_mbit
                print(cal.describe(), flush=True)
            cluster.set_bandwidth(None)
        spec = dict(
            config=osp.abspath(args.config),
            cfg_options=args.cfg_options,
            hooks=args.hooks,
            rates=args.rates,
            bucket_cap_mb=args.bucket_cap_mb,
            steps=args.steps,
            rounds=args.rounds,
            timeout=args.timeout,
            comm_only=args.comm_only,
            auto=args.auto,
            imports=args.imports,
            threads=threads)
        print(f"Nodes' logs: {args.work_dir}/node<i>.log", flush=True)
        result, results = run_on_cluster(cluster, spec, osp.abspath(__file__),
                                         args.work_dir, folder)
        if result.returncode != 0:
            print(
                f'benchmark_step_time: {result.describe()}' +
                log_tails(result, args.work_dir),
                file=sys.stderr)
            return result.returncode
    meta = dict(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        config=args.config,
        rounds=args.rounds,
        steps=args.steps,
        comm_only=args.comm_only,
        auto=args.auto,
        calibrated=calibrated)
    for line in report_run(results, meta, args.hooks, args.rates, args.json,
                           args.plot):
        print(line)
    return 0


if __name__ == '__main__':
    sys.exit(main())
