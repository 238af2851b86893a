"""The network namespaces of emulated clusters, by name, and the keeper.

What runs in a namespace (found, signalled, stopped), deleting namespaces,
the setup commands (``ip``, ``tc``) and their errors; and the keeper of a
cluster (see :class:`~.cluster.EmulatedCluster`), which removes the
cluster when the process that made it ends without doing so.

The keeper runs this file by path (``python -P namespaces.py --keeper FD
TAG PID``, see :mod:`.programs`), so it imports only the standard library
and nothing of the package: the rest of the package builds on it.
"""
import logging
import os
import signal
import subprocess
import sys
import time
from typing import List, Sequence, Tuple

__all__ = [
    'NAME_PREFIX', 'NETNS_DIR', 'NETNS_ETC', 'KEEPER_FLAG', 'DISMISSED',
    'ClusterError', 'one_line', 'run_command', 'namespace_exists',
    'namespace_pids', 'kill_namespace_pids', 'stop_namespaces',
    'delete_namespaces', 'write_hosts', 'remove_hosts'
]

_LOG = logging.getLogger(__name__)

#: Every namespace this package creates is named ``mmcvc-<pid>-<hex>-...``,
#: so that two runs never collide and a leftover one (after SIGKILL) says
#: which process made it.
NAME_PREFIX = 'mmcvc-'
#: Where ``ip netns add`` puts a named namespace.
NETNS_DIR = '/run/netns'
#: Where ``ip netns exec NAME`` finds the namespace's own files, each
#: bind-mounted over its namesake in ``/etc`` (iproute2's convention).
NETNS_ETC = '/etc/netns'
#: This file run as a cluster's keeper.
KEEPER_FLAG = '--keeper'
#: What a maker that closed its cluster itself tells its keeper.
DISMISSED = b'closed'
#: Seconds a keeper waits between SIGTERM and SIGKILL.
_KEEPER_GRACE = 2.0


class ClusterError(RuntimeError):
    """A command that builds or runs the emulated cluster failed."""


def one_line(text: str) -> str:
    """A command's error output as one line, its lines joined by ``; ``."""
    return '; '.join(ln.strip() for ln in text.strip().splitlines()
                     if ln.strip())


