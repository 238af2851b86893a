"""What ``tools/analysis_tools/comm_cost_model.py`` prints and saves: the
fit's report and validation table (:func:`fit_report`, :func:`fit_json`)
and the projection of every hook's step to a cluster
(:class:`ProjectionSettings`, :func:`project`), as Markdown lines and a
JSON-ready dict."""
import dataclasses
import math
import os.path as osp
from typing import Dict, List, Optional, Sequence, Tuple

from .buckets import ddp_buckets
from .codecs import CodecCost
from .collectives import Cluster, LinkConstants
from .compute import Workload, estimate_compute
from .fit import FitResult
from .fsdp2 import gathered_bytes, sharded_costs
from .hooks import hook_costs, uncosted_lines, uncosted_reasons
from .hybrid import config_sharding, recommend_sharded
from .measurements import Benchmark
from .memory import GiB, fitting_variant, hook_memory
from .model import config_params
from .periodic import left_out_lines, periodic_costs, periodic_table
from .recommend import assumptions, recommend

__all__ = ['fit_report', 'fit_json', 'ProjectionSettings', 'project']

GB = 1e9


# -- the fit --------------------------------------------------------------
def _pct(x: float) -> str:
    return f'{100 * x:+.1f}%'


def _rates(points) -> str:
    return ', '.join(f'{r:g}' for r in sorted({p.mbit for p in points}))


def fit_report(result: FitResult, benchmarks: Sequence[Benchmark]) -> list:
    """The fit in Markdown lines: the benchmarks, the constants, the
    fitted points' error and the validation table."""
    c = result.constants
    lines = ['## Fit of the cost model', '']
    for b in benchmarks:
        lines.append(f'- {b.source}: {b.nodes} nodes x {b.ranks_per_node} '
                     f'rank(s), {b.grad_bytes / 2**20:.2f} MiB of gradients '
                     f'in {len(b.bucket_bytes)} buckets, backward '
                     f'{b.backward_s * 1e3:.1f} ms, step '
                     f'{b.compute_step_s * 1e3:.1f} ms unshaped' +
                     ('; communication only (the buckets without the '
                      'compute)' if b.comm_only else ''))
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


def fit_json(result: FitResult) -> dict:
    """The fit as JSON: the constants, the codec per byte and every point."""
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
@dataclasses.dataclass(frozen=True)
class ProjectionSettings:
    """What a projection is of, as ``comm_cost_model.py``'s options state it
    (None: from the config, else estimated).

    Attributes:
        config (str): The training config.
        cfg_options (dict, optional): Keys to override in it.
        nodes (int): ``M``. gpus_per_node (int): ``G``.
        gbps (tuple[float]): Node link rates, Gbit/s per direction.
        intra_gbps (float): Intra-node rate per GPU, Gbit/s.
        hbm_tbps (float): HBM bandwidth, TB/s (for the optimizer's time).
        backward_s, compute_step_s (float, optional): Given times.
        tokens_per_gpu (float, optional): Tokens per GPU and step.
        tflops (float): Achieved model TFLOP/s per GPU.
        recompute (str, optional): ``'yes'``/``'no'``: activation
            checkpointing (None: the config's ``backbone.with_cp``).
        block_size, powersgd_rank, min_compression_rate: Hook settings
            (:func:`~.hooks.hook_costs`).
        bucket_cap_mb (float, optional): DDP's.
        hooks (tuple[str], optional): Hooks to project (None: all).
        recommend (bool): Add the recommendation per rate.
        max_loss (str), min_gain (float): What the recommendation weighs
            (see :class:`~.recommend.Recommendation`).
        hardware (str): The GPU figures in words (``--gpu``'s preset and
            what was given), printed with the result.
        compute_how (str, optional): Where given times come from
            (``--from-log``); None: given on the command line.
        gpu_mem (float, optional): A GPU's memory, GiB (``--gpu-mem``, else
            the ``--gpu`` preset's): only hooks whose memory per GPU fits
            are recommended. None: not checked.
        periods (tuple[int], optional): The periods the periodic hooks
            are projected at (None: :data:`~.periodic.DEFAULT_PERIODS`).
        outer_formats (tuple[str], optional): ``diloco``'s outer formats
            to project (None: its default, int8).
        fragments, overlap (tuple[int], optional): ``diloco``'s streaming
            settings to project (None: its defaults, 1 and 0).
    """
    config: str
    cfg_options: Optional[dict] = None
    nodes: int = 8
    gpus_per_node: int = 8
    gbps: Tuple[float, ...] = (100.0, 200.0, 400.0)
    intra_gbps: float = 3600.0
    hbm_tbps: float = 3.0
    backward_s: Optional[float] = None
    compute_step_s: Optional[float] = None
    tokens_per_gpu: Optional[float] = None
    tflops: float = 400.0
    recompute: Optional[str] = None
    block_size: int = 256
    powersgd_rank: int = 1
    min_compression_rate: float = 2.0
    bucket_cap_mb: Optional[float] = None
    hooks: Optional[Tuple[str, ...]] = None
    recommend: bool = False
    max_loss: str = 'quantized_ef'
    min_gain: float = 0.1
    hardware: str = ''
    compute_how: Optional[str] = None
    gpu_mem: Optional[float] = None
    periods: Optional[Tuple[int, ...]] = None
    outer_formats: Optional[Tuple[str, ...]] = None
    fragments: Optional[Tuple[int, ...]] = None
    overlap: Optional[Tuple[int, ...]] = None


