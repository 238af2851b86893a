# Full tuning of InternViT-300M with UperNet on ADE20K (layer decay 0.95,
# stochastic depth 0.1); the auxiliary head reads the third output, as in
# the 6B full-tuning recipe.
_base_ = ['./upernet_intern-vit-300m-frozen_8xb2-80k_ade20k-504x504.py']
model = dict(
    backbone=dict(freeze=False, with_cp=True, drop_path_rate=0.1),
    auxiliary_head=dict(in_index=2))
optim_wrapper = dict(
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(num_layers=24, layer_decay_rate=0.95))
