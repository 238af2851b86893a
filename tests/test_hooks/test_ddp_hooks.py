"""The hook math, on real gloo process groups and real DDP models.

Each rank plants known gradients (a parameter ``p`` with loss
``(p * x).sum()`` has gradient exactly ``x``), so every rank can compute the
exact fp32 mean of all ranks' gradients and compare DDP's result with it.
"""
import inspect
import os.path as osp
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.hooks import cast, half
from mmcv_custom.hooks.half import (allreduce_hook, bf16_compress_hook,
                                    bf16_compress_wrapper, fp16_compress_hook,
                                    fp16_compress_wrapper)
from mmcv_custom.testing import run_ranks

# Unit roundoff of each wire format: the relative error of one rounding.
UNIT_ROUNDOFF = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
}
# Smallest positive (subnormal) value: the absolute error floor near zero.
TINY = {
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
    torch.float32: 2.0**-149,
}
SHAPES = [(64, 32), (64, ), (16, 64), (16, ), (300, )]


class Planted(nn.Module):
    """Parameters whose gradients are exactly the planted inputs."""

    def __init__(self, shapes):
        super().__init__()
        self.params = nn.ParameterList(
            nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.params, xs))


def planted_grads(rank, shapes=SHAPES, scale=1.0):
    gen = torch.Generator().manual_seed(100 + rank)
    # Magnitudes over several decades, signs mixed.
    return [
        torch.randn(s, generator=gen) * scale *
        10**torch.randint(-4, 3, s, generator=gen).float() for s in shapes
    ]


def exact_mean(world_size, group_ranks=None, **kwargs):
    ranks = group_ranks if group_ranks is not None else range(world_size)
    per_rank = [planted_grads(r, **kwargs) for r in ranks]
    means = [
        torch.stack([g[i].double() for g in per_rank]).mean(0)
        for i in range(len(per_rank[0]))
    ]
    abs_sums = [
        torch.stack([g[i].double().abs() for g in per_rank]).sum(0)
        for i in range(len(per_rank[0]))
    ]
    return means, abs_sums


def _reduce_with_hook(rank,
                      world_size,
                      hook_name,
                      bucket_cap_mb,
                      as_view=False):
    hook = {
        'allreduce': allreduce_hook,
        'fp16': fp16_compress_hook,
        'bf16': bf16_compress_hook,
        'fp16_wrapper': fp16_compress_wrapper(allreduce_hook),
        'bf16_wrapper': bf16_compress_wrapper(allreduce_hook),
    }[hook_name]
    model = DDP(
        Planted(SHAPES),
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=as_view)
    model.register_comm_hook(None, hook)
    # Two steps: DDP lays out its buckets again after the first one.
    results = []
    for _ in range(2):
        model.zero_grad()
        model(planted_grads(rank)).backward()
        results.append([p.grad.clone() for p in model.module.params])
    return results


@pytest.fixture(params=['c_kernel', 'torch_ops'])
def cpu_codec(request, monkeypatch):
    """Run with the one-pass C cast and with torch's ops (the fallback when
    it is not built); forked ranks inherit the choice."""
    if request.param == 'torch_ops':
        monkeypatch.setattr(cast, '_cpu_codec', None)
    return request.param


@pytest.mark.parametrize('hook_name,dtype', [
    ('allreduce', torch.float32),
    ('fp16', torch.float16),
    ('bf16', torch.bfloat16),
    ('fp16_wrapper', torch.float16),
    ('bf16_wrapper', torch.bfloat16),
])
def test_average_within_wire_format_rounding(hook_name, dtype, cpu_codec):
    # A small bucket cap gives several buckets per step.
    results = run_ranks(_reduce_with_hook, hook_name, 0.004)
    means, abs_sums = exact_mean(2)
    u = UNIT_ROUNDOFF[dtype]
    for rank_result in results:
        for step in rank_result:
            for got, mean, abs_sum in zip(step, means, abs_sums):
                assert got.dtype == torch.float32
                err = (got.double() - mean).abs()
                # Rounding each rank's share, then every partial sum: at most
                # u * sum(|x_r|), plus the subnormal spacing near zero.
                bound = u * abs_sum * 1.001 + 2 * TINY[dtype]
                assert (err <= bound).all(), (err - bound).max()
                if dtype is not torch.float32:
                    # What came off the wire is exactly representable in the
                    # wire format: the reduction really ran in half.
                    assert torch.equal(got.to(dtype).float(), got)
    # All ranks agree bit for bit.
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_compressed_result_differs_from_fp32():
    """Guards the test above against passing because nothing was
    compressed."""
    half = run_ranks(_reduce_with_hook, 'bf16', 25)
    full = run_ranks(_reduce_with_hook, 'allreduce', 25)
    assert not torch.equal(half[0][1][0], full[0][1][0])


