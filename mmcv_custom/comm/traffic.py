"""Which collectives count as bytes sent: the one counting rule.

A hook's traffic is reported as one number per step, "sent bytes": the size
of the tensor a ring all-reduce would carry to put the same bytes on the
links. Hooks that all-reduce are counted by their tensors; others are
weighted by what their collectives move against an all-reduce. On ``P``
ranks a ring all-reduce of ``S`` bytes sends ``2 (P - 1) / P * S`` from
each rank; an all-to-all of an ``S``-byte send tensor sends ``(P - 1) / P *
S`` (half of it), as does a reduce-scatter of an ``S``-byte input, and
an all-gather of ``s`` bytes from each rank sends
``(P - 1) s``, half of an all-reduce of the gathered ``P s``. So an
all-to-all followed by an all-gather of its result (``int8_compress``'s two
halves of a reduction) counts about its quantized bucket once, and a hook
whose only collective is an all-gather counts what it gathers.

The communication telemetry (:mod:`.records`), the cost model
(:mod:`mmcv_custom.analysis.cost`) and the benchmarks count with it.
Standard library only.
"""
from typing import Iterable, Tuple

__all__ = ['COLLECTIVE_KINDS', 'reduced_bytes', 'sent_bytes']

#: The collectives the hooks issue, as the cost model and benchmarks name
#: them.
COLLECTIVE_KINDS = ('all_reduce', 'all_gather', 'all_to_all', 'reduce_scatter')


def reduced_bytes(kind: str, nbytes: float, world_size: int) -> float:
    """One collective's sent bytes, as an all-reduced tensor's size.

    Args:
        kind (str): One of :data:`COLLECTIVE_KINDS`.
        nbytes (float): ``all_reduce``: the tensor reduced;
            ``all_to_all``: the rank's whole send tensor; ``all_gather``:
            the rank's own part; ``reduce_scatter``: the rank's whole
            input (FSDP2's, :mod:`mmcv_custom.hooks.sharded`).
        world_size (int): Ranks taking part (an all-gather's result grows
            with them).

    Returns:
        float: ``nbytes`` for an all-reduce, half of it for an all-to-all
        or a reduce-scatter, ``world_size * nbytes / 2`` for an
        all-gather.
    """
    if kind == 'all_reduce':
        return nbytes
    if kind in ('all_to_all', 'reduce_scatter'):
        return nbytes / 2
    if kind == 'all_gather':
        return world_size * nbytes / 2
    raise ValueError(f'collective kind should be one of '
                     f'{list(COLLECTIVE_KINDS)}, but got {kind!r}')


def sent_bytes(collectives: Iterable[Tuple[str, float]],
               world_size: int) -> float:
    """The sent bytes of ``(kind, nbytes)`` pairs, summed by
    :func:`reduced_bytes` (what a step's hook reports)."""
    return sum(
        reduced_bytes(kind, nbytes, world_size)
        for kind, nbytes in collectives)
