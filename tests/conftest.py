"""Keep the pytest process free of OpenMP thread teams, and keep each test
file on one worker when ``make test`` runs files in parallel.

mmcv_custom.testing.run_ranks forks the pytest process to start gloo ranks.
A process that forks after its OpenMP runtime started a thread team (any
multi-threaded torch op in a test, e.g. building a large model) leaves the
children hanging in their first parallel region. One OpenMP thread means no
team is ever started. It is set through the environment, before torch is
imported:
``torch.set_num_threads`` would instead make every new thread of a forked
child (gloo's, which run the hooks' callbacks) re-apply the setting to a
thread pool that does not survive the fork, and abort ("Invalid thread
pool"). Forked ranks and the tools' subprocesses inherit it: two ranks on a
2-core machine, one thread each.

What a rank's first DDP or Runner imports, each rank of each test would
import again: ``torch._dynamo`` (DDP's constructor imports it) and the
matplotlib modules of MMEngine's Visualizer, 0.4 s of CPU in a rank's
first DDP and 0.8 s in its first Runner. The test process imports them
once, before any test forks (:func:`_imported_before_forking`), and the
ranks inherit them. Measured file by file, CPU seconds of pytest and its
ranks without and with it: test_powersgd_resume 81 and 33,
test_hook_state_files 64 and 23, test_int8_hook 42 and 21,
test_runner_hook 33 and 15; each test process pays 0.7 s once. Importing
starts no thread (OpenMP's included) and picks no matplotlib backend.

``make test`` runs the test files on parallel workers (pytest-xdist,
``--dist loadfile``), each file whole on one worker, the files with the
most end-to-end runs first; files that share machine-wide state run on one
worker together (:data:`ONE_WORKER`).
"""
import importlib
import os
import subprocess
import sys

import pytest

if 'torch' in sys.modules:
    raise RuntimeError('tests/conftest.py must run before torch is imported '
                       'to keep forked gloo ranks safe')
os.environ['OMP_NUM_THREADS'] = '1'


@pytest.fixture(scope='session', autouse=True)
def _imported_before_forking():
    """Import once what each forked rank would (the module docstring says
    why); a fixture, not an import here, so that only processes that run
    tests pay for it (not xdist's controller, not ``--collect-only``)."""
    for name in ('torch._dynamo', 'matplotlib.figure',
                 'matplotlib.backends.backend_agg'):
        importlib.import_module(name)


def _disk(tmp_path, size: str):
    """A real disk of ``size`` (a tmpfs: root only) at ``tmp_path/disk``,
    unmounted afterwards; the test is skipped where none can be made."""
    mount = tmp_path / 'disk'
    mount.mkdir()
    made = subprocess.run(
        ['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs',
         str(mount)],
        capture_output=True,
        text=True)
    if made.returncode != 0:
        pytest.skip(f'cannot mount a tmpfs here: {made.stderr.strip()}')
    try:
        yield mount
    finally:
        subprocess.run(['umount', str(mount)], check=False)


@pytest.fixture
def tiny_disk(tmp_path):
    """A full disk for one small checkpoint: a 1 MiB tmpfs."""
    yield from _disk(tmp_path, '1m')


@pytest.fixture
def small_disk(tmp_path):
    """A full disk for a toy model's save: an 8 MiB tmpfs."""
    yield from _disk(tmp_path, '8m')


#: Test files that share machine-wide state and so one worker runs them one
#: after the other: the emulated clusters' network namespaces (a cluster
#: opening on another worker would remove a killed cluster's namespaces
#: while a test has them in hand).
ONE_WORKER = {
    'tests/test_launching/test_emulated_cluster.py': 'emulated nodes',
    'tests/test_analysis/test_benchmark_step_time.py': 'emulated nodes',
}


def _test_file(nodeid: str) -> str:
    return nodeid.split('::', 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with :data:`ONE_WORKER`'s files put together.

    Files go to the workers whole, so a module's fixtures (a trained run
    its tests share) are built once, in the order the workers collected
    them (:func:`pytest_collection_modifyitems`), not by their number of
    tests."""
    if config.getvalue('dist') != 'loadfile':
        return None
    from xdist.scheduler import LoadScopeScheduling
    config.option.loadscopereorder = False

    class _Files(LoadScopeScheduling):

        def _split_scope(self, nodeid):
            test_file = _test_file(nodeid)
            return ONE_WORKER.get(test_file, test_file)

    return _Files(config, log)


def pytest_collection_modifyitems(config, items):
    """On a parallel worker, the files with the most end-to-end runs
    (tests marked ``slow``) first, the rest in their order: the longest
    files start first and the many short ones fill in at the end, so the
    two workers finish about together."""
    if not os.environ.get('PYTEST_XDIST_WORKER'):
        return
    slow = {}
    for item in items:
        test_file = _test_file(item.nodeid)
        heavy = item.get_closest_marker('slow') is not None
        slow[test_file] = slow.get(test_file, 0) + heavy
    first_seen = {f: i for i, f in enumerate(slow)}

    def order(item):
        test_file = _test_file(item.nodeid)
        return -slow[test_file], first_seen[test_file]

    items.sort(key=order)
