"""The compute a GPU does per step, estimated from FLOPs, for projections
without a measured backward. Standard library only."""
import dataclasses
from typing import Optional, Sequence, Tuple

from .buckets import ParamSpec
from .checks import require_positive
from .codecs import GpuCodec

__all__ = ['Workload', 'estimate_compute']


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a GPU computes per step, to estimate the compute time.

    The defaults are InternViT-6B's UperNet recipe: 504 x 504 crops in
    14-pixel patches (36 x 36 = 1296 tokens an image), 2 images per GPU.
    (At 448 px it would be 2 x 32^2 = 2048 tokens.)

    Args:
        tokens_per_gpu (float): Tokens per GPU and step. Defaults to 2592.
        achieved_flops (float): Achieved FLOP/s of the model's matmuls.
            Defaults to 4e14 (about 40% of an H100/H200's 989 TFLOP/s
            dense bf16).
        recompute (bool): Activation checkpointing recomputes the forward
            in the backward (the 6B recipe's ``with_cp=True``). Defaults
            to True.
    """
    tokens_per_gpu: float = 2 * 36 * 36
    achieved_flops: float = 4.0e14
    recompute: bool = True

    def __post_init__(self) -> None:
        require_positive('tokens_per_gpu', self.tokens_per_gpu)
        require_positive('achieved_flops', self.achieved_flops)


def estimate_compute(
        params: Sequence[ParamSpec],
        workload: Workload,
        total_params: Optional[int] = None,
        hbm_Bps: float = GpuCodec().hbm_Bps,
        forward_flops: Optional[float] = None) -> Tuple[float, float]:
    """Backward and whole-step compute time from FLOPs.

    The backward costs about twice the forward's FLOPs, plus one more
    forward with activation checkpointing. The forward is
    ``forward_flops`` where the model's were counted
    (:func:`~.model.forward_flops`); else a transformer's ``2 N T``
    (``N`` parameters, ``T`` tokens). The optimizer (AdamW)
    is memory bound: it reads and writes the parameter and both moments and
    reads the gradient, 7 passes of each trainable parameter's dtype. The
    heads' convolutions, run at finer resolutions than the ViT's tokens,
    are not counted by ``N T``: an underestimate for UperNet.

    Args:
        params (Sequence[ParamSpec]): The trainable parameters.
        workload (Workload): Tokens and FLOP/s.
        total_params (int, optional): All parameters, frozen included, for
            the FLOPs. Defaults to the trainable ones.
        hbm_Bps (float): For the optimizer. Defaults to :class:`GpuCodec`'s.
        forward_flops (float, optional): The forward's FLOPs per GPU and
            step, counted. Defaults to None: ``2 N T``.

    Returns:
        tuple[float, float]: ``(backward_s, compute_step_s)``.
    """
    if forward_flops is None:
        n = total_params if total_params is not None else sum(p.numel
                                                              for p in params)
        forward_flops = 2 * n * workload.tokens_per_gpu
    else:
        require_positive('forward_flops', forward_flops)
    forward = forward_flops / workload.achieved_flops
    backward = (2 + workload.recompute) * forward
    optimizer = 7 * sum(p.nbytes for p in params) / hbm_Bps
    return backward, forward + backward + optimizer
