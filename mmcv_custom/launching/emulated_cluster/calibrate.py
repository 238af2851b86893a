"""What a plain gloo ``all_reduce`` achieves across the emulated links:
the most a communication hook can hope for there.
"""
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import IO, Optional, Tuple

from . import calibration_rank
from .calibration_rank import CALIBRATION_FLAG
from .cluster import EmulatedCluster
from .programs import program_argv
from .run import DEFAULT_PORT, NodesFailed, run_on_nodes
from .shaping import format_mbit

__all__ = ['Calibration', 'calibrate']


@dataclass(frozen=True)
class Calibration:
    """What a gloo ``all_reduce`` achieved across the emulated nodes.

    Attributes:
        nodes (int): Ranks, one per node.
        size_bytes (int): The fp32 tensor reduced.
        times (tuple): Seconds per timed all_reduce (the slowest rank's).
        bandwidth_mbit (float, optional): The set link rate; None when
            not shaped.
    """
    nodes: int
    size_bytes: int
    times: Tuple[float, ...]
    bandwidth_mbit: Optional[float]

    @property
    def seconds(self) -> float:
        """The median time of one all_reduce."""
        return statistics.median(self.times)

    @property
    def busbw_mbit(self) -> float:
        """Bus bandwidth in Mbit/s, as nccl-tests define it for
        all_reduce: ``size * 2 (n - 1) / n / time``, the rate each rank's
        link carries in each direction with a ring algorithm, so it is
        directly comparable with the set link rate."""
        factor = 2 * (self.nodes - 1) / self.nodes
        return self.size_bytes * factor * 8 / self.seconds / 1e6

    @property
    def ratio(self) -> Optional[float]:
        """Bus bandwidth over the set rate; None when not shaped."""
        if self.bandwidth_mbit is None:
            return None
        return self.busbw_mbit / self.bandwidth_mbit

    def describe(self) -> str:
        """One line for the tool's header."""
        line = (f'calibration: gloo all_reduce of {self.size_bytes / 2**20:g}'
                f' MiB fp32, {self.nodes} ranks (one per node), median of '
                f'{len(self.times)}: {self.seconds:.3f} s, bus bandwidth '
                f'{self.busbw_mbit:.1f} Mbit/s')
        if self.bandwidth_mbit is None:
            return line + ' (links not shaped)'
        return (line + f' = {self.ratio:.2f} x the set '
                f'{format_mbit(self.bandwidth_mbit)}')


def calibrate(cluster: EmulatedCluster,
              *,
              size_mib: float = 16,
              warmup: int = 2,
              iters: int = 5,
              port: int = DEFAULT_PORT,
              timeout: Optional[float] = None,
              python: Optional[str] = None,
              stream: Optional[IO[str]] = None) -> Calibration:
    """Measure a plain gloo all_reduce across the emulated nodes.

    One rank per node (``RANK=NODE_RANK``, ``WORLD_SIZE=NNODES``, gloo on
    the node's interface) all-reduces an fp32 tensor of ``size_mib`` MiB
    ``warmup`` times, then ``iters`` times behind a barrier each; each
    iteration counts as its slowest rank. The result is what a hook can
    hope for on these links: the bus bandwidth against the set rate.

    Args:
        cluster (EmulatedCluster): An open cluster.
        size_mib (float): Tensor size in MiB. Defaults to 16. One
            iteration at rate R Mbit/s takes about
            ``size_mib * 8.4 * 2 (n - 1) / n / R`` seconds.
        warmup (int): Untimed iterations. Defaults to 2.
        iters (int): Timed iterations. Defaults to 5.
        port (int): The rendezvous port. Defaults to :data:`DEFAULT_PORT`.
        timeout (float, optional): Seconds before giving up. Defaults to
            None.
        python (str, optional): The interpreter with torch. Defaults to
            None, meaning ``sys.executable``.
        stream (IO[str], optional): Where the nodes' output goes (prefixed
            lines). Defaults to None.

    Returns:
        Calibration: The times and the bus bandwidth.

    Raises:
        ValueError: For a bad ``size_mib``, ``warmup`` or ``iters``.
        NodesFailed: A node failed or the run timed out; the message
            holds the last lines of the failed node's output.
    """
    if not (isinstance(size_mib,
                       (int, float)) and not isinstance(size_mib, bool)
            and math.isfinite(size_mib) and size_mib > 0):
        raise ValueError(f'size_mib should be a number > 0, but got '
                         f'{size_mib!r}')
    for name, value, low in (('warmup', warmup, 0), ('iters', iters, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or (value
                                                                     < low):
            raise ValueError(f'{name} should be an int >= {low}, but got '
                             f'{value!r}')
    numel = max(1, int(size_mib * 2**20) // 4)
    with tempfile.TemporaryDirectory(prefix='mmcvc-calibration-') as tmp:
        out = os.path.join(tmp, 'result.json')
        argv = program_argv(
            calibration_rank.__file__,
            CALIBRATION_FLAG,
            str(numel),
            str(warmup),
            str(iters),
            out,
            python=python)
        result = run_on_nodes(
            cluster,
            argv,
            port=port,
            timeout=timeout,
            log_dir=tmp,
            stream=stream)
        if result.returncode != 0:
            node = (
                result.failed_node if result.failed_node is not None else 0)
            with open(os.path.join(tmp, f'node{node}.log'), 'rb') as f:
                tail = f.read().decode('utf-8', 'replace').splitlines()[-20:]
            raise NodesFailed(
                f'calibration failed: {result.describe()}; last lines of '
                f'node{node}:\n' + '\n'.join(tail), result)
        with open(out) as f:
            times = json.load(f)['times']
    return Calibration(
        nodes=cluster.num_nodes,
        size_bytes=numel * 4,
        times=tuple(times),
        bandwidth_mbit=cluster.bandwidth_mbit)
