# Linear probing: InternViT-6B frozen, one 1x1 convolution on the last
# block's features predicts the classes.
_base_ = ['./upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py']
model = dict(
    backbone=dict(out_indices=(47, ), with_fpn=False),
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
