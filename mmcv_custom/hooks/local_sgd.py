"""Local SGD and DiLoCo: gradients exchanged inside the node every step, the
model synchronised across nodes every ``period`` steps. Torch only.

Every hook of this package exchanges gradients every step, so a step can
never be faster than the compressed gradients' time on the slowest link.
These two communicate across nodes less *often* instead:

* ``post_local_sgd`` (Lin et al. 2020; PyTorch's ``post_localSGD_hook``
  with ``PeriodicModelAverager``): every rank all-reduces its gradients
  over the whole world for ``start_iter`` optimizer steps, then only
  inside its node; after every ``period``-th local step the parameters are
  averaged across the nodes.
* ``diloco`` (Douillard et al. 2023): the configured optimizer is the
  *inner* one, stepping on gradients exchanged inside the node; every
  ``period`` steps the pseudo-gradient (the global parameters of the last
  synchronisation minus the node's) is averaged across the nodes, in fp32,
  bf16 or int8 with error feedback, and applied to the global parameters by
  an outer Nesterov SGD; every rank then continues from them.

Unlike PyTorch's averagers, the synchronisation here

* knows the nodes (:class:`~.topology.NodeGroups`): ranks of one node hold
  the same parameters, so each of a node's ranks sends only its slice of
  them to its peers on the other nodes (``cross``) and the node gathers the
  slices (``intra``): ``P`` values cross per node, not ``ranks_per_node *
  P``;
* copies in place (the parameters keep their storage: fused optimizers
  and compiled graphs see the new values);
* averages the floating-point buffers (BatchNorm's running statistics)
  over every rank at the same steps; the run turns off DDP's per-step
  buffer broadcast, which would cross the nodes every step;
* counts the optimizer steps itself (:meth:`PeriodicState.after_step`,
  called after each), so the schedule is the same on every rank and
  survives a resume (the step is part of the saved state).

The inner exchange is any hook of this package built over the node's
group (:class:`InnerExchange`, built by :mod:`mmcv_custom.comm`); with one
rank a node there is none and the bucket is the node's gradient as it is.
"""
import math
import time
from typing import Any, Callable, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import diloco_stream, int8_codec
from .topology import NodeGroups
from .util import ceil_div

__all__ = [
    'PERIODIC_ALGORITHMS', 'OUTER_FORMATS', 'DEFAULT_INNER', 'InnerExchange',
    'SyncReport', 'PeriodicState', 'LocalSGDState', 'DiLoCoState',
    'post_local_sgd_hook', 'diloco_hook'
]

#: The algorithms, by their ``comm_hook`` type.
PERIODIC_ALGORITHMS = ('post_local_sgd', 'diloco')

#: The exchange inside the node of a config that names none: DDP's own
#: average (a ``comm_hook`` config).
DEFAULT_INNER = {'type': 'allreduce'}

#: What DiLoCo's pseudo-gradient crosses the nodes as.
OUTER_FORMATS = ('fp32', 'bf16', 'int8')


class InnerExchange(NamedTuple):
    """A hook that exchanges the gradients over a group: inside the node
    (or, during ``start_iter``, over the world).

    Attributes:
        hook (Callable): The hook chain to call as ``hook(state, bucket)``.
        state: Its state.
        group_size (int): Ranks it averages over.
        pop_sent (Callable, optional): ``pop_sent() -> int``: the bytes it
            sent since the last call (the one counting rule); None: not
            counted.
        keeper: Its state keeper (a
            :class:`~.state.HookStateKeeper`), or None.
    """
    hook: Callable
    state: Any
    group_size: int
    pop_sent: Optional[Callable[[], int]] = None
    keeper: Any = None


class SyncReport(NamedTuple):
    """One synchronisation: the bytes sent across the nodes (counted by
    the one rule: an all-reduced tensor's size), the bytes gathered inside
    the node, and the seconds the step spent in it."""
    cross_bytes: int
    intra_bytes: int
    seconds: float


#: Values gathered inside the node at once (64 MiB of fp32).
_GATHER_VALUES = 1 << 24


