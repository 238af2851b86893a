"""A segmentation dataset that ships with the project: coloured shapes.

Generated deterministically on first use (no download), in MMSegmentation's
usual folder layout::

    data/toy_shapes/
        img_dir/{train,val}/0000.png   RGB images
        ann_dir/{train,val}/0000.png   class index per pixel

Each image has a textured background and one to three shapes. The class is
the shape (circle, square, triangle); its colour is drawn at random around a
class-dependent hue, so a small network learns both colour and shape. It
trains to a useful mIoU in a couple of CPU minutes, so the whole segmentation
flow (tools, configs, comm hooks, resume) can be tried without a GPU.
"""
import json
import os
import os.path as osp
import shutil
import tempfile

import numpy as np
from mmseg.datasets import BaseSegDataset
from mmseg.registry import DATASETS
from PIL import Image, ImageDraw

__all__ = ['ToyShapesDataset', 'generate_toy_shapes']

CLASSES = ('background', 'circle', 'square', 'triangle')
PALETTE = [[0, 0, 0], [220, 20, 60], [0, 128, 255], [255, 200, 0]]
# Base RGB colour per shape class; each sample is jittered around it.
_BASE_COLOURS = np.array([[200, 60, 60], [60, 120, 220], [220, 190, 40]])
_VERSION = 1


def _draw_sample(rng: np.random.RandomState, size: int):
    # Low-contrast noisy background.
    base = rng.randint(40, 110, size=3)
    noise = rng.randint(-25, 26, size=(size, size, 3))
    image = np.clip(base + noise, 0, 255).astype(np.uint8)
    canvas = Image.fromarray(image)
    label = Image.new('L', (size, size), 0)
    draw_img, draw_lbl = ImageDraw.Draw(canvas), ImageDraw.Draw(label)
    for _ in range(rng.randint(1, 4)):
        cls = rng.randint(1, len(CLASSES))
        colour = np.clip(_BASE_COLOURS[cls - 1] + rng.randint(-40, 41, 3), 0,
                         255)
        radius = rng.randint(size // 10, size // 4)
        cx, cy = rng.randint(radius, size - radius, size=2)
        box = [cx - radius, cy - radius, cx + radius, cy + radius]
        if cls == 1:
            shape = ('ellipse', box)
        elif cls == 2:
            shape = ('rectangle', box)
        else:
            shape = ('polygon', [(cx, cy - radius), (cx - radius, cy + radius),
                                 (cx + radius, cy + radius)])
        kind, xy = shape
        getattr(draw_img, kind)(xy, fill=tuple(int(c) for c in colour))
        getattr(draw_lbl, kind)(xy, fill=cls)
    return canvas, label


def generate_toy_shapes(root: str,
                        num_train: int = 400,
                        num_val: int = 100,
                        size: int = 64,
                        seed: int = 0) -> str:
    """Write the dataset under ``root`` unless it is already there.

    Safe to call from every rank at once: each process writes into a private
    temporary folder and moves it into place with one atomic rename; a
    process that loses the race discards its copy. A folder generated with
    other parameters is regenerated.

    Returns:
        str: ``root``.
    """
    spec = dict(
        version=_VERSION,
        num_train=num_train,
        num_val=num_val,
        size=size,
        seed=seed)
    if _generated_with(root) == spec:
        return root
    parent = osp.dirname(osp.abspath(root)) or '.'
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='.toy_shapes-', dir=parent)
    try:
        for split, count, offset in (('train', num_train, 0), ('val', num_val,
                                                               1)):
            rng = np.random.RandomState(seed * 2 + offset)
            img_dir = osp.join(tmp, 'img_dir', split)
            ann_dir = osp.join(tmp, 'ann_dir', split)
            os.makedirs(img_dir)
            os.makedirs(ann_dir)
            for i in range(count):
                image, label = _draw_sample(rng, size)
                image.save(osp.join(img_dir, f'{i:04d}.png'))
                label.save(osp.join(ann_dir, f'{i:04d}.png'))
        with open(osp.join(tmp, 'toy_shapes.json'), 'w') as f:
            json.dump(spec, f)
        if _generated_with(root) == spec:
            return root  # another rank finished first
        if osp.isdir(root):
            # Generated with other parameters: replace it.
            stale = tempfile.mkdtemp(prefix='.toy_shapes-stale-', dir=parent)
            try:
                os.rename(root, osp.join(stale, 'old'))
            except OSError:
                pass  # another rank moved it first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, root)
        except OSError:
            pass  # another rank finished first; its copy is identical
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _generated_with(root: str):
    marker = osp.join(root, 'toy_shapes.json')
    if not osp.isfile(marker):
        return None
    with open(marker) as f:
        return json.load(f)


@DATASETS.register_module()
class ToyShapesDataset(BaseSegDataset):
    """Coloured circles, squares and triangles on a noisy background.

    Args:
        data_root (str): Where the dataset lives; generated there on first
            use. Defaults to ``'data/toy_shapes'``.
        generate (dict, optional): Arguments of :func:`generate_toy_shapes`
            (``num_train``, ``num_val``, ``size``, ``seed``). Defaults to
            None, meaning its defaults. Set to False to require existing
            data.
        **kwargs: Passed to ``BaseSegDataset`` (``data_prefix``,
            ``pipeline``, ...).
    """
    METAINFO = dict(classes=CLASSES, palette=PALETTE)

    def __init__(self,
                 data_root: str = 'data/toy_shapes',
                 generate=None,
                 img_suffix: str = '.png',
                 seg_map_suffix: str = '.png',
                 **kwargs) -> None:
        if generate is not False:
            generate_toy_shapes(data_root, **(generate or {}))
        super().__init__(
            data_root=data_root,
            img_suffix=img_suffix,
            seg_map_suffix=seg_map_suffix,
            reduce_zero_label=False,
            **kwargs)

    @staticmethod
    def generates_data(cfg: dict) -> bool:
        """Whether a dataset built from ``cfg`` writes its own data, so
        that its folders may be missing before the run
        (:mod:`mmcv_custom.launching.preflight` leaves them alone): unless
        ``generate=False``."""
        return cfg.get('generate') is not False
