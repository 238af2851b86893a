# Linear probing: InternViT-6B frozen, one 1x1 convolution on the last
# block's features predicts the classes.
_base_ = [
    '../_base_/models/upernet_intern-vit-6b.py',
    '../_base_/datasets/ade20k_504x504.py', '../_base_/default_runtime.py',
    '../_base_/schedules/schedule_80k_adamw.py', '../_base_/comm_hook.py'
]
custom_imports = dict(
    imports=['mmcv_custom', 'mmcv_custom.models'], allow_failed_imports=False)
comm_hook = dict(type='bf16_compress')
model = dict(
    backbone=dict(
        out_indices=(47, ),
        with_fpn=False,
        with_cp=False,
        freeze=True,
        pretrained='pretrained/intern_vit_6b_224px.pth'),
    decode_head=dict(
        _delete_=True,
        type='FCNHead',
        in_channels=3200,
        in_index=0,
        channels=3200,
        num_convs=0,
        concat_input=False,
        dropout_ratio=0.0,
        num_classes=150,
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        align_corners=False,
        loss_decode=dict(
            type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    auxiliary_head=None)
