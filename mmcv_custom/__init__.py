"""mmcv_custom: half-precision DDP communication hooks for MMEngine training.

``import mmcv_custom`` (or ``custom_imports=dict(imports=['mmcv_custom'])``
in a config) registers the communication-hook registry and the
``CommHookRegistrationHook`` runner hook. The hook functions themselves live
in :mod:`mmcv_custom.ddp_hooks`, which needs only torch.
"""
from .ddp_hooks import (allreduce_hook, bf16_compress_hook,
                        bf16_compress_wrapper, check_bf16_support,
                        fp16_compress_hook, fp16_compress_wrapper)
from .engine import CommHookRegistrationHook
from .registry import (COMM_HOOK_STATES, COMM_HOOKS, CommHookSpec,
                       build_comm_hook, check_comm_hook_cfg)
from .version import __version__

__all__ = [
    '__version__',
    'allreduce_hook',
    'fp16_compress_hook',
    'bf16_compress_hook',
    'fp16_compress_wrapper',
    'bf16_compress_wrapper',
    'check_bf16_support',
    'COMM_HOOKS',
    'COMM_HOOK_STATES',
    'CommHookSpec',
    'build_comm_hook',
    'check_comm_hook_cfg',
    'CommHookRegistrationHook',
]
