"""How large one save of a run is (weights, optimizer state, every rank's
hook state file), estimated from the model built on the meta device.

Under FSDP2 the hooks' state files are written under hybrid sharding only:
``int8_compress`` with error feedback keeps, on every rank, the residual of
its shard (4 bytes a value, 2 with ``residual_dtype='bfloat16'``), saved
beside each checkpoint. Whether the run shards hybrid is decided as the
strategy decides it, on the layout the launcher's environment states.
"""
import copy
import warnings
from typing import NamedTuple, Optional

from mmengine.config import Config

from ...hooks.util import ceil_div
from ..cpu_start import uses_fsdp2
from .config_values import checked_comm_hook
from .strategy import plan_at_start

__all__ = [
    'CheckpointSize', 'checkpoint_size', 'estimate_checkpoint_bytes',
    'format_size'
]

_GIB = 1024**3

#: Optimizer states per trainable parameter, each of its size, that a
#: checkpoint saves (SGD: its momentum buffer, when momentum is set).
_OPTIMIZER_STATES = {
    'Adam': 2,
    'AdamW': 2,
    'Adamax': 2,
    'NAdam': 2,
    'RAdam': 2,
    'Adadelta': 2,
    'Adagrad': 1,
    'RMSprop': 1,
}


def _optimizer_states(cfg: Config, saved_only: bool = True) -> int:
    """Tensors the checkpoint saves per trainable parameter for the
    optimizer (0 when unknown: the estimate stays a lower bound; 0 too
    where the CheckpointHook saves no optimizer, unless ``saved_only`` is
    False: the periodic hooks' files keep it whatever that says)."""
    checkpoint_hook = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    if saved_only and checkpoint_hook.get('save_optimizer', True) is False:
        return 0
    optimizer = (cfg.get('optim_wrapper') or {}).get('optimizer') or {}
    kind = optimizer.get('type', '')
    name = kind if isinstance(kind, str) else getattr(kind, '__name__', '')
    name = name.split('.')[-1]
    if name == 'SGD':
        return 1 if optimizer.get('momentum') else 0
    return _OPTIMIZER_STATES.get(name, 0)


class CheckpointSize(NamedTuple):
    """What one save of a run writes, in bytes (see
    :func:`checkpoint_size`)."""
    weights: int  # parameters and buffers, in their dtypes
    optimizer: int  # the optimizer's state per trainable parameter
    hook_state: int  # every rank's communication-hook state file

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.hook_state

    def describe(self) -> str:
        parts = [f'weights {format_size(self.weights)}']
        if self.optimizer:
            parts.append(f'optimizer state {format_size(self.optimizer)}')
        if self.hook_state:
            parts.append('communication-hook state files '
                         f'{format_size(self.hook_state)}')
        return ', '.join(parts)


def format_size(size: float) -> str:
    """``size`` bytes for a message: GiB from 1 GiB, MiB below (so that a
    small model's checkpoint is not "0.0 GiB")."""
    if size >= _GIB:
        return f'{size / _GIB:.1f} GiB'
    return f'{size / 2**20:.1f} MiB'


def _hybrid_ranks_per_node(cfg: Config, launcher: str) -> Optional[int]:
    """The ranks of a node where ``cfg``'s FSDP2Strategy shards hybrid on
    the layout ``launcher``'s environment states (the strategy's own
    :func:`~.strategy.plan_at_start`, the ranks' own decision); None where it
    shards over every rank, or where the layout or the arguments cannot
    hold (the strategy check says why). ``'auto'`` also weighs the GPU's
    memory at start, which is not known here: counted as hybrid wherever
    the layout allows it, the larger save."""
    plan = plan_at_start(cfg, launcher)
    return plan.layout.ranks_per_node if plan is not None and (
        plan.hybrid) else None