def _fsdp2_line(facts: dict, rec, why: str) -> str:
    """What an FSDP2 config's projection models, for the output: the
    sharding it runs and why (``why``), its units, what each sharding
    gathers per rank and the hooks weighed (``rec``'s)."""
    units, cluster = facts['fsdp2_units'], rec.cluster
    names = ', '.join(dict.fromkeys(h.name for h in rec.hooks.values()))
    text = (f'FSDP2Strategy, {why}; modelled as FSDP2: {facts["fsdp2_how"]}. '
            'Full sharding gathers '
            f'{_size(gathered_bytes(units, cluster.world_size))} of '
            'parameters per rank each step from every rank (the forward, '
            'and the backward again where resharded), the same for every '
            'hook, and reduce-scatters each unit\'s gradients in the hook\'s '
            'format when its backward is done (int8_compress without error '
            'feedback)')
    if any(h.sharding == 'hybrid' for h in rec.hooks.values()):
        text += (
            '; hybrid sharding (rows (hybrid): sharding=\'hybrid\', or '
            '\'auto\' here) gathers '
            f'{_size(gathered_bytes(units, cluster.gpus_per_node))} per rank '
            'inside the node only, reduce-scatters each unit\'s gradients '
            'there in their own dtype, then all-reduces each rank\'s shard '
            f'across the {cluster.nodes} nodes in the hook\'s format '
            '(int8_compress with error feedback, its default, its residual '
            'in fp32 or bf16, or without)')
    else:
        text += '; hybrid sharding is full sharding on this cluster'
    return (text + '. Weighed: the hooks with an FSDP2 form (' +
            (names or 'none of the hooks projected') + '); PowerSGD has none')


def _memory_line(settings, facts) -> str:
    """What the memory per GPU counts, and the card it must fit."""
    hybrid = settings.nodes > 1 and settings.gpus_per_node > 1
    where = (f'rank 0\'s shards under FSDP2 on '
             f'{settings.nodes * settings.gpus_per_node} ranks' +
             (f' (hybrid sharding: on a node\'s {settings.gpus_per_node})'
              if hybrid else '') + ' plus the units gathered at once '
             '(model_stats.py\'s count); the hook keeps no state under full '
             'sharding' +
             (', and under hybrid sharding int8_compress with error feedback '
              'a residual of the rank\'s shard, in fp32 (4 B a value) or '
              'in bf16 (2 B: residual_dtype=\'bfloat16\', rows bf16 EF)'
              if hybrid else '') if facts['fsdp2'] else
             'under DDP, with its buckets (a second copy of the gradients '
             'unless model_wrapper_cfg sets gradient_as_bucket_view=True); '
             'the hook\'s state as its record states it (int8: '
             'an fp32 residual per gradient element with error feedback; '
             'PowerSGD: an error in the gradients\' dtype and its factors; '
             'a periodic hook: its state of the rank\'s slice and its inner '
             'hook\'s, and apart its synchronisation\'s buffers)')
    card = (f'; a GPU holds {settings.gpu_mem:g} GiB (--gpu-mem, else the '
            '--gpu preset\'s): what exceeds it is not recommended, what is '
            'left of it is the room for activations'
            if settings.gpu_mem else '')
    return (f'- memory per GPU: parameters, gradients, AdamW\'s two moments '
            f'and the hook\'s state, {where}; activations not counted' + card)


