"""How each bucket's communication overlaps the backward pass: one link,
first in first out, in DDP's order. Standard library only."""
import dataclasses
from typing import List, Sequence, Tuple

__all__ = ['Overlap', 'simulate_overlap', 'even_ready_times']


@dataclasses.dataclass(frozen=True)
class Overlap:
    """The simulated communication of one step.

    Attributes:
        finish_s (tuple[float]): When each bucket's communication ends,
            seconds from the start of the backward.
        exposed_s (float): ``max(0, last finish - backward)``: what the
            step waits for after its backward.
    """
    finish_s: Tuple[float, ...]
    exposed_s: float


def simulate_overlap(ready_s: Sequence[float], busy_s: Sequence[float],
                     backward_s: float) -> Overlap:
    """Buckets through one link, first in first out, in DDP's order.

    Bucket ``i`` starts when it is ready and bucket ``i - 1`` has finished
    (DDP hands buckets to the hook in order; one NCCL stream, or the
    communication worker thread, carries them one after the other) and
    keeps the link ``busy_s[i]`` (its collectives plus its codec).

    Args:
        ready_s (Sequence[float]): When each bucket is ready, seconds from
            the start of the backward.
        busy_s (Sequence[float]): Each bucket's communication time.
        backward_s (float): The backward pass's length.

    Returns:
        Overlap: finish times and the exposed time.
    """
    if len(ready_s) != len(busy_s):
        raise ValueError(f'ready_s and busy_s should have one entry per '
                         f'bucket, but got {len(ready_s)} and '
                         f'{len(busy_s)}')
    finish, now = [], 0.0
    for ready, busy in zip(ready_s, busy_s):
        now = max(now, ready) + busy
        finish.append(now)
    return Overlap(tuple(finish), max(0.0, now - backward_s))


def even_ready_times(buckets: Sequence, backward_s: float) -> List[float]:
    """When each bucket is ready if the backward produces gradients at an
    even rate over its parameters, in DDP's order: bucket ``i`` at
    ``backward_s`` times the share of elements in buckets ``0..i``.
    Weighted by elements rather than bytes, since the backward's work
    follows the parameter count, not the gradients' dtype."""
    total = sum(b.numel for b in buckets) or 1
    out, seen = [], 0
    for bucket in buckets:
        seen += bucket.numel
        out.append(backward_s * seen / total)
    return out
