"""Small helpers the hook modules share: the standard library, and the
one name of torch's all-gather into one tensor."""
from typing import Callable

import torch.distributed as dist

__all__ = ['ceil_div', 'align_up', 'named_after', 'all_gather_single']

#: ``all_gather_single(output, input, group=..., async_op=...)``: the torch
#: this project pins (2.13) calls it so and warns on every call of the
#: older name, ``all_gather_into_tensor``, which older torches only have.
all_gather_single = (
    getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor)


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for non-negative ints, exactly
    (no float rounding for large counts)."""
    return -(-numerator // denominator)


def align_up(nbytes: int, to: int) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return ceil_div(nbytes, to) * to


def named_after(wrapper: Callable,
                hook: Callable,
                template: str = '{}') -> Callable:
    """Name ``wrapper`` after the ``hook`` it wraps (its ``__qualname__``
    put into ``template``, e.g. ``'on_comm_worker({})'``) and point
    ``__wrapped__`` at it.

    DDP logs a hook by ``__qualname__``, so a wrapped hook keeps a readable
    name; ``__wrapped__`` lets tools find the hook inside a chain. Not
    ``functools.wraps``: hooks may be callables without ``__name__`` or a
    ``__dict__`` worth copying.
    """
    name = getattr(hook, '__qualname__', type(hook).__name__)
    wrapper.__qualname__ = template.format(name)
    wrapper.__wrapped__ = hook
    return wrapper
