"""Ranks end with their launcher, SIGKILL included
(``mmcv_custom/launching/lifetime.py``): the death signal itself, a rank
orphaned before it asks, ranks of a SIGKILLed torchrun agent
(``mmcv_custom/launching/torchrun.py``, as ``dist_train.sh`` runs it) and of a
SIGKILLed ``srun`` (stood in for by ``tests/srun_standin.py``), and a
real 2-rank ``dist_train.sh`` training whose agent is SIGKILLed. Real
processes and real signals throughout."""
import os
import os.path as osp
import signal
import subprocess
import sys
import time

import pytest

from mmcv_custom.launching import lifetime, torchrun
from mmcv_custom.launching.ports import free_port

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TORCHRUN = osp.join(ROOT, 'mmcv_custom', 'launching', 'torchrun.py')
SRUN = osp.join(ROOT, 'tests', 'srun_standin.py')
DIST_TRAIN = osp.join(ROOT, 'tools', 'dist_train.sh')
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')

#: A rank: waits for ``FOLDER/go`` when it is rank ``WAIT`` (a launcher
#: killed while the rank imports), asks to die with its launcher, says so
#: in ``FOLDER/rank<R>``, and sleeps.
RANK = '''
import os, sys, time
from mmcv_custom.launching.lifetime import die_with_launcher
launcher, folder, wait = sys.argv[1], sys.argv[2], sys.argv[3]
rank = os.environ.get('RANK', os.environ.get('SLURM_PROCID'))
with open(os.path.join(folder, f'waiting{rank}'), 'w') as f:
    f.write(str(os.getpid()))
while rank == wait and not os.path.exists(os.path.join(folder, 'go')):
    time.sleep(0.02)
die_with_launcher(launcher)
with open(os.path.join(folder, f'rank{rank}.tmp'), 'w') as f:
    f.write(f"{os.getpid()} {os.environ.get('TORCHELASTIC_ERROR_FILE')}")
os.rename(os.path.join(folder, f'rank{rank}.tmp'),
          os.path.join(folder, f'rank{rank}'))
time.sleep(300)
'''


