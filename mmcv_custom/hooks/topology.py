"""Which ranks share a node, agreed on by every rank, and the process
groups a two-level (node-aware) hook reduces over.

A flat hook sends every rank's share of a bucket through the node's one
network link; a two-level hook reduces inside the node first (the fast
link), sends across nodes only among ranks of the same local rank, then
spreads the result inside the node again. That needs two groups per rank
(its node's ranks, and its peers of the same local rank on the other
nodes), and those groups must be made by every rank, in the same order,
from a layout every rank agrees on: a rank that decided alone would make
other groups than its peers and hang them.

The layout is not read from host names (emulated nodes share one host):
each rank says what its launcher told it (:class:`NodeClaim`, read by the
launching layer), one all-gather shows every rank every claim, and every
rank judges the same list the same way (:func:`agree_on_layout`). A config
may instead state ``ranks_per_node`` (:func:`blocks_layout`), which is then
checked against the launcher's word where there is one
(:func:`check_stated_layout`).
"""
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .validation import require_int

__all__ = [
    'NodeClaim', 'NodeLayout', 'NodeGroups', 'blocks_layout',
    'agree_on_layout', 'layout_of_claims', 'check_stated_layout',
    'make_node_groups'
]


class NodeClaim(NamedTuple):
    """What a rank's launcher says of it: its node's index, its rank on
    that node and how many ranks the node runs."""
    node: int
    local_rank: int
    local_size: int


