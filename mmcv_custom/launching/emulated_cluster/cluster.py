"""The emulated cluster itself: ``nodes`` network namespaces joined by a
shaped switch, made and removed as one, with a keeper for the case that
its process is killed.
"""
import ipaddress
import itertools
import logging
import os
import secrets
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from . import namespaces
from .availability import USERNS_ENV, ClusterUnavailable, missing_programs
from .leftovers import remove_leftovers
from .namespaces import (DISMISSED, KEEPER_FLAG, NAME_PREFIX, ClusterError,
                         kill_namespace_pids, namespace_exists, one_line,
                         remove_hosts, run_command, write_hosts)
from .programs import program_argv
from .shaping import (TBF_LATENCY_MS, check_bandwidth, format_mbit,
                      shape_links, tbf_burst_bytes)

__all__ = [
    'SUBNET', 'MAX_NODES', 'Interrupted', 'Node', 'EmulatedCluster',
    'check_ranks_per_node'
]

_LOG = logging.getLogger(__name__)
_SERIAL = itertools.count()

#: RFC 2544's benchmarking range: never routed on the Internet, so an
#: emulated node cannot shadow a real address it might need.
SUBNET = ipaddress.ip_network('198.18.0.0/15')
#: A Linux bridge takes at most 1024 ports (``BR_MAX_PORTS``).
MAX_NODES = 1024

#: Interface names inside the namespaces.
_NODE_IFACE = 'eth0'
_BRIDGE = 'br0'


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived while an :class:`EmulatedCluster` was
    open. Raised (like ``KeyboardInterrupt`` for SIGINT, and a
    ``BaseException`` for the same reason: ``except Exception`` must not
    swallow it) so that every ``finally`` and ``__exit__`` on the way out
    stops the nodes and removes the cluster; Python's default SIGTERM
    action would kill the process and leave the namespaces behind."""

    def __init__(self, signum: int):
        super().__init__(f'interrupted by {signal.Signals(signum).name}')
        self.signum = signum


@dataclass(frozen=True)
class Node:
    """One emulated node.

    Attributes:
        rank (int): ``NODE_RANK``; node 0 is the master.
        namespace (str): Its network namespace (``ip netns exec NAME``).
        address (str): Its IPv4 address, in :data:`SUBNET`.
        interface (str): Its interface to the switch
            (``GLOO_SOCKET_IFNAME``).
        switch_port (str): The other end, in the switch's namespace.
    """
    rank: int
    namespace: str
    address: str
    interface: str
    switch_port: str


def _check_nodes(nodes) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, int):
        raise TypeError(f'nodes should be an int, but got '
                        f'{type(nodes).__name__} {nodes!r}')
    if not 2 <= nodes <= MAX_NODES:
        raise ValueError(
            f'nodes should be an int from 2 to {MAX_NODES} (one network '
            'namespace per node; a Linux bridge takes at most '
            f'{MAX_NODES} ports), but got {nodes}')
    return nodes


def check_ranks_per_node(ranks_per_node) -> int:
    """``ranks_per_node`` if it is an int >= 1; a ``TypeError`` or
    ``ValueError`` naming the bad value and the valid range."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
        raise TypeError(f'ranks_per_node should be an int >= 1, but got '
                        f'{type(ranks_per_node).__name__} {ranks_per_node!r}')
    if ranks_per_node < 1:
        raise ValueError(
            'ranks_per_node should be an int >= 1 (ranks on each emulated '
            f'node), but got {ranks_per_node}')
    return ranks_per_node


