# The tiny InternViT UperNet of upernet_intern-vit-tiny_2xb8-200iter_toy-
# shapes-56x56.py, sharded with PyTorch's FSDP2 instead of DDP, with the
# units of the 6B FSDP2 recipe: each InternViT block, the rest of the
# backbone, and each head; bf16_compress sets the reduce-scatter's format.
# Trains on two CPU ranks in a couple of minutes:
#   bash tools/dist_train.sh \
#       configs/intern_vit/upernet_intern-vit-tiny_2xb8-fsdp2-200iter_toy-shapes-56x56.py \
#       2
# Checkpoints are sharded directories (iter_200.pth/); evaluate one with
# tools/test.py as any checkpoint, or consolidate it with
# tools/model_converters/fsdp2_to_pth.py.
_base_ = [
    './upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py',
    '../_base_/strategies/fsdp2_intern-vit.py'
]
comm_hook = dict(type='bf16_compress')
