"""What a launcher's environment says, and a gloo process group from it.

torchrun, ``srun`` and ``mpirun`` each name a process's rank, the world size
and the restart in variables of their own (:data:`LAUNCH_ENV`). On a
CPU-only machine MMEngine's ``init_dist`` fails (it calls
``torch.cuda.set_device``), so :func:`init_gloo` starts a gloo group from
them instead, for the tools (through
:func:`mmcv_custom.launching.cpu_start.prepare_launch`) and for
:class:`~mmcv_custom.engine.FSDP2Strategy`'s own start-up alike. It lives
here, below the launching package, because the strategy needs it.
"""
import os
import re
from typing import List, Mapping, NamedTuple, Optional, Tuple

import torch.distributed as dist

from ..hooks.topology import NodeClaim, NodeLayout, layout_of_claims

__all__ = [
    'LaunchEnv', 'LAUNCH_ENV', 'init_gloo', 'restart_count', 'is_launch_rank0',
    'launcher_claim', 'launcher_layout'
]


class LaunchEnv(NamedTuple):
    """The variables a ``--launcher``'s starter sets in each process."""
    rank: str  # global rank
    world: str  # world size
    local: str  # rank on the node
    others: Tuple[str, ...]  # the rest the process group needs
    node: str = ''  # the node's index ('': the starter names none)
    local_world: str = ''  # ranks on the node (Slurm's: a list per node)


#: Per ``--launcher``: what torchrun, ``srun`` and Open MPI's ``mpirun``
#: set. A gloo start copies the Slurm and MPI ones into torchrun's names.
LAUNCH_ENV = {
    'pytorch':
    LaunchEnv('RANK', 'WORLD_SIZE', 'LOCAL_RANK',
              ('MASTER_ADDR', 'MASTER_PORT'), 'GROUP_RANK',
              'LOCAL_WORLD_SIZE'),
    'slurm':
    LaunchEnv('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID', (),
              'SLURM_NODEID', 'SLURM_TASKS_PER_NODE'),
    'mpi':
    LaunchEnv('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
              'OMPI_COMM_WORLD_LOCAL_RANK', (), '',
              'OMPI_COMM_WORLD_LOCAL_SIZE'),
}