class NodeLayout(NamedTuple):
    """The ranks (of the hook's process group) on each node: node by node,
    each node's ranks by local rank. Every node runs as many ranks."""
    nodes: Tuple[Tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int:
        return len(self.nodes[0])

    @property
    def two_level(self) -> bool:
        """Whether a two-level reduction differs from a flat one: several
        nodes, several ranks on each."""
        return self.num_nodes > 1 and self.ranks_per_node > 1

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank_of(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def peers_of(self, rank: int) -> Tuple[int, ...]:
        """The ranks of ``rank``'s local rank on every node, node by node
        (``rank`` among them): the group its cross-node traffic goes to."""
        local = self.local_rank_of(rank)
        return tuple(ranks[local] for ranks in self.nodes)

    def describe(self) -> str:
        nodes = 'node' if self.num_nodes == 1 else 'nodes'
        ranks = 'rank' if self.ranks_per_node == 1 else 'ranks'
        return (
            f'{self.num_nodes} {nodes} x {self.ranks_per_node} {ranks} '
            f'(ranks {self.nodes[0]} on node 0' +
            (f', {self.nodes[1]} on node 1' if self.num_nodes > 1 else '') +
            (', ...' if self.num_nodes > 2 else '') + ')')


def blocks_layout(world_size: int, ranks_per_node: int) -> NodeLayout:
    """The layout a config states with ``ranks_per_node``: consecutive
    ranks share a node, as every launcher places them by default.

    Raises:
        TypeError: ``ranks_per_node`` is not an int.
        ValueError: it is below 1, or does not divide the world size.
    """
    require_int('ranks_per_node', ranks_per_node, minimum=1)
    if world_size % ranks_per_node:
        raise ValueError(
            f'ranks_per_node={ranks_per_node} does not divide the '
            f'{world_size} ranks of the process group into whole nodes: '
            f'give a divisor of {world_size}, or topology=\'auto\' to take '
            'the layout from the launcher')
    return NodeLayout(
        tuple(
            tuple(range(start, start + ranks_per_node))
            for start in range(0, world_size, ranks_per_node)))


def layout_of_claims(
        claims: Sequence[Optional[NodeClaim]]
) -> Tuple[Optional[NodeLayout], str]:
    """The layout that every rank's claim (index: the rank) describes, or
    None and why not. Pure: every rank that judges the same claims reaches
    the same answer."""
    unknown = [rank for rank, claim in enumerate(claims) if claim is None]
    if unknown:
        return None, (f'the launcher did not say which node ranks {unknown} '
                      'run on')
    by_node = {}
    for rank, claim in enumerate(claims):
        by_node.setdefault(claim.node, []).append((claim.local_rank, rank))
    sizes = {node: len(members) for node, members in by_node.items()}
    if len(set(sizes.values())) > 1:
        listed = ', '.join(f'node {n}: {s}' for n, s in sorted(sizes.items()))
        return None, f'the nodes run uneven numbers of ranks ({listed})'
    size = next(iter(sizes.values()))
    nodes = []
    for node in sorted(by_node):
        members = sorted(by_node[node])
        locals_ = [local for local, _ in members]
        said = {claims[rank].local_size for _, rank in members}
        if locals_ != list(range(size)) or said != {size}:
            return None, (
                f'the launcher\'s word on node {node} does not add up '
                f'(local ranks {locals_}, local sizes {sorted(said)}, '
                f'{size} ranks there)')
        nodes.append(tuple(rank for _, rank in members))
    return NodeLayout(tuple(nodes)), ''


def agree_on_layout(
    claim: Optional[NodeClaim],
    process_group: Optional[dist.ProcessGroup] = None
) -> Tuple[Optional[NodeLayout], str]:
    """Every rank's claim, gathered in one all-gather, judged by
    :func:`layout_of_claims`: the same layout, or the same reason for none,
    on every rank. Collective: every rank of ``process_group`` calls it."""
    world_size = dist.get_world_size(process_group)
    mine = torch.tensor(
        list(claim) if claim is not None else [-1, -1, -1], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=process_group)
    claims = [
        None if int(t[0]) < 0 else NodeClaim(*(int(v) for v in t.tolist()))
        for t in gathered
    ]
    return layout_of_claims(claims)


def check_stated_layout(stated: NodeLayout,
                        launched: Optional[NodeLayout],
                        key: str = 'topology') -> None:
    """Raise if a config's ``ranks_per_node`` contradicts the launcher.

    Args:
        key (str): Where the config states it, to name it: ``comm_hook``'s
            ``topology`` or ``FSDP2Strategy``. Defaults to 'topology'.

    Raises:
        ValueError: Both say which ranks share a node, and they differ.
    """
    if launched is not None and launched != stated:
        raise ValueError(
            f'{key} says ranks_per_node={stated.ranks_per_node} '
            f'({stated.describe()}), but the launcher placed the ranks as '
            f'{launched.describe()}: remove ranks_per_node to follow the '
            'launcher, or launch the ranks as stated')


class NodeGroups(NamedTuple):
    """This rank's two groups: its node's ranks (``intra``) and its peers
    on every other node (``cross``).

    ``new_group`` numbers a group's ranks in the order of their global
    ranks, whatever order it is given them in. So a rank's place in
    ``intra`` (``intra_rank``) is its place among its node's ranks in that
    order, and ``cross`` joins the ranks of the same place on every node:
    every rank of a node then agrees which peer of ``intra`` stands for
    which ``cross`` group, even where the launcher numbered a node's ranks
    in another order than their global ranks.
    """
    layout: NodeLayout
    intra: dist.ProcessGroup
    cross: dist.ProcessGroup

    @property
    def intra_rank(self) -> int:
        return dist.get_rank(self.intra)

    @property
    def cross_rank(self) -> int:
        return dist.get_rank(self.cross)

    def describe(self) -> str:
        return 'two-level, ' + self.layout.describe()


def make_node_groups(
        layout: NodeLayout,
        process_group: Optional[dist.ProcessGroup] = None) -> NodeGroups:
    """Make every node's group and every place's cross-node group, on every
    rank in the same order (as ``new_group`` requires), and return this
    rank's two. Collective: every rank of the default group calls it
    (``new_group`` is), with the same ``layout``.

    The layout's ranks are ranks of ``process_group``; the groups are made
    from their global ranks, each node's in ascending order (see
    :class:`NodeGroups`).
    """

    def global_ranks(ranks):
        if process_group is None:
            return sorted(ranks)
        return sorted(dist.get_global_rank(process_group, r) for r in ranks)

    me = dist.get_rank()
    nodes = [global_ranks(ranks) for ranks in layout.nodes]
    intra = cross = None
    for ranks in nodes:
        group = dist.new_group(ranks)
        if me in ranks:
            intra = group
    for place in range(layout.ranks_per_node):
        peers = [ranks[place] for ranks in nodes]
        group = dist.new_group(peers)
        if me in peers:
            cross = group
    return NodeGroups(layout, intra, cross)
