"""Print a config's parameter count, trainable count and gradient traffic.

The model is built on the meta device, so InternViT-6B needs no memory:

    python tools/analysis_tools/model_stats.py \\
        configs/intern_vit/upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py

Prints the gradient bytes each rank all-reduces per optimizer step and what
the configured ``comm_hook`` sends instead (counted on the first of
``--gpus`` ranks, which the line names), the memory per GPU under DDP
(with DDP's buckets and what the hook keeps from step to step: int8's fp32
residual, PowerSGD's error and factors),
and under FSDP2 (``FSDP2Strategy``, for ``--gpus N [N ...]``) the fullest
rank's shards plus the units gathered at once, for the parameters' dtypes
as the config builds them (the 6B recipes' backbone in bf16, their heads in
fp32) and for all-fp32 parameters. For an FSDP2 config that may shard
hybrid (``strategy.sharding='hybrid'``, or ``'auto'``), the memory per GPU
under hybrid sharding with the hook's state of the rank's shard (int8's
residual with error feedback), on nodes of the config's ``ranks_per_node``
or, where it states none, on nodes of each ``--gpus N``. The counting, and
what each number includes, is :mod:`mmcv_custom.analysis.model_stats`'s.

For ``post_local_sgd`` and ``diloco``, which synchronise the model
across nodes every ``period`` steps, the hook's line is what a rank sends
across the nodes per step, averaged over the period, on nodes of one rank
each (the inner exchange inside the node comes on top, every step), and
its state DiLoCo's fp32 global parameters and outer momentum (and int8's
residual) with the inner hook's.

A plugin's hook is counted too: the config's ``custom_imports`` and each
``--import MODULE`` are imported first; of one registered without a
record, the bytes and the state are said to be unknown.
"""
import argparse
import os.path as osp
import sys

from mmengine.registry import DefaultScope

from mmcv_custom.analysis import (cfg_options, filter_tool_warnings,
                                  read_config, stats)
from mmcv_custom.analysis.model_stats import check_stats_hook
from mmcv_custom.analysis.plugins import add_import_option, plugin_parser
from mmcv_custom.analysis.registered import HOW_TO_RECORD

GiB = 2**30


def _size(num_bytes: int) -> str:
    """GiB with three decimals, or MiB for what would read 0.000 GiB."""
    if num_bytes >= GiB / 100:
        return f'{num_bytes / GiB:.3f} GiB'
    return f'{num_bytes / 2**20:.3f} MiB'


def _error(message: str) -> None:
    """Exit with one line, as argparse does, instead of a traceback."""
    sys.exit(f'{osp.basename(__file__)}: error: {message}')


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('config', help='config file path')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        metavar='KEY=VALUE',
        help='override some settings in the used config, as in '
        'tools/train.py: the key-value pairs in xxx=yyy format are merged '
        'into the config, e.g. comm_hook.type=fp16_compress')
    parser.add_argument(
        '--gpus',
        type=int,
        nargs='+',
        default=[8],
        metavar='N',
        help='numbers of GPUs: the memory per GPU under FSDP2 is printed '
        "for each, and the comm_hook's traffic is counted on the first "
        '(default: 8)')
    add_import_option(
        parser, 'a comm_hook type it registers is counted '
        '(e.g. with --cfg-options comm_hook.type=NAME)')
    return parser


def parse_args(argv=None):
    """The command line, checked, and the config it names (``cfg``):
    a usage error (exit code 2) names any bad value. The plugins it
    names (the config's ``custom_imports``, ``--import``) are imported
    first, so that their hooks are known when ``comm_hook`` is read."""
    parser = plugin_parser(_parser, argv)
    args = parser.parse_args(argv)
    bad = [n for n in args.gpus if n < 1]
    if bad:
        parser.error(f'--gpus should be positive numbers of GPUs, but got '
                     f'{bad[0]}')
    args.cfg = read_config(parser, 'config', args.config,
                           cfg_options(parser, args.cfg_options))
    return args


