"""Ranks for the benchmark tools, spawned on this host.

The benchmarks measure a hook on ``nproc`` ranks without torchrun:
:func:`spawn_ranks` starts them and returns what one of them handed back
with :func:`write_results`.
"""
import json
import os
import tempfile
from typing import Callable

__all__ = ['spawn_ranks', 'write_results']

_RESULTS = 'results.json'


def spawn_ranks(worker: Callable, nproc: int, args) -> object:
    """For the benchmark tools: run ``worker(rank, nproc, folder, args)``
    in ``nproc`` spawned processes and return what one of them saved with
    :func:`write_results` in ``folder`` (a temporary folder, removed
    after)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            worker,
            args=(nproc, folder, args),
            nprocs=nproc,
            start_method='spawn')
        with open(os.path.join(folder, _RESULTS)) as f:
            return json.load(f)


def write_results(folder: str, results) -> None:
    """In a :func:`spawn_ranks` worker: hand ``results`` (JSON) back."""
    with open(os.path.join(folder, _RESULTS), 'w') as f:
        json.dump(results, f)
