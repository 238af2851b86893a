"""torchrun for the tools' launchers: a failed run ends with one report.

``tools/dist_train.sh`` and ``tools/dist_test.sh`` run this file by path
(so the agent process imports torch, not this package) as
``python mmcv_custom/launching/torchrun.py PROG [torchrun arguments]``. It is
``torch.distributed.run`` (``torchrun``) with the same arguments, except
for what it prints, its exit code when a rank fails, its restarts and
what it leaves behind:

* the report of the first rank that failed (:func:`format_report`: the
  cause in one line, and the log file holding the traceback), which
  ``tools/train.py`` and ``tools/test.py`` hand over in torchrun's own
  error file (``TORCHELASTIC_ERROR_FILE``, see :func:`write_error_file`),
  then ``PROG: exit code N``; instead of every rank's traceback and
  torchrun's ``ChildFailedError`` block ("To enable traceback see ...");
* the exit code is that rank's (128 + N for a rank killed by signal N),
  where torchrun always exits with 1;
* torchrun's lines about stopping the other ranks are left out;
* a restart (``--max-restarts=N``) is this wrapper's: each attempt is a
  torchrun launch of its own with ``--max-restarts=0`` and
  ``MMCV_CUSTOM_RESTART_COUNT`` set to the attempt (which
  ``mmcv_custom.engine.process_group.restart_count`` reads), announced in
  one line naming the rank that failed after that failure's report. A failure
  with exit code 2 (a usage or preflight error: a missing file, a bad
  value) is not restarted: it would only fail and be printed again;
* the ranks end with this process, SIGKILL included: its pid goes to
  them in ``MMCV_CUSTOM_LAUNCHER_PID`` for
  ``mmcv_custom.launching.lifetime.die_with_launcher``, and torchrun's log
  folder (its ranks' error files) is a temporary one removed at the end, by
  a waiting shell when this process is killed;
* under ``nohup`` (SIGHUP ignored), torchrun does not take SIGHUP back to
  stop the ranks when the terminal closes.

With ``LOGLEVEL`` set, torchrun's own log lines are left as they are.
"""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Dict, Optional, Tuple

__all__ = [
    'ERROR_KEY', 'LAUNCHER_PID_ENV', 'RESTART_COUNT_ENV', 'format_report',
    'write_error_file', 'first_failure', 'main'
]

#: The key of the tools' report in a torchrun error file, beside torchrun's
#: own ``message`` (which torchrun's ``ChildFailedError`` shows).
ERROR_KEY = 'mmcv_custom'
#: A launcher names its pid here for the ranks it starts (read by
#: ``mmcv_custom.launching.lifetime.die_with_launcher``; written out again
#: here, since this file imports nothing of the package).
LAUNCHER_PID_ENV = 'MMCV_CUSTOM_LAUNCHER_PID'
#: The attempt a rank belongs to (0: the first), read by
#: ``mmcv_custom.engine.process_group.restart_count``.
RESTART_COUNT_ENV = 'MMCV_CUSTOM_RESTART_COUNT'
#: A usage or preflight error's exit code: a restart would only print it
#: again.
_NOT_RESTARTED = 2


def format_report(report: dict, show_rank: bool = True) -> str:
    """The lines a failed tool prints: what failed, and where the traceback
    is. ``report`` holds ``prog``, ``error`` (one line), ``rank``,
    ``world_size``, ``log_file`` (or None), ``time`` (when it failed) and
    ``exit_code``."""
    where = ''
    if show_rank and report.get('world_size', 1) > 1:
        where = f' on rank {report["rank"]}'
    lines = [f'{report["prog"]}: error{where}: {report["error"]}']
    if report.get('log_file'):
        lines.append(f'{report["prog"]}: the traceback is in '
                     f'{report["log_file"]}')
    return '\n'.join(lines)


def write_error_file(report: dict, callstack: str) -> bool:
    """Hand ``report`` to torchrun's agent: write the error file torchrun
    gave this worker (``TORCHELASTIC_ERROR_FILE``), in the format of
    torch's ``ErrorHandler.record_exception`` plus the report under
    :data:`ERROR_KEY`. False when not run by torchrun, or on failure."""
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path:
        return False
    data = {
        'message': {
            'message': report['error'],
            'extraInfo': {
                'py_callstack': callstack,
                'timestamp': str(int(report['time'])),
            },
        },
        ERROR_KEY: report,
    }
    try:
        with open(path, 'w') as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f'signal {number}'


