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
from mmcv_custom.ddp_hooks import (CompressState, allreduce_hook,
                                   bf16_compress_hook, fp16_compress_hook,
                                   fp16_compress_wrapper)
from mmcv_custom.models.backbones.intern_vit import InternViT
from mmcv_custom.registry import CommCounter, build_comm_hook

from .dist_utils import run_ranks

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY = osp.join(ROOT, 'configs', 'intern_vit',
                'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')

FP16_REFUSED = (
    "fp16 compression cannot take torch.bfloat16 gradients (a bf16 model or "
    "backbone, e.g. InternViT(dtype='bfloat16')): fp16 has less range than "
    'bf16, so it would overflow above 65504 and flush values below about '
    "6e-8 to zero. Use bf16_compress (it sends bf16 buckets as they are) or "
    "wrapper='bf16'.")


def _tiny_vit(**kwargs):
    return InternViT(img_size=28, embed_dims=32, depth=2, num_heads=2,
                     out_indices=(0, 1), **kwargs)


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
    vit = InternViT(img_size=28, embed_dims=32, depth=4, num_heads=2,
                    out_indices=(0, 1, 2, 3), with_fpn=True,
                    with_final_norm=True, dtype='bfloat16')
    outs = vit(torch.randn(1, 3, 28, 28))
    assert [o.dtype for o in outs] == [torch.float32] * 4
    assert [o.shape[-1] for o in outs] == [8, 4, 2, 1]


def test_fp32_backbone_unchanged():
    vit = _tiny_vit()
    assert {p.dtype for p in vit.parameters()} == {torch.float32}
    assert vit(torch.randn(1, 3, 28, 28))[0].dtype is torch.float32


def test_bad_dtype():
    with pytest.raises(ValueError, match=r"dtype should be one of "
                       r"\['bfloat16', 'float32'\], but got 'float16'"):
        _tiny_vit(dtype='float16')


