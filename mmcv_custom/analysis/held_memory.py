"""What a rank actually holds, measured on live tensors: the counterpart of
:mod:`mmcv_custom.analysis.model_stats`' predictions.

``tools/analysis_tools/benchmark_fsdp2.py`` measures DDP and FSDP2 with
these on gloo ranks.
"""
import torch

__all__ = ['held_bytes', 'GatheredPeak']


def _local_bytes(tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (a DTensor's local shard)."""
    if hasattr(tensor, 'to_local'):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def held_bytes(params, optimizer) -> dict:
    """Bytes this rank holds for ``params``, their gradients and
    ``optimizer``'s state, counting local shards only.

    Args:
        params (Iterable[Tensor]): Parameters, plain or FSDP2's ``DTensor``
            shards.
        optimizer (torch.optim.Optimizer): Their optimizer.

    Returns:
        dict: ``param_bytes``, ``grad_bytes`` (of the gradients present
        now), ``optim_bytes`` (every tensor of ``optimizer.state``) and,
        of those, ``optim_step_bytes`` (the ``step`` counters).
    """
    params = list(params)
    out = dict(
        param_bytes=sum(_local_bytes(p) for p in params),
        grad_bytes=sum(
            _local_bytes(p.grad) for p in params if p.grad is not None),
        optim_bytes=0,
        optim_step_bytes=0)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                out['optim_bytes'] += _local_bytes(value)
                if key == 'step':
                    out['optim_step_bytes'] += _local_bytes(value)
    return out


class GatheredPeak:
    """Most bytes of whole (gathered) parameters registered on an FSDP2
    model at once, sampled at every operator of a forward and backward.

    FSDP2 registers a unit's unsharded parameters on its modules while it
    runs, and the ``DTensor`` shards otherwise, so the plain tensors among
    ``model.parameters()`` are what is gathered at that moment. A unit
    being prefetched is not seen: its all-gather output becomes its
    parameters only when it runs.

    Args:
        model (nn.Module): A model sharded by ``fully_shard`` (e.g. by
            :class:`~mmcv_custom.engine.FSDP2Strategy`), with MMEngine's
            ``data_preprocessor`` and ``parse_losses``.
    """

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode
        peak = self

        class _Mode(TorchDispatchMode):

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                peak.sample()
                return func(*args, **(kwargs or {}))

        self.model = model
        self.peak = 0
        self.mode = _Mode()

    def sample(self):
        """Take the bytes gathered now into the peak."""
        now = sum(p.numel() * p.element_size()
                  for p in self.model.parameters()
                  if not hasattr(p, 'to_local'))
        self.peak = max(self.peak, now)

    def step(self, batch, optim_wrapper) -> int:
        """One training step of the model, sampled; returns the peak."""
        data = self.model.data_preprocessor(batch, True)
        with self.mode:
            losses = self.model(**data, mode='loss')
            loss, _ = self.model.parse_losses(losses)
            loss.backward()
        optim_wrapper.step()
        optim_wrapper.zero_grad()
        return self.peak
