"""A DDP communication hook that averages gradients as blockwise int8.

:func:`int8_compress_hook` follows PyTorch's communication-hook contract, so
it registers on any plain :class:`torch.nn.parallel.DistributedDataParallel`::

    >>> from mmcv_custom.hooks import Int8State, int8_compress_hook
    >>> ddp_model.register_comm_hook(Int8State(None), int8_compress_hook)

Nothing here imports MMEngine. The format: every parameter's gradient is
cut into blocks of ``block_size`` elements (its last block may be shorter),
each sent as int8 with one fp32 scale (``max |x| / 127`` of the block), so
an element costs about ``1 + 4 / block_size`` bytes on the wire instead of
4 (fp32) or 2 (bf16). The rounding rule, and the one-pass C kernels that
carry it out on CPU bit for bit as torch's ops do elsewhere, are
:mod:`mmcv_custom.hooks.int8_codec`'s.

The reduction is a reduce-scatter then an all-gather (the two halves of a
ring all-reduce), each in int8: every rank scales its bucket by
``1 / world_size``, adds its error feedback and quantizes it into one byte
buffer grouped by owner; ``all_to_all_single`` gives each owner its blocks
from every rank, which it sums in fp32 and quantizes again; ``all_gather``
returns the result, dequantized into the bucket in place. Blocks and their
owners follow the parameters, not the buckets, so a resumed run is bit for
bit the uninterrupted one; the reasoning, step by step, is in
``docs/en/design/int8_ownership.md``.
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import int8_codec
from .half import group_or_world
from .int8_plan import Int8BucketPlan, exchange_and_requantize
from .int8_two_level import TwoLevelPlan, two_level_reduce
from .state import HookStateKeeper
from .topology import NodeGroups
from .util import all_gather_single, ceil_div
from .validation import require_bool, require_int
from .worker import run_on_comm_worker

__all__ = [
    'Int8State', 'Int8StateKeeper', 'Int8BucketPlan', 'int8_compress_hook'
]

_QMAX = 127
# 2: per-parameter blocks; the state names each parameter's first block.
_VERSION = 2
_READS = (1, 2)


def _layout(bucket: dist.GradBucket) -> tuple:
    """``((parameter id, numel), ...)`` of a bucket, in bucket order: what
    plans and residuals are kept by."""
    return tuple((id(p), p.numel()) for p in bucket.parameters())


def _split(layout: tuple, residual: torch.Tensor) -> dict:
    """Parameter id -> its piece of a bucket's residual (views)."""
    if sum(numel for _, numel in layout) != residual.numel():
        return {}  # not laid out parameter after parameter: drop it
    out, offset = {}, 0
    for pid, numel in layout:
        out[pid] = residual[offset:offset + numel]
        offset += numel
    return out


