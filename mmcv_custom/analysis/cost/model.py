"""A config's trainable parameters as the cost model takes them
(:class:`~.buckets.ParamSpec`), its model built on the meta device, and the
facts the compute estimate reads from the config: among them the forward
FLOPs of one GPU's batch through the whole model (backbone and heads),
counted on the meta device (:func:`forward_flops`). Imports torch and
MMEngine (on first use)."""
from typing import Optional, Tuple

from .buckets import ParamSpec

__all__ = ['config_params', 'forward_flops', 'fsdp2_units']


def _input_size(cfg) -> Optional[Tuple[int, int]]:
    """The training crop, ``(h, w)``: the data preprocessor's ``size``,
    the config's ``crop_size``, else the backbone's ``img_size``."""
    model = cfg.get('model') or {}
    backbone = model.get('backbone') or {}
    for size in ((model.get('data_preprocessor') or {}).get('size'),
                 cfg.get('crop_size'), backbone.get('img_size')):
        if isinstance(size, int):
            return size, size
        if isinstance(size, (tuple, list)) and len(size) == 2:
            return int(size[0]), int(size[1])
    return None


def forward_flops(model, cfg) -> Tuple[Optional[float], str]:
    """The FLOPs of one training forward of a GPU's batch through the
    backbone, the neck and every head, and how they were counted (or why
    not: then None).

    Counted by PyTorch's ``FlopCounterMode`` on the meta device, where
    nothing is computed: it counts at the dispatcher, so a 6B model costs
    seconds and no memory. (MMEngine's ``FlopAnalyzer`` traces with
    ``torch.jit``, which does not run on meta tensors.) A hand-written
    ``2 N T`` counts only what every token meets once: it misses the
    heads' convolutions at finer resolutions, a quarter of InternViT-6B's
    UperNet and four fifths of InternViT-300M's.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    size = _input_size(cfg)
    batch = (cfg.get('train_dataloader') or {}).get('batch_size')
    if size is None or not isinstance(batch, int):
        return None, 'no crop size or batch size in the config'
    if not hasattr(model, 'extract_feat'):
        return None, f'{type(model).__name__} is not a segmentor'
    heads = []
    for name in ('decode_head', 'auxiliary_head'):
        head = getattr(model, name, None)
        heads += list(head) if isinstance(head, torch.nn.ModuleList) else (
            [head] if head is not None else [])
    x = torch.empty(batch, 3, *size, device='meta')
    try:
        with FlopCounterMode(display=False) as counter:
            feats = model.extract_feat(x)
            for head in heads:
                head.forward(feats)
    except Exception as e:  # a model the meta device cannot run
        return None, f'the forward failed on the meta device ({e})'
    return float(counter.get_total_flops()), (
        f'{batch} x {size[0]} x {size[1]} per GPU through the backbone and '
        f'{len(heads)} head(s), counted on the meta device')


def _dtype(p) -> str:
    return str(p.dtype).replace('torch.', '')


def fsdp2_units(model, cfg) -> Tuple[list, str]:
    """The units ``FSDP2Strategy`` would shard ``model`` into, as
    :class:`~.fsdp2.ShardUnit` in forward order (by the strategy's own
    :func:`~mmcv_custom.engine.fsdp2_units.select_units`), and the strategy
    in words."""
    from mmcv_custom.engine.fsdp2_mesh import check_sharding
    from mmcv_custom.engine.fsdp2_units import (parse_mp_policy, select_units,
                                                unit_parameters)
    from .fsdp2 import shard_units
    strategy = cfg.get('strategy') or {}
    # The strategy's own check of sharding and ranks_per_node.
    check_sharding(
        strategy.get('sharding', 'full'), strategy.get('ranks_per_node'))
    reshard = strategy.get('reshard_after_forward', True)
    # The strategy's own check of mp_policy, and its dtype's name.
    policy = parse_mp_policy(strategy.get('mp_policy'))
    param_dtype = (None if policy.param_dtype is None else str(
        policy.param_dtype).replace('torch.', ''))
    layout = [(name, [
        (ParamSpec(tuple(p.shape), _dtype(p),
                   f'{name}.{n}' if name else n), p.requires_grad)
        for n, p in own
    ]) for name, _, own in unit_parameters(
        model, select_units(model, strategy.get('shard_modules')))]
    units = shard_units(layout, reshard, param_dtype)
    modules = strategy.get('shard_modules')
    which = (f'shard_modules {list(modules)}'
             if modules else 'the default shard_modules')
    root = sum(u.numel for u in units if u.root)
    return units, (
        f'{sum(1 for u in units if u.gathered and not u.root)} units with '
        f'parameters ({which}; the root holds {root:,} of its own), '
        f'reshard_after_forward={reshard}, parameters gathered in '
        f'{param_dtype or "their own dtype"}')


def _auto_fit(model, cfg, world_size: Optional[int],
              ranks_per_node: Optional[int],
              gpu_bytes: Optional[float]) -> Optional[Tuple[bool, str]]:
    """Whether ``sharding='auto'`` keeps hybrid sharding on nodes of
    ``ranks_per_node`` ranks, and why, by the strategy's own rule
    (:func:`~mmcv_custom.engine.fsdp2_mesh.fit_on_node`: the node's shard
    of parameters, gradients and optimizer states within a share of the
    GPU); None where there are not several nodes of several ranks or no
    GPU memory to check."""
    if (gpu_bytes is None or world_size is None or ranks_per_node is None
            or not 1 < ranks_per_node < world_size
            or world_size % ranks_per_node):
        return None
    from mmcv_custom.engine.fsdp2_mesh import ShardingPlan, fit_on_node
    from mmcv_custom.hooks.topology import blocks_layout
    plan = fit_on_node(
        ShardingPlan(blocks_layout(world_size, ranks_per_node), ''), model,
        int(gpu_bytes), world_size, cfg.get('optim_wrapper'))
    why = plan.describe.strip()
    return plan.hybrid, why[1:-1] if plan.hybrid else why


def config_params(config: str,
                  cfg_options: Optional[dict] = None,
                  count_flops: bool = False,
                  world_size: Optional[int] = None,
                  ranks_per_node: Optional[int] = None,
                  gpu_bytes: Optional[float] = None) -> Tuple[list, int, dict]:
    """The config's trainable parameters, all parameters' count and facts.

    Args:
        config (str): A training config's path.
        cfg_options (dict, optional): Keys to override, as
            ``--cfg-options`` gives them.
        count_flops (bool): Count the forward's FLOPs
            (:func:`forward_flops`: seconds for a 6B model). Defaults to
            False: ``forward_flops`` None, ``flops_how`` saying why.
        world_size (int, optional): For a config that trains with
            FSDP2Strategy, the ranks to count the memory per GPU on
            (``fsdp2_memory``). Defaults to None: not counted.
        ranks_per_node (int, optional): Likewise, the ranks of a node, for
            hybrid sharding's memory (``fsdp2_node_memory``: sharded over
            them). Defaults to None: not counted.
        gpu_bytes (float, optional): A GPU's memory: with both counts,
            whether ``sharding='auto'`` keeps hybrid sharding, as the
            strategy decides (``auto_fit``). Defaults to None: not decided.

    Returns:
        tuple[list[ParamSpec], int, dict]: The trainable parameters in model
        order, the count of every parameter (frozen included) and
        ``fsdp2`` (whether it trains with FSDP2Strategy; then
        ``fsdp2_units``, :func:`fsdp2_units`' units, ``fsdp2_how``, the
        strategy in words, and its ``sharding`` and ``ranks_per_node``,
        None where the config leaves them out; ``auto_fit``, see
        :func:`_auto_fit`), ``with_cp``,
        ``bucket_cap_mb``, ``forward_flops`` (None where they could not be
        counted) and ``flops_how``, ``gradient_as_bucket_view`` (DDP's,
        False by default), ``param_bytes`` (every parameter, in
        its dtype; ``fsdp2_memory``: with ``world_size`` under FSDP2,
        :func:`~mmcv_custom.analysis.model_stats.fsdp2_memory`'s dict for
        the fullest rank), and, where the config
        states them, ``tokens`` per GPU and ``tokens_how``.
    """
    import torch
    from mmengine.registry import DefaultScope, init_default_scope
    from mmengine.utils import import_modules_from_strings

    from mmcv_custom.launching.cpu_start import uses_fsdp2
    from mmcv_custom.launching.running import load_config
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
        ParamSpec(tuple(p.shape), _dtype(p), name)
        for name, p in model.named_parameters() if p.requires_grad
    ]
    total = sum(p.numel() for p in model.parameters())
    backbone = cfg.model.get('backbone') or {}
    facts = dict(
        fsdp2=uses_fsdp2(cfg),
        with_cp=backbone.get('with_cp'),
        bucket_cap_mb=(cfg.get('model_wrapper_cfg')
                       or {}).get('bucket_cap_mb'),
        gradient_as_bucket_view=(cfg.get('model_wrapper_cfg')
                                 or {}).get('gradient_as_bucket_view', False))
    facts['param_bytes'] = sum(p.numel() * p.element_size()
                               for p in model.parameters())
    if facts['fsdp2']:
        facts['fsdp2_units'], facts['fsdp2_how'] = fsdp2_units(model, cfg)
        strategy = cfg.get('strategy') or {}
        facts['sharding'] = strategy.get('sharding')
        facts['ranks_per_node'] = strategy.get('ranks_per_node')
        from ..model_stats import fsdp2_memory, fsdp2_strategy_args
        args = fsdp2_strategy_args(cfg)
        for key, ranks in (('fsdp2_memory', world_size), ('fsdp2_node_memory',
                                                          ranks_per_node)):
            if ranks is not None:
                facts[key] = fsdp2_memory(model, ranks,
                                          args.get('shard_modules'),
                                          args.get('param_dtype'))
        if facts['sharding'] == 'auto':
            facts['auto_fit'] = _auto_fit(model, cfg, world_size,
                                          ranks_per_node, gpu_bytes)
    facts['forward_flops'], facts['flops_how'] = (
        forward_flops(model, cfg) if count_flops else (None, 'not counted'))
    size, patch = backbone.get('img_size'), backbone.get('patch_size')
    batch = (cfg.get('train_dataloader') or {}).get('batch_size')
    if isinstance(size, int) and isinstance(patch, int) and batch:
        facts['tokens'] = batch * (size // patch)**2
        facts['tokens_how'] = (f'{batch} x ({size} / {patch})^2 from the '
                               'config')
    return params, total, facts
