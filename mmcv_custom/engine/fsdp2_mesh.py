"""Over which ranks :class:`~mmcv_custom.engine.fsdp2_strategy.FSDP2Strategy`
shards: every rank (``sharding='full'``), or the ranks of each node, the
shards replicated across nodes (``'hybrid'``: FSDP2 on a 1-D mesh over each
node, the shards averaged across nodes by :mod:`mmcv_custom.hooks.hybrid`),
or whichever fits the node layout and the GPU (``'auto'``).

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
from typing import Any, NamedTuple, Optional, Tuple

import torch.distributed as dist

from ..hooks.topology import (NodeLayout, agree_on_layout, blocks_layout,
                              check_stated_layout)
from ..hooks.validation import require_int
from .process_group import launcher_claim

__all__ = [
    'SHARDINGS', 'ShardingPlan', 'check_sharding', 'plan_sharding',
    'decide_sharding', 'sharding_record', 'describe_sharding', 'hybrid_mesh',
    'fit_on_node', 'AUTO_STATE_SHARE'
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
    """
    layout: Optional[NodeLayout]
    describe: str

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
    every rank (:func:`decide_sharding` on the layout every rank's
    launcher claims, gathered). Collective (one all-gather) unless
    ``sharding='full'``.

    Raises:
        ValueError: As :func:`decide_sharding`; every rank raises the same.
    """
    world = dist.get_world_size()
    if sharding == 'full':
        return decide_sharding(sharding, ranks_per_node, world, None, '')
    launched, why = agree_on_layout(launcher_claim())
    return decide_sharding(sharding, ranks_per_node, world, launched, why)


def decide_sharding(sharding: str, ranks_per_node: Optional[int], world: int,
                    launched: Optional[NodeLayout], why: str) -> ShardingPlan:
    """Full or hybrid sharding of ``world`` ranks, from the launcher's
    layout ``launched`` (None: ``why`` says why there is none) and a
    stated ``ranks_per_node``. Pure: :func:`plan_sharding` judges what
    every rank's launcher said, the preflight
    (:mod:`mmcv_custom.launching.preflight.strategy`) what the launcher's
    environment says before any rank starts, and both raise the same.

    Raises:
        ValueError: ``ranks_per_node`` does not divide the world or
            contradicts the launcher; ``sharding='hybrid'`` where the
            layout is unknown, where its nodes are not blocks of
            consecutive ranks (``init_device_mesh`` places rank ``node *
            ranks_per_node + local``), or where there is one node, or one
            rank a node (hybrid would be full sharding, or no sharding at
            all: ``'auto'`` is for configs that run on either).
    """
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
        if sharding == 'hybrid':
            raise ValueError(_not_hybrid(layout, ranks_per_node, world))
        what = (f'one node of {layout.ranks_per_node} ranks'
                if layout.num_nodes == 1 else
                f'one rank a node, {layout.num_nodes} nodes')
        return ShardingPlan(None, f'{full} ({asked}: {what})')
    hybrid = (f'hybrid: sharded over the {layout.ranks_per_node} ranks of '
              f'each node, replicated over {layout.num_nodes} nodes')
    if sharding == 'auto':
        hybrid += (f' ({asked}: several nodes of several ranks, '
                   f'{layout.describe()})')
    else:
        hybrid += f' ({layout.describe()})'
    return ShardingPlan(layout, hybrid)


def _not_hybrid(layout: NodeLayout, ranks_per_node: Optional[int],
                world: int) -> str:
    """Why ``sharding='hybrid'`` cannot run on ``layout`` (one node, or
    one rank a node), and what to write instead."""
    source = (f'ranks_per_node={ranks_per_node}'
              if ranks_per_node is not None else 'as the launcher placed them')
    if layout.num_nodes == 1:
        but = (f'the {world} ranks run on one node ({source}): there is '
               'nothing to replicate across')
    else:
        but = (f'each of the {world} nodes runs one rank ({source}): there '
               'is nothing to shard inside a node')
    return ("FSDP2Strategy sharding='hybrid' shards inside each node and "
            'replicates across nodes, so it needs several nodes of several '
            f"ranks, but {but}. Use sharding='auto' (full sharding here, "
            'hybrid on several nodes of several ranks) or '
            "sharding='full'")


def sharding_record(world_size: int, replicas: int) -> dict:
    """What a checkpoint's meta records of the sharding that saved it,
    beside ``world_size`` (``meta['sharded']``): ``sharding='full'``, or
    ``'hybrid'`` with its ``nodes`` and ``ranks_per_node``. ``replicas``:
    the nodes each shard is replicated over (1 under full sharding; see
    :func:`~mmcv_custom.hooks.sharded.fsdp_replicas`).

    DCP reads a checkpoint into any layout (the shards it stores are by
    parameter, not by rank); the record is what the load's log line and
    ``fsdp2_to_pth.py`` say, and what the hooks' state is checked
    against."""
    if replicas > 1:
        return dict(
            sharding='hybrid',
            nodes=replicas,
            ranks_per_node=world_size // replicas)
    return dict(sharding='full')


def describe_sharding(sharded: dict) -> str:
    """A checkpoint's ``meta['sharded']`` in words: ``hybrid sharding (2
    nodes x 2 ranks)``, ``full sharding over 4 ranks``, ``one process, not
    sharded``, or ``an unrecorded layout``. A record without ``sharding``
    (saved before hybrid sharding existed) was full sharding."""
    world = sharded.get('world_size')
    if sharded.get('sharding') == 'hybrid':
        return (f"hybrid sharding ({sharded['nodes']} nodes x "
                f"{sharded['ranks_per_node']} ranks)")
    if world is None:
        return 'an unrecorded layout'
    if world == 1:
        return 'one process, not sharded'
    return f'full sharding over {world} ranks'


#: The share of a GPU's memory the sharded state (parameters, gradients,
#: optimizer states) may take under ``sharding='auto'``'s hybrid choice; the
#: rest is for activations and the gathered units.
AUTO_STATE_SHARE = 0.75

_GIB = 2**30


def _optimizer_bytes(optim_cfg: Any) -> Tuple[int, str]:
    """Bytes an optimizer keeps per trainable parameter, and its name:
    Adam's two fp32 moments, SGD's momentum, or Adam's where the config
    does not say."""
    optimizer = (optim_cfg or {}).get('optimizer') if isinstance(
        optim_cfg, dict) else None
    name = str((optimizer or {}).get('type', 'AdamW'))
    if name == 'SGD':
        return (4 if (optimizer or {}).get('momentum') else 0), name
    return 8, name


def fit_on_node(plan: ShardingPlan,
                model,
                gpu_bytes: Optional[int],
                world: int,
                optim_cfg: Any = None,
                where: str = 'cpu') -> ShardingPlan:
    """``sharding='auto'``'s hybrid ``plan`` if the node's shard fits the
    GPU, else full sharding, saying which and why in ``plan.describe``.

    The sharded state of a GPU under hybrid sharding is the model's
    parameters and gradients and the optimizer's states, divided by the
    node's ranks (not by every rank): it fits when it takes at most
    :data:`AUTO_STATE_SHARE` of the GPU's memory (``gpu_bytes``; None off
    the GPU, where nothing is checked, and ``where`` says on what). The
    same on every rank: the model and the GPUs are.
    """
    if gpu_bytes is None:
        return _said(plan, f'memory not checked on {where}')
    per_param, optimizer = _optimizer_bytes(optim_cfg)
    total = 0
    for param in model.parameters():
        total += param.numel() * param.element_size()
        if param.requires_grad:
            total += param.numel() * (param.element_size() + per_param)
    need = total / plan.layout.ranks_per_node
    state = f'parameters, gradients and {optimizer} states'
    if need <= AUTO_STATE_SHARE * gpu_bytes:
        return _said(
            plan, f'the node\'s shard fits: {need / _GIB:.2f} GiB of {state} '
            f'per GPU of {gpu_bytes / _GIB:.1f} GiB')
    return ShardingPlan(
        None, f'full: sharded over the {world} ranks (sharding=\'auto\': on '
        f'{plan.layout.num_nodes} nodes hybrid sharding would keep '
        f'{need / _GIB:.2f} GiB of {state} per GPU, over '
        f'{AUTO_STATE_SHARE:.0%} of its {gpu_bytes / _GIB:.1f} GiB; full '
        f'sharding keeps {total / world / _GIB:.2f} GiB)')


def _said(plan: ShardingPlan, why: str) -> ShardingPlan:
    """``plan`` with ``why`` added to the reason its line ends with."""
    line = plan.describe
    line = (
        line[:-1] + f', {why})' if line.endswith(')') else f'{line} ({why})')
    return plan._replace(describe=line)


def hybrid_mesh(plan: ShardingPlan, device_type: str) -> tuple:
    """``(node mesh, cross-node group)`` of a hybrid ``plan``: the 1-D
    device mesh of this rank's node, which ``fully_shard(mesh=...)`` shards
    and reduce-scatters over, and the group of this rank's peers at the
    same place of every other node, over which each shard is averaged
    (:func:`~mmcv_custom.hooks.hybrid.install_cross_node`). Collective
    (it makes the groups).

    Not FSDP2's native HSDP (a 2-D mesh): there FSDP2 runs the cross-node
    all-reduce itself, in the gradients' dtype, and no hook can change what
    crosses the slow link.
    """
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(
        device_type, (plan.layout.num_nodes, plan.layout.ranks_per_node),
        mesh_dim_names=('replicate', 'shard'))
    return mesh['shard'], mesh['replicate'].get_group()