def _exit_code(exitcode: int) -> int:
    """A rank's exit code as a shell reports it: 128 + N for signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def first_failure(failures: Dict[int, object]) -> Tuple[int, Optional[dict]]:
    """The rank whose failure to show, and its report (None if it wrote
    none), from torchrun's ``ChildFailedError.failures``.

    The earliest report wins (by its time, to the microsecond; torchrun's
    own order has whole seconds), so a rank that failed because another
    one did first is not taken for the cause. Several ranks reporting the
    same error (a config every rank reads) show as the lowest of them.
    Without any report, a rank that ended by itself (an exit code, or a
    signal other than SIGTERM) comes before one torchrun stopped with
    SIGTERM after that failure: torchrun stamps failures without a report
    when it collects them, so their times rarely tell them apart. Then the
    earliest by torchrun's order.
    """
    reports = {}
    for rank, failure in failures.items():
        data = getattr(failure, 'error_file_data', None) or {}
        if isinstance(data.get(ERROR_KEY), dict):
            reports[rank] = data[ERROR_KEY]
    if reports:
        earliest = min(reports, key=lambda r: (reports[r]['time'], r))
        same = [
            r for r in reports
            if reports[r]['error'] == reports[earliest]['error']
        ]
        rank = min(same)
        return rank, reports[rank]
    rank = min(failures, key=lambda r: _cause_order(r, failures[r]))
    return rank, None


def _cause_order(rank: int, failure) -> tuple:
    """Sorts failures without a report, most likely cause first: a rank
    stopped by SIGTERM (what torchrun sends the others once one failed)
    last, then by torchrun's time stamp and rank."""
    stopped = failure.exitcode == -signal.SIGTERM
    return stopped, failure.timestamp, rank


class _QuietAgent(logging.Filter):
    """On torchrun's loggers: drops the lines about stopping the ranks (the
    report says what failed) and its INFO lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith('failed (exitcode'):
            return False
        if 'closing signal' in message or 'death signal' in message:
            return False
        return record.levelno >= logging.WARNING


def _quiet_torchrun() -> None:
    if 'LOGLEVEL' in os.environ:
        return
    quiet = _QuietAgent()
    for name in ('torch.distributed.elastic.multiprocessing.api',
                 'torch.distributed.elastic.agent.server.api'):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietAgent) for f in logger.filters):
            logger.addFilter(quiet)


def _restart_cause(failures: Dict[int, object], rank: int) -> str:
    """What the restart line names: a local rank killed by a signal other
    than SIGTERM (what torchrun stops the others with) when there is one,
    since the errors the others report follow from it; else the rank
    :func:`first_failure` chose."""
    killed = [
        f for f in failures.values()
        if f.exitcode < 0 and f.exitcode != -signal.SIGTERM
    ]
    if killed:
        failure = min(killed, key=lambda f: (f.timestamp, f.local_rank))
        return (f'local rank {failure.local_rank} was killed by '
                f'{_signal_name(-failure.exitcode)}')
    failure = failures[rank]
    return (f'local rank {failure.local_rank} exited with code '
            f'{_exit_code(failure.exitcode)}')


def _outcome(failures: Dict[int, object]) -> Tuple[int, Optional[dict], int]:
    """The rank whose failure to show, its report (or None) and the
    launcher's exit code, from torchrun's ``ChildFailedError.failures``."""
    rank, report = first_failure(failures)
    code = _exit_code(failures[rank].exitcode)
    if report is not None:
        # The tool's code: a rank that reported may yet have been
        # stopped by torchrun while it exited.
        code = int(report.get('exit_code', code))
    return rank, report, code


def _report_end(prog: str, failures: Dict[int, object], rank: int,
                report: Optional[dict], code: int) -> int:
    """Print how the run ended after ``failures`` (with :func:`_outcome`'s
    ``rank``, ``report`` and ``code``); return the exit code."""
    failure = failures[rank]
    if report is not None:
        print(format_report(report), file=sys.stderr)
        print(f'{prog}: exit code {code}', file=sys.stderr)
    elif failure.exitcode < 0:
        print(
            f'{prog}: rank {rank} was killed by '
            f'{_signal_name(-failure.exitcode)}; exit code {code}',
            file=sys.stderr)
    else:
        # It exited by itself, after saying why (a usage error).
        print(
            f'{prog}: exit code {code} (first failure: rank {rank})',
            file=sys.stderr)
    return code


class _LogDir:
    """torchrun's log folder for this launch (its ranks' error files):
    a temporary folder removed when the launch ends, SIGKILL included.

    torchrun makes a ``torchelastic_*`` folder under the temporary
    directory for every launch and never removes it. This one goes on
    every exit, and a SIGKILL of this process is seen by a shell started
    in a session of its own (so that no signal to this process's group
    reaches it) that waits on a pipe only this process holds open: at its
    end of file the shell removes the folder."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix='mmcv_custom-torchrun-')
        read_end, self._write_end = os.pipe()  # not inherited by exec
        reaper = [
            'sh', '-c', 'read line; exec rm -rf -- "$1"', 'sh', self.path
        ]
        try:
            self._reaper = subprocess.Popen(
                reaper,
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:
            self._reaper = None
        finally:
            os.close(read_end)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._write_end)
        if self._reaper is not None:
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _handled_signals(requested: str) -> str:
    """torchrun's ``--signals-to-handle`` without SIGHUP when this process
    ignores it (``nohup``): torchrun would otherwise install its own
    handler and stop every rank when the terminal closes."""
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        return requested
    names = [s.strip() for s in requested.split(',')]
    return ','.join(s for s in names if s and s != 'SIGHUP')


