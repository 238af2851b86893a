"""The comm-hook registry: config names, errors, user hooks, PowerSGD."""
import inspect

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom import (COMM_HOOK_STATES, COMM_HOOKS, allreduce_hook,
                         bf16_compress_hook, build_comm_hook,
                         check_comm_hook_cfg)
from mmcv_custom.comm.builtins import BUILTIN_HOOKS
from mmcv_custom.hooks.batched_powersgd import batched_powersgd_hook
from mmcv_custom.hooks.powersgd import powersgd_hook
from mmcv_custom.hooks.state import HookStateKeeper
from mmcv_custom.testing import run_ranks

# The built-in hooks, from their one place: a new one is tested here
# without editing this file.
BUILTIN = sorted(builtin.name for builtin in BUILTIN_HOOKS)


def test_builtin_names():
    # Every built-in is registered under its name (plugins' may join).
    assert {
        n: COMM_HOOKS.get(n)
        for n in BUILTIN
    } == {
        b.name: b.hook
        for b in BUILTIN_HOOKS
    }
    assert {
        'allreduce', 'fp16_compress', 'bf16_compress', 'int8_compress',
        'powerSGD', 'batched_powerSGD'
    } <= set(BUILTIN)
    assert COMM_HOOKS.get('bf16_compress') is bf16_compress_hook
    # Ours too: PyTorch's algorithm on aligned copies
    # (mmcv_custom.hooks.powersgd).
    assert COMM_HOOKS.get('powerSGD') is powersgd_hook
    # Ours: PyTorch 2.13's batched hook fails at its first compressed step.
    assert COMM_HOOKS.get('batched_powerSGD') is batched_powersgd_hook


@pytest.mark.parametrize(
    'cfg,error,patterns',
    [
        ('bf16', TypeError, ["should be a dict", "got str: 'bf16'"]),
        (dict(wrapper='bf16'), KeyError, ['needs a `type` key', 'allreduce']),
        (dict(type='bf16'), KeyError,
         ["'bf16' is not in the", ', '.join(BUILTIN)]),
        (dict(type=3), TypeError, ['got int: 3', 'bf16_compress']),
        # A bare name is never imported, even where a module of that name
        # exists.
        (dict(type='os'), KeyError, ["'os' is not in the"]),
        (dict(type='mmcv_custom.hooks.half'), TypeError,
         ['should name a callable hook']),
        (dict(type='bf16_compress', wrapper='int8'), ValueError,
         ["'fp16', 'bf16' or None", "'int8'"]),
        (dict(type='fp16_compress', wrapper='bf16'), ValueError,
         ['already reduces in fp16', 'round twice']),
        (dict(type='powerSGD', rank=2, lr=1), TypeError,
         ["unexpected keys ['lr', 'rank']", 'matrix_approximation_rank']),
        (dict(type='powerSGD', process_group=None), TypeError,
         ["unexpected keys ['process_group']", "the DDP model's own"]),
        (dict(type='allreduce', foo=1), TypeError,
         ["takes no arguments besides type and wrapper", "['foo']"]),
    ])
def test_bad_configs_name_the_value_and_the_choices(cfg, error, patterns):
    with pytest.raises(error) as info:
        check_comm_hook_cfg(cfg)
    for pattern in patterns:
        assert pattern in str(info.value)


def test_powersgd_gets_a_safe_epsilon_unless_given():
    for wrapper, eps, dtype in [(None, 1e-8, torch.float32),
                                ('bf16', 1e-8, torch.bfloat16),
                                ('fp16', 1e-6, torch.float16)]:
        checked = check_comm_hook_cfg(dict(type='powerSGD', wrapper=wrapper))
        assert checked['state_kwargs'] == dict(orthogonalization_epsilon=eps)
        assert checked['defaults_set'] == ('orthogonalization_epsilon', )
        # The format PowerSGD computes in must represent it, or adding it
        # rounds back to 0 (1e-8 does in fp16).
        assert torch.tensor(eps, dtype=dtype) > 0
    checked = check_comm_hook_cfg(
        dict(type='powerSGD', orthogonalization_epsilon=0))
    assert checked['state_kwargs'] == dict(orthogonalization_epsilon=0)
    assert checked['defaults_set'] == ()


