"""The hook math: DDP communication hooks and their states, torch only.

Every hook here follows PyTorch's communication-hook contract
(``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``), so it
registers on any plain :class:`torch.nn.parallel.DistributedDataParallel`::

    >>> from mmcv_custom.hooks import bf16_compress_hook
    >>> ddp_model.register_comm_hook(None, bf16_compress_hook)

The rule of this package: its modules import torch (numpy where PyTorch's
PowerSGD state needs it; Triton, torch's kernel language, for the optional
fused int8 kernels, only when they are used), the standard library, each
other and the optional C kernel ``mmcv_custom._cpu_codec``, and nothing
else of ``mmcv_custom``, so that the registry, the MMEngine adapters and
anyone's own training loop can all build on it, never the other way round.

Modules, each with one concern:

* :mod:`.half`: ``allreduce_hook``, the fp16 and bf16 hooks and wrappers,
  ``CompressState`` (the fp16 range guard);
* :mod:`.cast`: the scaling casts to and from half precision, and the CPU
  kernel that does them (``cpu_codec()`` says which is in use);
* :mod:`.int8` and :mod:`.int8_codec`: the blockwise int8 hook and its
  quantization rule;
* :mod:`.powersgd`, :mod:`.batched_powersgd`: PowerSGD on aligned copies
  and on whole buckets, flat or two-level; :mod:`.node_shares`: the
  two-level forms' steps inside the node; :mod:`.powersgd_state`: their
  state across bucket layouts and checkpoints;
* :mod:`.state`: ``HookStateKeeper``, what a stateful hook saves;
* :mod:`.worker`: the thread that issues CPU buckets' collectives in order;
* :mod:`.sharded`: the FSDP2 reduce-scatters;
* :mod:`.validation`, :mod:`.util`: standard-library helpers.

The public hooks and states are re-exported here.
"""
from .batched_powersgd import batched_powersgd_hook
from .cast import cpu_codec
from .half import (CompressState, allreduce_hook, bf16_compress_hook,
                   bf16_compress_wrapper, check_bf16_support,
                   default_predivide_factor, fp16_compress_hook,
                   fp16_compress_wrapper)
from .int8 import Int8State, int8_compress_hook
from .powersgd import powersgd_hook
from .state import HookStateKeeper

__all__ = [
    'allreduce_hook',
    'fp16_compress_hook',
    'bf16_compress_hook',
    'fp16_compress_wrapper',
    'bf16_compress_wrapper',
    'check_bf16_support',
    'CompressState',
    'default_predivide_factor',
    'cpu_codec',
    'Int8State',
    'int8_compress_hook',
    'powersgd_hook',
    'batched_powersgd_hook',
    'HookStateKeeper',
]
