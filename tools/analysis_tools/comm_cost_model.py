"""Project each communication hook's step time to a GPU cluster.

A thin command line over :mod:`mmcv_custom.analysis.cost`. Two parts, either
or both:

* ``--fit BENCH.json`` fits the cost model's constants (alpha, eta and an
  overhead per hook, a share of the compute step) to a benchmark measured
  on emulated nodes, on the rates of ``--fit-rates`` (default: all), and
  prints the validation table: predicted against measured step time on
  the rates (and world sizes) it did not fit on.
* ``--config CONFIG`` (default: InternViT-6B's UperNet) builds the model
  on the meta device, lays its gradients out in DDP's buckets (or, for a
  config that trains with FSDP2Strategy, in its units, each gathered and
  reduced as FSDP2 does, sharded over every rank and, on several nodes of
  several GPUs, hybrid: inside the node, each shard all-reduced across
  nodes in the hook's format) and prints,
  per hook and link rate, the predicted step time on ``--nodes`` x
  ``--gpus-per-node`` GPUs, each hook with a two-level (node-aware) form
  in both forms; ``--recommend`` adds one line per rate naming the hook
  and form to use, with the ``comm_hook`` line that sets them: the
  fastest hook of the accuracy classes ``--max-loss`` allows, where it
  gains at least ``--min-gain`` over the less lossy pick (else that one,
  and why), with the evidence behind it (and, under FSDP2, the strategy
  line where the pick shards otherwise than the config); of forms of one
  class as fast within 1% (the model's resolution), the one that keeps
  the least memory per GPU (e.g. int8's error feedback in bf16 under
  hybrid sharding). ``--gpu`` picks
  the hardware figures (A100, H100, H200; each overridable), printed with
  the result. Link
  constants come from ``--fit`` when given, else from defaults for NCCL
  on a GPU cluster (alpha 10 us, eta 0.9); the intra-node rate and
  latency of the two-level forms from ``--intra-gbps`` and
  ``--intra-alpha-us``; the codec (each hook's local work) from GPU
  memory bandwidth and FLOP/s unless ``--codec fitted``; all printed.

A plugin's hooks are choices of ``--hooks`` too: the config's
``custom_imports`` and each ``--import MODULE`` are imported before the
choices are built. One whose record states a cost is projected as a
built-in hook is; one without (no record, or none with a ``cost``) is
named as unknown, with how to give it one. The periodic hooks
(``post_local_sgd``, ``diloco``: the gradients exchanged inside the node
every step, the model across nodes every period steps) are projected at
each of ``--periods`` and, for ``diloco``, each of ``--outer-formats``,
``--fragments`` and ``--overlap`` (streaming), in a table of their own:
the average step and the step that synchronises; ``--recommend`` weighs
them only where ``--max-loss`` admits their class, ``periodic``.

Arguments are checked before any work starts: a bad value is a usage error
(exit code 2) naming it and the valid ones.

Examples:
    python tools/analysis_tools/comm_cost_model.py --nodes 8 \\
        --gpus-per-node 8 --gbps 100 200 400 --recommend
    python tools/analysis_tools/comm_cost_model.py \\
        --fit work_dirs/step_time.json --fit-rates 50 1000 \\
        --json work_dirs/fit.json
    python tools/analysis_tools/comm_cost_model.py \\
        --fit work_dirs/step_time.json --config CONFIG --gbps 100 \\
        --recommend  # fitted alpha and eta
"""
import argparse
import dataclasses
import json
import os.path as osp
import sys

from mmcv_custom.analysis import cost, filter_tool_warnings
from mmcv_custom.analysis.cli import cfg_options, check_output, read_config
from mmcv_custom.analysis.cost.options import (add_projection_options,
                                               add_streaming_options,
                                               check_projection_options)
from mmcv_custom.analysis.plugins import add_import_option, plugin_parser
from mmcv_custom.analysis.registered import registered_hooks
from mmcv_custom.hooks.local_sgd import OUTER_FORMATS
from mmcv_custom.integrity.files import atomic_write_bytes

