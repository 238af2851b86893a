"""Counting the bytes a rank hands to its hooks and the bytes they send,
and how long its step waited for them.

The builder wraps a hook chain in :func:`add_baseline_count` (outermost)
and :func:`add_sent_count` (around the named hook, inside any wrapper); how
a hook counts the bytes it sends is its record's
:attr:`~.records.HookRecord.count_bytes_sent`.

What a hook buys is time, not bytes: the outermost wrapper also notes when
each bucket is handed over and when its reduction completes, so that
:meth:`CommCounter.pop_wait` gives the communication the step waited for
(from the last bucket's hand-over, when the backward has no more gradients
to compute, to the last completion), measured on the run itself.
"""
import time
from typing import Callable, Optional

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
        # perf_counter() when the latest bucket was handed over, and when
        # the latest reduction completed (on whichever thread ran it).
        self._ready: Optional[float] = None
        self._done: Optional[float] = None

    def bucket_ready(self) -> None:
        """Note that a bucket was handed to the hook now."""
        self._ready = time.perf_counter()

    def bucket_done(self) -> None:
        """Note that a bucket's reduction completed now."""
        now = time.perf_counter()
        self._done = now if self._done is None else max(self._done, now)

    def pop_wait(self) -> Optional[float]:
        """Seconds from the last bucket handed over to the last reduction
        completed, since the last call (0 where the reductions were done
        before the last bucket came); None where no bucket came.

        The last bucket comes when the backward has computed every
        gradient, so this is the communication the step waited for: what
        the hook left exposed. On CUDA it is when the host saw each
        collective complete, so it is measured where DDP waits too.
        """
        ready, done = self._ready, self._done
        self._ready = self._done = None
        if ready is None:
            return None
        return 0.0 if done is None else max(0.0, done - ready)

    def pop(self):
        """``(baseline_bytes, bytes_sent or None)`` since the last call."""
        out = (self.baseline_bytes,
               self.bytes_sent if self.bytes_sent_known else None)
        self.baseline_bytes = self.bytes_sent = 0
        return out


def add_baseline_count(hook: Callable, counter: CommCounter) -> Callable:
    """Wrap ``hook`` (outermost) to add each bucket as DDP hands it over,
    in its own dtype, to ``counter.baseline_bytes``, and to note when it
    was handed over and when its reduction completed
    (:meth:`CommCounter.pop_wait`)."""

    def _done(fut):
        counter.bucket_done()
        return fut.value()  # re-raises what the hook's future raised

    def _counted_hook(state, bucket: dist.GradBucket):
        buffer = bucket.buffer()
        counter.baseline_bytes += buffer.numel() * buffer.element_size()
        counter.bucket_ready()
        return hook(state, bucket).then(_done)

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
