# The quick-start demo (`make demo`): a small FCN on the built-in toy dataset,
# 2 ranks x 8 images, gradients all-reduced in bf16. Trains and evaluates on
# two CPU ranks in about two minutes.
_base_ = [
    '../_base_/models/fcn_r18-w16-d8.py', '../_base_/datasets/toy_shapes.py',
    '../_base_/default_runtime.py', '../_base_/schedules/schedule_600.py',
    '../_base_/comm_hook.py'
]
custom_imports = dict(
    imports=['mmcv_custom', 'mmcv_custom.datasets'],
    allow_failed_imports=False)
crop_size = (64, 64)
data_preprocessor = dict(size=crop_size)
model = dict(data_preprocessor=data_preprocessor)
comm_hook = dict(type='bf16_compress')
randomness = dict(seed=0)