def _left_out(rec, buckets, settings) -> list:
    """One line per hook (and form) the GPU cannot hold, its memory and
    the form of it that fits, where one does."""
    lines = []
    for key, hook in rec.hooks.items():
        if rec.fits(key) or hook.form == 'periodic':  # left_out_lines
            continue
        memory = rec.memory[key]
        label = rec.predictions[key].label
        if memory.total is None:
            lines.append(f'- left out: {label}: its memory is unknown (its '
                         'record states no state_bytes)')
            continue
        text = (f'- left out: {label} needs {memory.describe()} per GPU, '
                f'over the {settings.gpu_mem:g} GiB of a GPU before any '
                'activation')
        flat = getattr(hook, 'flat', hook)
        if getattr(hook, 'sharding', None) is not None:
            lines.append(text + _sharded_fits(rec, hook))
            continue
        found = fitting_variant(
            getattr(flat, 'record', None), flat.settings, buckets, memory,
            rec.gpu_bytes)
        if found is not None:
            variant, fitted = found
            klass = variant.accuracy or hook.accuracy.klass
            keys = dict(type=hook.name, **variant.options)
            if 'topology' in rec.config(key):
                keys['topology'] = 'auto' if hook.form == 'two-level' else \
                    'flat'
            line = ', '.join(f'{k}={v!r}' for k, v in keys.items())
            text += (f'; what fits: `comm_hook = dict({line})`, '
                     f'{fitted.total / GiB:.2f} GiB per GPU, class {klass} '
                     f'(a class that needs --max-loss {klass})')
        elif dataclasses.replace(memory, state_bytes=0).fits(rec.gpu_bytes):
            text += '; no setting of it fits under DDP'
        else:
            text += ('; the model does not fit under DDP whatever the hook: '
                     'FSDP2 shards it (model_stats.py --gpus N)')
        if memory.bucket_bytes:
            viewed = dataclasses.replace(memory, bucket_bytes=0)
            text += ('; with gradient_as_bucket_view=True in '
                     'model_wrapper_cfg (no second copy of the gradients) '
                     f'it needs {viewed.total / GiB:.2f} GiB' +
                     (', which fits' if viewed.fits(rec.gpu_bytes) else ''))
        g = settings.gpus_per_node
        if (memory.state_bytes and settings.nodes > 1 and g > 1
                and getattr(flat, 'record', None) is not None
                and flat.record.fsdp2_form is not None):
            text += (f'; under FSDP2Strategy(sharding=\'hybrid\') its state '
                     f'is the rank\'s shard\'s, about {g} times less '
                     f'({memory.state_bytes / g / GiB:.2f} GiB per GPU, '
                     'half that with residual_dtype=\'bfloat16\'), and '
                     'the parameters, gradients and moments are sharded over '
                     'the node too: project an FSDP2 config of this model')
        lines.append(text)
    return lines


def _sharded_fits(rec, hook) -> str:
    """For a form under FSDP2 the GPU cannot hold: the forms of the same
    hook that fit, with their memory, or that none does."""
    fits = [
        k for k, h in rec.hooks.items() if h.name == hook.name and rec.fits(k)
    ]
    if not fits:
        return '; no form of it fits'
    return '; what fits: ' + ', '.join(
        f'{rec.predictions[k].label} ({rec.memory[k].total / GiB:.2f} GiB)'
        for k in fits)


def _size(nbytes: float) -> str:
    if nbytes >= GB / 10:
        return f'{nbytes / GB:.2f} GB'
    return f'{nbytes / 1e6:.2f} MB'


