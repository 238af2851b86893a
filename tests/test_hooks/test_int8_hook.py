"""The int8 hook on real gloo ranks: exact algebra, error feedback, config.

Each rank plants known gradients (a parameter ``p`` with loss
``(p * x).sum()`` has gradient exactly ``x``). The test recomputes the whole
reduction by hand with its own torch code (the same rounding rules: scale
``max|x| / 127`` per block, round half to even, clamp to +-127) and expects
DDP's result bit for bit.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.comm import (CommCounter, build_comm_hook, build_sharded_comm,
                              check_comm_hook_cfg)
from mmcv_custom.hooks.int8 import Int8State, int8_compress_hook
from mmcv_custom.hooks.sharded import Int8ReduceScatter
from mmcv_custom.testing import run_ranks

# (numel, block_size): exact multiples of block_size * world_size, ragged
# tails, a bucket smaller than one block, a single element.
CASES = [(1536, 256), (1000, 256), (300, 7), (5, 256), (1, 4)]


def planted(rank, step, numel, block_size, dtype=torch.float32):
    """Gradients over several decades (so block scales differ), with the
    second block all zero on every rank."""
    gen = torch.Generator().manual_seed(1000 * step + 17 * rank + numel)
    g = torch.randn(numel, generator=gen)
    g *= 10.0**torch.randint(-3, 3, (numel, ), generator=gen).float()
    g[block_size:2 * block_size] = 0
    return g.to(dtype)


# -- the reference, independent of mmcv_custom -------------------------------
def ref_quantize(x, block_size):
    """Blocks of ``x`` (fp32, whole blocks) -> (q as fp32 ints, scales)."""
    blocks = x.view(-1, block_size)
    scales = blocks.abs().amax(dim=1) / 127
    q = torch.where(scales[:, None] > 0, blocks / scales[:, None],
                    torch.zeros_like(blocks))
    return q.round().clamp(-127, 127), scales


def ref_dequantize(q, scales):
    return (q * scales[:, None]).reshape(-1)


def ref_reduce(grads, residuals, block_size, dtype):
    """The hook's result and each rank's next residual, by hand.

    One parameter: its blocks start at 0 (the last one may be short) and
    block ``b`` belongs to rank ``b % world``.

    Returns:
        tuple: (result in ``dtype``, new residuals, first-phase scales per
        rank, second-phase scales, padded length).
    """
    world = len(grads)
    numel = grads[0].numel()
    padded = -(-numel // block_size) * block_size
    shares, deqs, scales1 = [], [], []
    for g, e in zip(grads, residuals):
        # Zero padding leaves a short last block's max, hence scale, alone.
        x = torch.zeros(padded)
        x[:numel] = g.float() * (1.0 / world) + e
        q, s = ref_quantize(x, block_size)
        shares.append(x)
        deqs.append(ref_dequantize(q, s))
        scales1.append(s)
    new_res = [(x - d)[:numel].clone() for x, d in zip(shares, deqs)]
    total = deqs[0].clone()
    for i in range(1, world):
        total = total + deqs[i]
    q, scales2 = ref_quantize(total, block_size)
    result = ref_dequantize(q, scales2)
    # The owner keeps what the second rounding and the cast dropped.
    lost = (total - result.to(dtype).float())[:numel]
    for b in range(padded // block_size):
        piece = slice(b * block_size, min((b + 1) * block_size, numel))
        new_res[b % world][piece] += lost[piece]
    out = result[:numel].to(dtype)
    return out, new_res, scales1, [scales2], padded


class OneParam(nn.Module):
    """One parameter, so DDP's bucket is exactly its gradient."""

    def __init__(self, numel, dtype):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(numel, dtype=dtype))

    def forward(self, x):
        return (self.p * x).sum()


