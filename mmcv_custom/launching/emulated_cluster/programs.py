"""How the package runs its own files as programs: the keeper
(:mod:`.namespaces`), a node's first program (:mod:`.node_start`) and a
rank of the calibration (:mod:`.calibration_rank`).

They run by path, not with ``-m``: ``-m`` would import ``mmcv_custom``
(torch, MMEngine: seconds and hundreds of MB for each node's command),
and the calibration's interpreter may not have the package at all. So
each of those files imports only the standard library (and torch for the
calibration), nothing of the package.
"""
import os
import sys
from typing import List, Optional

__all__ = ['program_argv']


def program_argv(path: str,
                 *args: str,
                 python: Optional[str] = None) -> List[str]:
    """The command that runs the file ``path`` of this package as a program
    with ``args``, by ``python`` (default: this interpreter).

    Python would put the file's folder first on ``sys.path``, where a
    module of this package could shadow one that the program (or torch)
    imports. ``-P`` (3.11+) leaves it out; ``-I`` does as well on older
    Pythons, but also ignores PYTHON* variables.
    """
    flags = ['-P'] if sys.version_info >= (3, 11) else ['-I']
    return [python or sys.executable] + flags + [os.path.abspath(path)
                                                 ] + list(args)