def _alive(pid: int) -> bool:
    """Runs, and is not a zombie waiting for its parent."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def _wait_for(paths, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not all(osp.exists(p) for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f'none of {paths} after {timeout}s'
        time.sleep(0.05)


def _gone_within(pids, seconds) -> float:
    """Seconds until none of ``pids`` runs; fails after ``seconds``."""
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - start < seconds, [
            p for p in pids if _alive(p)
        ]
        time.sleep(0.01)
    return time.monotonic() - start


def _kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _in_child(fn) -> str:
    """``fn()``'s result (a string) from a process forked from this one,
    whose parent is this process: a death signal set there dies with it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions past here
        try:
            os.close(read_end)
            os.write(write_end, str(fn()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, 'rb') as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_only_a_rank_gets_the_death_signal(monkeypatch):
    """'none' (a plain run, or one under nohup) changes nothing; a rank
    gets SIGKILL; a launcher that is alive but not the parent (a wrapper
    script in between) is no reason to stop."""

    def ask(launcher, named):

        def run():
            if named is not None:
                os.environ[lifetime.LAUNCHER_PID_ENV] = str(named)
            set_ = lifetime.die_with_launcher(launcher)
            return (f'{set_} {lifetime._death_signal()} '
                    f'{os.environ.get(lifetime.LAUNCHER_PID_ENV)}')

        return _in_child(run)

    me = os.getpid()
    assert ask('none', None) == 'False 0 None'
    assert ask('pytorch', me) == f'True {int(signal.SIGKILL)} None'
    assert ask('slurm', None) == f'True {int(signal.SIGKILL)} None'
    # Alive, not the parent: still running (it wrote its answer).
    assert ask('mpi', 1) == f'True {int(signal.SIGKILL)} None'
    assert torchrun.LAUNCHER_PID_ENV == lifetime.LAUNCHER_PID_ENV


def test_bad_values_are_named(monkeypatch):
    with pytest.raises(
            ValueError,
            match=r"launcher should be one of 'pytorch', 'slurm', 'mpi', "
            r"'none', but got 'torchrun'"):
        lifetime.die_with_launcher('torchrun')
    monkeypatch.setenv(lifetime.LAUNCHER_PID_ENV, 'agent')
    with pytest.raises(
            ValueError,
            match=r"MMCV_CUSTOM_LAUNCHER_PID should be the pid of the "
            r"launcher that started this process \(a whole number > 0\), "
            r"but got 'agent'"):
        lifetime.die_with_launcher('pytorch')


def test_ranks_end_with_a_killed_torchrun_agent(tmp_path):
    """SIGKILL of the agent: rank 0, which asked, ends within a second;
    rank 1, still importing (it waits for a file), outlives the agent
    (what every rank did before) until it asks, then ends at once
    although its launcher was gone before; the agent's log folder goes
    too."""
    script = tmp_path / 'rank.py'
    script.write_text(RANK)
    agent = subprocess.Popen([
        sys.executable, TORCHRUN, 'test', '--nproc_per_node=2',
        f'--master_port={free_port()}',
        str(script), 'pytorch',
        str(tmp_path), '1'
    ],
                             cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=ROOT),
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    pids = []
    try:
        _wait_for([tmp_path / 'rank0', tmp_path / 'waiting1'], agent)
        pid0, error_file = (tmp_path / 'rank0').read_text().split()
        pid1 = int((tmp_path / 'waiting1').read_text())
        pids = [int(pid0), pid1]
        log_dir = error_file.split(os.sep + 'none_')[0]
        assert osp.basename(log_dir).startswith('mmcv_custom-torchrun-')
        agent.kill()
        agent.wait()
        took = _gone_within([int(pid0)], 5)
        time.sleep(0.5)
        assert _alive(pid1), 'the waiting rank should not have asked yet'
        (tmp_path / 'go').touch()
        took1 = _gone_within([pid1], 5)
        assert not (tmp_path / 'rank1').exists()
        deadline = time.monotonic() + 5
        while osp.exists(log_dir) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not osp.exists(log_dir)
        print(f'rank 0 ended {took:.2f} s after the agent; rank 1 '
              f'{took1:.2f} s after it asked')
    finally:
        agent.kill()
        _kill_all(pids)


def test_a_launcher_under_nohup_outlives_its_terminal(tmp_path):
    """SIGHUP ignored (``nohup``): torchrun would install its own handler
    and stop every rank when the terminal closes; the agent keeps the
    ranks running, and SIGTERM still stops them all."""
    script = tmp_path / 'rank.py'
    script.write_text(RANK)
    agent = subprocess.Popen(
        [
            sys.executable, TORCHRUN, 'test', '--nproc_per_node=2',
            f'--master_port={free_port()}',
            str(script), 'pytorch',
            str(tmp_path), 'none'
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    pids = []
    try:
        _wait_for([tmp_path / 'rank0', tmp_path / 'rank1'], agent)
        pids = [
            int((tmp_path / f'rank{r}').read_text().split()[0]) for r in (0, 1)
        ]
        agent.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert agent.poll() is None and all(_alive(p) for p in pids)
        agent.terminate()
        _, err = agent.communicate(timeout=60)
        assert agent.returncode == 128 + signal.SIGTERM
        assert err.splitlines()[-1] == 'test: stopped every rank (SIGTERM)'
        _gone_within(pids, 5)
    finally:
        agent.kill()
        _kill_all(pids)


def test_tasks_end_with_a_killed_srun(tmp_path):
    """``--launcher slurm`` tasks, children of ``srun`` (the stand-in, as
    of slurmstepd on a real cluster), end when it is SIGKILLed."""
    script = tmp_path / 'rank.py'
    script.write_text(RANK)
    srun = subprocess.Popen([
        sys.executable, SRUN, '--ntasks=2', sys.executable,
        str(script), 'slurm',
        str(tmp_path), 'none'
    ],
                            cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    pids = []
    try:
        _wait_for([tmp_path / 'rank0', tmp_path / 'rank1'], srun)
        pids = [
            int((tmp_path / f'rank{r}').read_text().split()[0]) for r in (0, 1)
        ]
        srun.kill()
        srun.wait()
        _gone_within(pids, 5)
    finally:
        srun.kill()
        _kill_all(pids)


def _environ(pid: int) -> dict:
    with open(f'/proc/{pid}/environ', 'rb') as f:
        pairs = [e.split(b'=', 1) for e in f.read().split(b'\0') if e]
    return {k.decode(): v.decode() for k, v in pairs}


def _cmdline(pid: int) -> str:
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            return f.read().replace(b'\0', b' ').decode()
    except OSError:
        return ''


def _children(pid: int) -> list:
    found = []
    for entry in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{entry}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def test_a_killed_dist_train_leaves_no_rank_training(tmp_path):
    """Issue 28's case: ``kill -9`` of the agent of a 2-rank
    ``dist_train.sh`` run once it trains. Every rank ends within seconds,
    no checkpoint is written after, and neither a process nor torchrun's
    log folder is left."""
    work = tmp_path / 'work'
    env = dict(os.environ, PYTHON=sys.executable, PORT=free_port())
    out = open(tmp_path / 'out.log', 'wb')
    proc = subprocess.Popen([
        'bash', DIST_TRAIN, MLP, '2', '--work-dir',
        str(work), '--cfg-options', 'train_cfg.max_iters=100000',
        'train_cfg.val_interval=100000', 'default_hooks.checkpoint.interval=5',
        'default_hooks.logger.interval=1'
    ],
                            cwd=ROOT,
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True)
    out.close()
    ranks = []
    try:
        deadline = time.monotonic() + 180
        while not list(work.glob('iter_*.pth')):
            assert proc.poll() is None, (tmp_path / 'out.log').read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # dist_train.sh execs the agent, whose children are the ranks
        # (and the shell that removes its log folder).
        ranks = [
            pid for pid in _children(proc.pid) if 'train.py' in _cmdline(pid)
        ]
        assert len(ranks) == 2, ranks
        error_files = [_environ(r)['TORCHELASTIC_ERROR_FILE'] for r in ranks]
        log_dir = error_files[0].split(os.sep + 'none_')[0]
        assert osp.isdir(log_dir)
        proc.kill()
        proc.wait()
        took = _gone_within(ranks, 10)
        saved = sorted(p.name for p in work.glob('iter_*.pth'))
        time.sleep(3)
        assert sorted(p.name for p in work.glob('iter_*.pth')) == saved
        assert not osp.exists(log_dir)
        print(f'every rank ended {took:.2f} s after the agent')
    finally:
        proc.kill()
        _kill_all(ranks)
