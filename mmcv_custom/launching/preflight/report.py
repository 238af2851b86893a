"""How a preflight error is said and the process ends: once per node,
by the rank that speaks, before any rank exits.
"""
import os
import socket
import sys
import time
from typing import Optional

from ...engine.process_group import LAUNCH_ENV
from .problems import PreflightError

__all__ = ['preflight_report', 'exit_on_problems']

# How long a quiet rank waits before it exits on a preflight problem; see
# exit_on_problems.
_QUIET_RANK_GRACE_S = 3.0


def preflight_report(error: PreflightError, prog: str,
                     launcher: str) -> Optional[str]:
    """What this process prints for ``error`` (``prog: error: ...``), or
    None where it stays quiet, so that every rank exits but each problem
    is said once.

    Local rank 0 of each node speaks (a single node: once), since every
    node checks its own disks; another node than global rank 0's says
    which it is. Works before the process group exists, from the
    launcher's environment.
    """
    if launcher in LAUNCH_ENV:
        env = LAUNCH_ENV[launcher]
        local = os.environ.get(env.local, '0').strip()
        if local not in ('', '0'):
            return None
        rank = os.environ.get(env.rank, '0').strip()
        if rank not in ('', '0'):
            prog = f'{prog} (on {socket.gethostname()}, rank {rank})'
    return f'{prog}: error: {error}'


def exit_on_problems(error: PreflightError, prog: str, launcher: str):
    """Stop this process with exit code 2 (as for a usage error), saying
    ``error`` where :func:`preflight_report` says this process speaks.

    Every rank finds the same problems at about the same time. A quiet
    rank waits a moment before it exits, so that the speaking one has
    said why and exited first: the launcher (torchrun, Slurm) stops the
    remaining ranks as soon as one exits, and a speaking rank stopped
    mid-sentence would leave a failure without its cause.
    """
    report = preflight_report(error, prog, launcher)
    if report:
        print(report, file=sys.stderr, flush=True)
    else:
        time.sleep(_QUIET_RANK_GRACE_S)
    sys.exit(2)