def _reduce_cases(rank, world_size, dtype, steps, error_feedback):
    out = []
    for numel, block_size in CASES:
        model = DDP(OneParam(numel, dtype))
        state = Int8State(None, block_size, error_feedback)
        model.register_comm_hook(state, int8_compress_hook)
        grads = []
        for step in range(steps):
            model.zero_grad()
            model(planted(rank, step, numel, block_size, dtype)).backward()
            grads.append(model.module.p.grad.clone())
        names = {model.module.p: 'p'}
        out.append(
            dict(
                grads=grads,
                state=state.state_dict(names),
                kept=len(state._residuals) + len(state._pending)))
    return out


@pytest.mark.parametrize('world_size', [2, 3])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_result_is_the_hand_computed_dequantized_sum(world_size, dtype):
    steps = 3
    results = run_ranks(
        _reduce_cases, dtype, steps, True, world_size=world_size)
    for case, (numel, block_size) in enumerate(CASES):
        residuals = [torch.zeros(numel) for _ in range(world_size)]
        for step in range(steps):
            grads = [
                planted(r, step, numel, block_size, dtype)
                for r in range(world_size)
            ]
            expected, new_res, scales1, scales2, shard = ref_reduce(
                grads, residuals, block_size, dtype)
            for rank in range(world_size):
                got = results[rank][case]['grads'][step]
                assert got.dtype is dtype
                assert torch.equal(got, expected), (numel, block_size, step)
            if step == 0:
                # No residual yet: the error against the true mean is at
                # most half a step of every rank's block scale plus half a
                # step of the sum's (plus the cast to bf16).
                mean = torch.stack([g.double() for g in grads]).mean(0)
                padded = world_size * shard
                bound = sum(s.double().repeat_interleave(block_size)
                            for s in scales1) / 2
                bound += torch.cat(scales2).double().repeat_interleave(
                    block_size) / 2
                bound = bound[:numel] * (1 + 1e-5) + 1e-30
                if dtype is torch.bfloat16:
                    bound += expected.double().abs() * 2.0**-8
                assert padded % block_size == 0
                assert ((expected.double() - mean).abs() <= bound).all()
            residuals = new_res
        for rank in range(world_size):
            saved = results[rank][case]['state']['params']['p']
            assert torch.equal(saved, residuals[rank])


def test_all_zero_bucket_stays_zero():

    def body(rank, world_size):
        model = DDP(OneParam(600, torch.float32))
        state = Int8State(None, 8)
        model.register_comm_hook(state, int8_compress_hook)
        model(torch.zeros(600)).backward()
        return model.module.p.grad, state.state_dict({model.module.p: 'p'})

    for grad, saved in run_ranks(body):
        assert torch.equal(grad, torch.zeros(600))
        assert torch.equal(saved['params']['p'], torch.zeros(600))


@pytest.mark.parametrize('world_size', [2, 3])
def test_error_feedback_conserves_the_gradient_sum(world_size):
    """sum_t applied_t + sum_ranks residual_T == sum_t mean_t.

    Per step every rank's share is ``x_i = g_i / W + e_i``; the first
    rounding keeps ``x_i - deq_i`` and the owner of each shard adds what
    the second rounding dropped, so ``applied = sum_i x_i - sum_i e_i'``
    and the sum over steps telescopes. Residuals are of ``g / W``: they
    are summed over ranks, not averaged.
    """
    steps = 5
    results = run_ranks(
        _reduce_cases, torch.float32, steps, True, world_size=world_size)
    plain = run_ranks(
        _reduce_cases, torch.float32, steps, False, world_size=world_size)
    for case, (numel, block_size) in enumerate(CASES):
        true_sum = sum(
            torch.stack([
                planted(r, t, numel, block_size).double()
                for r in range(world_size)
            ]).mean(0) for t in range(steps))
        # A few fp32 roundings per step, of numbers up to the largest
        # gradient.
        tol = 4 * 2.0**-24 * steps * max(
            planted(r, t, numel, block_size).abs().max().item()
            for r in range(world_size) for t in range(steps))
        applied = sum(g.double() for g in results[0][case]['grads'])
        kept = sum(results[r][case]['state']['params']['p'].double()
                   for r in range(world_size))
        assert (applied + kept - true_sum).abs().max() <= tol
        # Without error feedback the rounding is lost for good (the
        # identity fails by far more than the tolerance), and nothing is
        # kept.
        lost = sum(g.double() for g in plain[0][case]['grads']) - true_sum
        if numel > 1:
            assert lost.abs().max() > 100 * tol
        for rank in range(world_size):
            assert plain[rank][case]['kept'] == 0
            assert plain[rank][case]['state']['params'] == {}
            assert plain[rank][case]['state']['error_feedback'] is False


