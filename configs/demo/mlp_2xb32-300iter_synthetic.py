# The MMEngine-only demo (no MMSegmentation): a small MLP regressor on
# synthetic data, 2 CPU ranks, gradients all-reduced in bf16. Run it with
# `.venv/bin/python tools/demo.py --config
# configs/demo/mlp_2xb32-300iter_synthetic.py` (trains, then tests on the
# validation set; work dir: work_dirs/mlp_2xb32-300iter_synthetic);
# `make demo` trains the toy segmenter instead.
_base_ = ['../_base_/comm_hook.py']

custom_imports = dict(
    imports=['mmcv_custom', 'mmcv_custom.demo'], allow_failed_imports=False)
comm_hook = dict(type='bf16_compress')

model = dict(type='MLPRegressor', in_features=32, hidden=256, depth=3)
# One target function (function_seed) for both sets; the validation set
# draws other inputs (seed), so its MSE measures how well the MLP learned
# the function.
train_dataloader = dict(
    batch_size=32,
    num_workers=0,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        type='SyntheticRegressionDataset',
        num_samples=2048,
        function_seed=0,
        seed=0))
val_dataloader = dict(
    batch_size=64,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='SyntheticRegressionDataset',
        num_samples=512,
        function_seed=0,
        seed=1))
val_evaluator = dict(type='RegressionMSE')
# tools/test.py (and tools/demo.py's evaluation) test on the validation set.
test_dataloader = val_dataloader
test_evaluator = val_evaluator
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))
train_cfg = dict(by_epoch=False, max_iters=300, val_interval=300)
val_cfg = dict()
test_cfg = dict()
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=300))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
