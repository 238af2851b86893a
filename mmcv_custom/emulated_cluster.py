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
  ``netem``, which is not used: this module shapes the rate only); the
  nodes share the host's CPUs, memory, disks, file system and hostname, so
  compute is not scaled and a busy host slows every node.

:func:`run_on_nodes` starts one command on every node at once, with the
environment ``tools/dist_train.sh`` and ``tools/dist_test.sh`` read for a
multi-node torchrun job (``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``,
``PORT``) plus ``GLOO_SOCKET_IFNAME``, and stops them all as soon as one
fails. Nothing outlives the process that made the cluster, SIGKILL
included: each node's command gets SIGTERM when that process ends, and a
keeper process removes the namespaces and what still runs in them (see
:class:`EmulatedCluster`). :func:`calibrate` measures what a plain gloo
``all_reduce`` achieves across the emulated links.
``tools/emulated_cluster.py`` is the command line over all three.

Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
:func:`check_available` says whether this process can;
:func:`reexec_in_user_namespace` re-executes a non-root program inside an
unprivileged user namespace where it can. This module imports only the
standard library; torch is imported by the calibration's child processes
alone.

Examples:
    >>> with EmulatedCluster(2, bandwidth_mbit=100) as cluster:
    ...     result = run_on_nodes(cluster, 'echo $NODE_RANK of $NNODES')
    >>> result.returncode
    0
"""
import ipaddress
import itertools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Dict, List, Optional, Sequence, Tuple, Union

__all__ = [
    'NAME_PREFIX', 'SUBNET', 'DEFAULT_PORT', 'MAX_NODES', 'TIMEOUT_EXIT_CODE',
    'TBF_BURST_BYTES', 'TBF_BURST_MS', 'TBF_LATENCY_MS', 'tbf_burst_bytes',
    'ClusterUnavailable', 'ClusterError', 'NodesFailed', 'Interrupted', 'Node',
    'EmulatedCluster', 'RunResult', 'Calibration', 'check_available',
    'check_user_namespace', 'reexec_in_user_namespace', 'run_on_nodes',
    'calibrate', 'signal_exit_code', 'shape_links', 'remove_leftovers'
]

_LOG = logging.getLogger(__name__)
_SERIAL = itertools.count()

#: Every namespace this module creates is named ``mmcvc-<pid>-<hex>-...``,
#: so that two runs never collide and a leftover one (after SIGKILL) says
#: which process made it.
NAME_PREFIX = 'mmcvc-'
#: RFC 2544's benchmarking range: never routed on the Internet, so an
#: emulated node cannot shadow a real address it might need.
SUBNET = ipaddress.ip_network('198.18.0.0/15')
#: ``PORT`` when none is given; each node has its own ports, so it never
#: clashes with the host's or another cluster's.
DEFAULT_PORT = 29500
#: A Linux bridge takes at most 1024 ports (``BR_MAX_PORTS``).
MAX_NODES = 1024
#: The exit code of a run stopped by its timeout, as timeout(1) uses.
TIMEOUT_EXIT_CODE = 124
#: The least tbf may send at once (its bucket): one full-size TSO segment
#: of a veth. Above 256 Mbit/s the bucket holds :data:`TBF_BURST_MS` of
#: the rate instead: with a bucket no larger than one segment, tbf sends a
#: segment only once the bucket is full again, every timer delay is lost,
#: and 1 Gbit/s measured 0.78 Gbit/s (0.96 with 2 ms).
TBF_BURST_BYTES = 64 * 1024
#: Above 256 Mbit/s, the bucket in milliseconds of the rate.
TBF_BURST_MS = 2
#: How long a packet may wait in tbf's queue before it is dropped: the
#: queue a switch port might have. TCP needs a queue of about one
#: bandwidth-delay product to fill the link.
TBF_LATENCY_MS = 50

#: Interface names inside the namespaces.
_NODE_IFACE = 'eth0'
_BRIDGE = 'br0'
#: Set in the environment of a program re-executed by
#: :func:`reexec_in_user_namespace`, to say so and never loop.
_USERNS_ENV = 'MMCVC_USER_NAMESPACE'
_CHILD_FLAG = '--calibration-child'
#: This file run as a cluster's keeper, and as a node's first program.
_KEEPER_FLAG = '--keeper'
_NODE_FLAG = '--node'
#: What a maker that closed its cluster itself tells its keeper.
_DISMISSED = b'closed'
#: Seconds a keeper waits between SIGTERM and SIGKILL.
_KEEPER_GRACE = 2.0
#: What a node's first process gets when the process running the nodes
#: ends: SIGTERM, so that a launcher there can stop its ranks itself.
_NODE_DEATH_SIGNAL = signal.SIGTERM
_PR_SET_PDEATHSIG = 1
_USERNS_SETUP = (
    # A private /run/netns for `ip netns add`, in the new mount namespace;
    # where there is none, a private /run to make it in.
    'set -e; if [ -d /run/netns ]; then '
    'mount -t tmpfs -o mode=0755 mmcvc /run/netns; '
    'else mount -t tmpfs -o mode=0755 mmcvc /run; mkdir /run/netns; fi; '
    'exec "$@"')
_UNSHARE = [
    'unshare', '--user', '--map-root-user', '--net', '--mount',
    '--propagation', 'private'
]


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be created here; the message is one line
    saying what was tried and why it failed."""


