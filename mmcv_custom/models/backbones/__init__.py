from .intern_vit import InternViT, resize_patch_kernel, resize_pos_embed
from .intern_vit_checkpoint import (LAYOUTS, ConvertedCheckpoint,
                                    UnknownCheckpointLayoutError,
                                    convert_checkpoint, detect_layout,
                                    load_internvit_checkpoint, read_state_file)

__all__ = [
    'InternViT', 'resize_patch_kernel', 'resize_pos_embed', 'LAYOUTS',
    'ConvertedCheckpoint', 'UnknownCheckpointLayoutError',
    'convert_checkpoint', 'detect_layout', 'load_internvit_checkpoint',
    'read_state_file'
]
