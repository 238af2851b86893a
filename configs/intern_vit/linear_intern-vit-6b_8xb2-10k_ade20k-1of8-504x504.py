# Few-shot fine-tuning on 1/8 of the ADE20K training images
# (splits/train_1of8.txt): the 1/1 recipe over 10k iterations with a
# 200-iteration warm-up, as InternVL's
# few_shot/linear_intern_vit_6b_504_10k_ade20k_bs16_lr4e-5_1of8.py.
_base_ = ['./linear_intern-vit-6b_8xb2-80k_ade20k-1of1-504x504.py']
train_dataloader = dict(dataset=dict(ann_file='splits/train_1of8.txt'))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=200),
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=1.0,
        begin=0,
        end=10000,
        by_epoch=False)
]
train_cfg = dict(max_iters=10000)
