"""The ``--launcher`` check: a process given ``--launcher pytorch``,
``slurm`` or ``mpi`` that torchrun, ``srun`` or ``mpirun`` did not start.
"""
import os
from typing import List

from ...engine.process_group import LAUNCH_ENV
from .problems import Problem

__all__ = ['launcher_problems']

# Per --launcher: what starts its processes, and how a user does that.
_STARTERS = {
    'pytorch':
    ('torchrun', 'start it with tools/dist_train.sh CONFIG NPROC (torchrun), '
     'or leave --launcher out to run one process'),
    'slurm':
    ('srun', 'start it with tools/slurm_train.sh PARTITION JOB_NAME CONFIG '
     '(srun), or leave --launcher out to run one process'),
    'mpi': ("Open MPI's mpirun",
            'start it with mpirun -np N, or leave --launcher out to run '
            'one process'),
}


def launcher_problems(launcher: str) -> List[Problem]:
    """A process given ``--launcher`` that its launcher did not start
    would fail in the process group's start-up on a bare ``KeyError``."""
    if launcher not in LAUNCH_ENV:
        return []
    env = LAUNCH_ENV[launcher]
    # LOCAL_RANK: tools/train.py sets it from --local_rank when missing.
    names = (env.rank, env.world) + (
        (env.local, ) if launcher != 'pytorch' else ()) + env.others
    missing = [n for n in names if not os.environ.get(n, '').strip()]
    if not missing:
        return []
    starter, fix = _STARTERS[launcher]
    return [
        Problem(
            f'--launcher {launcher}: {", ".join(missing)} '
            f'{"is" if len(missing) == 1 else "are"} not set, so '
            f'{starter} did not start this process', fix)
    ]
