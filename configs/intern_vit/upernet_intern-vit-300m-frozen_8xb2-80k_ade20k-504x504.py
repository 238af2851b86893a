# Head tuning on a frozen InternViT-300M: the 6B recipe with the 300M
# architecture and blocks 6, 12, 18 and 24 (every quarter of the depth, as
# 12, 24, 36 and 48 of 48) into the pyramid.
_base_ = [
    './upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py',
    '../_base_/models/intern-vit-300m.py'
]
model = dict(
    backbone=dict(**_base_.intern_vit_300m, out_indices=(5, 11, 17, 23)),
    decode_head=dict(in_channels=[1024, 1024, 1024, 1024]),
    auxiliary_head=dict(in_channels=1024))
optim_wrapper = dict(paramwise_cfg=dict(num_layers=24))
