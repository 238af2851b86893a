"""Segmentation models (need MMSegmentation): ``custom_imports`` of
``mmcv_custom.models`` registers them in MMSegmentation's ``MODELS``."""
from .backbones import InternViT, resize_pos_embed

__all__ = ['InternViT', 'resize_pos_embed']