def main():
    filter_tool_warnings()
    args = parse_args()
    cfg = args.cfg
    if cfg.get('comm_hook') is not None:
        # Before building the model (seconds for InternViT-6B). The errors
        # name the bad value and the valid ones: that line is what the
        # user needs, not a traceback.
        try:
            check_stats_hook(cfg)
        except (KeyError, TypeError, ValueError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            _error(str(message))
    with DefaultScope.overwrite_default_scope(
            cfg.get('default_scope', 'mmseg')):
        try:
            s = stats(cfg, gpus=args.gpus)
        except (KeyError, TypeError, ValueError) as e:
            # A value of the config the model or the strategy refuses
            # (a ResNet depth, shard_modules, a dtype): its message.
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            _error(f'cannot build the model of {args.config}: {message}')
    vit = ('' if s['vit_params'] is None else
           f', of which the pre-trained ViT {s["vit_params"]:,}')
    parts = ('' if s['backbone_params'] is None else
             f' (backbone {s["backbone_params"]:,}{vit})')
    print(f'config            : {args.config}')
    print(f'parameters        : {s["params"]:,}{parts}')
    print(f'trainable         : {s["trainable"]:,}')
    kind = (f'{s["bf16_trainable"]:,} of them in bf16'
            if s['bf16_trainable'] else 'fp32')
    print(f'gradients         : {_size(s["grad_bytes"])} per step ({kind})')
    hook_bytes = ('depends on the DDP buckets' if s['hook_bytes'] is None else
                  f'{_size(s["hook_bytes"])} per step')
    counted = ''
    if s['hook_world_size'] is not None:
        # The hook's record counts on a world size: say which.
        counted = (f'; {"its flat form " if s["hook_flat"] else ""}on '
                   f'{s["hook_world_size"]} ranks, the first of --gpus')
    if s['hook_periodic']:
        # Its synchronisation every period steps; the inner exchange runs
        # every step inside the node (bucketed, not counted here).
        hook_bytes += ' across nodes, averaged over the period'
        nodes = s['hook_world_size']
        counted = (f'; on {nodes} node{"s" if nodes > 1 else ""} of one '
                   'rank each, the first of --gpus: with R ranks a node each '
                   'sends 1/R of it; plus the inner exchange inside the node '
                   'every step')
    if not s['hook_has_record']:
        hook_bytes, counted = 'unknown', f': it has no record; {HOW_TO_RECORD}'
    print(f'with comm_hook    : {hook_bytes} ({s["hook"]}{counted})')
    total = s['param_bytes'] + s['grad_bytes'] + s['optim_bytes']
    print(f'memory per GPU    : {_size(total)} under DDP (parameters '
          f'{_size(s["param_bytes"])}, gradients {_size(s["grad_bytes"])}, '
          f'AdamW moments {_size(s["optim_bytes"])}; activations not '
          'counted)')
    _print_ddp_extra(s, total)
    _print_fsdp2(s)


def _print_ddp_extra(s: dict, total: int) -> None:
    """DDP's buckets and the hook's state, on top of that line."""
    view = ('gradient_as_bucket_view=False, DDP\'s default; True makes the '
            'gradients views of them'
            if s['bucket_bytes'] else 'none: gradient_as_bucket_view=True')
    print(f'  DDP buckets     : + {_size(s["bucket_bytes"])} (a second copy '
          f'of the gradients; {view})')
    state = s['hook_state_bytes']
    if state is None:
        why = ('the hook has no record' if not s['hook_has_record'] else
               'its record states no state_bytes, or the hook is chosen at '
               'run time')
        print(f'  hook state      : unknown ({why})')
        return
    kept = f'+ {_size(state)} per GPU, kept from step to step' if state \
        else 'none kept from step to step'
    note = f'; {s["ddp_note"]}' if s['ddp_note'] else ''
    if s['hook_periodic']:
        note += ('; with one rank a node (with R, each keeps 1/R of the '
                 "outer state), the inner hook's state included"
                 if state else "; the inner hook's included")
    print(f'  hook state      : {kept} ({s["hook"]}{note})')
    print(f'  in all          : {_size(total + s["bucket_bytes"] + state)} '
          'per GPU under DDP with this comm_hook, activations aside')


def _print_fsdp2(s: dict) -> None:
    units = ', '.join(f'{n} {k}' for k, n in s['fsdp2_units'].items())
    shard_modules = list(s['fsdp2_shard_modules'])
    if len(s['fsdp2_units']) == 1:
        # Only the root: the default classes are not in this model, and
        # naming them would only confuse.
        print(f'FSDP2 units       : {units} (the whole model is one unit; '
              'set strategy.shard_modules to shard it finer)')
    else:
        print(f'FSDP2 units       : {units} (the last: the root, with what '
              f'the others leave); shard_modules={shard_modules}')
    fsdp2_state = ('its FSDP2 form keeps none' if s['hook_state_fsdp2'] == 0
                   else 'it does not run under full sharding'
                   if s['hook'] != 'auto (chosen by the run)' else 'unknown')
    print(f'FSDP2 hook state  : {fsdp2_state} (the counts below hold no hook '
          'state)')
    built = ('bf16 and fp32 as built' if s['bf16_params'] else 'fp32 as built')
    for key, kind in (('fsdp2', built), ('fsdp2_fp32', 'all fp32')):
        print(f'FSDP2 per GPU     : parameters {kind}; rank 0\'s shards '
              'plus the units gathered at once (a block, the units around '
              'it, the next block prefetched); activations not counted')
        for n, m in s[key].items():
            print(f'  {n:>4} GPUs       : {_size(m["total_bytes"])} '
                  f'(parameters {_size(m["param_bytes"])}, gradients '
                  f'{_size(m["grad_bytes"])}, AdamW moments '
                  f'{_size(m["optim_bytes"])}, gathered '
                  f'{_size(m["gathered_bytes"])})')
    _print_hybrid(s['hybrid'])


def _print_hybrid(h: dict) -> None:
    """Hybrid sharding's memory per GPU, where the config may shard so."""
    if h['sharding'] is None:
        return
    where = (f"on nodes of its ranks_per_node={h['ranks_per_node']}, for "
             'each of --gpus that makes several of them'
             if h['ranks_per_node'] is not None else
             'on nodes of each of --gpus (the config states no '
             'ranks_per_node, and the tool does not know the nodes: their '
             'number pads int8\'s residual of a unit by fewer values than '
             'nodes, not counted)')
    print(f"FSDP2 hybrid      : the config's sharding={h['sharding']!r} "
          '(hybrid on several nodes of several ranks' +
          (' where the node\'s shard fits the GPU, else full'
           if h['sharding'] == 'auto' else '') + f'), {where}; rank 0\'s '
          'shards over the node plus the units gathered at once, and the '
          f"hook's state ({h['hook']})")
    if not h['layouts']:
        print('  none            : no --gpus makes several nodes of several '
              'ranks')
    for layout in h['layouts']:
        g, m, state = (layout['ranks_per_node'], layout['nodes'],
                       layout['state_bytes'])
        name = f'{m} x {g} GPUs' if m else f'{g} GPUs a node'
        node = _size(layout['memory']['total_bytes'])
        if state is None:
            held = 'unknown' if h['runs'] else 'none: the hook does not run'
            print(f'  {name:<16}: {node} sharded over the node; hook state '
                  f'{held}')
            continue
        print(f"  {name:<16}: {_size(layout['memory']['total_bytes'] + state)}"
              f' (sharded over the node {node}, hook state ' +
              (_size(state) if state else 'none') + ')')


if __name__ == '__main__':
    main()