class Int8State:
    """State of :func:`int8_compress_hook`: settings and error feedback.

    Error feedback: what quantization drops from this rank's share of a
    step's gradient is added to its share of the next step's before it is
    quantized, so nothing is lost for good, only delayed: summed over
    steps, the applied gradients plus the ranks' current residuals equal
    the sum of the true mean gradients (up to fp32 rounding).

    Two roundings drop something. The first, of ``g / world_size`` on each
    rank, is that rank's own. The second, of a block's sum (and, for a
    bf16 bucket, the cast of the result back to bf16), is made by the
    block's owner alone, and its result is what every rank applies. It is
    fed back too, into the owner's residual for that block: next step the
    owner's share carries it into the same sum. That keeps one residual
    per rank and bucket, in the bucket's layout, and makes the identity
    above exact; without it the second rounding (up to half a step of the
    sum's scale, about ``world_size`` times the first's) would be lost
    every step.

    DDP lays its buckets out again after the first iteration (and a
    resumed run lays them out afresh), so residuals are kept by bucket
    index *and* the parameters in it: when a bucket's parameters change,
    every residual is cut into per-parameter pieces and reassembled for
    the new buckets. Blocks and their owners follow the parameters, not
    the buckets (see the module docstring), so a re-layout changes no
    number. :meth:`state_dict` saves the residuals in per-parameter form
    and each parameter's first block number, keyed by name.

    Args:
        process_group (ProcessGroup, optional): Group to average over.
            Defaults to None (WORLD).
        block_size (int): Elements per fp32 scale. Smaller blocks follow
            the gradient's magnitude more closely and cost more bytes
            (``4 / block_size`` per element). Defaults to 256.
        error_feedback (bool): Keep what quantization drops and add it to
            the next step's gradient. Costs one fp32 copy of the gradients
            per rank. Defaults to True.
        node_groups (NodeGroups, optional): Reduce in two levels over these
            groups (see :mod:`.int8_two_level`; made by
            :func:`~mmcv_custom.hooks.topology.make_node_groups`). Defaults
            to None: the flat form.

    Raises:
        TypeError: ``block_size`` is not an int (``True`` is not one), or
            ``error_feedback`` is not a bool.
        ValueError: ``block_size`` is below 1.
    """

    def __init__(self,
                 process_group: Optional[dist.ProcessGroup] = None,
                 block_size: int = 256,
                 error_feedback: bool = True,
                 node_groups: Optional[NodeGroups] = None) -> None:
        require_int('block_size', block_size, minimum=1)
        require_bool('error_feedback', error_feedback)
        if node_groups is not None and not isinstance(node_groups, NodeGroups):
            raise TypeError('node_groups should be a NodeGroups (from '
                            'make_node_groups) or None, but got '
                            f'{type(node_groups).__name__}')
        self.process_group = process_group
        self.node_groups = node_groups
        self.block_size = int(block_size)  # numpy's ints count too
        self.error_feedback = error_feedback
        # bucket index -> (((parameter id, numel), ...) in bucket order,
        # fp32 residual of the bucket).
        self._residuals: Dict[int, Tuple[tuple, torch.Tensor]] = {}
        # parameter id -> fp32 residual, while no bucket holds it.
        self._pending: Dict[int, torch.Tensor] = {}
        # parameter id -> number of its first block (owner of block b:
        # (first + b) % world_size); the next free number.
        self._firsts: Dict[int, int] = {}
        self._next_block = 0
        # bucket index -> (layout, Int8BucketPlan).
        self._plans: Dict[int, Tuple[tuple, Int8BucketPlan]] = {}

    def __repr__(self) -> str:
        # The form (flat or two-level) is the log line's topology part.
        return (f'Int8State(block_size={self.block_size}, '
                f'error_feedback={self.error_feedback})')

    def exchange_size(self) -> int:
        """Ranks of the int8 exchange: the group's, or in the two-level
        form the number of nodes (what :meth:`collectives` counts on)."""
        if self.node_groups is not None:
            return self.node_groups.layout.num_nodes
        return group_or_world(self.process_group).size()

    def quantized_bytes(self, bucket: dist.GradBucket) -> int:
        """Bytes of the quantized form of ``bucket``: the int8 payload plus
        4 bytes per block scale, plus at most 3 bytes of alignment per
        owner (what the all-to-all scatters)."""
        plan = self._plan(bucket, _layout(bucket))
        return (plan.cross
                if isinstance(plan, TwoLevelPlan) else plan).send_bytes

    def collectives(self, bucket: dist.GradBucket) -> List[Tuple[str, int]]:
        """What the hook issues for ``bucket``, as ``(kind, bytes)``: the
        all-to-all of the whole quantized bucket, then the all-gather of
        this rank's part (padded to the largest owner's). The telemetry
        counts them by the one counting rule
        (:mod:`mmcv_custom.comm.traffic`), as the cost model does, on
        :meth:`exchange_size` ranks. In the two-level form, those of the
        exchange across nodes: what the node's link carries (the fp32
        traffic inside the node is left out)."""
        plan = self._plan(bucket, _layout(bucket))
        if isinstance(plan, TwoLevelPlan):
            plan = plan.cross
        return [('all_to_all', plan.send_bytes), ('all_gather', plan.padded)]

    def _plan(self, bucket: dist.GradBucket, layout: tuple):
        """The bucket's :class:`Int8BucketPlan` (a :class:`TwoLevelPlan`
        in the two-level form), built for a new layout.

        Parameters met for the first time are numbered in bucket order, the
        same on every rank (and, in a fresh run, the same in every run of
        the same model: DDP's first layout follows the parameters' order).
        """
        kept = self._plans.get(bucket.index())
        if kept is not None and kept[0] == layout:
            return kept[1]
        pieces = self._pieces(bucket, layout)
        if self.node_groups is not None:
            plan = TwoLevelPlan(pieces, self.node_groups, self.block_size)
        else:
            group = group_or_world(self.process_group)
            plan = Int8BucketPlan(pieces, group.size(), group.rank(),
                                  self.block_size)
        self._plans[bucket.index()] = (layout, plan)
        return plan

    def _pieces(self, bucket: dist.GradBucket,
                layout: tuple) -> List[Tuple[int, int, int]]:
        """The bucket's parameters as ``(offset, numel, first block)``."""
        buffer = bucket.buffer()
        if sum(numel for _, numel in layout) != buffer.numel():
            # Not parameter after parameter (no such bucket is known): the
            # bucket as one piece, still the same on every rank.
            return [(0, buffer.numel(), 0)]
        pieces, offset = [], 0
        for pid, numel in layout:
            if pid not in self._firsts:
                self._firsts[pid] = self._next_block
                self._next_block += ceil_div(numel, self.block_size)
            pieces.append((offset, numel, self._firsts[pid]))
            offset += numel
        return pieces

    # -- error feedback across bucket layouts ----------------------------
    def _residual(self, bucket: dist.GradBucket,
                  layout: tuple) -> torch.Tensor:
        """The bucket's fp32 residual in its ``layout`` (zeros where
        nothing is known yet)."""
        buffer = bucket.buffer()
        kept = self._residuals.get(bucket.index())
        if kept is not None and kept[0] == layout:
            return kept[1]
        ids = {pid for pid, _ in layout}
        if kept is not None or any(pid in ids
                                   for old, _ in self._residuals.values()
                                   for pid, _ in old):
            # DDP laid its buckets out again: every residual goes to
            # per-parameter form once, then each new bucket takes its own.
            self._to_params()
        residual = torch.zeros(
            buffer.numel(), dtype=torch.float32, device=buffer.device)
        if sum(numel for _, numel in layout) == buffer.numel():
            offset = 0
            for pid, numel in layout:
                saved = self._pending.pop(pid, None)
                if saved is not None:
                    residual[offset:offset + numel].copy_(saved.reshape(-1))
                offset += numel
        self._residuals[bucket.index()] = (layout, residual)
        return residual

    def _to_params(self) -> None:
        """Cut every bucket's residual into per-parameter pieces."""
        for layout, residual in self._residuals.values():
            self._pending.update(_split(layout, residual))
        self._residuals.clear()

    # -- checkpoints -------------------------------------------------------
    def state_dict(self, names: Dict[torch.Tensor, str]) -> dict:
        """This rank's residuals per parameter name, on the CPU.

        Each rank saves its own: the residuals differ between ranks (each
        holds what its own quantization dropped).

        Args:
            names (dict): Parameter -> name, e.g.
                ``{p: n for n, p in ddp.module.named_parameters()}``.
        """
        by_id = {id(p): n for p, n in names.items()}
        per_param = dict(self._pending)
        for layout, residual in self._residuals.values():
            per_param.update(_split(layout, residual))
        return dict(
            version=_VERSION,
            world_size=group_or_world(self.process_group).size(),
            block_size=self.block_size,
            error_feedback=self.error_feedback,
            # Informative only: a residual is an addend of the average in
            # either form, so it carries over between them.
            topology=('flat' if self.node_groups is None else
                      self.node_groups.describe()),
            params={
                by_id[pid]: r.detach().cpu().clone()
                for pid, r in per_param.items() if pid in by_id
            },
            first_blocks={
                by_id[pid]: first
                for pid, first in self._firsts.items() if pid in by_id
            })

    def load_state_dict(self, saved: dict, names: Dict[torch.Tensor,
                                                       str]) -> None:
        """Restore :meth:`state_dict`'s output, before the first step.

        The residuals are laid out for whatever buckets DDP builds. Nothing
        is changed when ``saved`` does not fit.

        Raises:
            ValueError: ``saved`` is not such a dict, was saved with
                another world size (each rank's residual is its share of
                the dropped mass: they do not carry over to another number
                of ranks), holds residuals while ``error_feedback`` is
                off, or names a parameter ``names`` lacks or of another
                size.
        """
        self.check_state_dict(saved, names)
        by_name = {n: p for p, n in names.items()}
        self._residuals.clear()
        self._pending = {
            id(by_name[name]): r.float().reshape(-1)
            for name, r in saved['params'].items()
        }
        # The saved numbering, so that every block keeps its owner (and
        # the run stays bit for bit) even if the buckets are cut otherwise.
        firsts = saved.get('first_blocks', {})
        if firsts and self.block_size == saved.get('block_size'):
            self._plans.clear()
            self._firsts = {id(by_name[n]): f for n, f in firsts.items()}
            self._next_block = max(
                f + ceil_div(by_name[n].numel(), self.block_size)
                for n, f in firsts.items())

    def check_state_dict(self, saved, names: Dict[torch.Tensor, str]) -> None:
        """Raise ``ValueError`` (see :meth:`load_state_dict`) if ``saved``
        does not fit; change nothing."""
        if not isinstance(saved, dict):
            raise ValueError('expected an Int8State.state_dict(), but got '
                             f'{type(saved).__name__}')
        if saved.get('version') not in _READS:
            raise ValueError(f'int8 state version {saved.get("version")!r} '
                             f'is not one of {_READS}')
        world_size = group_or_world(self.process_group).size()
        if saved.get('world_size') != world_size:
            raise ValueError(
                f'the int8 residuals were saved on {saved.get("world_size")!r}'
                f' ranks and cannot be used on {world_size}; start without '
                'them')
        by_name = {n: p for p, n in names.items()}
        params = saved.get('params')
        if not isinstance(params, dict):
            raise ValueError('the saved int8 state holds no per-parameter '
                             'residuals')
        if params and not self.error_feedback:
            raise ValueError('the saved int8 state holds residuals, but '
                             'error_feedback is False here: nothing would '
                             'use them')
        unknown = sorted(set(params) - set(by_name))
        if unknown:
            raise ValueError('the saved int8 residuals have parameters this '
                             f'model does not: {unknown[:5]}')
        for name, residual in params.items():
            if not (isinstance(residual, torch.Tensor)
                    and residual.numel() == by_name[name].numel()):
                raise ValueError(f'the int8 residual of {name} does not fit '
                                 'the parameter')
        firsts = saved.get('first_blocks', {})
        if not isinstance(firsts, dict) or not all(
                isinstance(f, int) and not isinstance(f, bool) and f >= 0
                for f in firsts.values()):
            raise ValueError('the saved int8 block numbers are not a dict of '
                             'ints >= 0')
        unknown = sorted(set(firsts) - set(by_name))
        if unknown:
            raise ValueError('the saved int8 block numbers have parameters '
                             f'this model does not: {unknown[:5]}')


