# FSDP2 (MMEngine's FlexibleRunner with mmcv_custom's FSDP2Strategy) for the
# InternViT UperNets. Units: each InternViT block, the rest of the backbone
# (embeddings and pyramid), and each head, so that a unit holds parameters
# of one dtype and the heads are not gathered while the backbone runs.
# sharding='auto': on several nodes of several GPUs, shard inside each node
# and replicate across nodes (hybrid) where the node's shard fits the GPU,
# so that only the gradient shards cross the slow link; on one node, or
# where it does not fit, shard over every rank. The log line says which
# and why. The configs' comm_hook sets the format of what crosses nodes:
# the reduce-scatter under full sharding, the shards' all-reduce under
# hybrid sharding.
runner_type = 'FlexibleRunner'
strategy = dict(
    type='FSDP2Strategy',
    shard_modules=['InternViTBlock', 'InternViT', 'UPerHead', 'FCNHead'],
    reshard_after_forward=True,
    sharding='auto')
