# InternViT-300M's architecture, to merge into an InternViT backbone config:
#   model = dict(backbone=dict(**_base_.intern_vit_300m, out_indices=...))
intern_vit_300m = dict(
    embed_dims=1024,
    depth=24,
    num_heads=16,
    qkv_bias=True,
    qk_norm=False,
    norm='ln',
    pretrained='pretrained/intern_vit_300m_448px.pth')
