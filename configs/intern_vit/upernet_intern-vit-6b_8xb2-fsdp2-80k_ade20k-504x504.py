# InternViT-6B full tuning (upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py,
# InternVL's recipe, unchanged) sharded with PyTorch's FSDP2 instead of DDP.
# Under DDP every GPU holds all 6.4e9 parameters, their gradients and
# AdamW's two moments (about 50 GiB with the bf16 backbone, before
# activations); FSDP2 keeps 1/N of them per GPU plus the units gathered at
# the time (tools/analysis_tools/model_stats.py prints both for N GPUs).
# Units: each InternViT block, the rest of the backbone (embeddings and
# pyramid, bf16), and each head (fp32, 0.5e9 parameters together: as units
# of their own they are not gathered while the backbone runs). A unit holds
# parameters of one dtype.
#   bash tools/dist_train.sh \
#       configs/intern_vit/upernet_intern-vit-6b_8xb2-fsdp2-80k_ade20k-504x504.py \
#       8
# bf16_compress reduce-scatters the heads' fp32 gradients as bf16 and the
# backbone's bf16 ones as they are. Checkpoints are sharded directories:
# `--resume` reads them on any number of GPUs, tools/test.py evaluates them,
# tools/model_converters/fsdp2_to_pth.py consolidates them.
_base_ = [
    './upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py',
    '../_base_/strategies/fsdp2_intern-vit.py'
]
comm_hook = dict(type='bf16_compress')