class Layers(nn.Module):
    """Several parameters in small buckets, which DDP lays out again after
    the first step (in forward order instead of reverse)."""

    def __init__(self):
        super().__init__()
        self.params = nn.ParameterList(
            nn.Parameter(torch.zeros(n)) for n in (700, 300, 900, 50, 400))

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.params, xs))


def _relayout(rank, world_size):
    model = DDP(Layers(), bucket_cap_mb=0.004)
    state = Int8State(None, 16)
    model.register_comm_hook(state, int8_compress_hook)
    names = {p: f'params.{i}' for i, p in enumerate(model.module.params)}
    layouts, grads = [], []
    for step in range(4):
        model.zero_grad()
        xs = [planted(rank, step, p.numel(), 16) for p in model.module.params]
        model(xs).backward()
        grads.append([p.grad.clone() for p in model.module.params])
        layouts.append(
            sorted(layout for layout, _ in state._residuals.values()))
    saved = state.state_dict(names)
    # A fresh state takes the saved residuals; a wrong one is refused
    # before anything changes.
    fresh = Int8State(None, 16)
    fresh.load_state_dict(saved, names)
    again = fresh.state_dict(names)
    errors = []
    for bad in (dict(saved, world_size=world_size + 1),
                dict(saved, params={'nope': torch.zeros(3)}),
                dict(saved, params={'params.0':
                                    torch.zeros(3)}), dict(saved,
                                                           version=0), 'junk'):
        try:
            fresh.load_state_dict(bad, names)
        except ValueError as e:
            errors.append(str(e))
    try:
        Int8State(None, 16, error_feedback=False).load_state_dict(saved, names)
    except ValueError as e:
        off = str(e)
    return dict(
        layouts=layouts,
        grads=grads,
        saved=saved,
        again=again,
        errors=errors,
        after=fresh.state_dict(names),
        off=off)


def test_residuals_follow_parameters_across_bucket_layouts():
    steps = 4
    results = run_ranks(_relayout)
    sizes = (700, 300, 900, 50, 400)
    first = results[0]
    # DDP did change its buckets, so the residuals had to move.
    assert first['layouts'][0] != first['layouts'][1]
    assert first['layouts'][1] == first['layouts'][3]
    for i, n in enumerate(sizes):
        true_sum = sum(
            torch.stack([planted(r, t, n, 16).double()
                         for r in range(2)]).mean(0) for t in range(steps))
        applied = sum(g[i].double() for g in first['grads'])
        kept = sum(res['saved']['params'][f'params.{i}'].double()
                   for res in results)
        tol = 4 * 2.0**-24 * steps * max(
            planted(r, t, n, 16).abs().max().item() for r in range(2)
            for t in range(steps))
        assert (applied + kept - true_sum).abs().max() <= tol, i
    for res in results:
        for name, r in res['saved']['params'].items():
            assert torch.equal(res['again']['params'][name], r)
            assert torch.equal(res['after']['params'][name], r)
        assert len(res['errors']) == 5
        assert 'saved on 3 ranks and cannot be used on 2' in res['errors'][0]
        assert "parameters this model does not: ['nope']" in res['errors'][1]
        assert 'residual of params.0 does not fit' in res['errors'][2]
        assert res['errors'][3] == 'int8 state version 0 is not one of (1, 2)'
        assert res['errors'][4] == ('expected an Int8State.state_dict(), '
                                    'but got str')
        assert 'error_feedback is False here' in res['off']