class _Bf16BackboneNet(nn.Module):
    """A bf16 'backbone' and an fp32 'head', cast before DDP wraps them."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(4, 4).to(torch.bfloat16)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.backbone(x.to(torch.bfloat16)).float())


def _hooks_on_bf16_buckets(rank, world_size):
    torch.manual_seed(0)
    net = _Bf16BackboneNet()
    ddp = nn.parallel.DistributedDataParallel(net)
    counter = CommCounter()
    spec = build_comm_hook(dict(type='bf16_compress'), counter=counter,
                           param_names={
                               p: n
                               for n, p in net.named_parameters()
                           })
    seen = []

    def spy(state, bucket):
        seen.append(bucket.buffer().dtype)
        return spec.hook(state, bucket)

    ddp.register_comm_hook(spec.state, spy)
    x = torch.randn(8, 4) * (rank + 1)
    ddp(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    baseline, wire = counter.pop()

    # The same step by DDP's own all-reduce, as a reference.
    torch.manual_seed(0)
    ref = _Bf16BackboneNet()
    ref_ddp = nn.parallel.DistributedDataParallel(ref)
    ref_ddp(x).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    errors = []
    for cfg in (dict(type='fp16_compress'),
                dict(type='allreduce', wrapper='fp16')):
        try:
            build_comm_hook(cfg, param_names={
                p: n
                for n, p in net.named_parameters()
            })
        except TypeError as e:
            errors.append(str(e))
    return dict(seen=sorted(map(str, seen)), grads=grads,
                ref_grads=ref_grads, baseline=baseline, wire=wire,
                errors=errors)


def test_bf16_compress_passes_bf16_buckets_through():
    results = run_ranks(_hooks_on_bf16_buckets)
    for r in results:
        # DDP buckets parameters of one dtype together.
        assert r['seen'] == ['torch.bfloat16', 'torch.float32']
        assert r['grads']['backbone.weight'].dtype is torch.bfloat16
        assert r['grads']['head.weight'].dtype is torch.float32
        # Passed through: one bf16 all-reduce of the halved bucket, exactly
        # what DDP does without a hook (division by 2 is exact).
        for n in ('backbone.weight', 'backbone.bias'):
            assert torch.equal(r['grads'][n], r['ref_grads'][n]), n
        # 20 bf16 numbers at 2 bytes, 5 fp32 ones at 4, both on the wire
        # as bf16 (the fp32 bucket is compressed): baseline 60, wire 50.
        assert r['baseline'] == 20 * 2 + 5 * 4
        assert r['wire'] == 25 * 2
        assert len(r['errors']) == 2
        assert r['errors'][0] == (
            "comm_hook type='fp16_compress': the DDP model has bfloat16 "
            "parameters (backbone.weight, backbone.bias), so DDP's buckets "
            'are bf16. ' + FP16_REFUSED)
        assert r['errors'][1].startswith(
            "comm_hook type='allreduce', wrapper='fp16': the DDP model has "
            'bfloat16 parameters')
    assert torch.equal(results[0]['grads']['backbone.weight'],
                       results[1]['grads']['backbone.weight'])


def _fp16_at_first_bucket(rank, world_size, which):
    net = _Bf16BackboneNet()
    ddp = nn.parallel.DistributedDataParallel(net)
    if which == 'hook':
        ddp.register_comm_hook(CompressState(None), fp16_compress_hook)
    else:
        ddp.register_comm_hook(None, fp16_compress_wrapper(allreduce_hook))
    try:
        ddp(torch.randn(2, 4)).sum().backward()
    except Exception as e:  # DDP may wrap it in a RuntimeError
        return str(e)
    return None


@pytest.mark.parametrize('which', ['hook', 'wrapper'])
def test_fp16_on_bf16_bucket_refused_at_first_bucket(which):
    """Registered by hand (no param_names to look at): the first bf16 bucket
    raises the same message."""
    for message in run_ranks(_fp16_at_first_bucket, which):
        assert message is not None and FP16_REFUSED in message


def test_fp32_model_still_builds_fp16_compress():
    spec = build_comm_hook(dict(type='fp16_compress'),
                           param_names={nn.Parameter(torch.ones(2)): 'w'})
    assert spec.base_hook is fp16_compress_hook
    frozen = nn.Parameter(torch.ones(2, dtype=torch.bfloat16),
                          requires_grad=False)
    # Frozen bf16 parameters are in no bucket.
    build_comm_hook(dict(type='fp16_compress'), param_names={frozen: 'f'})


def _train_tiny(rank, world_size, work_dir, comm_hook):
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mmcv_custom.launcher import prepare_launch

    os.chdir(work_dir)  # the toy dataset is generated under the cwd
    cfg = Config.fromfile(TINY)
    cfg.work_dir = osp.join(work_dir, 'work')
    prepare_launch(cfg, 'pytorch', cuda=False)  # CPU DDP, SyncBN -> BN
    cfg.comm_hook = comm_hook
    cfg.model.backbone.dtype = 'bfloat16'
    cfg.model.backbone.drop_path_rate = 0.
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=6,
                         val_interval=1000)
    cfg.param_scheduler = []
    cfg.default_hooks.logger.interval = 1
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=-1)
    for loader in (cfg.train_dataloader, cfg.val_dataloader):
        loader.batch_size = 4
        loader.num_workers = 0
        loader.persistent_workers = False
        loader.dataset.generate = dict(num_train=16, num_val=4)
    cfg.test_dataloader = cfg.val_dataloader
    try:
        runner = Runner.from_cfg(cfg)
        runner.train()
    except TypeError as e:
        return dict(error=str(e))
    model = runner.model.module
    hub = runner.message_hub
    flat = torch.cat([p.detach().float().flatten()
                      for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    trained = [(n, p) for n, p in model.named_parameters()
               if p.requires_grad]
    return dict(
        losses=list(hub.get_scalar('train/loss').data[0]),
        in_sync=torch.equal(gathered[0], gathered[1]),
        backbone={str(p.dtype) for p in model.backbone.parameters()},
        heads={str(p.dtype) for n, p in trained
               if not n.startswith('backbone.')},
        bf16_numel=sum(p.numel() for _, p in trained
                       if p.dtype is torch.bfloat16),
        fp32_numel=sum(p.numel() for _, p in trained
                       if p.dtype is torch.float32),
        comm_mb=list(hub.get_scalar('train/comm_MB').data[0]),
        comm_ratio=list(hub.get_scalar('train/comm_ratio').data[0]))


def test_tiny_upernet_trains_with_a_bf16_backbone(tmp_path):
    results = run_ranks(_train_tiny, str(tmp_path),
                        dict(type='bf16_compress'), timeout=300)
    for r in results:
        assert 'error' not in r, r['error']
        assert r['backbone'] == {'torch.bfloat16'}
        assert r['heads'] == {'torch.float32'}
        assert r['in_sync']
        assert r['losses'][-1] < r['losses'][0]
        # From inside the hook: the telemetry's baseline is each bucket as
        # DDP hands it over, so bf16 buckets count 2 bytes an element: the
        # backbone's buckets are bf16, the heads' fp32. Everything goes out
        # as bf16 (the backbone's passed through).
        bf16, fp32 = r['bf16_numel'], r['fp32_numel']
        assert bf16 > 0 and fp32 > 0
        assert r['comm_mb'] == [2 * (bf16 + fp32) / 2**20] * 6
        assert r['comm_ratio'] == pytest.approx(
            [(2 * bf16 + 2 * fp32) / (2 * bf16 + 4 * fp32)] * 6)


def test_tiny_upernet_refuses_fp16_compress_on_a_bf16_backbone(tmp_path):
    results = run_ranks(_train_tiny, str(tmp_path),
                        dict(type='fp16_compress'), timeout=300)
    for r in results:
        assert r['error'].startswith(
            "comm_hook type='fp16_compress': the DDP model has bfloat16 "
            'parameters (backbone.cls_token, backbone.pos_embed, '
            'backbone.patch_embed.proj.weight, ... (')
        assert FP16_REFUSED in r['error']  # MMEngine appends the hook


def _nonfinite_bf16_bucket(rank, world_size):
    net = _Bf16BackboneNet()
    ddp = nn.parallel.DistributedDataParallel(net)
    state = CompressState(None, check_finite=True)
    ddp.register_comm_hook(state, bf16_compress_hook)
    x = torch.randn(2, 4)
    if rank == 1:
        x[0, 0] = float('inf')
    ddp(x).sum().backward()
    return [sorted({str(p.dtype) for p in params})
            for _, params in state.pop_nonfinite()]


def test_bf16_pass_through_still_marks_nonfinite_buckets():
    # An inf input on one rank: the average of the bf16 bucket (sent as
    # it is) is not finite, and is marked like any compressed bucket.
    for found in run_ranks(_nonfinite_bf16_bucket):
        assert ['torch.bfloat16'] in found
