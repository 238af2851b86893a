"""DDP communication hooks that all-reduce gradient buckets in half precision.

Every hook here follows PyTorch's communication-hook contract
(``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``), so it can be
registered on any plain :class:`torch.nn.parallel.DistributedDataParallel`
with ``ddp.register_comm_hook(process_group, hook)``; nothing here imports
MMEngine. ``process_group`` may be ``None``, meaning the default (WORLD)
group.

The compressing hooks halve the bytes on the wire: a bucket of fp32 gradients
is sent as fp16 or bf16 and written back into the bucket's own fp32 buffer, so
the optimizer still sees full-precision tensors. The difference from
PyTorch's built-ins of the same names:

* the average is taken *before* the cast and in the bucket's own precision,
  so fp16 does not overflow when one rank's raw gradient exceeds 65504 while
  the mean fits;
* the bf16 hooks register on gloo (CPU clusters): PyTorch's DDP refuses any
  hook *named* ``bf16_compress_hook`` unless CUDA and NCCL >= 2.10 are present,
  a rule meant for NCCL. We check the backend the bucket actually uses instead
  and raise the same kind of error on an NCCL that is too old;
* the wrappers resolve to the bucket's original (fp32) buffer rather than to
  a half-precision copy;
* a bucket that is already fp16 or bf16 (a bf16 backbone's, as InternVL
  trains it) is sent as it is by every hook and wrapper here: the same bytes,
  one rounding fewer, and bf16 gradients are never squeezed into fp16's much
  smaller range. So ``fp16_compress_hook`` on a model with a bf16 backbone
  sends the backbone's buckets as bf16 and the fp32 head's as fp16.

The scaling casts themselves, and the optional C kernel that does them on
CPU, are in :mod:`.cast`.

Example:
    >>> from mmcv_custom.hooks import bf16_compress_hook
    >>> ddp_model.register_comm_hook(None, bf16_compress_hook)
"""
import functools
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from . import cast
from .half_two_level import two_level_compress
from .topology import NodeGroups
from .util import named_after
from .validation import require_bool, require_real
from .worker import run_on_comm_worker

__all__ = [
    'allreduce_hook',
    'fp16_compress_hook',
    'bf16_compress_hook',
    'fp16_compress_wrapper',
    'bf16_compress_wrapper',
    'check_bf16_support',
    'CompressState',
    'default_predivide_factor',
    'require_wire_dtype',
    'check_compress_args',
    'group_or_world',
    'require_dtype_support',
    'wire_dtype_for',
]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]

# NCCL only reduces bfloat16 from this version on.
_NCCL_BF16_MIN_VERSION = (2, 10)


def group_or_world(process_group: Optional[dist.ProcessGroup]):
    """The group a hook reduces over: ``process_group``, or WORLD for None.

    DDP hands a hook ``None`` when it was registered with ``None``; every
    hook of this package resolves it here.
    """
    return process_group if process_group is not None else dist.group.WORLD


@functools.lru_cache(maxsize=None)
def _nccl_version() -> Optional[tuple]:
    if not dist.is_nccl_available():
        return None
    return tuple(torch.cuda.nccl.version())


def _uses_nccl(process_group: Optional[dist.ProcessGroup],
               device: Optional[torch.device]) -> bool:
    """Whether NCCL carries tensors on ``device`` (None: any CUDA device)."""
    backend = str(dist.get_backend(group_or_world(process_group)))
    # A mixed backend reads e.g. 'cpu:gloo,cuda:nccl': NCCL only carries the
    # CUDA tensors.
    return 'nccl' in backend and (device is None or device.type == 'cuda')


def check_bf16_support(process_group: Optional[dist.ProcessGroup] = None,
                       device: Optional[torch.device] = None) -> None:
    """Raise ``TypeError`` if the group cannot all-reduce bfloat16 tensors.

    Gloo (and MPI) reduce bfloat16 on any torch this project supports; NCCL
    needs version 2.10 or newer for tensors on CUDA devices. The bf16 hooks
    call this for each bucket (a string comparison on gloo); the MMEngine
    runner hook calls it at registration so a bad setup fails before the
    first step.

    Args:
        process_group (ProcessGroup, optional): The group the hook reduces
            over. Defaults to None (WORLD).
        device (torch.device, optional): Device of the gradients. Defaults to
            None, meaning CUDA when the backend is NCCL.
    """
    if not _uses_nccl(process_group, device):
        return
    version = _nccl_version()
    if version is None or version < _NCCL_BF16_MIN_VERSION:
        raise TypeError(
            'bf16 gradient compression on the NCCL backend needs NCCL >= '
            f'2.10, but this torch has NCCL {version}. Use fp16_compress / '
            "wrapper='fp16' instead, or a torch built with a newer NCCL.")


