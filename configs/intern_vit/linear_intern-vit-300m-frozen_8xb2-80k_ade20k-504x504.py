# Linear probing on a frozen InternViT-300M (last block).
_base_ = [
    './linear_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py',
    '../_base_/models/intern-vit-300m.py'
]
model = dict(
    backbone=dict(**_base_.intern_vit_300m, out_indices=(23, )),
    decode_head=dict(in_channels=1024, channels=1024))
