"""A config's parameter counts, gradient traffic and memory per GPU, from
its model built on the meta device (InternViT-6B needs no memory).

Gradient bytes are what each rank all-reduces per optimizer step: each
trainable parameter's gradient in its own dtype (4 bytes in fp32, 2 for a
bf16 backbone), and what the configured ``comm_hook`` sends instead, as its
hook record counts it (2 bytes for fp16/bf16; for PowerSGD, the two factors
of every matrix it compresses plus what it leaves alone, after its
warm-up). Memory under DDP is the parameters, the gradients, AdamW's two
moments, DDP's buckets (a second copy of the gradients unless
``gradient_as_bucket_view=True``) and the hook's state per GPU (int8's
fp32 residual, PowerSGD's error and factors), activations aside.

Under FSDP2 (``FSDP2Strategy``) each of N GPUs keeps 1/N of those, and
gathers whole units only while they run. The FSDP2 counts are for the
fullest rank (rank 0: ``fully_shard`` splits each parameter along its
first dimension in ``torch.chunk``'s pieces, so rank 0's is rounded up and
a parameter of one row lives on rank 0 alone):

* its shards of the parameters, of the gradients and of AdamW's two moments
  (kept in the parameters' dtype);
* what is gathered unsharded at the peak: the units are the modules named in
  the strategy's ``shard_modules`` (InternViT's blocks and the backbone by
  default) and the root, which holds what they leave (the heads). A unit
  stays gathered while the units inside it run: through its forward, which
  encloses theirs, and in the backward until its gradients are reduced,
  which for the root and the backbone (whose input, the image, needs no
  gradient) is at the end. So the peak is a block with the units around it
  (backbone and root) plus the next block, which FSDP2 prefetches in the
  backward: two units of the innermost kind at once. The unsharded
  gradients of the unit being reduced, the reduce-scatter's buffer and the
  activations are not counted.

Under hybrid sharding (``FSDP2Strategy(sharding='hybrid')``, or
``'auto'`` on several nodes of several ranks) each of a node's G GPUs keeps
1/G of those (the FSDP2 count on G GPUs) and the hook's state of its
shard: ``int8_compress`` with error feedback a residual of it in fp32, or
bf16 with ``residual_dtype='bfloat16'`` (:func:`hybrid_stats`, counted as
the cost model counts it).

``tools/analysis_tools/model_stats.py`` prints these;
``tools/analysis_tools/benchmark_fsdp2.py`` sets them against what two
ranks actually hold.
"""
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmengine.utils import import_modules_from_strings

from ..comm.auto import AUTO
from ..comm.builder import check_comm_hook_cfg, hook_record, lookup_hook
from ..comm.records import has_record
from ..comm.sharded import build_sharded_comm, check_sharded_cfg
from ..engine.fsdp2_units import (DEFAULT_SHARD_MODULES, select_units,
                                  unit_parameters)
from ..launching.cpu_start import uses_fsdp2
from .cost.buckets import ParamSpec, ddp_buckets
from .cost.fsdp2 import shard_units
from .cost.hybrid import hybrid_state_bytes
from .cost.memory import hook_state_bytes

__all__ = [
    'stats', 'fsdp2_units', 'fsdp2_memory', 'shard_numel',
    'fsdp2_strategy_args', 'check_stats_hook', 'hybrid_stats'
]


