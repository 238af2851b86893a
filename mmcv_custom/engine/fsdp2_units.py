"""What :class:`~mmcv_custom.engine.fsdp2_strategy.FSDP2Strategy` shards,
and with which policy: its ``mp_policy`` argument checked and turned into
FSDP2's ``MixedPrecisionPolicy``, the units it shards (shared with
``tools/analysis_tools/model_stats.py``, which counts what each unit
gathers) and the broadcast of rank 0's buffers that stands in for DDP's.

Kept apart from the strategy so that a tool can ask what would be sharded
without the runner's machinery, and from the checkpoint code
(:mod:`~mmcv_custom.engine.fsdp2_checkpoint`), which is about files.
"""
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    'DEFAULT_SHARD_MODULES', 'parse_mp_policy', 'select_units',
    'unit_parameters', 'broadcast_rank0_buffers'
]

_DTYPES = {
    'float32': torch.float32,
    'bfloat16': torch.bfloat16,
    'float16': torch.float16
}
# What select_units shards when the config names nothing.
DEFAULT_SHARD_MODULES = ('InternViTBlock', 'InternViT')


def parse_mp_policy(mp_policy: Optional[dict]):
    """FSDP2's ``MixedPrecisionPolicy`` for ``FSDP2Strategy``'s
    ``mp_policy`` argument (None: compute in the parameters' own dtype).

    Raises:
        ValueError: ``reduce_dtype`` is given (the ``comm_hook`` key
            chooses it), or a dtype is not one of ``float32``,
            ``bfloat16``, ``float16``.
        TypeError: ``mp_policy`` is not a dict, has unknown keys, or
            ``cast_forward_inputs`` is not a bool.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if not isinstance(mp_policy, dict):
        raise TypeError('FSDP2Strategy mp_policy should be a dict such as '
                        "dict(param_dtype='bfloat16'), but got "
                        f'{type(mp_policy).__name__}: {mp_policy!r}')
    mp_policy = dict(mp_policy)
    if 'reduce_dtype' in mp_policy:
        raise ValueError(
            'FSDP2Strategy mp_policy: reduce_dtype is set by the comm_hook '
            "key, the one place that chooses how gradients are reduced: "
            "e.g. comm_hook = dict(type='bf16_compress') sends bf16, "
            "dict(type='allreduce') the gradients' own dtype. Remove "
            f"reduce_dtype={mp_policy['reduce_dtype']!r}.")
    known = ('param_dtype', 'output_dtype', 'cast_forward_inputs')
    unknown = sorted(set(mp_policy) - set(known))
    if unknown:
        raise TypeError(f'FSDP2Strategy mp_policy got unknown keys '
                        f'{unknown}; valid keys: {list(known)}')
    kwargs = {}
    for key in ('param_dtype', 'output_dtype'):
        value = mp_policy.get(key)
        if value is None:
            continue
        if value not in _DTYPES:
            raise ValueError(f'FSDP2Strategy mp_policy {key} should be one '
                             f'of {sorted(_DTYPES)} or None, but got '
                             f'{value!r}')
        kwargs[key] = _DTYPES[value]
    if 'cast_forward_inputs' in mp_policy:
        value = mp_policy['cast_forward_inputs']
        if not isinstance(value, bool):
            raise TypeError('FSDP2Strategy mp_policy cast_forward_inputs '
                            f'should be True or False, but got {value!r}')
        kwargs['cast_forward_inputs'] = value
    return MixedPrecisionPolicy(**kwargs)


def select_units(
        model: nn.Module,
        shard_modules: Optional[Sequence[Union[str, type]]] = None) -> list:
    """The modules :class:`FSDP2Strategy` shards as units of their own.

    Every module of ``model`` (not the model itself) whose class is in
    ``shard_modules``, by class or class name; None means InternViT's
    blocks and the InternViT backbone where the model has them. Shared
    with ``tools/analysis_tools/model_stats.py``, which counts what each
    unit gathers.

    Returns:
        list[tuple[str, nn.Module]]: ``(name, module)``, children before
        their parents (the order to shard them in).

    Raises:
        ValueError: An entry of an explicit ``shard_modules`` matches no
            module; the message lists the model's module classes.
    """
    explicit = shard_modules is not None
    wanted = tuple(shard_modules) if explicit else DEFAULT_SHARD_MODULES

    def matches(module, spec):
        if isinstance(spec, type):
            return isinstance(module, spec)
        return type(module).__name__ == spec

    found = {spec: 0 for spec in wanted}
    units = []
    for name, module in model.named_modules():
        if module is model:
            continue
        for spec in wanted:
            if matches(module, spec):
                found[spec] += 1
                units.append((name, module))
                break
    missing = [
        s if isinstance(s, str) else s.__name__ for s, n in found.items()
        if n == 0
    ]
    if explicit and missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f'FSDP2Strategy shard_modules {missing} match no module of '
            f'the model; its module classes are: {", ".join(present)}')
    # named_modules() is parents first: shard the deepest first.
    return units[::-1]


def unit_parameters(model: nn.Module, units: list) -> list:
    """What each unit of ``units`` (:func:`select_units`' order) and then
    the root gathers and reduces: its parameters not in a unit below it.

    Returns:
        list[tuple[str, nn.Module, list]]: ``(name, module, [(parameter
        name within the module, parameter), ...])``, the root last with
        name ``''``.
    """
    claimed = set()
    out = []
    for name, module in units + [('', model)]:
        own = [(n, p) for n, p in module.named_parameters()
               if id(p) not in claimed]
        claimed.update(id(p) for _, p in own)
        out.append((name, module, own))
    return out


def broadcast_rank0_buffers(module: nn.Module, *args) -> None:
    """Give every rank rank 0's buffers: one broadcast per dtype. A forward
    pre-hook of the root, and run before each save."""
    by_dtype = {}
    for buffer in module.buffers():
        if buffer.numel():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.broadcast(flat, src=0)
        for buffer, value in zip(buffers,
                                 flat.split([b.numel() for b in buffers])):
            buffer.copy_(value.view_as(buffer))
