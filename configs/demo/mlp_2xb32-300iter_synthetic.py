# The quick-start demo: a small MLP regressor on synthetic data, 2 CPU ranks,
# gradients all-reduced in bf16. `make demo` runs it through
# tools/dist_train.sh.
_base_ = ['../_base_/comm_hook.py']

custom_imports = dict(
    imports=['mmcv_custom', 'mmcv_custom.demo'], allow_failed_imports=False)
comm_hook = dict(type='bf16_compress')

model = dict(type='MLPRegressor', in_features=32, hidden=256, depth=3)
train_dataloader = dict(
    batch_size=32,
    num_workers=0,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(type='SyntheticRegressionDataset', num_samples=2048))
val_dataloader = dict(
    batch_size=64,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(type='SyntheticRegressionDataset', num_samples=512, seed=1))
val_evaluator = dict(type='RegressionMSE')
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))
train_cfg = dict(by_epoch=False, max_iters=300, val_interval=300)
val_cfg = dict()
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=300))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
