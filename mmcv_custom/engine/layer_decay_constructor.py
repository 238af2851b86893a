"""Layer-wise learning-rate decay for ViT backbones such as InternViT."""
import re
from typing import List

from mmengine.logging import print_log
from mmengine.optim import DefaultOptimWrapperConstructor
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

__all__ = ['LayerDecayOptimWrapperConstructor']

_BLOCK = re.compile(r'(?:^|\.)backbone\.blocks\.(\d+)\.')
_EMBEDDINGS = ('backbone.cls_token', 'backbone.pos_embed',
               'backbone.patch_embed.')
_NO_DECAY_NAMES = ('cls_token', 'pos_embed')


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class LayerDecayOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """Scale each ViT block's learning rate by its depth.

    Block ``i`` (``backbone.blocks.{i}``) is layer ``i + 1``; the patch
    embedding, class token and position embeddings are layer 0; everything
    else (decode head, pyramid) is layer ``num_layers + 1`` and keeps the
    base rate. Layer ``l`` trains at
    ``lr * layer_decay_rate ** (num_layers + 1 - l)``: early, generic layers
    move least. Norm weights, LayerScale factors, biases (every 1-d
    parameter), position embeddings and the class token get no weight
    decay. Frozen parameters are left out.

    Config::

        optim_wrapper = dict(
            optimizer=dict(type='AdamW', lr=4e-5, weight_decay=0.05),
            constructor='LayerDecayOptimWrapperConstructor',
            paramwise_cfg=dict(num_layers=48, layer_decay_rate=0.95))
    """

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg=None):
        paramwise_cfg = dict(paramwise_cfg or {})
        missing = [
            k for k in ('num_layers', 'layer_decay_rate')
            if k not in paramwise_cfg
        ]
        if missing:
            raise KeyError(f'paramwise_cfg needs {missing} for layer-wise '
                           f'decay, but got {paramwise_cfg}')
        self.num_layers = int(paramwise_cfg.pop('num_layers'))
        self.decay_rate = float(paramwise_cfg.pop('layer_decay_rate'))
        if not 0 < self.decay_rate <= 1:
            raise ValueError('layer_decay_rate should be in (0, 1], but got '
                             f'{self.decay_rate}')
        super().__init__(optim_wrapper_cfg, paramwise_cfg)
        # Non-empty, so that the parent calls add_params.
        self.paramwise_cfg = paramwise_cfg or {'layer_decay': True}

    def layer_id(self, name: str) -> int:
        """The layer a parameter belongs to (see the class docstring)."""
        match = _BLOCK.search(name)
        if match:
            return int(match.group(1)) + 1
        if any(name.startswith(e) or f'.{e}' in name for e in _EMBEDDINGS):
            return 0
        return self.num_layers + 1

    def add_params(self, params: List[dict], module: nn.Module,
                   **kwargs) -> None:
        groups = {}
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            layer = self.layer_id(name)
            no_decay = (
                param.ndim == 1 or name.endswith('.bias')
                or name.split('.')[-1] in _NO_DECAY_NAMES)
            key = (layer, no_decay)
            if key not in groups:
                scale = self.decay_rate**(self.num_layers + 1 - layer)
                group = dict(
                    params=[],
                    lr=self.base_lr * scale,
                    layer_id=layer,
                    lr_scale=scale)
                if self.base_wd is not None:
                    group['weight_decay'] = 0. if no_decay else self.base_wd
                groups[key] = group
            groups[key]['params'].append(param)
        params.extend(groups[k] for k in sorted(groups))
        print_log(
            f'Layer-wise lr decay {self.decay_rate} over {self.num_layers} '
            f'layers: {len(groups)} parameter groups, lr scale '
            f'{self.decay_rate**(self.num_layers + 1):.3g} (embeddings) to 1 '
            '(head).',
            logger='current')