__all__ = ['parse_args', 'main']

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIG = osp.join('configs', 'intern_vit',
                  'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py')


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='\n'.join(__doc__.splitlines()[2:]))
    fit = parser.add_argument_group('fit to a benchmark')
    fit.add_argument(
        '--fit',
        nargs='+',
        metavar='BENCH.json',
        help='benchmark JSON files (version 1) to fit the constants to')
    fit.add_argument(
        '--fit-rates',
        nargs='+',
        type=float,
        metavar='MBIT',
        help='link rates (Mbit/s, as in the benchmark) to fit on; the '
        'others validate (default: all)')
    fit.add_argument(
        '--fit-world-sizes',
        nargs='+',
        type=int,
        metavar='N',
        help='world sizes to fit on, with several benchmarks (default: all)')
    fit.add_argument(
        '--no-overhead',
        action='store_true',
        help='fit no per-step overhead per hook')
    fit.add_argument(
        '--check-collectives',
        action='store_true',
        help='build each benchmark\'s config on the meta device and compare '
        'what the hook catalogue predicts with the collectives measured '
        '(hook settings: --block-size, --powersgd-rank)')
    proj = parser.add_argument_group('project to a cluster')
    proj.add_argument(
        '--config',
        help=f'training config (default {CONFIG}; given, or without --fit, '
        'the projection runs)')
    proj.add_argument(
        '--cfg-options',
        nargs='+',
        metavar='KEY=VALUE',
        help='override config keys, as in tools/train.py (xxx=yyy, values '
        'parsed as Python literals)')
    proj.add_argument(
        '--gbps',
        nargs='+',
        type=float,
        default=[100.0, 200.0, 400.0],
        metavar='GBIT',
        help='node link rates, Gbit/s per direction')
    add_projection_options(proj)
    proj.add_argument(
        '--codec',
        choices=('gpu', 'fitted'),
        default='gpu',
        help='local cost of each hook: assumed for a GPU (default) or as '
        'the benchmark measured it')
    proj.add_argument(
        '--recompute',
        choices=('yes', 'no'),
        help='activation checkpointing (default: the config\'s '
        'backbone.with_cp)')
    # Every registered hook, a plugin's too (imported first): one whose
    # record states no cost is named as unknown, not refused.
    names = tuple(h.name for h in registered_hooks())
    proj.add_argument(
        '--hooks',
        nargs='+',
        choices=names,
        metavar='HOOK',
        help=f'hooks to project (default: all: {", ".join(names)})')
    proj.add_argument(
        '--periods',
        nargs='+',
        type=int,
        metavar='N',
        help='optimizer steps between synchronisations across nodes that '
        'the periodic hooks (post_local_sgd, diloco) are projected at, '
        'each a row (default: 25 100 500)')
    proj.add_argument(
        '--outer-formats',
        nargs='+',
        choices=OUTER_FORMATS,
        metavar='FORMAT',
        help='what diloco\'s pseudo-gradient crosses the nodes as, each a '
        f'row at each period: {", ".join(OUTER_FORMATS)} (default: int8, '
        'its default)')
    add_streaming_options(proj)
    # The settings each periodic hook's cost takes, for their checks.
    parser.set_defaults(
        periodic_settings={
            h.name: tuple(h.record.cost.settings)
            for h in registered_hooks() if h.record.periodic and h.record.cost
        })
    add_import_option(
        proj, 'the hooks it registers are choices of --hooks (projected '
        'where their record states a cost, else named as unknown)')
    proj.add_argument(
        '--recommend',
        action='store_true',
        help='print which hook to use at each rate')
    parser.add_argument(
        '--json', metavar='OUT', help='also write the results as JSON')
    return parser


def _check_fit(parser, args) -> None:
    """Read the benchmarks; check the rates and world sizes to fit on."""
    args.benchmarks, args.bench_configs = [], []
    if not args.fit:
        for flag, given in (('--fit-rates', args.fit_rates is not None),
                            ('--fit-world-sizes', args.fit_world_sizes
                             is not None), ('--no-overhead', args.no_overhead),
                            ('--check-collectives', args.check_collectives)):
            if given:
                parser.error(f'{flag} needs --fit (a benchmark JSON to fit)')
        if args.codec == 'fitted':
            parser.error('--codec fitted needs --fit (the benchmark '
                         "measures the codec); valid without it: 'gpu'")
        return
    for path in args.fit:
        if not osp.isfile(path):
            parser.error(f'--fit {path}: no such file')
        try:
            args.benchmarks.append(cost.load_benchmark(path))
        except (OSError, ValueError) as e:
            parser.error(f'--fit {path}: {e}'.replace(f'{path}: {path}:',
                                                      f'{path}:'))
    problem = cost.fit_selection_problem(args.benchmarks, args.fit_rates,
                                         args.fit_world_sizes,
                                         ', '.join(args.fit))
    if problem:
        parser.error(problem)
    for bench in args.benchmarks if args.check_collectives else ():
        config = _find(bench.config or '')
        if config is None:
            parser.error(f'--check-collectives: the config of {bench.source}'
                         f' ({bench.config!r}) is not a file here or under '
                         f'{ROOT}')
        args.bench_configs.append(config)


