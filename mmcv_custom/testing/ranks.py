"""Run a test body on real gloo ranks, one process each.

Processes are forked (the calling process never initialises a process
group, so forking is safe and saves re-importing torch) and meet through a
``FileStore`` in a temporary folder, so there are no ports to clash. Each
rank's return value comes back to the caller; an exception on any rank
raises in the caller with that rank's traceback.
"""
import gc
import os
import tempfile
import time
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ['run_ranks']

# The process groups of this (child) process, kept alive until it exits.
_KEPT: list = []


def _entry(rank: int, world_size: int, folder: str, fn: Callable,
           args: tuple) -> None:
    # MMEngine reads these (Runner.wrap_model and get_dist_info).
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.manual_seed(1234 + rank)
    store = dist.FileStore(os.path.join(folder, 'store'), world_size)
    dist.init_process_group(
        'gloo', store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(folder, f'rank{rank}.pt'))
        del result
    finally:
        # A hook's future callback can hold a group (PyTorch's PowerSGD
        # captures WORLD) and release it on the gloo worker thread that ran
        # it, a moment after the step returned. Were that the last
        # reference, the group's destructor would join that very thread:
        # "terminate called after throwing an instance of
        # 'std::system_error' what(): Resource deadlock avoided", SIGABRT.
        # So this process keeps every group until it exits (os._exit: no
        # destructor runs), and the main thread collects the rest first.
        world = getattr(dist.distributed_c10d, '_world', None)
        _KEPT.extend(getattr(world, 'pg_map', {}).keys())
        gc.collect()
        if dist.is_initialized():  # fn may have shut it down itself
            dist.destroy_process_group()


def run_ranks(fn: Callable,
              *args: Any,
              world_size: int = 2,
              timeout: float = 120) -> List[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Each rank is a forked process with the default process group already
    initialised (gloo, CPU tensors), ``RANK``, ``LOCAL_RANK`` and
    ``WORLD_SIZE`` set (as MMEngine reads them) and torch seeded with
    ``1234 + rank``. The ranks meet through a ``FileStore`` in a temporary
    folder: no port, so tests can run side by side.

    Call it from a process that has no process group and has not
    initialised CUDA (forking either is unsafe), such as a pytest process,
    with ``OMP_NUM_THREADS=1`` set before torch is first imported (e.g. at
    the top of your ``conftest.py``): a process that forks after OpenMP
    started a thread team (any multi-threaded torch op) leaves its children
    hanging in their first parallel region. A collective that hangs (ranks
    issuing collectives in different orders) raises after ``timeout``
    seconds instead of blocking the suite.

    Args:
        fn (Callable): ``fn(rank, world_size, *args)``, run on every rank.
            Forked, not pickled: a local function or a lambda will do. What
            it returns must be picklable (``torch.save`` brings it back).
        *args: Passed on to ``fn`` after ``rank`` and ``world_size``.
        world_size (int): Ranks to start. Defaults to 2.
        timeout (float): Seconds before the ranks are killed and
            ``TimeoutError`` is raised. Defaults to 120.

    Returns:
        list: ``fn``'s return value of each rank, by rank.

    Raises:
        torch.multiprocessing.ProcessRaisedException: ``fn`` raised on a
            rank; the message holds that rank's traceback.
        TimeoutError: The ranks did not finish within ``timeout``.

    Examples:
        A comm hook on a real DDP model, its averaged gradient checked on
        every rank:

        >>> import torch
        >>> from torch import nn
        >>> from mmcv_custom import fp16_compress_hook
        >>> from mmcv_custom.testing import run_ranks
        >>> def body(rank, world_size):
        ...     model = nn.parallel.DistributedDataParallel(
        ...         nn.Linear(4, 1, bias=False))
        ...     model.register_comm_hook(None, fp16_compress_hook)
        ...     model(torch.full((1, 4), float(rank + 1))).sum().backward()
        ...     return model.module.weight.grad
        >>> grads = run_ranks(body)  # mean of 1 and 2 on both ranks
        >>> [g.tolist() for g in grads]
        [[[1.5, 1.5, 1.5, 1.5]], [[1.5, 1.5, 1.5, 1.5]]]
    """
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _entry,
            args=(world_size, folder, fn, args),
            nprocs=world_size,
            join=False,
            start_method='fork')
        deadline = time.monotonic() + timeout
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(
                    f'{getattr(fn, "__name__", fn)} did not finish on '
                    f'{world_size} ranks within {timeout} s (a hung '
                    'collective?)')
        return [
            torch.load(
                os.path.join(folder, f'rank{r}.pt'), weights_only=False)
            for r in range(world_size)
        ]
