"""Which ranks share a node (issue 30's first part): the layout every rank
agrees on from its launcher's word, a config's ``ranks_per_node``, and the
two groups a two-level hook reduces over, on real gloo ranks."""
import pytest
import torch
import torch.distributed as dist

from mmcv_custom.engine.process_group import launcher_claim
from mmcv_custom.hooks.topology import (NodeClaim, NodeLayout, agree_on_layout,
                                        blocks_layout, check_stated_layout,
                                        layout_of_claims, make_node_groups)
from mmcv_custom.testing import run_ranks


def test_a_stated_ranks_per_node_places_consecutive_ranks_together():
    layout = blocks_layout(6, 2)
    assert layout.nodes == ((0, 1), (2, 3), (4, 5))
    assert (layout.num_nodes, layout.ranks_per_node) == (3, 2)
    assert layout.two_level
    assert layout.node_of(3) == 1 and layout.local_rank_of(3) == 1
    assert layout.peers_of(3) == (1, 3, 5)
    assert not blocks_layout(4, 1).two_level  # one rank per node
    assert not blocks_layout(4, 4).two_level  # one node


@pytest.mark.parametrize('ranks_per_node, kind, error', [
    (3, ValueError,
     'ranks_per_node=3 does not divide the 4 ranks of the process group '
     "into whole nodes: give a divisor of 4, or topology='auto'"),
    (0, ValueError, 'ranks_per_node should be an int >= 1, but got 0'),
    ('2', TypeError, "ranks_per_node should be an int >= 1, but got str: '2'"),
    (True, TypeError,
     'ranks_per_node should be an int >= 1, but got bool: True'),
])
def test_a_stated_ranks_per_node_that_cannot_be_is_named(
        ranks_per_node, kind, error):
    with pytest.raises(kind) as raised:
        blocks_layout(4, ranks_per_node)
    assert error in str(raised.value)


