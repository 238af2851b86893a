"""Tools (scripts under tools/, not a package) loaded into the test process,
their argument checks read back, the network namespaces they leave, a
plugin-like hook registered with a record for the length of a test, and the
toy sets the end-to-end runs train on."""
import contextlib
import importlib.util
import os.path as osp
import subprocess
import sys

import pytest

__all__ = [
    'load_script', 'usage_errors', 'usage_error_line', 'netns_names',
    'plugin_hook', 'toy_set'
]

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def toy_set(num_train: int, num_val: int) -> list:
    """``--cfg-options`` items for a toy set of ``num_train`` and
    ``num_val`` images in every split, drawn into a folder of its own for
    these sizes (``data/toy_shapes-<num_train>-<num_val>``).

    The dataset draws its folder anew when asked for other sizes than it
    holds; runs on different sizes sharing one folder would redraw it under
    each other when the suite runs files in parallel (``make test``'s
    workers). One folder per size is never redrawn, and runs on the same
    size share it (drawn once, atomically)."""
    root = osp.join(ROOT, 'data', f'toy_shapes-{num_train}-{num_val}')
    return [
        f'{split}_dataloader.dataset.{key}={value}'
        for split in ('train', 'val', 'test')
        for key, value in (('data_root', root), ('generate.num_train',
                                                 num_train),
                           ('generate.num_val', num_val))
    ]


def load_script(path: str, name: str):
    """The script at ``path`` as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error_line(tool: str, *args: str) -> str:
    """Run the script ``tool`` with ``args`` as a user would (a fresh
    interpreter, from the repository), expect a usage error (exit 2,
    nothing on stdout) and return the last line of its stderr."""
    done = subprocess.run([sys.executable, tool, *args],
                          capture_output=True,
                          text=True,
                          timeout=120,
                          cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == ''
    return done.stderr.splitlines()[-1]


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


@contextlib.contextmanager
def plugin_hook():
    """A hook registered as ``'plugin_int4'`` with a record (label
    ``'int4 (plugin)'``, a colour, a codec, a variant), as a plugin would
    register one; removed again on leaving. Yields the hook's name
    and its record."""
    import torch

    from mmcv_custom.comm.records import (HookRecord, HookVariant,
                                          unregister_hook_record)
    from mmcv_custom.comm.registry import COMM_HOOKS

    def plugin_int4_hook(process_group, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def codec(bucket, world_size, rank):
        return lambda: bucket.div_(world_size)

    record = HookRecord(
        sent_format='int4',
        quantizes=True,
        label='int4 (plugin)',
        colour='tab:olive',
        codec=codec,
        variants=(HookVariant('int4_plugin', {}, 'int4 (plugin)',
                              'tab:olive'), ))
    name = 'plugin_int4'
    COMM_HOOKS.register_module(
        name=name, module=plugin_int4_hook, record=record)
    try:
        yield name, record
    finally:
        del COMM_HOOKS.module_dict[name]
        unregister_hook_record(plugin_int4_hook)
