"""``make`` judges the environment by what it was installed from.

A fresh clone beside a current environment must neither rebuild it (twenty
minutes of mmcv) nor re-point its editable install, while a changed
requirement must reinstall. Checked with ``make -n`` (which prints the
commands it would run and runs none) on a copy of the real Makefile and the
real files it hashes, against a stand-in environment folder.
"""
import os
import os.path as osp
import shutil
import subprocess
import time

import pytest

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
HASHED = ('setup.py', 'requirements/runtime.txt', 'requirements/dev.txt')

pytestmark = pytest.mark.skipif(
    shutil.which('make') is None, reason='needs make')


def _clone(into):
    """The files ``make install`` reads, copied with fresh file times (as a
    new clone has)."""
    for path in ('Makefile', 'mmcv_custom/csrc/cpu_codec.c') + HASHED:
        os.makedirs(osp.dirname(osp.join(into, path)) or into, exist_ok=True)
        shutil.copy(osp.join(ROOT, path), osp.join(into, path))
    return into


def _would_run(clone, venv):
    out = subprocess.run(['make', '-n', 'install', f'VENV={venv}'],
                         cwd=clone,
                         capture_output=True,
                         text=True,
                         check=True)
    return out.stdout


def _installed(clone, venv):
    """A stand-in environment as ``make install`` leaves it for ``clone``:
    the stamp it writes (the name ``make -n`` says it would touch)."""
    os.makedirs(venv, exist_ok=True)
    commands = _would_run(clone, venv).splitlines()
    stamp = [
        c.split()[-1] for c in commands
        if c.startswith('touch ') and '.installed-' in c
    ]
    assert len(stamp) == 1, commands
    # Older than every file of the clone, as an environment made before it.
    with open(stamp[0], 'w'):
        pass
    os.utime(stamp[0], (time.time() - 3600, ) * 2)
    return stamp[0]


def test_a_fresh_clone_beside_a_current_environment_installs_nothing(tmp_path):
    venv = str(tmp_path / 'venv')
    _installed(_clone(str(tmp_path / 'first')), venv)
    plan = _would_run(_clone(str(tmp_path / 'second')), venv)
    assert 'pip install' not in plan
    # Only this clone's own C extension is built, beside its sources.
    assert 'build_ext --inplace' in plan


def test_a_changed_requirement_reinstalls(tmp_path):
    venv = str(tmp_path / 'venv')
    clone = _clone(str(tmp_path / 'clone'))
    old = _installed(clone, venv)
    assert 'pip install' not in _would_run(clone, venv)
    with open(osp.join(clone, 'requirements/dev.txt'), 'a') as f:
        f.write('pytest-timeout\n')
    plan = _would_run(clone, venv)
    assert '-r requirements/dev.txt' in plan
    assert 'install --no-build-isolation --no-deps -e .' in plan
    # The stale stamp goes, so the next run does not take it for current.
    assert f'rm -f {venv}/.installed*' in plan
    touched = [
        line.split()[-1] for line in plan.splitlines()
        if line.startswith('touch ') and '.installed-' in line
    ]
    assert len(touched) == 1 and touched[0] != old
