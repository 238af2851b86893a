# UperNet R50 on ADE20K with gradients all-reduced in fp16 (half the bytes
# of fp32 on the wire). See upernet_r50_4xb4-allreduce-160k_ade20k-512x512.py.
_base_ = ['./upernet_r50_4xb4-allreduce-160k_ade20k-512x512.py']
comm_hook = dict(type='fp16_compress')
