"""Tools (scripts under tools/, not a package) loaded into the test process,
their argument checks read back, and the network namespaces they leave."""
import importlib.util
import subprocess
import sys

import pytest

__all__ = ['load_script', 'usage_errors', 'netns_names']


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


def netns_names() -> set:
    """Names in ``ip netns list`` (this process's view)."""
    listed = subprocess.run(['ip', 'netns', 'list'],
                            capture_output=True,
                            text=True,
                            check=True).stdout
    return {ln.split()[0] for ln in listed.splitlines() if ln.strip()}