def _done_future(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class PeriodicState:
    """What both algorithms share: the schedule, the node groups, the inner
    exchanges and the slice of the model this rank synchronises.

    Args:
        process_group (ProcessGroup, optional): The DDP model's group; it
            must be the whole world (None).
        period (int): Optimizer steps between synchronisations (>= 1).
        start_iter (int): Optimizer steps, first, with the gradients
            exchanged over the whole world every step (>= 0).

    Set by the builder before the first step: :meth:`set_groups` and the
    inner exchanges (:attr:`world_inner`, :attr:`intra_inner`); by the run:
    :meth:`attach` (the module and, to save it, its optimizer).
    """

    #: The ``comm_hook`` type.
    algorithm = ''

    def __init__(self,
                 process_group: Optional[dist.ProcessGroup] = None,
                 period: int = 1,
                 start_iter: int = 0) -> None:
        self.process_group = process_group
        self.period = period
        self.start_iter = start_iter
        #: Optimizer steps done (:meth:`after_step`).
        self.steps = 0
        #: Steps at the last synchronisation across every node.
        self.synced_at = 0
        self.groups: Optional[NodeGroups] = None
        #: Smaller groups of nodes (:class:`LocalSGDState`).
        self.level_groups: dict = {}
        #: The exchange of the ``start_iter`` steps (None: no such steps).
        self.world_inner: Optional[InnerExchange] = None
        #: The exchange inside the node (None: one rank a node).
        self.intra_inner: Optional[InnerExchange] = None
        self.module: Optional[nn.Module] = None
        self.optimizer = None
        self._sync_bytes = 0
        self._cross_bytes = 0

    # -- set-up ------------------------------------------------------------
    def set_groups(self, groups: NodeGroups) -> None:
        """This rank's node group and cross-node group."""
        self.groups = groups

    def attach(self, module: nn.Module, optimizer=None) -> None:
        """The model whose parameters and buffers are synchronised, and the
        optimizer whose state is saved with them: anything with
        ``state_dict`` and ``load_state_dict`` (a torch optimizer, an
        MMEngine optimizer wrapper with its loss scaler); None: not
        saved."""
        self.module = module
        self.optimizer = optimizer

    @property
    def num_nodes(self) -> int:
        return self.groups.layout.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self.groups.layout.ranks_per_node

    def params(self) -> List[nn.Parameter]:
        """The trainable parameters, in the module's order (the same on
        every rank)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def numel(self) -> int:
        return sum(p.numel() for p in self.params())

    def my_slice(self) -> slice:
        """The part of the flat parameters this rank synchronises across
        nodes: one of ``ranks_per_node`` equal chunks (the last one
        short)."""
        chunk = ceil_div(self.numel(), self.ranks_per_node)
        start = min(self.groups.intra_rank * chunk, self.numel())
        return slice(start, min(start + chunk, self.numel()))

    # -- the schedule --------------------------------------------------------
    def local(self) -> bool:
        """Whether the gradients stay inside the node this step."""
        return self.steps >= self.start_iter

    def due(self) -> bool:
        """Whether the step just counted ends a period."""
        done = self.steps - self.start_iter
        return done > 0 and done % self.period == 0

    def level(self) -> Optional[int]:
        """Where the step just counted synchronises: None across every
        node (a subclass may name a smaller group of nodes)."""
        return None

    def after_step(self) -> Optional[SyncReport]:
        """Count one optimizer step and synchronise when it ends a period.
        Call it on every rank after every optimizer step (collective on the
        steps that synchronise). Returns the synchronisation's report, or
        None."""
        self.steps += 1
        if not self.due():
            return None
        return self.sync(self.level())

    def pending(self) -> int:
        """Local steps since the last synchronisation."""
        return self.steps - max(self.synced_at, self.start_iter)

    def sync(self, level: Optional[int] = None) -> SyncReport:
        """Synchronise now (collective): at the end of a period, or early
        (the run's last step); ``level``: across every node (None), or
        within groups of that many nodes (:class:`LocalSGDState`'s
        ``group_periods``)."""
        began = time.perf_counter()
        cross, intra = self._sync_params(level)
        # On one node the buffers' average stays inside it.
        if self.num_nodes > 1:
            cross += self._average_buffers(level)
        else:
            intra += self._average_buffers(level)
        if level is None:  # a group of nodes' average leaves the others
            self.synced_at = self.steps
        self._sync_bytes += cross + intra
        self._cross_bytes += cross
        return SyncReport(int(cross), int(intra), time.perf_counter() - began)

    def pop_sent(self) -> int:
        """Bytes sent since the last call: the inner exchanges' and the
        synchronisations' (the one counting rule)."""
        sent, self._sync_bytes = self._sync_bytes, 0
        for inner in (self.world_inner, self.intra_inner):
            if inner is not None and inner.pop_sent is not None:
                part = inner.pop_sent()
                sent += part
                if inner is self.world_inner:
                    self._cross_bytes += part
        return sent

    def pop_cross(self) -> int:
        """Bytes sent across the nodes since the last call: the
        synchronisations', and the exchange over the world of the
        ``start_iter`` steps (counted whole). Call :meth:`pop_sent` first."""
        cross, self._cross_bytes = self._cross_bytes, 0
        return cross

    # -- the hook ------------------------------------------------------------
    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """The bucket's exchange this step: over the world during
        ``start_iter``, else inside the node (or none)."""
        inner = self.intra_inner if self.local() else self.world_inner
        if inner is None:
            return _done_future(bucket.buffer())
        return inner.hook(inner.state, bucket)

    # -- synchronisation -----------------------------------------------------
    def _flat_slice(self) -> torch.Tensor:
        """This rank's slice of the parameters, flat, in fp32 (a copy)."""
        part = self.my_slice()
        return self._flat_range(part.start, part.stop)

    def _flat_range(self, start: int, stop: int) -> torch.Tensor:
        """The flat parameters' values ``[start, stop)`` in fp32 (a
        copy)."""
        pieces, at = [], 0
        for p in self.params():
            n = p.numel()
            lo, hi = max(start, at), min(stop, at + n)
            if lo < hi:
                pieces.append(p.detach().reshape(-1)[lo - at:hi - at].float())
            at += n
            if at >= stop:
                break
        if not pieces:
            return torch.zeros(0, device=self._device())
        return torch.cat(pieces)

    def _device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _write_flat(self, values: torch.Tensor, start: int) -> None:
        """Copy ``values`` into the parameters from flat offset ``start``
        on, in place (the parameters keep their storage)."""
        end, at = start + values.numel(), 0
        with torch.no_grad():
            for p in self.params():
                n = p.numel()
                lo, hi = max(start, at), min(end, at + n)
                if lo < hi:
                    src = values[lo - start:hi - start]
                    if p.is_contiguous():
                        p.view(-1)[lo - at:hi - at].copy_(src)
                    else:  # channels_last and the like: logical order
                        flat = p.detach().reshape(-1).clone()
                        flat[lo - at:hi - at] = src
                        p.copy_(flat.view(p.shape))
                at += n
                if at >= end:
                    break

    def _gather_and_write(self, mine: torch.Tensor) -> int:
        """Gather every slice inside the node, piece by piece (a 6B
        model's whole flat fp32 copy would not fit beside it), and copy
        them into the parameters, in place. Returns the bytes gathered
        (the rule)."""
        ranks, numel = self.ranks_per_node, self.numel()
        if ranks == 1:
            self._write_flat(mine, self.my_slice().start)
            return 0
        chunk = ceil_div(numel, ranks)
        if mine.numel() < chunk:
            mine = torch.cat([mine, mine.new_zeros(chunk - mine.numel())])
        step = min(chunk, _GATHER_VALUES)
        for at in range(0, chunk, step):
            piece = mine[at:at + step].contiguous()
            parts = [torch.empty_like(piece) for _ in range(ranks)]
            dist.all_gather(parts, piece, group=self.groups.intra)
            for r, got in enumerate(parts):
                start = r * chunk + at
                valid = min(got.numel(), numel - start)
                if valid > 0:
                    self._write_flat(got[:valid], start)
        return ranks * chunk * 4 // 2

    def _average_buffers(self, level: Optional[int] = None) -> int:
        """Average the floating-point buffers over every rank, or every
        rank of ``level``'s group of nodes (BatchNorm's running statistics:
        each rank's saw its own batches); integer ones (batch counts) are
        the same everywhere. Returns the bytes sent."""
        group = (
            self.process_group
            if level is None else self.level_groups[level][1])
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        if not buffers or dist.get_world_size(group) == 1:
            return 0
        flat = torch.cat([b.detach().reshape(-1).float() for b in buffers])
        flat.div_(dist.get_world_size(group))
        dist.all_reduce(flat, group=group)
        at = 0
        with torch.no_grad():
            for b in buffers:
                n = b.numel()
                b.copy_(flat[at:at + n].view_as(b))
                at += n
        return flat.numel() * 4

    def _sync_params(self, level: Optional[int]) -> tuple:
        """Synchronise the parameters; ``(cross bytes, intra bytes)``."""
        raise NotImplementedError


class LocalSGDState(PeriodicState):
    """``post_local_sgd``: the parameters averaged across nodes in fp32
    every ``period`` local steps (see the module's docstring).

    The hierarchical form (PyTorch's ``HierarchicalModelAverager``, by
    nodes rather than by consecutive ranks): ``group_periods`` maps shorter
    periods to groups of that many consecutive nodes, e.g. ``{4: 2}`` with
    ``period=16`` on 4 nodes averages within each pair of nodes every 4
    steps and across all 4 every 16 (the longest period that divides the
    local step wins). The builder makes the groups
    (:meth:`set_level_groups`).

    Args:
        process_group, period, start_iter: See :class:`PeriodicState`.
        group_periods (dict, optional): ``{period: nodes}``, each period
            dividing ``period``.
    """

    algorithm = 'post_local_sgd'

    def __init__(self,
                 process_group: Optional[dist.ProcessGroup] = None,
                 period: int = 1,
                 start_iter: int = 0,
                 group_periods: Optional[dict] = None) -> None:
        super().__init__(process_group, period, start_iter)
        self.group_periods = dict(sorted((group_periods or {}).items()))

    def __repr__(self) -> str:
        levels = (f', group_periods={self.group_periods}'
                  if self.group_periods else '')
        return (f'LocalSGDState(period={self.period}, '
                f'start_iter={self.start_iter}{levels})')

    def set_level_groups(self, level_groups: dict) -> None:
        """``{nodes: (peers group, ranks group)}`` for each level of
        ``group_periods``: this rank's peers of the same place on its group
        of nodes, and every rank of those nodes."""
        self.level_groups = level_groups

    def due(self) -> bool:
        done = self.steps - self.start_iter
        return done > 0 and any(done % p == 0
                                for p in [self.period, *self.group_periods])

    def level(self) -> Optional[int]:
        done = self.steps - self.start_iter
        if done % self.period == 0:
            return None
        return self.group_periods[max(p for p in self.group_periods
                                      if done % p == 0)]

    def _sync_params(self, level: Optional[int]) -> tuple:
        mine = self._flat_slice()
        nodes = self.num_nodes if level is None else level
        group = (
            self.groups.cross
            if level is None else self.level_groups[level][0])
        cross = 0
        if nodes > 1:
            mine.div_(nodes)
            dist.all_reduce(mine, group=group)
            cross = mine.numel() * 4
        return cross, self._gather_and_write(mine)


class DiLoCoState(PeriodicState):
    """``diloco``: every ``period`` local steps, the pseudo-gradient
    (global minus local parameters) averaged across nodes in
    ``outer_format`` and applied by an outer SGD with (Nesterov) momentum.

    The global parameters, the outer momentum and the error feedback are
    this rank's slice only, in fp32: ``3 P / ranks_per_node`` values a rank
    (``P``: the trainable values).

    Args:
        process_group, period, start_iter: See :class:`PeriodicState`.
        outer_lr (float): The outer learning rate (0.7 in the paper).
        outer_momentum (float): Its momentum, in ``[0, 1)`` (0.9).
        nesterov (bool): Nesterov momentum (the paper's).
        outer_format (str): ``'fp32'``, ``'bf16'`` or ``'int8'`` (blockwise,
            one fp32 scale per ``block_size`` values).
        block_size (int): int8's values per scale.
        error_feedback (bool): With int8: what rounding drops is added to
            the next pseudo-gradient.
        fragments (int): The streaming form (:mod:`.diloco_stream`): the
            slice synchronised in this many fragments at staggered steps
            of each period. 1: all at once.
        overlap (int): Optimizer steps each fragment's exchange runs
            beside the training before it is applied (below ``period //
            fragments``). 0: at once.
        mix (float): With ``overlap``: the share of the local values kept
            when the fragment's new global ones are applied, in [0, 1).
    """

    algorithm = 'diloco'

    def __init__(self,
                 process_group: Optional[dist.ProcessGroup] = None,
                 period: int = 1,
                 start_iter: int = 0,
                 outer_lr: float = 0.7,
                 outer_momentum: float = 0.9,
                 nesterov: bool = True,
                 outer_format: str = 'int8',
                 block_size: int = 256,
                 error_feedback: bool = True,
                 fragments: int = 1,
                 overlap: int = 0,
                 mix: float = 0.5) -> None:
        super().__init__(process_group, period, start_iter)
        self.fragments = fragments
        self.overlap = overlap
        self.mix = mix
        #: Fragments' exchanges sent and not yet applied (the streaming
        #: form's :class:`~.diloco_stream.InFlight`).
        self.in_flight: list = []
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.outer_format = outer_format
        self.block_size = block_size
        self.error_feedback = error_feedback and outer_format == 'int8'
        #: This rank's slice of the global parameters (None until the
        #: first local step: :meth:`start`).
        self.global_params: Optional[torch.Tensor] = None
        self.momentum: Optional[torch.Tensor] = None
        self.residual: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        stream = (f', fragments={self.fragments}, overlap={self.overlap}, '
                  f'mix={self.mix}' if self.streaming else '')
        return (f'DiLoCoState(period={self.period}, start_iter='
                f'{self.start_iter}, outer_lr={self.outer_lr}, '
                f'outer_momentum={self.outer_momentum}, nesterov='
                f'{self.nesterov}, outer_format={self.outer_format!r}'
                f'{stream})')

    @property
    def streaming(self) -> bool:
        """Whether the streaming form runs (fragments or overlap)."""
        return self.fragments > 1 or self.overlap > 0

    def after_step(self) -> Optional[SyncReport]:
        if not self.streaming:
            return super().after_step()
        self.steps += 1
        done = diloco_stream.stream_step(self)
        if done is None:
            return None
        cross, intra, seconds = done
        self._sync_bytes += cross + intra
        self._cross_bytes += cross
        return SyncReport(int(cross), int(intra), seconds)

    def pending(self) -> int:
        if not self.streaming:
            return super().pending()
        return diloco_stream.stream_pending(self)

    def sync(self, level: Optional[int] = None) -> SyncReport:
        """As :meth:`PeriodicState.sync`; the streaming form applies
        its exchanges in flight first, then synchronises every fragment."""
        if not self.streaming:
            return super().sync(level)
        intra, seconds = diloco_stream.flush(self)
        self._sync_bytes += intra
        report = super().sync(level)
        return report._replace(
            intra_bytes=report.intra_bytes + intra,
            seconds=report.seconds + seconds)

    def start(self) -> None:
        """Take the global parameters from the model as it is now (every
        rank holds the same: DDP broadcast them, or the checkpoint loaded
        them), with no momentum and no error feedback."""
        self.global_params = self._flat_slice()
        self.momentum = torch.zeros_like(self.global_params)
        self.residual = (
            torch.zeros_like(self.global_params)
            if self.error_feedback else None)

    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future:
        # The first local step starts from the global parameters: take
        # them before it changes them (after any restore).
        if self.global_params is None and self.local():
            self.start()
        return super().exchange(bucket)

    def _sync_params(self, level: Optional[int]) -> tuple:
        if self.global_params is None:
            self.start()
        delta = self.global_params - self._flat_slice()
        cross = self._average_across(delta)
        # Outer SGD, as torch.optim.SGD does it (no dampening, the first
        # step's buffer is the gradient itself).
        self.momentum.mul_(self.outer_momentum).add_(delta)
        step = (
            delta.add(self.momentum, alpha=self.outer_momentum)
            if self.nesterov else self.momentum)
        self.global_params.sub_(step, alpha=self.outer_lr)
        return cross, self._gather_and_write(self.global_params)

    def _average_across(self, delta: torch.Tensor) -> int:
        """``delta`` replaced by its mean over the nodes (in place).
        Returns the bytes sent."""
        nodes = self.num_nodes
        if nodes == 1:
            return 0
        group = self.groups.cross
        if self.outer_format == 'fp32':
            delta.div_(nodes)
            dist.all_reduce(delta, group=group)
            return delta.numel() * 4
        if self.outer_format == 'bf16':
            half = delta.div(nodes).to(torch.bfloat16)
            dist.all_reduce(half, group=group)
            delta.copy_(half)
            return half.numel() * 2
        # int8: every node's blocks gathered and summed in fp32, so every
        # rank gets the same sum; what rounding dropped goes back into the
        # residual for the next synchronisation.
        block = self.block_size
        q, scales = int8_codec.quantize(delta, block, 1.0 / nodes,
                                        self.residual)
        qs = [torch.empty_like(q) for _ in range(nodes)]
        ss = [torch.empty_like(scales) for _ in range(nodes)]
        dist.all_gather(qs, q, group=group)
        dist.all_gather(ss, scales, group=group)
        delta.zero_()
        for q_i, s_i in zip(qs, ss):
            int8_codec.dequantize(q_i, s_i, block, out=delta, accumulate=True)
        # An all-gather of s bytes from each of n ranks counts n s / 2.
        sent = q.numel() + scales.numel() * 4
        return int(math.ceil(nodes * sent / 2))


def post_local_sgd_hook(
        state: LocalSGDState,
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP hook of ``post_local_sgd``: the bucket averaged over the
    world during ``start_iter``, then inside the node (see
    :class:`LocalSGDState`; the averaging across nodes runs after the
    optimizer step, :meth:`~PeriodicState.after_step`)."""
    return state.exchange(bucket)


def diloco_hook(state: DiLoCoState,
                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP hook of ``diloco``: the bucket averaged inside the node (see
    :class:`DiLoCoState`; the outer step runs after the optimizer step,
    :meth:`~PeriodicState.after_step`)."""
    return state.exchange(bucket)
