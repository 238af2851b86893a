"""Training features users combine with the hooks, on 2 gloo ranks.

Each run trains with a compressing hook registered and checks what matters
for data parallelism: every rank ends with the same weights (so gradients
were averaged, by the hook, on the steps DDP synchronises), the loss is
finite and falls.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from mmcv_custom.demo import MLPRegressor
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner


class _WithUnusedBranch(MLPRegressor):
    """Has parameters that get no gradient: needs find_unused_parameters."""

    def __init__(self):
        super().__init__(hidden=32, depth=2)
        self.unused = nn.Linear(32, 32)


def _train(rank, world_size, work_dir, comm_hook, wrapper_kwargs,
           optim_wrapper, model_type):
    model = _WithUnusedBranch() if model_type == 'unused' else None
    runner, _ = build_runner(
        work_dir,
        comm_hook,
        wrapper=dict(
            type='MMDistributedDataParallel',
            device_ids=None,
            **wrapper_kwargs),
        max_iters=12,
        model=model,
        optim_wrapper=optim_wrapper)
    runner.train()
    ddp = runner.model
    flat = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    losses = runner.message_hub.get_scalar('train/loss').data[0].tolist()
    return gathered, losses, len(ddp._comm_hooks)


SGD = dict(optimizer=dict(type='SGD', lr=0.1))


@pytest.mark.parametrize('name,comm_hook,wrapper_kwargs,optim_wrapper,model', [
    ('accumulative_counts', 'bf16_compress', {},
     dict(optimizer=dict(type='SGD', lr=0.1), accumulative_counts=3), None),
    ('amp-bf16', 'bf16_compress', {},
     dict(type='CPUAmpOptimWrapper', optimizer=dict(type='SGD',
                                                    lr=0.1)), None),
    ('amp-fp16-loss-scale', 'fp16_compress', {},
     dict(
         type='CPUAmpOptimWrapper',
         loss_scale=1024.,
         optimizer=dict(type='SGD', lr=0.1)), None),
    ('find_unused_parameters', 'bf16_compress',
     dict(find_unused_parameters=True), SGD, 'unused'),
    ('static_graph', 'fp16_compress', dict(static_graph=True), SGD, None),
    ('gradient_as_bucket_view', 'bf16_compress',
     dict(gradient_as_bucket_view=True), SGD, None),
    ('powerSGD+static_graph',
     dict(type='powerSGD', wrapper='bf16',
          start_powerSGD_iter=3), dict(static_graph=True), SGD, None),
    ('batched_powerSGD+accumulation',
     dict(type='batched_powerSGD', wrapper='bf16', start_powerSGD_iter=3), {},
     dict(optimizer=dict(type='SGD', lr=0.1), accumulative_counts=2), None),
])
def test_feature_trains_in_sync_with_the_hook(tmp_path, name, comm_hook,
                                              wrapper_kwargs, optim_wrapper,
                                              model):
    if isinstance(comm_hook, str):
        comm_hook = dict(type=comm_hook)
    (params, losses, n_hooks), _ = run_ranks(_train, str(tmp_path), comm_hook,
                                             wrapper_kwargs, optim_wrapper,
                                             model)
    assert n_hooks == 1
    # Both ranks saw different data yet hold the same weights.
    assert torch.equal(params[0], params[1])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_cpu_amp_wrapper_names_the_unsupported_dtype():
    from mmcv_custom import CPUAmpOptimWrapper
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'bfloat16' only, but got 'float16'"):
        CPUAmpOptimWrapper(optimizer=optimizer, dtype='float16')
    with pytest.raises(TypeError, match="but got 'static'"):
        CPUAmpOptimWrapper(optimizer=optimizer, loss_scale='static')