def _hybrid_state_bytes(checked, params, ranks_per_node: int) -> int:
    """One rank's hook state file under hybrid sharding: int8's error
    feedback of its shard (each trainable parameter's rows split over the
    node's ranks, rounded up as FSDP2 pads them: the fullest rank's), in
    its ``residual_dtype``; nothing for the other hooks."""
    from ...comm.sharded import build_sharded_comm
    spec = build_sharded_comm(checked, hybrid=True)
    if not spec.error_feedback:
        return 0
    shard = 0
    for p in params:
        if p.requires_grad and p.numel():
            rows = p.shape[0] if p.dim() else 1
            shard += ceil_div(rows, ranks_per_node) * (p.numel() // rows)
    return shard * spec.residual_dtype.itemsize


def _hook_state_bytes(cfg: Config,
                      params,
                      world_size: int,
                      launcher: str = 'none',
                      checked=None) -> int:
    """Every rank's hook state file for one save: the keeper of the
    ``comm_hook``'s record says how large one is (no table by hook); under
    FSDP2, only hybrid sharding's int8 error feedback
    (:func:`_hybrid_state_bytes`). ``checked``: the config as the
    preflight checked it (None: checked here; a problem counts 0, said
    as a comm_hook problem)."""
    if checked is None:
        checked, _ = checked_comm_hook(cfg, launcher)
    if checked is None or checked.type == 'auto':
        return 0
    if uses_fsdp2(cfg):
        per_node = _hybrid_ranks_per_node(cfg, launcher)
        if per_node is None:
            return 0
        return world_size * _hybrid_state_bytes(checked, params, per_node)
    keeper = checked.record.state_keeper
    if keeper is None:
        return 0
    if checked.record.periodic:
        return world_size * _periodic_state_bytes(cfg, checked, params,
                                                  world_size, launcher)
    return world_size * keeper.file_bytes(params, dict(checked.state_kwargs))


class _Slice(NamedTuple):
    """A rank's slice of the flat parameters, as a record's
    ``state_bytes`` reads a bucket."""
    numel: int
    itemsize: int = 4


def _periodic_state_bytes(cfg: Config, checked, params, world_size: int,
                          launcher: str) -> int:
    """One rank's file for ``post_local_sgd``/``diloco``: its own
    parameters and optimizer state (every rank's differ within a period),
    the algorithm's state of its slice of the node (its record's
    ``state_bytes``: DiLoCo's fp32 global parameters, momentum and error
    feedback; the node's ranks split them, on the launcher's layout or the
    one the config states), and the inner exchange's state once for each
    exchange it keeps (inside the node with several ranks a node; over
    every rank during ``start_iter``)."""
    from ...comm.local_sgd import periodic_ranks_per_node
    from ...engine.process_group import LAUNCH_ENV, launcher_layout
    launched = (
        launcher_layout(launcher)[1] if launcher in LAUNCH_ENV else None)
    per_node = periodic_ranks_per_node(checked, world_size, launched)
    kwargs = dict(checked.state_kwargs)
    record = checked.record
    total = record.state_keeper.file_bytes(
        params, kwargs, optimizer_states=_optimizer_states(cfg, False))
    values = sum(p.numel() for p in params if p.requires_grad)
    total += record.state_bytes([_Slice(ceil_div(values, per_node))], kwargs)
    inner = checked.inner
    inner_keeper = None if inner is None else inner.record.state_keeper
    if inner_keeper is not None:
        copies = (per_node > 1) + (kwargs.get('start_iter', 0) > 0)
        total += copies * inner_keeper.file_bytes(params,
                                                  dict(inner.state_kwargs))
    return total


def checkpoint_size(cfg: Config,
                    world_size: int = 1,
                    launcher: str = 'none',
                    comm_hook=None) -> Optional[CheckpointSize]:
    """About how large one save of ``cfg``'s run is: the model's
    parameters and buffers in their dtypes, the optimizer's state per
    trainable parameter (two for Adam/AdamW), and the state file every one
    of ``world_size`` ranks writes beside it for a stateful ``comm_hook``
    (int8's and PowerSGD's error feedback; under FSDP2, int8's of each
    rank's shard where ``launcher``'s layout shards hybrid).

    The model is built on the meta device, so no memory is allocated
    (InternViT-6B: about a second). Returns None when it cannot be built
    that way; the caller then checks nothing. ``comm_hook``: the config's,
    as the preflight checked it (a ``CommHookConfig``); None: checked
    here.
    """
    model_cfg = cfg.get('model')
    if not isinstance(model_cfg, dict):
        return None
    try:
        import torch
        from mmengine.registry import MODELS
        with warnings.catch_warnings():
            # The real build shows them again.
            warnings.simplefilter('ignore')
            with MODELS.switch_scope_and_registry(
                    cfg.get('default_scope')) as registry:
                with torch.device('meta'):
                    model = registry.build(copy.deepcopy(model_cfg))
        params = list(model.parameters())
        size = sum(p.numel() * p.element_size() for p in params)
        size += sum(b.numel() * b.element_size() for b in model.buffers())
        trainable = sum(p.numel() * p.element_size() for p in params
                        if p.requires_grad)
    except Exception:
        return None
    return CheckpointSize(
        size,
        _optimizer_states(cfg) * trainable,
        _hook_state_bytes(cfg, params, world_size, launcher, comm_hook))


def estimate_checkpoint_bytes(cfg: Config,
                              world_size: int = 1,
                              launcher: str = 'none') -> Optional[int]:
    """:func:`checkpoint_size`'s total; None where it is unknown."""
    size = checkpoint_size(cfg, world_size, launcher)
    return None if size is None else size.total
