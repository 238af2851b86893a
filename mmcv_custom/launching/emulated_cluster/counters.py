"""The bytes an emulated node's link carried, from its interface's
counters: what crossed between the nodes, measured rather than counted by
the hooks.

Ranks of one node reach each other at the node's own address, which
Linux delivers through the namespace's loopback device, never through
the node's veth; so the veth's counters hold exactly the traffic between
nodes (plus TCP's acknowledgements and the packets' headers, which a
hook's own byte count leaves out). The packet counters take those out
again: every frame between the nodes is a TCP segment whose Ethernet, IP
and TCP headers (with Linux's default timestamps option) take
:data:`HEADER_BYTES`, and an acknowledgement is nothing else, so the
bytes less that much a packet are what TCP carried for the ranks
(:meth:`LinkBytes.payload`), comparable with what a hook counts.

Two ways to read them: :func:`read_link_bytes` from inside the node (a
rank reads its own node's link: ``/proc/self/net/dev``, which always
shows the reader's network namespace, unlike ``/sys/class/net``, which
shows the namespace that mounted sysfs), and :func:`namespace_link_bytes`
from outside (``ip -n NS -s -j link``).
"""
import json
from dataclasses import dataclass

from .namespaces import ClusterError, run_command

__all__ = [
    'LinkBytes', 'read_link_bytes', 'namespace_link_bytes', 'HEADER_BYTES'
]

#: Ethernet (14), IPv4 (20) and TCP with the timestamps option (32) bytes
#: in each frame the counters count (a GSO frame counts once, with one
#: set of headers, in both counters).
HEADER_BYTES = 14 + 20 + 32

_PROC_NET_DEV = '/proc/self/net/dev'


@dataclass(frozen=True)
class LinkBytes:
    """An interface's byte counters at one moment.

    Attributes:
        tx (int): Bytes it sent (``tx_bytes``): what the node put on its
            link.
        rx (int): Bytes it received (``rx_bytes``).
        tx_packets (int): Frames it sent; ``rx_packets``: received.
    """
    tx: int
    rx: int
    tx_packets: int = 0
    rx_packets: int = 0

    def __sub__(self, earlier: 'LinkBytes') -> 'LinkBytes':
        return LinkBytes(self.tx - earlier.tx, self.rx - earlier.rx,
                         self.tx_packets - earlier.tx_packets,
                         self.rx_packets - earlier.rx_packets)

    def payload(self) -> int:
        """What TCP carried out of the node: the bytes sent less every
        frame's headers (an acknowledgement's bytes are all headers)."""
        return self.tx - HEADER_BYTES * self.tx_packets


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
            # Receive: bytes, packets first of 8 fields; transmit: from
            # the 9th.
            return LinkBytes(
                tx=int(values[8]),
                rx=int(values[0]),
                tx_packets=int(values[9]),
                rx_packets=int(values[1]))
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
    return LinkBytes(
        tx=stats['tx']['bytes'],
        rx=stats['rx']['bytes'],
        tx_packets=stats['tx']['packets'],
        rx_packets=stats['rx']['packets'])
