# InternViT-300M's architecture, to merge into an InternViT backbone config:
#   model = dict(backbone=dict(**_base_.intern_vit_300m, out_indices=...))
# Its public checkpoint is pre-trained at 448 px (a 32 x 32 grid of
# position embeddings).
intern_vit_300m = dict(
    embed_dims=1024,
    depth=24,
    num_heads=16,
    qkv_bias=True,
    qk_norm=False,
    norm='ln',
    pretrain_size=448,
    pretrained='pretrained/intern_vit_300m_448px.pth')
