"""Over which ranks :class:`~mmcv_custom.engine.fsdp2_strategy.FSDP2Strategy`
shards: every rank (``sharding='full'``), or the ranks of each node, the
shards replicated across nodes (``'hybrid'``, FSDP2's native HSDP on a 2-D
``DeviceMesh``), or whichever fits the node layout (``'auto'``).

Inside a node the link is fast (NVLink, hundreds of GB/s); between nodes it
is 10 to 100 times slower. Full sharding gathers every unit's parameters
from every rank, across that slow link, in the forward and again in the
backward; hybrid sharding gathers inside the node only and sends each
rank's gradient shard across nodes once, in an all-reduce.

The node layout is the one the two-level DDP hooks agree on
(:func:`~mmcv_custom.hooks.topology.agree_on_layout`: the launcher's word,
judged the same on every rank) or a stated ``ranks_per_node``, so every
rank builds the same mesh or raises the same error.
"""
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from ..hooks.topology import (NodeLayout, agree_on_layout, blocks_layout,
                              check_stated_layout)
from ..hooks.validation import require_int
from .process_group import launcher_claim

__all__ = [
    'SHARDINGS', 'ShardingPlan', 'check_sharding', 'plan_sharding',
    'hybrid_mesh'
]

#: The values of ``FSDP2Strategy(sharding=...)``.
SHARDINGS = ('full', 'hybrid', 'auto')


class ShardingPlan(NamedTuple):
    """What the strategy shards over, and how to say it.

    Attributes:
        layout (NodeLayout, optional): The nodes to replicate across;
            None for full sharding.
        describe (str): For the strategy's log line, e.g. ``hybrid: sharded
            over the 2 ranks of each node, replicated over 2 nodes``.
        warn (bool): Whether the line is a WARNING (hybrid was asked for
            and full sharding is what runs).
    """
    layout: Optional[NodeLayout]
    describe: str
    warn: bool = False

    @property
    def hybrid(self) -> bool:
        return self.layout is not None


def check_sharding(sharding: Any, ranks_per_node: Any) -> None:
    """The strategy's ``sharding`` and ``ranks_per_node``, before anything
    starts (whether ``ranks_per_node`` divides the world is checked by
    :func:`plan_sharding`, once the world is known).

    Raises:
        ValueError: ``sharding`` is not one of :data:`SHARDINGS`,
            ``ranks_per_node`` is below 1, or given with ``'full'`` (where
            it would change nothing).
        TypeError: ``ranks_per_node`` is not an int.
    """
    if sharding not in SHARDINGS:
        raise ValueError(
            f'FSDP2Strategy sharding should be one of '
            f'{", ".join(repr(s) for s in SHARDINGS)}, but got {sharding!r}')
    if ranks_per_node is not None:
        try:
            require_int('ranks_per_node', ranks_per_node, minimum=1)
        except (TypeError, ValueError) as e:
            raise type(e)(f'FSDP2Strategy {e}') from None
        if sharding == 'full':
            raise ValueError(
                f'FSDP2Strategy ranks_per_node={ranks_per_node} is for '
                "sharding='hybrid' or 'auto'; sharding='full' shards over "
                'every rank whatever the nodes: remove ranks_per_node, or '
                "set sharding='hybrid'")


def plan_sharding(sharding: str,
                  ranks_per_node: Optional[int] = None) -> ShardingPlan:
    """Decide full or hybrid sharding over the default group, the same on
    every rank. Collective (one all-gather) unless ``sharding='full'``.

    Raises:
        ValueError: ``ranks_per_node`` does not divide the world or
            contradicts the launcher; ``sharding='hybrid'`` where the
            layout is unknown or its nodes are not blocks of consecutive
            ranks (``init_device_mesh`` places rank ``node *
            ranks_per_node + local``). Every rank raises the same.
    """
    world = dist.get_world_size()
    full = f'full: sharded over the {world} ranks'
    if sharding == 'full':
        return ShardingPlan(None, full)
    stated = None
    if ranks_per_node is not None:
        if world % ranks_per_node:
            raise ValueError(
                f'FSDP2Strategy ranks_per_node={ranks_per_node} does not '
                f'divide the {world} ranks into whole nodes: give a divisor '
                f'of {world}, or leave ranks_per_node out to take the layout '
                'from the launcher')
        stated = blocks_layout(world, ranks_per_node)
    launched, why = agree_on_layout(launcher_claim())
    if stated is not None:
        check_stated_layout(stated, launched, key='FSDP2Strategy')
    layout = stated if stated is not None else launched
    asked = f"sharding={sharding!r}"
    if layout is None:
        if sharding == 'hybrid':
            raise ValueError(
                f'FSDP2Strategy {asked} needs to know which ranks share a '
                f'node, but {why}: state it, e.g. strategy=dict('
                "type='FSDP2Strategy', sharding='hybrid', ranks_per_node=8), "
                "or use sharding='full'")
        return ShardingPlan(None, f'{full} ({asked}: {why})')
    if layout != blocks_layout(world, layout.ranks_per_node):
        if sharding == 'hybrid':
            raise ValueError(
                f'FSDP2Strategy {asked} needs the ranks of each node to be '
                'consecutive (rank = node * ranks_per_node + local rank, '
                'as the (replicate, shard) device mesh lays them out), but '
                f'the launcher placed them as {layout.describe()}: launch '
                "them in node blocks (Slurm's --distribution=block, "
                "torchrun), or use sharding='full'")
        return ShardingPlan(
            None, f'{full} ({asked}: the nodes are not blocks of '
            f'consecutive ranks, {layout.describe()})')
    if not layout.two_level:
        what = (f'one node of {layout.ranks_per_node} ranks'
                if layout.num_nodes == 1 else
                f'one rank a node, {layout.num_nodes} nodes')
        if sharding == 'hybrid':
            return ShardingPlan(
                None, f'{full} ({asked}, but {what}: nothing to replicate '
                'across, so full sharding)', True)
        return ShardingPlan(None, f'{full} ({asked}: {what})')
    hybrid = (f'hybrid: sharded over the {layout.ranks_per_node} ranks of '
              f'each node, replicated over {layout.num_nodes} nodes')
    if sharding == 'auto':
        hybrid += (f' ({asked}: several nodes of several ranks, '
                   f'{layout.describe()})')
    else:
        hybrid += f' ({layout.describe()})'
    return ShardingPlan(layout, hybrid)


def hybrid_mesh(plan: ShardingPlan, device_type: str):
    """The 2-D ``(replicate, shard)`` device mesh of a hybrid ``plan``:
    ``fully_shard(mesh=...)`` reduce-scatters over the ``shard`` dimension
    (inside the node) and all-reduces over ``replicate`` (across nodes).
    Collective (it makes the groups)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(
        device_type, (plan.layout.num_nodes, plan.layout.ranks_per_node),
        mesh_dim_names=('replicate', 'shard'))
