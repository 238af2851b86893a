"""A rank ends when its launcher ends, SIGKILL included.

torchrun's agent, ``srun`` and ``mpirun`` stop their ranks when a rank
fails or when they are told to stop. A launcher killed outright (``kill
-9``, the OOM killer, a scheduler's hard limit) stops nothing: its ranks
are handed to init and go on training unseen, writing checkpoints into a
work dir that the next launch then shares with them.
:func:`die_with_launcher` asks Linux to send the rank SIGKILL as soon as
its parent ends (``prctl(PR_SET_PDEATHSIG)``).

Why the parent, and why that is enough: each launcher starts its ranks
itself. torchrun's agent starts them with ``subprocess.Popen`` from its
main thread (``SubprocessContext``, called from ``LocalElasticAgent``'s
run loop; the death signal follows the thread that forked, and that one
lives as long as the agent); a Slurm task is a child of its
``slurmstepd`` (``srun`` in the tests' stand-in), an Open MPI rank of its
daemon.

Why SIGKILL: nobody is left to read what a rank would say, a rank blocked
in a collective runs no Python signal handler until the collective's
timeout (minutes), and the checkpoints are written through a temporary
name and a rename, so a rank killed mid-save leaves no damaged file (the
next save removes what it left).

The race: the rank imports torch before it can ask (seconds), and a
launcher that dies in that time has made the rank an orphan already, so
no death signal will come. A launcher that names its pid in
:data:`LAUNCHER_PID_ENV` (``mmcv_custom/launching/torchrun.py``,
``tools/slurm_train.sh``, ``tools/slurm_test.sh``) closes it: a rank whose
parent is not that process, while that process is gone, ends at once.
Under a launcher that does not (plain ``torchrun``, ``mpirun``), the
parent at the time of the call is taken, and a launcher killed during
those first seconds goes unnoticed.

Standard library only; on other systems than Linux it does nothing.
"""
import ctypes
import logging
import os
import signal
import sys
from typing import Optional

from ..integrity import process_alive

__all__ = [
    'LAUNCHERS', 'LAUNCHER_PID_ENV', 'DEATH_SIGNAL', 'die_with_launcher'
]

#: The ``--launcher`` values whose processes a launcher started.
LAUNCHERS = ('pytorch', 'slurm', 'mpi')
#: Set by a launcher to its own pid, for the ranks it starts itself.
LAUNCHER_PID_ENV = 'MMCV_CUSTOM_LAUNCHER_PID'
#: What a rank receives when its launcher ends.
DEATH_SIGNAL = signal.SIGKILL

_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
_LOG = logging.getLogger(__name__)


def die_with_launcher(launcher: str) -> bool:
    """End this process (SIGKILL) when the launcher that started it ends.

    Call it first thing in a tool's ``main()``, with the tool's
    ``--launcher``: only a rank follows its launcher. ``'none'`` (a plain
    ``python tools/train.py``) does nothing, so a run started by hand, or
    under ``nohup``, outlives the shell that started it as before.

    The launcher's pid in :data:`LAUNCHER_PID_ENV` is removed from the
    environment, so that what this process starts (data loader workers,
    another launcher) does not take this process's launcher for its own.

    Args:
        launcher (str): ``'none'`` or one of :data:`LAUNCHERS`.

    Returns:
        bool: Whether the death signal is set (False for ``'none'``, off
        Linux, or where ``prctl`` refused).

    Raises:
        ValueError: An unknown ``launcher``, or a :data:`LAUNCHER_PID_ENV`
            that is not a pid.
    """
    if launcher not in LAUNCHERS + ('none', ):
        raise ValueError(f'launcher should be one of '
                         f'{", ".join(map(repr, LAUNCHERS + ("none", )))}, '
                         f'but got {launcher!r}')
    if launcher == 'none':
        return False
    named = _named_launcher_pid()
    if not sys.platform.startswith('linux'):
        return False
    if not _set_death_signal(DEATH_SIGNAL):
        return False
    parent = os.getppid()
    if named is not None and parent != named and not process_alive(named):
        # Orphaned before the signal was set: it will never come.
        _LOG.error(
            'the launcher that started this process (pid %d) has ended; '
            'stopping this rank (%s)', named, DEATH_SIGNAL.name)
        logging.shutdown()
        os.kill(os.getpid(), DEATH_SIGNAL)
    return True


def _named_launcher_pid() -> Optional[int]:
    """The pid a launcher put in :data:`LAUNCHER_PID_ENV` (taken out of
    the environment), or None."""
    value = os.environ.pop(LAUNCHER_PID_ENV, None)
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(
            f'{LAUNCHER_PID_ENV} should be the pid of the launcher that '
            f'started this process (a whole number > 0), but got {value!r}')
    return int(value)


def _libc_prctl():
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    return prctl


def _set_death_signal(signum: int) -> bool:
    try:
        prctl = _libc_prctl()
    except (OSError, AttributeError):
        return False
    if prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        _LOG.warning(
            'prctl(PR_SET_PDEATHSIG) failed (%s): this rank will '
            'outlive a killed launcher', os.strerror(ctypes.get_errno()))
        return False
    return True


def _death_signal() -> int:
    """The death signal set for this process (0: none); Linux only."""
    value = ctypes.c_int(0)
    prctl = _libc_prctl()
    prctl.argtypes = [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_ulong] * 3
    if prctl(_PR_GET_PDEATHSIG, ctypes.addressof(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), 'prctl(PR_GET_PDEATHSIG) failed')
    return value.value
