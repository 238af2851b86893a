"""Measure what each rank holds, and the step time, under DDP and FSDP2.

Starts ``--nproc`` gloo ranks on CPU and builds the tiny InternViT UperNet
of ``--config`` twice, with the same seed: once wrapped in MMEngine's
``MMDistributedDataParallel`` (as ``tools/train.py`` wraps it on CPUs) and
once sharded by :class:`~mmcv_custom.engine.FSDP2Strategy` (as the
FlexibleRunner prepares it), each with the config's optimizer (AdamW with
layer decay). Both train on the same batches, a step of one after a step of
the other, so that drift on a shared machine hits them alike. Neither
registers a ``comm_hook``: both reduce fp32 gradients the PyTorch way
(DDP's all-reduce, FSDP2's reduce-scatter), so the comparison is of the
sharding alone.

Per rank it reports the bytes actually held:

* parameters: every parameter's local tensor (a ``DTensor``'s shard under
  FSDP2, ``p.to_local()``);
* gradients: the same of every ``p.grad``, read just before each optimizer
  step (MMEngine zeroes them right after);
* optimizer state: every tensor in ``optimizer.state`` (AdamW's two moments,
  sharded like their parameters, and its per-parameter ``step`` counters,
  which are not);

and the median step time after the warm-up (the slowest rank sets each
step). Not counted there: DDP's gradient buckets (a second copy of the
gradients unless ``gradient_as_bucket_view``) and activations. What FSDP2
gathers is measured apart, in one more (untimed) step: the most bytes of
whole parameters registered on the model at once, sampled at every
operator of the forward and backward. That leaves out a unit being
prefetched, whose all-gather output becomes its parameters only when it
runs; ``model_stats.py`` counts it separately. The measuring is
:mod:`mmcv_custom.analysis.held_memory`'s, the prediction
:func:`mmcv_custom.analysis.fsdp2_memory`'s.

The table sets FSDP2's fullest rank (rank 0, see
``tools/analysis_tools/model_stats.py``) against DDP, next to 1/N and to
what ``model_stats.py`` predicts for rank 0; meanwhile rank 0 reports each
step on stderr, with an ETA. Arguments are checked before any rank starts
(a bad value is a usage error, exit code 2).

Examples:
    python tools/analysis_tools/benchmark_fsdp2.py --nproc 2 --iters 10
    python tools/analysis_tools/benchmark_fsdp2.py --nproc 2 --iters 3 \\
        --warmup 1 --json work_dirs/fsdp2/fsdp2.json  # quick
"""
import argparse
import itertools
import json
import logging
import os
import os.path as osp
import statistics
import time

import torch
import torch.distributed as dist

from mmcv_custom.analysis import (GatheredPeak, Progress, check_output,
                                  filter_tool_warnings, fsdp2_memory,
                                  held_bytes, read_config)
from mmcv_custom.launching.bench_ranks import spawn_ranks, write_results

__all__ = ['report', 'parse_args']

# The repository: --config and the configs' data_root are relative to it.
ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIG = ('configs/intern_vit/'
          'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')
MiB = 2**20
KINDS = ('ddp', 'fsdp2')
# Rows of the table: (key, label).
_ROWS = (('param_bytes', 'parameters'), ('grad_bytes', 'gradients'),
         ('optim_bytes', 'optimizer state'), ('total_bytes', 'all three'))


def _build(kind, cfg, work_dir):
    """The model and optim wrapper of ``cfg``, under DDP or FSDP2, from the
    same seed."""
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import MODEL_WRAPPERS
    from mmseg.registry import MODELS

    from mmcv_custom.engine import FSDP2Strategy
    if kind == 'fsdp2':
        # Made first: its set-up seeds the random generators.
        strategy = FSDP2Strategy(
            work_dir=work_dir,
            env_kwargs=dict(launcher='pytorch', dist_cfg=dict(backend='gloo')),
            log_kwargs=dict(log_level='WARNING'))
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    if kind == 'fsdp2':
        # Initialises the weights, shards, then builds the optimizer on
        # the sharded parameters, as FlexibleRunner does.
        return strategy.prepare(model, optim_wrapper=cfg.optim_wrapper)
    model.init_weights()
    model = MODEL_WRAPPERS.build(
        cfg.model_wrapper_cfg, default_args=dict(module=model))
    return model, build_optim_wrapper(model, cfg.optim_wrapper)


