"""A config's trainable parameters as the cost model takes them
(:class:`~.buckets.ParamSpec`), its model built on the meta device, and the
facts the compute estimate reads from the config. Imports torch and
MMEngine (on first use)."""
from typing import Optional, Tuple

from .buckets import ParamSpec

__all__ = ['config_params']


def config_params(
        config: str,
        cfg_options: Optional[dict] = None) -> Tuple[list, int, dict]:
    """The config's trainable parameters, all parameters' count and facts.

    Args:
        config (str): A training config's path.
        cfg_options (dict, optional): Keys to override, as
            ``--cfg-options`` gives them.

    Returns:
        tuple[list[ParamSpec], int, dict]: The trainable parameters in model
        order, the count of every parameter (frozen included) and
        ``with_cp``, ``bucket_cap_mb`` and, where the config states them,
        ``tokens`` per GPU and ``tokens_how``.
    """
    import torch
    from mmengine.registry import DefaultScope, init_default_scope
    from mmengine.utils import import_modules_from_strings

    from mmcv_custom.launching.running import load_config
    cfg = load_config(config, cfg_options)
    scope = cfg.get('default_scope', 'mmseg')
    with DefaultScope.overwrite_default_scope(scope):
        if cfg.get('custom_imports'):
            import_modules_from_strings(**cfg.custom_imports)
        init_default_scope(scope)
        from mmseg.registry import MODELS
        with torch.device('meta'):
            model = MODELS.build(cfg.model)
    params = [
        ParamSpec(tuple(p.shape),
                  str(p.dtype).replace('torch.', ''), name)
        for name, p in model.named_parameters() if p.requires_grad
    ]
    total = sum(p.numel() for p in model.parameters())
    backbone = cfg.model.get('backbone') or {}
    facts = dict(
        with_cp=backbone.get('with_cp'),
        bucket_cap_mb=(cfg.get('model_wrapper_cfg')
                       or {}).get('bucket_cap_mb'))
    size, patch = backbone.get('img_size'), backbone.get('patch_size')
    batch = (cfg.get('train_dataloader') or {}).get('batch_size')
    if isinstance(size, int) and isinstance(patch, int) and batch:
        facts['tokens'] = batch * (size // patch)**2
        facts['tokens_how'] = (f'{batch} x ({size} / {patch})^2 from the '
                               'config')
    return params, total, facts
