"""How FSDP2 (``torch.distributed.fsdp.fully_shard``) reduces gradients.

FSDP2 has no DDP communication hooks: each sharded module reduce-scatters
its gradients through a ``ReduceScatter`` object, which
``FSDPModule.set_custom_reduce_scatter`` replaces.
:class:`AveragingReduceScatter` is that object for this project's
``comm_hook`` types, with the DDP hooks' semantics
(:mod:`mmcv_custom.hooks.half`):

* the average is taken in the gradients' own precision *before* the cast,
  so fp16 overflows only when the mean does;
* the reduce-scatter runs on the wire dtype (fp32 for ``allreduce``, fp16 or
  bf16 for the compressing types) and the shard is widened in place into
  FSDP's output;
* gradients already in a 2-byte float (a bf16 backbone's) are sent as they
  are, never cast from bf16 to fp16.

FSDP2 must hand over the plain sum: :func:`install_reduce_scatter` sets
``set_gradient_divide_factor(1.0)`` and
``set_force_sum_reduction_for_comms(True)`` on every sharded module, so
FSDP neither divides nor asks for an averaging reduce op, and this object
divides once.

Under hybrid sharding (FSDP2 on a 1-D mesh over each node, see
:func:`fsdp_replicas`) the reduce-scatter averages over the node and the
all-reduce hook of :mod:`.hybrid` averages the shard over the nodes, so the
result is the mean over every rank.

:class:`Int8ReduceScatter` is the ``int8_compress`` form, without error
feedback: the average of each rank's share is sent as blockwise int8 with
one fp32 scale per block (:mod:`mmcv_custom.hooks.int8_codec`), scattered with
one ``all_to_all`` and summed in fp32 by the rank that keeps the shard, so
only the first rounding happens (the shard stays in full precision).
Error feedback would have to keep, on every rank, what rounding dropped
from the whole unsharded gradient: the memory FSDP2 is there to save.

Both are the flat forms. :class:`TwoLevelReduceScatter` is the two-level
(node-aware) form of either: the flat int8 form's all-to-all makes every one
of a node's G ranks push its chunks for the other nodes through the node's
one link, about G times the bytes of a reduce-scatter that crosses it once.
It sums inside the node first (one all-to-all in the gradients' own dtype,
nothing rounded on the way, summed in fp32 in the node's rank order), then
runs the flat form across nodes among the ranks of the same place, on the
node's sums: a node's link carries 1/G of the flat int8 bytes, and the shard
is rounded once, as in the flat form. Like the flat forms it keeps no state,
so a resumed run is the uninterrupted one bit for bit.

Like the rest of :mod:`mmcv_custom.hooks`, this module imports only torch.
"""
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from . import cast
from .half import require_dtype_support, require_wire_dtype, wire_dtype_for
from .hybrid import cross_node_group
from .int8_plan import Int8Chunks
from .topology import NodeGroups
from .validation import require_int

try:  # The base class set_custom_reduce_scatter documents (torch >= 2.6).
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - older torch
    ReduceScatter = object

__all__ = [
    'AveragingReduceScatter', 'Int8ReduceScatter', 'TwoLevelReduceScatter',
    'install_reduce_scatter', 'make_reduce_scatter', 'set_reduce_scatter',
    'fsdp_modules', 'fsdp_replicas'
]