class Int8StateKeeper(HookStateKeeper):
    """The :class:`~mmcv_custom.hooks.state.HookStateKeeper` of
    :class:`Int8State`. The state already follows DDP's bucket layouts
    itself, so this only names its parameters.

    Args:
        state (Int8State): The hook's state.
        names (dict): Parameter -> name of the DDP model.
    """

    #: What a restore brings back, for the log.
    RESTORED = 'error feedback'
    FRESH_NOTE = 'error feedback from zero'
    FEEDBACK_KEY = 'error_feedback'

    @classmethod
    def file_bytes(cls, params, state_kwargs: dict) -> int:
        """The residual is fp32 whatever the gradients' dtype (a bf16
        backbone's too): 4 bytes a trainable value, or none without
        feedback."""
        if state_kwargs.get(cls.FEEDBACK_KEY, True) is False:
            return 0
        return sum(4 * p.numel() for p in params if p.requires_grad)

    def __init__(self, state: Int8State, names: Dict[torch.Tensor,
                                                     str]) -> None:
        self.state = state
        self.names = names

    def state_dict(self) -> dict:
        return self.state.state_dict(self.names)

    def check_state_dict(self, saved) -> None:
        self.state.check_state_dict(saved, self.names)

    def load_state_dict(self, saved: dict) -> None:
        self.state.load_state_dict(saved, self.names)

    def start_fresh(self, steps_done: int) -> None:
        """Forget every residual (the saved ones could not be used)."""
        self.state._residuals.clear()
        self.state._pending = {}


