# Head tuning: InternViT-6B frozen, the simple feature pyramid and UperNet
# train. Only the head's gradients cross the network. As InternVL's
# head_tuning/upernet_intern_vit_6b_504_80k_ade20k_bs16_lr4e-5_frozen.py:
# the auxiliary head reads the second output (in_index=1; full tuning
# reads the third), and the layer-decay constructor runs with decay 1.0,
# which keeps norms and biases of the head out of weight decay.
# InternVL's recipes leave the pyramid's `with_final_norm` at its default
# (False).
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
        pretrained='pretrained/intern_vit_6b_224px.pth'),
    auxiliary_head=dict(in_index=1))
optim_wrapper = dict(
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(num_layers=48, layer_decay_rate=1.0))
