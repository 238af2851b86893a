"""Tools (scripts under tools/, not a package) loaded into the test process,
and their argument checks read back."""
import importlib.util
import sys

import pytest

__all__ = ['load_script', 'usage_errors']


def load_script(path: str, name: str):
    """The script at ``path`` as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_errors(tool, path: str, monkeypatch, capsys):
    """A function running ``tool.parse_args(args)`` in this process (a
    subprocess per case would import torch again for nothing) that
    expects it to exit and returns the exit code and the last line of
    stderr it printed (nothing on stdout)."""
    monkeypatch.setattr(sys, 'argv', [path])

    def parse(args):
        with pytest.raises(SystemExit) as exited:
            tool.parse_args(args)
        captured = capsys.readouterr()
        assert captured.out == ''
        return exited.value.code, captured.err.splitlines()[-1]

    return parse
