# UperNet R50 on ADE20K with PowerSGD (rank 2) computed in bf16. The first
# 1000 iterations all-reduce normally (PyTorch's recommended warm-up), then
# each gradient matrix is sent as two rank-2 factors with error feedback.
_base_ = ['./upernet_r50_4xb4-allreduce-160k_ade20k-512x512.py']
comm_hook = dict(
    type='powerSGD',
    wrapper='bf16',
    matrix_approximation_rank=2,
    start_powerSGD_iter=1000)