def test_type_may_be_an_import_path():
    checked = check_comm_hook_cfg(
        dict(type='mmcv_custom.hooks.half.fp16_compress_hook'))
    assert checked['state_kwargs'] == {}
    with pytest.raises(ValueError, match='already reduces in fp16'):
        check_comm_hook_cfg(
            dict(
                type='mmcv_custom.hooks.half.fp16_compress_hook',
                wrapper='bf16'))


def _user_hook_rank(rank, world_size):
    calls = []

    @COMM_HOOK_STATES.register_module(name='counting_allreduce', force=True)
    def counting_state(process_group, tag='none'):
        return dict(group=process_group, tag=tag)

    @COMM_HOOKS.register_module(force=True)
    def counting_allreduce(state, bucket):
        calls.append((state['tag'], bucket.buffer().dtype))
        return allreduce_hook(state['group'], bucket)

    spec = build_comm_hook(
        dict(type='counting_allreduce', wrapper='bf16', tag='mine'))
    model = DDP(nn.Linear(4, 2))
    model.register_comm_hook(spec.state, spec.hook)
    model(torch.ones(2, 4) * (rank + 1)).sum().backward()
    return calls, spec.describe(), model.module.weight.grad


def test_user_hook_with_state_and_wrapper_on_ddp():
    (calls, described, grad), _ = run_ranks(_user_hook_rank)
    # The wrapper handed the user hook a bf16 bucket.
    assert calls == [('mine', torch.bfloat16)]
    assert "type='counting_allreduce'" in described
    assert "wrapper='bf16'" in described
    assert "tag='mine'" in described
    # Two rows of (rank + 1): gradient 2 and 4, averaged to 3.
    assert torch.equal(grad, torch.full((2, 4), 3.0))


def _callable_type(rank, world_size):
    spec = build_comm_hook(dict(type=allreduce_hook))
    model = DDP(nn.Linear(4, 2))
    model.register_comm_hook(spec.state, spec.hook)
    model(torch.ones(2, 4) * (rank + 1)).sum().backward()
    return spec.type, model.module.weight.grad


def test_type_may_be_a_callable():
    (name, grad), _ = run_ranks(_callable_type)
    assert name == 'allreduce_hook'
    assert torch.equal(grad, torch.full((2, 4), 3.0))


class _WithSilentLayer(nn.Module):
    """Several buckets, and one layer whose gradient is all zero."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        self.silent = nn.Linear(64, 64)

    def forward(self, x):
        return self.body(x).sum() + 0 * self.silent(x).sum()


def _train_silent(rank, comm_hook, steps):
    """``steps`` steps of the silent-layer model in 20 kB buckets with the
    hook ``comm_hook`` builds; the gradients of every step, and the spec."""
    torch.manual_seed(0)
    model = DDP(_WithSilentLayer(), bucket_cap_mb=0.02)
    spec = build_comm_hook(comm_hook)
    model.register_comm_hook(spec.state, spec.hook)
    grads = []
    for step in range(steps):
        model.zero_grad()
        torch.manual_seed(10 * step + rank)
        model(torch.randn(8, 64)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads, spec


def _assert_finite_and_in_sync(grads, grads1):
    for step, step1 in zip(grads, grads1):
        for g, g1 in zip(step, step1):
            assert torch.isfinite(g).all()
            assert torch.equal(g, g1)


def _powersgd_rank(rank, world_size, wrapper):
    grads, spec = _train_silent(
        rank,
        dict(
            type='powerSGD',
            wrapper=wrapper,
            start_powerSGD_iter=2,
            min_compression_rate=0.5), 4)
    return grads, spec.on_worker, spec.state.iter, spec.describe()


@pytest.mark.parametrize('wrapper', [None, 'bf16', 'fp16'])
def test_powersgd_on_gloo_with_several_buckets(wrapper):
    """PyTorch's PowerSGD hook aborts or hangs on gloo with several buckets;
    through the registry it completes, with finite gradients even where a
    layer's gradient is zero."""
    (grads, on_worker, iters, described), (grads1, *_) = run_ranks(
        _powersgd_rank, wrapper, timeout=60)
    assert on_worker and iters == 4
    assert 'in order on a worker thread' in described
    assert 'orthogonalization_epsilon' in described
    _assert_finite_and_in_sync(grads, grads1)
    # The silent layer's gradient stays zero rather than NaN.
    assert all((g == 0).all() for g in grads[-1][-2:])


