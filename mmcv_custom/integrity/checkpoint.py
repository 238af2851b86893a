"""Let torch's safe loader read MMEngine checkpoints, and nothing more.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``: it only
rebuilds tensors, containers and globals on an allow-list. MMEngine 0.10.7
calls ``torch.load`` without ``weights_only``, and its checkpoints also hold
the message hub's ``HistoryBuffer`` objects, numpy arrays and dtypes, so
``--resume`` fails with "Weights only load failed". Turning safe loading off
would let any checkpoint run code on load. Instead,
:func:`allow_mmengine_checkpoints` (run on ``import mmcv_custom``) adds
exactly the globals MMEngine's own checkpoints need to torch's allow-list;
anything else in a file is still refused, and :func:`check_checkpoint` names
it before a run starts. The per-rank communication-hook state files load the
same way (:func:`load_checkpoint_file`). Which checkpoint a run loads or
resumes from is :mod:`~mmcv_custom.integrity.checkpoint_choice`'s; the
sharded directories' reading is
:mod:`~mmcv_custom.integrity.sharded_checkpoint`'s, which builds on this
module (and this one on neither).

``builtins.getattr`` is on the list because MMEngine pickles the statistics
methods of ``HistoryBuffer`` as ``getattr(HistoryBuffer, 'min')``. The safe
loader still only *calls* allow-listed functions, so an attribute fetched
this way cannot be executed.
"""
import builtins
import logging
import os.path as osp
import pickle
from typing import Dict, List

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

from .files import require_intact

__all__ = [
    'SAFE_CHECKPOINT_GLOBALS', 'allow_mmengine_checkpoints',
    'check_checkpoint', 'load_checkpoint_file', 'is_sharded_checkpoint',
    'SHARDED_META_FILE', 'DCP_METADATA_FILE', 'UnsafeCheckpointError',
    'readable_checkpoint', 'say_unverified_once'
]


def _numpy_globals() -> List:
    reconstruct = np._core.multiarray._reconstruct if hasattr(
        np, '_core') else np.core.multiarray._reconstruct
    scalar = np._core.multiarray.scalar if hasattr(
        np, '_core') else np.core.multiarray.scalar
    found = [np.ndarray, np.dtype, reconstruct, scalar]
    # numpy >= 1.25 gives every dtype a class of its own (Float64DType...).
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:
        found += [
            getattr(dtypes, n) for n in dir(dtypes) if n.endswith('DType')
        ]
    return found


def _name(obj) -> str:
    return f'{obj.__module__}.{obj.__qualname__}'


#: Name -> object of every global an MMEngine checkpoint may contain.
SAFE_CHECKPOINT_GLOBALS: Dict[str, object] = {
    _name(obj): obj
    for obj in [HistoryBuffer, builtins.getattr, *_numpy_globals()]
}

#: The file of a sharded (FSDP2Strategy) checkpoint directory that holds
#: everything but the tensors: meta, message hub, schedulers.
SHARDED_META_FILE = 'meta.pth'
#: What torch.distributed.checkpoint writes last, once every rank's shards
#: are on disk.
DCP_METADATA_FILE = '.metadata'


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory of
    :class:`~mmcv_custom.engine.FSDP2Strategy` (DCP shards and
    ``meta.pth``)."""
    return (osp.isdir(path) and osp.isfile(osp.join(path, DCP_METADATA_FILE))
            and osp.isfile(osp.join(path, SHARDED_META_FILE)))


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint holds objects outside :data:`SAFE_CHECKPOINT_GLOBALS`."""


def allow_mmengine_checkpoints() -> None:
    """Add :data:`SAFE_CHECKPOINT_GLOBALS` to torch's safe-loading list.

    Idempotent. Does nothing on a torch without ``add_safe_globals`` (older
    than 2.4), which loads everything anyway.
    """
    add = getattr(torch.serialization, 'add_safe_globals', None)
    if add is not None:
        add(list(SAFE_CHECKPOINT_GLOBALS.values()))


def check_checkpoint(path: str) -> None:
    """Raise :class:`UnsafeCheckpointError` if ``path`` holds anything a
    safe load would refuse, naming it; nothing in the file is executed.

    Args:
        path (str): A checkpoint written by ``torch.save``.
    """
    scan = getattr(torch.serialization, 'get_unsafe_globals_in_checkpoint',
                   None)
    if scan is None:
        return
    allowed = set(SAFE_CHECKPOINT_GLOBALS) | {
        _name(g) if not isinstance(g, tuple) else g[1]
        for g in torch.serialization.get_safe_globals()
    }
    unsafe = sorted(set(scan(path)) - allowed)
    if unsafe:
        raise UnsafeCheckpointError(
            f'Refusing to load {path}: it contains {", ".join(unsafe)}, '
            'which is not on the allow-list of safe checkpoint contents '
            '(tensors, containers, MMEngine HistoryBuffer, numpy arrays and '
            'dtypes). If you trust this file, add those globals with '
            'torch.serialization.add_safe_globals([...]) before loading.')


def load_checkpoint_file(path: str, map_location='cpu'):
    """``torch.load`` a file of this project's kind, safely.

    The same allow-list as :func:`check_checkpoint`, and the same error:
    a file holding anything else raises :class:`UnsafeCheckpointError`
    naming it, never torch's own advice to turn safe loading off. Used for
    the per-rank communication-hook state files, which travel with their
    checkpoints and deserve the same suspicion.

    Raises:
        UnsafeCheckpointError: The file holds objects off the allow-list.
        CheckpointDamagedError: The file differs from its digest.
        OSError, RuntimeError, EOFError...: The file is missing, truncated
            or not a torch file at all (whatever ``torch.load`` raises).
    """
    require_intact(path)
    check_checkpoint(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # What the scan above did not name (an unsupported opcode, say):
        # still refused, in our words.
        raise UnsafeCheckpointError(
            f'Refusing to load {path}: a safe load failed '
            f'({str(e).splitlines()[0]}).') from None


_UNVERIFIED_SAID = set()


def say_unverified_once(path: str, message: str) -> None:
    """Log ``message`` (INFO) that ``path`` loads without a digest to
    check, once per file and process, however often it is loaded."""
    key = osp.abspath(path)
    if key not in _UNVERIFIED_SAID:
        _UNVERIFIED_SAID.add(key)
        from mmengine.logging import print_log
        print_log(message, logger='current', level=logging.INFO)


def readable_checkpoint(path: str) -> bool:
    """Whether torch can read ``path``'s structure (a truncated or
    overwritten file cannot), without loading its tensors."""
    try:
        check_checkpoint(path)
    except UnsafeCheckpointError:
        return True  # readable; refused later, by name
    except Exception:
        return False
    return True
