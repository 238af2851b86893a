"""A bf16 InternViT backbone (InternVL's recipe): bf16 DDP buckets, fp32
heads, and what the comm hooks do with bf16 buckets.

Layers: the backbone alone; the hooks on a real gloo group with exact
expectations; a real MMEngine Runner training the tiny InternViT UperNet on
two gloo ranks (a few seconds: 6 iterations on 16 images).
"""
import os
import os.path as osp

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mmcv_custom.models  # noqa: F401  (registers InternViT)
from mmcv_custom.comm import CommCounter, build_comm_hook
from mmcv_custom.hooks.half import (CompressState, allreduce_hook,
                                    bf16_compress_hook, fp16_compress_hook,
                                    fp16_compress_wrapper)
from mmcv_custom.models.backbones.intern_vit import InternViT
from mmcv_custom.testing import run_ranks

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TINY = osp.join(ROOT, 'configs', 'intern_vit',
                'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')

FP16_NOTE = (
    "comm_hook type='fp16_compress': the bf16 parameters ({names}) are sent "
    'as bf16, as they are, not cast to fp16 (fp16 has far less range than '
    'bf16: it would overflow above 65504 and flush values below about 6e-8 '
    'to zero); the bytes are the same. Only fp32 buckets are cast to fp16. '
    "For one wire format everywhere use type='bf16_compress'.")


def _tiny_vit(**kwargs):
    return InternViT(
        img_size=28,
        embed_dims=32,
        depth=2,
        num_heads=2,
        out_indices=(0, 1),
        **kwargs)


def test_bf16_backbone_casts_at_construction_and_returns_fp32():
    vit = _tiny_vit(dtype='bfloat16')
    assert {p.dtype for p in vit.parameters()} == {torch.bfloat16}
    vit.init_weights()  # in place: the dtype stays
    assert {p.dtype for p in vit.parameters()} == {torch.bfloat16}
    outs = vit(torch.randn(2, 3, 28, 28))  # fp32 in, as from the preprocessor
    assert [o.dtype for o in outs] == [torch.float32] * 2
    sum(o.sum() for o in outs).backward()
    assert vit.blocks[0].attn.qkv.weight.grad.dtype is torch.bfloat16


def test_bf16_backbone_with_pyramid():
    vit = InternViT(
        img_size=28,
        embed_dims=32,
        depth=4,
        num_heads=2,
        out_indices=(0, 1, 2, 3),
        with_fpn=True,
        with_final_norm=True,
        dtype='bfloat16')
    outs = vit(torch.randn(1, 3, 28, 28))
    assert [o.dtype for o in outs] == [torch.float32] * 4
    assert [o.shape[-1] for o in outs] == [8, 4, 2, 1]


def test_fp32_backbone_unchanged():
    vit = _tiny_vit()
    assert {p.dtype for p in vit.parameters()} == {torch.float32}
    assert vit(torch.randn(1, 3, 28, 28))[0].dtype is torch.float32


def test_bad_dtype():
    with pytest.raises(
            ValueError,
            match=r"dtype should be one of "
            r"\['bfloat16', 'float32'\], but got 'float16'"):
        _tiny_vit(dtype='float16')