def project(settings: ProjectionSettings, constants: LinkConstants,
            codec: CodecCost) -> Tuple[List[str], Dict]:
    """Every hook's predicted step on the cluster, per link rate.

    Returns:
        tuple[list[str], dict]: Markdown lines (the step table, the details,
        the recommendation if asked for, the assumptions) and the same as
        JSON.

    Raises:
        ValueError: The config's model has no trainable parameter.
    """
    hooks = hook_costs(settings.block_size, settings.powersgd_rank,
                       settings.min_compression_rate)
    if settings.hooks:
        hooks = {n: h for n, h in hooks.items() if n in settings.hooks}
    periodic = periodic_costs(
        settings.gpus_per_node,
        settings.nodes,
        settings.periods,
        settings.outer_formats,
        names=settings.hooks,
        fragments=settings.fragments,
        overlap=settings.overlap)
    unknown = uncosted_lines(settings.hooks)
    if not hooks and not periodic:
        # Only hooks without a cost: said so, with nothing to project.
        name = osp.basename(settings.config)
        out = dict(
            config=settings.config, unknown=uncosted_reasons(settings.hooks))
        return [f'## Projected step time per hook: {name}', ''] + unknown, out
    # The FLOPs only where the compute is estimated from them, and not
    # where the tokens are given: the user asks for 2 N T with them.
    params, total, facts = config_params(
        settings.config, settings.cfg_options, settings.backward_s is None
        and not settings.tokens_per_gpu,
        settings.nodes * settings.gpus_per_node, settings.gpus_per_node,
        settings.gpu_mem * GiB if settings.gpu_mem else None)
    if not params:
        raise ValueError(f'{settings.config} has no trainable parameter: '
                         'nothing is communicated')
    if facts['fsdp2'] and periodic:
        names = dict.fromkeys(h.name for h in periodic.values())
        unknown.append(f'- not projected under FSDP2Strategy: '
                       f'{", ".join(names)} (FSDP2 refuses a periodic hook: '
                       'it shards the parameters the hook synchronises)')
        periodic = {}
    recompute = (
        settings.recompute == 'yes'
        if settings.recompute is not None else bool(facts['with_cp']))
    tokens = settings.tokens_per_gpu or facts.get('tokens')
    workload = Workload(
        tokens_per_gpu=tokens or Workload().tokens_per_gpu,
        achieved_flops=settings.tflops * 1e12,
        recompute=recompute)
    cap = (
        settings.bucket_cap_mb
        if settings.bucket_cap_mb is not None else facts['bucket_cap_mb'])
    flops = facts['forward_flops']
    common = dict(
        backward_s=settings.backward_s,
        compute_step_s=settings.compute_step_s,
        constants=constants,
        codec=codec,
        hooks=dict(hooks, **periodic),
        workload=workload,
        total_params=total,
        max_loss=settings.max_loss,
        min_gain=settings.min_gain,
        forward_flops=flops)
    recs = []
    sharding = why = None
    for gbps in settings.gbps:
        cluster = Cluster(settings.nodes, settings.gpus_per_node, gbps * 1e9,
                          settings.intra_gbps * 1e9)
        if facts['fsdp2']:
            sharding, why = config_sharding(facts['sharding'],
                                            facts['ranks_per_node'], cluster,
                                            facts.get('auto_fit'))
            recs.append(
                recommend_sharded(
                    facts['fsdp2_units'], cluster, sharding=sharding,
                    **common))
        else:
            recs.append(
                recommend(params, cluster, bucket_cap_mb=cap, **common))
    if not recs[0].predictions:
        asked = ', '.join(settings.hooks or hooks)
        raise ValueError(f'none of the hooks projected ({asked}) runs under '
                         'FSDP2Strategy; those that do: ' +
                         ', '.join(sharded_costs(hook_costs())))
    buckets = ddp_buckets(params, cap)
    memory = {
        key: hook_memory(hook, buckets, facts)
        for key, hook in recs[0].hooks.items()
    }
    gpu_bytes = settings.gpu_mem * GiB if settings.gpu_mem else None
    recs = [
        dataclasses.replace(r, memory=memory, gpu_bytes=gpu_bytes)
        for r in recs
    ]
    first = next(iter(recs[0].predictions.values()))
    backward = (
        settings.backward_s if settings.backward_s is not None else
        estimate_compute(params, workload, total, settings.hbm_tbps *
                         1e12, flops)[0])
    if settings.backward_s is not None:
        how = settings.compute_how or 'given'
    elif flops is not None:
        how = (f'estimated: {2 + recompute} x the forward\'s '
               f'{flops / 1e12:.3g} TFLOP ({facts["flops_how"]}) / '
               f'{settings.tflops:g} TFLOP/s')
    else:
        why = ('--tokens-per-gpu given' if settings.tokens_per_gpu else
               f'FLOPs not counted: {facts["flops_how"]}')
        how = (f'estimated: {4 + 2 * recompute} x {total:.3g} parameters x '
               f'{workload.tokens_per_gpu:g} tokens per GPU / '
               f'{settings.tflops:g} TFLOP/s ({why})')
    how += ', recomputing the forward' if recompute else ''
    token_how = ('given' if settings.tokens_per_gpu else facts.get(
        'tokens_how', 'default (InternViT-6B at 504 px, 2 per GPU)'))
    dtypes = {}
    for p in params:
        dtypes[p.dtype] = dtypes.get(p.dtype, 0) + p.numel
    lines = [
        f'## Projected step time per hook: {osp.basename(settings.config)}',
        '',
        f'- cluster: {settings.nodes} nodes x {settings.gpus_per_node} GPUs '
        f'({settings.nodes * settings.gpus_per_node} ranks)',
        f'- model: {sum(dtypes.values()):,} trainable parameters (' +
        ', '.join(f'{n:,} {d}' for d, n in dtypes.items()) +
        f'), {_size(sum(p.nbytes for p in params))} of gradients per step ' +
        (f'in {sum(1 for u in facts["fsdp2_units"] if u.reduced)} FSDP2 '
         'units' if facts['fsdp2'] else
         f'in {len(buckets)} DDP buckets (bucket_cap_mb '
         f'{cap if cap is not None else "25, first 1"})'),
        f'- compute: backward {backward:.3f} s ({how}); step without '
        f'communication {first.compute_step_s:.3f} s' +
        ('' if settings.compute_step_s is not None else
         ' (the forward, the backward, AdamW 7 passes over HBM' +
         (' of the rank\'s shard)' if facts['fsdp2'] else ')')),
        f'- tokens per GPU: {workload.tokens_per_gpu:g} ({token_how})',
    ]
    if facts['fsdp2']:
        lines.append('- strategy: ' + _fsdp2_line(facts, recs[0], why))
    if settings.hardware:
        lines.append(f'- hardware: {settings.hardware}')
    lines.append(_memory_line(settings, facts))
    lines.extend(unknown)
    lines.append('')
    lines += _step_table(settings, recs, facts['fsdp2'])
    lines += [''] + _detail_table(settings, recs, facts['fsdp2'])
    lines += periodic_table(settings.gbps, recs, _size)
    if settings.recommend:
        lines += [
            '', '### Recommendation', '',
            f'Weighing hooks up to --max-loss {settings.max_loss} and taking '
            'a lossier class only for a gain of at least '
            f'{settings.min_gain:.0%} (--min-gain {settings.min_gain:g})' +
            (f'; {settings.hardware}' if settings.hardware else '') + '.', ''
        ]
        lines += [f'- {r.line()}' for r in recs]
        lines += _left_out(recs[0], buckets, settings) + left_out_lines(
            recs[0])
    lines += ['', '### Assumptions', '']
    lines += [
        f'> - {a}' for a in assumptions(constants, codec, recs[0].cluster)
    ]
    if any(
            getattr(h, 'sharding', None) == 'hybrid'
            for h in recs[0].hooks.values()):
        lines.append(
            '> - hybrid sharding: the gathers and reduce-scatters run inside '
            'the node at the intra-node rate and latency, one after the '
            'other; each rank\'s all-reduce across nodes on the node link '
            'after its reduce-scatter and the previous all-reduce, at the '
            'same time as them (the node\'s G all-reduces share the link)')
    lines += [
        '> - compute from FLOPs, unless --backward-s/--compute-step-s are '
        'given: the whole model\'s forward counted on the meta device '
        '(PyTorch\'s FlopCounterMode), the backward twice that (three '
        'times with activation checkpointing), all at the achieved '
        'TFLOP/s; frozen layers are counted as if they trained',
        '> - accuracy is not modelled, only classed: each hook\'s class and '
        'evidence are its record\'s (toy-config convergence runs, '
        'docs/en/notes/benchmarks.md); they bound the risk, they do not '
        'predict the final mIoU on ADE20K'
    ]
    out = dict(
        config=settings.config,
        nodes=settings.nodes,
        gpus_per_node=settings.gpus_per_node,
        constants=dict(
            alpha_s=constants.alpha_s,
            eta=constants.eta,
            source=constants.source),
        codec=codec.describe(),
        backward_s=backward,
        strategy=('FSDP2Strategy' if facts['fsdp2'] else 'DDP'),
        sharding=sharding,
        sharding_why=why,
        unknown=uncosted_reasons(settings.hooks),
        rates={
            f'{g:g}':
            dict(
                best=r.best,
                fastest=r.fastest,
                best_lossless=r.best_lossless,
                classes={
                    n: h.accuracy.klass
                    for n, h in r.hooks.items()
                },
                hooks={
                    n: dataclasses.asdict(p)
                    for n, p in r.predictions.items()
                })
            for g, r in zip(settings.gbps, recs)
        },
        gpu_memory_bytes=gpu_bytes,
        memory={
            n: dict(dataclasses.asdict(m), total=m.total)
            for n, m in memory.items()
        })
    return lines, out