def shard_numel(shape, world_size: int) -> int:
    """Numbers of a parameter of ``shape`` on rank 0 under FSDP2, the
    fullest rank: ``fully_shard`` gives rank r the r-th of ``torch.chunk``'s
    pieces along the first dimension, ``ceil(rows / world_size)`` rows for
    rank 0 (a 0-d parameter counts as one row).

    Examples:
        >>> shard_numel((5, 3), 2)  # rows 0-2 of 5 on rank 0
        9
    """
    shape = tuple(shape) or (1, )
    rows = shape[0]
    numel = 1
    for d in shape:
        numel *= d
    if rows == 0:
        return 0
    return -(-rows // world_size) * (numel // rows)


def fsdp2_units(model, shard_modules=None) -> list:
    """The FSDP2 units ``FSDP2Strategy`` makes of ``model``, with the
    parameters each one gathers.

    As the strategy: every module whose class is in ``shard_modules`` (by
    name or class; None for the strategy's default, InternViT's blocks and
    the backbone when present) is a unit, and the root holds the rest. A
    parameter belongs to the innermost unit that contains it.

    Returns:
        list[dict]: ``name`` (``''`` for the root), ``type`` (class name),
        ``params`` (its own parameters) and ``ancestors`` (names of the
        units containing it, the root included), innermost units first,
        the root last.

    Raises:
        ValueError: An explicit ``shard_modules`` entry matches no module of
            the model (the strategy's own check).
    """
    # Deepest first, as the strategy shards them.
    deepest_first = select_units(model, shard_modules)
    units = []
    for name, module, own in unit_parameters(model, deepest_first):
        ancestors = [
            n for n, _ in deepest_first
            if n != name and name.startswith(n + '.')
        ]
        units.append(
            dict(
                name=name,
                type=type(module).__name__,
                params=[p for _, p in own],
                ancestors=ancestors[::-1] + [''] if name else []))
    return units


def _gathered_bytes(units, size) -> tuple:
    """Peak bytes gathered at once: a unit with the units around it, plus
    the largest other unit (the one prefetched); ``size(p)`` is a
    parameter's gathered bytes. Returns the peak and its prefetched
    part."""
    own = {u['name']: sum(size(p) for p in u['params']) for u in units}
    best = (0, 0)
    for unit in units:
        chain = [unit['name']] + unit['ancestors']
        prefetch = max((b for n, b in own.items() if n not in chain),
                       default=0)
        # Of equal peaks, the one with more in use (a unit runs inside
        # the root rather than being prefetched beside it).
        best = max(best, (sum(own[n] for n in chain) + prefetch, -prefetch))
    return best[0], -best[1]


def fsdp2_memory(model,
                 world_size: int,
                 shard_modules=None,
                 param_dtype=None,
                 all_fp32: bool = False) -> dict:
    """Bytes on the fullest GPU (rank 0) when FSDP2 shards ``model`` over
    ``world_size`` GPUs with AdamW, activations aside.

    Args:
        model (nn.Module): Built as the config builds it (e.g. on the meta
            device).
        world_size (int): GPUs.
        shard_modules (Sequence, optional): ``FSDP2Strategy``'s.
        param_dtype (torch.dtype, optional): Its ``mp_policy`` compute
            dtype: the dtype units are gathered in. None: the parameters'.
        all_fp32 (bool): Count every parameter as fp32 instead of its own
            dtype. Defaults to False.

    Returns:
        dict: ``param_bytes``, ``grad_bytes`` and ``optim_bytes`` (this
        rank's shards of parameters, of the gradients of the trainable
        ones and of AdamW's two moments), ``gathered_bytes`` (see the
        module's docstring), ``prefetch_bytes`` (the part of it that is the
        unit being prefetched) and ``total_bytes``.
    """

    def element(p):
        return 4 if all_fp32 else p.element_size()

    params = list(model.parameters())
    shard = {
        id(p): shard_numel(p.shape, world_size) * element(p)
        for p in params
    }
    out = dict(
        param_bytes=sum(shard[id(p)] for p in params),
        grad_bytes=sum(shard[id(p)] for p in params if p.requires_grad))
    out['optim_bytes'] = 2 * out['grad_bytes']
    gathered = (
        torch.empty((), dtype=param_dtype).element_size()
        if param_dtype is not None else None)
    out['gathered_bytes'], out['prefetch_bytes'] = _gathered_bytes(
        fsdp2_units(model, shard_modules), lambda p: p.numel() *
        (gathered or element(p)))
    out['total_bytes'] = sum(out[k] for k in ('param_bytes', 'grad_bytes',
                                              'optim_bytes', 'gathered_bytes'))
    return out


def fsdp2_strategy_args(cfg: Config) -> dict:
    """The config's FSDP2Strategy arguments that change the count
    (``shard_modules``, ``mp_policy.param_dtype``); empty for any other
    config, which is counted as the strategy's defaults would shard it."""
    strategy = cfg.get('strategy') or {}
    kind = strategy.get('type')
    name = kind if isinstance(kind, str) else getattr(kind, '__name__', None)
    if cfg.get('runner_type') != 'FlexibleRunner' or name != 'FSDP2Strategy':
        return {}
    out = {}
    if strategy.get('shard_modules') is not None:
        out['shard_modules'] = tuple(strategy['shard_modules'])
    dtype = (strategy.get('mp_policy') or {}).get('param_dtype')
    if dtype is not None:
        valid = ('float32', 'bfloat16', 'float16')
        if dtype not in valid:
            raise ValueError(f'strategy.mp_policy.param_dtype should be one '
                             f'of {list(valid)} or None, but got {dtype!r}')
        out['param_dtype'] = getattr(torch, dtype)
    return out


def _may_shard_hybrid(cfg: Config) -> bool:
    """Whether ``cfg`` trains with FSDP2Strategy and a ``sharding`` that
    runs hybrid on several nodes of several ranks (``'hybrid'``,
    ``'auto'``)."""
    return uses_fsdp2(cfg) and (cfg.get('strategy') or {}).get(
        'sharding', 'full') in ('hybrid', 'auto')


def _ddp_form(hook):
    """``hook`` without the keys only hybrid sharding reads
    (``residual_dtype``): what DDP and full sharding are counted with."""
    if not isinstance(hook, dict) or 'residual_dtype' not in hook:
        return hook
    return {k: v for k, v in hook.items() if k != 'residual_dtype'}


def _with_inner_state(state: int, buckets, state_kwargs: dict):
    """A periodic hook's state and its inner hook's, which exchanges every
    step's gradients, in DDP's buckets, inside the node (None: the inner
    hook's is unknown)."""
    inner = check_comm_hook_cfg(state_kwargs['inner'])
    kept = hook_state_bytes(
        hook_record(inner['type']), buckets, inner['state_kwargs'])
    return None if kept is None else state + kept


def check_stats_hook(cfg: Config) -> None:
    """The config's ``comm_hook``, checked before the model is built as
    its run checks it: ``int8_compress``'s ``residual_dtype`` only where the
    config may shard hybrid (:func:`~mmcv_custom.comm.sharded.
    check_sharded_cfg`), the rest by
    :func:`~mmcv_custom.comm.builder.check_comm_hook_cfg`.

    Raises:
        KeyError, TypeError, ValueError: Their errors.
    """
    hook = cfg.get('comm_hook')
    if hook is None:
        return
    if isinstance(hook, dict) and 'residual_dtype' in hook:
        check_sharded_cfg(hook, hybrid=_may_shard_hybrid(cfg))
    check_comm_hook_cfg(_ddp_form(hook))


def _hybrid_layouts(ranks_per_node, gpus) -> list:
    """``(G, M)`` of each layout hybrid sharding is counted on: with the
    config's ``ranks_per_node`` G, each of ``gpus`` it divides into
    several nodes (M of them); without, each of ``gpus`` as the ranks of
    one node, the nodes unknown (M None)."""
    if ranks_per_node is None:
        return list(dict.fromkeys((n, None) for n in gpus if n > 1))
    return list(
        dict.fromkeys((ranks_per_node, n // ranks_per_node) for n in gpus
                      if ranks_per_node > 1 and n %
                      ranks_per_node == 0 and n // ranks_per_node > 1))


def hybrid_stats(cfg: Config, model, gpus=(8, )) -> dict:
    """Memory per GPU under hybrid sharding, for an FSDP2 config whose
    ``sharding`` may run it (``'hybrid'``, or ``'auto'`` on several nodes
    of several ranks where the node's shard fits the GPU).

    The layout is the config's ``ranks_per_node`` where it states one (on
    each of ``gpus`` it divides into several nodes); else each of ``gpus``
    as the GPUs of one node, the nodes unknown: they only pad int8's
    residual of each unit to one equal piece a node (fewer values than
    nodes a unit), which is then not counted.

    Returns:
        dict: ``sharding`` (the config's; None for a config that never
        shards hybrid, then nothing else), ``ranks_per_node`` (the
        config's, or None), ``layouts``: one dict a layout with
        ``ranks_per_node`` (G), ``nodes`` (M, or None), ``memory``
        (:func:`fsdp2_memory` on G GPUs: the node's shards) and
        ``state_bytes`` (the hook's state of the rank's shard, as the cost
        model counts it, :func:`~.cost.hybrid.hybrid_state_bytes`; 0
        without a hook, None where unknown or where the hook has no form
        there), ``hook`` (that state in words) and ``runs`` (False where
        the hook has no form under hybrid sharding).
    """
    if not _may_shard_hybrid(cfg):
        return dict(sharding=None)
    strategy = cfg.get('strategy') or {}
    args = fsdp2_strategy_args(cfg)
    per_node = strategy.get('ranks_per_node')
    units = fsdp2_units(model, args.get('shard_modules'))
    shards = shard_units([(u['name'], [
        (ParamSpec(tuple(p.shape),
                   str(p.dtype).replace('torch.', '')), p.requires_grad)
        for p in u['params']
    ]) for u in units])
    hook, record, kwargs = cfg.get('comm_hook'), None, {}
    what = 'no comm_hook: nothing kept'
    if isinstance(hook, dict) and hook.get('type') == AUTO:
        what = 'unknown: the hook is chosen at run time'
    elif hook is not None:
        try:
            spec = build_sharded_comm(hook, hybrid=True)
        except ValueError:
            what = (f"comm_hook type={hook.get('type')!r} does not run under "
                    'hybrid sharding (the strategy refuses it there)')
        else:
            record = hook_record(spec.type)
            dtype = str(spec.residual_dtype).replace('torch.', '')
            kwargs = dict(
                error_feedback=spec.error_feedback, residual_dtype=dtype)
            short = 'bf16' if dtype == 'bfloat16' else 'fp32'
            what = (f'{spec.type} with error feedback: an {short} residual '
                    "of the rank's shard"
                    if spec.error_feedback else f'{spec.type}: nothing kept')
    layouts = []
    for g, m in _hybrid_layouts(per_node, gpus):
        state = 0 if hook is None else None
        if record is not None:
            state = hybrid_state_bytes(record, kwargs, shards, g, m or 1)
        layouts.append(
            dict(
                ranks_per_node=g,
                nodes=m,
                memory=fsdp2_memory(model, g, args.get('shard_modules'),
                                    args.get('param_dtype')),
                state_bytes=state))
    return dict(
        sharding=strategy.get('sharding'),
        ranks_per_node=per_node,
        layouts=layouts,
        hook=what,
        runs=not (hook is not None and record is None
                  and hook.get('type') != AUTO))


def stats(cfg: Config, gpus=(8, )) -> dict:
    """Counts for ``cfg``'s model, built on the meta device.

    Imports the config's ``custom_imports`` and sets its default scope
    (``mmseg`` when it names none) first.

    Args:
        cfg (Config): A training config.
        gpus (Sequence[int]): Numbers of GPUs for the FSDP2 keys; the
            first is the world size ``hook_bytes`` is counted on. Defaults
            to ``(8, )``.

    Returns:
        dict: ``params``, ``trainable``, ``backbone_params`` and
        ``vit_params`` (None without a backbone, or one that is not
        InternViT), ``bf16_params`` and ``bf16_trainable``;
        ``grad_bytes`` (what DDP all-reduces per step without a hook),
        ``hook`` (the ``comm_hook`` as text), ``hook_bytes`` (what it
        sends instead; None where that depends on DDP's buckets),
        ``hook_world_size`` (the ranks ``hook_bytes`` was counted on,
        ``gpus[0]``, where the hook's record counted it; None where no
        world size entered the count) and ``hook_flat`` (True where the
        hook also has a two-level form, which that count is not);
        ``param_bytes`` and ``optim_bytes`` (per GPU under DDP);
        ``bucket_bytes`` (DDP's buckets, a second copy of the gradients
        unless ``model_wrapper_cfg`` sets ``gradient_as_bucket_view``),
        ``hook_state_bytes`` (what the hook keeps per GPU under DDP, see
        :func:`~.cost.memory.hook_state_bytes`; None: unknown) and
        ``hook_has_record`` (False for a hook registered without a
        record: its bytes and state are unknown), ``hook_periodic`` (True
        for ``post_local_sgd`` and ``diloco``: ``hook_bytes`` is then what
        crosses the nodes per step, averaged over the period, on
        ``gpus[0]`` nodes of one rank each, the inner exchange aside, and
        ``hook_state_bytes`` includes the inner hook's),
        ``hook_state_fsdp2`` (under FSDP2's full sharding; None where it
        does not run there: no FSDP2 form, or ``int8_compress`` with error
        feedback, which runs under hybrid sharding only); ``hybrid``:
        :func:`hybrid_stats`' dict, and ``ddp_note`` (why DDP's counts
        leave a key of the config out, or empty).
        ``fsdp2`` and ``fsdp2_fp32`` map each number of GPUs to
        :func:`fsdp2_memory`'s dict (the parameters' dtypes as built, and
        all in fp32), ``fsdp2_units`` counts the units by class (the root
        under its own class name) and ``fsdp2_shard_modules`` is what
        selected them.

    Raises:
        ValueError: The config's ``strategy`` names a ``shard_modules``
            entry the model lacks or a ``param_dtype`` FSDP2 does not take.

    Examples:
        >>> from mmengine.config import Config
        >>> from mmcv_custom.analysis import stats
        >>> cfg = Config.fromfile('configs/intern_vit/'
        ...     'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py')
        >>> s = stats(cfg, gpus=(8, 16))
        >>> s['fsdp2'][16]['total_bytes']  # on rank 0 of 16 GPUs
    """
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg.custom_imports)
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    from mmseg.registry import MODELS
    with torch.device('meta'):
        model = MODELS.build(cfg.model)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    backbone = getattr(model, 'backbone', None)
    # Only InternViT tells its pre-trained ViT apart from its adapters.
    vit = getattr(backbone, 'vit_parameters', None)
    out = dict(
        params=sum(p.numel() for p in params),
        backbone_params=None if backbone is None else sum(
            p.numel() for p in backbone.parameters()),
        vit_params=None if vit is None else sum(p.numel() for p in vit()),
        trainable=sum(p.numel() for p in trainable))
    # What DDP all-reduces without a hook: each gradient in its parameter's
    # dtype (a bf16 backbone's in bf16).
    out['grad_bytes'] = sum(p.numel() * p.element_size() for p in trainable)
    out['bf16_params'] = sum(p.numel() for p in params
                             if p.dtype == torch.bfloat16)
    out['bf16_trainable'] = sum(p.numel() for p in trainable
                                if p.dtype == torch.bfloat16)
    # Per GPU under DDP, activations aside: every parameter, the gradients
    # and AdamW's two moments (kept in the parameters' dtype).
    out['param_bytes'] = sum(p.numel() * p.element_size() for p in params)
    out['optim_bytes'] = 2 * out['grad_bytes']
    strategy = fsdp2_strategy_args(cfg)
    shard_modules = strategy.get('shard_modules')
    units = fsdp2_units(model, shard_modules)
    out['fsdp2_shard_modules'] = shard_modules or DEFAULT_SHARD_MODULES
    out['fsdp2_units'] = {}
    for unit in units:
        out['fsdp2_units'][unit['type']] = out['fsdp2_units'].get(
            unit['type'], 0) + 1
    for key, all_fp32 in (('fsdp2', False), ('fsdp2_fp32', True)):
        out[key] = {
            n:
            fsdp2_memory(
                model,
                n,
                shard_modules,
                strategy.get('param_dtype'),
                all_fp32=all_fp32)
            for n in gpus
        }
    # DDP's buckets: a second copy of the gradients, unless they are views
    # of them (gradient_as_bucket_view=True; DDP's default is False).
    wrapper = cfg.get('model_wrapper_cfg') or {}
    out['bucket_bytes'] = (0 if wrapper.get('gradient_as_bucket_view') else
                           out['grad_bytes'])
    buckets = ddp_buckets([
        ParamSpec(tuple(p.shape),
                  str(p.dtype).replace('torch.', '')) for p in trainable
    ], wrapper.get('bucket_cap_mb'))
    hook = cfg.get('comm_hook')
    out['hybrid'] = hybrid_stats(cfg, model, gpus)
    out['ddp_note'] = ('' if _ddp_form(hook) is hook else
                       "under DDP int8's residual is fp32: residual_dtype "
                       'is hybrid sharding\'s')
    out['hook_world_size'], out['hook_flat'] = None, False
    # The hook's state per GPU under DDP and FSDP2 (None: unknown, or no
    # FSDP2 form); none without a hook.
    out['hook_state_bytes'], out['hook_state_fsdp2'] = 0, 0
    out['hook_has_record'], out['hook_periodic'] = True, False
    if hook is None:
        out['hook'], out['hook_bytes'] = 'none (plain all-reduce)', out[
            'grad_bytes']
        return out
    checked = check_comm_hook_cfg(_ddp_form(hook))
    if checked['type'] == AUTO:
        # Chosen at run time: the log and the checkpoint say which.
        out['hook'], out['hook_bytes'] = 'auto (chosen by the run)', None
        out['hook_state_bytes'] = out['hook_state_fsdp2'] = None
        return out
    record = hook_record(checked['type'])
    out['hook_has_record'] = has_record(lookup_hook(checked['type']))
    out['hook_state_bytes'] = hook_state_bytes(record, buckets,
                                               checked['state_kwargs'])
    out['hook_periodic'] = record.periodic
    if record.periodic and out['hook_state_bytes'] is not None:
        out['hook_state_bytes'] = _with_inner_state(out['hook_state_bytes'],
                                                    buckets,
                                                    checked['state_kwargs'])
    try:
        check_sharded_cfg(hook)
    except ValueError:
        out['hook_state_fsdp2'] = None  # full sharding refuses it
    else:
        out['hook_state_fsdp2'] = hook_state_bytes(record, buckets, None,
                                                   'fsdp2')
    half = bool(checked['wrapper'] or record.half_precision)
    # None where the traffic depends on DDP's buckets. A record counts on a
    # world size (an all-gather's bytes grow with it): the first of gpus,
    # which the result names.
    if record.model_bytes is None:
        out['hook_bytes'] = None
    else:
        out['hook_world_size'], out['hook_flat'] = gpus[0], record.two_level
        out['hook_bytes'] = record.model_bytes(trainable,
                                               checked['state_kwargs'], half,
                                               gpus[0])
    out['hook'] = ', '.join(f'{k}={v!r}' for k, v in hook.items())
    return out
