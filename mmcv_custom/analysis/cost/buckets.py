"""A model as DDP sees it: parameters (:class:`ParamSpec`, shapes and
dtypes, so that a projection needs no measurement of the model) and the
gradient buckets DDP lays them out in (:func:`ddp_buckets`). Standard
library only."""
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from .checks import require_positive

__all__ = ['MiB', 'DTYPE_BYTES', 'ParamSpec', 'Bucket', 'ddp_buckets']

MiB = 1024 * 1024
DTYPE_BYTES = {'float32': 4, 'bfloat16': 2, 'float16': 2, 'float64': 8}

# DDP's bucket caps (torch.nn.parallel.DistributedDataParallel): 25 MiB,
# and a first bucket of 1 MiB unless bucket_cap_mb is given.
_DEFAULT_BUCKET_CAP_MB = 25.0
_DEFAULT_FIRST_BUCKET_MB = 1.0


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """A trainable parameter as DDP sees it: its shape and dtype.

    Args:
        shape (tuple[int]): The parameter's shape.
        dtype (str): One of :data:`DTYPE_BYTES`; its gradient's dtype,
            hence the bucket's. Defaults to ``'float32'``.
        name (str): For messages only. Defaults to ``''``.
    """
    shape: Tuple[int, ...]
    dtype: str = 'float32'
    name: str = ''

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0
                for d in shape):
            raise ValueError(f'ParamSpec {self.name!r}: shape should hold '
                             f'ints >= 0, but got {self.shape!r}')
        object.__setattr__(self, 'shape', shape)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f'ParamSpec {self.name!r}: dtype should be one of '
                f'{sorted(DTYPE_BYTES)}, but got {self.dtype!r}')

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def matrix(self) -> Tuple[int, int]:
        """``(n, m)``: PowerSGD views a gradient as its first dimension by
        the rest (a 1-d tensor as ``n x 1``, a 0-d one as ``1 x 1``)."""
        n = self.shape[0] if self.shape else 1
        return n, (self.numel // n if n else 0)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One DDP gradient bucket: parameters of one dtype, in bucket order.

    Attributes:
        params (tuple[ParamSpec]): In the order DDP packs them.
        indices (tuple[int]): Their positions in the model's parameter
            list (what ``int8_compress`` numbers its blocks by).
    """
    params: Tuple[ParamSpec, ...]
    indices: Tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def itemsize(self) -> int:
        return self.params[0].itemsize if self.params else 4

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def ddp_buckets(params: Sequence[ParamSpec],
                bucket_cap_mb: Optional[float] = None,
                first_bucket_mb: Optional[float] = None) -> List[Bucket]:
    """Lay parameters out in buckets as DDP does after its first step.

    After the first iteration DDP rebuilds its buckets in the order the
    gradients became ready, which for a feed-forward model is the reverse
    of the parameter order; that is the layout of every later step and the
    one modelled. As DDP's ``compute_bucket_assignment_by_size``: one open
    bucket per dtype; a parameter joins its dtype's bucket, which closes
    once it holds at least the cap (so a parameter larger than the cap
    fills a bucket alone). The first bucket of each dtype has its own cap
    (1 MiB by default: the last layers' gradients go out early). Buckets
    come in the order they closed, then the ones still open at the end
    (each dtype's last), by their first parameter in ready order. (Within
    a layer DDP may order the parameters otherwise, e.g. a norm's weight
    before its bias; no hook's bytes depend on that order.)

    Args:
        params (Sequence[ParamSpec]): Trainable parameters in the model's
            order (``model.parameters()``).
        bucket_cap_mb (float, optional): DDP's ``bucket_cap_mb`` in MiB.
            Defaults to None: 25 MiB, and 1 MiB for the first bucket.
        first_bucket_mb (float, optional): The first bucket's cap. Defaults
            to None: 1 MiB if ``bucket_cap_mb`` is None, else the same as
            ``bucket_cap_mb`` (DDP's rule).

    Returns:
        list[Bucket]: In DDP's order (the order the hook is called in).
    """
    if bucket_cap_mb is None:
        cap = _DEFAULT_BUCKET_CAP_MB
        first = (
            _DEFAULT_FIRST_BUCKET_MB
            if first_bucket_mb is None else first_bucket_mb)
    else:
        cap = bucket_cap_mb
        first = cap if first_bucket_mb is None else first_bucket_mb
    require_positive('bucket_cap_mb', cap)
    require_positive('first_bucket_mb', first)
    limits = (first * MiB, cap * MiB)
    open_buckets: Dict[str, List[int]] = {}
    closed_per_dtype: Dict[str, int] = {}
    done: List[List[int]] = []
    for index in reversed(range(len(params))):
        dtype = params[index].dtype
        current = open_buckets.setdefault(dtype, [])
        current.append(index)
        limit = limits[min(closed_per_dtype.get(dtype, 0), 1)]
        if sum(params[i].nbytes for i in current) >= limit:
            done.append(current)
            open_buckets[dtype] = []
            closed_per_dtype[dtype] = closed_per_dtype.get(dtype, 0) + 1
    done.extend(
        sorted((b for b in open_buckets.values() if b), key=lambda b: -b[0]))
    return [Bucket(tuple(params[i] for i in b), tuple(b)) for b in done]