def _find(path: str):
    """``path`` as given, else under the repository; None if neither."""
    for candidate in (path, osp.join(ROOT, path)):
        if path and osp.isfile(candidate):
            return candidate
    return None


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: a usage error (exit code 2) names any
    bad value and the valid ones. Sets ``benchmarks`` (the read
    ``--fit`` files), ``project`` and ``cfg_options`` (a dict)."""
    parser = plugin_parser(_parser, argv, '--config')
    args = parser.parse_args(argv)
    check_projection_options(parser, args)
    _check_fit(parser, args)
    args.project = args.config is not None or not args.fit
    if args.project:
        config = CONFIG if args.config is None else args.config
        args.config = _find(CONFIG) if args.config is None else config
        if args.config is None or not osp.isfile(args.config):
            parser.error(f'--config {config}: no such file')
    elif args.recommend or args.cfg_options:
        parser.error('--recommend and --cfg-options need a projection: '
                     'give --config')
    args.cfg_options = cfg_options(parser, args.cfg_options)
    if args.project:
        # A file that is not a config fails here, in one line.
        read_config(parser, '--config', args.config, args.cfg_options)
    if args.json:
        check_output(parser, '--json', args.json)
    return args


def _project(args, constants, codec) -> tuple:
    """The projection's lines and JSON, or a one-line error."""
    fields = {f.name for f in dataclasses.fields(cost.ProjectionSettings)}
    settings = cost.ProjectionSettings(**{
        k: v
        for k, v in vars(args).items() if k in fields
    })
    try:
        return cost.project(settings, constants, codec)
    except ValueError as e:
        sys.exit(f'{osp.basename(__file__)}: error: {e}')


def main(argv=None) -> None:
    filter_tool_warnings()
    args = parse_args(argv)
    out, lines = {}, []
    constants = cost.GPU_CLUSTER_CONSTANTS
    codec: cost.CodecCost = cost.GpuCodec(args.hbm_tbps * 1e12,
                                          args.matmul_tflops * 1e12)
    if args.benchmarks:
        result = cost.fit(
            args.benchmarks,
            args.fit_rates,
            args.fit_world_sizes,
            overhead=not args.no_overhead)
        lines += cost.fit_report(result, args.benchmarks)
        if args.check_collectives:
            hooks = cost.hook_costs(args.block_size, args.powersgd_rank,
                                    args.min_compression_rate)
            lines += ['', '### Collectives: catalogue against measured', '']
            for bench, config in zip(args.benchmarks, args.bench_configs):
                lines += cost.check_benchmark(bench,
                                              cost.config_params(config)[0],
                                              hooks)
        out['fit'] = cost.fit_json(result)
        # The fitted overheads are the benchmark machine's: not carried.
        constants = cost.LinkConstants(
            result.constants.alpha_s,
            result.constants.eta,
            source=result.constants.source)
        if args.codec == 'fitted':
            codec = result.codec
    if args.alpha_us is not None or args.eta is not None:
        alpha = (
            constants.alpha_s if args.alpha_us is None else args.alpha_us *
            1e-6)
        eta = constants.eta if args.eta is None else args.eta
        constants = cost.LinkConstants(alpha, eta, source='given')
    # Never fitted (the emulated nodes have no intra-node link): as given.
    constants = dataclasses.replace(
        constants, intra_alpha_s=args.intra_alpha_us * 1e-6)
    if args.project:
        projected, out['projection'] = _project(args, constants, codec)
        lines += ([''] if lines else []) + projected
    print('\n'.join(lines))
    if args.json:
        # Through a temporary name and a rename: no half-written file.
        atomic_write_bytes(
            args.json, json.dumps(out, indent=1).encode(), digest=False)


if __name__ == '__main__':
    main()
