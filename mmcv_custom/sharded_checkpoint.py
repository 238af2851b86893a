"""Old path of the sharded (DCP) checkpoint reading; kept for users.

The code now lives in :mod:`mmcv_custom.integrity.sharded_checkpoint`; this
module only re-exports the names it used to define.
"""
# yapf: disable (isort lays these out)
from .integrity.sharded_checkpoint import (MANIFEST_FILE,
                                           consolidate_sharded_checkpoint,
                                           consolidated_file, damaged_message,
                                           newest_intact_checkpoint,
                                           read_manifest,
                                           require_intact_sharded,
                                           safe_dcp_load, safe_load_planner,
                                           verify_sharded_checkpoint,
                                           write_manifest)

# yapf: enable

__all__ = [
    'safe_load_planner', 'safe_dcp_load', 'consolidate_sharded_checkpoint',
    'consolidated_file', 'MANIFEST_FILE', 'write_manifest', 'read_manifest',
    'verify_sharded_checkpoint', 'newest_intact_checkpoint', 'damaged_message',
    'require_intact_sharded'
]
