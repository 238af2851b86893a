"""The link rate of emulated nodes: a token bucket filter (``tc qdisc
... tbf``) on each end of a node's link, changed in place or removed.
"""
import math
from typing import Optional, Sequence, Tuple

from .namespaces import run_command

__all__ = [
    'TBF_BURST_BYTES', 'TBF_BURST_MS', 'TBF_LATENCY_MS', 'MIN_RATE_MBIT',
    'MAX_RATE_MBIT', 'check_bandwidth', 'shape_links', 'tbf_burst_bytes',
    'format_mbit'
]

#: The least tbf may send at once (its bucket): one full-size TSO segment
#: of a veth. Above 256 Mbit/s the bucket holds :data:`TBF_BURST_MS` of
#: the rate instead: with a bucket no larger than one segment, tbf sends a
#: segment only once the bucket is full again, every timer delay is lost,
#: and 1 Gbit/s measured 0.78 Gbit/s (0.96 with 2 ms).
TBF_BURST_BYTES = 64 * 1024
#: Above 256 Mbit/s, the bucket in milliseconds of the rate.
TBF_BURST_MS = 2
#: How long a packet may wait in tbf's queue before it is dropped: the
#: queue a switch port might have. TCP needs a queue of about one
#: bandwidth-delay product to fill the link.
TBF_LATENCY_MS = 50
#: The link rates, in Mbit/s, that tc's tbf holds as given with the bucket
#: and queue above (iproute2 6.1, measured by reading the qdisc back).
#: Below about 0.0019 Mbit/s the 64 KiB bucket takes longer to fill than
#: tc's 32-bit count of 64 ns ticks holds (275 s), and tc silently keeps
#: another bucket; below 8 bit/s it refuses the rate (0 bytes a second).
#: Above about 660,000 Mbit/s the queue (:data:`TBF_LATENCY_MS` of the
#: rate, plus the bucket) overflows its 32-bit limit in bytes.
MIN_RATE_MBIT = 0.002
MAX_RATE_MBIT = 600_000


def check_bandwidth(bandwidth_mbit) -> Optional[float]:
    """``bandwidth_mbit`` as a float, or None (not shaped); a
    ``TypeError`` or ``ValueError`` naming the bad value (a
    ``ValueError`` too outside :data:`MIN_RATE_MBIT` to
    :data:`MAX_RATE_MBIT`, before tc refuses it or keeps another)."""
    if bandwidth_mbit is None:
        return None
    if isinstance(bandwidth_mbit,
                  bool) or not isinstance(bandwidth_mbit, (int, float)):
        raise TypeError(
            'bandwidth_mbit should be a number of Mbit/s or None (not '
            f'shaped), but got {type(bandwidth_mbit).__name__} '
            f'{bandwidth_mbit!r}')
    if not (math.isfinite(bandwidth_mbit) and bandwidth_mbit > 0):
        raise ValueError(
            'bandwidth_mbit should be a finite number of Mbit/s > 0, or '
            f'None for links that are not shaped, but got {bandwidth_mbit}')
    if not MIN_RATE_MBIT <= bandwidth_mbit <= MAX_RATE_MBIT:
        raise ValueError(
            f'bandwidth_mbit should be from {MIN_RATE_MBIT:g} to '
            f'{MAX_RATE_MBIT:g} Mbit/s (what tc\'s tbf shapes as given), or '
            f'None for links that are not shaped, but got {bandwidth_mbit}')
    return float(bandwidth_mbit)


def shape_links(links: Sequence[Tuple[str, str]],
                bandwidth_mbit: Optional[float]) -> None:
    """Put a tbf of ``bandwidth_mbit`` on each ``(namespace, device)`` of
    ``links`` (replacing what is there), or with None remove it.

    A function of names, not of a cluster object, so that a process
    running on a node (a benchmark's rank 0) can change the rate of the
    cluster it runs in.

    Raises:
        TypeError, ValueError: A bad ``bandwidth_mbit``.
        ClusterError: ``tc`` failed to shape a link.
    """
    rate = check_bandwidth(bandwidth_mbit)
    for ns, dev in links:
        if rate is None:
            # Fails harmlessly where nothing was shaped.
            run_command(['tc', '-n', ns, 'qdisc', 'del', 'dev', dev, 'root'],
                        check=False)
            continue
        run_command([
            'tc', '-n', ns, 'qdisc', 'replace', 'dev', dev, 'root', 'tbf',
            'rate', f'{int(round(rate * 1e6))}bit', 'burst',
            str(tbf_burst_bytes(rate)), 'latency', f'{TBF_LATENCY_MS}ms'
        ])


def tbf_burst_bytes(bandwidth_mbit: float) -> int:
    """tbf's bucket for a rate: :data:`TBF_BURST_BYTES`, or
    :data:`TBF_BURST_MS` of the rate where that is more."""
    return max(TBF_BURST_BYTES,
               int(bandwidth_mbit * 1e6 / 8 * TBF_BURST_MS / 1000))


def format_mbit(mbit: float) -> str:
    """A rate for a message, e.g. ``100 Mbit/s``."""
    return f'{mbit:g} Mbit/s'
