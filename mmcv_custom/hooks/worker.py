"""One communication thread per process, so that no hook holds up backward.

DDP calls a communication hook on the autograd thread as soon as a bucket's
gradients are ready, and expects a future back at once: the next buckets'
gradients are computed while the first bucket travels. A hook that must
*wait* for a collective before it can go on (the int8 hook between its
all-to-all and its all-gather; batched PowerSGD between its two
all-reduces; PyTorch's PowerSGD on gloo, which must finish a bucket before
the next one is started, see below) would stop the backward pass for the
whole round trip if it waited there. Here it waits on this module's worker
thread instead, and the autograd thread goes on at once.

Why one thread, taking buckets first come first served: collectives on a
process group must be issued in the same order on every rank. DDP hands
buckets to its hook in the same order on every rank (bucket index order),
and one thread that runs them one after the other issues their collectives
in that order. Issuing a collective from a future's callback instead (what
PyTorch's PowerSGD does, and what ``.then()`` chains do) runs it on one of
gloo's own threads, where two buckets' callbacks can race and the ranks
disagree on the order (pytorch/pytorch#48478): gloo then aborts with
"Received data size doesn't match expected size" or hangs.

Why the last bucket waits: once DDP has handed over its last bucket it may
issue collectives of its own on the same group from the autograd thread
(the used-parameter map with ``find_unused_parameters=True`` or in a static
graph's first iteration). If the worker were still issuing a bucket's
collectives then, the two threads' collectives could interleave
differently on different ranks. So :func:`run_on_comm_worker` returns for
the last bucket only when the worker has issued every bucket's collectives
(a bucket whose future's callbacks issue more is waited for whole): nothing
is lost, since DDP waits for every bucket right after anyway.

Why a failure stops the worker for good: if one rank fails in the middle
of a bucket, its peers are left waiting in a collective it never joined.
Sending the next bucket would pair that rank's next collective with its
peers' pending one: wrong bytes, or a silent wrong sum when the sizes
match. So after a failure every later bucket fails at once, naming the
first error; the rank raises out of ``backward()``, and its peers get an
error as soon as its process ends and its connections close, instead of
waiting for the group's timeout.

Only CPU buckets go to the worker. On CUDA a collective returns as soon as
it is queued on a stream (NCCL's waits are the GPU's, not the CPU's), so
the hooks already run there without holding up the CPU.

Nothing here imports MMEngine.
"""
import os
import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .util import named_after

__all__ = ['run_on_comm_worker', 'on_comm_worker', 'on_worker_thread']


class _Worker:
    """The thread, its queue and the first failure."""

    def __init__(self) -> None:
        self.queue: 'queue.SimpleQueue' = queue.SimpleQueue()
        self.failure: Optional[BaseException] = None
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name='mmcv_custom-comm', daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            fn, wait, fut, issued = self.queue.get()
            try:
                if self.failure is not None:
                    raise RuntimeError(
                        'mmcv_custom: no bucket is communicated after an '
                        'earlier bucket failed on this rank (its peers may '
                        'still wait in that collective, and a later one '
                        'would be paired with it): '
                        f'{type(self.failure).__name__}: {self.failure}')
                result = fn()
                if wait:
                    result = _resolve(result)
            except BaseException as exc:  # noqa: B902 - handed to DDP
                if self.failure is None:
                    self.failure = exc
                fut.set_exception(exc)
            else:
                _hand_over(result, fut)
            finally:
                issued.set()


# What collectives' ``get_future()`` and ``then()`` return is the C++
# future; ``torch.futures.Future`` is a Python subclass of it.
_FUTURE_TYPES = (torch.futures.Future, torch._C.Future)


def _hand_over(result: Any, fut: torch.futures.Future) -> None:
    """Resolve ``fut`` with ``result``, or, when that is a future still
    in flight, with what it resolves to, once it does."""
    if not isinstance(result, _FUTURE_TYPES):
        fut.set_result(result)
        return

    def done(inner: torch.futures.Future) -> None:
        try:
            fut.set_result(_resolve(inner))
        except BaseException as exc:  # noqa: B902 - handed to DDP
            fut.set_exception(exc)

    result.add_done_callback(done)


