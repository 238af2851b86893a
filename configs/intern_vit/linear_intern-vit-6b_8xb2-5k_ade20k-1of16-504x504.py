# Few-shot fine-tuning on 1/16 of the ADE20K training images
# (splits/train_1of16.txt): the 1/1 recipe over 5k iterations with a
# 100-iteration warm-up, as InternVL's
# few_shot/linear_intern_vit_6b_504_5k_ade20k_bs16_lr4e-5_1of16.py.
_base_ = ['./linear_intern-vit-6b_8xb2-80k_ade20k-1of1-504x504.py']
train_dataloader = dict(dataset=dict(ann_file='splits/train_1of16.txt'))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=100),
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=1.0,
        begin=0,
        end=5000,
        by_epoch=False)
]
train_cfg = dict(max_iters=5000)
