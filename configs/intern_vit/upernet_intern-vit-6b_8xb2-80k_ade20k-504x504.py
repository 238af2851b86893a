# Full tuning of InternViT-6B with UperNet on ADE20K: every parameter
# trains, with layer-wise lr decay 0.95 and stochastic depth 0.4. About
# 5.9e9 gradients (23.6 GB in fp32) are all-reduced every step: bf16
# compression halves that.
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
        drop_path_rate=0.4,
        pretrained='pretrained/intern_vit_6b_224px.pth'))
optim_wrapper = dict(
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(num_layers=48, layer_decay_rate=0.95))
