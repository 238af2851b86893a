from .intern_vit import InternViT, resize_pos_embed

__all__ = ['InternViT', 'resize_pos_embed']
