"""Project each communication hook's step time to a GPU cluster.

A thin command line over :mod:`mmcv_custom.comm_cost`. Two parts, either
or both:

* ``--fit BENCH.json`` fits the cost model's constants (alpha, eta and an
  overhead per hook, a share of the compute step) to a benchmark measured
  on emulated nodes, on the rates of ``--fit-rates`` (default: all), and
  prints the validation table: predicted against measured step time on
  the rates (and world sizes) it did not fit on.
* ``--config CONFIG`` (default: InternViT-6B's UperNet) builds the model
  on the meta device, lays its gradients out in DDP's buckets and prints,
  per hook and link rate, the predicted step time on ``--nodes`` x
  ``--gpus-per-node`` GPUs; ``--recommend`` adds one line per rate naming
  the hook to use. Link constants come from ``--fit`` when given, else
  from defaults for NCCL on a GPU cluster (alpha 10 us, eta 0.9); the
  codec (each hook's local work) is assumed from GPU memory bandwidth and
  FLOP/s unless ``--codec fitted``. The assumptions are printed with the
  table.

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
import math
import os
import os.path as osp
import sys

from mmcv_custom import comm_cost as cc
from mmcv_custom.analysis import filter_tool_warnings
from mmcv_custom.analysis.cli import cfg_options, check_output, read_config

__all__ = ['parse_args', 'main']

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIG = osp.join('configs', 'intern_vit',
                  'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py')
GB = 1e9


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
        help='benchmark JSON files (version 1) to fit the '
        'constants to')
    fit.add_argument(
        '--fit-rates',
        nargs='+',
        type=float,
        metavar='MBIT',
        help='link rates (Mbit/s, as in the benchmark) to fit '
        'on; the others validate (default: all)')
    fit.add_argument(
        '--fit-world-sizes',
        nargs='+',
        type=int,
        metavar='N',
        help='world sizes to fit on, with several '
        'benchmarks (default: all)')
    fit.add_argument(
        '--no-overhead',
        action='store_true',
        help='fit no per-step overhead per hook')
    fit.add_argument(
        '--check-collectives',
        action='store_true',
        help='build each benchmark\'s config on the meta '
        'device and compare what the hook catalogue predicts '
        'with the collectives measured (hook settings: '
        '--block-size, --powersgd-rank)')
    proj = parser.add_argument_group('project to a cluster')
    proj.add_argument(
        '--config',
        help=f'training config (default {CONFIG}'
        '; given, or without --fit, the projection runs)')
    proj.add_argument(
        '--cfg-options',
        nargs='+',
        metavar='KEY=VALUE',
        help='override config keys, as in tools/train.py '
        '(xxx=yyy, values parsed as Python literals)')
    proj.add_argument('--nodes', type=int, default=8, help='nodes (M)')
    proj.add_argument(
        '--gpus-per-node', type=int, default=8, help='GPUs per node (G)')
    proj.add_argument(
        '--gbps',
        nargs='+',
        type=float,
        default=[100.0, 200.0, 400.0],
        metavar='GBIT',
        help='node link rates, Gbit/s per direction')
    proj.add_argument(
        '--intra-gbps',
        type=float,
        default=3600.0,
        help='intra-node rate per GPU per direction, Gbit/s '
        '(default 3600: NVLink 4, 450 GB/s)')
    proj.add_argument(
        '--alpha-us',
        type=float,
        help='latency per message, us (default: fitted, else '
        '10)')
    proj.add_argument(
        '--eta',
        type=float,
        help='achieved fraction of the link rate (default: '
        'fitted, else 0.9)')
    proj.add_argument(
        '--codec',
        choices=('gpu', 'fitted'),
        default='gpu',
        help='local cost of each hook: assumed for a GPU '
        '(default) or as the benchmark measured it')
    proj.add_argument(
        '--hbm-tbps',
        type=float,
        default=3.0,
        help='effective HBM bandwidth, TB/s (default 3.0)')
    proj.add_argument(
        '--matmul-tflops',
        type=float,
        default=50.0,
        help='PowerSGD low-rank products, TFLOP/s (default '
        '50)')
    proj.add_argument(
        '--backward-s',
        type=float,
        help='backward time, s (default: from FLOPs)')
    proj.add_argument(
        '--compute-step-s',
        type=float,
        help='step time without communication, s (default: '
        'from FLOPs)')
    proj.add_argument(
        '--tokens-per-gpu',
        type=float,
        help='tokens per GPU and step (default: from the '
        'config, batch x (img_size / patch_size)^2)')
    proj.add_argument(
        '--tflops',
        type=float,
        default=400.0,
        help='achieved model FLOP/s per GPU, TFLOP/s '
        '(default 400)')
    proj.add_argument(
        '--recompute',
        choices=('yes', 'no'),
        help='activation checkpointing (default: the '
        'config\'s backbone.with_cp)')
    proj.add_argument(
        '--block-size',
        type=int,
        default=256,
        help='int8_compress block size (default 256)')
    proj.add_argument(
        '--powersgd-rank',
        type=int,
        default=1,
        help='PowerSGD matrix_approximation_rank (default 1)')
    proj.add_argument(
        '--min-compression-rate',
        type=float,
        default=2.0,
        help='PowerSGD min_compression_rate (default 2)')
    proj.add_argument(
        '--bucket-cap-mb',
        type=float,
        help='DDP bucket_cap_mb (default: the config\'s '
        'model_wrapper_cfg, else DDP\'s 25)')
    proj.add_argument(
        '--hooks',
        nargs='+',
        choices=tuple(cc.HOOK_COSTS),
        metavar='HOOK',
        help='hooks to project (default: '
        f'all: {", ".join(cc.HOOK_COSTS)})')
    proj.add_argument(
        '--recommend',
        action='store_true',
        help='print which hook to use at each rate')
    parser.add_argument(
        '--json', metavar='OUT', help='also write the results as JSON')
    return parser


def _check_ranges(parser, args) -> None:
    """Every number in its range, or a usage error naming it."""
    ints = (('--nodes', args.nodes), ('--gpus-per-node', args.gpus_per_node),
            ('--block-size', args.block_size), ('--powersgd-rank',
                                                args.powersgd_rank))
    for option, value in ints:
        if value < 1:
            parser.error(f'{option} should be an int >= 1, but got {value}')
    positive = [('--gbps', v) for v in args.gbps
                ] + [('--intra-gbps', args.intra_gbps),
                     ('--hbm-tbps', args.hbm_tbps),
                     ('--matmul-tflops', args.matmul_tflops),
                     ('--tflops', args.tflops),
                     ('--min-compression-rate', args.min_compression_rate),
                     ('--eta', args.eta),
                     ('--tokens-per-gpu', args.tokens_per_gpu),
                     ('--bucket-cap-mb', args.bucket_cap_mb)]
    for option, value in positive:
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f'{option} should be a number > 0, but got {value}')
    for option, value in (('--alpha-us', args.alpha_us), ('--backward-s',
                                                          args.backward_s),
                          ('--compute-step-s', args.compute_step_s)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            parser.error(f'{option} should be a number >= 0, but got '
                         f'{value}')
    if args.eta is not None and args.eta > 1:
        parser.error(f'--eta should be a fraction of the link rate, in '
                     f'(0, 1], but got {args.eta}: no link carries more than '
                     'its rate')
    if (args.backward_s is not None and args.compute_step_s is not None
            and args.compute_step_s < args.backward_s):
        parser.error(f'--compute-step-s {args.compute_step_s} should be at '
                     f'least --backward-s {args.backward_s}: the step '
                     'contains the backward')


def _check_fit(parser, args) -> None:
    """Read the benchmarks; check the rates and world sizes to fit on."""
    args.benchmarks, args.bench_configs = [], []
    if not args.fit:
        for option in ('fit_rates', 'fit_world_sizes'):
            if getattr(args, option) is not None:
                parser.error(f'--{option.replace("_", "-")} needs --fit '
                             '(a benchmark JSON to fit)')
        for flag in ('--no-overhead', '--check-collectives'):
            if getattr(args, flag[2:].replace('-', '_')):
                parser.error(f'{flag} needs --fit (a benchmark JSON to '
                             'fit)')
        if args.codec == 'fitted':
            parser.error('--codec fitted needs --fit (the benchmark '
                         "measures the codec); valid without it: 'gpu'")
        return
    for path in args.fit:
        if not osp.isfile(path):
            parser.error(f'--fit {path}: no such file')
        try:
            args.benchmarks.append(cc.load_benchmark(path))
        except (OSError, ValueError) as e:
            parser.error(f'--fit {path}: {e}'.replace(f'{path}: {path}:',
                                                      f'{path}:'))
    rates = sorted({r for b in args.benchmarks for r in b.measured_rates})
    for rate in args.fit_rates or ():
        if rate not in rates:
            parser.error(
                f'--fit-rates {rate:g} is not a shaped rate of '
                f'{", ".join(args.fit)}; measured: '
                f'{", ".join(f"{r:g}" for r in rates) or "none"} (Mbit/s)')
    for bench in args.benchmarks if args.check_collectives else ():
        config = _find(bench.config or '')
        if config is None:
            parser.error(f'--check-collectives: the config of {bench.source}'
                         f' ({bench.config!r}) is not a file here or under '
                         f'{ROOT}')
        args.bench_configs.append(config)
    sizes = sorted({b.world_size for b in args.benchmarks})
    for size in args.fit_world_sizes or ():
        if size not in sizes:
            parser.error(f'--fit-world-sizes {size} is not a world size of '
                         f'{", ".join(args.fit)}; measured: '
                         f'{", ".join(map(str, sizes))}')
    if not any(
            _fittable(b, r, args) for b in args.benchmarks for r in b.rates):
        parser.error(f'--fit {" ".join(args.fit)}: nothing to fit on: no '
                     'hook that lists its collectives was measured at a '
                     'shaped rate (mbit not null)' +
                     (' of the chosen --fit-rates and --fit-world-sizes'
                      if args.fit_rates or args.fit_world_sizes else ''))


def _fittable(bench: cc.Benchmark, rate: dict, args) -> bool:
    """Whether ``cc.fit`` would fit on a hook of this rate."""
    return (rate['mbit'] is not None and any(h in bench.hooks
                                             for h in rate['median_step_s'])
            and (args.fit_rates is None or rate['mbit'] in args.fit_rates)
            and (args.fit_world_sizes is None
                 or bench.world_size in args.fit_world_sizes))


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
    parser = _parser()
    args = parser.parse_args(argv)
    _check_ranges(parser, args)
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


# -- the fit --------------------------------------------------------------
def _pct(x: float) -> str:
    return f'{100 * x:+.1f}%'


def _fit_report(result: cc.FitResult, args) -> list:
    c = result.constants
    lines = ['## Fit of the cost model', '']
    for b in args.benchmarks:
        lines.append(f'- {b.source}: {b.nodes} nodes x {b.ranks_per_node} '
                     f'rank(s), {b.grad_bytes / 2**20:.2f} MiB of gradients '
                     f'in {len(b.bucket_bytes)} buckets, backward '
                     f'{b.backward_s * 1e3:.1f} ms, step '
                     f'{b.compute_step_s * 1e3:.1f} ms unshaped')
        for r in b.rates:
            if r['mbit'] and r.get('calibrated_mbit'):
                lines.append(
                    f'  - {r["mbit"]:g} Mbit/s: plain all_reduce achieved '
                    f'{r["calibrated_mbit"]:g} Mbit/s '
                    f'({r["calibrated_mbit"] / r["mbit"]:.2f} of the rate)')
    lines += [
        '', f'alpha = {c.alpha_s * 1e6:.1f} us per message, eta = '
        f'{c.eta:.3f} of the link rate'
    ]
    if c.overhead_share:
        lines.append('overhead per step, as a share of the compute step: ' +
                     ', '.join(f'{h} {100 * s:.1f}%'
                               for h, s in c.overhead_share.items()))
    fitted = [p for p in result.points if p.fitted]
    check = [p for p in result.points if not p.fitted]
    rms = math.sqrt(sum(p.rel_error**2 for p in fitted) / len(fitted))
    worst = result.worst(fitted=True)
    lines.append(f'fitted on {len(fitted)} points (rates '
                 f'{_rates(fitted)} Mbit/s): RMS error {100 * rms:.1f}%, '
                 f'worst {_pct(worst.rel_error)} ({worst.hook} at '
                 f'{worst.mbit:g} Mbit/s, world size {worst.world_size})')
    for note in result.skipped:
        lines.append(f'skipped: {note}')
    lines += [
        '', '> - each point is predicted from the benchmark\'s own buckets, '
        'ready times, collectives and codec time (measured without '
        'network, added to each bucket\'s communication)',
        '> - the emulated links have no propagation delay: alpha is the '
        'software latency of this machine\'s backend, not a long-haul '
        'link\'s',
        '> - the fitted overheads belong to the benchmark machine (CPU '
        'ranks sharing one host) and are not carried to projections'
    ]
    lines += ['', '### Validation (points not fitted on)', '']
    if not check:
        lines.append('none: every measured point was fitted on (choose '
                     '--fit-rates to keep some for validation)')
        return lines
    lines += [
        '| world size | hook | Mbit/s | measured s | predicted s | '
        'error |', '|--:|---|--:|--:|--:|--:|'
    ]
    for p in check:
        lines.append(f'| {p.world_size} | {p.hook} | {p.mbit:g} | '
                     f'{p.measured_s:.4f} | {p.predicted_s:.4f} | '
                     f'{_pct(p.rel_error)} |')
    worst = result.worst()
    lines += [
        '', f'worst validation error: {_pct(worst.rel_error)} '
        f'({worst.hook} at {worst.mbit:g} Mbit/s, world size '
        f'{worst.world_size})'
    ]
    return lines


def _rates(points) -> str:
    return ', '.join(f'{r:g}' for r in sorted({p.mbit for p in points}))


def _fit_json(result: cc.FitResult) -> dict:
    c = result.constants
    return dict(
        alpha_s=c.alpha_s,
        eta=c.eta,
        overhead_share=dict(c.overhead_share),
        codec_s_per_byte=dict(result.codec.per_byte),
        source=c.source,
        skipped=list(result.skipped),
        points=[
            dict(dataclasses.asdict(p), rel_error=p.rel_error)
            for p in result.points
        ])


# -- the projection -----------------------------------------------------------
def _load_model(config: str, cfg_options=None):
    """The config's trainable parameters as :class:`ParamSpec`, the total
    parameter count and the facts the estimates read from the config."""
    import torch
    from mmengine.registry import DefaultScope, init_default_scope
    from mmengine.utils import import_modules_from_strings

    from mmcv_custom.launcher import load_config
    cfg = load_config(config, cfg_options)
    scope = cfg.get('default_scope', 'mmseg')
    with DefaultScope.overwrite_default_scope(scope):
        if cfg.get('custom_imports'):
            import_modules_from_strings(**cfg.custom_imports)
        init_default_scope(scope)
        from mmseg.registry import MODELS
        with torch.device('meta'):
            model = MODELS.build(cfg.model)
    params = [
        cc.ParamSpec(tuple(p.shape),
                     str(p.dtype).replace('torch.', ''), name)
        for name, p in model.named_parameters() if p.requires_grad
    ]
    total = sum(p.numel() for p in model.parameters())
    backbone = cfg.model.get('backbone') or {}
    facts = dict(
        with_cp=backbone.get('with_cp'),
        bucket_cap_mb=(cfg.get('model_wrapper_cfg')
                       or {}).get('bucket_cap_mb'))
    size, patch = backbone.get('img_size'), backbone.get('patch_size')
    batch = (cfg.get('train_dataloader') or {}).get('batch_size')
    if isinstance(size, int) and isinstance(patch, int) and batch:
        facts['tokens'] = batch * (size // patch)**2
        facts['tokens_how'] = (f'{batch} x ({size} / {patch})^2 from the '
                               'config')
    return params, total, facts


def _size(nbytes: float) -> str:
    if nbytes >= GB / 10:
        return f'{nbytes / GB:.2f} GB'
    return f'{nbytes / 1e6:.2f} MB'


def _project(args, constants: cc.LinkConstants, codec: cc.CodecCost):
    params, total, facts = _load_model(args.config, args.cfg_options)
    if not params:
        sys.exit(f'{osp.basename(__file__)}: error: {args.config} has no '
                 'trainable parameter: nothing is communicated')
    recompute = (
        args.recompute == 'yes'
        if args.recompute is not None else bool(facts['with_cp']))
    tokens = args.tokens_per_gpu or facts.get('tokens')
    workload = cc.Workload(
        tokens_per_gpu=tokens or cc.Workload().tokens_per_gpu,
        achieved_flops=args.tflops * 1e12,
        recompute=recompute)
    cap = (
        args.bucket_cap_mb
        if args.bucket_cap_mb is not None else facts['bucket_cap_mb'])
    hooks = cc.hook_costs(args.block_size, args.powersgd_rank,
                          args.min_compression_rate)
    if args.hooks:
        hooks = {n: h for n, h in hooks.items() if n in args.hooks}
    recs = [
        cc.recommend(
            params,
            cc.Cluster(args.nodes, args.gpus_per_node, gbps * 1e9,
                       args.intra_gbps * 1e9),
            backward_s=args.backward_s,
            compute_step_s=args.compute_step_s,
            constants=constants,
            codec=codec,
            hooks=hooks,
            workload=workload,
            total_params=total,
            bucket_cap_mb=cap) for gbps in args.gbps
    ]
    buckets = cc.ddp_buckets(params, cap)
    first = recs[0].predictions[next(iter(hooks))]
    backward = (
        args.backward_s if args.backward_s is not None else
        cc.estimate_compute(params, workload, total, args.hbm_tbps * 1e12)[0])
    how = ('given' if args.backward_s is not None else
           f'estimated: {4 + 2 * recompute} x {total:.3g} parameters x '
           f'{workload.tokens_per_gpu:g} tokens per GPU / '
           f'{args.tflops:g} TFLOP/s' +
           (', recomputing the forward' if recompute else ''))
    token_how = ('given' if args.tokens_per_gpu else facts.get(
        'tokens_how', 'default (InternViT-6B at 504 px, 2 per GPU)'))
    dtypes = {}
    for p in params:
        dtypes[p.dtype] = dtypes.get(p.dtype, 0) + p.numel
    lines = [
        f'## Projected step time per hook: {osp.basename(args.config)}',
        '',
        f'- cluster: {args.nodes} nodes x {args.gpus_per_node} GPUs '
        f'({args.nodes * args.gpus_per_node} ranks)',
        f'- model: {sum(dtypes.values()):,} trainable parameters (' +
        ', '.join(f'{n:,} {d}' for d, n in dtypes.items()) +
        f'), {_size(sum(p.nbytes for p in params))} of gradients per step '
        f'in {len(buckets)} DDP buckets (bucket_cap_mb '
        f'{cap if cap is not None else "25, first 1"})',
        f'- compute: backward {backward:.3f} s ({how}); step without '
        f'communication {first.compute_step_s:.3f} s' +
        ('' if args.compute_step_s is not None else
         ' (forward 2 N T, AdamW 7 passes over HBM)'),
        f'- tokens per GPU: {workload.tokens_per_gpu:g} ({token_how})',
        '',
    ]
    lines += _step_table(args, recs)
    lines += [''] + _detail_table(args, recs)
    if args.recommend:
        lines += ['', '### Recommendation', '']
        lines += [f'- {r.line()}' for r in recs]
    lines += ['', '### Assumptions', '']
    lines += [
        f'> - {a}' for a in cc.assumptions(constants, codec, recs[0].cluster)
    ]
    lines += [
        '> - compute from FLOPs (4 N T for the backward, 6 with activation '
        'checkpointing) counts the ViT\'s matmuls only, not the heads\' '
        'convolutions, unless --backward-s/--compute-step-s are given',
        '> - accuracy is not modelled: int8 and PowerSGD are lossy and keep '
        'error-feedback state; fp16/bf16 are nearly lossless'
    ]
    out = dict(
        config=args.config,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        constants=dict(
            alpha_s=constants.alpha_s,
            eta=constants.eta,
            source=constants.source),
        codec=codec.describe(),
        backward_s=backward,
        rates={
            f'{g:g}':
            dict(
                best=r.best,
                best_lossless=r.best_lossless,
                hooks={
                    n: dataclasses.asdict(p)
                    for n, p in r.predictions.items()
                })
            for g, r in zip(args.gbps, recs)
        })
    return lines, out


def _step_table(args, recs) -> list:
    first = recs[0].predictions
    lines = [
        '| hook | sent per step | per node link | ' +
        ' | '.join(f'{g:g} Gbit/s' for g in args.gbps) + ' |',
        '|---|--:|--:|' + '--:|' * len(recs)
    ]
    for name, p in first.items():
        cells = []
        for r in recs:
            q, speedup = r.predictions[name], r.speedup(name)
            cells.append(f'{q.step_s:.3f} s' +
                         (f' ({speedup:.2f}x)' if speedup is not None else ''))
        lines.append(f'| {p.label} | {_size(p.sent_bytes)} | '
                     f'{_size(p.node_bytes)} | ' + ' | '.join(cells) + ' |')
    lines += [
        '', 'step = compute + exposed communication; (x) speed-up '
        'against allreduce; sent: the tensors one rank reduces; per '
        'node link: bytes through it each way'
    ]
    return lines


def _detail_table(args, recs) -> list:
    lines = [
        '| hook | Gbit/s | step s | exposed s | wire s | '
        'overlap bound s | codec s | collectives |',
        '|---|--:|--:|--:|--:|--:|--:|--:|'
    ]
    for name in recs[0].predictions:
        for g, r in zip(args.gbps, recs):
            p = r.predictions[name]
            lines.append(f'| {p.label} | {g:g} | {p.step_s:.3f} | '
                         f'{p.exposed_s:.3f} | {p.wire_s:.3f} | '
                         f'{p.overlap_bound_s:.3f} | {p.codec_s:.4f} | '
                         f'{p.collectives} |')
    lines += [
        '', 'wire: bytes over the link rate, no latency; overlap '
        'bound: exposed time with no latency, eta 1 and no codec (the '
        'physical bound for this bucket order)'
    ]
    return lines


def _write_json(path: str, data: dict) -> None:
    """Through a temporary name and a rename: no half-written file."""
    partial = path + '.partial'
    with open(partial, 'w') as f:
        json.dump(data, f, indent=1)
    os.replace(partial, path)


def main(argv=None) -> None:
    filter_tool_warnings()
    args = parse_args(argv)
    out, lines = {}, []
    constants = cc.GPU_CLUSTER_CONSTANTS
    codec: cc.CodecCost = cc.GpuCodec(args.hbm_tbps * 1e12,
                                      args.matmul_tflops * 1e12)
    if args.benchmarks:
        result = cc.fit(
            args.benchmarks,
            args.fit_rates,
            args.fit_world_sizes,
            overhead=not args.no_overhead)
        lines += _fit_report(result, args)
        if args.check_collectives:
            hooks = cc.hook_costs(args.block_size, args.powersgd_rank,
                                  args.min_compression_rate)
            lines += ['', '### Collectives: catalogue against measured', '']
            for bench, config in zip(args.benchmarks, args.bench_configs):
                lines += cc.check_benchmark(bench,
                                            _load_model(config)[0], hooks)
        out['fit'] = _fit_json(result)
        # The fitted overheads are the benchmark machine's: not carried.
        constants = cc.LinkConstants(
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
        constants = cc.LinkConstants(alpha, eta, source='given')
    if args.project:
        projected, out['projection'] = _project(args, constants, codec)
        lines += ([''] if lines else []) + projected
    print('\n'.join(lines))
    if args.json:
        _write_json(args.json, out)


if __name__ == '__main__':
    main()
