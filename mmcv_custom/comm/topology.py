"""The ``topology`` key of a ``comm_hook`` config: flat or two-level.

``topology='auto'`` (the default) reduces in two levels (inside the node,
then across nodes; see :mod:`mmcv_custom.hooks.int8_two_level`) wherever
that differs from the flat form: a hook with a two-level form
(:attr:`~.records.HookRecord.two_level`) on several nodes with several
ranks each, as the launcher placed them. ``'flat'`` keeps the one-level
form; ``dict(ranks_per_node=N)`` states the layout (consecutive ranks
share a node), checked against the launcher's word where it has one.

:func:`check_topology` judges the value without a process group (the
runner hook checks every config at the start of every run);
:func:`resolve_topology` decides, on every rank together, and makes the
groups. Imports only torch and the hook package.
"""
from typing import Any, List, NamedTuple, Optional

import torch.distributed as dist

from ..hooks.topology import (NodeClaim, NodeGroups, agree_on_layout,
                              blocks_layout, check_stated_layout,
                              make_node_groups)
from ..hooks.validation import require_int
from .records import HookRecord

__all__ = ['TOPOLOGIES', 'check_topology', 'resolve_topology', 'Topology']

#: The string values of ``topology``; the third form is
#: ``dict(ranks_per_node=N)``.
TOPOLOGIES = ('auto', 'flat')


class Topology(NamedTuple):
    """What a run uses: the groups of the two-level form (None: flat) and
    one phrase for the log line saying which, and why."""
    groups: Optional[NodeGroups]
    describe: str


def check_topology(value: Any, hook_type: Any, record: HookRecord,
                   two_level_hooks: List[str]) -> List[Exception]:
    """The errors of a ``topology`` value for this hook (none: fine).

    Args:
        value: The config's ``topology``.
        hook_type: The config's ``type``, to name it.
        record (HookRecord): The hook's record.
        two_level_hooks (list[str]): The registered names that have a
            two-level form, to name in the message.
    """
    valid = ("'auto', 'flat' or dict(ranks_per_node=N) (N ranks per node, "
             'an int >= 1)')
    if record.periodic and value == 'flat':
        return [
            ValueError(
                f'comm_hook type {hook_type!r} synchronises across nodes, so '
                "it needs the node layout: topology='auto' (the launcher's) "
                "or dict(ranks_per_node=N), not 'flat'")
        ]
    if isinstance(value, str):
        if value in TOPOLOGIES:
            return []
        # --cfg-options keeps 'dict(ranks_per_node=2)' as a string.
        hint = ('; on the command line give the key itself: --cfg-options '
                'comm_hook.topology.ranks_per_node=N'
                if 'ranks_per_node' in value else '')
        return [
            ValueError(f'comm_hook topology should be {valid}, but got '
                       f'{value!r}{hint}')
        ]
    if not isinstance(value, dict):
        return [
            TypeError(f'comm_hook topology should be {valid}, but got '
                      f'{type(value).__name__}: {value!r}')
        ]
    errors: List[Exception] = []
    unknown = sorted(set(value) - {'ranks_per_node'})
    if unknown or 'ranks_per_node' not in value:
        errors.append(
            TypeError(f'comm_hook topology as a dict takes the one key '
                      f'ranks_per_node, but got {value!r}'))
    else:
        try:
            require_int('ranks_per_node', value['ranks_per_node'], minimum=1)
        except (TypeError, ValueError) as e:
            errors.append(type(e)(f'comm_hook topology: {e}'))
    if not record.two_level and not record.periodic:
        errors.append(
            ValueError(
                f'comm_hook type {hook_type!r} has no two-level form, so '
                f'topology={value!r} cannot apply. Two-level forms: '
                f'{", ".join(two_level_hooks)}; leave topology out (or '
                "'flat') for this hook."))
    return errors


def resolve_topology(value: Any,
                     record: HookRecord,
                     process_group: Optional[dist.ProcessGroup] = None,
                     claim: Optional[NodeClaim] = None) -> Topology:
    """Decide flat or two-level, the same on every rank, and make the
    groups. Collective: every rank of the default group calls it with the
    same config (a checked one).

    Args:
        value: The config's ``topology`` (checked).
        record (HookRecord): The hook's record.
        process_group (ProcessGroup, optional): The DDP model's group.
        claim (NodeClaim, optional): What this rank's launcher says of its
            node (:func:`mmcv_custom.engine.process_group.launcher_claim`);
            None: it says nothing.

    Raises:
        ValueError: A stated ``ranks_per_node`` does not divide the group
            into whole nodes, or contradicts the launcher's placement, or
            the DDP model reduces over a subgroup (the node groups are
            made from the whole world).
    """
    if value == 'flat':
        return Topology(None, 'flat (as set)')
    if not record.two_level:
        return Topology(None, 'flat (this hook has no two-level form)')
    if not dist.is_initialized():
        if value == 'auto':
            return Topology(None, 'flat (no process group)')
        raise ValueError(f'comm_hook topology={value!r} needs a process '
                         'group: build the hook after init_process_group')
    world_size = dist.get_world_size(process_group)
    if world_size != dist.get_world_size():
        if value == 'auto':
            return Topology(None, 'flat (the DDP model reduces over a '
                            'subgroup)')
        raise ValueError(
            f'comm_hook topology={value!r} needs the DDP model to reduce '
            f'over every rank, but its group has {world_size} of '
            f'{dist.get_world_size()}; use topology=\'flat\'')
    stated = None
    if isinstance(value, dict):
        # Every rank raises the same error before any collective.
        stated = blocks_layout(world_size, value['ranks_per_node'])
    launched, why = agree_on_layout(claim, process_group)
    if stated is not None:
        check_stated_layout(stated, launched)
    layout = stated if stated is not None else launched
    if layout is None:
        return Topology(None, f'flat ({why})')
    if not layout.two_level:
        what = (f'one node of {layout.ranks_per_node} ranks'
                if layout.num_nodes == 1 else
                f'one rank a node, {layout.num_nodes} nodes')
        return Topology(None, f'flat ({what})')
    groups = make_node_groups(layout, process_group)
    return Topology(groups, groups.describe())
