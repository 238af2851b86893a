"""Emulate a multi-node cluster on one Linux host with network namespaces.

A communication hook earns its keep where the network is the bottleneck,
between nodes, and a single development machine has no such network: its
ranks talk over loopback at memory speed. :class:`EmulatedCluster` gives
each emulated node its own network namespace (its own interfaces, routes
and ports) and connects the nodes through a Linux bridge in one more
namespace, the "switch", one veth pair per node. The bridge is used for
every number of nodes, two included, so that one topology (a node's link
to the switch, like a NIC's cable) serves all sizes. Each node's link is
shaped in both directions with a token bucket (``tc qdisc ... tbf``):
what the node sends leaves through a tbf on its own veth end, what it
receives through a tbf on the switch's end, so ``bandwidth_mbit`` is the
node's NIC rate each way, as on a real switched cluster.

What is emulated and what is not:

* **Emulated**: the link rate of every node, each direction (tbf, burst
  64 KiB, or 2 ms of the rate above 256 Mbit/s); separate network stacks,
  so every node has its own address in the benchmarking range
  198.18.0.0/15 (RFC 2544) and its own ports (each node can listen on the
  same ``PORT``); no route out of the cluster.
* **Not emulated**: propagation delay, jitter and packet loss (they need
  ``netem``, which is not used: this package shapes the rate only); the
  nodes share the host's CPUs, memory, disks, file system and hostname, so
  compute is not scaled and a busy host slows every node.

:func:`run_on_nodes` starts one command on every node at once, with the
environment ``tools/dist_train.sh`` and ``tools/dist_test.sh`` read for a
multi-node torchrun job (``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``,
``PORT``) plus ``NPROC_PER_NODE`` (``ranks_per_node``: several ranks per
node share its namespace and talk through its loopback device, so only
traffic between nodes crosses the shaped link) and
``GLOO_SOCKET_IFNAME``, and stops them all as soon as one fails.
:mod:`.counters` reads what a node's link carried. Nothing outlives the
process that made the cluster, SIGKILL included: each node's command gets
SIGTERM when that process ends, and a
keeper process removes the namespaces and what still runs in them (see
:class:`EmulatedCluster`). :func:`calibrate` measures what a plain gloo
``all_reduce`` achieves across the emulated links.
``tools/emulated_cluster.py`` is the command line over all three.

Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
:func:`check_available` says whether this process can;
:func:`reexec_in_user_namespace` re-executes a non-root program inside an
unprivileged user namespace where it can. This package imports only the
standard library; torch is imported by the calibration's child processes
alone.

Examples:
    >>> with EmulatedCluster(2, bandwidth_mbit=100) as cluster:
    ...     result = run_on_nodes(cluster, 'echo $NODE_RANK of $NNODES')
    >>> result.returncode
    0

Modules, one concern each: :mod:`.cluster` (the namespaces, the switch
and the keeper's start), :mod:`.shaping` (the link rate), :mod:`.run`
(a command on every node), :mod:`.counters` (the bytes a link
carried), :mod:`.calibrate`, :mod:`.availability`
(root, or a user namespace), :mod:`.leftovers` (what killed clusters
left), :mod:`.node_options` (the tools' ``--nodes`` and
``--ranks-per-node``), and at the bottom :mod:`.namespaces` (namespaces
by name, setup commands, the keeper). The keeper, a node's first program and a
calibration rank run files of this package by path (:mod:`.programs`),
so those files import nothing of the package.
"""
from .availability import (ClusterUnavailable, check_available,
                           check_user_namespace, reexec_in_user_namespace)
from .calibrate import Calibration, calibrate
from .cluster import (MAX_NODES, SUBNET, EmulatedCluster, Interrupted, Node,
                      check_ranks_per_node)
from .counters import LinkBytes, namespace_link_bytes, read_link_bytes
from .leftovers import remove_leftovers
from .namespaces import NAME_PREFIX, ClusterError
from .node_start import signal_exit_code
from .run import (DEFAULT_PORT, TIMEOUT_EXIT_CODE, NodesFailed, RunResult,
                  run_on_nodes)
from .shaping import (TBF_BURST_BYTES, TBF_BURST_MS, TBF_LATENCY_MS,
                      shape_links, tbf_burst_bytes)

__all__ = [
    'NAME_PREFIX', 'SUBNET', 'DEFAULT_PORT', 'MAX_NODES', 'TIMEOUT_EXIT_CODE',
    'TBF_BURST_BYTES', 'TBF_BURST_MS', 'TBF_LATENCY_MS', 'tbf_burst_bytes',
    'ClusterUnavailable', 'ClusterError', 'NodesFailed', 'Interrupted', 'Node',
    'EmulatedCluster', 'RunResult', 'Calibration', 'check_available',
    'check_user_namespace', 'reexec_in_user_namespace', 'run_on_nodes',
    'calibrate', 'signal_exit_code', 'shape_links', 'remove_leftovers',
    'check_ranks_per_node', 'LinkBytes', 'read_link_bytes',
    'namespace_link_bytes'
]
