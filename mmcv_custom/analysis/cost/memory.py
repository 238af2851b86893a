"""Memory per GPU: the parameters, their gradients, AdamW's two moments
and what the communication hook keeps from step to step, so that every
answer of the cost model and ``model_stats.py`` carries it.

Under DDP, its buckets are a second copy of the gradients unless
``gradient_as_bucket_view=True`` (DDP's default is False): 12.56 GiB more
for InternViT-6B, 62.80 GiB before any hook. A hook's state is read from
its record
(:attr:`~mmcv_custom.comm.records.HookRecord.state_bytes`): int8 with
error feedback keeps an fp32 residual per gradient element (6.39e9 x 4 B,
23.79 GiB per GPU for InternViT-6B under DDP), PowerSGD an error in the
gradients' dtype plus its warm-start factors; fp16, bf16 and the plain
all-reduce keep none. Under FSDP2's full sharding the hooks' forms keep
none; under its hybrid sharding int8 keeps the residual of the rank's
shard only (about 1/G of DDP's on nodes of G GPUs, FSDP2's padding aside:
2.99 GiB for InternViT-6B on 8 in fp32, 1.49 GiB with
``residual_dtype='bfloat16'``), beside parameters, gradients and moments
sharded over the node. A plugin's record without ``state_bytes``
is unknown (None), never counted as 0. Activations are not counted: what
is left of the card is their room. Standard library only.
"""
import dataclasses
from typing import Any, Mapping, Optional, Sequence

__all__ = [
    'GiB', 'STRATEGIES', 'GpuMemory', 'hook_state_bytes', 'ddp_memory',
    'sharded_memory', 'hybrid_memory', 'hook_memory', 'fitting_variant'
]

GiB = 2**30

#: What :func:`hook_state_bytes` counts for: DDP, FSDP2's full sharding
#: and its hybrid sharding (the state of the rank's shard: int8's residual
#: is 1/G of DDP's, on a node of G GPUs).
STRATEGIES = ('ddp', 'fsdp2', 'hybrid')