class _SummingReduceScatter(ReduceScatter):
    """What the reduce-scatters share: FSDP2 allocates the buffers as
    usual, and must ask for a plain sum (they average by themselves); the
    ``counter`` (if any) counts the input's bytes as FSDP would send them,
    and the bytes sent (what :meth:`_reduce` returns)."""

    def __call__(self,
                 output_tensor: torch.Tensor,
                 input_tensor: torch.Tensor,
                 group: dist.ProcessGroup,
                 op=None,
                 async_op: bool = False):
        self._check_op(op)
        sent, work = self._reduce(output_tensor, input_tensor, group, async_op)
        if self.counter is not None:
            self.counter.baseline_bytes += (
                input_tensor.numel() * input_tensor.element_size())
            self.counter.bytes_sent += sent
        return work

    def _reduce(self, output: torch.Tensor, input_tensor: torch.Tensor,
                group: dist.ProcessGroup, async_op: bool) -> tuple:
        """FSDP's reduce-scatter of ``input_tensor`` over ``group`` into
        ``output``: ``(bytes sent, work or None)``."""
        raise NotImplementedError

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_sizes(self, output: torch.Tensor, input_tensor: torch.Tensor,
                     world: int) -> None:
        """Raise unless ``input_tensor`` holds a chunk like ``output`` per
        rank of the ``world`` it is scattered over."""
        chunk = output.numel()
        if input_tensor.numel() != chunk * world:
            raise ValueError(
                f'{type(self).__name__} needs an input of world_size '
                f'({world}) times the output ({chunk} values), but got '
                f'{input_tensor.numel()}')

    def _check_op(self, op) -> None:
        if op is not None and op != dist.ReduceOp.SUM:
            # The strategy forces sum reductions (see the module docstring).
            raise RuntimeError(
                f'{type(self).__name__} got reduce op {op}; it averages by '
                'itself and needs FSDP to ask for a plain sum: call '
                'install_reduce_scatter instead of set_custom_reduce_scatter')


class AveragingReduceScatter(_SummingReduceScatter):
    """Average gradients across the group and keep this rank's shard.

    Args:
        wire_dtype (torch.dtype, optional): What to send: ``torch.float16``,
            ``torch.bfloat16``, or None for the gradients' own dtype (FSDP's
            default reduction). Gradients already in a 2-byte float are
            sent as they are.
        counter (object, optional): Anything with ``baseline_bytes`` and
            ``bytes_sent`` attributes (e.g. ``registry.CommCounter``):
            each call adds the bytes of its input as FSDP would send them
            and as sent. Defaults to None.

    The input is FSDP's flat reduce-scatter buffer (its gradients chunked by
    rank, padded), which it no longer needs after the call: it is divided
    in place when the wire dtype is the gradients' own.
    """

    def __init__(self,
                 wire_dtype: Optional[torch.dtype] = None,
                 counter=None) -> None:
        require_wire_dtype(wire_dtype)
        self.wire_dtype = wire_dtype
        self.counter = counter

    def _reduce(self, output: torch.Tensor, input_tensor: torch.Tensor,
                group: dist.ProcessGroup, async_op: bool) -> tuple:
        return self.scatter(output, input_tensor, group, group.size(),
                            input_tensor, async_op)

    def scatter(self,
                output: torch.Tensor,
                x: torch.Tensor,
                group: dist.ProcessGroup,
                divisor: float,
                grads: torch.Tensor,
                async_op: bool = False) -> tuple:
        """``x / divisor`` reduce-scattered over ``group`` into ``output``,
        sent as ``grads`` (the gradients ``x`` comes from) go: ``x`` may be
        a widened copy (the two-level form's fp32 sums). Returns ``(bytes
        sent, work or None)``."""
        wire = (
            grads.dtype if self.wire_dtype is None else wire_dtype_for(
                self.wire_dtype, grads))
        require_dtype_support(wire, group, x.device)
        if wire is x.dtype:
            sent = x.mul_(1.0 / divisor)
        else:
            # Divide in the gradients' precision, then round once.
            sent = cast.compress(x, divisor, wire)
        nbytes = x.numel() * torch.finfo(wire).bits // 8
        if output.dtype is wire:
            return nbytes, dist.reduce_scatter_single(
                output, sent, group=group, async_op=async_op)
        received = torch.empty(
            output.numel(), dtype=wire, device=output.device)
        dist.reduce_scatter_single(received, sent, group=group)
        if output.dtype is torch.float32 and wire is not torch.float32:
            # Half on the wire into fp32 gradients: widened in place.
            cast.decompress(received, output.view(-1))
        else:
            output.view(-1).copy_(received)
        return nbytes, None


