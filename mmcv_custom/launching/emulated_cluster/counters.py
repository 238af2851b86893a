"""The bytes an emulated node's link carried, from its interface's
counters: what crossed between the nodes, measured rather than counted by
the hooks.

Ranks of one node reach each other at the node's own address, which
Linux delivers through the namespace's loopback device, never through
the node's veth; so the veth's counters hold exactly the traffic between
nodes (plus TCP's acknowledgements and the packets' headers, which a
hook's own byte count leaves out).

Two ways to read them: :func:`read_link_bytes` from inside the node (a
rank reads its own node's link: ``/proc/self/net/dev``, which always
shows the reader's network namespace, unlike ``/sys/class/net``, which
shows the namespace that mounted sysfs), and :func:`namespace_link_bytes`
from outside (``ip -n NS -s -j link``).
"""
import json
from dataclasses import dataclass

from .namespaces import ClusterError, run_command

__all__ = ['LinkBytes', 'read_link_bytes', 'namespace_link_bytes']

_PROC_NET_DEV = '/proc/self/net/dev'


@dataclass(frozen=True)
class LinkBytes:
    """An interface's byte counters at one moment.

    Attributes:
        tx (int): Bytes it sent (``tx_bytes``): what the node put on its
            link.
        rx (int): Bytes it received (``rx_bytes``).
    """
    tx: int
    rx: int

    def __sub__(self, earlier: 'LinkBytes') -> 'LinkBytes':
        return LinkBytes(self.tx - earlier.tx, self.rx - earlier.rx)


def read_link_bytes(interface: str) -> LinkBytes:
    """The counters of ``interface`` in this process's network namespace.

    Raises:
        ClusterError: No such interface here (e.g. not run on a node).
    """
    with open(_PROC_NET_DEV) as f:
        lines = f.read().splitlines()[2:]  # two header lines
    for line in lines:
        name, _, fields = line.partition(':')
        if name.strip() == interface:
            values = fields.split()
            # Receive: bytes first of 8 fields; transmit: bytes 9th.
            return LinkBytes(tx=int(values[8]), rx=int(values[0]))
    raise ClusterError(f'no interface {interface!r} in this network '
                       f'namespace ({_PROC_NET_DEV}): not on an emulated '
                       'node?')


def namespace_link_bytes(namespace: str, interface: str) -> LinkBytes:
    """The counters of ``interface`` in network namespace ``namespace``,
    read from outside it.

    Raises:
        ClusterError: ``ip`` failed (no such namespace or interface).
    """
    done = run_command(
        ['ip', '-n', namespace, '-s', '-j', 'link', 'show', 'dev', interface])
    stats = json.loads(done.stdout)[0]['stats64']
    return LinkBytes(tx=stats['tx']['bytes'], rx=stats['rx']['bytes'])
