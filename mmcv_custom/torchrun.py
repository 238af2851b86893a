"""torchrun for the tools' launchers: a failed run ends with one report.

``tools/dist_train.sh`` and ``tools/dist_test.sh`` run this file by path
(so the agent process imports torch, not this package) as
``python mmcv_custom/torchrun.py PROG [torchrun arguments]``. It is
``torch.distributed.run`` (``torchrun``) with the same arguments, except
for what it prints and its exit code when a rank fails:

* the report of the first rank that failed (:func:`format_report`: the
  cause in one line, and the log file holding the traceback), which
  ``tools/train.py`` and ``tools/test.py`` hand over in torchrun's own
  error file (``TORCHELASTIC_ERROR_FILE``, see :func:`write_error_file`),
  then ``PROG: exit code N``; instead of every rank's traceback and
  torchrun's ``ChildFailedError`` block ("To enable traceback see ...");
* the exit code is that rank's (128 + N for a rank killed by signal N),
  where torchrun always exits with 1;
* torchrun's lines about stopping the other ranks are left out; a restart
  (``--max-restarts``) is one line naming the rank that failed.

With ``LOGLEVEL`` set, torchrun's own log lines are left as they are.
"""
import json
import logging
import os
import signal
import sys
from typing import Dict, Optional, Tuple

__all__ = [
    'ERROR_KEY', 'format_report', 'write_error_file', 'first_failure', 'main'
]

#: The key of the tools' report in a torchrun error file, beside torchrun's
#: own ``message`` (which torchrun's ``ChildFailedError`` shows).
ERROR_KEY = 'mmcv_custom'


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
    """On torchrun's loggers: drops the lines about stopping the ranks
    (the report says what failed) and turns a restart into one line."""

    def __init__(self, prog: str) -> None:
        super().__init__()
        self.prog = prog
        self.failed = None  # (exit code, local rank) of the last failure

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith('failed (exitcode'):
            if isinstance(record.args, tuple) and len(record.args) >= 2:
                self.failed = record.args[:2]
            return False
        if 'closing signal' in message or 'death signal' in message:
            return False
        if 'will restart worker group' in message and 'attempts left' in \
                message:
            self._say_restart(record.args)
            return False
        return record.levelno >= logging.WARNING

    def _say_restart(self, args) -> None:
        try:
            left, most = int(args[2]), int(args[3])
        except (TypeError, ValueError, IndexError):
            return
        what = 'a rank failed'
        if self.failed is not None:
            code, local_rank = self.failed
            code = int(code)
            what = (f'local rank {local_rank} was killed by '
                    f'{_signal_name(-code)}' if code < 0 else
                    f'local rank {local_rank} exited with code {code}')
        print(
            f'{self.prog}: {what}; restarting every rank (restart '
            f'{most - left + 1} of {most})',
            file=sys.stderr,
            flush=True)


def _quiet_torchrun(prog: str) -> None:
    if 'LOGLEVEL' in os.environ:
        return
    quiet = _QuietAgent(prog)
    for name in ('torch.distributed.elastic.multiprocessing.api',
                 'torch.distributed.elastic.agent.server.api'):
        logger = logging.getLogger(name)
        logger.addFilter(quiet)
    # The restart line is an INFO record of the agent.
    logging.getLogger('torch.distributed.elastic.agent.server.api').setLevel(
        logging.INFO)


def main(argv=None) -> int:
    """``PROG [torchrun arguments]``: run torchrun; return the exit code."""
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
    _quiet_torchrun(prog)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, report = first_failure(e.failures)
        failure = e.failures[rank]
        code = _exit_code(failure.exitcode)
        if report is not None:
            # The tool's code: a rank that reported may yet have been
            # stopped by torchrun while it exited.
            code = int(report.get('exit_code', code))
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
    except SignalException as e:
        print(
            f'{prog}: stopped every rank ({_signal_name(int(e.sigval))})',
            file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == '__main__':
    # Run by path: Python put this folder first on sys.path, where this
    # package's modules (registry.py, testing/, ...) would shadow others.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [
        p for p in sys.path if os.path.abspath(p or os.curdir) != _here
    ]
    sys.exit(main())
