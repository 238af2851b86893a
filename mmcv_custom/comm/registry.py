"""The two registries a ``comm_hook`` config is looked up in.

:data:`COMM_HOOKS` maps a config's ``type`` to a hook function;
:data:`COMM_HOOK_STATES` maps the same name to the factory that builds the
hook's state from the config's other keys (see :mod:`.states`). Users add
their own with ``@COMM_HOOKS.register_module()``.
"""
from mmengine.registry import Registry

from ..hooks.batched_powersgd import batched_powersgd_hook
from ..hooks.half import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ..hooks.int8 import int8_compress_hook
from ..hooks.powersgd import powersgd_hook

__all__ = ['COMM_HOOKS', 'COMM_HOOK_STATES']

COMM_HOOKS = Registry('DDP communication hook', scope='mmcv_custom')
COMM_HOOK_STATES = Registry(
    'DDP communication hook state', scope='mmcv_custom')

COMM_HOOKS.register_module(name='allreduce', module=allreduce_hook)
COMM_HOOKS.register_module(name='fp16_compress', module=fp16_compress_hook)
COMM_HOOKS.register_module(name='bf16_compress', module=bf16_compress_hook)
COMM_HOOKS.register_module(name='powerSGD', module=powersgd_hook)
COMM_HOOKS.register_module(
    name='batched_powerSGD', module=batched_powersgd_hook)
COMM_HOOKS.register_module(name='int8_compress', module=int8_compress_hook)