class Int8ReduceScatter(_SummingReduceScatter):
    """Average gradients across the group as blockwise int8 and keep this
    rank's shard in full precision (see the module docstring).

    Each rank multiplies its input by ``1 / world_size`` (before any
    rounding) and quantizes every rank's chunk in blocks of ``block_size``
    from the chunk's start, into one segment per rank: the chunk's fp32
    scales, then its int8 values, padded to 4 bytes. ``all_to_all_single``
    hands every rank its chunk from every rank, which it dequantizes and
    sums in fp32 in rank order into FSDP's output. Each rank sends ``(N -
    1) / N`` of the quantized gradients, as a ring reduce-scatter does.

    Args:
        block_size (int): Values per fp32 scale. Defaults to 256.
        counter (object, optional): As :class:`AveragingReduceScatter`'s;
            the wire bytes are those of the quantized input.
    """

    def __init__(self, block_size: int = 256, counter=None) -> None:
        require_int('block_size', block_size, minimum=1)
        self.block_size = block_size
        self.counter = counter

    def _reduce(self, output: torch.Tensor, input_tensor: torch.Tensor,
                group: dist.ProcessGroup, async_op: bool) -> tuple:
        self._check_sizes(output, input_tensor, group.size())
        return self.scatter(output, input_tensor, group, group.size(),
                            input_tensor)

    def scatter(self,
                output: torch.Tensor,
                x: torch.Tensor,
                group: dist.ProcessGroup,
                divisor: float,
                grads: torch.Tensor = None,
                async_op: bool = False) -> tuple:
        """``x / divisor`` reduce-scattered over ``group`` in int8 into
        ``output`` (``x``: a chunk per rank of ``group``); ``(bytes sent,
        None)``, as :meth:`AveragingReduceScatter.scatter` (int8 whatever
        ``grads`` are; it waits for its all-to-all)."""
        chunks = Int8Chunks(group.size(), output.numel(), self.block_size)
        x = x.reshape(-1)
        x = x.float() if x.dtype is not torch.float32 else x.contiguous()
        send = chunks.quantize(x, 1.0 / divisor)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        output.view(-1).copy_(chunks.sum(recv))
        return chunks.nbytes, None


class TwoLevelReduceScatter(_SummingReduceScatter):
    """Reduce inside the node in full precision, then reduce-scatter the
    node's sums across nodes with ``across`` (see the module docstring).

    Args:
        groups (NodeGroups): This rank's node and cross-node groups, made
            from the layout of the ranks FSDP2 shards over (the whole
            world: FSDP2Strategy shards over every rank).
        across (AveragingReduceScatter | Int8ReduceScatter): The flat form
            that carries the node's sums across nodes; its ``counter``
            (if any) counts the input's bytes as FSDP would send them, and
            as sent the bytes this rank sends across nodes.
    """

    def __init__(
            self, groups: NodeGroups,
            across: Union[AveragingReduceScatter, Int8ReduceScatter]) -> None:
        self.groups = groups
        self.across = across
        self.counter = across.counter
        # members[p][j]: the global rank at place p of its node and place
        # j among its peers (the order of ``new_group``: ascending global
        # ranks, see NodeGroups).
        nodes = [sorted(ranks) for ranks in groups.layout.nodes]
        self.members: List[List[int]] = [
            sorted(node[place] for node in nodes)
            for place in range(groups.layout.ranks_per_node)
        ]
        self.world_size = sum(len(node) for node in nodes)
        self._orders: dict = {}

    def _order(self, group: dist.ProcessGroup) -> torch.Tensor:
        """The chunks of FSDP's input, in the order they go to the node's
        ranks: place by place, each place's peers node by node."""
        key = id(group)
        if key not in self._orders:
            size = group.size()
            if size != self.world_size:
                raise ValueError(
                    f'the two-level reduce-scatter was made for '
                    f'{self.world_size} ranks ({self.groups.describe()}), '
                    f'but FSDP2 reduce-scatters over a group of {size}: '
                    "use topology='flat' for this sharding")
            self._orders[key] = torch.tensor([
                dist.get_group_rank(group, rank) for place in self.members
                for rank in place
            ],
                                             dtype=torch.int64)
        return self._orders[key]

    def _reduce(self, output: torch.Tensor, input_tensor: torch.Tensor,
                group: dist.ProcessGroup, async_op: bool) -> tuple:
        order = self._order(group)
        self._check_sizes(output, input_tensor, self.world_size)
        chunk = output.numel()
        node_size = self.groups.layout.ranks_per_node
        nodes = self.groups.layout.num_nodes
        chunks = input_tensor.reshape(self.world_size, chunk)
        send = chunks.index_select(0, order.to(chunks.device))
        recv = torch.empty_like(send)
        # As bytes: gloo's all-to-all does not take every dtype (bf16).
        dist.all_to_all_single(
            recv.view(-1).view(torch.uint8),
            send.view(-1).view(torch.uint8),
            group=self.groups.intra)
        del send
        parts = recv.view(node_size, nodes * chunk)
        sums = parts[0].float()
        for i in range(1, node_size):
            sums += parts[i]
        del recv, parts
        return self.across.scatter(output, sums, self.groups.cross,
                                   self.world_size, input_tensor)


