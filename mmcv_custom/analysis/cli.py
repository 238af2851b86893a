"""Checks the tools run on their command line before any work starts.

A bad value fails in a second as a usage error (``parser.error``: one
line, exit code 2), not as a traceback after minutes of measuring.
"""
import os
import os.path as osp
from typing import Optional

from mmcv_custom.launcher import check_writable
from mmcv_custom.preflight import PreflightError, checked_config

__all__ = ['check_output', 'read_config', 'WORK_DIRS']

#: The folder runs and outputs go to, as with MMSegmentation's tools.
WORK_DIRS = 'work_dirs'


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
    :func:`mmcv_custom.launcher.check_writable` (a folder, a read-only
    place: a usage error).

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
