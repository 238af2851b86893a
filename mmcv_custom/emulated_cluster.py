"""Moved: the emulated cluster now lives in
:mod:`mmcv_custom.launching.emulated_cluster` (a package, one module per
concern); this module re-exports its public names, each from its module,
so that ``from mmcv_custom.emulated_cluster import ...`` keeps working.
"""
from .launching.emulated_cluster.availability import (ClusterUnavailable,
                                                      check_available,
                                                      check_user_namespace,
                                                      reexec_in_user_namespace)
from .launching.emulated_cluster.calibrate import Calibration, calibrate
from .launching.emulated_cluster.cluster import (MAX_NODES, SUBNET,
                                                 EmulatedCluster, Interrupted,
                                                 Node, check_ranks_per_node)
from .launching.emulated_cluster.counters import (LinkBytes,
                                                  namespace_link_bytes,
                                                  read_link_bytes)
from .launching.emulated_cluster.leftovers import remove_leftovers
from .launching.emulated_cluster.namespaces import NAME_PREFIX, ClusterError
from .launching.emulated_cluster.node_start import signal_exit_code
from .launching.emulated_cluster.run import (DEFAULT_PORT, TIMEOUT_EXIT_CODE,
                                             NodesFailed, RunResult,
                                             run_on_nodes)
from .launching.emulated_cluster.shaping import (TBF_BURST_BYTES, TBF_BURST_MS,
                                                 TBF_LATENCY_MS, shape_links,
                                                 tbf_burst_bytes)

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
