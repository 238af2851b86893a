# Few-shot head tuning on 1/4 of the ADE20K training images. The subset
# comes from splits/train_1of4.txt under the data root, written by
#   python tools/dataset_converters/ade20k_fewshot_splits.py
# (deterministic; every smaller subset is inside the larger ones).
_base_ = ['./upernet_intern-vit-6b-frozen_8xb2-80k_ade20k-504x504.py']
train_dataloader = dict(
    dataset=dict(ann_file='splits/train_1of4.txt'))
