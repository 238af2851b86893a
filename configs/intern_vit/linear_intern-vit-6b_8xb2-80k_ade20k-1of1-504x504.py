# Few-shot fine-tuning on 1/1 of the ADE20K training images, as InternVL's
# few_shot/linear_intern_vit_6b_504_80k_ade20k_bs16_lr4e-5_1of1.py: the
# linear head (BN and a 1x1 convolution) on the last block (index 47) of a
# fully tuned InternViT-6B (drop path 0.4, layer decay 0.95, weight decay
# 0.05). The smaller subsets train shorter (1of{2,4,8,16}). The subset
# comes from splits/train_1of1.txt under the data root, written by
#   python tools/dataset_converters/ade20k_fewshot_splits.py
# (deterministic; every smaller subset is inside the larger ones).
# InternVL validates and saves every 1000 iterations in these recipes.
_base_ = ['./linear_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py']
model = dict(
    backbone=dict(
        out_indices=(47, ), freeze=False, with_cp=True, drop_path_rate=0.4))
optim_wrapper = dict(
    optimizer=dict(weight_decay=0.05),
    paramwise_cfg=dict(num_layers=48, layer_decay_rate=0.95))
train_dataloader = dict(dataset=dict(ann_file='splits/train_1of1.txt'))
train_cfg = dict(val_interval=1000)
default_hooks = dict(checkpoint=dict(interval=1000))
