#!/usr/bin/env python3
"""Stands in for Slurm's ``srun`` on a machine without Slurm, for
``tests/test_launching/test_restart.py``: it starts ``--ntasks`` copies of
the command on this machine with the variables a Slurm task sees
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
``SLURM_JOB_NODELIST``) and, as ``--kill-on-bad-exit=1`` does, kills the
others when one fails and exits with its code. Every other option is
accepted and ignored. Only the launching is stood in for: the tasks are
real training processes.
"""
import os
import signal
import subprocess
import sys
import time


def main(argv):
    ntasks, i = 1, 0
    while i < len(argv) and argv[i].startswith('-'):
        arg = argv[i]
        if arg.startswith('--ntasks='):
            ntasks = int(arg.split('=', 1)[1])
        elif arg in ('-p', '-n', '-N') and i + 1 < len(argv):
            if arg == '-n':
                ntasks = int(argv[i + 1])
            i += 1
        i += 1
    command = argv[i:]
    tasks = []
    for rank in range(ntasks):
        env = dict(
            os.environ,
            SLURM_PROCID=str(rank),
            SLURM_NTASKS=str(ntasks),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID='0',
            SLURM_JOB_NODELIST='localhost')
        tasks.append(
            subprocess.Popen(command, env=env, start_new_session=True))
    while True:
        codes = [t.poll() for t in tasks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for t in tasks:
                if t.poll() is None:
                    os.killpg(t.pid, signal.SIGKILL)
            for t in tasks:
                t.wait()
            code = failed[0]
            return 128 - code if code < 0 else code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
