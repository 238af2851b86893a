# Linear probing: InternViT-6B frozen; the features of block 45 of 48
# (index 44) go through a BatchNorm and one 1x1 convolution to the classes
# (mmcv_custom's LinearHead: InternVL's FCNHead with num_convs=0 and
# with_norm=True). As InternVL's
# linear_probing/linear_intern_vit_6b_504_80k_ade20k_bs16_lr4e-5_frozen.py:
# no dropout, no weight decay, layer decay 1.0.
_base_ = ['./upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py']
model = dict(
    backbone=dict(out_indices=(44, ), with_fpn=False),
    decode_head=dict(
        _delete_=True,
        type='LinearHead',
        in_channels=3200,
        in_index=0,
        with_norm=True,
        norm_cfg=dict(type='SyncBN', requires_grad=True),
        dropout_ratio=0.0,
        num_classes=150,
        align_corners=False,
        loss_decode=dict(
            type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    auxiliary_head=None)
optim_wrapper = dict(optimizer=dict(weight_decay=0.0))
