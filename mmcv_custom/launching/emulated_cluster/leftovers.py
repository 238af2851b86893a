"""Removing what killed clusters left: the namespaces of a cluster whose
process and keeper are both gone, group-wise, once nothing runs in them.
"""
import logging
import os
from typing import Dict, List, Optional

from .namespaces import (NAME_PREFIX, NETNS_DIR, delete_namespaces,
                         namespace_pids)

__all__ = ['remove_leftovers']

_LOG = logging.getLogger(__name__)


def _maker_pid(name: str) -> Optional[int]:
    """The pid in a name this package gave (``mmcvc-<pid>-...``), else
    None."""
    if not name.startswith(NAME_PREFIX):
        return None
    pid = name[len(NAME_PREFIX):].split('-', 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    # integrity's process_alive, written again on purpose: this package
    # is standard library only, and is loaded without mmcv_custom (by a
    # bare python3 when not root).
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _cluster_tag(name: str) -> str:
    """The cluster a namespace of this package belongs to: its name up to
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
    when its name is one this package gives and the process named in it
    no longer exists. One cluster's namespaces (the same
    ``mmcvc-<pid>-<hex>-`` prefix) go together, and only once nothing
    runs in any of them: a node still running would lose its network
    under it. When something does, all of them stay, with one warning
    per cluster naming the namespaces and the processes in them.

    Returns:
        list[str]: The namespaces deleted, sorted.
    """
    try:
        names = sorted(os.listdir(NETNS_DIR))
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
        running = {ns: namespace_pids(ns) for ns in members}
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
        removed += delete_namespaces(members)
    return sorted(removed)
