"""MMEngine's local checkpoint files, written atomically and verified.

Two of MMEngine's own extension points, installed by ``import mmcv_custom``
(so a config's ``custom_imports`` is all it takes, whatever its
``default_hooks``):

* **The file backend of local paths** (``mmengine.fileio``'s ``''``
  prefix). MMEngine's ``save_checkpoint`` serializes a checkpoint to bytes
  and hands them to the backend's ``put``; this backend writes them through
  :func:`mmcv_custom.integrity.atomic_write_bytes` (a temporary name,
  flushed, renamed, then the ``.sha256`` digest), and removing a file
  (``max_keep_ckpts``) removes its digest too. Reads are MMEngine's own.
* **The checkpoint loader of local paths** (``CheckpointLoader``'s ``''``
  scheme), through which ``load_from``, ``--resume``, ``init_cfg``'s
  ``Pretrained`` and ``tools/test.py`` load: the file is checked against
  its digest first. A damaged file raises
  :class:`~mmcv_custom.integrity.CheckpointDamagedError` naming it (and the
  newest intact checkpoint beside it); one without a digest loads with one
  INFO line.
"""
import os
import os.path as osp

import torch
from mmengine.fileio import LocalBackend
from mmengine.fileio import io as _fileio
from mmengine.fileio import register_backend
from mmengine.runner import CheckpointLoader

from ..integrity import (DIGEST_SUFFIX, atomic_write_bytes, atomic_write_text,
                         require_intact)
from ..integrity.checkpoint import say_unverified_once
from ..integrity.checkpoint_choice import newest_intact

__all__ = [
    'AtomicLocalBackend', 'load_verified', 'install_checkpoint_integrity'
]


class AtomicLocalBackend(LocalBackend):
    """MMEngine's local backend, whose writes are all-or-nothing.

    ``put`` (what ``save_checkpoint`` calls with the checkpoint's bytes)
    also writes the digest; ``put_text`` is atomic without one.
    """

    def put(self, obj: bytes, filepath) -> None:
        filepath = os.fspath(filepath)
        self._ensure_folder(filepath)
        atomic_write_bytes(str(filepath), obj)

    def put_text(self, obj: str, filepath, encoding: str = 'utf-8') -> None:
        filepath = os.fspath(filepath)
        self._ensure_folder(filepath)
        atomic_write_text(str(filepath), obj, encoding)

    def remove(self, filepath) -> None:
        super().remove(filepath)
        digest = str(os.fspath(filepath)) + DIGEST_SUFFIX
        if osp.isfile(digest):
            super().remove(digest)

    @staticmethod
    def _ensure_folder(filepath) -> None:
        folder = osp.dirname(str(filepath))
        if folder:
            os.makedirs(folder, exist_ok=True)


def load_verified(filename: str, map_location=None):
    """Check a local checkpoint against its digest, then ``torch.load`` it
    as MMEngine's loader does."""
    filename = osp.expanduser(filename)
    if not osp.isfile(filename):
        raise FileNotFoundError(
            f'checkpoint {filename!r}: no such file' if filename else
            'checkpoint path is empty (a blank load_from, or an empty '
            'last_checkpoint file in the work dir)')
    result = require_intact(filename, lambda: newest_intact(filename))
    if result.status == 'no_digest':
        say_unverified_once(filename, result.message)
    return torch.load(filename, map_location=map_location)


def install_checkpoint_integrity() -> None:
    """Make :class:`AtomicLocalBackend` MMEngine's backend of local paths
    and :func:`load_verified` its loader of local checkpoints. Idempotent.
    """
    register_backend('local', AtomicLocalBackend, force=True, prefixes='')
    # Backends are cached per prefix: drop any plain local one made before.
    for key in [
            k for k, v in _fileio.backend_instances.items()
            if type(v) is LocalBackend
    ]:
        del _fileio.backend_instances[key]
    CheckpointLoader.register_scheme(
        prefixes='', loader=load_from_local, force=True)


def load_from_local(filename: str, map_location=None):
    """:func:`load_verified` under the name MMEngine's loader of local
    files has: MMEngine prints ``'Loads checkpoint by ' + name[10:]``
    ("local", not "ied")."""
    return load_verified(filename, map_location)
