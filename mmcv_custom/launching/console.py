"""What the tools print: a header, the progress and a summary; everything
else goes to the run's log file.

Before its first progress line, MMEngine's runner prints the environment
(about 40 lines), the whole config (about 150) and its hook table (about
90), and the libraries warn about things a user of the tools cannot
change. ``tools/train.py`` and ``tools/test.py`` start a
:class:`ToolConsole`, which keeps those in the log file and off the
console (``--verbose`` prints them again):

* :class:`ConsoleFilter`, on the console handler of MMEngine's loggers
  (:class:`~mmengine.logging.MMLogger`), drops the records of
  :data:`FILE_ONLY`; the file handler keeps every record;
* Python warnings go to the log file, and to the console unless
  :data:`RUN_NOISE` lists them;
* what is logged before the runner exists waits for the header
  (:meth:`ToolConsole.open`) and goes into the log file as soon as the
  runner's logger exists (:meth:`ToolConsole.building` hands the runner's
  logger its filter before the runner logs its first line);
* a failure goes into the log file with its traceback, and its cause is
  printed once, by the first rank that failed (:meth:`ToolConsole.fail`);
  a record logged as that cause (``extra={'failure_cause': True}``)
  goes into the log file only.

The records themselves are MMEngine's: nothing here changes the runner.
"""
import atexit
import contextlib
import logging
import os
import os.path as osp
import re
import sys
import time
import traceback
import warnings
from typing import List, Optional, Tuple

from mmengine.logging import MMLogger
from mmengine.logging.logger import MMFormatter

from ..integrity import link_of
from .torchrun import format_report, write_error_file
from .warning_noise import TOOL_NOISE

__all__ = [
    'FILE_ONLY', 'RUN_NOISE', 'ConsoleFilter', 'ToolConsole',
    'current_console', 'report_failure', 'header_text', 'progress_text',
    'summary_text'
]

#: Log records kept in the log file only: (message regex, why).
FILE_ONLY = (
    (r'^\n-+\nSystem environment:', "MMEngine's environment dump (about 40 "
     'lines): for bug reports, not for watching a run'),
    (r'^Config:\n', 'the whole config (about 150 lines); the header names '
     'the config file'),
    (r'^Hooks will be executed in the following order',
     "MMEngine's hook table (about 90 lines)"),
    (r'^Checkpoints will be saved to ', 'the summary says where they are'),
    (r'^No CUDA: started a gloo process group of ', 'the header says it'),
    (r'^"FileClient" will be deprecated in future', "MMEngine's own "
     'CheckpointHook builds a FileClient in every run (backward '
     'compatibility); no config avoids it'),
    (r'^"HardDiskBackend" is the alias of "LocalBackend"',
     "the same FileClient, under MMEngine's old name of its local backend"),
    (r'^The prefix is not set in metric class ', "MMSegmentation's "
     'IoUMetric sets none; its metrics are named all the same'),
)
_FILE_ONLY = [re.compile(pattern) for pattern, _ in FILE_ONLY]

#: Python warnings kept off the console (the log file has them):
#: (message regex, category, issuing module regex, why). The analysis
#: tools' list (:data:`~mmcv_custom.launching.warning_noise.TOOL_NOISE`)
#: where it fits a training or test run, and one more. (MMEngine's
#: pkg_resources warning is silenced where it arises, around the config's
#: reading: :data:`~mmcv_custom.launching.warning_noise.CONFIG_NOISE`.)
RUN_NOISE = tuple(entry for entry in TOOL_NOISE
                  if 'Multi-processing start method' not in entry[0]) + (
                      (r'The draw is False, it means that the hook for '
                       r'visualization will not take effect', UserWarning,
                       r'mmseg\.engine\.hooks\.visualization_hook',
                       "the default of MMSegmentation's runtime config; "
                       'tools/test.py --show-dir turns drawing on'), )


def _is_noise(message, category, filename: str) -> bool:
    text = str(message)
    path = filename.replace(os.sep, '/')
    for pattern, kind, module, _ in RUN_NOISE:
        if (issubclass(category, kind) and re.search(pattern, text)
                and re.search(module.replace(r'\.', '/'), path)):
            return True
    return False


