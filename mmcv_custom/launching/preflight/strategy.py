"""The ``strategy`` of an FSDP2 config: FSDP2Strategy's arguments, and
whether its ``sharding`` can run on the nodes the launcher started.

The runner builds the strategy, and the strategy decides its sharding,
only after every rank has started and joined the process group; a bad
value or a layout that cannot hold would then stop each rank with a
traceback (exit 1). Here both are said before that, once per node, with
the same words the strategy uses (the same functions:
:func:`~mmcv_custom.engine.fsdp2_args.strategy_arg_errors` and
:func:`~mmcv_custom.engine.fsdp2_mesh.decide_sharding`, on the layout the
launcher's environment states, :func:`~mmcv_custom.engine.process_group.
launcher_layout`).
"""
from typing import List, Optional

from mmengine.config import Config

from ...engine.fsdp2_args import STRATEGY_DEFAULTS, strategy_arg_errors
from ...engine.fsdp2_mesh import ShardingPlan, decide_sharding
from ...engine.process_group import LAUNCH_ENV, launcher_layout
from ..cpu_start import uses_fsdp2
from .problems import Problem

__all__ = ['strategy_problems', 'plan_at_start', 'hybrid_at_start']


def strategy_problems(cfg: Config, launcher: str) -> List[Problem]:
    """Every bad FSDP2Strategy argument (unknown keys, wrong types and
    values), one problem each; when all are valid, whether ``sharding``
    holds on the world and nodes ``launcher``'s environment states
    (``'hybrid'`` on one node, or one rank a node, on nodes of uneven
    sizes; ``ranks_per_node`` that does not divide the world or
    contradicts the launcher). Nothing for other strategies, nor for a
    process that no launcher started (it shards nothing).
    """
    if not uses_fsdp2(cfg):
        return []
    args = {k: v for k, v in cfg.strategy.items() if k != 'type'}
    errors = strategy_arg_errors(args)
    if errors:
        return [Problem(str(e)) for e in errors]
    args = dict(STRATEGY_DEFAULTS, **args)
    if args['sharding'] == 'full' or launcher not in LAUNCH_ENV:
        return []
    world, layout, why = launcher_layout(launcher)
    if world is None:
        return []  # the launcher check names what is missing
    try:
        decide_sharding(args['sharding'], args['ranks_per_node'], world,
                        layout, why)
    except ValueError as e:
        return [Problem(str(e))]
    return []


def plan_at_start(cfg: Config, launcher: str) -> Optional[ShardingPlan]:
    """The sharding the FSDP2 config will run on the nodes ``launcher``'s
    environment states, as the ranks will decide it
    (:func:`~mmcv_custom.engine.fsdp2_mesh.decide_sharding`); None where
    that is not known before the ranks start (no launcher's word, or
    arguments or a layout that :func:`strategy_problems` refuses).
    ``'auto'``'s memory check (:func:`~mmcv_custom.engine.fsdp2_mesh.
    fit_on_node`) needs the GPU, so a hybrid plan may still become full
    sharding on a GPU the node's shard does not fit."""
    given = {
        k: v
        for k, v in (cfg.get('strategy') or {}).items() if k != 'type'
    }
    args = dict(STRATEGY_DEFAULTS, **given)
    if args['sharding'] == 'full':
        return ShardingPlan(None, 'full')
    if launcher not in LAUNCH_ENV or strategy_arg_errors(given):
        return None
    world, layout, why = launcher_layout(launcher)
    if world is None:
        return None
    try:
        return decide_sharding(args['sharding'], args['ranks_per_node'], world,
                               layout, why)
    except ValueError:
        return None


def hybrid_at_start(cfg: Config, launcher: str) -> Optional[bool]:
    """Whether the FSDP2 config will shard hybrid (:func:`plan_at_start`);
    None where that is not known before the ranks start."""
    plan = plan_at_start(cfg, launcher)
    return None if plan is None else plan.hybrid
