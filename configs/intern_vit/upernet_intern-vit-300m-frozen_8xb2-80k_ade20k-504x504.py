# Head tuning on a frozen InternViT-300M.
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
        embed_dims=1024,
        depth=24,
        num_heads=16,
        qkv_bias=True,
        qk_norm=False,
        norm='ln',
        out_indices=(5, 11, 17, 23),
        pretrained='pretrained/intern_vit_300m_448px.pth'),
    decode_head=dict(in_channels=[1024, 1024, 1024, 1024]),
    auxiliary_head=dict(in_channels=1024))
model.update(backbone=dict(model['backbone'], freeze=True, with_cp=False))