def _step_table(settings, recs, fsdp2=False) -> list:
    first = recs[0].predictions
    lines = [
        '| hook | sent per step | per node link | memory per GPU | ' +
        ' | '.join(f'{g:g} Gbit/s' for g in settings.gbps) + ' |',
        '|---|--:|--:|--:|' + '--:|' * len(recs)
    ]
    for name, p in first.items():
        cells = []
        for r in recs:
            q, speedup = r.predictions[name], r.speedup(name)
            cells.append(f'{q.step_s:.3f} s' +
                         (f' ({speedup:.2f}x)' if speedup is not None else ''))
        total = recs[0].memory[name].total
        held = 'unknown' if total is None else f'{total / GiB:.2f} GiB'
        if not recs[0].fits(name):
            held += ' (does not fit)'
        lines.append(f'| {p.label} | {_size(p.sent_bytes)} | '
                     f'{_size(p.node_bytes)} | {held} | ' + ' | '.join(cells) +
                     ' |')
    lines += [
        '', 'step = compute + exposed communication; (x) speed-up '
        f'against {recs[0].reference}; ' +
        ('sent: what one rank sends, as the run\'s comm_MB counts it: the '
         'reduce-scatters\' inputs under full sharding (across nodes only, '
         'for a two-level form), the all-reduces of its shard across nodes '
         'under hybrid sharding; per node link: bytes through it each way, '
         'all-gathers included'
         if fsdp2 else 'sent: what one rank sends, as the run\'s comm_MB '
         'counts it (these bytes over 2**20; the one counting rule: the '
         'tensor an all-reduce would carry to move the same bytes), across '
         'nodes only for a two-level form; per node link: bytes through it '
         'each way')
    ]
    if any(p.form == 'two-level' for p in first.values()):
        lines += [
            '', '(two-level): the hook\'s node-aware form, which it runs by '
            "default here (`topology='auto'`): reduced inside the node at "
            f'{settings.intra_gbps:g} Gbit/s per GPU, compressed only '
            'across nodes; the row above it is its flat form '
            "(`topology='flat'`)"
        ]
    return lines


def _detail_table(settings, recs, fsdp2=False) -> list:
    lines = [
        '| hook | Gbit/s | step s | exposed s | wire s | '
        'overlap bound s | codec s | collectives |',
        '|---|--:|--:|--:|--:|--:|--:|--:|'
    ]
    for name in recs[0].predictions:
        for g, r in zip(settings.gbps, recs):
            p = r.predictions[name]
            lines.append(f'| {p.label} | {g:g} | {p.step_s:.3f} | '
                         f'{p.exposed_s:.3f} | {p.wire_s:.3f} | '
                         f'{p.overlap_bound_s:.3f} | {p.codec_s:.4f} | '
                         f'{p.collectives} |')
    lines += [
        '', 'wire: bytes over the link rate, no latency; overlap '
        'bound: exposed time with no latency, eta 1 and no codec (the '
        'physical bound for this ' +
        ('order of units' if fsdp2 else 'bucket order') + ')'
    ]
    return lines
