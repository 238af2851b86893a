# ADE20K at 504 x 504 (a multiple of InternViT's 14-pixel patches), on top
# of MMSegmentation's ADE20K settings.
_base_ = ['mmseg::_base_/datasets/ade20k.py']
crop_size = (504, 504)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(
        type='RandomResize',
        scale=(2016, 504),
        ratio_range=(0.5, 2.0),
        keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='PackSegInputs')
]
# InternVL's test resize (SETR_Resize with setr_multi_scale, then
# ResizeToMultiple): the short edge to 504 whatever the long one becomes
# (no 2016 cap), then each side up to a multiple of 14. The labels are
# loaded afterwards, so mIoU is computed at the original size.
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeShortestEdge', scale=504, max_size=2**31 - 1),
    dict(type='ResizeToMultiple', size_divisor=14),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