def test_gradient_as_bucket_view():
    results = run_ranks(_reduce_with_hook, 'bf16', 0.004, True)
    means, abs_sums = exact_mean(2)
    for got, mean, abs_sum in zip(results[0][1], means, abs_sums):
        assert ((got.double() - mean).abs()
                <= UNIT_ROUNDOFF[torch.bfloat16] * abs_sum * 1.001).all()


def _fp16_large_values(rank, world_size, wrapper):
    model = DDP(Planted([(4, )]))
    hook = fp16_compress_wrapper(allreduce_hook) if wrapper else (
        fp16_compress_hook)
    model.register_comm_hook(None, hook)
    grad = (
        torch.tensor([1e5, 7e4, 3.0, -1e-3])
        if rank == 0 else torch.tensor([-2e4, -6e4, 1.0, 2e-3]))
    model([grad]).backward()
    return model.module.params[0].grad


def test_fp16_hook_divides_before_the_cast():
    # 1e5 does not fit fp16 (max 65504) but the mean 4e4 does.
    got = run_ranks(_fp16_large_values, False)[0]
    assert torch.isfinite(got).all()
    exact = torch.tensor([4e4, 5e3, 2.0, 5e-4], dtype=torch.float64)
    abs_sum = torch.tensor([1.2e5, 1.3e5, 4.0, 3e-3], dtype=torch.float64)
    err = (got.double() - exact).abs()
    u = UNIT_ROUNDOFF[torch.float16]
    assert (err <= u * abs_sum + 2 * TINY[torch.float16]).all()


def test_fp16_wrapper_overflows_on_raw_values_above_fp16_range():
    """Documented behaviour: the wrapper casts before the inner hook
    averages, so a raw 1e5 becomes inf (bf16_compress_wrapper does not)."""
    got = run_ranks(_fp16_large_values, True)[0]
    assert not torch.isfinite(got[0])
    assert torch.isfinite(got[2:]).all()


# Parameters of the range-guard test, by size, each above the bucket cap
# (131 fp32 elements) and so in a bucket of its own, and what rank 0
# plants in it (the other rank plants finite values): NaN mid-way, -inf
# in the last element (past the vector lanes), +inf first, fp16's largest
# value (finite: its mean fits), and NaN in a bf16 parameter (a bucket
# sent as it is).
_PLANTED_BAD = {
    700: ('nan', 350),
    137: ('-inf', 136),
    515: ('inf', 0),
    300: (65504.0, 7),
    64: ('nan', 10),
}


def _nonfinite_buckets(rank, world_size):
    params = nn.ParameterList(
        nn.Parameter(
            torch.zeros(n, dtype=torch.bfloat16 if n == 64 else None))
        for n in _PLANTED_BAD)

    class Net(nn.Module):

        def __init__(self):
            super().__init__()
            self.params = params

        def forward(self, xs):
            return sum((p * x).sum().float() for p, x in zip(self.params, xs))

    state = half.CompressState(None, check_finite=True)
    ddp = DDP(Net(), bucket_cap_mb=0.0005)
    ddp.register_comm_hook(state, fp16_compress_hook)
    xs = []
    for p, (value, at) in zip(params, _PLANTED_BAD.values()):
        x = torch.randn(p.numel()).to(p.dtype)
        if rank == 0:
            x[at] = float(value)
        elif value == 65504.0:
            x[at] = value
        xs.append(x)
    found = []
    for _ in range(2):  # buckets are laid out again after the first step
        ddp.zero_grad()
        ddp(xs).backward()
        found.append(
            sorted(p.numel() for _, params in state.pop_nonfinite()
                   for p in params))
    return found, [p.grad.clone() for p in params]


