"""Mixed precision on CPU: MMEngine's ``AmpOptimWrapper`` refuses CPUs."""
from typing import Union

import torch
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

__all__ = ['CPUAmpOptimWrapper']


@OPTIM_WRAPPERS.register_module()
class CPUAmpOptimWrapper(AmpOptimWrapper):
    """``AmpOptimWrapper`` for CPU runs: autocast plus a CPU gradient scaler.

    MMEngine's wrapper asserts a GPU, NPU, MLU or MUSA device, so ``--amp``
    would stop a CPU run; ``tools/train.py`` uses this class instead when
    there is no CUDA. It behaves like ``AmpOptimWrapper`` (same state dict,
    same dynamic loss scaling, so a communication hook sees the same scaled
    gradients) with ``torch.amp.GradScaler('cpu')`` and bfloat16 autocast by
    default, the half type CPUs compute fast.

    Args:
        loss_scale (str, float or dict): As in ``AmpOptimWrapper``.
            Defaults to ``'dynamic'``.
        dtype (str or torch.dtype): Autocast type; CPU autocast in MMEngine
            supports only ``'bfloat16'``. Defaults to ``'bfloat16'``.
        **kwargs: Passed to ``OptimWrapper``.
    """

    def __init__(self,
                 loss_scale: Union[str, float, dict] = 'dynamic',
                 dtype: Union[str, torch.dtype] = 'bfloat16',
                 **kwargs) -> None:
        OptimWrapper.__init__(self, **kwargs)
        self._scale_update_param = None
        if loss_scale == 'dynamic':
            self.loss_scaler = torch.amp.GradScaler('cpu')
        elif isinstance(loss_scale, float):
            self._scale_update_param = loss_scale
            self.loss_scaler = torch.amp.GradScaler(
                'cpu', init_scale=loss_scale)
        elif isinstance(loss_scale, dict):
            self.loss_scaler = torch.amp.GradScaler('cpu', **loss_scale)
        else:
            raise TypeError("loss_scale should be 'dynamic', a float or a "
                            f'dict, but got {loss_scale!r}')
        if dtype not in ('bfloat16', torch.bfloat16):
            # MMEngine's autocast asserts bfloat16 on CPU.
            raise ValueError("CPU autocast supports dtype='bfloat16' only, "
                             f'but got {dtype!r}')
        self.cast_dtype = torch.bfloat16