def run_command(cmd: Sequence[str],
                check: bool = True) -> subprocess.CompletedProcess:
    """Run a short setup command (``ip``, ``tc``); raise
    :class:`ClusterError` naming it and its error when ``check``."""
    _LOG.debug('+ %s', ' '.join(cmd))
    done = subprocess.run(
        list(cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(
            f'`{" ".join(cmd)}` failed with exit code {done.returncode}: '
            f'{one_line(done.stderr) or "no message"}')
    return done


def namespace_exists(name: str) -> bool:
    """Whether the named network namespace ``name`` exists."""
    return os.path.exists(os.path.join(NETNS_DIR, name))


def namespace_pids(ns: str) -> List[int]:
    """The pids of every process in namespace ``ns`` (none if it is gone)."""
    done = run_command(['ip', 'netns', 'pids', ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def kill_namespace_pids(
    ns: str, signum: int, spare_groups: Sequence[int] = ()) -> List[int]:
    """Send ``signum`` to every process in ``ns`` (one of ours: whatever
    runs there was started by :func:`~.run.run_on_nodes`), but those in
    the process groups ``spare_groups`` (already sent it: a second SIGTERM
    arriving while a rank writes its stacks, faulthandler's chained
    handler, ends it mid-line). Returns their pids."""
    if not namespace_exists(ns):
        return []
    pids = namespace_pids(ns)
    for pid in pids:
        try:
            if spare_groups and os.getpgid(pid) in spare_groups:
                continue
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return pids


def write_hosts(name: str, hosts: Sequence[Tuple[str, str]]) -> bool:
    """Give namespace ``name`` a hosts file of its own: localhost and
    ``hosts`` (address, host name), in ``/etc/netns/NAME/hosts``, which
    ``ip netns exec`` puts over ``/etc/hosts``.

    Why: torch's TCPStore names each peer by a reverse lookup of its
    address, and inside a node the DNS servers of ``/etc/resolv.conf``
    cannot be reached, so every connection warned ``[c10d] The hostname
    of the client socket cannot be retrieved. err=-3``; answered from the
    file, the lookups succeed. False, and nothing written, where
    ``/etc/netns`` cannot be written (a user namespace, a read-only
    ``/etc``): the lookups then fail, and warn, as before.
    """
    folder = os.path.join(NETNS_ETC, name)
    # Each IPv4 address also as IPv6 maps it: torchrun's store listens on
    # both, and sees its IPv4 peers as ::ffff:a.b.c.d.
    lines = [
        f'{prefix}{address}\t{host}'
        for address, host in [('127.0.0.1', 'localhost')] + list(hosts)
        for prefix in ('', '::ffff:')
    ] + ['::1\tlocalhost ip6-localhost']
    try:
        os.makedirs(NETNS_ETC, mode=0o755, exist_ok=True)
        if os.path.islink(NETNS_ETC):
            return False  # nothing written through a link
        os.mkdir(folder, 0o755)  # the name is this run's: never there
    except OSError:
        return False
    try:
        fd = os.open(
            os.path.join(folder, 'hosts'),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, 'w') as f:
            f.write('\n'.join(lines) + '\n')
    except OSError:
        remove_hosts(name)
        return False
    return True


def remove_hosts(name: str) -> None:
    """Remove what :func:`write_hosts` wrote for ``name`` (and
    ``/etc/netns`` once empty); nothing there, nothing done."""
    folder = os.path.join(NETNS_ETC, name)
    for path, remove in ((os.path.join(folder, 'hosts'), os.unlink),
                         (folder, os.rmdir), (NETNS_ETC, os.rmdir)):
        try:
            remove(path)
        except OSError:  # gone, or another cluster's files are there
            pass


def delete_namespaces(names: Sequence[str]) -> List[str]:
    """``ip netns del`` each of ``names``, the switch last, with its hosts
    file (:func:`write_hosts`); the names deleted."""
    deleted = []
    for name in sorted(names, key=lambda n: n.endswith('-sw')):
        if run_command(['ip', 'netns', 'del', name],
                       check=False).returncode == 0:
            remove_hosts(name)
            deleted.append(name)
    return deleted


def stop_namespaces(names: Sequence[str], grace: float) -> List[int]:
    """SIGTERM every process in ``names``, SIGKILL what remains after
    ``grace`` seconds, wait until they are gone (10 s at most); the pids
    seen."""
    seen = []
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        for ns in names:
            seen += [
                p for p in kill_namespace_pids(ns, signum) if p not in seen
            ]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(namespace_pids(ns) for ns in names):
                return seen
            time.sleep(0.1)
    return seen


def _keep(fd: int, tag: str, maker: int) -> int:
    """The keeper of cluster ``tag`` (see
    :class:`~.cluster.EmulatedCluster`): wait for the end of file of pipe
    ``fd``; unless the maker closed the cluster itself, stop what runs in
    the cluster's namespaces and delete them."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    with os.fdopen(fd, 'rb') as pipe:
        said = pipe.read()
    if said == DISMISSED:
        return 0
    stopped: List[int] = []
    removed: List[str] = []
    # Twice: a setup command of the maker may still add a namespace.
    for _ in range(2):
        try:
            names = [
                n for n in os.listdir(NETNS_DIR) if n.startswith(tag + '-')
            ]
        except OSError:
            names = []
        if not names:
            break
        stopped += stop_namespaces(names, _KEEPER_GRACE)
        removed += delete_namespaces(names)
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
    if len(argv) == 4 and argv[0] == KEEPER_FLAG:
        logging.basicConfig(
            format='mmcv_custom.emulated_cluster: %(message)s',
            level=logging.WARNING)
        return _keep(int(argv[1]), argv[2], int(argv[3]))
    sys.stderr.write('this module is a library; run '
                     'tools/emulated_cluster.py\n')
    return 2


if __name__ == '__main__':
    sys.exit(_main(sys.argv[1:]))