def fsdp_modules(model: nn.Module) -> list:
    """Every module of ``model`` that ``fully_shard`` has sharded, root
    included (empty when none is)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_replicas(model: nn.Module) -> int:
    """How many replicas of each shard ``model`` keeps: the number of
    nodes under hybrid sharding (the size of the cross-node group
    :func:`~.hybrid.mark_hybrid` noted), else 1 (full sharding, or not
    sharded)."""
    group = cross_node_group(model)
    return 1 if group is None else group.size()


def make_reduce_scatter(wire_dtype: Optional[torch.dtype] = None,
                        counter=None,
                        int8_block_size: Optional[int] = None,
                        node_groups=None):
    """One :class:`AveragingReduceScatter`, or an :class:`Int8ReduceScatter`
    when ``int8_block_size`` is given (``wire_dtype`` is then unused); in
    two levels with ``node_groups`` (a
    :class:`~mmcv_custom.hooks.topology.NodeGroups`, see
    :class:`TwoLevelReduceScatter`)."""
    comm = (
        AveragingReduceScatter(wire_dtype, counter) if int8_block_size is None
        else Int8ReduceScatter(int8_block_size, counter))
    if node_groups is not None:
        comm = TwoLevelReduceScatter(node_groups, comm)
    return comm


def set_reduce_scatter(model: nn.Module, comm) -> int:
    """Make every sharded module of ``model`` reduce its gradients with
    ``comm`` (from :func:`make_reduce_scatter`), the sum divided by the
    world size inside it. Under hybrid sharding ``comm`` averages over the
    node and :mod:`.hybrid`'s all-reduce hook over the nodes (see the module
    docstring). Between iterations it may be set again: the next
    backward's reduce-scatters use the new one.

    Returns:
        int: How many sharded modules were set (0: ``model`` is not
        sharded with FSDP2).
    """
    modules = fsdp_modules(model)
    for module in modules:
        module.set_custom_reduce_scatter(comm)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return len(modules)


def install_reduce_scatter(model: nn.Module,
                           wire_dtype: Optional[torch.dtype] = None,
                           counter=None,
                           int8_block_size: Optional[int] = None,
                           node_groups=None) -> int:
    """:func:`set_reduce_scatter` of :func:`make_reduce_scatter`'s
    reduce-scatter on every sharded module of ``model``.

    Returns:
        int: How many sharded modules were set (0: ``model`` is not
        sharded with FSDP2).
    """
    return set_reduce_scatter(
        model,
        make_reduce_scatter(wire_dtype, counter, int8_block_size, node_groups))
