"""Old path of the checkpoint loading and resume choice; kept for users.

The code now lives in :mod:`mmcv_custom.integrity.checkpoint` (torch's safe
loader for MMEngine's checkpoints) and
:mod:`mmcv_custom.integrity.checkpoint_choice` (which checkpoint a run loads
or resumes from); this module only re-exports the names it used to define.
"""
# yapf: disable (isort lays these out)
from .integrity.checkpoint import (SAFE_CHECKPOINT_GLOBALS, SHARDED_META_FILE,
                                   UnsafeCheckpointError,
                                   allow_mmengine_checkpoints,
                                   check_checkpoint, is_sharded_checkpoint,
                                   load_checkpoint_file, readable_checkpoint,
                                   say_unverified_once)
from .integrity.checkpoint_choice import (ResumeChoice, check_checkpoint_file,
                                          checkpoint_folder,
                                          choose_resume_checkpoint,
                                          find_resume_checkpoint,
                                          newest_intact,
                                          resolve_resume_checkpoint,
                                          unusable_reason)

# yapf: enable

__all__ = [
    'SAFE_CHECKPOINT_GLOBALS', 'allow_mmengine_checkpoints',
    'check_checkpoint', 'check_checkpoint_file', 'load_checkpoint_file',
    'resolve_resume_checkpoint', 'is_sharded_checkpoint', 'SHARDED_META_FILE',
    'UnsafeCheckpointError', 'readable_checkpoint', 'newest_intact',
    'choose_resume_checkpoint', 'say_unverified_once', 'checkpoint_folder',
    'unusable_reason', 'ResumeChoice', 'find_resume_checkpoint'
]
