"""Read the sharded checkpoints of :class:`~mmcv_custom.engine.FSDP2Strategy`.

A sharded checkpoint is a directory (``iter_N.pth/``) of
``torch.distributed.checkpoint`` (DCP) files, one per saving rank, plus
``meta.pth`` with MMEngine's meta, message hub and scheduler states. DCP
reshards on load, so any number of ranks (or one process) can read it.

Safety: DCP's default planner unpickles every non-tensor entry (the
optimizer's hyper-parameters) with ``torch.load(weights_only=False)``, which
runs whatever a crafted file says. :func:`safe_load_planner` reads them with
torch's safe loader and this project's allow-list instead
(:mod:`mmcv_custom.checkpoint`), and ``meta.pth`` is read the same way.
"""
import contextlib
import os.path as osp
import pickle
import re
import shutil
import tempfile
import warnings

import torch

from .checkpoint import (SHARDED_META_FILE, UnsafeCheckpointError,
                         is_sharded_checkpoint, load_checkpoint_file)

__all__ = ['safe_load_planner', 'safe_dcp_load',
           'consolidate_sharded_checkpoint', 'consolidated_file']


def safe_load_planner(path: str = 'the sharded checkpoint'):
    """DCP's default load planner with safe unpickling of non-tensor
    entries: one that holds anything off the allow-list raises
    :class:`~mmcv_custom.checkpoint.UnsafeCheckpointError` naming it."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _SafeLoadPlanner(DefaultLoadPlanner):

        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                found = re.search(r'GLOBAL ([\w.]+)', str(e))
                what = found.group(1) if found else 'an object'
                raise UnsafeCheckpointError(
                    f'Refusing to load {path}: its entry {fqn} holds '
                    f'{what}, which is not on the allow-list of safe '
                    'checkpoint contents (tensors, containers, numbers, '
                    'strings).') from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _SafeLoadPlanner()


def safe_dcp_load(state: dict, path: str, **kwargs) -> None:
    """``torch.distributed.checkpoint.load`` of ``path`` into ``state`` with
    :func:`safe_load_planner`; an unsafe entry raises
    :class:`~mmcv_custom.checkpoint.UnsafeCheckpointError` on every rank,
    not DCP's wrapper around it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.load(state, checkpoint_id=path, planner=safe_load_planner(path),
                 **kwargs)
    except CheckpointException as e:
        # failures: rank -> (exception, traceback) in torch 2.13.
        found = [f[0] if isinstance(f, tuple) else f
                 for f in e.failures.values()]
        unsafe = [f for f in found if isinstance(f, UnsafeCheckpointError)]
        if unsafe:
            raise unsafe[0] from None
        raise


def consolidate_sharded_checkpoint(path: str) -> dict:
    """The model of a sharded checkpoint as one ordinary checkpoint.

    Reads in this process, without a process group, whatever the number of
    ranks that saved it.

    Args:
        path (str): A sharded checkpoint directory.

    Returns:
        dict: ``{'meta': ..., 'state_dict': {name: full tensor}}``, what
        MMEngine's ``load_from`` and ``tools/test.py`` take. The optimizer
        state is left out (it only serves a resume, which reads the
        directory itself).

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f'{path} is not a complete sharded checkpoint (a directory '
            f'holding .metadata and {SHARDED_META_FILE}, written by '
            'FSDP2Strategy)')
    prefix = 'model.'
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in FileSystemReader(
            path).read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming the intent is to
        # load in a single process": that is the intent.
        warnings.filterwarnings('ignore', message='torch.distributed is')
        safe_dcp_load(state, path, no_dist=True)
    meta = load_checkpoint_file(osp.join(path, SHARDED_META_FILE))
    return {
        'meta': meta.get('meta', {}),
        'state_dict': {k[len(prefix):]: v for k, v in state.items()},
    }


@contextlib.contextmanager
def consolidated_file(path: str):
    """A temporary ordinary checkpoint file of the sharded checkpoint
    ``path`` (:func:`consolidate_sharded_checkpoint`), removed on exit: for
    a runner that only loads files (``load_from`` of a DDP config). Each
    process writes its own, so no rank waits on another's file system."""
    folder = tempfile.mkdtemp(prefix='sharded_ckpt_')
    try:
        file = osp.join(folder, 'model.pth')
        torch.save(consolidate_sharded_checkpoint(path), file)
        yield file
    finally:
        shutil.rmtree(folder, ignore_errors=True)