def _resolve(result: Any) -> Any:
    """Wait for a hook's future on this thread; pass a tensor through."""
    while isinstance(result, _FUTURE_TYPES):
        result = result.wait()
    return result


_WORKER = _Worker()


def _forget_worker_in_child() -> None:
    # A forked child has no copy of the thread: it starts its own if needed.
    global _WORKER
    _WORKER = _Worker()


if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=_forget_worker_in_child)


def on_worker_thread() -> bool:
    """Whether the caller runs on this process's communication thread."""
    return threading.current_thread() is _WORKER.thread


def run_on_comm_worker(fn: Callable[[], Any],
                       bucket: dist.GradBucket,
                       wait: bool = True) -> torch.futures.Future:
    """Run ``fn`` (one bucket's communication) on the worker thread.

    ``fn`` takes no argument and returns the averaged bucket, or a future
    of it. Buckets are run in the order they are handed in, which for
    DDP's buckets is the same on every rank.

    Called on the worker thread itself (a hook inside a hook that already
    runs there), ``fn`` runs at once. A CUDA bucket also runs at once, on
    the caller's thread (see the module docstring).

    Args:
        fn (Callable): The bucket's work.
        bucket (GradBucket): The bucket, for its device and whether it is
            DDP's last.
        wait (bool): Whether the worker waits for the future ``fn``
            returns before it takes the next bucket: needed when that
            future's callbacks issue collectives (PyTorch's PowerSGD),
            which must not meet the next bucket's. False when ``fn`` has
            issued every collective of its bucket by the time it returns
            and the future only finishes them (the int8 hook's all-gather
            and decoding): the next bucket is then encoded while this one
            is still on the wire. Defaults to True.

    Returns:
        Future[Tensor]: Resolves to what ``fn`` resolves to, or to its
        exception. For DDP's last bucket, every collective of every bucket
        has been issued when it is returned.
    """
    if on_worker_thread() or bucket.buffer().device.type != 'cpu':
        result = fn()
        if isinstance(result, _FUTURE_TYPES):
            return result
        fut = torch.futures.Future()
        fut.set_result(result)
        return fut
    worker = _WORKER
    worker.start()
    fut = torch.futures.Future()
    issued = threading.Event()
    worker.queue.put((fn, wait, fut, issued))
    if bucket.is_last():
        # DDP may issue its own collectives on this group as soon as this
        # returns (see the module docstring): let the worker issue every
        # bucket's first. A failure stays in the future, for DDP to raise
        # at the end of backward like any hook's.
        issued.wait()
    return fut


def on_comm_worker(hook: Callable, wait: bool = True) -> Callable:
    """Wrap a communication hook to run on the worker thread.

    For hooks that wait for their own collectives (PyTorch's
    ``powerSGD_hook`` on gloo, whose later all-reduces start from future
    callbacks and so must not overlap another bucket's): with this wrapper
    the waiting happens on the worker, one bucket after another in DDP's
    order, while the backward pass goes on. Everything the wrapped hook
    does, its state's bookkeeping included, runs on the worker, in bucket
    order, so the result is bit for bit the hook's own.

    Args:
        hook (Callable): A communication hook ``hook(state, bucket)``.
        wait (bool): See :func:`run_on_comm_worker`. Defaults to True:
            the next bucket waits for this one's future.

    Returns:
        Callable: The same hook, run on the worker thread.

    Example:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import (
        ...     powerSGD_hook as powerSGD)
        >>> state = powerSGD.PowerSGDState(None)
        >>> ddp.register_comm_hook(state, on_comm_worker(
        ...     powerSGD.powerSGD_hook))
    """
    if not callable(hook):
        raise TypeError(
            f'The hook to wrap must be callable, but got {type(hook)}')

    def _comm_worker_hook(state: Any, bucket: dist.GradBucket):
        return run_on_comm_worker(lambda: hook(state, bucket), bucket, wait)

    return named_after(_comm_worker_hook, hook, 'on_comm_worker({})')
