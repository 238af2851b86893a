"""What a hook's local work (its codec) costs per bucket: assumed for a GPU
(:class:`GpuCodec`) or as a benchmark measured it (:class:`FittedCodec`).
Standard library only."""
import dataclasses
from abc import ABC, abstractmethod
from typing import Mapping

from .checks import require_positive

__all__ = ['CodecCost', 'GpuCodec', 'FittedCodec']


class CodecCost(ABC):
    """What a hook's local work on one bucket costs, in seconds."""

    @abstractmethod
    def seconds(self, hook, bucket, world_size: int = 1) -> float:
        """The codec time of ``hook`` (a :class:`~.hooks.HookCost`) on
        ``bucket`` (a :class:`~.buckets.Bucket`) on ``world_size``
        ranks."""

    @abstractmethod
    def describe(self) -> str:
        """One sentence for the assumptions of the output."""


@dataclasses.dataclass(frozen=True)
class GpuCodec(CodecCost):
    """Codec cost on a GPU, assumed: memory passes plus matmul FLOPs.

    A hook's elementwise work (division, casts, quantization, error
    feedback) is memory bound: each hook states the bytes of HBM traffic
    per gradient element (:meth:`HookCost.memory_bytes`), read at
    ``hbm_Bps``. PowerSGD's products with its rank-``r`` factors are
    skinny (``r`` columns), far from a GPU's peak, hence their own rate;
    the two times are added (no overlap assumed: an upper bound).

    Args:
        hbm_Bps (float): Effective HBM bandwidth, bytes/s. Defaults to 3e12
            (H100/H200-class: 3.35-4.8 TB/s peak).
        matmul_flops (float): Achieved FLOP/s of the low-rank products.
            Defaults to 5e13 (50 TFLOP/s).
    """
    hbm_Bps: float = 3.0e12
    matmul_flops: float = 5.0e13

    def __post_init__(self) -> None:
        require_positive('hbm_Bps', self.hbm_Bps)
        require_positive('matmul_flops', self.matmul_flops)

    def seconds(self, hook, bucket, world_size=1) -> float:
        return (hook.memory_bytes(bucket, world_size) / self.hbm_Bps +
                hook.flops(bucket, world_size) / self.matmul_flops)

    def describe(self) -> str:
        return (f'codec on the GPU assumed, not measured: memory passes per '
                f'element over {self.hbm_Bps / 1e12:g} TB/s of HBM, PowerSGD'
                f'\'s low-rank products at {self.matmul_flops / 1e12:g} '
                'TFLOP/s, added (no overlap)')


@dataclasses.dataclass(frozen=True)
class FittedCodec(CodecCost):
    """Codec cost measured: seconds per gradient byte, per hook.

    The benchmark times each hook's local work with no network
    (``codec_s``, per step); divided by the step's gradient bytes it scales
    to any bucket. It describes the machine it was measured on (CPU ranks,
    for the emulated nodes), not a GPU.

    Args:
        per_byte (Mapping[str, float]): Hook name -> seconds per gradient
            byte; 0 for hooks not named.
    """
    per_byte: Mapping[str, float]

    def seconds(self, hook, bucket, world_size=1) -> float:
        return self.per_byte.get(hook.name, 0.0) * bucket.nbytes

    def describe(self) -> str:
        return ('codec cost as measured by the benchmark (seconds per '
                'gradient byte; its machine, not a GPU)')