class ClusterError(RuntimeError):
    """A command that builds or runs the emulated cluster failed."""


class NodesFailed(RuntimeError):
    """A run on the nodes failed or timed out; ``result`` says which node
    and how (a :class:`RunResult`)."""

    def __init__(self, message: str, result: 'RunResult'):
        super().__init__(message)
        self.result = result


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


def signal_exit_code(signum: int) -> int:
    """The shell's exit code for death by ``signum``: ``128 + signum``
    (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def _one_line(text: str) -> str:
    return '; '.join(ln.strip() for ln in text.strip().splitlines()
                     if ln.strip())


def _run(cmd: Sequence[str],
         check: bool = True) -> subprocess.CompletedProcess:
    """Run a short setup command (``ip``, ``tc``); raise
    :class:`ClusterError` naming it and its error when ``check``."""
    _LOG.debug('+ %s', ' '.join(cmd))
    done = subprocess.run(
        list(cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(
            f'`{" ".join(cmd)}` failed with exit code {done.returncode}: '
            f'{_one_line(done.stderr) or "no message"}')
    return done


def _missing_programs() -> List[str]:
    return [p for p in ('ip', 'tc') if shutil.which(p) is None]


def _probe_script(name: str) -> str:
    """Shell commands that make what a cluster needs, once, and remove it:
    a namespace, a veth pair in it, a tbf on one end."""
    return (f'ip netns add {name} && '
            f'{{ ip -n {name} link add name p0 type veth peer name p1 && '
            f'tc -n {name} qdisc add dev p0 root tbf rate 1mbit '
            f'burst {TBF_BURST_BYTES} latency {TBF_LATENCY_MS}ms; '
            f'rc=$?; ip netns del {name}; exit $rc; }}')


def _probe_name() -> str:
    return f'{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(2)}-probe'


def check_available() -> Optional[str]:
    """Why :class:`EmulatedCluster` cannot work in this process, or None.

    Tries what a cluster does, once: add a namespace, a veth pair and a
    tbf qdisc, then removes them (about 50 ms). Tests skip with the
    returned line.

    Returns:
        Optional[str]: None when it works, else one line saying what was
        tried and why it failed.
    """
    if not sys.platform.startswith('linux'):
        return (f'emulated clusters need Linux network namespaces, but '
                f'this is {sys.platform}')
    missing = _missing_programs()
    if missing:
        return (f'emulated clusters need iproute2 ({" and ".join(missing)} '
                'not found on PATH)')
    if os.geteuid() != 0:
        return (f'not root (uid {os.geteuid()}): creating network '
                'namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN; run as '
                'root, or through tools/emulated_cluster.py, which '
                're-executes itself in an unprivileged user namespace')
    done = _run(['sh', '-c', _probe_script(_probe_name())], check=False)
    if done.returncode != 0:
        why = _one_line(done.stderr) or f'exit code {done.returncode}'
        return f'cannot create network namespaces as root: {why}'
    return None


def check_user_namespace() -> Optional[str]:
    """Why :func:`reexec_in_user_namespace` cannot work here, or None.

    Runs the probe of :func:`check_available` inside ``unshare --user
    --map-root-user --net --mount`` with a private tmpfs on
    ``/run/netns``, as the re-executed program would run.
    """
    missing = _missing_programs() + ([] if shutil.which('unshare') else
                                     ['unshare'])
    if missing:
        return (f'an unprivileged user namespace needs util-linux and '
                f'iproute2 ({" and ".join(missing)} not found on PATH)')
    done = _run(
        _UNSHARE + [
            '--', 'sh', '-c', _USERNS_SETUP, 'sh', 'sh', '-c',
            _probe_script(_probe_name())
        ],
        check=False)
    if done.returncode != 0:
        return ('an unprivileged user namespace (`unshare --user '
                '--map-root-user --net --mount`, tmpfs on /run/netns) '
                f'failed: {_one_line(done.stderr) or "no message"}')
    return None


def reexec_in_user_namespace(argv: Sequence[str]) -> None:
    """Replace this process by ``argv`` run as root of a new user namespace.

    For a program that is not root: inside ``unshare --user
    --map-root-user --net --mount`` it holds CAP_SYS_ADMIN and
    CAP_NET_ADMIN over namespaces it creates, ``/run/netns`` is a private
    tmpfs (so ``ip netns add`` works and nothing is left behind) and its
    outer network namespace is new as well, so nothing is created in the
    host's. Files it writes belong to the calling user. The process keeps
    its pid (``unshare`` and the shell exec), so signals sent to it still
    reach the program.

    Args:
        argv (Sequence[str]): The program and its arguments, e.g.
            ``[sys.executable] + sys.argv``.

    Raises:
        ClusterUnavailable: Already re-executed once, or the user
            namespace does not work here (one line: what was tried, why
            it failed). On success this function does not return.
    """
    if os.environ.get(_USERNS_ENV):
        raise ClusterUnavailable(
            'already re-executed in a user namespace, and still cannot '
            f'create network namespaces: {check_available()}')
    reason = check_user_namespace()
    if reason is not None:
        raise ClusterUnavailable(
            f'cannot create network namespaces: not root (uid '
            f'{os.geteuid()}), and {reason}')
    os.environ[_USERNS_ENV] = '1'
    cmd = _UNSHARE + ['--', 'sh', '-c', _USERNS_SETUP, 'sh'] + list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)


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


def _check_bandwidth(bandwidth_mbit) -> Optional[float]:
    if bandwidth_mbit is None:
        return None
    if isinstance(bandwidth_mbit,
                  bool) or not isinstance(bandwidth_mbit, (int, float)):
        raise TypeError(
            'bandwidth_mbit should be a number of Mbit/s or None (not '
            f'shaped), but got {type(bandwidth_mbit).__name__} '
            f'{bandwidth_mbit!r}')
    if not (math.isfinite(bandwidth_mbit) and bandwidth_mbit > 0):
        raise ValueError(
            'bandwidth_mbit should be a finite number of Mbit/s > 0, or '
            f'None for links that are not shaped, but got {bandwidth_mbit}')
    return float(bandwidth_mbit)


def shape_links(links: Sequence[Tuple[str, str]],
                bandwidth_mbit: Optional[float]) -> None:
    """Put a tbf of ``bandwidth_mbit`` on each ``(namespace, device)`` of
    ``links`` (replacing what is there), or with None remove it.

    A function of names, not of a cluster object, so that a process
    running on a node (a benchmark's rank 0) can change the rate of the
    cluster it runs in.

    Raises:
        TypeError, ValueError: A bad ``bandwidth_mbit``.
        ClusterError: ``tc`` failed to shape a link.
    """
    rate = _check_bandwidth(bandwidth_mbit)
    for ns, dev in links:
        if rate is None:
            # Fails harmlessly where nothing was shaped.
            _run(['tc', '-n', ns, 'qdisc', 'del', 'dev', dev, 'root'],
                 check=False)
            continue
        _run([
            'tc', '-n', ns, 'qdisc', 'replace', 'dev', dev, 'root', 'tbf',
            'rate', f'{int(round(rate * 1e6))}bit', 'burst',
            str(tbf_burst_bytes(rate)), 'latency', f'{TBF_LATENCY_MS}ms'
        ])


def tbf_burst_bytes(bandwidth_mbit: float) -> int:
    """tbf's bucket for a rate: :data:`TBF_BURST_BYTES`, or
    :data:`TBF_BURST_MS` of the rate where that is more."""
    return max(TBF_BURST_BYTES,
               int(bandwidth_mbit * 1e6 / 8 * TBF_BURST_MS / 1000))


def _format_mbit(mbit: float) -> str:
    return f'{mbit:g} Mbit/s'


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
    a keeper: this file run as a small process in a session of its own
    (no signal to this process's group or terminal reaches it), waiting
    on a pipe whose other end only this process holds. When this process
    ends without closing the cluster, the pipe's end of file wakes the
    keeper, which stops everything running in the cluster's namespaces
    (SIGTERM, SIGKILL after 2 s), deletes them and logs one warning;
    :meth:`close` dismisses it. (A child forked from this process without
    ``exec`` holds the pipe too, and delays the keeper until it ends.)
    What a killed keeper leaves, the next cluster removes
    (:func:`remove_leftovers`), once nothing runs in it.

    Nothing is created in the caller's network namespace: each veth pair
    is made inside the node's namespace with its peer sent straight to
    the switch's.

    Args:
        nodes (int): How many nodes, 2 to :data:`MAX_NODES`.
        bandwidth_mbit (float, optional): Each node's link rate in Mbit/s
            (10**6 bit/s), each direction. Defaults to None: not shaped
            (veth speed, several Gbit/s, bound by the host's CPUs).

    Raises:
        TypeError, ValueError: At construction, for a bad ``nodes`` or
            ``bandwidth_mbit``.
        ClusterUnavailable: On entering, when not root (see
            :func:`reexec_in_user_namespace`) or without iproute2.
        ClusterError: On entering, when a setup command fails (after
            everything made so far was removed).
    """

    def __init__(self, nodes: int, bandwidth_mbit: Optional[float] = None):
        self.num_nodes = _check_nodes(nodes)
        self.bandwidth_mbit = _check_bandwidth(bandwidth_mbit)
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
        lines = [
            f'Emulated cluster: {self.num_nodes} nodes on this host, '
            'one network namespace each, joined by a bridge in '
            f'{self.switch}'
        ]
        if os.environ.get(_USERNS_ENV):
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
                f'  links: {_format_mbit(self.bandwidth_mbit)} per node, '
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
        missing = _missing_programs()
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
                [sys.executable] + _interpreter_flags() + [
                    os.path.abspath(__file__), _KEEPER_FLAG,
                    str(read_end), self.tag,
                    str(os.getpid())
                ],
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
                os.write(self._keeper_pipe, _DISMISSED)
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
        _run(sw + [
            'link', 'add', 'name', _BRIDGE, 'type', 'bridge', 'stp_state', '0'
        ])
        _run(sw + ['link', 'set', _BRIDGE, 'addrgenmode', 'none'])
        _run(sw + ['link', 'set', _BRIDGE, 'up'])
        for node in self.nodes:
            self._add_node(node)

    def _add_namespace(self, name: str) -> None:
        if _namespace_exists(name):
            # Someone else's: not recorded, so never removed by us.
            raise ClusterError(f'network namespace {name} exists already')
        self._namespaces.append(name)
        _run(['ip', 'netns', 'add', name])
        _run(['ip', '-n', name, 'link', 'set', 'lo', 'up'])

    def _add_node(self, node: Node) -> None:
        ns = node.namespace
        self._add_namespace(ns)
        ip_node = ['ip', '-n', ns]
        ip_sw = ['ip', '-n', self.switch]
        self._links.append((ns, node.interface))
        _run(ip_node + [
            'link', 'add', 'name', node.interface, 'type', 'veth', 'peer',
            'name', node.switch_port, 'netns', self.switch
        ])
        # No IPv6 link-local address: gloo binds the first address of
        # GLOO_SOCKET_IFNAME, which must be the IPv4 one.
        _run(ip_node + ['link', 'set', node.interface, 'addrgenmode', 'none'])
        _run(ip_sw + ['link', 'set', node.switch_port, 'addrgenmode', 'none'])
        _run(ip_sw + ['link', 'set', node.switch_port, 'master', _BRIDGE])
        _run(ip_node + [
            'addr', 'add', f'{node.address}/{SUBNET.prefixlen}', 'dev',
            node.interface
        ])
        if self.bandwidth_mbit is not None:
            # Upload: the node's egress. Download: the switch's egress
            # towards the node.
            shape_links([(ns, node.interface),
                         (self.switch, node.switch_port)], self.bandwidth_mbit)
        _run(ip_sw + ['link', 'set', node.switch_port, 'up'])
        _run(ip_node + ['link', 'set', node.interface, 'up'])

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
        self.bandwidth_mbit = _check_bandwidth(bandwidth_mbit)

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
            _kill_namespace_pids(ns, signal.SIGKILL)
        # Deleting one end of a veth pair deletes both; deleting the links
        # first frees them even if a process we could not kill keeps its
        # namespace alive.
        for ns, dev in reversed(self._links):
            if ns in self._namespaces:
                _run(['ip', '-n', ns, 'link', 'del', dev], check=False)
        self._links.clear()
        for ns in reversed(self._namespaces):
            if _namespace_exists(ns):
                done = _run(['ip', 'netns', 'del', ns], check=False)
                if done.returncode != 0:
                    _LOG.warning(
                        'could not delete network namespace %s: '
                        '%s', ns, _one_line(done.stderr))
        self._namespaces.clear()


#: Where ``ip netns add`` puts a named namespace.
_NETNS_DIR = '/run/netns'


def _maker_pid(name: str) -> Optional[int]:
    """The pid in a name this module gave (``mmcvc-<pid>-...``), else
    None."""
    if not name.startswith(NAME_PREFIX):
        return None
    pid = name[len(NAME_PREFIX):].split('-', 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    # integrity's process_alive, written again on purpose: this module
    # also runs as a file (the calibration's children; a bare python3
    # when not root), so it imports nothing of the package.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _cluster_tag(name: str) -> str:
    """The cluster a namespace of this module belongs to: its name up to
    the last ``-`` (``mmcvc-<pid>-<serial><hex>``)."""
    return name.rsplit('-', 1)[0]


#: Killed clusters already said to be still running, said once each.
_STILL_RUNNING: set = set()


def remove_leftovers() -> List[str]:
    """Delete the namespaces of clusters whose process is gone.

    A cluster removes what it made on every exit, and its keeper when
    its process is killed; only a cluster whose keeper was killed as well
    leaves its namespaces and the veth pairs in them, which would stay
    until reboot and accumulate. A namespace counts as left over only
    when its name is one this module gives and the process named in it
    no longer exists. One cluster's namespaces (the same
    ``mmcvc-<pid>-<hex>-`` prefix) go together, and only once nothing
    runs in any of them: a node still running would lose its network
    under it. When something does, all of them stay, with one warning
    per cluster naming the namespaces and the processes in them.

    Returns:
        list[str]: The namespaces deleted, sorted.
    """
    try:
        names = sorted(os.listdir(_NETNS_DIR))
    except OSError:
        return []
    clusters: Dict[str, List[str]] = {}
    for name in names:
        pid = _maker_pid(name)
        if pid is None or _alive(pid):
            continue
        clusters.setdefault(_cluster_tag(name), []).append(name)
    removed = []
    for tag, members in sorted(clusters.items()):
        running = {ns: _namespace_pids(ns) for ns in members}
        running = {ns: pids for ns, pids in running.items() if pids}
        if running:
            if tag not in _STILL_RUNNING:
                _STILL_RUNNING.add(tag)
                _LOG.warning(
                    'left the network namespaces of a killed cluster in '
                    'place (its process %d is gone, but processes still '
                    'run in them): %s; once they end (kill %s), the next '
                    'cluster removes the namespaces', _maker_pid(members[0]),
                    ', '.join(f'{ns} (pids {", ".join(map(str, running[ns]))})'
                              if ns in running else ns for ns in members),
                    ' '.join(
                        str(p) for ns in members for p in running.get(ns, ())))
            continue
        removed += _delete_namespaces(members)
    return sorted(removed)


def _delete_namespaces(names: Sequence[str]) -> List[str]:
    """``ip netns del`` each of ``names``, the switch last; the names
    deleted."""
    deleted = []
    for name in sorted(names, key=lambda n: n.endswith('-sw')):
        if _run(['ip', 'netns', 'del', name], check=False).returncode == 0:
            deleted.append(name)
    return deleted


def _namespace_exists(name: str) -> bool:
    return os.path.exists(os.path.join(_NETNS_DIR, name))


def _namespace_pids(ns: str) -> List[int]:
    done = _run(['ip', 'netns', 'pids', ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_namespace_pids(ns: str, signum: int) -> List[int]:
    """Send ``signum`` to every process in ``ns`` (one of ours: whatever
    runs there was started by :func:`run_on_nodes`). Returns their pids."""
    if not _namespace_exists(ns):
        return []
    pids = _namespace_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return pids


@dataclass(frozen=True)
class RunResult:
    """How a :func:`run_on_nodes` ended.

    Attributes:
        returncodes (tuple): Each node's exit code as ``Popen`` reports it
            (negative: killed by that signal, e.g. after another node
            failed).
        failed_node (int, optional): The first node seen to exit non-zero;
            None if none did.
        timed_out (bool): Whether the timeout stopped the run.
        elapsed (float): Seconds from start to the last node's exit.
    """
    returncodes: Tuple[Optional[int], ...]
    failed_node: Optional[int]
    timed_out: bool
    elapsed: float

    @property
    def returncode(self) -> int:
        """A shell's exit code for the run: the failed node's (``128 + N``
        when signal N killed it), :data:`TIMEOUT_EXIT_CODE` for a timeout,
        else 0."""
        if self.failed_node is not None:
            code = self.returncodes[self.failed_node]
            return signal_exit_code(-code) if code < 0 else code
        return TIMEOUT_EXIT_CODE if self.timed_out else 0

    def describe(self) -> str:
        """One line saying how the run ended."""
        if self.failed_node is not None:
            code = self.returncodes[self.failed_node]
            how = (f'was killed by {signal.Signals(-code).name}'
                   if code < 0 else f'exited with code {code}')
            return (f'node{self.failed_node} {how} after '
                    f'{self.elapsed:.1f} s; stopped the other nodes')
        if self.timed_out:
            return (f'timed out after {self.elapsed:.1f} s; stopped all '
                    'nodes')
        return (f'all {len(self.returncodes)} nodes exited with code 0 '
                f'after {self.elapsed:.1f} s')


def _node_env(cluster: EmulatedCluster, node: Node, port: int,
              env: Optional[Dict[str, str]]) -> Dict[str, str]:
    merged = dict(os.environ if env is None else env)
    # Prefixed lines are only useful when they arrive as they are written.
    merged.setdefault('PYTHONUNBUFFERED', '1')
    merged.update(
        NNODES=str(cluster.num_nodes),
        NODE_RANK=str(node.rank),
        MASTER_ADDR=cluster.master_addr,
        PORT=str(port),
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=node.interface)
    return merged


def _pump(node: int, pipe: IO[bytes], stream: Optional[IO[str]],
          log: Optional[IO[bytes]], lock: threading.Lock) -> None:
    """Copy a node's output line by line to ``stream`` (prefixed) and
    ``log`` (as it is) until the node closes it."""
    try:
        for raw in iter(pipe.readline, b''):
            if log is not None:
                log.write(raw)
                log.flush()
            if stream is not None:
                text = raw.decode('utf-8', 'replace').rstrip('\r\n')
                with lock:
                    stream.write(f'[node{node}] {text}\n')
                    stream.flush()
    finally:
        pipe.close()
        if log is not None:
            log.close()


def _killpg(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: List[subprocess.Popen], cluster: EmulatedCluster,
          grace: float) -> None:
    """SIGTERM every node's process group and every process left in the
    nodes; SIGKILL what remains after ``grace`` seconds.

    Process groups alone are not enough: torchrun starts its workers in
    sessions of their own (and forwards SIGTERM to them itself), and a
    command may leave daemons behind; whatever is in a node's namespace
    was started there by us, so it is all stopped."""
    namespaces = [n.namespace for n in cluster.nodes]
    for proc in procs:
        if proc.poll() is None:
            _killpg(proc, signal.SIGTERM)
    for ns in namespaces:
        _kill_namespace_pids(ns, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs) and not any(
                _namespace_pids(ns) for ns in namespaces):
            break
        time.sleep(0.1)
    else:
        for proc in procs:
            if proc.poll() is None:
                _killpg(proc, signal.SIGKILL)
        for ns in namespaces:
            _kill_namespace_pids(ns, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (D state)
            _LOG.warning('process %d did not exit after SIGKILL', proc.pid)


def _start_on_node(cluster: EmulatedCluster, node, argv: List[str], port: int,
                   env: Optional[Dict[str, str]], log_dir: Optional[str],
                   stream: Optional[IO[str]], lock: threading.Lock):
    """Start ``argv`` in ``node``'s namespace, in a session of its own,
    ending with this process (see :func:`_node_argv`), and a thread
    pumping its output to ``stream`` and its log."""
    log = (
        open(os.path.join(log_dir, f'node{node.rank}.log'), 'wb')
        if log_dir is not None else None)
    try:
        proc = subprocess.Popen(
            _node_argv(node.namespace, argv),
            env=_node_env(cluster, node, port, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True)
    except BaseException:
        if log is not None:
            log.close()
        raise
    pump = threading.Thread(
        target=_pump,
        args=(node.rank, proc.stdout, stream, log, lock),
        name=f'node{node.rank}-output',
        daemon=True)
    pump.start()
    return proc, pump


def _node_argv(namespace: str, argv: List[str]) -> List[str]:
    """``ip netns exec NAMESPACE ARGV``, started through this file, which
    sets the process's parent-death signal first (SIGTERM, kept through
    ``exec``): a node's command ends as soon as the process that started
    it does, SIGKILL included, before the cluster's keeper sweeps the
    rest. (A small program rather than ``preexec_fn``, which is unsafe
    beside the output threads.)"""
    return [sys.executable] + _interpreter_flags() + [
        os.path.abspath(__file__), _NODE_FLAG,
        str(os.getpid()), '--', 'ip', 'netns', 'exec', namespace
    ] + argv


def _wait_for_nodes(procs: List[subprocess.Popen], start: float,
                    timeout: Optional[float]) -> Tuple[Optional[int], bool]:
    """Wait until every node exited, one failed or ``timeout`` passed since
    ``start``; ``(first failed node or None, whether it timed out)``."""
    while True:
        codes = [p.poll() for p in procs]
        failed = next(
            (i for i, c in enumerate(codes) if c is not None and c != 0), None)
        if failed is not None or all(c is not None for c in codes):
            return failed, False
        if timeout is not None and time.monotonic() - start > timeout:
            return None, True
        time.sleep(0.05)


def run_on_nodes(cluster: EmulatedCluster,
                 command: Union[str, Sequence[str]],
                 *,
                 port: int = DEFAULT_PORT,
                 env: Optional[Dict[str, str]] = None,
                 timeout: Optional[float] = None,
                 log_dir: Optional[str] = None,
                 stream: Optional[IO[str]] = None,
                 grace: float = 5.0) -> RunResult:
    """Run ``command`` on every node at once and wait for all of them.

    Each node runs it in its namespace (``ip netns exec``), in a session
    of its own, with stdin closed and the environment ``env`` (default:
    this process's) plus ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` (node
    0's address), ``PORT`` and ``MASTER_PORT`` (``port``),
    ``GLOO_SOCKET_IFNAME`` (the node's interface; gloo would otherwise
    resolve the hostname, which all nodes share) and, unless set,
    ``PYTHONUNBUFFERED=1``. These are what ``tools/dist_train.sh`` and
    ``tools/dist_test.sh`` read for a multi-node torchrun job.

    As soon as one node exits non-zero, or ``timeout`` passes, or this
    process is interrupted (Ctrl-C, or :class:`Interrupted` inside an
    open cluster), the other nodes get SIGTERM (their whole process
    groups, and every process left in their namespaces), then SIGKILL
    after ``grace`` seconds. When this returns or raises, no process is
    left in any node, including daemons a successful command left
    behind: the nodes are clean for the next run.

    Args:
        cluster (EmulatedCluster): An open cluster.
        command (str | Sequence[str]): A string is run by ``bash -c``
            (so ``$NODE_RANK`` expands on each node); a sequence is run
            as it is.
        port (int): ``PORT``. Defaults to :data:`DEFAULT_PORT`.
        env (dict, optional): The base environment. Defaults to None,
            meaning ``os.environ``.
        timeout (float, optional): Seconds before every node is stopped.
            Defaults to None: no limit.
        log_dir (str, optional): When given, node ``i``'s output also goes
            to ``log_dir/node{i}.log`` (created if needed).
        stream (IO[str], optional): Where each output line goes, prefixed
            with ``[node{i}] ``. Defaults to None: only to the logs.
        grace (float): Seconds between SIGTERM and SIGKILL. Defaults to 5.

    Returns:
        RunResult: Each node's exit code, the first that failed, whether
        it timed out.

    Raises:
        KeyboardInterrupt, Interrupted: After stopping every node.
    """
    if not cluster.active:
        raise RuntimeError('run_on_nodes needs an open EmulatedCluster '
                           '(inside its `with` block)')
    if isinstance(
            port,
            bool) or not isinstance(port, int) or not (1 <= port <= 65535):
        raise ValueError(f'port should be an int from 1 to 65535, but got '
                         f'{port!r}')
    if timeout is not None and not timeout > 0:
        raise ValueError(f'timeout should be > 0 seconds or None, but got '
                         f'{timeout!r}')
    argv = (['bash', '-c', command]
            if isinstance(command, str) else list(command))
    if not argv:
        raise ValueError('command should not be empty')
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    lock = threading.Lock()
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    start = time.monotonic()
    try:
        for node in cluster.nodes:
            proc, pump = _start_on_node(cluster, node, argv, port, env,
                                        log_dir, stream, lock)
            procs.append(proc)
            pumps.append(pump)
        failed, timed_out = _wait_for_nodes(procs, start, timeout)
        elapsed = time.monotonic() - start
    finally:
        # Also on Ctrl-C and Interrupted: nothing may outlive the call.
        _stop(procs, cluster, grace)
        for pump in pumps:
            pump.join(timeout=5)
    return RunResult(
        returncodes=tuple(p.returncode for p in procs),
        failed_node=failed,
        timed_out=timed_out,
        elapsed=elapsed)


# Calibration ----------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """What a gloo ``all_reduce`` achieved across the emulated nodes.

    Attributes:
        nodes (int): Ranks, one per node.
        size_bytes (int): The fp32 tensor reduced.
        times (tuple): Seconds per timed all_reduce (the slowest rank's).
        bandwidth_mbit (float, optional): The set link rate; None when
            not shaped.
    """
    nodes: int
    size_bytes: int
    times: Tuple[float, ...]
    bandwidth_mbit: Optional[float]

    @property
    def seconds(self) -> float:
        """The median time of one all_reduce."""
        return statistics.median(self.times)

    @property
    def busbw_mbit(self) -> float:
        """Bus bandwidth in Mbit/s, as nccl-tests define it for
        all_reduce: ``size * 2 (n - 1) / n / time``, the rate each rank's
        link carries in each direction with a ring algorithm, so it is
        directly comparable with the set link rate."""
        factor = 2 * (self.nodes - 1) / self.nodes
        return self.size_bytes * factor * 8 / self.seconds / 1e6

    @property
    def ratio(self) -> Optional[float]:
        """Bus bandwidth over the set rate; None when not shaped."""
        if self.bandwidth_mbit is None:
            return None
        return self.busbw_mbit / self.bandwidth_mbit

    def describe(self) -> str:
        """One line for the tool's header."""
        line = (f'calibration: gloo all_reduce of {self.size_bytes / 2**20:g}'
                f' MiB fp32, {self.nodes} ranks (one per node), median of '
                f'{len(self.times)}: {self.seconds:.3f} s, bus bandwidth '
                f'{self.busbw_mbit:.1f} Mbit/s')
        if self.bandwidth_mbit is None:
            return line + ' (links not shaped)'
        return (line + f' = {self.ratio:.2f} x the set '
                f'{_format_mbit(self.bandwidth_mbit)}')


def _interpreter_flags() -> List[str]:
    # The child runs this file as a script; Python would put mmcv_custom/
    # first on sys.path, where modules such as `datasets` or `version`
    # could shadow packages torch imports. -P (3.11+) leaves it out; -I
    # does as well on older Pythons, but also ignores PYTHON* variables.
    return ['-P'] if sys.version_info >= (3, 11) else ['-I']


def calibrate(cluster: EmulatedCluster,
              *,
              size_mib: float = 16,
              warmup: int = 2,
              iters: int = 5,
              port: int = DEFAULT_PORT,
              timeout: Optional[float] = None,
              python: Optional[str] = None,
              stream: Optional[IO[str]] = None) -> Calibration:
    """Measure a plain gloo all_reduce across the emulated nodes.

    One rank per node (``RANK=NODE_RANK``, ``WORLD_SIZE=NNODES``, gloo on
    the node's interface) all-reduces an fp32 tensor of ``size_mib`` MiB
    ``warmup`` times, then ``iters`` times behind a barrier each; each
    iteration counts as its slowest rank. The result is what a hook can
    hope for on these links: the bus bandwidth against the set rate.

    Args:
        cluster (EmulatedCluster): An open cluster.
        size_mib (float): Tensor size in MiB. Defaults to 16. One
            iteration at rate R Mbit/s takes about
            ``size_mib * 8.4 * 2 (n - 1) / n / R`` seconds.
        warmup (int): Untimed iterations. Defaults to 2.
        iters (int): Timed iterations. Defaults to 5.
        port (int): The rendezvous port. Defaults to :data:`DEFAULT_PORT`.
        timeout (float, optional): Seconds before giving up. Defaults to
            None.
        python (str, optional): The interpreter with torch. Defaults to
            None, meaning ``sys.executable``.
        stream (IO[str], optional): Where the nodes' output goes (prefixed
            lines). Defaults to None.

    Returns:
        Calibration: The times and the bus bandwidth.

    Raises:
        ValueError: For a bad ``size_mib``, ``warmup`` or ``iters``.
        NodesFailed: A node failed or the run timed out; the message
            holds the last lines of the failed node's output.
    """
    if not (isinstance(size_mib,
                       (int, float)) and not isinstance(size_mib, bool)
            and math.isfinite(size_mib) and size_mib > 0):
        raise ValueError(f'size_mib should be a number > 0, but got '
                         f'{size_mib!r}')
    for name, value, low in (('warmup', warmup, 0), ('iters', iters, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or (value
                                                                     < low):
            raise ValueError(f'{name} should be an int >= {low}, but got '
                             f'{value!r}')
    numel = max(1, int(size_mib * 2**20) // 4)
    with tempfile.TemporaryDirectory(prefix='mmcvc-calibration-') as tmp:
        out = os.path.join(tmp, 'result.json')
        argv = [python or sys.executable] + _interpreter_flags() + [
            os.path.abspath(__file__), _CHILD_FLAG,
            str(numel),
            str(warmup),
            str(iters), out
        ]
        result = run_on_nodes(
            cluster,
            argv,
            port=port,
            timeout=timeout,
            log_dir=tmp,
            stream=stream)
        if result.returncode != 0:
            node = (
                result.failed_node if result.failed_node is not None else 0)
            with open(os.path.join(tmp, f'node{node}.log'), 'rb') as f:
                tail = f.read().decode('utf-8', 'replace').splitlines()[-20:]
            raise NodesFailed(
                f'calibration failed: {result.describe()}; last lines of '
                f'node{node}:\n' + '\n'.join(tail), result)
        with open(out) as f:
            times = json.load(f)['times']
    return Calibration(
        nodes=cluster.num_nodes,
        size_bytes=numel * 4,
        times=tuple(times),
        bandwidth_mbit=cluster.bandwidth_mbit)


def _calibration_child(numel: int, warmup: int, iters: int, out: str) -> None:
    """One rank of :func:`calibrate`, run on each node."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ['RANK'] = os.environ['NODE_RANK']
    os.environ['WORLD_SIZE'] = os.environ['NNODES']
    os.environ['MASTER_PORT'] = os.environ['PORT']
    dist.init_process_group(
        'gloo', init_method='env://', timeout=timedelta(minutes=10))
    try:
        tensor = torch.zeros(numel, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            with open(out + '.tmp', 'w') as f:
                json.dump({'times': slowest.tolist()}, f)
            os.replace(out + '.tmp', out)
    finally:
        dist.destroy_process_group()


def _set_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)``: ``signum`` when the parent
    ends. (:mod:`mmcv_custom.lifetime` does the same for ranks; this file
    imports nothing of the package, see :func:`_alive`.)"""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _node_start(maker: int, argv: List[str]) -> int:
    """A node's first program (:func:`_node_argv`): set the death signal,
    then become ``argv``; end at once if ``maker`` is already gone."""
    _set_death_signal(_NODE_DEATH_SIGNAL)
    if os.getppid() != maker:
        return signal_exit_code(_NODE_DEATH_SIGNAL)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f'cannot run {argv[0]}: {e.strerror}\n')
        return 127


def _stop_namespaces(names: Sequence[str], grace: float) -> List[int]:
    """SIGTERM every process in ``names``, SIGKILL what remains after
    ``grace`` seconds, wait until they are gone (10 s at most); the pids
    seen."""
    seen = []
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        for ns in names:
            seen += [
                p for p in _kill_namespace_pids(ns, signum) if p not in seen
            ]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(_namespace_pids(ns) for ns in names):
                return seen
            time.sleep(0.1)
    return seen


def _keep(fd: int, tag: str, maker: int) -> int:
    """The keeper of cluster ``tag`` (see :class:`EmulatedCluster`): wait
    for the end of file of pipe ``fd``; unless the maker closed the cluster
    itself, stop what runs in the cluster's namespaces and delete them."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    with os.fdopen(fd, 'rb') as pipe:
        said = pipe.read()
    if said == _DISMISSED:
        return 0
    stopped: List[int] = []
    removed: List[str] = []
    # Twice: a setup command of the maker may still add a namespace.
    for _ in range(2):
        try:
            names = [
                n for n in os.listdir(_NETNS_DIR) if n.startswith(tag + '-')
            ]
        except OSError:
            names = []
        if not names:
            break
        stopped += _stop_namespaces(names, _KEEPER_GRACE)
        removed += _delete_namespaces(names)
        time.sleep(0.2)
    if not (stopped or removed):
        return 0  # it ended before making anything
    _LOG.warning(
        'the process that made emulated cluster %s (pid %d) ended without '
        'removing it: stopped %d process%s in its nodes and removed %s', tag,
        maker, len(stopped), '' if len(stopped) == 1 else 'es',
        ', '.join(sorted(removed)) or 'none of its namespaces')
    return 0


def _main(argv: List[str]) -> int:
    if len(argv) == 5 and argv[0] == _CHILD_FLAG:
        _calibration_child(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        return 0
    if len(argv) >= 4 and argv[0] == _NODE_FLAG and argv[2] == '--':
        return _node_start(int(argv[1]), argv[3:])
    if len(argv) == 4 and argv[0] == _KEEPER_FLAG:
        logging.basicConfig(
            format='mmcv_custom.emulated_cluster: %(message)s',
            level=logging.WARNING)
        return _keep(int(argv[1]), argv[2], int(argv[3]))
    sys.stderr.write('this module is a library; run '
                     'tools/emulated_cluster.py\n')
    return 2


if __name__ == '__main__':
    sys.exit(_main(sys.argv[1:]))
