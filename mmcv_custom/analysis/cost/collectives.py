"""Collectives on ``M`` nodes of ``G`` ranks: what each puts on the links
and how long it takes (the formulas are in :mod:`mmcv_custom.analysis.cost`'s
docstring). Standard library only."""
import dataclasses
from typing import Mapping

from mmcv_custom.comm.traffic import COLLECTIVE_KINDS
from .checks import require_count, require_positive

__all__ = [
    'COLLECTIVE_KINDS', 'Collective', 'Cluster', 'LinkConstants',
    'GPU_CLUSTER_CONSTANTS', 'Traffic', 'traffic', 'collective_time',
    'all_reduce_time', 'all_gather_time', 'all_to_all_time'
]

# NVLink 4 (H100/H200): 900 GB/s per GPU, both directions together.
_DEFAULT_INTRA_BPS = 450e9 * 8


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a hook issues for a bucket, as one rank sees it.

    Args:
        kind (str): One of :data:`COLLECTIVE_KINDS`.
        nbytes (float): ``all_reduce``: the tensor reduced; ``all_to_all``:
            the rank's whole send tensor; ``all_gather``: the rank's own
            part (the benchmark JSON's convention).
        bucket (int): The bucket's index. Defaults to 0.
    """
    kind: str
    nbytes: float
    bucket: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f'collective kind should be one of '
                             f'{list(COLLECTIVE_KINDS)}, but got '
                             f'{self.kind!r}')
        require_positive('collective bytes', self.nbytes, allow_zero=True)


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

    def __post_init__(self) -> None:
        require_positive('alpha_s', self.alpha_s, allow_zero=True)
        require_positive('eta', self.eta)


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
    """
    messages: int
    node_bytes: float
    intra_bytes: float

    def seconds(self,
                cluster: Cluster,
                alpha_s: float = 0.0,
                eta: float = 1.0) -> float:
        """The time with latency ``alpha_s`` and efficiency ``eta``."""
        return (self.messages * alpha_s + 8 *
                (self.node_bytes / cluster.link_bps +
                 self.intra_bytes / cluster.intra_bps) / eta)


def traffic(collective: Collective, cluster: Cluster) -> Traffic:
    """The links' load of ``collective`` on ``cluster`` (see the module's
    docstring for the formulas)."""
    p, m, g = cluster.world_size, cluster.nodes, cluster.gpus_per_node
    if p == 1:
        return Traffic(0, 0.0, 0.0)
    s = collective.nbytes
    if collective.kind == 'all_reduce':
        messages, moved = 2 * (p - 1), 2 * (p - 1) / p * s
    elif collective.kind == 'all_gather':
        messages, moved = p - 1, (p - 1) * s  # (P - 1) / P of P * s
    else:  # all_to_all: no ring, every off-node share crosses
        return Traffic(p - 1, g * (m - 1) / m * s, (g - 1) / p * s)
    if m > 1:
        return Traffic(messages, moved, 0.0)
    return Traffic(messages, 0.0, moved)


def collective_time(collective: Collective,
                    cluster: Cluster,
                    constants: LinkConstants = GPU_CLUSTER_CONSTANTS) -> float:
    """Seconds ``collective`` takes on ``cluster``."""
    return traffic(collective, cluster).seconds(cluster, constants.alpha_s,
                                                constants.eta)


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
