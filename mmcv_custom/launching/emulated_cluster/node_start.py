"""A node's first program: ties the command run on a node to the life of
the process that started it (``prctl(PR_SET_PDEATHSIG)``), then becomes
that command; and the exit code of a death by signal.

:func:`~.run.run_on_nodes` starts every node's command through this file
(``python -P node_start.py --node PID -- ip netns exec NS ARGV``, see
:mod:`.programs`) rather than a ``preexec_fn``, which is unsafe beside the
output threads. So it imports only the standard library and nothing of
the package.
"""
import os
import signal
import sys
from typing import List

__all__ = ['NODE_FLAG', 'signal_exit_code']

#: This file run as a node's first program.
NODE_FLAG = '--node'
#: What a node's first process gets when the process running the nodes
#: ends: SIGTERM, so that a launcher there can stop its ranks itself.
_NODE_DEATH_SIGNAL = signal.SIGTERM
_PR_SET_PDEATHSIG = 1


def signal_exit_code(signum: int) -> int:
    """The shell's exit code for death by ``signum``: ``128 + signum``
    (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def _set_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)``: ``signum`` when the parent
    ends. (:mod:`mmcv_custom.launching.lifetime` does the same for ranks;
    this file imports nothing of the package, see the module's
    description.)"""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _node_start(maker: int, argv: List[str]) -> int:
    """A node's first program (see :func:`~.run.run_on_nodes`): set the
    death signal, then become ``argv``; end at once if ``maker`` is
    already gone."""
    _set_death_signal(_NODE_DEATH_SIGNAL)
    if os.getppid() != maker:
        return signal_exit_code(_NODE_DEATH_SIGNAL)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f'cannot run {argv[0]}: {e.strerror}\n')
        return 127


def _main(argv: List[str]) -> int:
    if len(argv) >= 4 and argv[0] == NODE_FLAG and argv[2] == '--':
        return _node_start(int(argv[1]), argv[3:])
    sys.stderr.write('this module is a library; run '
                     'tools/emulated_cluster.py\n')
    return 2


if __name__ == '__main__':
    sys.exit(_main(sys.argv[1:]))
