"""The state factories of the built-in hooks, and how each checks its
config values before anything is built.

Each is registered in :data:`~.registry.COMM_HOOK_STATES` under its hook's
name and takes ``(process_group, **config_keys)``.
"""
import inspect
from typing import Optional

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD

from ..hooks.half import CompressState, check_compress_args
from ..hooks.int8 import Int8State
from ..hooks.powersgd import PowerSGDState
from ..hooks.validation import (require_bool, require_int, require_real,
                                with_args_check)
from .registry import COMM_HOOK_STATES

__all__: list = []  # registered by name, not imported


def _check_fp16_args(args: dict) -> None:
    check_compress_args(args['predivide_factor'], args['check_finite'])


def _check_bf16_args(args: dict) -> None:
    check_compress_args(None, args['check_finite'])


@COMM_HOOK_STATES.register_module(name='fp16_compress')
@with_args_check(_check_fp16_args)
def _fp16_state(process_group: Optional[dist.ProcessGroup],
                predivide_factor: Optional[float] = None,
                check_finite: bool = True) -> CompressState:
    """fp16's range guard: where to divide, and whether to look for inf
    and NaN after the reduction (on by default: fp16 is the format that
    overflows).

    Any ``predivide_factor`` > 0 works with any world size: above the
    world size the ranks' shares sum to less than their mean, which lets
    fp16 carry an average above 65504 (the rest of the division becomes a
    product after the reduction), at the cost of flushing more small
    gradients to zero.
    """
    return CompressState(
        process_group, predivide_factor, check_finite, wire='fp16')


@COMM_HOOK_STATES.register_module(name='bf16_compress')
@with_args_check(_check_bf16_args)
def _bf16_state(process_group: Optional[dist.ProcessGroup],
                check_finite: bool = False) -> CompressState:
    """bf16 keeps fp32's range: it always divides before the reduction."""
    return CompressState(process_group, check_finite=check_finite, wire='bf16')


# NumPy's RandomState, which PowerSGDState seeds, takes seeds below 2**32.
_MAX_SEED = 2**32 - 1


def _check_powersgd_args(args: dict) -> None:
    """PyTorch's ``PowerSGDState`` arguments (torch 2.13), which it takes
    as given: rank 0 compresses every gradient to nothing, a negative rank
    or a string fails deep inside the hook at the first compressed step,
    and a stats frequency below 1 is quietly raised to 1. A key a later
    torch adds is left to PyTorch."""
    checks = {
        'matrix_approximation_rank':
        lambda v: require_int('matrix_approximation_rank', v, minimum=1),
        'start_powerSGD_iter':
        lambda v: require_int('start_powerSGD_iter', v, minimum=1),
        'min_compression_rate':
        lambda v: require_real(
            'min_compression_rate', v, minimum=0, inclusive=False),
        'use_error_feedback':
        lambda v: require_bool('use_error_feedback', v),
        'warm_start':
        lambda v: require_bool('warm_start', v),
        'orthogonalization_epsilon':
        lambda v: require_real('orthogonalization_epsilon', v, minimum=0),
        'random_seed':
        lambda v: require_int('random_seed', v, minimum=0, maximum=_MAX_SEED),
        'compression_stats_logging_frequency':
        lambda v: require_int(
            'compression_stats_logging_frequency', v, minimum=1),
        'batch_tensors_with_same_shape':
        lambda v: require_bool('batch_tensors_with_same_shape', v),
    }
    for key, check in checks.items():
        if key in args:
            check(args[key])
    # PowerSGDState.__init__'s own rule, checked before anything is built.
    start = args.get('start_powerSGD_iter', 1)
    if (args.get('use_error_feedback') or args.get('warm_start')) and (start
                                                                       <= 1):
        raise ValueError(
            'start_powerSGD_iter should be > 1 when use_error_feedback or '
            'warm_start is True (both are by default), because PowerSGD '
            "can only be applied after DDP's first two iterations (PyTorch's "
            f'rule), but got {start!r}. Set start_powerSGD_iter >= 2, or '
            'use_error_feedback=False and warm_start=False.')


@COMM_HOOK_STATES.register_module(name='powerSGD')
@with_args_check(_check_powersgd_args)
def _powersgd_state(process_group: Optional[dist.ProcessGroup],
                    **kwargs) -> PowerSGDState:
    """Build PyTorch's ``PowerSGDState`` from the config keys (as
    :class:`~mmcv_custom.hooks.powersgd.PowerSGDState`, which can take the
    node groups of the two-level form)."""
    return PowerSGDState(process_group=process_group, **kwargs)


# Only so that config keys (and, with their defaults, values) can be checked
# against PowerSGDState's arguments.
_powersgd_state.__signature__ = inspect.signature(powerSGD.PowerSGDState)
COMM_HOOK_STATES.register_module(
    name='batched_powerSGD', module=_powersgd_state)


def _check_int8_args(args: dict) -> None:
    require_int('block_size', args['block_size'], minimum=1)
    require_bool('error_feedback', args['error_feedback'])


@COMM_HOOK_STATES.register_module(name='int8_compress')
@with_args_check(_check_int8_args)
def _int8_state(process_group: Optional[dist.ProcessGroup],
                block_size: int = 256,
                error_feedback: bool = True) -> Int8State:
    """Blockwise int8 with one fp32 scale per ``block_size`` elements, and
    error feedback of what the rounding drops (see :class:`Int8State`)."""
    return Int8State(process_group, block_size, error_feedback)
