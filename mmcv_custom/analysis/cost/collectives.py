"""Collectives on ``M`` nodes of ``G`` ranks: what each puts on the links
and how long it takes (the formulas are in :mod:`mmcv_custom.analysis.cost`'s
docstring). A collective runs among all ``P`` ranks (a flat hook's), or at
one of the two levels of a two-level hook (:data:`LEVELS`). Standard
library only."""
import dataclasses
from typing import Mapping, Optional

from mmcv_custom.comm.cost_records import LEVELS
from mmcv_custom.comm.traffic import COLLECTIVE_KINDS
from .checks import require_count, require_positive

__all__ = [
    'COLLECTIVE_KINDS', 'LEVELS', 'FORMS', 'Collective', 'Cluster',
    'LinkConstants', 'GPU_CLUSTER_CONSTANTS', 'Traffic', 'traffic',
    'group_size', 'collective_time', 'all_reduce_time', 'all_gather_time',
    'all_to_all_time'
]

#: A hook's forms: ``'flat'`` (every rank with every rank, what
#: ``topology='flat'`` runs) and ``'two-level'`` (node-aware, what
#: ``topology='auto'`` runs on several nodes of several ranks each).
FORMS = ('flat', 'two-level')

# NVLink 4 (HGX H100/H200): 18 links of 25 GB/s per direction, 450 GB/s
# per GPU per direction (NVIDIA quotes 900 GB/s, both directions
# together). At the model's eta of 0.9 a ring gets 405 GB/s, a little
# below the 460-480 GB/s busbw nccl-tests' all_reduce_perf shows on one
# 8 x H100 SXM node (NVLink SHARP helps there): a conservative figure.
_DEFAULT_INTRA_BPS = 450e9 * 8
# NCCL's latency per ring step inside an NVSwitch node: a few us (its LL
# protocol; an 8-GPU all_reduce of a few KB takes some 10-30 us, 14
# steps). Assumed, not measured here.
_DEFAULT_INTRA_ALPHA_S = 2e-6


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a hook issues for a bucket, as one rank sees it.

    Args:
        kind (str): One of :data:`COLLECTIVE_KINDS`.
        nbytes (float): ``all_reduce``: the tensor reduced; ``all_to_all``:
            the rank's whole send tensor; ``all_gather``: the rank's own
            part (the benchmark JSON's convention); ``reduce_scatter``:
            the rank's whole input (FSDP2's, :mod:`.fsdp2`).
        bucket (int): The bucket's index. Defaults to 0.
        level (str, optional): Where a two-level hook runs it: ``'intra'``
            (among the ``G`` ranks of each node) or ``'cross'`` (among the
            ``M`` ranks of each local rank, one per node); ``nbytes`` is
            then for that group. Defaults to None: among all ranks.
    """
    kind: str
    nbytes: float
    bucket: int = 0
    level: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f'collective kind should be one of '
                             f'{list(COLLECTIVE_KINDS)}, but got '
                             f'{self.kind!r}')
        require_positive('collective bytes', self.nbytes, allow_zero=True)
        if self.level is not None and self.level not in LEVELS:
            raise ValueError(f'collective level should be None (all ranks) '
                             f'or one of {list(LEVELS)}, but got '
                             f'{self.level!r}')


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes, ranks per node and link rates.

    Args:
        nodes (int): ``M``.
        gpus_per_node (int): ``G``: ranks per node.
        link_bps (float): ``B``: each node's link, bits/s per direction.
        intra_bps (float): ``B_in``: each GPU's intra-node rate, bits/s per
            direction. Defaults to NVLink 4's 450 GB/s (900 GB/s counting
            both directions).
    """
    nodes: int
    gpus_per_node: int
    link_bps: float
    intra_bps: float = _DEFAULT_INTRA_BPS

    def __post_init__(self) -> None:
        require_count('nodes', self.nodes)
        require_count('gpus_per_node', self.gpus_per_node)
        require_positive('link_bps', self.link_bps)
        require_positive('intra_bps', self.intra_bps)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class LinkConstants:
    """The fitted (or assumed) constants of the cost model.

    Args:
        alpha_s (float): Latency per message (per ring step), seconds.
        eta (float): Achieved fraction of every link rate.
        intra_alpha_s (float): Latency per message of a two-level hook's
            collectives inside a node (NVLink, not the network). Assumed,
            not fitted (the emulated nodes have no such link). Defaults to
            2 us.
        overhead_share (Mapping[str, float]): A cost per step and hook
            beyond the model (thread hand-offs, the codec's thread taking
            cores from the backward), as a share of the compute step:
            it runs on the same cores as the compute, so a machine whose
            compute step is slower (more ranks per core) is slower at it
            alike. Fitted; 0 for hooks not named. Defaults to none.
        source (str): Where the constants come from, for the output.
    """
    alpha_s: float = 10e-6
    eta: float = 0.9
    overhead_share: Mapping[str,
                            float] = dataclasses.field(default_factory=dict)
    source: str = 'defaults'
    intra_alpha_s: float = _DEFAULT_INTRA_ALPHA_S

    def __post_init__(self) -> None:
        require_positive('alpha_s', self.alpha_s, allow_zero=True)
        require_positive('eta', self.eta)
        require_positive('intra_alpha_s', self.intra_alpha_s, allow_zero=True)