def _worker(rank, world_size, folder, args):
    filter_tool_warnings()  # a spawned rank starts with Python's filters
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.chdir(ROOT)  # the config's data_root is relative to it
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.FileStore(osp.join(folder, 'store'), world_size)
    dist.init_process_group(
        'gloo', store=store, rank=rank, world_size=world_size)
    from mmengine.logging import MMLogger
    from mmengine.registry import init_default_scope
    from mmengine.runner import Runner
    from mmengine.utils import import_modules_from_strings

    from mmcv_custom.launching.cpu_start import prepare_launch
    from mmcv_custom.launching.running import load_config

    # Before any logger exists: the tool prints its table, not INFO lines.
    MMLogger.get_current_instance().setLevel(logging.WARNING)
    cfg = load_config(args.config)
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg.custom_imports)
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    # SyncBN to BN and a DDP wrapper without device_ids, as on CPU runs.
    prepare_launch(cfg, 'pytorch', cuda=False)
    steps = args.warmup + args.iters
    loader = Runner.build_dataloader(cfg.train_dataloader, seed=0)
    batches = list(itertools.islice(iter(loader), steps))

    built = {kind: _build(kind, cfg, osp.join(folder, kind)) for kind in KINDS}
    grads = {kind: 0 for kind in KINDS}
    for kind, (model, optim_wrapper) in built.items():
        params = list(model.parameters())

        def before_step(optimizer, args_, kwargs_, kind=kind, params=params):
            # MMEngine zeroes the gradients right after the step.
            grads[kind] = held_bytes(params, optimizer)['grad_bytes']

        optim_wrapper.optimizer.register_step_pre_hook(before_step)
    times = {kind: [] for kind in KINDS}
    losses = {kind: [] for kind in KINDS}
    # On stderr, from rank 0 only: the table goes to stdout at the end.
    progress = Progress(len(batches), enabled=rank == 0)
    for i, batch in enumerate(batches):
        for kind, (model, optim_wrapper) in built.items():
            dist.barrier()
            start = time.perf_counter()
            log_vars = model.train_step(batch, optim_wrapper)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[kind].append(float(elapsed))
            losses[kind].append(float(log_vars['loss'].detach()))
        what = 'warm-up' if i < args.warmup else 'timed'
        progress.advance(f'{what} step of DDP and FSDP2')
    progress.close()
    mine = {}
    for kind, (model, optim_wrapper) in built.items():
        held = held_bytes(model.parameters(), optim_wrapper.optimizer)
        held['grad_bytes'] = grads[kind]
        mine[kind] = held
    # One more FSDP2 step, untimed (sampling slows it down).
    model, optim_wrapper = built['fsdp2']
    mine['fsdp2']['gathered_peak_bytes'] = GatheredPeak(model).step(
        batches[-1], optim_wrapper)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        module = built['ddp'][0].module
        predicted = fsdp2_memory(module, world_size)
        results = dict(
            world_size=world_size,
            backend='gloo',
            torch=torch.__version__,
            config=args.config,
            iters=args.iters,
            warmup=args.warmup,
            trainable_tensors=sum(p.requires_grad
                                  for p in module.parameters()),
            predicted_fsdp2_rank0={
                k: predicted[k]
                for k in ('param_bytes', 'grad_bytes', 'optim_bytes',
                          'gathered_bytes', 'prefetch_bytes')
            },
            step_s={
                k: statistics.median(v[args.warmup:])
                for k, v in times.items()
            },
            times=times,
            losses=losses,
            ranks=[{
                kind: r[kind]
                for kind in KINDS
            } for r in gathered])
        write_results(folder, results)
    dist.barrier()
    dist.destroy_process_group()


def _total(held) -> int:
    return held['param_bytes'] + held['grad_bytes'] + held['optim_bytes']


def _mib(num_bytes) -> str:
    return f'{num_bytes / MiB:.3f} MiB'


