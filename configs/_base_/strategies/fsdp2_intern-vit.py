# FSDP2 (MMEngine's FlexibleRunner with mmcv_custom's FSDP2Strategy) for the
# InternViT UperNets. Units: each InternViT block, the rest of the backbone
# (embeddings and pyramid), and each head, so that a unit holds parameters
# of one dtype and the heads are not gathered while the backbone runs.
# The configs' comm_hook sets the reduce-scatter's format.
runner_type = 'FlexibleRunner'
strategy = dict(
    type='FSDP2Strategy',
    shard_modules=['InternViTBlock', 'InternViT', 'UPerHead', 'FCNHead'],
    reshard_after_forward=True)
