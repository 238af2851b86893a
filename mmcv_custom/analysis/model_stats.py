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

``tools/analysis_tools/model_stats.py`` prints these;
``tools/analysis_tools/benchmark_fsdp2.py`` sets them against what two
ranks actually hold.
"""
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmengine.utils import import_modules_from_strings

from ..comm.auto import AUTO
from ..comm.builder import check_comm_hook_cfg, hook_record
from ..engine.fsdp2_units import (DEFAULT_SHARD_MODULES, select_units,
                                  unit_parameters)
from .cost.buckets import ParamSpec, ddp_buckets
from .cost.memory import hook_state_bytes

__all__ = [
    'stats', 'fsdp2_units', 'fsdp2_memory', 'shard_numel',
    'fsdp2_strategy_args'
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
        ``hook_state_fsdp2`` (under FSDP2; None where it has no FSDP2
        form).
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
    out['hook_world_size'], out['hook_flat'] = None, False
    # The hook's state per GPU under DDP and FSDP2 (None: unknown, or no
    # FSDP2 form); none without a hook.
    out['hook_state_bytes'], out['hook_state_fsdp2'] = 0, 0
    if hook is None:
        out['hook'], out['hook_bytes'] = 'none (plain all-reduce)', out[
            'grad_bytes']
        return out
    checked = check_comm_hook_cfg(hook)
    if checked['type'] == AUTO:
        # Chosen at run time: the log and the checkpoint say which.
        out['hook'], out['hook_bytes'] = 'auto (chosen by the run)', None
        out['hook_state_bytes'] = out['hook_state_fsdp2'] = None
        return out
    record = hook_record(checked['type'])
    out['hook_state_bytes'] = hook_state_bytes(record, buckets,
                                               checked['state_kwargs'])
    out['hook_state_fsdp2'] = (
        hook_state_bytes(record, buckets, None, 'fsdp2')
        if record.fsdp2_form else None)
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