# -- config, wrapper, FSDP2 --------------------------------------------------
@pytest.mark.parametrize('cfg,error,message', [
    (dict(block_size=0), ValueError, 'block_size should be an int >= 1, but '
     'got 0'),
    (dict(block_size=-1), ValueError, 'block_size should be an int >= 1, '
     'but got -1'),
    (dict(block_size=2.5), TypeError, 'block_size should be an int >= 1, '
     'but got float: 2.5'),
    (dict(block_size='256'), TypeError, 'block_size should be an int >= 1, '
     "but got str: '256'"),
    (dict(block_size=True), TypeError, 'block_size should be an int >= 1, '
     'but got bool: True'),
    (dict(error_feedback='no'), TypeError, 'error_feedback should be True or '
     "False, but got str: 'no'"),
    (dict(error_feedback=1), TypeError, 'error_feedback should be True or '
     'False, but got int: 1'),
])
def test_bad_values_rejected_before_anything_is_built(cfg, error, message):
    with pytest.raises(error) as info:
        check_comm_hook_cfg(dict(type='int8_compress', **cfg))
    assert str(info.value) == f'comm_hook int8_compress: {message}'
    # The state says the same when built by hand.
    with pytest.raises(error) as info:
        Int8State(None, **cfg)
    assert str(info.value) == message


def test_config_keys_wrapper_and_fsdp2():
    checked = check_comm_hook_cfg(dict(type='int8_compress', block_size=64))
    assert checked['state_kwargs'] == dict(block_size=64)
    # Integers of other libraries pass, as require_int lets them.
    check_comm_hook_cfg(dict(type='int8_compress', block_size=np.int64(64)))
    assert type(Int8State(None, np.int64(64)).block_size) is int
    with pytest.raises(
            TypeError,
            match=r"unexpected keys \['bits'\]. Valid "
            'keys: type, wrapper, block_size, error_feedback'):
        check_comm_hook_cfg(dict(type='int8_compress', bits=4))
    for wrapper in ('fp16', 'bf16'):
        with pytest.raises(ValueError) as info:
            check_comm_hook_cfg(dict(type='int8_compress', wrapper=wrapper))
        assert str(info.value) == (
            "comm_hook type 'int8_compress' already quantizes to int8, so "
            f"wrapper='{wrapper}' would round twice. Drop the wrapper.")
    with pytest.raises(ValueError) as info:
        build_sharded_comm(dict(type='int8_compress'))
    assert str(info.value) == (
        "comm_hook type='int8_compress' with error_feedback=True has no "
        'form under full sharding: there error feedback would keep a '
        'full-size, unsharded residual of the gradients on every rank, the '
        'memory FSDP2 is there to save. Set error_feedback=False (e.g. '
        '--cfg-options comm_hook.error_feedback=False) to reduce-scatter in '
        "int8 without it, use type='bf16_compress', or shard hybrid "
        "(strategy.sharding='hybrid' on several nodes), where the residual "
        "is of the rank's shard only.")
    spec = build_sharded_comm(
        dict(type='int8_compress', block_size=64, error_feedback=False))
    assert spec.int8_block_size == 64 and spec.sent_dtype is None
    assert spec.describe() == (
        "type='int8_compress' (FSDP2 reduce-scatter in int8, one fp32 scale "
        'per 64 values, no error feedback, averaged before the rounding)')
    # Bad values are reported before the missing sharded form.
    with pytest.raises(ValueError, match='block_size should be an int >= 1'):
        build_sharded_comm(
            dict(type='int8_compress', block_size=0, error_feedback=False))
    with pytest.raises(ValueError, match='block_size should be an int >= 1'):
        build_sharded_comm(dict(type='int8_compress', block_size=0))


