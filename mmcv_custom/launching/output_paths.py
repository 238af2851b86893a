"""The tools' output options, checked before any work starts.

A file a tool writes at the end of a long run (``--json``, ``--out``) is
checked first: a missing or read-only folder is a usage error in a second,
not a traceback after hours.
"""
import os

__all__ = ['check_writable']


def check_writable(parser, option: str, path: str) -> None:
    """For the tools' output options: ``parser.error`` (a usage error, exit
    code 2) now, not after a long run, if ``path`` cannot be written: its
    folder is missing or read-only, or it is a folder. Leaves no file
    behind when there was none.

    Args:
        parser (argparse.ArgumentParser): The tool's parser.
        option (str): The option, for the message, e.g. ``'--json'``.
        path (str): The file the tool will write.
    """
    if os.path.isdir(path):
        parser.error(f'{option} {path}: is a directory, not a file')
    existed = os.path.exists(path)
    try:
        with open(path, 'a'):
            pass
    except OSError as e:
        parser.error(f'{option} {path}: cannot write there ({e.strerror})')
    if not existed:
        os.remove(path)
