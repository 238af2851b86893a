"""The cross-node all-reduce of hybrid sharding (HSDP), in the format a
``comm_hook`` asks for.

Under hybrid sharding each FSDP2 unit is sharded over the ranks of one node
(a 1-D mesh over the node): its gradients are reduce-scattered inside the
node, in full precision over the fast link, and every node ends up with the
same shards, each held by the rank at the same place of every node. What
is left is to average each shard over the nodes: one all-reduce among the
ranks of one place, across the slow link, of ``1 / ranks_per_node`` of the
gradients. FSDP2 runs it where ``FSDPModule.set_all_reduce_hook`` says (on
a 1-D mesh the hook gets the reduce-scatter's output, which it must reduce
in place); this module's objects are those hooks:

* :class:`CrossNodeAllReduce`: the shard averaged in its own dtype, or
  sent in fp16/bf16 (``fp16_compress``, ``bf16_compress``): divided by the
  number of nodes in the shard's precision, then cast once, as the DDP
  hooks do (:mod:`.half`);
* :class:`Int8CrossNodeAllReduce`: the shard as blockwise int8
  (:mod:`.int8_codec`), in the two halves of a ring all-reduce, with error
  feedback by default. A rank's shard is the same slice of the same
  parameters at every step, so the residual of what rounding drops is kept
  per unit, in the shard's layout (:class:`HybridInt8State`), saved beside
  the checkpoints by :class:`HybridInt8StateKeeper` and refused where the
  layout changed.

The all-reduce is exact only in :class:`CrossNodeAllReduce` with the
shard's own dtype, which :func:`install_cross_node` puts on a model the
strategy shards hybrid before any ``comm_hook`` is read: a 1-D mesh without
it would leave every node training on its own gradients.

Like the rest of :mod:`mmcv_custom.hooks`, this module imports only torch.
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import cast, int8_codec
from .half import require_dtype_support, require_wire_dtype, wire_dtype_for
from .int8_plan import Int8Chunks
from .state import HookStateKeeper
from .util import all_gather_single, ceil_div
from .validation import require_bool, require_int

__all__ = [
    'CrossNodeAllReduce', 'Int8CrossNodeAllReduce', 'HybridInt8State',
    'HybridInt8StateKeeper', 'install_cross_node', 'mark_hybrid',
    'cross_node_group', 'fsdp_units'
]

# The attribute of a model's root module that names its cross-node group.
_GROUP_ATTR = '_mmcv_custom_cross_node_group'


def mark_hybrid(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Note on ``model`` (sharded over each node) the group of this rank's
    peers on the other nodes, which :func:`cross_node_group` reads."""
    object.__setattr__(model, _GROUP_ATTR, group)


def cross_node_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The cross-node group :func:`mark_hybrid` noted on ``model``; None
    for a model that is not sharded hybrid."""
    return getattr(model, _GROUP_ATTR, None)


def fsdp_units(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every FSDP2 unit of ``model``, root (``''``)
    included, in module order."""
    from torch.distributed.fsdp import FSDPModule
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, FSDPModule)]


