"""The hooks' CUDA paths against their CPU paths (issue 32).

Skipped where no CUDA device is present; ``tools/device_check.sh`` runs them
on a lent GPU. Each case runs in processes of its own, started with
``spawn`` (CUDA does not survive a fork), that import only torch and
``mmcv_custom.hooks``, so they run on an image without MMEngine.

The gradients are made exact on every device: the model's loss is
``sum(p * t)`` over its parameters, so each gradient is ``t`` itself, and a
hook's CUDA path and its CPU path start from the same bits. What differs is
the hook's own work, which must agree bit for bit where the math is the
same operations (the casts, the int8 codec, the all-reduce of one rank)
and within rounding where the kernels differ (PowerSGD's matmuls).

The same case functions run on CPU in every ``make test``
(``test_the_cases_run_on_cpu``), so what a GPU finds is the GPU's.
"""
import os
import os.path as osp
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA,
    reason='no CUDA device: tools/device_check.sh runs these where a GPU '
    'is lent')

#: Hooks whose CUDA result is the CPU result bit for bit, and those within
#: rounding of it (kernels that sum in another order).
EXACT = ('allreduce', 'fp16', 'bf16', 'int8', 'int8_noef')
CLOSE = ('powersgd', 'batched_powersgd')
#: The collectives gloo carries for CUDA tensors: all-reduce only (the
#: int8 hook's all-to-all and PowerSGD's are not among them).
GLOO_ON_CUDA = ('allreduce', 'fp16', 'bf16')


# -- processes ---------------------------------------------------------------
def _child(rank, world_size, folder, backend, fn, args):
    if backend == 'nccl':
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(osp.join(folder, 'store'), world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        torch.save(out, osp.join(folder, f'rank{rank}.pt'))
    finally:
        dist.destroy_process_group()


def spawn(fn, *args, world_size=1, backend='gloo', timeout=300):
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks of
    ``backend``; their results in rank order."""
    ctx = torch.multiprocessing.get_context('spawn')
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(
                target=_child,
                args=(rank, world_size, folder, backend, fn, args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world_size, f'ranks exited with {codes}'
        return [
            torch.load(osp.join(folder, f'rank{r}.pt'))
            for r in range(world_size)
        ]


# -- the model and the hooks -------------------------------------------------
class _Exact(nn.Module):
    """Parameters whose gradients are the given targets exactly."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(64, 48))
        self.bias = nn.Parameter(torch.zeros(48))
        self.other = nn.Parameter(torch.zeros(1000))

    def forward(self, targets):
        return sum((p * t).sum() for p, t in zip(self.parameters(), targets))


def _hook(name):
    """``(state, hook)`` of ``name``, from mmcv_custom.hooks alone."""
    from mmcv_custom import hooks
    from mmcv_custom.hooks.powersgd import PowerSGDState
    if name == 'allreduce':
        return None, hooks.allreduce_hook
    if name in ('fp16', 'bf16'):
        return None, getattr(hooks, f'{name}_compress_hook')
    if name.startswith('int8'):
        return (hooks.Int8State(
            None, block_size=32,
            error_feedback=name == 'int8'), hooks.int8_compress_hook)
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=2,
        start_powerSGD_iter=2,
        min_compression_rate=0.5)
    return state, getattr(hooks, f'{name}_hook')


def hook_steps(rank, world_size, device, names, steps=3):
    """Per hook of ``names``: the averaged gradients of ``steps`` DDP
    steps on ``device`` (targets drawn on the CPU, so the same bits
    everywhere), and whether the comm worker thread ever started."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mmcv_custom.hooks import worker
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = _Exact().to(device)
        ddp = DDP(
            model,
            device_ids=[0] if device == 'cuda' else None,
            bucket_cap_mb=0.1)
        ddp.register_comm_hook(*_hook(name))
        grads = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            targets = [
                torch.randn(p.shape, generator=gen).to(device)
                for p in model.parameters()
            ]
            ddp.zero_grad()
            ddp(targets).backward()
            grads.append([p.grad.cpu() for p in model.parameters()])
        out[name] = grads
        del ddp
    out['worker_started'] = worker._WORKER.thread is not None
    return out


def _same(a, b):
    return all(
        torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def _equal_with_nan(a, b):
    """Equal, NaN where the other is NaN."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0), b.nan_to_num(0.0))


def _close(a, b, tol):
    return all(
        torch.allclose(x, y, rtol=tol, atol=tol) for sa, sb in zip(a, b)
        for x, y in zip(sa, sb))


