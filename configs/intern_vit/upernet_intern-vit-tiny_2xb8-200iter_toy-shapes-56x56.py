# A tiny InternViT (width 64, 4 blocks) with UperNet on the built-in toy
# dataset: the whole InternViT recipe (pyramid, layer decay, bf16
# all-reduce) on two CPU ranks in the test suite.
_base_ = [
    '../_base_/models/upernet_intern-vit-6b.py',
    '../_base_/datasets/toy_shapes.py', '../_base_/default_runtime.py',
    '../_base_/schedules/schedule_600.py', '../_base_/comm_hook.py'
]
custom_imports = dict(
    imports=['mmcv_custom', 'mmcv_custom.models', 'mmcv_custom.datasets'],
    allow_failed_imports=False)
comm_hook = dict(type='bf16_compress')
crop_size = (56, 56)
model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(
        img_size=56,
        embed_dims=64,
        depth=4,
        num_heads=4,
        out_indices=(0, 1, 2, 3),
        with_cp=False,
        drop_path_rate=0.1,
        # A CPU demo: fp32 (CPUs are slow at bf16 matmuls; the ADE20K
        # recipes train the backbone in bf16 as InternVL does).
        dtype='float32',
        # Trained from scratch: PyTorch's init of the pyramid did better
        # here than InternVL's He-normal (mIoU 73 against 64 at 200 iters).
        init_cfg=None),
    decode_head=dict(in_channels=[64, 64, 64, 64], channels=64, num_classes=4),
    auxiliary_head=dict(in_channels=64, channels=32, num_classes=4),
    test_cfg=dict(mode='whole'))
resize = dict(type='Resize', scale=crop_size, keep_ratio=False)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'), resize,
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'), resize,
    dict(type='LoadAnnotations'),
    dict(type='PackSegInputs')
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05),
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(num_layers=4, layer_decay_rate=0.9))
train_cfg = dict(max_iters=200, val_interval=200)
param_scheduler = [
    dict(
        type='PolyLR',
        eta_min=1e-5,
        power=0.9,
        begin=0,
        end=200,
        by_epoch=False)
]
randomness = dict(seed=0)
