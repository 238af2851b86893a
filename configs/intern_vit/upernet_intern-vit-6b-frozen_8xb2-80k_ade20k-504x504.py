# Head tuning: InternViT-6B frozen, the simple feature pyramid and UperNet
# train. Only the head's gradients cross the network.
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
        freeze=True,
        with_cp=False,
        pretrained='pretrained/intern_vit_6b_224px.pth'))
