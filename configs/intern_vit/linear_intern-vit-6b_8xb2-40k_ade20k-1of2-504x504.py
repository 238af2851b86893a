# Few-shot fine-tuning on 1/2 of the ADE20K training images
# (splits/train_1of2.txt): the 1/1 recipe over 40k iterations with a
# 800-iteration warm-up, as InternVL's
# few_shot/linear_intern_vit_6b_504_40k_ade20k_bs16_lr4e-5_1of2.py.
_base_ = ['./linear_intern-vit-6b_8xb2-80k_ade20k-1of1-504x504.py']
train_dataloader = dict(dataset=dict(ann_file='splits/train_1of2.txt'))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=800),
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=1.0,
        begin=0,
        end=40000,
        by_epoch=False)
]
train_cfg = dict(max_iters=40000)
