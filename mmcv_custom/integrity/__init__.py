"""Checkpoint files: whole or not there, with digests, and safely loaded.

:mod:`~mmcv_custom.integrity.files` writes through a temporary name and a
rename and keeps a SHA-256 digest beside each file (standard library only);
:mod:`~mmcv_custom.integrity.checkpoint` lets torch's safe loader read
MMEngine's checkpoints; :mod:`~mmcv_custom.integrity.sharded_checkpoint`
reads and checks the sharded (DCP) directories of FSDP2Strategy; and
:mod:`~mmcv_custom.integrity.checkpoint_choice` decides which checkpoint a
run loads or resumes from. This file re-exports only the names of
:mod:`~mmcv_custom.integrity.files` (the old ``mmcv_custom.integrity``
module) and imports nothing beyond the standard library, so the modules
that need just those (the work dir's lock, a rank's lifetime) stay light:
import the other modules by their own names.
"""
from . import files
from .files import (  # noqa: F401 (re-exported, as files.__all__ lists)
    DIGEST_SUFFIX, MANIFEST_FILE, CheckpointDamagedError, LinkedFileError,
    Verification, atomic_write_bytes, atomic_write_stream, atomic_write_text,
    checkpoint_candidates, digest_kept_beside, digest_path, file_sha256,
    is_temporary_name, link_of, open_own_file, process_alive, remove_entry,
    remove_stale_temporaries, require_intact, temporary_name,
    unverified_refusal, verify_file, write_digest)

__all__ = list(files.__all__)
