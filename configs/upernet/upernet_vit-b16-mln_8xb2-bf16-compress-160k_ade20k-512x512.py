# MMSegmentation's UperNet with a ViT-B/16 backbone on ADE20K
# (mmseg::vit), gradients all-reduced in bf16. Needs the ImageNet ViT-B/16
# weights MMSegmentation's config names
# (pretrain/jx_vit_base_p16_224-80ecf9dd.pth).
_base_ = [
    'mmseg::vit/vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/comm_hook.py'
]
comm_hook = dict(type='bf16_compress')
