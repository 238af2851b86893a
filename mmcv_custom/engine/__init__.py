"""MMEngine glue: thin adapters between the runner and the hook math."""
from .checkpoint_io import (AtomicLocalBackend, install_checkpoint_integrity,
                            load_verified)
from .comm_hook_registration_hook import (CommHookRegistrationHook,
                                          NonFiniteGradientsError)
from .cpu_amp_optim_wrapper import CPUAmpOptimWrapper
from .fsdp2_strategy import FSDP2Strategy
from .layer_decay_constructor import LayerDecayOptimWrapperConstructor
from .random_state import RandomStateHook
from .run_identity import RunIdentityHook
from .validation_record import ValidationRecordHook

__all__ = [
    'AtomicLocalBackend', 'install_checkpoint_integrity', 'load_verified',
    'CommHookRegistrationHook', 'CPUAmpOptimWrapper', 'FSDP2Strategy',
    'LayerDecayOptimWrapperConstructor', 'NonFiniteGradientsError',
    'RandomStateHook', 'RunIdentityHook', 'ValidationRecordHook'
]