def require_dtype_support(dtype: torch.dtype,
                          process_group: Optional[dist.ProcessGroup],
                          device: torch.device) -> None:
    """Raise ``TypeError`` if the group cannot reduce ``dtype`` on ``device``.

    Only bfloat16 has a requirement (see :func:`check_bf16_support`); the
    hooks and the FSDP2 reduce-scatter call this with the dtype they are
    about to send.
    """
    if dtype is torch.bfloat16:
        check_bf16_support(process_group, device)


def allreduce_hook(
        process_group: Optional[dist.ProcessGroup],
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one full-precision ``all_reduce``.

    Equivalent to DDP without any hook: a reference point for the
    compressing hooks and the inner hook of the wrappers. The bucket is
    divided by the world size *before* the reduction so that the sum of
    ``world_size`` large gradients cannot overflow.

    Args:
        process_group (ProcessGroup, optional): Group to average over; None
            means WORLD.
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the averaged bucket buffer.
    """
    group = group_or_world(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def default_predivide_factor(world_size: int) -> int:
    """FSDP's split of the averaging division around an fp16 all-reduce.

    ``f`` starts at 1 and doubles while it divides ``world_size`` and is
    below ``world_size / f``, ending near the square root: gradients are
    divided by ``f`` before the reduction and by ``world_size / f`` after
    it. Dividing
    everything before (``f = world_size``) can never overflow a sum whose
    mean fits, but flushes gradients below about ``6e-8 * world_size`` to
    zero; dividing everything after keeps small values but overflows once
    the *sum* passes 65504. The split bounds both. For two ranks it is 2:
    everything before.
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


def check_compress_args(predivide_factor: Any = None,
                        check_finite: Any = False) -> None:
    """Raise unless the arguments make a valid :class:`CompressState`.

    ``TypeError`` for a wrong type, ``ValueError`` for a value out of range,
    each naming the argument, the rule and the value. ``bool`` is not taken
    for a number (``True`` would divide by 1), nor is any truthy value for
    ``check_finite`` (``'no'`` would turn the check on). The registry runs
    the same check on a ``comm_hook`` config before anything is built.
    """
    require_real(
        'predivide_factor',
        predivide_factor,
        minimum=0,
        inclusive=False,
        allow_none=True)
    require_bool('check_finite', check_finite)


class CompressState:
    """Optional state of the compressing hooks: range guard and counters.

    Pass it where the hooks take ``process_group``:
    ``ddp.register_comm_hook(CompressState(group), fp16_compress_hook)``.
    The MMEngine runner hook builds one from
    ``comm_hook = dict(type='fp16_compress', predivide_factor=..., ...)``.

    Args:
        process_group (ProcessGroup, optional): Group to average over.
            Defaults to None (WORLD).
        predivide_factor (float, optional): fp16 only: divide by this before
            the all-reduce and by ``world_size / predivide_factor`` after.
            Defaults to None, meaning :func:`default_predivide_factor`. Set
            it to the world size to rule out overflow of the sum, at the
            cost of flushing more small gradients to zero. bf16, which has
            fp32's range, always divides everything before.
        check_finite (bool): Record buckets whose averaged gradients hold
            inf or NaN; :meth:`pop_nonfinite` returns them. The check stays
            on the device (no synchronisation in the hook). Defaults to
            False; the runner hook turns it on for fp16 and reports every
            occurrence.
        wire (str, optional): ``'fp16'`` or ``'bf16'``: the hook it goes
            with, so that its description (the runner hook's log line)
            says only what applies. Defaults to None: not said.
        node_groups (NodeGroups, optional): Reduce in two levels over these
            groups: in the bucket's own precision inside the node, in half
            precision only across nodes (see :mod:`.half_two_level`).
            Defaults to None: one all-reduce over the whole group.

    Raises:
        TypeError: ``predivide_factor`` is neither None nor a real number
            (``True`` is not one), or ``check_finite`` is not a bool.
        ValueError: ``predivide_factor`` is not finite and > 0, ``wire`` is
            not one of the above, or a ``predivide_factor`` is given for
            ``wire='bf16'``.
    """

    def __init__(self,
                 process_group: Optional[dist.ProcessGroup] = None,
                 predivide_factor: Optional[float] = None,
                 check_finite: bool = False,
                 *,
                 wire: Optional[str] = None,
                 node_groups: Optional[NodeGroups] = None) -> None:
        check_compress_args(predivide_factor, check_finite)
        if node_groups is not None and not isinstance(node_groups, NodeGroups):
            raise TypeError('node_groups should be a NodeGroups (from '
                            'make_node_groups) or None, but got '
                            f'{type(node_groups).__name__}')
        if wire not in (None, 'fp16', 'bf16'):
            raise ValueError(f"wire should be 'fp16', 'bf16' or None, but "
                             f'got {wire!r}')
        if wire == 'bf16' and predivide_factor is not None:
            raise ValueError(
                f'predivide_factor applies to fp16 only, but got '
                f"{predivide_factor!r} with wire='bf16': bf16 has fp32's "
                'range and always divides by the world size before the cast')
        self.process_group = process_group
        self.predivide_factor = predivide_factor
        self.check_finite = check_finite
        self.wire = wire
        self.node_groups = node_groups
        # bucket index -> (parameters, flag on the device). One entry per
        # bucket, or-ed until popped, so memory stays bounded.
        self._nonfinite: dict = {}
        # bucket index -> half-precision send buffer (CPU only).
        self._wire: dict = {}
        self._reuse_buffers = True

    def _world_size(self) -> Optional[int]:
        """The group's size, or None while no process group exists."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            size = dist.get_world_size(self.process_group)
        except (RuntimeError, ValueError):
            return None
        return size if size >= 1 else None

    def __repr__(self) -> str:
        # The form (flat or two-level) is the log line's topology part.
        end = f'check_finite={self.check_finite})'
        if self.wire == 'bf16':
            # predivide_factor does not apply: say what bf16 does instead.
            return ('CompressState(divides by the world size before the '
                    f'bf16 cast, {end}')
        if self.predivide_factor is not None:
            factor = repr(self.predivide_factor)
        else:
            # The value in effect, once the group (and its size) exists.
            size = self._world_size()
            ranks = f"{size} rank{'s' if size != 1 else ''}"
            factor = (f'{default_predivide_factor(size)} (default for '
                      f'{ranks})' if size is not None else
                      'default_predivide_factor(world size)')
        if self.wire is None:
            factor += ' (fp16 only)'
        return f'CompressState(predivide_factor={factor}, {end}'

    def factors(self, dtype: torch.dtype, world_size: int):
        """``(before, after)`` divisors of the average for ``dtype``."""
        if dtype is not torch.float16:
            return world_size, 1
        before = (
            self.predivide_factor if self.predivide_factor is not None else
            default_predivide_factor(world_size))
        return before, world_size / before

    def _wire_buffer(self, index: int, like: torch.Tensor,
                     dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The half-precision buffer bucket ``index`` is sent in, kept from
        step to step on CPU, where a fresh allocation of a large bucket
        costs page faults on every step (GPUs have a caching allocator, and
        keeping every bucket's copy there would raise peak memory). Safe to
        reuse: DDP finishes a step's all-reduces before the next step
        starts, so give each DDP model its own state."""
        if like.device.type != 'cpu' or not self._reuse_buffers:
            return None
        buf = self._wire.get(index)
        if (buf is None or buf.numel() != like.numel() or buf.dtype != dtype):
            buf = self._wire[index] = torch.empty(
                like.numel(), dtype=dtype, device=like.device)
        return buf

    def pop_nonfinite(self) -> list:
        """Buckets found non-finite since the last call, and forget them.

        Returns:
            list[tuple[int, list[Tensor]]]: ``(bucket index, parameters)``
            for each occurrence. Synchronises with the device once.
        """
        found = [(index, params)
                 for index, (params, flag) in sorted(self._nonfinite.items())
                 if bool(flag)]
        self._nonfinite.clear()
        return found


_TWO_BYTE_FLOATS = (torch.float16, torch.bfloat16)


def require_wire_dtype(wire_dtype: Optional[torch.dtype]) -> None:
    """Raise ``ValueError`` unless ``wire_dtype`` is a half-precision
    dtype or None (the gradients' own), what the FSDP2 forms send."""
    if wire_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError('wire_dtype should be torch.float16, '
                         f'torch.bfloat16 or None, but got {wire_dtype}')


def wire_dtype_for(dtype: torch.dtype, buffer: torch.Tensor) -> torch.dtype:
    """What a hook compressing to ``dtype`` sends ``buffer`` as.

    A bucket already in a 2-byte float (a bf16 backbone's, say) goes out as
    it is: the same bytes as a cast, without a second rounding, and never
    from bf16 into fp16, whose range is far smaller (it would overflow above
    65504 and flush values below about 6e-8 to zero).
    """
    return buffer.dtype if buffer.dtype in _TWO_BYTE_FLOATS else dtype


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """Whether ``tensor`` holds inf or NaN, as a bool on its device.

    One read of the tensor: its minimum and maximum, which take on any NaN
    and reach any inf, are finite exactly when every element is.
    ``~torch.isfinite(t).all()`` gives the same answer but builds four
    bucket-sized temporaries on the way (``t == t``, ``t.abs()``, its
    comparison with inf, their product) and reads them back: on CPU,
    where each is a fresh allocation, up to 13 times a copy of the bucket,
    which made the fp16 step 1.5x PyTorch's.
    """
    if tensor.numel() == 0:  # aminmax refuses an empty tensor
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def _record_nonfinite(state: 'CompressState', bucket: dist.GradBucket,
                      buffer: torch.Tensor) -> None:
    """Mark ``bucket`` when its average is not finite (on the device)."""
    flag = _nonfinite(buffer)
    seen = state._nonfinite.get(bucket.index())
    if seen is not None:
        flag = flag | seen[1]
    state._nonfinite[bucket.index()] = (bucket.parameters(), flag)


def _compress_hook(dtype: torch.dtype, state, bucket: dist.GradBucket):
    """Average ``bucket`` on the wire in ``dtype``; the shared core of the
    fp16 and bf16 hooks. ``state`` is a process group, None or a
    :class:`CompressState`."""
    if not isinstance(state, CompressState):
        state = CompressState(state, check_finite=False)
        state._reuse_buffers = False  # nowhere to keep them
    group = group_or_world(state.process_group)
    buffer = bucket.buffer()
    wire = wire_dtype_for(dtype, buffer)
    require_dtype_support(wire, group, buffer.device)
    before, after = state.factors(wire, group.size())
    if state.node_groups is not None:
        # Three collectives that wait for each other: on the worker, in
        # bucket order, while the backward goes on.
        return run_on_comm_worker(
            lambda: two_level_compress(wire, state, bucket, before, after,
                                       _record_nonfinite),
            bucket,
            wait=False)

    if buffer.dtype is wire:
        # Already 2 bytes an element (a bf16 backbone's bucket): average it
        # as it is, like DDP's own all-reduce: one rounding, no copy, no
        # fp32 round trip.
        buffer.mul_(1.0 / before)

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            if after != 1:
                buffer.mul_(1.0 / after)
            if state.check_finite:
                _record_nonfinite(state, bucket, buffer)
            return buffer

        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return fut.then(finish)

    # Divide in the buffer's own precision, then cast: the quotient is
    # computed in fp32 and only then rounded to half. Casting first (as
    # PyTorch's hooks do) turns a gradient above 65504 into inf in fp16 even
    # when the average across ranks is well inside the range.
    compressed = cast.compress(
        buffer, before, dtype, state._wire_buffer(bucket.index(), buffer,
                                                  dtype))

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        cast.decompress(fut.value()[0], buffer, after)
        if state.check_finite:
            _record_nonfinite(state, bucket, buffer)
        return buffer

    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return fut.then(decompress)


def fp16_compress_hook(
        process_group: Union[dist.ProcessGroup, 'CompressState', None],
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as float16 on the wire, keeping it fp32 locally.

    The division by the world size happens in fp32 before the cast, split
    around the reduction for large groups (see
    :func:`default_predivide_factor`): with two ranks all of it before, so
    the hook only overflows when the *mean* itself exceeds fp16's 65504.
    Gradients below fp16's subnormal range (about 6e-8 after division) are
    flushed to zero. Pass a :class:`CompressState` as ``process_group`` to
    choose the split and to record non-finite buckets. Prefer bf16 when
    gradients span a wide range. A bf16 bucket is averaged in bf16 as it
    is, never cast to fp16 (see the module docstring).

    Args:
        process_group (ProcessGroup | CompressState, optional): Group to
            average over, or a state holding it; None means WORLD.
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the bucket's own buffer, in its original
        dtype, holding the average.

    Example:
        >>> ddp_model.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(
        process_group: Union[dist.ProcessGroup, 'CompressState', None],
        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as bfloat16 on the wire, keeping it fp32 locally.

    bfloat16 has fp32's exponent range, so it neither overflows nor flushes
    small gradients; it keeps 8 significant bits (relative rounding error
    up to 2**-9). Works on gloo and MPI, and on NCCL >= 2.10; an older NCCL
    raises ``TypeError`` at the first bucket.

    Args:
        process_group (ProcessGroup | CompressState, optional): Group to
            average over, or a state holding it; None means WORLD.
        bucket (GradBucket): The flattened gradients DDP hands to the hook.

    Returns:
        Future[Tensor]: Resolves to the bucket's own buffer, in its original
        dtype, holding the average.

    Example:
        >>> ddp_model.register_comm_hook(None, bf16_compress_hook)
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


def _compress_wrapper(dtype: torch.dtype, hook: CommHook) -> CommHook:
    """Run ``hook`` on a ``dtype`` copy of the bucket; the shared core of
    both wrappers."""
    if not callable(hook):
        raise TypeError(
            f'The hook to wrap must be callable, but got {type(hook)}')

    def _half_precision_wrapped_hook(
            state: Any,
            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        wire = wire_dtype_for(dtype, buffer)
        if wire is torch.bfloat16:
            pg = getattr(state, 'process_group', state)
            if pg is None or isinstance(pg, dist.ProcessGroup):
                require_dtype_support(wire, pg, buffer.device)
        if buffer.dtype is wire:
            # Already 2 bytes an element: the wrapped hook takes it as is.
            return hook(state, bucket)
        # The wrapped hook reads the half-precision copy through the bucket
        # (``buffer()`` and ``gradients()`` are views of it), so it reduces
        # and returns half precision.
        bucket.set_buffer(cast.compress(buffer, 1, dtype))
        fut = hook(state, bucket)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            return cast.decompress(fut.value(), buffer)

        return fut.then(decompress)

    # DDP identifies PyTorch's own bf16 wrapper by the inner function's
    # __name__ and refuses it on gloo; ours has a name of its own (see the
    # module docstring). __qualname__ is what DDP logs: make it readable.
    prefix = 'fp16' if dtype is torch.float16 else 'bf16'
    return named_after(_half_precision_wrapped_hook, hook,
                       f'{prefix}_compress_wrapper({{}})')


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Make any communication hook reduce in float16.

    The bucket is cast to fp16 before ``hook`` runs and the result is copied
    back into the bucket's original buffer. Unlike
    :func:`fp16_compress_hook`, the cast happens *before* the wrapped hook
    averages, so a raw gradient above 65504 becomes inf; use
    :func:`bf16_compress_wrapper` when gradients can be that large. A
    bucket already in fp16 or bf16 reaches ``hook`` as it is.

    Args:
        hook (Callable): A communication hook ``hook(state, bucket)``, for
            example PyTorch's ``powerSGD_hook``.

    Returns:
        Callable: A hook with the same state argument as ``hook``.

    Example:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import (
        ...     powerSGD_hook as powerSGD)
        >>> state = powerSGD.PowerSGDState(
        ...     process_group=None, orthogonalization_epsilon=1e-6)
        >>> ddp_model.register_comm_hook(
        ...     state, fp16_compress_wrapper(powerSGD.powerSGD_hook))
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """Make any communication hook reduce in bfloat16.

    Same as :func:`fp16_compress_wrapper` with bfloat16, which keeps fp32's
    range. Needs gloo, MPI, or NCCL >= 2.10.

    Args:
        hook (Callable): A communication hook ``hook(state, bucket)``.

    Returns:
        Callable: A hook with the same state argument as ``hook``.
    """
    return _compress_wrapper(torch.bfloat16, hook)


# PyTorch's DDP refuses, by function name, hooks called bf16_compress_hook or
# bf16_compress_wrapper_hook unless CUDA and NCCL >= 2.10 are present. That
# test is about NCCL but also blocks gloo, which reduces bf16 fine. Our hook
# checks the backend it actually runs on (check_bf16_support), so it carries
# its own function name; the module attribute and __qualname__ (used by pickle
# and by DDP's logging) keep the public name.
bf16_compress_hook.__name__ = '_bf16_compress_hook_any_backend'