class ConsoleFilter(logging.Filter):
    """On a console handler: drop the records :data:`FILE_ONLY` lists."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad record is logging's to report
            return True
        return not any(p.search(message) for p in _FILE_ONLY)


class _Hold(logging.Filter):
    """Last filter of a console handler: keeps a record for
    :meth:`ToolConsole.open` while the console is closed; leaves one of a
    failure's cause to its report (:meth:`ToolConsole.fail`) and the file."""

    def __init__(self, console: 'ToolConsole',
                 handler: logging.Handler) -> None:
        super().__init__()
        self.console, self.handler = console, handler

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, 'failure_cause', False):
            return False
        if self.console.is_open:
            return True
        self.console._held.append((self.handler, record))
        return False


class _ForFile(logging.Handler):
    """On the logger in use before the runner's: keeps its records for
    the runner's log file."""

    def __init__(self, console: 'ToolConsole') -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        self.console._to_file(record)


def _files(logger) -> List[logging.Handler]:
    return [h for h in logger.handlers if isinstance(h, logging.FileHandler)]


def _consoles(logger) -> List[logging.Handler]:
    return [
        h for h in logger.handlers if isinstance(h, logging.StreamHandler)
        and not isinstance(h, logging.FileHandler)
    ]


def _rank_and_world() -> Tuple[int, int]:
    """This process's global rank and the world size, with or without a
    process group (torchrun's, Slurm's or Open MPI's variables)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from ..engine.process_group import LAUNCH_ENV
    env = os.environ
    for launch in LAUNCH_ENV.values():
        rank, world = env.get(launch.rank, ''), env.get(launch.world, '')
        if rank.isdigit() and world.isdigit():
            return int(rank), int(world)
    return 0, 1


def _say(text: str) -> None:
    """The report of a failure, on stderr: the tool's last words, not a
    log record."""
    sys.stderr.write(text + '\n')
    sys.stderr.flush()


def _torchrun_reports() -> bool:
    """Whether torchrun's agent reports a failure of this process: run by
    torchrun, and the agent itself does not restart the ranks. Under
    ``tools/dist_*.sh`` the restarts are the wrapper's own
    (:mod:`mmcv_custom.launching.torchrun`, torchrun with
    ``--max-restarts=0``), so every failure is handed over and the wrapper
    prints it, at a restart too; plain ``torchrun --max-restarts`` reports
    only the last."""
    env = os.environ
    if not env.get('TORCHELASTIC_ERROR_FILE'):
        return False
    restart = env.get('TORCHELASTIC_RESTART_COUNT', '0')
    most = env.get('TORCHELASTIC_MAX_RESTARTS', '0')
    if not (restart.isdigit() and most.isdigit()):
        return True
    return int(restart) >= int(most)


#: How long a rank that leaves the report of a failure before the runner
#: existed to rank 0 waits before it exits: the launcher (torchrun, srun
#: --kill-on-bad-exit) stops the other ranks once one exits.
QUIET_RANK_DELAY = 2.0


class ToolConsole:
    """The console of one tool process (``tools/train.py``,
    ``tools/test.py``): see the module's description.

    Args:
        prog (str): The tool, as its messages name it (``'train.py'``).
        verbose (bool): Print everything on the console as MMEngine does
            (the log file is the same either way). Defaults to False.

    Attributes:
        work_dir (str, optional): Where a failure before the runner exists
            is logged (``<work_dir>/<timestamp>/<timestamp>.log``), when
            that folder exists already; set by the tool once known.
        start_time (float): When the tool started, for the summary.
    """

    def __init__(self, prog: str, verbose: bool = False) -> None:
        self.prog = prog
        self.verbose = verbose
        self.work_dir: Optional[str] = None
        self.start_time = time.time()
        self.is_open = False
        self._held: list = []  # (console handler, record) until open()
        self._for_file: list = []  # records until the runner's log exists
        self._loggers: list = []
        self._runner_logger = None
        self._showwarning = None
        self._failed_at: Optional[float] = None
        self._claimed: Optional[bool] = None

    # -- set-up -----------------------------------------------------------
    def start(self) -> 'ToolConsole':
        """Take over the console of this process: the current MMLogger
        (what ``print_log(..., logger='current')`` writes to until the
        runner exists) and Python's warnings."""
        global _current
        _current = self
        self._adopt(MMLogger.get_current_instance())
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._warn
        # A tool that exits before its header (a usage error) still
        # prints what it logged.
        atexit.register(self.open)
        return self

    def stop(self) -> None:
        """Give the console back: Python's warnings as they were, what is
        held printed; the loggers keep their filters."""
        global _current
        self.open()
        atexit.unregister(self.open)
        if warnings.showwarning == self._warn:
            warnings.showwarning = self._showwarning
        if _current is self:
            _current = None

    def _adopt(self, logger) -> None:
        """Give ``logger``'s console handlers the filters, once; the first
        logger with a log file gets what was kept for it."""
        if any(logger is known for known in self._loggers):
            return
        self._loggers.append(logger)
        for handler in _consoles(logger):
            if not self.verbose:
                handler.addFilter(ConsoleFilter())
            handler.addFilter(_Hold(self, handler))
        if getattr(logger, 'log_file', None) is None:
            logger.addHandler(_ForFile(self))
        elif self._runner_logger is None:
            self._runner_logger = logger
            kept, self._for_file = self._for_file, []
            for record in kept:
                self._to_file(record)

    @contextlib.contextmanager
    def building(self):
        """Around building the runner: its logger gets the filters before
        its first record (the runner logs the environment and the config
        right after creating it), through a log record factory that adopts
        the newest MMLogger whenever a record is made."""
        previous = logging.getLogRecordFactory()

        def factory(*args, **kwargs):
            record = previous(*args, **kwargs)
            self._adopt(MMLogger.get_current_instance())
            return record

        logging.setLogRecordFactory(factory)
        try:
            yield self
        finally:
            if logging.getLogRecordFactory() is factory:
                logging.setLogRecordFactory(previous)
            self._adopt(MMLogger.get_current_instance())

    # -- records ----------------------------------------------------------
    def _to_file(self, record: logging.LogRecord) -> None:
        if self._runner_logger is None:
            self._for_file.append(record)
            return
        for handler in _files(self._runner_logger):
            if record.levelno >= handler.level:
                handler.handle(record)

    def _warn(self,
              message,
              category,
              filename,
              lineno,
              file=None,
              line=None) -> None:
        """``warnings.showwarning``: into the log file; on the console
        unless it is :data:`RUN_NOISE`."""
        record = logging.LogRecord(
            'py.warnings', logging.WARNING, filename, lineno,
            f'{category.__name__}: {message} '
            f'({filename}:{lineno})', None, None)
        self._to_file(record)
        if self.verbose or not _is_noise(message, category, filename):
            self._showwarning(message, category, filename, lineno, file, line)

    def open(self, header: Optional[str] = None, logger=None) -> None:
        """Print ``header`` (through ``logger``: console and log file),
        then what was held back, in order, and from then on everything
        as it comes."""
        self.is_open = True
        if header and logger is not None:
            logger.info(header)
        held, self._held = self._held, []
        for handler, record in held:
            # Every earlier filter passed it already (and MMEngine's
            # duplicate-warning filter would now take it for a repeat).
            if record.levelno >= handler.level:
                handler.acquire()
                try:
                    handler.emit(record)
                finally:
                    handler.release()

    # -- failures ---------------------------------------------------------
    @property
    def log_file(self) -> Optional[str]:
        """The run's log file, once the runner's logger exists."""
        if self._runner_logger is None:
            return None
        return self._runner_logger.log_file

    def note_failure(self) -> None:
        """Where the failure is first seen (before the process group is
        destroyed, which fails the other ranks too): its time decides
        which rank failed first."""
        if self._failed_at is None:
            self._failed_at = time.time()
            self._claim()

    def _claim(self) -> bool:
        """Whether this rank reports the failure itself (not through
        torchrun): the first to create a marker in the run's log folder,
        which every rank shares; before the runner exists, rank 0."""
        if self._claimed is None:
            rank, world_size = _rank_and_world()
            log_file = self.log_file
            if world_size == 1:
                self._claimed = True
            elif _torchrun_reports():
                self._claimed = False
            elif log_file is None:
                self._claimed = rank == 0
            else:
                marker = osp.join(osp.dirname(log_file), '.first_failure')
                try:
                    os.close(
                        os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    self._claimed = True
                except FileExistsError:
                    self._claimed = False
                except OSError:
                    self._claimed = True  # twice rather than never
        return self._claimed

    def fail(self, error: BaseException, plain: bool = False) -> int:
        """Report ``error``, which ends the tool; return its exit code.

        The traceback goes into the log file (the runner's; before the
        runner exists, rank 0 writes one in the work dir if that exists
        already). The cause is printed once: by torchrun's agent (see
        :mod:`mmcv_custom.launching.torchrun`) when it runs the tool and ends
        the run, else by the first rank that failed (before the runner exists,
        every rank reads the same config: rank 0).

        Args:
            error (BaseException): What ended the tool.
            plain (bool): Show the message without the exception's type
                (for messages written to be read alone). Defaults to
                False.

        Returns:
            int: 130 for KeyboardInterrupt, else 1.
        """
        failed_at = self._failed_at or time.time()
        rank, world_size = _rank_and_world()
        interrupted = isinstance(error, KeyboardInterrupt)
        callstack = ''.join(
            traceback.format_exception(
                type(error), error, error.__traceback__))
        before_runner = self._runner_logger is None
        what = 'interrupted' if interrupted else 'failed'
        log_file = self._log_failure(
            rank, world_size,
            f'{self.prog} {what} on rank {rank} of {world_size}:\n'
            f'{callstack}')
        self.open()
        code = 130 if interrupted else 1
        line = str(error) if plain else type(error).__name__ + (
            f': {error}' if str(error) else '')
        report = dict(
            prog=self.prog,
            error='interrupted' if interrupted else line,
            rank=rank,
            world_size=world_size,
            log_file=_shown_path(log_file) if log_file else None,
            time=failed_at,
            exit_code=code)
        if _torchrun_reports():
            if interrupted or write_error_file(report, callstack):
                if before_runner and rank != 0:
                    time.sleep(QUIET_RANK_DELAY)
                return code
            # No error file to hand it over in: say it here.
            _say(format_report(report))
        elif self._claim():
            _say(format_report(report))
        elif before_runner:
            time.sleep(QUIET_RANK_DELAY)
        return code

    def _log_failure(self, rank: int, world_size: int,
                     message: str) -> Optional[str]:
        """Write ``message`` as an ERROR record into the log file; return
        the file's path, or None where there is none."""
        record = logging.LogRecord('mmengine', logging.ERROR, self.prog, 0,
                                   message, None, None, 'main')
        logger = self._runner_logger
        if logger is not None:
            files = _files(logger)
            for handler in files:
                handler.handle(record)
            if files:
                return logger.log_file
            # Another rank than 0: its logger has no file; add to rank 0's.
            if logger.log_file and osp.isdir(osp.dirname(logger.log_file)):
                if self._append(logger.log_file, [record]):
                    return logger.log_file
            return None
        if rank != 0 or not self.work_dir or not osp.isdir(self.work_dir):
            return None  # a refused start creates no work dir
        stamp = time.strftime('%Y%m%d_%H%M%S', time.localtime())
        path = osp.join(self.work_dir, stamp, f'{stamp}.log')
        try:
            os.makedirs(osp.dirname(path), exist_ok=True)
        except OSError:
            return None
        kept, self._for_file = self._for_file, []
        return path if self._append(path, kept + [record]) else None

    @staticmethod
    def _append(path: str, records) -> bool:
        if link_of(path) is not None:
            return False  # never appended to through a link
        try:
            handler = logging.FileHandler(path, 'a')
        except OSError:
            return False
        handler.setFormatter(
            MMFormatter(color=False, datefmt='%Y/%m/%d %H:%M:%S'))
        try:
            for record in records:
                handler.handle(record)
        finally:
            handler.close()
        return True


_current: Optional[ToolConsole] = None


def current_console() -> Optional[ToolConsole]:
    """The console :meth:`ToolConsole.start` took over, if any."""
    return _current


def report_failure(error: BaseException,
                   prog: str,
                   plain: bool = False) -> int:
    """:meth:`ToolConsole.fail` on the current console (one is started
    for a failure before the tool started its own); the exit code."""
    console = _current or ToolConsole(prog).start()
    return console.fail(error, plain=plain)


# -- header and summary ------------------------------------------------------
def _shown_path(path: str) -> str:
    """``path`` relative to the current directory when it is below it."""
    if not path:
        return str(path)
    relative = osp.relpath(osp.abspath(path))
    return path if relative.startswith(os.pardir) else relative


def _ranks(runner) -> str:
    import torch
    import torch.distributed as dist
    device = 'GPU' if torch.cuda.is_available() else 'CPU'
    if dist.is_available() and dist.is_initialized():
        return (f'{dist.get_world_size()}, backend {dist.get_backend()}, '
                f'on {device}')
    return f'1 (not distributed), on {device}'


def header_text(runner, method: str, prog: Optional[str] = None) -> str:
    """The block that opens a tool's console: the config, the work dir,
    the log file and the ranks."""
    prog = prog or f'{method}.py'
    config = getattr(runner.cfg, 'filename', None) or '(config object)'
    lines = [f'{prog} {_shown_path(config)}']
    if method == 'test' and runner.cfg.get('load_from'):
        lines.append(
            f'  checkpoint : {_shown_path(str(runner.cfg.load_from))}')
    lines.append(f'  work dir   : {_shown_path(runner.work_dir)}')
    log_file = getattr(runner.logger, 'log_file', None)
    if log_file:
        lines.append(f'  log file   : {_shown_path(log_file)} (with the '
                     'environment, the full config and the hooks)')
    lines.append(f'  ranks      : {_ranks(runner)}')
    return '\n'.join(lines)


def _number(value) -> str:
    try:
        return f'{float(value):.4g}'
    except (TypeError, ValueError):
        return str(value)


def _metrics(metrics: dict) -> str:
    return ', '.join(f'{k} {_number(v)}' for k, v in metrics.items()
                     if not k.endswith('time'))


def _size(num_bytes: int) -> str:
    if num_bytes >= 2**30:
        return f'{num_bytes / 2**30:.2f} GiB'
    return f'{num_bytes / 2**20:.1f} MiB'


def _traffic(runner) -> Optional[str]:
    """What the comm hook saved, from the runner hook's counters."""
    from ..engine.comm_hook_registration_hook import CommHookRegistrationHook
    for hook in runner.hooks:
        if isinstance(hook, CommHookRegistrationHook):
            counted = hook.traffic()
            if not counted or not counted[0]:
                return None
            baseline, sent = counted
            if sent is None:
                return ('comm_MB: unknown (the hook has no record that '
                        f'counts what it sends); DDP sends {_size(baseline)} '
                        'without the hook')
            saved = baseline - sent
            return (f'rank 0 sent {_size(sent)} where DDP sends '
                    f'{_size(baseline)} without the hook: {_size(saved)} '
                    f'({saved / baseline:.0%}) saved')
    return None


def progress_text(runner) -> str:
    """``'iteration 600 of 600'`` (``'epoch 12 of 12'`` by epoch): where
    the training loop stands."""
    from mmengine.runner import EpochBasedTrainLoop
    loop = runner.train_loop
    if isinstance(loop, EpochBasedTrainLoop):
        return f'epoch {runner.epoch} of {loop.max_epochs}'
    return f'iteration {runner.iter} of {loop.max_iters}'


def summary_text(runner, method: str, result, seconds: float) -> str:
    """The block that closes a tool's console: where training or testing
    ended, the final metrics, the checkpoints, what the comm hook saved,
    the wall time and the log file."""
    hub = runner.message_hub
    lines = []
    if method == 'train':
        where = progress_text(runner)
        lines.append(f'Training done: {where}; wall time {seconds:.1f} s')
        scalars = hub.log_scalars
        if 'train/loss' in scalars:
            # As the last progress line shows it (smoothed over the log
            # processor's window).
            window = getattr(runner.log_processor, 'window_size', 1)
            loss = scalars['train/loss'].mean(
                window if isinstance(window, int) else 1)
            lines.append(f'  loss       : {_number(loss)}')
        val = {
            key[len('val/'):]: buffer.current()
            for key, buffer in scalars.items() if key.startswith('val/')
        }
        if _metrics(val):
            lines.append(f'  val        : {_metrics(val)}')
        last = hub.get_info('last_ckpt')
        if last:
            lines.append(f'  checkpoints: {_shown_path(osp.dirname(last))} '
                         f'(last: {osp.basename(last)})')
        traffic = _traffic(runner)
        if traffic:
            lines.append(f'  comm hook  : {traffic}')
    else:
        lines.append(f'{method.capitalize()} done; wall time {seconds:.1f} s')
        if isinstance(result, dict) and _metrics(result):
            lines.append(f'  metrics    : {_metrics(result)}')
    log_file = getattr(runner.logger, 'log_file', None)
    if log_file:
        lines.append(f'  log file   : {_shown_path(log_file)}')
    return '\n'.join(lines)
