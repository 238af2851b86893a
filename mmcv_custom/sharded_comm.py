"""How FSDP2 (``torch.distributed.fsdp.fully_shard``) reduces gradients.

FSDP2 has no DDP communication hooks: each sharded module reduce-scatters
its gradients through a ``ReduceScatter`` object, which
``FSDPModule.set_custom_reduce_scatter`` replaces.
:class:`AveragingReduceScatter` is that object for this project's
``comm_hook`` types, with the DDP hooks' semantics
(:mod:`mmcv_custom.ddp_hooks`):

* the average is taken in the gradients' own precision *before* the cast,
  so fp16 overflows only when the mean does;
* the reduce-scatter runs on the wire dtype (fp32 for ``allreduce``, fp16 or
  bf16 for the compressing types) and the shard is widened in place into
  FSDP's output;
* gradients already in a 2-byte float (a bf16 backbone's) are sent as they
  are, never cast from bf16 to fp16.

FSDP2 must hand over the plain sum: :func:`install_reduce_scatter` sets
``set_gradient_divide_factor(1.0)`` and
``set_force_sum_reduction_for_comms(True)`` on every sharded module, so
FSDP neither divides nor asks for an averaging reduce op, and this object
divides once.

Like :mod:`mmcv_custom.ddp_hooks`, this module imports only torch.
"""
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .ddp_hooks import (_compress, _decompress, _require_dtype_support,
                        _wire_dtype)

try:  # The base class set_custom_reduce_scatter documents (torch >= 2.6).
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - older torch
    ReduceScatter = object

__all__ = ['AveragingReduceScatter', 'install_reduce_scatter',
           'fsdp_modules', 'WIRE_DTYPES']

# comm_hook type -> dtype on the wire (None: the gradients' own dtype).
WIRE_DTYPES = {
    'allreduce': None,
    'fp16_compress': torch.float16,
    'bf16_compress': torch.bfloat16,
}


class AveragingReduceScatter(ReduceScatter):
    """Average gradients across the group and keep this rank's shard.

    Args:
        wire_dtype (torch.dtype, optional): What to send: ``torch.float16``,
            ``torch.bfloat16``, or None for the gradients' own dtype (FSDP's
            default reduction). Gradients already in a 2-byte float are
            sent as they are.
        counter (object, optional): Anything with ``baseline_bytes`` and
            ``wire_bytes`` attributes (e.g. ``registry.CommCounter``):
            each call adds the bytes of its input as FSDP would send them
            and as sent. Defaults to None.

    The input is FSDP's flat reduce-scatter buffer (its gradients chunked by
    rank, padded), which it no longer needs after the call: it is divided
    in place when the wire dtype is the gradients' own.
    """

    def __init__(self, wire_dtype: Optional[torch.dtype] = None,
                 counter=None) -> None:
        if wire_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError('wire_dtype should be torch.float16, '
                             f'torch.bfloat16 or None, but got {wire_dtype}')
        self.wire_dtype = wire_dtype
        self.counter = counter

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self,
                 output_tensor: torch.Tensor,
                 input_tensor: torch.Tensor,
                 group: dist.ProcessGroup,
                 op=None,
                 async_op: bool = False):
        if op is not None and op != dist.ReduceOp.SUM:
            # The strategy forces sum reductions (see the module docstring).
            raise RuntimeError(
                f'AveragingReduceScatter got reduce op {op}; it averages by '
                'itself and needs FSDP to ask for a plain sum: call '
                'install_reduce_scatter instead of set_custom_reduce_scatter')
        world = group.size()
        wire = (input_tensor.dtype if self.wire_dtype is None else
                _wire_dtype(self.wire_dtype, input_tensor))
        _require_dtype_support(wire, group, input_tensor.device)
        if self.counter is not None:
            numel = input_tensor.numel()
            self.counter.baseline_bytes += numel * input_tensor.element_size()
            self.counter.wire_bytes += numel * torch.finfo(wire).bits // 8
        if wire is input_tensor.dtype:
            input_tensor.mul_(1.0 / world)
            return dist.reduce_scatter_single(output_tensor, input_tensor,
                                              group=group, async_op=async_op)
        # Divide in the gradients' precision, then round once to the wire.
        sent = _compress(input_tensor, world, wire)
        received = torch.empty(output_tensor.numel(), dtype=wire,
                               device=output_tensor.device)
        dist.reduce_scatter_single(received, sent, group=group)
        _decompress(received, output_tensor.view(-1))
        return None


def fsdp_modules(model: nn.Module) -> list:
    """Every module of ``model`` that ``fully_shard`` has sharded, root
    included (empty when none is)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def install_reduce_scatter(model: nn.Module,
                           wire_dtype: Optional[torch.dtype] = None,
                           counter=None) -> int:
    """Make every sharded module of ``model`` reduce its gradients with one
    :class:`AveragingReduceScatter`.

    Returns:
        int: How many sharded modules were set (0: ``model`` is not
        sharded with FSDP2).
    """
    comm = AveragingReduceScatter(wire_dtype, counter)
    modules = fsdp_modules(model)
    for module in modules:
        module.set_custom_reduce_scatter(comm)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return len(modules)