def test_blocks_too_large_for_the_c_kernels_are_noted():
    assert build_comm_hook(dict(type='int8_compress',
                                block_size=4096)).notes == ()
    assert build_comm_hook(
        dict(type='int8_compress', block_size=8192),
        device=torch.device('cpu')
    ).notes == (
        "comm_hook type='int8_compress': block_size=8192 is larger than "
        "the C kernels' largest block (4096), so on CPU the quantization "
        "runs in torch's ops, about 25x slower; a block_size <= 4096 keeps "
        'the one-pass kernels.', )


def test_hook_needs_its_state():

    def body(rank, world_size):
        model = DDP(OneParam(10, torch.float32))
        model.register_comm_hook(None, int8_compress_hook)
        try:
            model(torch.ones(10)).backward()
        except Exception as e:  # DDP may wrap it
            return str(e)
        return None

    for message in run_ranks(body):
        assert 'int8_compress_hook needs an Int8State' in message
        assert 'but got NoneType: None' in message


# -- telemetry and training through the registry -----------------------------
class Net(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train(rank, world_size, as_view, cfg, bucket_cap_mb=25):
    torch.manual_seed(0)  # the same initial weights everywhere
    model = DDP(
        Net(), gradient_as_bucket_view=as_view, bucket_cap_mb=bucket_cap_mb)
    counter = CommCounter()
    spec = build_comm_hook(cfg, counter=counter)
    model.register_comm_hook(spec.state, spec.hook)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 16, generator=gen)
    y = x[:, :4] * 2 - x[:, 4:8]
    losses, counts = [], []
    for _ in range(20):
        optim.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        losses.append(loss.item())
        counts.append(counter.pop())
    params = [p.detach().clone() for p in model.parameters()]
    return dict(
        losses=losses, counts=counts, params=params, describe=spec.describe())


@pytest.mark.parametrize('as_view', [False, True])
def test_training_stays_in_sync_and_counts_bytes(as_view):
    results = run_ranks(_train, as_view,
                        dict(type='int8_compress', block_size=32))
    exact = run_ranks(_train, as_view, dict(type='allreduce'))
    for a, b in zip(results[0]['params'], results[1]['params']):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()
    for res, ref in zip(results, exact):
        assert res['losses'][-1] < 0.5 * res['losses'][0]
        # As good as full precision, to a per cent (1e-5 measured).
        assert abs(res['losses'][-1] - ref['losses'][-1]) < (0.01 *
                                                             ref['losses'][-1])
    # Net has 16*32 + 32 + 32*4 + 4 = 676 gradients, all in one bucket:
    # DDP would send 676 fp32 numbers. Blocks of 32 per parameter: 16 + 1
    # + 4 + 1 = 22 blocks, so 676 int8 plus 22 fp32 scales; the two ranks'
    # segments (11 blocks each: 324 and 352 values) need no alignment.
    # Counted by the one rule (mmcv_custom.comm.traffic): half the
    # all-to-all of all 764 bytes, plus the all-gather of each rank's
    # part, padded to the larger (352 + 44 = 396 bytes), from 2 ranks.
    numel = 16 * 32 + 32 + 32 * 4 + 4
    quantized, padded = 676 + 4 * 22, 352 + 4 * 11
    for res in results:
        for baseline, sent in res['counts']:
            assert baseline == 4 * numel
            assert sent == quantized // 2 + 2 * padded // 2
    assert "type='int8_compress' (int8_compress_hook)" in (
        results[0]['describe'])


