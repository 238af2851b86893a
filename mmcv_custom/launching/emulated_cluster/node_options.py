"""The command-line options that place ranks on emulated nodes.

``--nodes`` and ``--ranks-per-node``, as every tool that starts an
:class:`~.cluster.EmulatedCluster` takes them (``tools/emulated_cluster.py``,
``benchmark_step_time.py``), checked in the same words. Standard library
only.
"""
import argparse

from .cluster import MAX_NODES

__all__ = ['add_node_options', 'check_node_options']


def add_node_options(parser: argparse.ArgumentParser,
                     ranks_per_node_help: str) -> None:
    """``--nodes`` (2 by default) and ``--ranks-per-node`` (1 by default,
    described by the tool: what its ranks are started by)."""
    parser.add_argument(
        '--nodes',
        type=int,
        default=2,
        help=f'emulated nodes, 2 to {MAX_NODES} (default: 2)')
    parser.add_argument(
        '--ranks-per-node',
        type=int,
        default=1,
        metavar='N',
        help=ranks_per_node_help)


def check_node_options(parser: argparse.ArgumentParser,
                       args: argparse.Namespace) -> None:
    """A usage error (exit 2) for a number of nodes a bridge cannot join
    or fewer than one rank per node."""
    if not 2 <= args.nodes <= MAX_NODES:
        parser.error(f'--nodes should be an int from 2 to {MAX_NODES} (one '
                     f'network namespace per node), but got {args.nodes}')
    if args.ranks_per_node < 1:
        parser.error('--ranks-per-node should be an int >= 1 (ranks on each '
                     f'emulated node), but got {args.ranks_per_node}')