def int8_compress_hook(
        state: Int8State,
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as blockwise int8 (see the module docstring).

    Works for fp32 and bf16 buckets (the buffer keeps its dtype; the math is
    fp32) on gloo and NCCL. Only bytes cross the wire and the sums are
    taken locally, so no backend needs to reduce bf16 (no NCCL >= 2.10
    rule, unlike ``bf16_compress``). The hook waits for its all-to-all
    before it sums: for a CPU bucket that wait, and all the rest of the
    bucket's work, runs on :mod:`mmcv_custom.hooks.worker`'s thread, one
    bucket after another in DDP's order, so the backward pass goes on
    meanwhile and every rank issues its collectives in the same order.
    (A collective started from a future's callback instead would run on
    gloo's worker threads, where several buckets' collectives can be
    issued in different orders on different ranks.)

    Error: each element of the average is off by at most half a first-phase
    step of its block summed over the ranks, plus half the second-phase
    step of its block (``scale / 2`` each); with error feedback the error
    is carried into the next step instead of lost.

    Args:
        state (Int8State): Settings and error feedback; one per DDP model.
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the bucket's own buffer, in its original
        dtype, holding the average.

    Raises:
        TypeError: ``state`` is not an :class:`Int8State` (a process group
            or None has nowhere to keep the error feedback).
    """
    if not isinstance(state, Int8State):
        raise TypeError(
            'int8_compress_hook needs an Int8State, e.g. '
            'ddp.register_comm_hook(Int8State(process_group), '
            f'int8_compress_hook), but got {type(state).__name__}: {state!r}')
    # The all-gather is issued before _int8_reduce returns; its future only
    # decodes: the worker goes on to the next bucket meanwhile.
    return run_on_comm_worker(
        lambda: _int8_reduce(state, bucket), bucket, wait=False)


def _int8_reduce(state: Int8State,
                 bucket: dist.GradBucket) -> torch.futures.Future:
    """The hook's work on one bucket; waits for the first phase, leaves
    the all-gather in flight."""
    group = group_or_world(state.process_group)
    world_size, rank = group.size(), group.rank()
    buffer = bucket.buffer()
    numel, device = buffer.numel(), buffer.device
    layout = _layout(bucket)
    plan = state._plan(bucket, layout)
    if isinstance(plan, TwoLevelPlan):
        return two_level_reduce(
            state.node_groups, bucket, plan,
            state._residual(bucket, layout) if state.error_feedback else None)

    # This rank's share (the bucket times 1 / world_size, plus the residual
    # of earlier steps), quantized into the owners' segments in one pass.
    # Each owner sums its blocks over the ranks and quantizes the sum; the
    # owner feeds back what this rounding drops (see Int8State).
    x = buffer if buffer.dtype is torch.float32 else buffer.float()
    residual = (
        state._residual(bucket, layout) if state.error_feedback else None)
    out = exchange_and_requantize(plan, x, 1.0 / world_size, residual, rank,
                                  world_size, group, buffer.dtype)

    gathered = torch.empty(
        world_size * plan.padded, dtype=torch.uint8, device=device)
    fut = all_gather_single(
        gathered, out, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        # In place into the bucket's own buffer when it is fp32: no second
        # full-size copy at peak memory (pytorch/pytorch#45968).
        target = buffer if buffer.dtype is torch.float32 else torch.empty(
            numel, dtype=torch.float32, device=device)
        int8_codec.dequantize_blocks(gathered, plan.gather, target)
        if target is not buffer:
            buffer.copy_(target)
        return buffer

    return fut.then(decompress)
