"""Whether this process can make network namespaces, and, when it is not
root, re-executing a program in an unprivileged user namespace where it
can.
"""
import os
import secrets
import shutil
import sys
from typing import List, Optional, Sequence

from .namespaces import NAME_PREFIX, one_line, run_command
from .shaping import TBF_BURST_BYTES, TBF_LATENCY_MS

__all__ = [
    'USERNS_ENV', 'ClusterUnavailable', 'missing_programs', 'check_available',
    'check_user_namespace', 'reexec_in_user_namespace'
]

#: Set in the environment of a program re-executed by
#: :func:`reexec_in_user_namespace`, to say so and never loop.
USERNS_ENV = 'MMCVC_USER_NAMESPACE'
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


def missing_programs() -> List[str]:
    """The programs of iproute2 a cluster needs that are not on PATH."""
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
    missing = missing_programs()
    if missing:
        return (f'emulated clusters need iproute2 ({" and ".join(missing)} '
                'not found on PATH)')
    if os.geteuid() != 0:
        return (f'not root (uid {os.geteuid()}): creating network '
                'namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN; run as '
                'root, or through tools/emulated_cluster.py, which '
                're-executes itself in an unprivileged user namespace')
    done = run_command(['sh', '-c', _probe_script(_probe_name())], check=False)
    if done.returncode != 0:
        why = one_line(done.stderr) or f'exit code {done.returncode}'
        return f'cannot create network namespaces as root: {why}'
    return None


def check_user_namespace() -> Optional[str]:
    """Why :func:`reexec_in_user_namespace` cannot work here, or None.

    Runs the probe of :func:`check_available` inside ``unshare --user
    --map-root-user --net --mount`` with a private tmpfs on
    ``/run/netns``, as the re-executed program would run.
    """
    missing = missing_programs() + ([] if shutil.which('unshare') else
                                    ['unshare'])
    if missing:
        return (f'an unprivileged user namespace needs util-linux and '
                f'iproute2 ({" and ".join(missing)} not found on PATH)')
    done = run_command(
        _UNSHARE + [
            '--', 'sh', '-c', _USERNS_SETUP, 'sh', 'sh', '-c',
            _probe_script(_probe_name())
        ],
        check=False)
    if done.returncode != 0:
        return ('an unprivileged user namespace (`unshare --user '
                '--map-root-user --net --mount`, tmpfs on /run/netns) '
                f'failed: {one_line(done.stderr) or "no message"}')
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
    if os.environ.get(USERNS_ENV):
        raise ClusterUnavailable(
            'already re-executed in a user namespace, and still cannot '
            f'create network namespaces: {check_available()}')
    reason = check_user_namespace()
    if reason is not None:
        raise ClusterUnavailable(
            f'cannot create network namespaces: not root (uid '
            f'{os.geteuid()}), and {reason}')
    os.environ[USERNS_ENV] = '1'
    cmd = _UNSHARE + ['--', 'sh', '-c', _USERNS_SETUP, 'sh'] + list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)
