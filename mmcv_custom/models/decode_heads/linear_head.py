"""A linear segmentation head with an optional norm before the classifier.

InternVL's linear-probing and few-shot ADE20K recipes classify every patch
feature with one 1x1 convolution, after a BatchNorm over the input channels
(``with_norm=True`` on its MMSegmentation 0.x FCNHead). MMSegmentation 1.x's
FCNHead has no such option, hence this head.
"""
from typing import List, Optional

from mmcv.cnn import build_norm_layer
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.registry import MODELS
from torch import Tensor, nn

__all__ = ['LinearHead']


@MODELS.register_module()
class LinearHead(BaseDecodeHead):
    """Norm, dropout and a 1x1 convolution on one backbone output.

    The norm standardises the backbone's features channel by channel
    before the classifier, as InternVL's probe does. A BN adds ``2 *
    in_channels`` trainable parameters (3200 channels: 6,400) and its
    running statistics.

    Args:
        in_channels (int): Channels of the selected backbone output; the
            classifier reads them directly, so ``channels`` must equal it
            (or be left out).
        with_norm (bool): Add the norm before the classifier. Defaults to
            True.
        norm_cfg (dict, optional): The norm, as in MMSegmentation configs
            (``dict(type='SyncBN', requires_grad=True)`` on GPUs; the
            project's tools turn SyncBN into BN without CUDA). Defaults to
            ``dict(type='BN', requires_grad=True)``.
        **kwargs: The rest of :class:`BaseDecodeHead`'s arguments
            (``num_classes``, ``in_index``, ``dropout_ratio``, ...).

    Examples:
        >>> head = LinearHead(in_channels=3200, in_index=0, num_classes=150,
        ...                   dropout_ratio=0.0,
        ...                   norm_cfg=dict(type='BN', requires_grad=True))
    """

    def __init__(self,
                 in_channels: int,
                 channels: Optional[int] = None,
                 with_norm: bool = True,
                 norm_cfg: Optional[dict] = dict(
                     type='BN', requires_grad=True),
                 **kwargs) -> None:
        if not isinstance(in_channels, int):
            raise TypeError('LinearHead reads one backbone output: '
                            f'in_channels should be an int, but got '
                            f'{in_channels!r}')
        if channels is not None and channels != in_channels:
            raise ValueError(
                'LinearHead classifies its input features directly: '
                f'channels should equal in_channels ({in_channels}), but '
                f'got {channels}')
        if with_norm and norm_cfg is None:
            raise ValueError('LinearHead(with_norm=True) needs a norm_cfg, '
                             'e.g. dict(type=\'SyncBN\', requires_grad=True)')
        super().__init__(in_channels, in_channels, norm_cfg=norm_cfg, **kwargs)
        self.with_norm = with_norm
        if with_norm:
            _, self.norm = build_norm_layer(norm_cfg, in_channels)
        else:
            self.norm = nn.Identity()

    def forward(self, inputs: List[Tensor]) -> Tensor:
        """Class logits at the resolution of the selected input."""
        x = self._transform_inputs(inputs)
        return self.cls_seg(self.norm(x))