def test_the_launchers_word_however_the_ranks_are_placed():
    # Round robin (rank r on node r % 2), as a launcher may place them.
    claims = [NodeClaim(r % 2, r // 2, 3) for r in range(6)]
    layout, why = layout_of_claims(claims)
    assert why == ''
    assert layout == NodeLayout(((0, 2, 4), (1, 3, 5)))
    assert layout.peers_of(4) == (4, 5)


@pytest.mark.parametrize(
    'claims, why', [
        ([NodeClaim(0, 0, 2), None,
          NodeClaim(1, 0, 2),
          NodeClaim(1, 1, 2)
          ], 'the launcher did not say which node ranks [1] run on'),
        ([NodeClaim(0, 0, 2),
          NodeClaim(0, 1, 2),
          NodeClaim(1, 0, 1)
          ], 'the nodes run uneven numbers of ranks (node 0: 2, node 1: 1)'),
        ([
            NodeClaim(0, 0, 2),
            NodeClaim(0, 0, 2),
            NodeClaim(1, 0, 2),
            NodeClaim(1, 1, 2)
        ], "the launcher's word on node 0 does not add up "
         '(local ranks [0, 0], local sizes [2], 2 ranks there)'),
        ([
            NodeClaim(0, 0, 4),
            NodeClaim(0, 1, 4),
            NodeClaim(1, 0, 4),
            NodeClaim(1, 1, 4)
        ], "the launcher's word on node 0 does not add up "
         '(local ranks [0, 1], local sizes [4], 2 ranks there)'),
    ],
    ids=['unknown', 'uneven', 'twice', 'size'])
def test_a_layout_that_does_not_add_up_is_none_with_the_reason(claims, why):
    assert layout_of_claims(claims) == (None, why)


def test_a_stated_layout_the_launcher_contradicts_is_refused():
    launched = NodeLayout(((0, 2), (1, 3)))
    check_stated_layout(blocks_layout(4, 2), None)  # nothing to contradict
    check_stated_layout(launched, launched)
    with pytest.raises(ValueError) as raised:
        check_stated_layout(blocks_layout(4, 2), launched)
    assert str(raised.value) == (
        'topology says ranks_per_node=2 (2 nodes x 2 ranks (ranks (0, 1) on '
        'node 0, (2, 3) on node 1)), but the launcher placed the ranks as 2 '
        'nodes x 2 ranks (ranks (0, 2) on node 0, (1, 3) on node 1): remove '
        'ranks_per_node to follow the launcher, or launch the ranks as stated')


def _two_levels(rank, world_size, claim_of):
    """Agree, make the groups, and sum each rank's number over each."""
    layout, why = agree_on_layout(claim_of(rank))
    if layout is None:
        return None, why
    groups = make_node_groups(layout)
    inside = torch.tensor([float(rank)])
    across = torch.tensor([float(rank)])
    dist.all_reduce(inside, group=groups.intra)
    dist.all_reduce(across, group=groups.cross)
    return layout, (inside.item(), across.item())


def test_every_rank_agrees_and_the_groups_reduce_where_they_should():
    # 3 nodes x 2 ranks, placed round robin: node n holds ranks n and n + 3.
    results = run_ranks(
        _two_levels,
        lambda rank: NodeClaim(rank % 3, rank // 3, 2),
        world_size=6)
    layouts = {layout for layout, _ in results}
    assert layouts == {NodeLayout(((0, 3), (1, 4), (2, 5)))}
    for rank, (_, (inside, across)) in enumerate(results):
        node = rank % 3
        assert inside == node + (node + 3)
        # Local rank l is rank 3 * l + n on node n.
        assert across == sum(3 * (rank // 3) + n for n in range(3))


def test_one_rank_without_a_word_leaves_every_rank_flat_for_one_reason():
    # Uneven on purpose too: rank 2 alone on node 1 and no word from rank 3.
    results = run_ranks(
        _two_levels,
        lambda rank: None if rank == 3 else NodeClaim(rank // 2, rank % 2, 2),
        world_size=4)
    assert results == [
        (None, 'the launcher did not say which node ranks [3] run '
         'on')
    ] * 4


@pytest.mark.parametrize(
    'environ, claim',
    [
        (dict(GROUP_RANK='1', LOCAL_RANK='0',
              LOCAL_WORLD_SIZE='2'), NodeClaim(1, 0, 2)),
        # torchrun inside a Slurm job speaks for its ranks.
        (dict(
            GROUP_RANK='0',
            LOCAL_RANK='1',
            LOCAL_WORLD_SIZE='4',
            SLURM_NODEID='5',
            SLURM_LOCALID='0',
            SLURM_TASKS_PER_NODE='1'), NodeClaim(0, 1, 4)),
        (dict(
            SLURM_NODEID='1',
            SLURM_LOCALID='1',
            SLURM_TASKS_PER_NODE='2(x3),1'), NodeClaim(1, 1, 2)),
        (dict(
            SLURM_NODEID='3',
            SLURM_LOCALID='0',
            SLURM_TASKS_PER_NODE='2(x3),1'), NodeClaim(3, 0, 1)),
        (dict(
            SLURM_NODEID='4',
            SLURM_LOCALID='0',
            SLURM_TASKS_PER_NODE='2(x3),1'), None),
        (dict(SLURM_NODEID='0', SLURM_LOCALID='0',
              SLURM_TASKS_PER_NODE='two'), None),
        # mpirun names no node index: consecutive ranks share a node (its
        # default placement), so rank 5, second on its node of 2, is on
        # node 2; rank 2 as second of 2 cannot be (placed round robin).
        (dict(
            OMPI_COMM_WORLD_RANK='5',
            OMPI_COMM_WORLD_LOCAL_RANK='1',
            OMPI_COMM_WORLD_LOCAL_SIZE='2'), NodeClaim(2, 1, 2)),
        (dict(
            OMPI_COMM_WORLD_RANK='2',
            OMPI_COMM_WORLD_LOCAL_RANK='1',
            OMPI_COMM_WORLD_LOCAL_SIZE='2'), None),
        (dict(OMPI_COMM_WORLD_LOCAL_RANK='0',
              OMPI_COMM_WORLD_LOCAL_SIZE='2'), None),
        ({}, None),
    ],
    ids=[
        'torchrun', 'torchrun-in-slurm', 'slurm', 'slurm-last-node',
        'slurm-past-the-list', 'slurm-unreadable', 'mpirun',
        'mpirun-round-robin', 'mpirun-without-rank', 'none'
    ])
def test_what_each_launcher_says_of_a_ranks_node(environ, claim):
    assert launcher_claim(environ) == claim
