"""Progress of the long tools: steps done out of the total, with an ETA.

The benchmarks run for minutes and print their tables at the end; this is
what they say meanwhile, on stderr, so that the tables on stdout stay
whole for whoever parses them. On a terminal it is a ``rich`` progress bar
(rich comes with MMEngine, whose own ``ProgressBar`` has no ETA for work of
uneven steps); anywhere else (a pipe, a file, CI, a test capturing the
output) it is one plain line per step, which a log keeps::

    [3/40] 4 MB, bf16_compress_hook: warm-up and bytes: 2.1 s, ETA 0:00:40
    ...
    [40/40] 16 MB, codecs: 3.0 s, done in 0:01:52

The ETA is the work left at the rate measured since the first step ended
(the first carries what happens once: start-up, first allocations); with
``weights`` (each step's expected cost, in any unit) a 100 MB step is not
counted as a 1 MB one.

Example:
    >>> with Progress(3, stream=sys.stderr) as progress:
    ...     for size in (1, 4, 16):
    ...         work(size)
    ...         progress.advance(f'{size} MB')
"""
import sys
import time
from typing import IO, Optional, Sequence

__all__ = ['Progress', 'format_eta']


def format_eta(seconds: Optional[float]) -> str:
    """``H:MM:SS``, as rich and ``datetime.timedelta`` print durations;
    ``-:--:--`` when not known yet."""
    if seconds is None:
        return '-:--:--'
    seconds = max(0, int(round(seconds)))
    return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


class Progress:
    """Steps done out of ``total``, with an ETA, on ``stream``.

    Args:
        total (int): Steps in all (at least 1).
        weights (Sequence[float], optional): Expected cost of each step,
            ``total`` of them, all > 0, for the ETA. Defaults to None: all
            steps alike.
        label (str, optional): Put before every line, e.g. the name of the
            run (``[int8_ef] [50/600] ...``). Defaults to None.
        stream (IO[str], optional): Where to write. Defaults to None:
            ``sys.stderr`` at construction.
        terminal (bool, optional): Draw a rich progress bar (True) or
            write plain lines (False). Defaults to None: a bar when
            ``stream`` is a terminal.
        step_time (bool): End each plain line's note with the seconds since
            the step before (``: 2.1 s``). Defaults to True; turn it off
            when steps are reported in jumps (``update``).
        enabled (bool): Defaults to True; False makes every call do
            nothing (e.g. on ranks other than 0).
        done (int): Steps already done when it starts, e.g. a training run
            first seen at its 10th iteration. Defaults to 0.
        since (float, optional): When the work started, a
            ``time.monotonic()`` value, for the last line's ``done in``.
            Defaults to None: now.

    Raises:
        ValueError: ``total`` is below 1, or ``weights`` is not ``total``
            numbers > 0.
    """

    def __init__(self,
                 total: int,
                 *,
                 weights: Optional[Sequence[float]] = None,
                 label: Optional[str] = None,
                 stream: Optional[IO[str]] = None,
                 terminal: Optional[bool] = None,
                 step_time: bool = True,
                 enabled: bool = True,
                 done: int = 0,
                 since: Optional[float] = None) -> None:
        if not isinstance(total, int) or total < 1:
            raise ValueError(f'total should be an int >= 1, but got {total!r}')
        if weights is not None:
            weights = [float(w) for w in weights]
            if len(weights) != total or not all(w > 0 for w in weights):
                raise ValueError(
                    f'weights should be {total} numbers > 0 (one per step), '
                    f'but got {len(weights)}' +
                    ('' if len(weights) != total else ' with some <= 0'))
        self.total = total
        self.enabled = enabled
        self.label = label
        self.step_time = step_time
        self.done = max(0, min(int(done), total))
        self._cumulative = [0.0]
        for w in weights or [1.0] * total:
            self._cumulative.append(self._cumulative[-1] + w)
        self._stream = sys.stderr if stream is None else stream
        self._start = self._last = time.monotonic()
        if since is not None:
            self._start = since
        # Where the ETA's rate is measured from: the first update (see
        # ``update``), as (time, work done).
        self._base: Optional[tuple] = None
        # Seconds left as of the last update, and when that was.
        self._left: Optional[float] = None
        self._left_at = self._start
        self._bar = None
        if not enabled:
            return
        if terminal is None:
            isatty = getattr(self._stream, 'isatty', None)
            terminal = bool(isatty and isatty())
        if terminal:
            self._bar = self._start_bar()

    # -- reporting ---------------------------------------------------------
    def advance(self, note: str = '', steps: int = 1) -> None:
        """``steps`` more are done; ``note`` says which (e.g. ``'4 MB,
        round 2/10'``)."""
        self.update(self.done + steps, note)

    def update(self, done: int, note: str = '') -> None:
        """``done`` steps are done in all (at most ``total``)."""
        if not self.enabled:
            return
        done = max(0, min(int(done), self.total))
        now = time.monotonic()
        step_s, self._last = now - self._last, now
        self.done = done
        work = self._cumulative[done]
        if self._base is None:
            # The first step carries what happens once (start-up, the
            # first allocations, a profiler's set-up): timed from its end,
            # the ETA is not thrown off by it.
            self._base = (now, work)
        elif work > self._base[1]:
            rate = (now - self._base[0]) / (work - self._base[1])
            self._left = rate * (self._cumulative[-1] - work)
            self._left_at = now
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=work,
                count=f'{done}/{self.total}',
                note=note)
            if done == self.total:
                self.close()
            return
        line = f'[{done}/{self.total}]'
        if self.label:
            line = f'[{self.label}] {line}'
        if note:
            line += f' {note}'
            if self.step_time:
                line += f': {step_s:.1f} s'
        if done == self.total:
            line += f', done in {format_eta(now - self._start)}'
        else:
            line += f', ETA {format_eta(self.eta())}'
        self._stream.write(line + '\n')
        self._stream.flush()

    def eta(self) -> Optional[float]:
        """Seconds left, from the elapsed time and the work left; None
        before the first step."""
        if self._left is None:
            return None
        return max(0.0, self._left - (time.monotonic() - self._left_at))

    def close(self) -> None:
        """Stop the bar (it stays on screen as it ended). Idempotent."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.stop()

    def __enter__(self) -> 'Progress':
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the terminal bar --------------------------------------------------
    def _start_bar(self):
        from rich.console import Console
        from rich.progress import BarColumn
        from rich.progress import Progress as RichProgress
        from rich.progress import ProgressColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        owner = self

        class _Eta(ProgressColumn):
            # Ours, not rich's TimeRemainingColumn: that one divides by the
            # recent speed in weight units, which jumps between a 1 MB and
            # a 100 MB step.
            def render(self, task) -> Text:
                return Text(f'ETA {format_eta(owner.eta())}')

        columns = [
            BarColumn(bar_width=30),
            TextColumn('{task.fields[count]}'),
            TimeElapsedColumn(),
            _Eta(),
            TextColumn('{task.fields[note]}'),
        ]
        if self.label:
            columns.insert(0, TextColumn(f'[{self.label}]', markup=False))
        bar = RichProgress(
            *columns,
            console=Console(file=self._stream, force_terminal=True),
            refresh_per_second=2)
        self._task = bar.add_task(
            '',
            total=self._cumulative[-1],
            completed=self._cumulative[self.done],
            count=f'{self.done}/{self.total}',
            note='')
        bar.start()
        return bar