# NCCL on a GPU cluster: ~10 us per ring step, ~90% of the link rate.
GPU_CLUSTER_CONSTANTS = LinkConstants(
    alpha_s=10e-6, eta=0.9, source='defaults for NCCL on a GPU cluster')


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What a collective puts on the links, from one rank's side.

    Attributes:
        messages (int): Sequential latency steps (each costs ``alpha``).
        node_bytes (float): Bytes through each node link, per direction.
        intra_bytes (float): Bytes through each GPU's intra-node link, per
            direction, that add to the node link's time.
        intra_messages (int): Sequential latency steps of a collective
            confined to a node (a two-level hook's ``'intra'`` level), each
            costing the intra-node latency. Defaults to 0.
    """
    messages: int
    node_bytes: float
    intra_bytes: float
    intra_messages: int = 0

    def seconds(self,
                cluster: Cluster,
                alpha_s: float = 0.0,
                eta: float = 1.0,
                intra_alpha_s: float = 0.0) -> float:
        """The time with latencies ``alpha_s`` (across nodes) and
        ``intra_alpha_s`` (inside one) and efficiency ``eta``."""
        return (self.messages * alpha_s + self.intra_messages * intra_alpha_s +
                8 * (self.node_bytes / cluster.link_bps +
                     self.intra_bytes / cluster.intra_bps) / eta)


def group_size(collective: Collective, cluster: Cluster) -> int:
    """The ranks taking part in ``collective``: all of them, a node's
    ``G`` (``'intra'``) or one per node, ``M`` (``'cross'``)."""
    if collective.level == 'intra':
        return cluster.gpus_per_node
    if collective.level == 'cross':
        return cluster.nodes
    return cluster.world_size


def _ring(kind: str, nbytes: float, ranks: int):
    """Sequential steps and bytes each rank sends for ``kind`` on a ring of
    ``ranks`` (an all-to-all: its off-rank share, in ``ranks - 1``
    steps)."""
    if kind == 'all_reduce':
        return 2 * (ranks - 1), 2 * (ranks - 1) / ranks * nbytes
    if kind == 'all_gather':
        return ranks - 1, (ranks - 1) * nbytes  # (r - 1) / r of r * s
    # all_to_all, reduce_scatter: (r - 1) / r of the input leaves the rank
    return ranks - 1, (ranks - 1) / ranks * nbytes


def _level_traffic(collective: Collective, cluster: Cluster) -> Traffic:
    """A two-level hook's collective: inside a node it runs on the GPU
    links only; across nodes the node's ``G`` groups (one per local rank)
    run at once and share the node link, which therefore carries ``G``
    times what one member sends."""
    ranks = group_size(collective, cluster)
    if ranks == 1:
        return Traffic(0, 0.0, 0.0)
    steps, sent = _ring(collective.kind, collective.nbytes, ranks)
    if collective.level == 'intra':
        return Traffic(0, 0.0, sent, intra_messages=steps)
    return Traffic(steps, cluster.gpus_per_node * sent, 0.0)


def traffic(collective: Collective, cluster: Cluster) -> Traffic:
    """The links' load of ``collective`` on ``cluster`` (see the module's
    docstring for the formulas)."""
    if collective.level is not None:
        return _level_traffic(collective, cluster)
    p, m, g = cluster.world_size, cluster.nodes, cluster.gpus_per_node
    if p == 1:
        return Traffic(0, 0.0, 0.0)
    s = collective.nbytes
    if collective.kind == 'all_reduce':
        messages, moved = 2 * (p - 1), 2 * (p - 1) / p * s
    elif collective.kind == 'all_gather':
        messages, moved = p - 1, (p - 1) * s  # (P - 1) / P of P * s
    elif collective.kind == 'reduce_scatter':
        messages, moved = p - 1, (p - 1) / p * s  # a ring, half all_reduce
    else:  # all_to_all: no ring, every off-node share crosses
        return Traffic(p - 1, g * (m - 1) / m * s, (g - 1) / p * s)
    if m > 1:
        return Traffic(messages, moved, 0.0)
    return Traffic(messages, 0.0, moved)


def collective_time(collective: Collective,
                    cluster: Cluster,
                    constants: LinkConstants = GPU_CLUSTER_CONSTANTS) -> float:
    """Seconds ``collective`` takes on ``cluster``."""
    return traffic(collective,
                   cluster).seconds(cluster, constants.alpha_s, constants.eta,
                                    constants.intra_alpha_s)


def all_reduce_time(nbytes: float,
                    cluster: Cluster,
                    alpha_s: float = 0.0,
                    eta: float = 1.0) -> float:
    """Ring all-reduce of ``nbytes``:
    ``2 (P - 1) alpha + 2 (P - 1) / P * S / (eta B)``."""
    return collective_time(
        Collective('all_reduce', nbytes), cluster, LinkConstants(alpha_s, eta))


def all_gather_time(part_bytes: float,
                    cluster: Cluster,
                    alpha_s: float = 0.0,
                    eta: float = 1.0) -> float:
    """All-gather of ``part_bytes`` from each rank:
    ``(P - 1) alpha + (P - 1) / P * (P s) / (eta B)``."""
    return collective_time(
        Collective('all_gather', part_bytes), cluster,
        LinkConstants(alpha_s, eta))


def all_to_all_time(send_bytes: float,
                    cluster: Cluster,
                    alpha_s: float = 0.0,
                    eta: float = 1.0) -> float:
    """All-to-all of ``send_bytes`` per rank:
    ``(P - 1) alpha + G (M - 1) / M * S / (eta B) + (G - 1) / P * S /
    (eta B_in)``."""
    return collective_time(
        Collective('all_to_all', send_bytes), cluster,
        LinkConstants(alpha_s, eta))