def test_bucket_layout_changes_no_number():
    """Blocks and their owners follow the parameters, not DDP's buckets:
    one bucket for the whole net, or one per parameter (and DDP's rebuilt
    layout after the first step), train to the same bits, on 3 ranks so
    that owners take turns unevenly."""
    cfg = dict(type='int8_compress', block_size=32)
    one = run_ranks(_train, True, cfg, 25, world_size=3)
    # A bucket closes once it is over the cap: at 1e-4 MB (26 fp32
    # gradients), DDP's buckets from its second step on are fc2 (132),
    # fc1.bias (32) and fc1.weight (512).
    many = run_ranks(_train, True, cfg, 1e-4, world_size=3)
    for a, b in zip(one, many):
        assert a['losses'] == b['losses']
        for p, q in zip(a['params'], b['params']):
            assert torch.equal(p, q)


def test_non_finite_gradient_poisons_its_block_once():
    """A NaN or inf reaches every rank's result (so non-finite checks after
    the hook fire) in its block only, and is not kept for the next step."""

    def body(rank, world_size):
        model = DDP(OneParam(64, torch.float32))
        model.register_comm_hook(Int8State(None, 8), int8_compress_hook)
        grads = []
        for bad in (float('nan'), float('inf'), None):
            x = torch.ones(64)
            if bad is not None and rank == 1:
                x[20] = bad  # block 2 of 8 elements
            model.zero_grad()
            model(x).backward()
            grads.append(model.module.p.grad.clone())
        return grads

    for grads in run_ranks(body):
        for grad in grads[:2]:
            assert not torch.isfinite(grad[16:24]).any()
            assert torch.isfinite(grad[:16]).all()
            assert torch.isfinite(grad[24:]).all()
        assert torch.allclose(grads[2], torch.ones(64), rtol=1e-6, atol=0)


# -- FSDP2: int8 reduce-scatter, no error feedback ---------------------------
def _reduce_scatter_int8(rank, world_size, dtype, block_size):
    counter = CommCounter()
    comm = Int8ReduceScatter(block_size, counter)
    chunk = 300
    inp = planted(rank, 0, world_size * chunk, block_size, dtype)
    out = comm.allocate((chunk, ), dtype=dtype, device=inp.device)
    comm(
        output_tensor=out,
        input_tensor=inp,
        group=dist.group.WORLD,
        op=dist.ReduceOp.SUM)
    return out, counter.pop()


@pytest.mark.parametrize('world_size', [2, 3])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_int8_reduce_scatter_is_the_hand_computed_sum(world_size, dtype):
    """Every rank's chunk j, in blocks from the chunk's start, quantized
    from 1 / world_size of the input; rank j sums the dequantized copies
    in fp32 in rank order and keeps the sum (no second rounding)."""
    block, chunk = 64, 300  # 300 = 4 whole blocks and a short one
    results = run_ranks(
        _reduce_scatter_int8, dtype, block, world_size=world_size)
    inputs = [
        planted(r, 0, world_size * chunk, block, dtype).float()
        for r in range(world_size)
    ]
    padded = -(-chunk // block) * block
    for rank, (out, (baseline, wire)) in enumerate(results):
        total = None
        for x in inputs:
            share = torch.zeros(padded)
            share[:chunk] = x[rank * chunk:(rank + 1) * chunk] * (1.0 /
                                                                  world_size)
            deq = ref_dequantize(*ref_quantize(share, block))[:chunk]
            total = deq if total is None else total + deq
        assert out.dtype is dtype
        assert torch.equal(out, total.to(dtype))
        # 5 scales and 300 values per chunk, for every rank.
        assert wire == world_size * (4 * 5 + 300)
        assert baseline == world_size * chunk * (2 if dtype is torch.bfloat16
                                                 else 4)


def test_state_file_bytes_count_the_fp32_residual():
    """What the preflight counts for a save: the residual is fp32 even for
    bf16 gradients (a bf16 backbone), none without error feedback."""
    from mmcv_custom.hooks.int8 import Int8StateKeeper
    params = [
        torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.zeros(6), requires_grad=False)
    ]
    assert Int8StateKeeper.file_bytes(params, {}) == 40
    assert Int8StateKeeper.file_bytes(params, dict(error_feedback=False)) == 0