# -- on CPU, every time: the cases themselves work ---------------------------
def test_the_cases_run_on_cpu():
    """The case functions the GPU tests run, on 2 CPU ranks: every rank
    alike, the first step of allreduce the mean of the targets exactly,
    fp16 near it, and the int8 hook's CPU buckets on the comm worker (on a
    GPU they must not be: test_each_hook_on_an_nccl_group_of_one_...)."""
    names = EXACT + CLOSE
    two = spawn(hook_steps, 'cpu', names, world_size=2)
    targets = []
    for rank in range(2):
        gen = torch.Generator().manual_seed(rank)
        targets.append([
            torch.randn(s, generator=gen) for s in ((64, 48), (48, ), (1000, ))
        ])
    mean = [(a + b) * 0.5 for a, b in zip(*targets)]
    assert _same(two[0]['allreduce'][:1], [mean])
    for name in names:
        assert _same(two[0][name], two[1][name]), name
    assert _close(two[0]['fp16'], two[0]['allreduce'], 1e-2)
    assert two[0]['worker_started']


# -- on a GPU ----------------------------------------------------------------
@needs_cuda
def test_the_int8_codec_is_the_same_on_cpu_and_cuda():
    """The C kernels (CPU) and torch's ops (CUDA) quantize and dequantize
    to the same bits: scales, payload, residual and the sum, for blocks
    with zeros, NaN and inf among ordinary values."""
    from mmcv_custom.hooks import int8_codec
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=gen) * 3
    x[:64] = 0
    x[100] = float('nan')
    x[300] = float('inf')
    residual = torch.randn(10_000, generator=gen) * 1e-3
    for block, prescale, with_residual in [(256, 1.0, False),
                                           (32, 0.125, True),
                                           (1000, 1 / 3, True)]:
        outs = []
        for device in ('cpu', 'cuda'):
            r = residual.to(device).clone() if with_residual else None
            q, s = int8_codec.quantize(x.to(device), block, prescale, r)
            back = int8_codec.dequantize(q, s, block)
            total = int8_codec.dequantize(q, s, block, back.clone(), True)
            outs.append([t.cpu() for t in (q, s, back, total)] +
                        ([r.cpu()] if r is not None else []))
        for a, b in zip(*outs):
            assert _equal_with_nan(a, b), (block, prescale)


@needs_cuda
def test_the_half_casts_are_the_same_on_cpu_and_cuda():
    """Divide in fp32, round once: the CPU kernel and CUDA agree, overflow
    to inf included."""
    from mmcv_custom.hooks import cast
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * 1e4
    x[0] = 1e6
    for dtype in (torch.float16, torch.bfloat16):
        for divisor in (1.0, 3.0, 8.0):
            cpu = cast.compress(x.clone(), divisor, dtype)
            gpu = cast.compress(x.cuda(), divisor, dtype).cpu()
            assert torch.equal(cpu.view(torch.int16), gpu.view(torch.int16))
            wide = torch.empty(4096)
            cast.decompress(cpu, wide)
            wide_gpu = torch.empty(4096, device='cuda')
            cast.decompress(cpu.cuda(), wide_gpu)
            assert torch.equal(wide, wide_gpu.cpu())


@needs_cuda
def test_each_hook_on_an_nccl_group_of_one_is_its_cpu_result():
    """Every hook's CUDA path, NCCL, one rank, against its CPU path, gloo,
    one rank: the same bits where the operations are the same, within
    rounding for PowerSGD's matmuls; CUDA buckets never go to the comm
    worker thread."""
    names = EXACT + CLOSE
    gpu = spawn(hook_steps, 'cuda', names, backend='nccl')[0]
    cpu = spawn(hook_steps, 'cpu', names)[0]
    for name in EXACT:
        assert _same(gpu[name], cpu[name]), name
    for name in CLOSE:
        assert _close(gpu[name], cpu[name], 1e-3), name
    assert not gpu['worker_started']


