"""A small real MMEngine Runner for tests, on the demo MLP regressor."""
import logging

import torch
import torch.distributed as dist
from mmengine.runner import Runner

import mmcv_custom.demo  # noqa: F401  (registers MLPRegressor & co.)

__all__ = ['Records', 'build_runner', 'train_and_gather']


class Records(logging.Handler):
    """Keeps what a runner logs, as (level, message) pairs."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def build_runner(work_dir,
                 comm_hook=None,
                 launcher='pytorch',
                 hook_args=None,
                 wrapper=None,
                 max_iters=3,
                 model=None,
                 optim_wrapper=None,
                 checkpoint=None,
                 resume=False,
                 dataset=None,
                 batch_size=8,
                 load_from=None,
                 visualizer=None):
    """A Runner training ``MLPRegressor`` (or ``model``) with the comm-hook
    runner hook; ``wrapper`` is the ``model_wrapper_cfg`` (CPU DDP by
    default). Returns the runner and a :class:`Records` of its log."""
    dataset = dataset or dict(
        type='SyntheticRegressionDataset', num_samples=64)
    loader = dict(
        dataset=dataset,
        sampler=dict(type='DefaultSampler', shuffle=False),
        batch_size=batch_size,
        num_workers=0)
    # MMEngine sleeps 2 s whenever an iteration-based loop restarts a
    # finite dataloader; an infinite sampler never restarts.
    train_loader = dict(loader, sampler=dict(type='InfiniteSampler'))
    if wrapper is None and launcher != 'none':
        wrapper = dict(type='MMDistributedDataParallel', device_ids=None)
    runner = Runner(
        model=model or dict(type='MLPRegressor', hidden=32, depth=2),
        work_dir=work_dir,
        train_dataloader=train_loader,
        val_dataloader=loader,
        val_evaluator=dict(type='RegressionMSE'),
        test_dataloader=loader,
        test_evaluator=dict(type='RegressionMSE'),
        optim_wrapper=optim_wrapper
        or dict(optimizer=dict(type='SGD', lr=0.1)),
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=100),
        val_cfg=dict(),
        test_cfg=dict(),
        launcher=launcher,
        env_cfg=dict(dist_cfg=dict(backend='gloo')),
        default_hooks=dict(
            logger=dict(type='LoggerHook', interval=1),
            checkpoint=checkpoint or dict(type='CheckpointHook', interval=-1)),
        resume=resume,
        load_from=load_from,
        visualizer=visualizer,
        custom_hooks=[
            dict(type='CommHookRegistrationHook', **(hook_args or {}))
        ],
        experiment_name='exp',
        randomness=dict(seed=0),
        # Where Runner.from_cfg puts the keys it has no argument for.
        cfg=dict(model_wrapper_cfg=wrapper, comm_hook=comm_hook))
    records = Records()
    runner.logger.addHandler(records)
    return runner, records


def train_and_gather(runner, records, world_size):
    """Train ``runner``; return every rank's flattened weights (to compare
    runs and ranks bit for bit) and this rank's INFO and WARNING lines about
    the hook state."""
    runner.train()
    flat = torch.cat(
        [p.detach().flatten() for p in runner.model.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return gathered, [(lvl, m) for lvl, m in records.lines
                      if 'state' in m and lvl in ('WARNING', 'INFO')]