def test_range_guard_finds_nan_and_inf_anywhere_in_a_bucket():
    """check_finite looks at every element (min and max over the bucket)
    and flags NaN and both infinities, not fp16's largest finite value."""
    found, grads = run_ranks(_nonfinite_buckets)[0]
    bad = sorted(n for n, (value, _) in _PLANTED_BAD.items()
                 if value != 65504.0)
    assert found[-1] == bad
    by_size = dict(zip(_PLANTED_BAD, grads))
    assert torch.isnan(by_size[700][350]) and torch.isnan(by_size[64][10])
    assert by_size[137][136] == -float('inf')
    assert by_size[515][0] == float('inf')
    assert by_size[300][7] == 65504.0 and torch.isfinite(by_size[300]).all()


def _check_in_place(rank, world_size, which):
    seen = []
    inner = {
        'fp16': fp16_compress_hook,
        'bf16': bf16_compress_hook,
        'bf16_wrapper': bf16_compress_wrapper(allreduce_hook),
        'fp16_wrapper': fp16_compress_wrapper(allreduce_hook),
    }[which]

    def recording_hook(state, bucket):
        buffer = bucket.buffer()
        fut = inner(state, bucket)

        def record(fut):
            result = fut.value()
            seen.append((result.data_ptr() == buffer.data_ptr(), result.dtype,
                         buffer.dtype))
            return result

        return fut.then(record)

    model = DDP(Planted(SHAPES), bucket_cap_mb=0.004)
    model.register_comm_hook(None, recording_hook)
    for _ in range(2):  # buckets are laid out again after the first step
        model(planted_grads(rank)).backward()
    return seen


@pytest.mark.parametrize('which',
                         ['fp16', 'bf16', 'fp16_wrapper', 'bf16_wrapper'])
def test_future_resolves_to_the_buckets_own_buffer(which):
    seen = run_ranks(_check_in_place, which)[0]
    assert len(seen) > 2  # one bucket, then several
    for same_storage, result_dtype, buffer_dtype in seen:
        assert same_storage
        assert result_dtype == buffer_dtype == torch.float32


def _subgroup(rank, world_size):
    # Ranks 0 and 1 train in a group of their own; rank 2 is outside it.
    group = dist.new_group([0, 1])
    if rank == 2:
        return None
    results = {}
    for name, hook in [('bf16', bf16_compress_hook),
                       ('allreduce', allreduce_hook)]:
        model = DDP(Planted(SHAPES), process_group=group)
        model.register_comm_hook(group, hook)
        model(planted_grads(rank)).backward()
        results[name] = [p.grad for p in model.module.params]
    return results


def test_explicit_process_group_averages_over_that_group():
    results = run_ranks(_subgroup, world_size=3)
    means, abs_sums = exact_mean(3, group_ranks=[0, 1])
    for name, dtype in [('bf16', torch.bfloat16),
                        ('allreduce', torch.float32)]:
        for got, mean, abs_sum in zip(results[0][name], means, abs_sums):
            err = (got.double() - mean).abs()
            assert (err <= UNIT_ROUNDOFF[dtype] * abs_sum * 1.001 +
                    2 * TINY[dtype]).all()


def _powersgd_wrapped(rank, world_size, wrapper):
    torch.manual_seed(0)
    # One bucket: PyTorch's PowerSGD hook on gloo needs that (see registry).
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    state = powerSGD.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
        orthogonalization_epsilon=1e-6)
    wrap = {'fp16': fp16_compress_wrapper, 'bf16': bf16_compress_wrapper}
    model.register_comm_hook(state, wrap[wrapper](powerSGD.powerSGD_hook))
    grads = []
    for step in range(4):
        model.zero_grad()
        torch.manual_seed(step * 10 + rank)
        model(torch.randn(8, 16)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return grads, state.iter


@pytest.mark.parametrize('wrapper', ['fp16', 'bf16'])
def test_wrapper_composes_with_powersgd(wrapper):
    (grads0, iters), (grads1, _) = run_ranks(_powersgd_wrapped, wrapper)
    assert iters == 4  # PowerSGD ran, and compressed from step 2 on
    for a, b in zip(grads0, grads1):
        assert a.dtype == torch.float32
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_public_api_honours_the_ddp_hook_contract():
    assert set(half.__all__) >= {
        'allreduce_hook', 'fp16_compress_hook', 'bf16_compress_hook',
        'fp16_compress_wrapper', 'bf16_compress_wrapper'
    }
    for hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook,
                 bf16_compress_wrapper(allreduce_hook)):
        sig = inspect.signature(hook)
        assert list(sig.parameters)[1] == 'bucket'
        assert sig.return_annotation == torch.futures.Future[torch.Tensor]
    # The public name survives for logs and pickling.
    assert bf16_compress_hook.__qualname__ == 'bf16_compress_hook'
    assert pickle.loads(pickle.dumps(bf16_compress_hook)) is bf16_compress_hook
    assert (bf16_compress_wrapper(allreduce_hook).__qualname__ ==
            'bf16_compress_wrapper(allreduce_hook)')


