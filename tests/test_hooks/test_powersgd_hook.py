"""The project's PowerSGD hook is PyTorch's algorithm, computed on aligned
tensors (see mmcv_custom/hooks/powersgd.py), on real gloo groups and real
DDP."""
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import \
    powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.hooks.powersgd import powersgd_hook
from mmcv_custom.testing import run_ranks

STATE_ARGS = [
    dict(matrix_approximation_rank=1),
    dict(matrix_approximation_rank=4),  # orthonormalised by QR
    dict(matrix_approximation_rank=2, batch_tensors_with_same_shape=True),
    dict(
        matrix_approximation_rank=1,
        warm_start=False,
        use_error_feedback=False),
]


def _steps(rank, world_size, which):
    """Per state setting: the gradients of five steps, the step count and
    the compression counters."""
    hook = powersgd_hook if which == 'ours' else powerSGD.powerSGD_hook
    out = []
    for state_args in STATE_ARGS:
        torch.manual_seed(0)
        # Widths that are multiples of 16 floats: every gradient starts at
        # an aligned offset, where PyTorch's hook rounds as this one does.
        # Two layers of one shape, for batch_tensors_with_same_shape.
        model = DDP(
            nn.Sequential(
                nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                nn.Linear(32, 32)))
        state = powerSGD.PowerSGDState(
            process_group=None,
            start_powerSGD_iter=2,
            orthogonalization_epsilon=1e-8,
            **state_args)
        model.register_comm_hook(state, hook)
        grads = []
        for step in range(5):
            model.zero_grad()
            torch.manual_seed(step * 10 + rank)
            model(torch.randn(8, 16)).pow(2).sum().backward()
            grads.append(
                torch.cat([p.grad.flatten() for p in model.parameters()]))
        out.append((grads, state.iter, (state.total_numel_before_compression,
                                        state.total_numel_after_compression)))
    return out


def test_same_bits_as_pytorchs_hook():
    """Ranks 1, 2 (Gram-Schmidt) and 4 (QR), batched shapes, and no warm
    start or error feedback."""
    ours = run_ranks(_steps, 'ours')
    theirs = run_ranks(_steps, 'pytorch')
    for i, state_args in enumerate(STATE_ARGS):
        for rank in (0, 1):
            grads, iters, counts = ours[rank][i]
            assert iters == 5, state_args
            assert counts == theirs[rank][i][2], state_args
            for got, want in zip(grads, theirs[rank][i][0]):
                assert torch.equal(got, want), state_args
        for a, b in zip(ours[0][i][0], ours[1][i][0]):
            assert torch.equal(a, b)
        # Compression did something: after the warm-up the gradients are
        # no longer the plain mean that step 1's were.
        assert ours[0][i][2][1] < ours[0][i][2][0]