class EmulatedCluster:
    """``nodes`` network namespaces joined by a shaped switch; a context
    manager that removes everything it made on exit.

    Entering creates, in order, the switch namespace with a bridge, then
    per node a namespace, a veth pair (node end ``eth0`` with the node's
    address; switch end on the bridge) and, when ``bandwidth_mbit`` is
    given, a tbf qdisc on both ends. Each thing is recorded before it is
    made, so that leaving the block, an exception, Ctrl-C, SIGTERM or
    SIGHUP (turned into :class:`Interrupted` while the cluster is open,
    when entered from the main thread) or a failure halfway through
    creation removes exactly what exists: every process still in a node
    is killed, every link and namespace deleted. Namespaces of other
    live runs are never touched.

    A SIGKILL of this process runs none of that, so entering also starts
    a keeper: :mod:`.namespaces` run as a small process in a session of
    its own (no signal to this process's group or terminal reaches it),
    waiting on a pipe whose other end only this process holds. When this
    process ends without closing the cluster, the pipe's end of file
    wakes the keeper, which stops everything running in the cluster's
    namespaces (SIGTERM, SIGKILL after 2 s), deletes them and logs one
    warning; :meth:`close` dismisses it. (A child forked from this process
    without ``exec`` holds the pipe too, and delays the keeper until it
    ends.) What a killed keeper leaves, the next cluster removes
    (:func:`~.leftovers.remove_leftovers`), once nothing runs in it.

    Nothing is created in the caller's network namespace: each veth pair
    is made inside the node's namespace with its peer sent straight to
    the switch's.

    Args:
        nodes (int): How many nodes, 2 to :data:`MAX_NODES`.
        bandwidth_mbit (float, optional): Each node's link rate in Mbit/s
            (10**6 bit/s), each direction. Defaults to None: not shaped
            (veth speed, several Gbit/s, bound by the host's CPUs).
        ranks_per_node (int): Ranks each node's command starts, as
            ``NPROC_PER_NODE`` in its environment (see
            :func:`~.run.run_on_nodes`). Ranks of one node share its
            namespace and reach each other at its address, through its
            loopback device: only traffic between nodes crosses the
            shaped link, as between the GPUs of a real node. Defaults
            to 1.

    Raises:
        TypeError, ValueError: At construction, for a bad ``nodes``,
            ``bandwidth_mbit`` or ``ranks_per_node``.
        ClusterUnavailable: On entering, when not root (see
            :func:`reexec_in_user_namespace`) or without iproute2.
        ClusterError: On entering, when a setup command fails (after
            everything made so far was removed).
    """

    def __init__(self,
                 nodes: int,
                 bandwidth_mbit: Optional[float] = None,
                 ranks_per_node: int = 1):
        self.num_nodes = _check_nodes(nodes)
        self.bandwidth_mbit = check_bandwidth(bandwidth_mbit)
        self.ranks_per_node = check_ranks_per_node(ranks_per_node)
        # Unique among live processes (pid), among this process's
        # clusters (counter), and unlikely to meet a leftover of a dead
        # process with the same pid (random).
        self.tag = (f'{NAME_PREFIX}{os.getpid()}-{next(_SERIAL)}'
                    f'{secrets.token_hex(2)}')
        self.switch = f'{self.tag}-sw'
        hosts = SUBNET.network_address
        self.nodes: List[Node] = [
            Node(
                rank=i,
                namespace=f'{self.tag}-node{i}',
                address=str(hosts + i + 1),
                interface=_NODE_IFACE,
                switch_port=f'n{i}') for i in range(self.num_nodes)
        ]
        # What exists (or may: recorded before the command runs), in the
        # order it was made.
        self._namespaces: List[str] = []
        self._links: List[Tuple[str, str]] = []
        self._old_handlers: Dict[int, object] = {}
        self._keeper: Optional[subprocess.Popen] = None
        self._keeper_pipe: Optional[int] = None
        self.active = False

    # Names and addresses --------------------------------------------
    @property
    def namespaces(self) -> List[str]:
        """Every namespace of the cluster, nodes first, then the switch."""
        return [n.namespace for n in self.nodes] + [self.switch]

    @property
    def master_addr(self) -> str:
        """Node 0's address: ``MASTER_ADDR``."""
        return self.nodes[0].address

    def describe(self, port: Optional[int] = None) -> List[str]:
        """The tool's header: the nodes, their addresses, the link rate,
        and what is not emulated. One string per line."""
        ranks = ('' if self.ranks_per_node == 1 else
                 f' ({self.ranks_per_node} ranks each, '
                 'NPROC_PER_NODE; they talk inside the node)')
        lines = [
            f'Emulated cluster: {self.num_nodes} nodes{ranks} on this '
            'host, one network namespace each, joined by a bridge in '
            f'{self.switch}'
        ]
        if os.environ.get(USERNS_ENV):
            lines.append('  (not root: inside an unprivileged user '
                         'namespace, with a private /run/netns)')
        for node in self.nodes:
            role = ('  MASTER_ADDR' + (f', PORT={port}' if port else '')
                    if node.rank == 0 else '')
            lines.append(f'  node{node.rank}  {node.address:<13} '
                         f'{node.interface} in {node.namespace}{role}')
        if self.bandwidth_mbit is None:
            lines.append('  links: not shaped (veth speed, bound by this '
                         "host's CPUs)")
        else:
            lines.append(
                f'  links: {format_mbit(self.bandwidth_mbit)} per node, '
                'each direction (tc tbf, burst '
                f'{tbf_burst_bytes(self.bandwidth_mbit) / 1024:.0f} KiB, '
                f'queue {TBF_LATENCY_MS} ms)')
        lines.append('  not emulated: propagation delay, jitter and loss '
                     '(no netem; rate only); all nodes share this '
                     "host's CPUs, memory and disks")
        return lines

    # Context manager --------------------------------------------------
    def __enter__(self) -> 'EmulatedCluster':
        if self.active:
            raise RuntimeError('this EmulatedCluster is already open')
        if os.geteuid() != 0:
            raise ClusterUnavailable(
                f'cannot create network namespaces: not root (uid '
                f'{os.geteuid()}); run as root, or through '
                'tools/emulated_cluster.py, which re-executes itself in '
                'an unprivileged user namespace')
        missing = missing_programs()
        if missing:
            raise ClusterUnavailable(
                'cannot create network namespaces: iproute2 '
                f'({" and ".join(missing)}) not found on PATH')
        self._install_signal_handlers()
        self.active = True
        try:
            self._start_keeper()
            removed = remove_leftovers()
            if removed:
                _LOG.warning(
                    'removed %d network namespace%s left by a killed '
                    'run (its process is gone): %s', len(removed),
                    '' if len(removed) == 1 else 's', ', '.join(removed))
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _start_keeper(self) -> None:
        """Start the keeper (see the class's description): it removes the
        cluster if this process ends without :meth:`close`."""
        read_end, write_end = os.pipe()  # neither is inherited by exec
        try:
            self._keeper = subprocess.Popen(
                program_argv(namespaces.__file__, KEEPER_FLAG, str(read_end),
                             self.tag, str(os.getpid())),
                pass_fds=(read_end, ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._keeper_pipe = write_end

    def _dismiss_keeper(self) -> None:
        if self._keeper_pipe is not None:
            try:
                os.write(self._keeper_pipe, DISMISSED)
            except OSError:  # the keeper is gone already
                pass
            os.close(self._keeper_pipe)
            self._keeper_pipe = None
        if self._keeper is not None:
            try:
                self._keeper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._keeper.kill()
                self._keeper.wait()
            self._keeper = None

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works in the main thread only

        def raise_interrupted(signum, frame):
            raise Interrupted(signum)

        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue  # e.g. SIGHUP under nohup: still ignored
            self._old_handlers[signum] = signal.signal(signum,
                                                       raise_interrupted)

    def _create(self) -> None:
        self._add_namespace(self.switch)
        sw = ['ip', '-n', self.switch]
        self._links.append((self.switch, _BRIDGE))
        # No STP: ports forward as soon as they are up.
        run_command(sw + [
            'link', 'add', 'name', _BRIDGE, 'type', 'bridge', 'stp_state', '0'
        ])
        run_command(sw + ['link', 'set', _BRIDGE, 'addrgenmode', 'none'])
        run_command(sw + ['link', 'set', _BRIDGE, 'up'])
        for node in self.nodes:
            self._add_node(node)
        # Every node's address by name in every node (see write_hosts).
        hosts = [(n.address, f'node{n.rank}') for n in self.nodes]
        for node in self.nodes:
            write_hosts(node.namespace, hosts)

    def _add_namespace(self, name: str) -> None:
        if namespace_exists(name):
            # Someone else's: not recorded, so never removed by us.
            raise ClusterError(f'network namespace {name} exists already')
        self._namespaces.append(name)
        run_command(['ip', 'netns', 'add', name])
        run_command(['ip', '-n', name, 'link', 'set', 'lo', 'up'])

    def _add_node(self, node: Node) -> None:
        ns = node.namespace
        self._add_namespace(ns)
        ip_node = ['ip', '-n', ns]
        ip_sw = ['ip', '-n', self.switch]
        self._links.append((ns, node.interface))
        run_command(ip_node + [
            'link', 'add', 'name', node.interface, 'type', 'veth', 'peer',
            'name', node.switch_port, 'netns', self.switch
        ])
        # No IPv6 link-local address: gloo binds the first address of
        # GLOO_SOCKET_IFNAME, which must be the IPv4 one.
        run_command(ip_node +
                    ['link', 'set', node.interface, 'addrgenmode', 'none'])
        run_command(ip_sw +
                    ['link', 'set', node.switch_port, 'addrgenmode', 'none'])
        run_command(ip_sw +
                    ['link', 'set', node.switch_port, 'master', _BRIDGE])
        run_command(ip_node + [
            'addr', 'add', f'{node.address}/{SUBNET.prefixlen}', 'dev',
            node.interface
        ])
        if self.bandwidth_mbit is not None:
            # Upload: the node's egress. Download: the switch's egress
            # towards the node.
            shape_links([(ns, node.interface),
                         (self.switch, node.switch_port)], self.bandwidth_mbit)
        run_command(ip_sw + ['link', 'set', node.switch_port, 'up'])
        run_command(ip_node + ['link', 'set', node.interface, 'up'])

    @property
    def shaped_links(self) -> List[Tuple[str, str]]:
        """``(namespace, device)`` of both ends of every node's link: the
        node's upload and the switch's download towards it."""
        return [
            pair for node in self.nodes
            for pair in ((node.namespace, node.interface), (self.switch,
                                                            node.switch_port))
        ]

    def set_bandwidth(self, bandwidth_mbit: Optional[float]) -> None:
        """Shape every node's link to ``bandwidth_mbit`` (None: not
        shaped), in place, while the cluster is open: a benchmark can
        change the rate between measurements without new namespaces."""
        shape_links(self.shaped_links, bandwidth_mbit)
        self.bandwidth_mbit = check_bandwidth(bandwidth_mbit)

    def close(self) -> None:
        """Kill what still runs in the nodes, delete every link and
        namespace this cluster made, and restore the signal handlers.
        Idempotent; failures are logged as warnings and the rest is still
        removed. Signals wait until it is done, so a second Ctrl-C
        cannot leave half a cluster."""
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self._teardown()
            self._dismiss_keeper()
        finally:
            for signum, handler in self._old_handlers.items():
                signal.signal(signum, handler)
            self._old_handlers.clear()
            self.active = False
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _teardown(self) -> None:
        for ns in self._namespaces:
            kill_namespace_pids(ns, signal.SIGKILL)
        # Deleting one end of a veth pair deletes both; deleting the links
        # first frees them even if a process we could not kill keeps its
        # namespace alive.
        for ns, dev in reversed(self._links):
            if ns in self._namespaces:
                run_command(['ip', '-n', ns, 'link', 'del', dev], check=False)
        self._links.clear()
        for ns in reversed(self._namespaces):
            if namespace_exists(ns):
                done = run_command(['ip', 'netns', 'del', ns], check=False)
                if done.returncode != 0:
                    _LOG.warning(
                        'could not delete network namespace %s: '
                        '%s', ns, one_line(done.stderr))
            remove_hosts(ns)
        self._namespaces.clear()