def is_launch_rank0() -> bool:
    """Whether this process is global rank 0, before or after the process
    group starts (torchrun sets ``RANK``, Slurm ``SLURM_PROCID``), so the
    tools log configuration facts once per run rather than once per rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get('RANK', os.environ.get('SLURM_PROCID', 0))) == 0


def init_gloo(launcher: str) -> None:
    """Start a gloo process group from ``launcher``'s environment
    (``pytorch``: torchrun's; ``slurm``; ``mpi``), for CPU runs, where
    MMEngine's ``init_dist`` fails (it calls ``torch.cuda.set_device``)."""
    if launcher in ('slurm', 'mpi'):
        ours, theirs = LAUNCH_ENV['pytorch'], LAUNCH_ENV[launcher]
        for field in ('rank', 'world', 'local'):
            os.environ.setdefault(
                getattr(ours, field), os.environ[getattr(theirs, field)])
    if launcher == 'slurm':
        os.environ.setdefault('MASTER_PORT', '29500')
        if 'MASTER_ADDR' not in os.environ:
            raise RuntimeError(
                'MASTER_ADDR is not set: on CPU nodes the Slurm launcher '
                'needs it (e.g. the first host of $SLURM_NODELIST); '
                'tools/slurm_train.sh sets it.')
    elif launcher not in ('pytorch', 'mpi'):
        raise ValueError(f"launcher should be 'none', 'pytorch', 'slurm' or "
                         f"'mpi', but got {launcher!r}")
    restart = restart_count()
    if not restart:
        dist.init_process_group(backend='gloo', init_method='env://')
        return
    # A restart under torchrun meets its peers through the agent's store,
    # which still holds the killed attempt's gloo addresses under the same
    # keys: ranks would dial dead ports ("Connection refused") and the
    # restart fail. A prefix per attempt keeps each attempt's keys apart.
    store, rank, world_size = next(dist.rendezvous('env://'))
    dist.init_process_group(
        backend='gloo',
        store=dist.PrefixStore(f'attempt{restart}', store),
        rank=rank,
        world_size=world_size)


def restart_count() -> int:
    """How many times this run was restarted after a failure: torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` (``--max-restarts``),
    ``MMCV_CUSTOM_RESTART_COUNT`` (``tools/slurm_train.sh``'s loop), or
    ``SLURM_RESTART_COUNT`` (a job Slurm requeued: ``scontrol requeue``,
    ``--requeue`` after a node failure)."""
    for name in ('TORCHELASTIC_RESTART_COUNT', 'MMCV_CUSTOM_RESTART_COUNT',
                 'SLURM_RESTART_COUNT'):
        value = os.environ.get(name, '').strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def _slurm_tasks(tasks_per_node: str) -> Optional[List[int]]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``'2(x3),1'``: 2 tasks on each of
    3 nodes, then 1) node by node; None where it does not parse."""
    counts = []
    for part in tasks_per_node.split(','):
        match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _slurm_tasks_on(node: int, tasks_per_node: str) -> Optional[int]:
    """:func:`_slurm_tasks` for node ``node``."""
    counts = _slurm_tasks(tasks_per_node) or []
    return counts[node] if node < len(counts) else None


def launcher_claim(
        environ: Optional[Mapping[str, str]] = None) -> Optional[NodeClaim]:
    """What this process's launcher says of its node: torchrun's
    ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (which only
    torchrun sets, so a torchrun inside a Slurm job speaks for its ranks),
    else Slurm's ``SLURM_NODEID``, ``SLURM_LOCALID`` and
    ``SLURM_TASKS_PER_NODE``, else Open MPI's local rank and size (see
    :func:`_mpi_claim`); None where none says (a single process names
    nothing).

    Not the host name: emulated nodes share one host. What every rank
    claims is judged together by
    :func:`~mmcv_custom.hooks.topology.agree_on_layout`.
    """
    env = os.environ if environ is None else environ
    for launch in (LAUNCH_ENV['pytorch'], LAUNCH_ENV['slurm']):
        node, local = env.get(launch.node, ''), env.get(launch.local, '')
        size = env.get(launch.local_world, '')
        if not (node.isdigit() and local.isdigit() and size):
            continue
        if launch.local_world == 'SLURM_TASKS_PER_NODE':
            tasks = _slurm_tasks_on(int(node), size)
        else:
            tasks = int(size) if size.isdigit() else None
        if tasks is not None:
            return NodeClaim(int(node), int(local), tasks)
    return _mpi_claim(env)


def _mpi_claim(env: Mapping[str, str]) -> Optional[NodeClaim]:
    """Open MPI names a rank's place on its node and the node's size, not
    the node's index: read as consecutive ranks sharing a node (its
    default ``--map-by slot``), the index of the node is
    ``(rank - local rank) / local size``. A rank where that is no whole
    number (``--map-by node``) says nothing; one whose neighbours were
    placed otherwise makes the agreed layout not add up (see
    :func:`~mmcv_custom.hooks.topology.layout_of_claims`): flat, either
    way, with the reason."""
    launch = LAUNCH_ENV['mpi']
    values = [
        env.get(name, '')
        for name in (launch.rank, launch.local, launch.local_world)
    ]
    if not all(v.isdigit() for v in values):
        return None
    rank, local, size = (int(v) for v in values)
    if size < 1 or local >= size or (rank - local) % size:
        return None
    return NodeClaim((rank - local) // size, local, size)


def launcher_layout(
    launcher: str,
    environ: Optional[Mapping[str, str]] = None
) -> Tuple[Optional[int], Optional[NodeLayout], str]:
    """The world size and the node layout ``launcher``'s environment
    states, read by one process before any process group exists (the
    preflight): ``(world, layout, why)``, ``layout`` None where it says
    none (``why`` says why, in :func:`launcher_claim`'s agreed words),
    ``world`` None where the launcher's variables are missing.

    Every launcher places the ranks of a node consecutively (torchrun
    always; Slurm and Open MPI by default), so the layout is read from the
    ranks each node runs: torchrun's ``LOCAL_WORLD_SIZE`` and Open MPI's
    local size (this node's, taken for every node: a node that runs
    another number is found by the process group's agreement, see
    :func:`~mmcv_custom.hooks.topology.agree_on_layout`), Slurm's
    ``SLURM_TASKS_PER_NODE`` (every node's).
    """
    env = os.environ if environ is None else environ
    launch = LAUNCH_ENV[launcher]
    world = env.get(launch.world, '').strip()
    if not world.isdigit() or int(world) < 1:
        return None, None, ''
    world = int(world)
    size = env.get(launch.local_world, '').strip()
    if launcher == 'slurm':
        counts = _slurm_tasks(size) if size else None
    elif size.isdigit() and int(size) > 0:
        size = int(size)
        counts = [size] * (world // size) + ([world % size] if world %
                                             size else [])
    else:
        counts = None
    if counts is None or sum(counts) != world:
        claims = [None] * world
    else:
        claims = [
            NodeClaim(node, local, count) for node, count in enumerate(counts)
            for local in range(count)
        ]
    layout, why = layout_of_claims(claims)
    return world, layout, why