def main(argv=None) -> int:
    """``PROG [torchrun arguments]``: run torchrun; return the exit code.

    A restart (``--max-restarts=N``) is done here, not by torchrun:
    torchrun runs with ``--max-restarts=0`` once per attempt, with
    :data:`RESTART_COUNT_ENV` set to the attempt, so that a failure with
    exit code 2 (a usage or preflight error: a missing file, a bad value)
    ends the run at once, said once, as ``tools/slurm_train.sh`` does.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print('usage: torchrun.py PROG [torchrun arguments]', file=sys.stderr)
        return 2
    prog, argv = argv[0], argv[1:]
    try:
        from torch.distributed.elastic.multiprocessing.api import \
            SignalException
        from torch.distributed.elastic.multiprocessing.errors import \
            ChildFailedError
        from torch.distributed.run import parse_args, run
    except ImportError as e:
        print(
            f'{prog}: {sys.executable} cannot run torchrun ('
            f'{type(e).__name__}: {e}); set PYTHON to a Python with torch, '
            'or run `make install`',
            file=sys.stderr)
        return 1
    _quiet_torchrun()
    asked = parse_args(argv)
    most = asked.max_restarts
    handled = _handled_signals(asked.signals_to_handle)
    # The ranks' death signal follows this process (launching/lifetime.py).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    log_dir = None if asked.log_dir else _LogDir()
    attempt = 0
    try:
        while True:
            os.environ[RESTART_COUNT_ENV] = str(attempt)
            args = parse_args(argv)
            args.max_restarts = 0
            args.signals_to_handle = handled
            if log_dir is not None:
                args.log_dir = log_dir.path
            try:
                run(args)
                return 0
            except ChildFailedError as e:
                rank, report, code = _outcome(e.failures)
                if code == _NOT_RESTARTED or attempt >= most:
                    return _report_end(prog, e.failures, rank, report, code)
                if report is not None:
                    print(format_report(report), file=sys.stderr)
                attempt += 1
                print(
                    f'{prog}: {_restart_cause(e.failures, rank)}; '
                    f'restarting every rank (restart {attempt} of {most})',
                    file=sys.stderr,
                    flush=True)
    except SignalException as e:
        print(
            f'{prog}: stopped every rank ({_signal_name(int(e.sigval))})',
            file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        if log_dir is not None:
            log_dir.close()


if __name__ == '__main__':
    # Run by path: Python put this folder first on sys.path, where this
    # package's modules (registry.py, testing/, ...) would shadow others.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [
        p for p in sys.path if os.path.abspath(p or os.curdir) != _here
    ]
    sys.exit(main())