class CrossNodeAllReduce:
    """Average a shard over the nodes in its dtype or in half precision.

    Args:
        group (ProcessGroup): This rank's peers of the same place on every
            node (one rank a node).
        wire_dtype (torch.dtype, optional): ``torch.float16``,
            ``torch.bfloat16``, or None to send the shard as it is (exact).
            A shard already in a 2-byte float is sent as it is.
        counter (object, optional): Anything with ``baseline_bytes`` and
            ``bytes_sent`` (``CommCounter``): each call adds the shard's
            bytes in its own dtype and as sent, the size of the tensor
            all-reduced across nodes (the project's counting rule).
    """

    def __init__(self,
                 group: dist.ProcessGroup,
                 wire_dtype: Optional[torch.dtype] = None,
                 counter=None) -> None:
        require_wire_dtype(wire_dtype)
        self.group = group
        self.wire_dtype = wire_dtype
        self.counter = counter

    def for_unit(self, name: str) -> 'CrossNodeAllReduce':
        """The hook for the unit ``name``: this one (it keeps no state)."""
        return self

    def __call__(self, shard: torch.Tensor) -> None:
        nodes = self.group.size()
        wire = (
            shard.dtype if self.wire_dtype is None else wire_dtype_for(
                self.wire_dtype, shard))
        require_dtype_support(wire, self.group, shard.device)
        if self.counter is not None:
            self.counter.baseline_bytes += shard.numel() * shard.element_size()
            self.counter.bytes_sent += (
                shard.numel() * torch.finfo(wire).bits // 8)
        if wire is shard.dtype:
            dist.all_reduce(shard.mul_(1.0 / nodes), group=self.group)
            return
        # Divide in the shard's precision, then round once.
        sent = cast.compress(shard, nodes, wire)
        dist.all_reduce(sent, group=self.group)
        if shard.dtype is torch.float32:
            cast.decompress(sent, shard)
        else:
            shard.copy_(sent)


class HybridInt8State:
    """Settings and per-unit error feedback of :class:`Int8CrossNodeAllReduce`.

    A unit's shard of ``n`` values is cut into one chunk per node of
    ``ceil(n / nodes)`` values (the last padded with zeros); the rank at
    place ``j`` of the cross-node group owns chunk ``j``. The residual of a
    unit is one value per padded element: what this rank's rounding of
    its ``shard / nodes`` dropped, plus, on its own chunk, what the owner's
    second rounding of the sum dropped (and, for a bf16 shard, the cast of
    the result), so that summed over steps nothing is lost, as in
    :class:`~.int8.Int8State`.

    The residuals may be kept in bf16 (``residual_dtype``): half the memory
    (2 bytes a value of the shard instead of 4), at the price of rounding
    the residual itself to 8 significant bits, about 1/256 of what the int8
    rounding dropped, so the sum above holds only that closely; the
    arithmetic stays in fp32.

    Args:
        block_size (int): Values per fp32 scale. Defaults to 256.
        error_feedback (bool): Keep the residuals. Defaults to True.
        residual_dtype (torch.dtype): ``torch.float32`` or
            ``torch.bfloat16``. Defaults to ``torch.float32``.
    """

    def __init__(self,
                 block_size: int = 256,
                 error_feedback: bool = True,
                 residual_dtype: torch.dtype = torch.float32) -> None:
        require_int('block_size', block_size, minimum=1)
        require_bool('error_feedback', error_feedback)
        if residual_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError('residual_dtype should be torch.float32 or '
                             f'torch.bfloat16, but got {residual_dtype}')
        self.block_size = int(block_size)
        self.error_feedback = error_feedback
        self.residual_dtype = residual_dtype
        # unit name -> residual of its padded shard.
        self.residuals: Dict[str, torch.Tensor] = {}

    def residual(self, unit: str, numel: int,
                 device: torch.device) -> Optional[torch.Tensor]:
        """The residual of ``unit`` (zeros the first time), or None
        without error feedback."""
        if not self.error_feedback:
            return None
        kept = self.residuals.get(unit)
        if kept is None:
            kept = torch.zeros(numel, dtype=self.residual_dtype, device=device)
        elif kept.numel() != numel:
            raise ValueError(
                f'the int8 error feedback of unit {unit or "(root)"} holds '
                f'{kept.numel()} values, its shard now needs {numel}: it '
                'belongs to another layout (HybridInt8StateKeeper refuses '
                'such state on restore)')
        self.residuals[unit] = kept = kept.to(device)
        return kept


class Int8CrossNodeAllReduce:
    """Average a shard over the nodes as blockwise int8 (see the module
    docstring), one object per unit sharing a :class:`HybridInt8State`.

    Every rank scales its shard by ``1 / nodes``, adds its residual and
    quantizes each chunk into one segment per owner (the chunk's fp32
    scales, then its int8 values padded to 4 bytes); ``all_to_all_single``
    gives each owner its chunk from every node, which it sums in fp32 in
    rank order and quantizes again; the owners' segments are all-gathered
    and dequantized into the shard. Sent: the quantized shard once as an
    all-to-all and once as an all-gather, i.e. the size of the quantized
    shard by the counting rule, as a ring all-reduce of it sends.

    Args:
        group (ProcessGroup): As :class:`CrossNodeAllReduce`'s.
        state (HybridInt8State): Settings and residuals.
        counter (object, optional): As :class:`CrossNodeAllReduce`'s.
        unit (str): The unit this object reduces (its residual's key).
    """

    def __init__(self,
                 group: dist.ProcessGroup,
                 state: HybridInt8State,
                 counter=None,
                 unit: str = '') -> None:
        self.group = group
        self.state = state
        self.counter = counter
        self.unit = unit

    def for_unit(self, name: str) -> 'Int8CrossNodeAllReduce':
        """The hook for the unit ``name`` (its own residual)."""
        return Int8CrossNodeAllReduce(self.group, self.state, self.counter,
                                      name)

    def __call__(self, shard: torch.Tensor) -> None:
        nodes, me = self.group.size(), self.group.rank()
        block = self.state.block_size
        n = shard.numel()
        chunk = ceil_div(n, nodes)
        chunks = Int8Chunks(nodes, chunk, block)
        device = shard.device
        x = torch.zeros(nodes * chunk, dtype=torch.float32, device=device)
        x[:n].copy_(shard.reshape(-1))
        kept = self.state.residual(self.unit, nodes * chunk, device)
        residual = kept
        if kept is not None and kept.dtype is not torch.float32:
            residual = kept.float()  # the arithmetic in fp32
        send = chunks.quantize(x, 1.0 / nodes, residual)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        total = chunks.sum(recv)
        own = torch.zeros(chunks.size, dtype=torch.uint8, device=device)
        q, scales = chunks.segment(own, 0)
        int8_codec.quantize(total, block, out=q, scales=scales)
        if residual is not None:
            # The owner feeds back what the second rounding (and the cast
            # to the shard's dtype) dropped from the sum.
            applied = int8_codec.dequantize(q, scales, block)
            lost = total - applied.to(shard.dtype).float()
            residual[me * chunk:(me + 1) * chunk].add_(
                torch.where(
                    torch.isfinite(lost), lost, torch.zeros_like(lost)))
            if residual is not kept:
                kept.copy_(residual)
        gathered = torch.empty_like(send)
        all_gather_single(gathered, own, group=self.group)
        for j in range(nodes):
            int8_codec.dequantize(*chunks.segment(gathered, j), block,
                                  x[j * chunk:(j + 1) * chunk])
        shard.view(-1).copy_(x[:n])
        if self.counter is not None:
            self.counter.baseline_bytes += n * shard.element_size()
            self.counter.bytes_sent += chunks.nbytes


def install_cross_node(model: nn.Module, comm) -> int:
    """Make every FSDP2 unit of ``model`` (sharded over each node) average
    its gradient shard across nodes with ``comm`` (a
    :class:`CrossNodeAllReduce` or :class:`Int8CrossNodeAllReduce`; each
    unit gets ``comm.for_unit(name)``). The shards reach the hook as the
    node's mean (FSDP2's own reduce-scatter averages over the node's
    ranks, as the project's averaging one does), and it is the hook that
    divides by the number of nodes: on a 1-D mesh FSDP2 knows of no other
    node.

    Returns:
        int: How many units were set.
    """
    units = fsdp_units(model)
    for name, module in units:
        module.set_all_reduce_hook(comm.for_unit(name))
    return len(units)


class HybridInt8StateKeeper(HookStateKeeper):
    """Saves and restores :class:`HybridInt8State`'s residuals per unit.

    A residual holds a rank's slice of a unit's parameters in the shard
    layout of the run that saved it: it can be restored only where every
    unit's shard has the same size (the same nodes, ranks per node and
    block size); otherwise it is refused, and every rank starts afresh
    (:mod:`mmcv_custom.engine.hook_state_files`).

    Args:
        state (HybridInt8State): The residuals.
        layout (tuple): ``(nodes, ranks_per_node)`` of the run, saved with
            the residuals and checked on restore (the state files check the
            rank).
    """

    RESTORED = 'error feedback of each unit\'s shard'
    FRESH_NOTE = 'error feedback from zero'
    FEEDBACK_KEY = 'error_feedback'

    def __init__(self, state: HybridInt8State, layout: tuple) -> None:
        self.state = state
        self.layout = tuple(layout)

    def state_dict(self) -> dict:
        return dict(
            format='hybrid_int8',
            layout=self.layout,
            block_size=self.state.block_size,
            residual_dtype=str(self.state.residual_dtype).replace(
                'torch.', ''),
            residuals={
                unit: residual.detach().cpu().clone()
                for unit, residual in self.state.residuals.items()
            })

    def check_state_dict(self, saved) -> None:
        if not isinstance(saved, dict) or saved.get('format') != 'hybrid_int8':
            raise ValueError('it holds no hybrid int8 error feedback')
        layout = tuple(saved.get('layout') or ())
        if layout != self.layout:
            raise ValueError(
                f'it was saved on {_nodes(layout)}, this run has '
                f'{_nodes(self.layout)}: its shards are other slices of the '
                'parameters')
        if saved.get('block_size') != self.state.block_size:
            raise ValueError(
                f"its block_size is {saved.get('block_size')}, this run's "
                f'{self.state.block_size}')
        dtype = self.state.residual_dtype
        residuals = saved.get('residuals')
        if not isinstance(residuals, dict) or not all(
                isinstance(r, torch.Tensor) for r in residuals.values()):
            raise ValueError('its residuals are not tensors')
        other = {r.dtype for r in residuals.values()} - {dtype}
        if other:
            raise ValueError(
                f'its residuals are {_dtype_name(other.pop())}, this run '
                f'keeps them in {_dtype_name(dtype)} (residual_dtype)')

    def load_state_dict(self, saved: dict) -> None:
        self.state.residuals = {
            unit: residual.clone()
            for unit, residual in saved['residuals'].items()
        }

    def start_fresh(self, steps_done: int) -> None:
        self.state.residuals = {}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace('torch.', '')


def _nodes(layout: tuple) -> str:
    if len(layout) != 2:
        return 'an unknown layout'
    return f'{layout[0]} nodes x {layout[1]} ranks'