def report(results) -> str:
    """The results as a Markdown table, as text."""
    n = results['world_size']
    ranks = results['ranks']
    ddp, fsdp2 = dict(ranks[0]['ddp']), dict(ranks[0]['fsdp2'])
    for held in (ddp, fsdp2):
        held['total_bytes'] = _total(held)
    predicted = dict(results['predicted_fsdp2_rank0'])
    # AdamW's step counters (one fp32 scalar per parameter) are not
    # sharded: every rank keeps all of them, under either wrapper.
    predicted['optim_bytes'] += fsdp2['optim_step_bytes']
    predicted['total_bytes'] = _total(predicted)
    lines = [
        f'{n} ranks, backend {results["backend"]} (CPU), torch '
        f'{results["torch"]}; {results["config"]}',
        f'{results["iters"]} timed steps after {results["warmup"]} of '
        'warm-up, DDP and FSDP2 alternately on the same batches; no comm_hook '
        '(fp32 reductions)', '',
        '| per rank | DDP | FSDP2 (rank 0) | FSDP2 / DDP | 1/N | '
        'model_stats (rank 0) |', '|' + '---|' * 6
    ]
    for key, label in _ROWS:
        lines.append(f'| {label} | {_mib(ddp[key])} | {_mib(fsdp2[key])} | '
                     f'{fsdp2[key] / ddp[key]:.3f} | {1 / n:.3f} | '
                     f'{_mib(predicted[key])} |')
    # The prefetched unit's all-gather output is registered as its
    # parameters only when it starts: the sampling does not see it.
    in_use = predicted['gathered_bytes'] - predicted['prefetch_bytes']
    lines.append(f'| gathered at once (FSDP2) | | '
                 f'{_mib(fsdp2["gathered_peak_bytes"])} | | | {_mib(in_use)} '
                 f'(+ {_mib(predicted["prefetch_bytes"])} prefetched) |')
    step = results['step_s']
    lines.append(f'| step time (median) | {step["ddp"] * 1e3:.1f} ms | '
                 f'{step["fsdp2"] * 1e3:.1f} ms | '
                 f'{step["fsdp2"] / step["ddp"]:.2f} | | |')
    summed = sum(r['fsdp2']['param_bytes'] for r in ranks)
    lines += [
        '',
        'FSDP2 parameter bytes, summed over the ranks: '
        f'{_mib(summed)} ({"=" if summed == ddp["param_bytes"] else "!="} '
        "DDP's per rank). Optimizer state includes AdamW's step counters "
        f'({fsdp2["optim_step_bytes"]} bytes per rank, not sharded).',
        'First / last loss: DDP {:.4f} / {:.4f}, FSDP2 {:.4f} / {:.4f}'.format(
            results['losses']['ddp'][0], results['losses']['ddp'][-1],
            results['losses']['fsdp2'][0], results['losses']['fsdp2'][-1]),
    ]
    return '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        '--nproc', type=int, default=2, help='ranks (processes) to start')
    parser.add_argument(
        '--iters',
        type=int,
        default=10,
        help='timed training steps of each model after the warm-up')
    parser.add_argument(
        '--warmup',
        type=int,
        default=2,
        help='untimed training steps of each model first')
    parser.add_argument(
        '--config',
        default=CONFIG,
        help='a DDP config of a small model (default: the tiny InternViT '
        'UperNet on the toy dataset); relative to the repository')
    parser.add_argument('--json', help='write the results here')
    args = parser.parse_args(argv)
    # Everything is checked before a rank starts.
    if args.nproc < 2:
        parser.error(f'--nproc should be at least 2 (FSDP2 against DDP '
                     f'needs ranks to shard over), but got {args.nproc}')
    if args.iters < 1:
        parser.error(f'--iters should be at least 1, but got {args.iters}')
    if args.warmup < 1:
        parser.error(f'--warmup should be at least 1, but got {args.warmup}')
    if not osp.isfile(osp.join(ROOT, args.config)):
        parser.error(f'--config {args.config}: no such file in {ROOT}')
    # Read here, not first in the ranks: a file that is not a config fails
    # in a second, with one line.
    read_config(parser, '--config', osp.join(ROOT, args.config))
    if args.json:
        check_output(parser, '--json', args.json)
    return args


def main():
    filter_tool_warnings()
    args = parse_args()
    results = spawn_ranks(_worker, args.nproc, args)
    print(report(results))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)


if __name__ == '__main__':
    main()
