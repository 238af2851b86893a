"""Segmentation datasets (need MMSegmentation)."""
from .toy_shapes import ToyShapesDataset, generate_toy_shapes

__all__ = ['ToyShapesDataset', 'generate_toy_shapes']