def _batched_rank(rank, world_size, wrapper):
    grads, spec = _train_silent(
        rank,
        dict(
            type='batched_powerSGD',
            wrapper=wrapper,
            start_powerSGD_iter=2,
            matrix_approximation_rank=2), 5)
    state = spec.state
    return (grads, state.iter, state.total_numel_before_compression,
            state.total_numel_after_compression, spec.on_worker,
            sorted(state.error_dict))


@pytest.mark.parametrize('wrapper', [None, 'bf16', 'fp16'])
def test_batched_powersgd_runs_on_gloo_with_several_buckets(wrapper):
    (grads, iters, before, after, on_worker, buckets), (grads1,
                                                        *_) = run_ranks(
                                                            _batched_rank,
                                                            wrapper,
                                                            timeout=60)
    assert iters == 5 and on_worker  # waits for its own all-reduces
    assert len(buckets) > 1  # several buckets compressed
    assert 0 < after < before / 10  # two thin factors per bucket
    _assert_finite_and_in_sync(grads, grads1)


def test_every_builtin_hook_has_its_record():
    """One record per hook (mmcv_custom.comm.records): what the registry,
    the byte count and the checkpoints need to know about a built-in hook
    is there; a user's hook gets the empty record (traffic unknown)."""
    from mmcv_custom.comm.records import HOOK_RECORDS, record_of
    for name in BUILTIN:
        record = record_of(COMM_HOOKS.get(name))
        assert record is HOOK_RECORDS[COMM_HOOKS.get(name)], name
        assert record.count_bytes_sent is not None, name
    on_worker = {n: record_of(COMM_HOOKS.get(n)).on_worker for n in BUILTIN}
    assert on_worker.items() >= dict(
        allreduce=False,
        fp16_compress=False,
        bf16_compress=False,
        int8_compress=True,
        powerSGD=True,
        batched_powerSGD=True).items()
    # Each has issued all its collectives when it returns.
    assert not any(
        record_of(COMM_HOOKS.get(n)).waits_per_bucket for n in BUILTIN)
    assert record_of(COMM_HOOKS.get('fp16_compress')).half_precision == 'fp16'
    assert record_of(COMM_HOOKS.get('int8_compress')).half_precision is None
    forms = {n: record_of(COMM_HOOKS.get(n)).fsdp2_form for n in BUILTIN}
    assert forms.items() >= dict(
        allreduce='averaging_reduce_scatter',
        fp16_compress='averaging_reduce_scatter',
        bf16_compress='averaging_reduce_scatter',
        int8_compress='int8_reduce_scatter',
        powerSGD=None,
        batched_powerSGD=None).items()

    # Every stateful hook's state is kept by a declared HookStateKeeper,
    # the interface the state files are written against.
    keepers = {n: record_of(COMM_HOOKS.get(n)).state_keeper for n in BUILTIN}
    assert {
        n: k is not None
        for n, k in keepers.items()
    }.items() >= dict(
        allreduce=False,
        fp16_compress=False,
        bf16_compress=False,
        int8_compress=True,
        powerSGD=True,
        batched_powerSGD=True).items()
    for name, keeper in keepers.items():
        if keeper is not None:
            assert issubclass(keeper, HookStateKeeper), name
            assert not inspect.isabstract(keeper), name
    with pytest.raises(TypeError, match='abstract'):
        HookStateKeeper()

    def user_hook(state, bucket):
        return allreduce_hook(state, bucket)

    assert record_of(user_hook).count_bytes_sent is None
    assert record_of(user_hook).state_keeper is None
