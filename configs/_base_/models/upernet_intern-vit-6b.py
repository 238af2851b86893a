# UperNet on InternViT-6B with the simple feature pyramid (blocks 12, 24,
# 36 and 48 at 4x, 2x, 1x and 1/2 of the 1/14 patch grid), as InternVL's
# ADE20K recipes (segmentation/configs/intern_vit_6b/): 1536-channel
# decode and auxiliary heads, sliding-window test with stride 322. Weights:
# the public InternViT-6B checkpoint (a flat state dict, optionally under
# `module`), e.g. pretrained='pretrained/intern_vit_6b_224px.pth'.
norm_cfg = dict(type='SyncBN', requires_grad=True)
data_preprocessor = dict(
    type='SegDataPreProcessor',
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=(504, 504))
model = dict(
    type='EncoderDecoder',
    data_preprocessor=data_preprocessor,
    backbone=dict(
        type='InternViT',
        pretrain_size=224,
        img_size=504,
        patch_size=14,
        embed_dims=3200,
        depth=48,
        num_heads=25,
        mlp_ratio=4.,
        qkv_bias=False,
        qk_norm=True,
        norm='rms',
        # InternVL trains the backbone in bf16 (its parameters, gradients
        # and so DDP's buckets); the heads stay fp32.
        dtype='bfloat16',
        init_values=0.1,
        drop_path_rate=0.,
        out_indices=(11, 23, 35, 47),
        with_fpn=True,
        with_cp=True,
        freeze=False,
        pretrained=None,
        # InternVL's init of the new pyramid's transposed convolutions:
        # normal with std sqrt(2 / (2 * 2 * channels)), zero bias. The
        # checkpoint, loaded after it, sets the ViT itself.
        init_cfg=dict(
            type='Kaiming',
            layer='ConvTranspose2d',
            mode='fan_out',
            nonlinearity='relu',
            distribution='normal')),
    decode_head=dict(
        type='UPerHead',
        in_channels=[3200, 3200, 3200, 3200],
        in_index=[0, 1, 2, 3],
        pool_scales=(1, 2, 3, 6),
        channels=1536,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(
            type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    auxiliary_head=dict(
        type='FCNHead',
        in_channels=3200,
        in_index=2,
        channels=1536,
        num_convs=1,
        concat_input=False,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(
            type='CrossEntropyLoss', use_sigmoid=False, loss_weight=0.4)),
    train_cfg=dict(),
    test_cfg=dict(mode='slide', crop_size=(504, 504), stride=(322, 322)))
