# Linear probing: InternViT-6B frozen, one 1x1 convolution on the features
# of block 45 of 48 (index 44) predicts the classes. As InternVL's
# linear_probing/linear_intern_vit_6b_504_80k_ade20k_bs16_lr4e-5_frozen.py:
# no weight decay, layer decay 1.0.
# TODO: InternVL's FCNHead there has `with_norm=True`, a SyncBatchNorm over
# the 3200 channels before the classifier (2 * 3200 more trainable
# parameters); MMSegmentation's FCNHead has no such option, so it needs a
# head in mmcv_custom before this recipe matches that one exactly.
_base_ = ['./upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py']
model = dict(
    backbone=dict(out_indices=(44, ), with_fpn=False),
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
optim_wrapper = dict(optimizer=dict(weight_decay=0.0))
