"""mmcv_custom: half-precision DDP communication hooks for MMEngine training.

``import mmcv_custom`` (or ``custom_imports=dict(imports=['mmcv_custom'])``
in a config) registers the communication-hook registry and the
``CommHookRegistrationHook`` runner hook and the ``FSDP2Strategy`` of
MMEngine's FlexibleRunner, and lets torch's safe loader read
MMEngine's own checkpoints (see :mod:`mmcv_custom.integrity.checkpoint`), so
``--resume`` works on torch >= 2.6, and makes every local checkpoint write
atomic with a ``.sha256`` digest that loads verify (see
:mod:`mmcv_custom.engine.checkpoint_io`). The hook functions themselves live in
:mod:`mmcv_custom.hooks`, which needs only torch.
"""
import importlib.util

from .hooks import (CompressState, Int8State, allreduce_hook,
                    bf16_compress_hook, bf16_compress_wrapper,
                    check_bf16_support, default_predivide_factor,
                    fp16_compress_hook, fp16_compress_wrapper,
                    int8_compress_hook)
from .version import __version__

#: The names below that are the MMEngine glue (registered at import).
_MMENGINE_NAMES = ('COMM_HOOKS', 'COMM_HOOK_STATES', 'CommCounter',
                   'CommHookSpec', 'build_comm_hook', 'check_comm_hook_cfg',
                   'with_args_check', 'require_int', 'require_real',
                   'require_bool', 'CommHookRegistrationHook',
                   'CPUAmpOptimWrapper', 'FSDP2Strategy',
                   'LayerDecayOptimWrapperConstructor',
                   'NonFiniteGradientsError', 'allow_mmengine_checkpoints',
                   'check_checkpoint', 'load_checkpoint_file',
                   'UnsafeCheckpointError', 'CheckpointDamagedError',
                   'install_checkpoint_integrity')

if importlib.util.find_spec('mmengine') is not None:
    from .comm.builder import (CommHookSpec, build_comm_hook,
                               check_comm_hook_cfg)
    from .comm.registry import COMM_HOOK_STATES, COMM_HOOKS
    from .comm.telemetry import CommCounter
    from .engine import (CommHookRegistrationHook, CPUAmpOptimWrapper,
                         FSDP2Strategy, LayerDecayOptimWrapperConstructor,
                         NonFiniteGradientsError, install_checkpoint_integrity)
    from .hooks.validation import (require_bool, require_int, require_real,
                                   with_args_check)
    from .integrity import CheckpointDamagedError
    from .integrity.checkpoint import (UnsafeCheckpointError,
                                       allow_mmengine_checkpoints,
                                       check_checkpoint, load_checkpoint_file)

    allow_mmengine_checkpoints()
    install_checkpoint_integrity()
else:

    def __getattr__(name: str):
        """Without MMEngine the hooks (:mod:`mmcv_custom.hooks`) import
        and work; the glue that needs MMEngine says so when asked for."""
        if name in _MMENGINE_NAMES:
            raise ImportError(
                f'mmcv_custom.{name} needs MMEngine, which is not installed '
                '(pip install mmengine, or `make install` in a checkout). '
                'The hooks themselves need only torch: import them from '
                'mmcv_custom.hooks.')
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = [
    '__version__',
    'allreduce_hook',
    'fp16_compress_hook',
    'bf16_compress_hook',
    'fp16_compress_wrapper',
    'bf16_compress_wrapper',
    'check_bf16_support',
    'CompressState',
    'Int8State',
    'int8_compress_hook',
    'default_predivide_factor',
    'COMM_HOOKS',
    'COMM_HOOK_STATES',
    'CommCounter',
    'CommHookSpec',
    'build_comm_hook',
    'check_comm_hook_cfg',
    'with_args_check',
    'require_int',
    'require_real',
    'require_bool',
    'CommHookRegistrationHook',
    'CPUAmpOptimWrapper',
    'FSDP2Strategy',
    'LayerDecayOptimWrapperConstructor',
    'NonFiniteGradientsError',
    'allow_mmengine_checkpoints',
    'check_checkpoint',
    'load_checkpoint_file',
    'UnsafeCheckpointError',
    'CheckpointDamagedError',
    'install_checkpoint_integrity',
]
