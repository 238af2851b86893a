"""Print a config's parameter count, trainable count and gradient traffic.

The model is built on the meta device, so InternViT-6B needs no memory:

    python tools/analysis_tools/model_stats.py \\
        configs/intern_vit/upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py

Gradient bytes are what each rank all-reduces per optimizer step: each
trainable parameter's gradient in its own dtype (4 bytes in fp32, 2 for a
bf16 backbone), and what the configured ``comm_hook`` sends instead (2 bytes
for fp16/bf16; for PowerSGD, the two factors of every matrix it compresses
plus what it leaves alone, after its warm-up). The memory line adds the
parameters and AdamW's two moments per GPU under DDP, activations aside.
"""
import argparse
import os.path as osp
import sys

import torch
from mmengine.config import Config, DictAction
from mmengine.registry import DefaultScope, init_default_scope
from mmengine.utils import import_modules_from_strings

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(
    __file__)))))
from mmcv_custom.launcher import load_config  # noqa: E402
from mmcv_custom.registry import check_comm_hook_cfg  # noqa: E402

GiB = 2**30


def powersgd_numel(params, rank: int, min_rate: float) -> int:
    """Numbers PowerSGD sends for ``params`` (PyTorch's compression rule)."""
    from torch.distributed.algorithms.ddp_comm_hooks import \
        powerSGD_hook as powerSGD
    total = 0
    for p in params:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        compress, before, after = powerSGD._should_compress(n, m, r, min_rate)
        total += after if compress else before
    return total


def _size(num_bytes: int) -> str:
    """GiB with three decimals, or MiB for what would read 0.000 GiB."""
    if num_bytes >= GiB / 100:
        return f'{num_bytes / GiB:.3f} GiB'
    return f'{num_bytes / 2**20:.3f} MiB'


def stats(cfg: Config) -> dict:
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg.custom_imports)
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    from mmseg.registry import MODELS
    with torch.device('meta'):
        model = MODELS.build(cfg.model)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    backbone = getattr(model, 'backbone', None)
    # Only InternViT tells its pre-trained ViT apart from its adapters.
    vit = getattr(backbone, 'vit_parameters', None)
    out = dict(
        params=sum(p.numel() for p in params),
        backbone_params=None if backbone is None else sum(
            p.numel() for p in backbone.parameters()),
        vit_params=None if vit is None else sum(p.numel() for p in vit()),
        trainable=sum(p.numel() for p in trainable))
    # What DDP all-reduces without a hook: each gradient in its parameter's
    # dtype (a bf16 backbone's in bf16).
    out['grad_bytes'] = sum(p.numel() * p.element_size() for p in trainable)
    out['bf16_params'] = sum(p.numel() for p in params
                             if p.dtype == torch.bfloat16)
    out['bf16_trainable'] = sum(p.numel() for p in trainable
                                if p.dtype == torch.bfloat16)
    # Per GPU under DDP, activations aside: every parameter, the gradients
    # and AdamW's two moments (kept in the parameters' dtype).
    out['param_bytes'] = sum(p.numel() * p.element_size() for p in params)
    out['optim_bytes'] = 2 * out['grad_bytes']
    hook = cfg.get('comm_hook')
    if hook is None:
        out['hook'], out['hook_bytes'] = 'none (plain all-reduce)', out[
            'grad_bytes']
        return out
    checked = check_comm_hook_cfg(hook)
    half = checked['wrapper'] or checked['type'] in ('fp16_compress',
                                                     'bf16_compress')
    kwargs = checked['state_kwargs']
    if checked['type'] == 'powerSGD':
        numel = powersgd_numel(trainable,
                               kwargs.get('matrix_approximation_rank', 1),
                               kwargs.get('min_compression_rate', 2))
        out['hook_bytes'] = numel * (2 if half else 4)
    elif checked['type'] in ('allreduce', 'fp16_compress', 'bf16_compress'):
        # Half precision halves fp32 gradients; bf16 ones go as they are.
        out['hook_bytes'] = sum(
            p.numel() * (min(p.element_size(), 2) if half else
                         p.element_size()) for p in trainable)
    else:
        out['hook_bytes'] = None  # depends on DDP's buckets
    out['hook'] = ', '.join(f'{k}={v!r}' for k, v in hook.items())
    return out


def _error(message: str) -> None:
    """Exit with one line, as argparse does, instead of a traceback."""
    sys.exit(f'{osp.basename(__file__)}: error: {message}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('config', help='config file path')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override some settings in the used config, as in '
        'tools/train.py: the key-value pairs in xxx=yyy format are merged '
        'into the config, e.g. comm_hook.type=fp16_compress')
    args = parser.parse_args()
    cfg = load_config(args.config, args.cfg_options)
    if cfg.get('comm_hook') is not None:
        # Before building the model (seconds for InternViT-6B). The errors
        # name the bad value and the valid ones: that line is what the
        # user needs, not a traceback.
        try:
            check_comm_hook_cfg(cfg.comm_hook)
        except (KeyError, TypeError, ValueError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            _error(str(message))
    with DefaultScope.overwrite_default_scope(
            cfg.get('default_scope', 'mmseg')):
        s = stats(cfg)
    vit = ('' if s['vit_params'] is None else
           f', of which the pre-trained ViT {s["vit_params"]:,}')
    parts = ('' if s['backbone_params'] is None else
             f' (backbone {s["backbone_params"]:,}{vit})')
    print(f'config            : {args.config}')
    print(f'parameters        : {s["params"]:,}{parts}')
    print(f'trainable         : {s["trainable"]:,}')
    kind = (f'{s["bf16_trainable"]:,} of them in bf16'
            if s['bf16_trainable'] else 'fp32')
    print(f'gradients         : {_size(s["grad_bytes"])} per step ({kind})')
    hook_bytes = ('depends on the DDP buckets' if s['hook_bytes'] is None
                  else f'{_size(s["hook_bytes"])} per step')
    print(f'with comm_hook    : {hook_bytes} ({s["hook"]})')
    total = s['param_bytes'] + s['grad_bytes'] + s['optim_bytes']
    print(f'memory per GPU    : {_size(total)} under DDP (parameters '
          f'{_size(s["param_bytes"])}, gradients {_size(s["grad_bytes"])}, '
          f'AdamW moments {_size(s["optim_bytes"])}; activations not '
          'counted)')


if __name__ == '__main__':
    main()