@needs_cuda
def test_the_fused_int8_kernels_compiled_are_the_torch_path():
    """The Triton kernels compiled for this GPU (not interpreted): the
    same bits as the torch path on the same GPU, every case of
    ``tests/test_hooks/int8_fused_cases.py``."""
    import subprocess
    import sys

    from mmcv_custom.hooks import int8_fused
    if not int8_fused.AVAILABLE:
        pytest.skip('Triton is not installed')
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    out = subprocess.run(
        [sys.executable, '-m', 'tests.test_hooks.int8_fused_cases', 'cuda'],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ['OK'], out.stdout


@needs_cuda
def test_the_int8_hook_with_the_fused_kernels_is_its_cpu_result(monkeypatch):
    """``MMCV_CUSTOM_INT8_FUSED=1``: the int8 hook's CUDA path through
    the fused kernels, NCCL, one rank, is its CPU path bit for bit."""
    from mmcv_custom.hooks import int8_fused
    if not int8_fused.AVAILABLE:
        pytest.skip('Triton is not installed')
    monkeypatch.setenv(int8_fused.ENV, '1')
    names = ('int8', 'int8_noef')
    gpu = spawn(hook_steps, 'cuda', names, backend='nccl')[0]
    cpu = spawn(hook_steps, 'cpu', names)[0]
    for name in names:
        assert _same(gpu[name], cpu[name]), name


@needs_cuda
def test_two_ranks_sharing_the_gpu_over_gloo_are_the_cpu_result():
    """Two processes, one GPU, gloo with CUDA tensors (it carries
    all-reduces): the hooks that only all-reduce, bit for bit as on
    CPU."""
    gpu = spawn(hook_steps, 'cuda', GLOO_ON_CUDA, world_size=2)
    cpu = spawn(hook_steps, 'cpu', GLOO_ON_CUDA, world_size=2)
    for name in GLOO_ON_CUDA:
        for a, b in zip(gpu, cpu):
            assert _same(a[name], b[name]), name


def amp_steps(rank, world_size, dtype_name):
    """A net under CUDA autocast (fp16 with a GradScaler, or bf16), its
    gradients reduced by the matching half hook and by allreduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mmcv_custom import hooks
    dtype = getattr(torch, dtype_name)
    out = {}
    for name in ('allreduce', 'half'):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64,
                                                                    8)).cuda()
        ddp = DDP(net, device_ids=[0])
        hook = (
            hooks.allreduce_hook
            if name == 'allreduce' else hooks.fp16_compress_hook
            if dtype is torch.float16 else hooks.bf16_compress_hook)
        ddp.register_comm_hook(None, hook)
        scaler = torch.amp.GradScaler('cuda', enabled=dtype is torch.float16)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
        with torch.autocast('cuda', dtype=dtype):
            loss = ddp(x.cuda()).float().square().mean()
        scaler.scale(loss).backward()
        out[name] = [p.grad.float().cpu() for p in net.parameters()]
    return out


@needs_cuda
@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_half_hooks_under_cuda_amp(dtype):
    """Under autocast the gradients are still fp32 (the parameters are):
    the half hook's average is allreduce's to its format's rounding."""
    out = spawn(amp_steps, dtype, backend='nccl')[0]
    for half, exact in zip(out['half'], out['allreduce']):
        assert torch.isfinite(half).all()
        assert torch.allclose(half, exact, rtol=1e-2, atol=1e-3)


def fsdp2_step(rank, world_size, wire):
    """``fully_shard`` on CUDA (NCCL, one rank) with the project's
    reduce-scatter in ``wire`` (None, bf16, fp16, or int8), against the
    unsharded gradients."""
    from torch.distributed.fsdp import fully_shard

    from mmcv_custom.hooks.sharded import install_reduce_scatter
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)).cuda()
    plain = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)).cuda()
    plain.load_state_dict(net.state_dict())
    fully_shard(net[0])
    fully_shard(net)
    int8 = wire == 'int8'
    install_reduce_scatter(
        net,
        None if int8 or wire is None else getattr(torch, wire),
        int8_block_size=32 if int8 else None)
    x = torch.randn(16, 32, device='cuda')
    net(x).square().mean().backward()
    plain(x).square().mean().backward()
    return [(p.grad.full_tensor().cpu(), q.grad.cpu())
            for p, q in zip(net.parameters(), plain.parameters())]


@needs_cuda
@pytest.mark.parametrize('wire', [None, 'bfloat16', 'float16', 'int8'])
def test_fsdp2_with_a_compressed_reduce_scatter_on_one_gpu(wire):
    pairs = spawn(fsdp2_step, wire, backend='nccl')[0]
    tol = 1e-6 if wire is None else 2e-2
    for sharded, plain in pairs:
        assert torch.allclose(sharded, plain, rtol=tol, atol=tol)


@needs_cuda
def test_intern_vit_forward_and_backward_in_bf16_on_a_gpu():
    """The bf16 backbone on a GPU: a finite loss and finite bf16 gradients,
    near fp32's. Needs MMSegmentation (not on every GPU image)."""
    pytest.importorskip('mmseg', reason='MMSegmentation is not installed')
    from mmcv_custom.models.intern_vit import InternViT
    outs = {}
    for dtype in ('float32', 'bfloat16'):
        torch.manual_seed(0)
        net = InternViT(
            img_size=56,
            patch_size=14,
            embed_dims=64,
            depth=2,
            num_heads=4,
            out_indices=(1, ),
            dtype=dtype).cuda()
        x = torch.randn(2, 3, 56, 56, device='cuda')
        feats = net(x)
        loss = sum(f.float().square().mean() for f in feats)
        loss.backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        assert all(torch.isfinite(g).all() for g in grads)
        outs[dtype] = loss.item()
    assert abs(outs['bfloat16'] -
               outs['float32']) < 0.05 * abs(outs['float32'])
