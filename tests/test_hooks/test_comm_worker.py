"""The hooks that wait for their own collectives, overlapped with backward.

The int8 hook, batched PowerSGD and PyTorch's PowerSGD (through the
registry) run each CPU bucket's communication on one worker thread per
process (``mmcv_custom.hooks.worker``). These tests check, on real gloo
ranks and real DDP, that:

* the result is bit for bit what the same hook gives when it waits on the
  autograd thread (the behaviour before the worker), in every DDP mode
  that changes what or when DDP communicates: many buckets on 3 ranks,
  ``find_unused_parameters``, ``static_graph``, gradient accumulation,
  autocast;
* the autograd thread does not wait: a hook returns before its bucket
  has travelled, while a peer holds the collective back;
* an exception inside a hook ends ``backward()`` on every rank, whether
  every rank fails or one alone, instead of hanging;
* ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which checks every collective's
  kind and shapes across ranks) finds nothing.
"""
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.comm import build_comm_hook
from mmcv_custom.hooks import worker
from mmcv_custom.hooks.batched_powersgd import (_batched_powersgd,
                                                batched_powersgd_hook)
from mmcv_custom.hooks.int8 import Int8State, _int8_reduce, int8_compress_hook
from mmcv_custom.hooks.powersgd import _powersgd, powersgd_hook
from mmcv_custom.testing import run_ranks


