"""Checks the tools run on their command line before any work starts.

A bad value fails in a second as a usage error (``parser.error``: one
line, exit code 2), not as a traceback after minutes of measuring.
"""
import argparse
import math
import os
import os.path as osp
import sys
from typing import Any, Callable, Optional, Sequence

from mmcv_custom.launching.emulated_cluster import shaping
from mmcv_custom.launching.output_paths import check_writable
from mmcv_custom.launching.preflight import PreflightError, checked_config

__all__ = [
    'check_output', 'check_work_dir', 'convert_file', 'read_config',
    'cfg_options', 'WORK_DIRS', 'tool_error', 'write_failure_reason',
    'checked_type', 'positive_int', 'positive_float', 'link_rate', 'LINK_RATES'
]

#: The folder runs and outputs go to, as with MMSegmentation's tools.
WORK_DIRS = 'work_dirs'


def checked_type(convert, ok, rule: str):
    """An argparse ``type``: ``convert(text)``, refused unless ``ok`` of
    it, with ``'TEXT' is not RULE`` (argparse adds the option's name)."""

    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f'{text!r} is not {rule}')
        return value

    return parse


#: argparse types: an int >= 1, a finite number > 0.
positive_int = checked_type(int, lambda v: v >= 1, 'an int >= 1')
positive_float = checked_type(float, lambda v: math.isfinite(v) and v > 0,
                              'a number > 0')

# 0 is refused, not read as 'unshaped' (a 0 Mbit/s link carries nothing),
# as is a rate tc's tbf cannot hold: here, not by tc on the nodes.
#: The rates the emulated link takes, for the tools' help.
LINK_RATES = f'{shaping.MIN_RATE_MBIT:g} to {shaping.MAX_RATE_MBIT:g}'
_mbit = checked_type(
    float, lambda v: shaping.MIN_RATE_MBIT <= v <= shaping.MAX_RATE_MBIT,
    f"a rate: give Mbit/s from {LINK_RATES} (what tc's tbf shapes as given), "
    "or 'unshaped' for a link that is not shaped")


def link_rate(text: str) -> Optional[float]:
    """An argparse ``type`` for the emulated link's ``--rates``: Mbit/s
    tc's tbf shapes, or ``'unshaped'`` (None)."""
    return None if text.lower() == 'unshaped' else _mbit(text)


def _under_work_dirs(path: str) -> bool:
    parts = osp.normpath(osp.abspath(path)).split(os.sep)
    return WORK_DIRS in parts[:-1]


def check_output(parser, option: str, path: str) -> None:
    """Make sure the tool can write ``path`` when it is done.

    Missing folders under a ``work_dirs`` folder are created, as
    MMSegmentation's tools create their work dirs, so that
    ``--json work_dirs/bench/bench.json`` works on a fresh checkout.
    Elsewhere the folder must exist: a typo in ``/data/reslts/x.json``
    is a usage error, not a new folder. Then
    :func:`~mmcv_custom.launching.output_paths.check_writable` (a folder, a
    read-only place: a usage error).

    Args:
        parser (argparse.ArgumentParser): The tool's parser.
        option (str): The option, for the message, e.g. ``'--json'``.
        path (str): The file the tool will write.
    """
    folder = osp.dirname(path)
    if folder and not osp.isdir(folder) and _under_work_dirs(path):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            parser.error(f'{option} {path}: cannot create {folder} '
                         f'({e.strerror})')
    check_writable(parser, option, path)


def check_work_dir(parser, option: str, path: str) -> None:
    """Make the folder ``path`` the tool writes into now (its runs or
    nodes log there), or ``parser.error`` when it cannot be made or
    written: a usage error in a second, not after the cluster is up."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        parser.error(f'{option} {path}: cannot create it ({e.strerror})')
    if not os.access(path, os.W_OK | os.X_OK):
        parser.error(f'{option} {path}: not writable')


def tool_error(prog: str, error, code: int) -> int:
    """Say ``error`` in one line, ``PROG: error: ...`` as argparse does,
    on stderr; return ``code`` (the tool's exit code)."""
    message = str(error).strip().splitlines() or [type(error).__name__]
    print(f'{prog}: error: {message[0]}', file=sys.stderr)
    return code


def convert_file(prog: str, dst: str, prepare: Callable[[], Any],
                 write: Callable[[Any], str]) -> int:
    """A converter's two steps and their exit codes: ``prepare()`` (read
    and check the source) refused is a usage-like error, exit 2, nothing
    written; ``write(prepared)`` failing (a full disk, say) is exit 1,
    ``DST`` untouched (the writers write a temporary and rename it). The
    line ``write`` returns goes to stdout; 0."""
    try:
        prepared = prepare()
    except (OSError, EOFError, ValueError, RuntimeError) as e:
        # A missing file, an unknown layout, another model, an unsafe,
        # damaged, unverified or unreadable file, a DST over SRC.
        return tool_error(prog, e, 2)
    try:
        print(write(prepared))
    except (OSError, RuntimeError) as e:
        return tool_error(
            prog, f'cannot write {dst} ({write_failure_reason(e)}): '
            'nothing written', 1)
    return 0


def write_failure_reason(error: BaseException) -> str:
    """Why a write failed: the OSError behind ``error`` (``torch.save``
    reports one as a RuntimeError of its own, "unexpected pos ...")."""
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return (str(error).strip().splitlines() or [type(error).__name__])[0]
    return cause.strerror or str(cause)


def read_config(parser,
                option: str,
                path: str,
                cfg_options: Optional[dict] = None):
    """``path`` read as an MMEngine config (``--cfg-options`` merged), or
    a usage error naming the file and why: missing, not a config
    (``.py``, ``.json``, ``.yml``), or one that does not parse.

    Args:
        parser (argparse.ArgumentParser): The tool's parser.
        option (str): How the command line names it, e.g. ``'config'`` or
            ``'--config'``.
        path (str): The config file.
        cfg_options (dict, optional): Merged into the config.

    Returns:
        mmengine.Config: The config.
    """
    try:
        return checked_config(path, cfg_options, option=option)
    except PreflightError as e:
        parser.error(str(e))


def cfg_options(parser, items: Optional[Sequence[str]]) -> Optional[dict]:
    """``--cfg-options KEY=VALUE ...`` as ``tools/train.py`` reads them
    (:func:`~mmcv_custom.launching.cfg_options.parse_cfg_option`: MMEngine's
    ``DictAction``, and a ``dict(...)`` read as the dict it writes), or a
    usage error naming the item: one without ``=``, or a value neither can
    read.

    Args:
        parser (argparse.ArgumentParser): The tool's parser.
        items (Sequence[str], optional): The words of ``--cfg-options``,
            as argparse collected them (``nargs='+'``).

    Returns:
        dict or None: ``{key: value}``; None without ``items``.
    """
    if not items:
        return None
    from mmcv_custom.launching.cfg_options import parse_cfg_option
    merged = {}
    for item in items:
        try:
            key, value = parse_cfg_option(item)
        except ValueError as e:
            parser.error(f'--cfg-options {e}')
        merged[key] = value
    return merged
