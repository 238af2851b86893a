"""Counting the bytes a rank hands to its hooks and the bytes they send.

The builder wraps a hook chain in :func:`add_baseline_count` (outermost)
and :func:`add_sent_count` (around the named hook, inside any wrapper); how
a hook counts the bytes it sends is its record's
:attr:`~.records.HookRecord.count_bytes_sent`.
"""
from typing import Callable

import torch.distributed as dist

from ..hooks.util import named_after
from .records import record_of

__all__ = ['CommCounter', 'add_baseline_count', 'add_sent_count']


class CommCounter:
    """Bytes a rank handed to its hooks, and the bytes the hooks sent.

    Counted in Python per bucket as the hooks run: no collective, no device
    synchronisation.

    Attributes:
        baseline_bytes (int): What DDP would have all-reduced without the
            hook: ``numel * element_size`` of each bucket as DDP hands it
            over (4 bytes an element for fp32 gradients, 2 for a bf16 or
            fp16 model's).
        bytes_sent (int): What the hooks reduced, as the size of the tensors
            an all-reduce would carry (a ring all-reduce sends
            ``2 * (world_size - 1) / world_size`` times it from each rank),
            so that the counts of different hooks compare as their traffic
            does; each hook's record says how it counts
            (:attr:`~.records.HookRecord.count_bytes_sent`).
        bytes_sent_known (bool): False for a hook whose record does not
            count the bytes it sends (a plugin hook without one).
    """

    def __init__(self) -> None:
        self.baseline_bytes = 0
        self.bytes_sent = 0
        self.bytes_sent_known = True

    def pop(self):
        """``(baseline_bytes, bytes_sent or None)`` since the last call."""
        out = (self.baseline_bytes,
               self.bytes_sent if self.bytes_sent_known else None)
        self.baseline_bytes = self.bytes_sent = 0
        return out


def add_baseline_count(hook: Callable, counter: CommCounter) -> Callable:
    """Wrap ``hook`` (outermost) to add each bucket as DDP hands it over,
    in its own dtype, to ``counter.baseline_bytes``."""

    def _counted_hook(state, bucket: dist.GradBucket):
        buffer = bucket.buffer()
        counter.baseline_bytes += buffer.numel() * buffer.element_size()
        return hook(state, bucket)

    return named_after(_counted_hook, hook)


def add_sent_count(hook: Callable, counter: CommCounter,
                   base: Callable) -> Callable:
    """Wrap ``hook`` (the named hook ``base``, or a chain around it) to add
    what it sends, as ``base``'s record counts it, to
    ``counter.bytes_sent``. Goes inside any wrapper, so that
    ``bucket.buffer()`` is in the format that is sent. Without a counting
    record, ``counter.bytes_sent_known`` is False from the start."""
    count_bytes_sent = record_of(base).count_bytes_sent
    if count_bytes_sent is None:
        counter.bytes_sent_known = False
        return hook

    def _counted_hook(state, bucket: dist.GradBucket):
        fut, sent = count_bytes_sent(hook, state, bucket)
        counter.bytes_sent += sent
        return fut

    return named_after(_counted_hook, hook)
