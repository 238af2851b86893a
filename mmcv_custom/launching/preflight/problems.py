"""What the preflight says: one :class:`Problem` per thing that would stop
the run, and the one message for all of them (:class:`PreflightError`).

Every check of this package returns a list of problems instead of raising
at the first, so that a user fixes everything in one go.
"""
import os
import os.path as osp
from dataclasses import dataclass
from typing import List

__all__ = ['Problem', 'format_problems', 'PreflightError', 'cwd_note']


@dataclass(frozen=True)
class Problem:
    """One thing that would stop the run, found before it starts.

    Attributes:
        what (str): Names the config key or source, the path and what is
            wrong with it.
        fix (str): What to do about it; empty when ``what`` says it.
    """
    what: str
    fix: str = ''

    def __str__(self) -> str:
        if not self.fix:
            return self.what
        return f'{self.what.rstrip(".")}. Fix: {self.fix}'


def format_problems(problems: List[Problem]) -> str:
    """The one message for ``problems``: a single problem on one line,
    several under a header line, one line each."""
    if len(problems) == 1:
        return str(problems[0])
    lines = [
        f'{len(problems)} problems, found before building the model or '
        'starting the process group:'
    ]
    lines += [f'  {i}. {p}' for i, p in enumerate(problems, 1)]
    return '\n'.join(lines)


class PreflightError(RuntimeError):
    """What :func:`check_preflight` found; ``str()`` is the message.

    Attributes:
        problems (list[Problem]): Every problem, in the order found.
    """

    def __init__(self, problems: List[Problem]) -> None:
        self.problems = list(problems)
        super().__init__(format_problems(self.problems))


def cwd_note(path: str) -> str:
    """What a problem adds to a relative ``path``: where it is relative
    to (the current directory), which a user launching from another
    folder may not expect; nothing for an absolute path."""
    if osp.isabs(path):
        return ''
    return (' (relative paths are from the current directory, '
            f'{os.getcwd()})')