class _Deep(nn.Module):
    """Seven layers, one bucket each at a tiny ``bucket_cap_mb`` (from
    DDP's second step on), the last of which only some steps use."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(6))
        self.sometimes = nn.Linear(24, 24)

    def forward(self, x, use_all=True):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if use_all:
            x = self.sometimes(x)
        return x.square().mean()


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _blocking(body):
    """The hook as it was: every wait on the autograd thread."""

    def hook(state, bucket):
        return _done(body(state, bucket).wait())

    return hook


def _int8(group=None):
    return Int8State(group, block_size=16)


def _powersgd_state(group=None):
    return powerSGD.PowerSGDState(
        group,
        matrix_approximation_rank=2,
        start_powerSGD_iter=2,
        min_compression_rate=0.5,
        orthogonalization_epsilon=1e-8)


# name -> (state factory, overlapped hook, blocking reference)
HOOKS = {
    'int8': (_int8, int8_compress_hook, _blocking(_int8_reduce)),
    'batched_powerSGD':
    (_powersgd_state, batched_powersgd_hook, _blocking(_batched_powersgd)),
    'powerSGD': (_powersgd_state, powersgd_hook, _blocking(_powersgd)),
    # PyTorch's own, through the public wrapper.
    'pytorch_powerSGD':
    (_powersgd_state, worker.on_comm_worker(powerSGD.powerSGD_hook),
     _blocking(powerSGD.powerSGD_hook)),
}


def _train(rank, hook_name, overlapped, mode, steps=5, group=None):
    """``group``: the hook's group (DDP's own is WORLD)."""
    make_state, hook, reference = HOOKS[hook_name]
    torch.manual_seed(0)
    kwargs = dict(bucket_cap_mb=0.001)
    if mode == 'find_unused':
        kwargs['find_unused_parameters'] = True
    if mode == 'static_graph':
        kwargs['static_graph'] = True
    model = DDP(_Deep(), **kwargs)
    model.register_comm_hook(
        make_state(group), hook if overlapped else reference)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(steps):
        optim.zero_grad()
        gen = torch.Generator().manual_seed(100 * step + rank)
        if mode == 'accumulate':
            with model.no_sync():
                model(torch.randn(8, 24, generator=gen)).backward()
        use_all = not (mode == 'find_unused' and step % 2)
        x = torch.randn(8, 24, generator=gen)
        if mode == 'autocast':
            with torch.autocast('cpu', dtype=torch.bfloat16):
                loss = model(x, use_all)
        else:
            loss = model(x, use_all)
        loss.backward()
        grads.append([
            p.grad.clone() if p.grad is not None else None
            for p in model.parameters()
        ])
        optim.step()
    return grads


def _compare(rank, world_size, hook_name, mode):
    return (_train(rank, hook_name, True,
                   mode), _train(rank, hook_name, False, mode))


@pytest.mark.parametrize('hook_name', sorted(HOOKS))
@pytest.mark.parametrize(
    'mode', ['plain', 'find_unused', 'static_graph', 'accumulate', 'autocast'])
def test_overlapped_is_bit_for_bit_the_blocking_hook(hook_name, mode):
    world_size = 3 if mode == 'plain' else 2
    results = run_ranks(
        _compare, hook_name, mode, world_size=world_size, timeout=90)
    for overlapped, blocking in results:
        assert len(overlapped) == len(blocking) == 5
        for got, want in zip(overlapped, blocking):
            for g, w in zip(got, want):
                assert (g is None) == (w is None)
                if g is not None:
                    assert torch.isfinite(g).all()
                    assert torch.equal(g, w)
    # And the ranks agree.
    for step in range(5):
        for r in range(1, world_size):
            for g, g0 in zip(results[r][0][step], results[0][0][step]):
                assert (g is None and g0 is None) or torch.equal(g, g0)


def _hook_returns_before_its_bucket_travels(rank, world_size, hook_name):
    """Rank 1 holds back every bucket's collectives for a moment; on
    rank 0, every hook but the last must return before its bucket is
    done, and the last only when all are."""
    make_state, hook, _ = HOOKS[hook_name]
    torch.manual_seed(0)
    model = DDP(_Deep(), bucket_cap_mb=0.001)
    returned = []

    def watched(state, bucket):
        if rank == 1:
            time.sleep(0.2)
        fut = hook(state, bucket)
        returned.append((bucket.index(), bucket.is_last(), fut.done(),
                         threading.current_thread().name))
        return fut

    model.register_comm_hook(make_state(), watched)
    for step in range(3):  # PowerSGD compresses from step 2 on
        model.zero_grad()
        model(torch.randn(8, 24)).backward()
    return returned


@pytest.mark.parametrize('hook_name', sorted(HOOKS))
def test_hooks_do_not_hold_up_the_backward_pass(hook_name):
    returned, _ = run_ranks(
        _hook_returns_before_its_bucket_travels, hook_name, timeout=60)
    # DDP's first step has one bucket; later ones one per layer (its
    # weight and bias).
    assert len(returned) == 1 + 2 * 7
    for index, last, done, thread in returned:
        assert thread == 'MainThread'
        # Not done on return: the wait is the worker's. (For the last
        # bucket the hook returns once every collective is issued.)
        assert last or not done, (index, last, done)


class _Boom(RuntimeError):
    pass


def _fail_in_hook(rank, world_size, hook_name, failing):
    make_state, hook, _ = HOOKS[hook_name]
    torch.manual_seed(0)
    model = DDP(_Deep(), bucket_cap_mb=0.001)
    failing_ranks = ()

    def failing_hook(state, bucket):
        if bucket.index() == 1 and rank in failing_ranks:

            def boom():
                raise _Boom(f'injected on rank {rank}')

            return worker.run_on_comm_worker(boom, bucket)
        return hook(state, bucket)

    model.register_comm_hook(make_state(), failing_hook)
    # DDP's first step has one bucket; from the second on, one per
    # parameter: fail there.
    model(torch.randn(8, 24)).backward()
    failing_ranks = failing
    try:
        model(torch.randn(8, 24)).backward()
    except Exception as exc:  # noqa: B902 - what each rank raised
        message = f'{type(exc).__name__}: {exc}'
    else:
        return 'no error'
    if rank not in failing or len(failing) < world_size:
        return message
    # Every rank failed at the same bucket, so the group is still in step.
    # The worker refuses every later bucket, naming the first error, even
    # another model's.
    torch.manual_seed(0)
    other = DDP(_Deep(), bucket_cap_mb=0.001)
    other.register_comm_hook(make_state(), hook)
    try:
        other(torch.randn(8, 24)).backward()  # one bucket, refused
    except Exception as exc:  # noqa: B902 - what the rank raised
        return message, str(exc)
    return message, 'later bucket ran'


@pytest.mark.parametrize('hook_name', ['int8', 'batched_powerSGD'])
def test_failure_on_every_rank_raises_everywhere(hook_name):
    results = run_ranks(_fail_in_hook, hook_name, (0, 1), timeout=60)
    for rank, (message, later) in enumerate(results):
        assert f'injected on rank {rank}' in message
        assert 'no bucket is communicated after an earlier bucket failed' in (
            later)
        assert f'injected on rank {rank}' in later


@pytest.mark.parametrize('hook_name', ['int8', 'powerSGD'])
def test_failure_on_one_rank_raises_everywhere(hook_name):
    """Rank 1 fails alone at bucket 1: it raises, and rank 0, left waiting
    in a collective, raises as soon as rank 1's connections close (well
    before gloo's 30-minute timeout: run_ranks fails a hang after 60 s)."""
    waiting, failed = run_ranks(_fail_in_hook, hook_name, (1, ), timeout=60)
    assert 'injected on rank 1' in failed
    assert 'Connection closed by peer' in waiting


