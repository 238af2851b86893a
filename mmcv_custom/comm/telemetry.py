"""Counting the bytes a rank hands to its hooks and what the hooks send.

The builder wraps a hook chain in :func:`_count_baseline` (outermost) and
:func:`_count_wire` (around the named hook, inside any wrapper); how a hook
counts its wire bytes is in its :class:`~.records.HookRecord`.
"""
from typing import Callable

import torch.distributed as dist

from ..hooks.util import named_after
from .records import record_of

__all__ = ['CommCounter']


class CommCounter:
    """Bytes a rank handed to its hooks, and what the hooks sent.

    Counted in Python per bucket as the hooks run: no collective, no device
    synchronisation.

    Attributes:
        baseline_bytes (int): What DDP would have all-reduced without the
            hook: ``numel * element_size`` of each bucket as DDP hands it
            over (4 bytes an element for fp32 gradients, 2 for a bf16 or
            fp16 model's).
        wire_bytes (int): What the hook reduces, as the size of the
            tensor an all-reduce would carry: the bucket in the format it
            sends, or for PowerSGD once it compresses (``iter >=
            start_powerSGD_iter``) the P and Q factors plus the tensors it
            leaves uncompressed. For ``int8_compress``, which reduces as
            an all-to-all and then an all-gather (the two halves of a ring
            all-reduce), it is the quantized bucket: the int8 payload plus
            4 bytes per block scale (blocks are per parameter) and at most
            3 bytes of alignment per rank (:meth:`Int8State.wire_bytes`),
            about ``numel * (1 + 4 / block_size)``, and it covers both
            phases: the hook
            sends ``2 * (world_size - 1) / world_size`` times it from each
            rank, half in each phase, the multiple a ring all-reduce
            sends of its tensor, so counts of different hooks compare as
            their traffic does.
        wire_known (bool): False once a hook ran whose traffic is unknown
            (a user hook).
    """

    def __init__(self) -> None:
        self.baseline_bytes = 0
        self.wire_bytes = 0
        self.wire_known = True

    def pop(self):
        """``(baseline_bytes, wire_bytes or None)`` since the last call."""
        out = (self.baseline_bytes,
               self.wire_bytes if self.wire_known else None)
        self.baseline_bytes = self.wire_bytes = 0
        return out


def _count_baseline(hook: Callable, counter: CommCounter) -> Callable:
    """Outermost: the bucket as DDP hands it over, in its own dtype."""

    def _counted_hook(state, bucket: dist.GradBucket):
        buffer = bucket.buffer()
        counter.baseline_bytes += buffer.numel() * buffer.element_size()
        return hook(state, bucket)

    return named_after(_counted_hook, hook)


def _count_wire(hook: Callable, counter: CommCounter,
                base: Callable) -> Callable:
    """Around the named hook ``base`` (``hook`` may be it or wrap it): what
    it puts on the wire, as its record counts it. Inside any wrapper, so
    ``bucket.buffer()`` is in the format that is sent."""
    count_wire = record_of(base).count_wire

    def _counted_hook(state, bucket: dist.GradBucket):
        if count_wire is None:
            counter.wire_known = False
            return hook(state, bucket)
        fut, sent = count_wire(hook, state, bucket)
        counter.wire_bytes += sent
        return fut

    return named_after(_counted_hook, hook)
