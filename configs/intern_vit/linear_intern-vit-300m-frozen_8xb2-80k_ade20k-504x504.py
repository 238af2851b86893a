# Linear probing on a frozen InternViT-300M (last block).
_base_ = ['./linear_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py']
model = dict(
    backbone=dict(
        embed_dims=1024,
        depth=24,
        num_heads=16,
        qkv_bias=True,
        qk_norm=False,
        norm='ln',
        out_indices=(23, ),
        pretrained='pretrained/intern_vit_300m_448px.pth'),
    decode_head=dict(in_channels=1024, channels=1024))
