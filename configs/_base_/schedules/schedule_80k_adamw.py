# 80k iterations of AdamW with linear warm-up and poly decay, as the
# InternViT-6B segmentation recipes use.
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        type='AdamW', lr=4e-5, betas=(0.9, 0.999), weight_decay=0.05),
    clip_grad=None)
# As MMCV's `lr_config` of InternVL's recipes (poly, power 1, min lr 0,
# linear warm-up over 1500 iterations from 1e-6): the poly decay runs over
# all 80k iterations and the warm-up scales it, so the two overlap (the
# schedulers multiply). Starting the decay at 1500 would train up to 1.9%
# above InternVL's rate.
param_scheduler = [
    dict(
        type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=1.0,
        begin=0,
        end=80000,
        by_epoch=False)
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=80000, val_interval=8000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(
        type='CheckpointHook', by_epoch=False, interval=8000,
        max_keep_ckpts=2),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
