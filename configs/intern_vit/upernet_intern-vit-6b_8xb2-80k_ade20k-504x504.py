# Full tuning of InternViT-6B with UperNet on ADE20K: every parameter
# trains, with layer-wise lr decay 0.95 and stochastic depth 0.4. About
# 5.9e9 gradients (23.6 GB in fp32) are all-reduced every step: bf16
# compression halves that. As InternVL's
# full_tuning/upernet_intern_vit_6b_504_80k_ade20k_bs16_lr4e-5.py, whose
# auxiliary head reads the third output (head tuning: the second).
_base_ = ['./upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py']
model = dict(
    backbone=dict(freeze=False, with_cp=True, drop_path_rate=0.4),
    auxiliary_head=dict(in_index=2))
optim_wrapper = dict(
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(num_layers=48, layer_decay_rate=0.95))
