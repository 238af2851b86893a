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
from typing import List, Sequence

__all__ = [
    'NAME_PREFIX', 'NETNS_DIR', 'KEEPER_FLAG', 'DISMISSED', 'ClusterError',
    'one_line', 'run_command', 'namespace_exists', 'namespace_pids',
    'kill_namespace_pids', 'stop_namespaces', 'delete_namespaces'
]

_LOG = logging.getLogger(__name__)

#: Every namespace this package creates is named ``mmcvc-<pid>-<hex>-...``,
#: so that two runs never collide and a leftover one (after SIGKILL) says
#: which process made it.
NAME_PREFIX = 'mmcvc-'
#: Where ``ip netns add`` puts a named namespace.
NETNS_DIR = '/run/netns'
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


def delete_namespaces(names: Sequence[str]) -> List[str]:
    """``ip netns del`` each of ``names``, the switch last; the names
    deleted."""
    deleted = []
    for name in sorted(names, key=lambda n: n.endswith('-sw')):
        if run_command(['ip', 'netns', 'del', name],
                       check=False).returncode == 0:
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
