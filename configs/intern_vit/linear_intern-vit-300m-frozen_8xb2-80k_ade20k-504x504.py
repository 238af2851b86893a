# Linear probing on a frozen InternViT-300M. InternVL publishes no 300M
# segmentation recipe; its 6B probe reads block index 44 of 48, the fourth
# from the end, so this one reads index 21 of 24 (the fourth from the end;
# the proportional 21.5 rounds either way).
_base_ = [
    './linear_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py',
    '../_base_/models/intern-vit-300m.py'
]
model = dict(
    backbone=dict(**_base_.intern_vit_300m, out_indices=(21, )),
    decode_head=dict(in_channels=1024))
optim_wrapper = dict(paramwise_cfg=dict(num_layers=24))