def _debug_detail(rank, world_size, hook_name):
    # What TORCH_DISTRIBUTED_DEBUG=DETAIL sets, for groups made now: each
    # is wrapped to check every collective against the other ranks'.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    control, group = (dist.new_group(backend='gloo') for _ in range(2))
    # torch 2.13's DDP constructor segfaults on CPU over a group so
    # wrapped (in its logger's set_construction_data_and_log, with or
    # without a hook; seen here), so DDP runs on WORLD and the hooks on
    # the wrapped group: every collective they issue is checked.
    dist.set_debug_level(dist.DebugLevel.OFF)
    # The check can fail: ranks all-reducing tensors of different sizes.
    try:
        dist.all_reduce(torch.zeros(3 + rank), group=control)
    except RuntimeError as exc:
        caught = str(exc)
    else:
        caught = 'nothing'
    assert 'Detected mismatch between collectives' in caught, caught
    return _train(rank, hook_name, True, 'find_unused', steps=3, group=group)


@pytest.mark.parametrize('hook_name', sorted(HOOKS))
def test_debug_detail_finds_no_mismatched_collective(hook_name):
    """DETAIL wraps a group so that every collective is first checked
    against the other ranks' (kind, shapes, dtypes): a rank issuing
    another collective than its peers raises. With unused parameters,
    DDP all-reduces its used-parameter map after the last bucket."""
    results = run_ranks(_debug_detail, hook_name, timeout=90)
    for step in range(3):
        for g, g1 in zip(results[0][step], results[1][step]):
            assert (g is None and g1 is None) or torch.equal(g, g1)


def _specs(rank, world_size):
    waiting = [
        build_comm_hook(cfg)
        for cfg in (dict(type='int8_compress'), dict(type='powerSGD'),
                    dict(type='batched_powerSGD'),
                    dict(type='powerSGD', wrapper='bf16'))
    ]
    others = [
        build_comm_hook(dict(type=name))
        for name in ('allreduce', 'bf16_compress', 'fp16_compress')
    ]
    return ([(s.on_worker, s.describe())
             for s in waiting], [s.on_worker for s in others])


def test_registry_runs_the_waiting_hooks_on_the_worker():
    (waiting, others), _ = run_ranks(_specs)
    for on_worker, described in waiting:
        assert on_worker
        assert 'overlapped with backward' in described
    assert others == [False] * 3


def test_wrapper_keeps_the_name_and_rejects_a_non_callable():
    wrapped = worker.on_comm_worker(powerSGD.powerSGD_hook)
    assert wrapped.__qualname__ == 'on_comm_worker(powerSGD_hook)'
    assert wrapped.__wrapped__ is powerSGD.powerSGD_hook
    with pytest.raises(TypeError, match='must be callable'):
        worker.on_comm_worker(None)