class _HalfBackboneNet(nn.Module):
    """A bf16 (or fp16) 'backbone' and an fp32 'head', cast before DDP wraps
    them."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.dtype = dtype
        self.backbone = nn.Linear(4, 4).to(dtype)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.backbone(x.to(self.dtype)).float())


def _step(cfg, x, dtype=torch.bfloat16, by_hand=None):
    """One DDP step of a fresh ``_HalfBackboneNet``: through the registry
    with ``cfg``, by hand with ``by_hand = (state, hook)``, or with DDP's
    own all-reduce when both are None."""
    torch.manual_seed(0)
    net = _HalfBackboneNet(dtype)
    ddp = nn.parallel.DistributedDataParallel(net)
    out = dict(seen=[])
    if cfg is not None:
        counter = CommCounter()
        spec = build_comm_hook(
            cfg,
            counter=counter,
            param_names={
                p: n
                for n, p in net.named_parameters()
            })
        state, hook = spec.state, spec.hook
        out['notes'] = spec.notes
    elif by_hand is not None:
        state, hook = by_hand
    if cfg is not None or by_hand is not None:

        def spy(state, bucket):
            out['seen'].append(str(bucket.buffer().dtype))
            return hook(state, bucket)

        ddp.register_comm_hook(state, spy)
    ddp(x).sum().backward()
    out['grads'] = {n: p.grad.clone() for n, p in net.named_parameters()}
    if cfg is not None:
        out['baseline'], out['wire'] = counter.pop()
    out['seen'].sort()
    return out


def _hooks_on_bf16_buckets(rank, world_size):
    x = torch.randn(8, 4) * (rank + 1)
    # What the ranks' fp32 head gradients are before averaging, to compute
    # the fp16 wire's result by hand.
    torch.manual_seed(0)
    local = _HalfBackboneNet()
    local(x).sum().backward()
    head = torch.cat([local.head.weight.grad.flatten(), local.head.bias.grad])
    heads = [torch.empty_like(head) for _ in range(world_size)]
    dist.all_gather(heads, head)
    return dict(
        ref=_step(None, x),
        bf16=_step(dict(type='bf16_compress'), x),
        fp16=_step(dict(type='fp16_compress'), x),
        fp16_wrapped=_step(dict(type='allreduce', wrapper='fp16'), x),
        fp16_by_hand=_step(
            None, x, by_hand=(CompressState(None), fp16_compress_hook)),
        wrapper_by_hand=_step(
            None, x, by_hand=(None, fp16_compress_wrapper(allreduce_hook))),
        heads=heads)


def test_half_precision_hooks_pass_bf16_buckets_through():
    results = run_ranks(_hooks_on_bf16_buckets)
    backbone = ('backbone.weight', 'backbone.bias')
    for r in results:
        ref = r['ref']['grads']
        assert ref['backbone.weight'].dtype is torch.bfloat16
        assert ref['head.weight'].dtype is torch.float32
        for run in ('bf16', 'fp16', 'fp16_wrapped', 'fp16_by_hand',
                    'wrapper_by_hand'):
            grads = r[run]['grads']
            # DDP buckets parameters of one dtype together.
            assert r[run]['seen'] == ['torch.bfloat16', 'torch.float32']
            # Passed through: one bf16 all-reduce of the halved bucket,
            # exactly what DDP does without a hook (division by 2 is exact),
            # whether the hook's own wire format is bf16 or fp16.
            for n in backbone:
                assert grads[n].dtype is torch.bfloat16
                assert torch.equal(grads[n], ref[n]), (run, n)
            assert grads['head.weight'].dtype is torch.float32
        # The fp32 head does go out in each hook's format: halve in fp32,
        # round, sum in that format, widen.
        for run, wire in (('bf16', torch.bfloat16), ('fp16', torch.float16),
                          ('fp16_by_hand', torch.float16)):
            halves = [(h * 0.5).to(wire) for h in r['heads']]
            expected = (halves[0] + halves[1]).float()
            grads = r[run]['grads']
            got = torch.cat(
                [grads['head.weight'].flatten(), grads['head.bias']])
            assert torch.equal(got, expected), run
        for run in ('bf16', 'fp16', 'fp16_wrapped'):
            # 20 bf16 numbers at 2 bytes, 5 fp32 ones at 4; all on the wire
            # at 2 bytes: baseline 60, wire 50.
            assert r[run]['baseline'] == 20 * 2 + 5 * 4
            assert r[run]['wire'] == 25 * 2
        assert r['bf16']['notes'] == ()
        assert r['fp16']['notes'] == (FP16_NOTE.format(
            names='backbone.weight, backbone.bias'), )
        assert r['fp16_wrapped']['notes'] == (
            "comm_hook type='allreduce', wrapper='fp16': the bf16 parameters "
            '(backbone.weight, backbone.bias) are sent as bf16, as they are, '
            'not cast to fp16 (fp16 has far less range than bf16: it would '
            'overflow above 65504 and flush values below about 6e-8 to '
            'zero); the bytes are the same. Only fp32 buckets are cast to '
            "fp16. For one wire format everywhere use wrapper='bf16'.", )
    assert torch.equal(results[0]['fp16']['grads']['backbone.weight'],
                       results[1]['fp16']['grads']['backbone.weight'])


def _fp16_backbone_under_bf16(rank, world_size):
    x = torch.randn(8, 4) * (rank + 1)
    return dict(
        ref=_step(None, x, dtype=torch.float16),
        bf16=_step(dict(type='bf16_compress'), x, dtype=torch.float16))


def test_bf16_compress_passes_fp16_buckets_through():
    """The mirror case: fp16 parameters keep their 3 extra bits."""
    for r in run_ranks(_fp16_backbone_under_bf16):
        for n in ('backbone.weight', 'backbone.bias'):
            assert r['bf16']['grads'][n].dtype is torch.float16
            assert torch.equal(r['bf16']['grads'][n], r['ref']['grads'][n])
        assert r['bf16']['notes'] == (
            "comm_hook type='bf16_compress': the fp16 parameters "
            '(backbone.weight, backbone.bias) are sent as fp16, as they are, '
            'not cast to bf16 (bf16 keeps 3 fewer significant bits than '
            'fp16); the bytes are the same. Only fp32 buckets are cast to '
            "bf16. For one wire format everywhere use type='fp16_compress'.", )


def test_fp32_model_has_no_note():
    spec = build_comm_hook(
        dict(type='fp16_compress'),
        param_names={nn.Parameter(torch.ones(2)): 'w'})
    assert spec.base_hook is fp16_compress_hook and spec.notes == ()
    frozen = nn.Parameter(
        torch.ones(2, dtype=torch.bfloat16), requires_grad=False)
    # Frozen bf16 parameters are in no bucket.
    assert build_comm_hook(
        dict(type='fp16_compress'), param_names={
            frozen: 'f'
        }).notes == ()


def _train_tiny(rank, world_size, work_dir, comm_hook):
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mmcv_custom.launching.cpu_start import prepare_launch

    os.chdir(work_dir)  # the toy dataset is generated under the cwd
    cfg = Config.fromfile(TINY)
    cfg.work_dir = osp.join(work_dir, 'work')
    prepare_launch(cfg, 'pytorch', cuda=False)  # CPU DDP, SyncBN -> BN
    cfg.comm_hook = comm_hook
    cfg.model.backbone.dtype = 'bfloat16'
    cfg.model.backbone.drop_path_rate = 0.
    cfg.train_cfg = dict(
        type='IterBasedTrainLoop', max_iters=6, val_interval=1000)
    cfg.param_scheduler = []
    cfg.default_hooks.logger.interval = 1
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=-1)
    for loader in (cfg.train_dataloader, cfg.val_dataloader):
        loader.batch_size = 4
        loader.num_workers = 0
        loader.persistent_workers = False
        loader.dataset.generate = dict(num_train=16, num_val=4)
    cfg.test_dataloader = cfg.val_dataloader
    runner = Runner.from_cfg(cfg)
    runner.train()
    model = runner.model.module
    hub = runner.message_hub
    flat = torch.cat(
        [p.detach().float().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    log = ''
    if rank == 0:
        with open(osp.join(runner.log_dir, f'{runner.timestamp}.log')) as f:
            log = f.read()
    return dict(
        log=log,
        losses=list(hub.get_scalar('train/loss').data[0]),
        in_sync=torch.equal(gathered[0], gathered[1]),
        backbone={str(p.dtype)
                  for p in model.backbone.parameters()},
        heads={
            str(p.dtype)
            for n, p in trained if not n.startswith('backbone.')
        },
        bf16_numel=sum(p.numel() for _, p in trained
                       if p.dtype is torch.bfloat16),
        fp32_numel=sum(p.numel() for _, p in trained
                       if p.dtype is torch.float32),
        comm_mb=list(hub.get_scalar('train/comm_MB').data[0]),
        comm_ratio=list(hub.get_scalar('train/comm_ratio').data[0]))


@pytest.mark.parametrize('hook', ['bf16_compress', 'fp16_compress'])
def test_tiny_upernet_trains_with_a_bf16_backbone(tmp_path, hook):
    results = run_ranks(
        _train_tiny, str(tmp_path), dict(type=hook), timeout=300)
    for r in results:
        assert r['backbone'] == {'torch.bfloat16'}
        assert r['heads'] == {'torch.float32'}
        assert r['in_sync']
        assert r['losses'][-1] < r['losses'][0]
        # From inside the hook: the telemetry's baseline is each bucket as
        # DDP hands it over, so bf16 buckets count 2 bytes an element: the
        # backbone's buckets are bf16, the heads' fp32. Everything goes out
        # at 2 bytes (the backbone's passed through as bf16).
        bf16, fp32 = r['bf16_numel'], r['fp32_numel']
        assert bf16 > 0 and fp32 > 0
        assert r['comm_mb'] == [2 * (bf16 + fp32) / 2**20] * 6
        assert r['comm_ratio'] == pytest.approx([(2 * bf16 + 2 * fp32) /
                                                 (2 * bf16 + 4 * fp32)] * 6)
    log = results[0]['log']
    assert f"type='{hook}'" in log
    note = FP16_NOTE.split('(')[0]
    if hook == 'fp16_compress':
        # Once, as a warning in the log file, naming the bf16 parameters.
        assert log.count(note) == 1
        head, tail = FP16_NOTE.split('{names}')
        assert ('WARNING - ' + head + 'backbone.cls_token, '
                'backbone.pos_embed, backbone.patch_embed.proj.weight, ... ('
                ) in log
        assert ' in all)' + tail in log
    else:
        assert note not in log


def _nonfinite_bf16_bucket(rank, world_size):
    net = _HalfBackboneNet()
    ddp = nn.parallel.DistributedDataParallel(net)
    state = CompressState(None, check_finite=True)
    ddp.register_comm_hook(state, bf16_compress_hook)
    x = torch.randn(2, 4)
    if rank == 1:
        x[0, 0] = float('inf')
    ddp(x).sum().backward()
    return [
        sorted({str(p.dtype)
                for p in params}) for _, params in state.pop_nonfinite()
    ]


def test_bf16_pass_through_still_marks_nonfinite_buckets():
    # An inf input on one rank: the average of the bf16 bucket (sent as
    # it is) is not finite, and is marked like any compressed bucket.
    for found in run_ranks(_nonfinite_bf16_bucket):
        assert ['torch.bfloat16'] in found
