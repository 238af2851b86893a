"""Segmentation models (need MMSegmentation): ``custom_imports`` of
``mmcv_custom.models`` registers them in MMSegmentation's ``MODELS``."""
from .backbones import InternViT, resize_pos_embed
from .decode_heads import LinearHead

__all__ = ['InternViT', 'LinearHead', 'resize_pos_embed']