def test_wrapper_rejects_a_non_callable():
    with pytest.raises(TypeError, match='must be callable'):
        bf16_compress_wrapper('allreduce')


def _bf16_on_old_nccl(rank, world_size):
    # Gloo passes the check on its own ...
    half.check_bf16_support(None, torch.device('cpu'))
    # ... and an NCCL older than 2.10 carrying CUDA tensors does not. There
    # is no NCCL on a CPU machine, so only the two probes are replaced.
    half._uses_nccl = lambda group, device: True
    half._nccl_version = lambda: (2, 9, 6)
    with pytest.raises(TypeError) as info:
        half.check_bf16_support(None, torch.device('cuda'))
    return str(info.value)


def test_bf16_check_refuses_old_nccl_with_a_clear_error():
    message = run_ranks(_bf16_on_old_nccl)[0]
    assert 'NCCL >= 2.10' in message
    assert '(2, 9, 6)' in message
    assert 'fp16_compress' in message


def _fresh_python(code: str, cwd=None) -> str:
    """What ``code`` prints in a fresh interpreter (stripped); it must
    exit 0."""
    out = subprocess.run([sys.executable, '-c', code],
                         capture_output=True,
                         text=True,
                         timeout=120,
                         cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_package_imports_without_mmengine():
    """Where MMEngine is not installed (a GPU image with torch alone):
    ``import mmcv_custom.hooks`` goes through the package's ``__init__``,
    which then leaves the MMEngine glue out, and a name of that glue says
    what it needs instead of an AttributeError."""
    import mmcv_custom
    code = (
        'import sys\n'
        'for name in ("mmengine", "mmseg", "mmcv"):\n'
        '    sys.modules[name] = None  # import fails, as if not installed\n'
        'from mmcv_custom.hooks import int8_compress_hook\n'
        'import mmcv_custom\n'
        'try:\n'
        '    mmcv_custom.CommHookRegistrationHook\n'
        'except ImportError as e:\n'
        '    print(e)\n')
    out = _fresh_python(
        code, cwd=osp.dirname(osp.dirname(mmcv_custom.__file__)))
    assert out == (
        'mmcv_custom.CommHookRegistrationHook needs MMEngine, which is not '
        'installed (pip install mmengine, or `make install` in a checkout). '
        'The hooks themselves need only torch: import them from '
        'mmcv_custom.hooks.')
    # Every name of the package's __all__ is a hook or that glue.
    hooks = set(mmcv_custom.__all__) - set(mmcv_custom._MMENGINE_NAMES)
    assert all(hasattr(mmcv_custom.hooks, n) for n in hooks - {'__version__'})


def test_hook_modules_import_without_mmengine(tmp_path):
    """The torch-only modules, and the hook records built on them, really
    run without MMEngine: imported in a fresh interpreter whose
    ``mmcv_custom`` package skips its ``__init__`` (which registers the
    MMEngine glue). What else ``mmcv_custom.hooks`` may import:
    ``tests/test_hooks/test_hooks_package.py``."""
    code = (
        'import sys, types\n'
        f'pkg = types.ModuleType("mmcv_custom"); pkg.__path__ = '
        f'[{osp.dirname(osp.dirname(half.__file__))!r}]\n'
        'sys.modules["mmcv_custom"] = pkg\n'
        'import mmcv_custom.hooks, mmcv_custom.hooks.powersgd_state\n'
        'import mmcv_custom.hooks.sharded, mmcv_custom.comm.records\n'
        'print(sorted(m for m in sys.modules if m.startswith("mmengine")))\n')
    assert _fresh_python(code) == '[]'