def hook_state_bytes(record,
                     buckets: Sequence,
                     state_kwargs: Optional[Mapping[str, Any]] = None,
                     strategy: str = 'ddp') -> Optional[int]:
    """Bytes a hook's state keeps on each GPU from step to step.

    Args:
        record (HookRecord): The hook's record.
        buckets (Sequence[Bucket]): The trainable gradients the state is
            kept for: in DDP's buckets (:func:`~.buckets.ddp_buckets`), or,
            under ``'hybrid'``, the rank's shards
            (:meth:`~.hybrid.HybridCost.state_buckets`).
        state_kwargs (Mapping, optional): The state's settings (the config's
            ``comm_hook`` keys); those left out take the state's defaults.
        strategy (str): ``'ddp'``, ``'fsdp2'`` (full sharding) or
            ``'hybrid'`` (hybrid sharding), see :data:`STRATEGIES`.
            Defaults to ``'ddp'``.

    Returns:
        int or None: The bytes; None where the record states none
        (unknown).

    Raises:
        ValueError: ``strategy`` is not one of :data:`STRATEGIES`, or the
            hook has no FSDP2 form under ``'fsdp2'`` or ``'hybrid'``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f'strategy should be one of {STRATEGIES}, but got '
                         f'{strategy!r}')
    if strategy != 'ddp' and record.fsdp2_form is None:
        under = 'hybrid sharding' if strategy == 'hybrid' else 'FSDP2'
        raise ValueError('the hook has no FSDP2 form, so no state under '
                         f'{under} to count')
    if strategy == 'fsdp2':
        # Both FSDP2 forms (an averaging reduce-scatter, int8 without error
        # feedback) keep nothing between steps.
        return 0
    if record.state_bytes is None:
        return None
    return int(record.state_bytes(buckets, dict(state_kwargs or {})))


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """Bytes on one GPU, activations aside.

    Attributes:
        param_bytes, grad_bytes, optim_bytes (int): The parameters (all of
            them, frozen too), the trainable ones' gradients and AdamW's two
            moments (in the parameters' dtype), or this rank's shards of
            them under FSDP2.
        state_bytes (int, optional): The hook's state; None: unknown.
        gathered_bytes (int): Under FSDP2, the units gathered at once
            (:func:`mmcv_custom.analysis.model_stats.fsdp2_memory`); 0 under
            DDP.
        bucket_bytes (int): Under DDP, its buckets: a second copy of the
            gradients unless ``gradient_as_bucket_view=True`` makes the
            gradients views of them (DDP's default is False).
        transient_bytes (int): What a periodic hook's synchronisation
            allocates at once after the optimizer step, when the
            activations are freed: not in :attr:`total` (not kept, and not
            beside the activations) but in :meth:`fits`. Defaults to 0.
    """
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    state_bytes: Optional[int]
    gathered_bytes: int = 0
    bucket_bytes: int = 0
    transient_bytes: int = 0

    @property
    def total(self) -> Optional[int]:
        """Everything counted; None where the hook's state is unknown."""
        if self.state_bytes is None:
            return None
        return (self.param_bytes + self.grad_bytes + self.optim_bytes +
                self.gathered_bytes + self.bucket_bytes + self.state_bytes)

    def fits(self, gpu_bytes: float) -> Optional[bool]:
        """Whether it fits a card of ``gpu_bytes`` (None: unknown), its
        synchronisation's buffers (:attr:`transient_bytes`) included."""
        total = self.total
        return (None if total is None else total +
                self.transient_bytes <= gpu_bytes)

    def describe(self) -> str:
        """The total and its parts, in GiB."""
        parts = [('parameters', self.param_bytes),
                 ('gradients', self.grad_bytes),
                 ('AdamW moments', self.optim_bytes)]
        if self.gathered_bytes:
            parts.append(('gathered', self.gathered_bytes))
        if self.bucket_bytes:
            parts.append(('DDP buckets', self.bucket_bytes))
        text = ', '.join(f'{k} {v / GiB:.2f} GiB' for k, v in parts)
        if self.state_bytes is None:
            return f'unknown ({text}; hook state unknown)'
        sync = (f'; and {self.transient_bytes / GiB:.2f} GiB more at once '
                'in its synchronisation, after the optimizer step'
                if self.transient_bytes else '')
        return (f'{self.total / GiB:.2f} GiB ({text}, hook state '
                f'{self.state_bytes / GiB:.2f} GiB{sync})')


def ddp_memory(param_bytes: int,
               buckets: Sequence,
               record,
               state_kwargs: Optional[Mapping[str, Any]] = None,
               bucket_view: bool = False) -> GpuMemory:
    """Per GPU under DDP: every parameter, the gradients of the trainable
    ones (``buckets``), AdamW's two moments, DDP's buckets (unless
    ``bucket_view``: ``gradient_as_bucket_view=True``) and the hook's
    state (None for ``record`` None: unknown)."""
    grads = sum(b.numel * b.itemsize for b in buckets)
    state = (None if record is None else hook_state_bytes(
        record, buckets, state_kwargs))
    return GpuMemory(
        param_bytes,
        grads,
        2 * grads,
        state,
        bucket_bytes=0 if bucket_view else grads)


def sharded_memory(shards: Mapping[str, int], record) -> GpuMemory:
    """Per GPU under FSDP2's full sharding, from
    :func:`~mmcv_custom.analysis.model_stats.fsdp2_memory`'s dict (the
    fullest rank), with the hook's FSDP2 form's state."""
    return GpuMemory(shards['param_bytes'], shards['grad_bytes'],
                     shards['optim_bytes'],
                     hook_state_bytes(record, (), None,
                                      'fsdp2'), shards['gathered_bytes'])


def hybrid_memory(shards: Mapping[str, int], record,
                  state_kwargs: Optional[Mapping[str, Any]],
                  state_buckets: Sequence) -> GpuMemory:
    """Per GPU under FSDP2's hybrid sharding: ``shards`` is
    :func:`~mmcv_custom.analysis.model_stats.fsdp2_memory`'s dict over the
    node's ranks (parameters, gradients and moments sharded over them),
    and the hook's state is kept for the rank's shard
    (``state_buckets``: int8's residual with error feedback, in fp32, or
    in bf16 where ``state_kwargs`` has ``residual_dtype='bfloat16'``)."""
    return GpuMemory(
        shards['param_bytes'], shards['grad_bytes'], shards['optim_bytes'],
        hook_state_bytes(record, state_buckets, state_kwargs, 'hybrid'),
        shards['gathered_bytes'])


def hook_memory(hook, buckets: Sequence, facts: Mapping) -> GpuMemory:
    """The memory per GPU of a :class:`~.hooks.HookCost` (any form: the
    two-level forms keep what the flat one does, int8's whole residual,
    PowerSGD's factors at most; hybrid sharding's,
    :class:`~.hybrid.HybridCost`, the state of the rank's shard), for a
    config's ``facts`` (:func:`~.model.config_params`'s, with
    ``world_size`` under FSDP2, and ``ranks_per_node`` under hybrid
    sharding). A hook cost without a record has an unknown state; one
    that counts its own (a periodic hook's ``gpu_memory``: the state of
    its slice, its inner hook's and its synchronisation's buffers) gives
    it."""
    own = getattr(hook, 'gpu_memory', None)
    if own is not None:
        return own(buckets, facts)
    flat = getattr(hook, 'flat', hook)
    record = getattr(flat, 'record', None)
    if getattr(hook, 'sharding', None) == 'hybrid':
        return hybrid_memory(facts['fsdp2_node_memory'], record,
                             hook.state_kwargs,
                             hook.state_buckets(facts['fsdp2_units']))
    if facts.get('fsdp2'):
        return sharded_memory(facts['fsdp2_memory'], record)
    return ddp_memory(facts['param_bytes'], buckets, record,
                      getattr(flat, 'settings', None),
                      bool(facts.get('gradient_as_bucket_view')))


def fitting_variant(record, settings: Mapping, buckets: Sequence,
                    memory: GpuMemory, gpu_bytes: float):
    """The first of the record's variants (the settings the convergence
    comparison trains it under, e.g. int8 without error feedback) whose
    state makes ``memory`` fit ``gpu_bytes``: ``(variant, its memory)``,
    or None."""
    if record is None:
        return None
    for variant in record.variants:
        state = hook_state_bytes(record, buckets,
                                 dict(settings, **variant.options))
        if state is None or state >= (memory.state_bytes or 0):
            continue
        fitted = dataclasses.replace(memory, state_bytes=state)
        if fitted.fits(gpu_bytes):
            return variant, fitted
    return None
