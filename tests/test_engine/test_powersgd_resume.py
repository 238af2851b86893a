"""PowerSGD's state in checkpoints: resume gives the uninterrupted weights."""
import pytest
import torch

from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner, train_and_gather

POWERSGD = dict(
    type='powerSGD', start_powerSGD_iter=2, matrix_approximation_rank=1)


def _train(rank,
           world_size,
           work_dir,
           comm_hook,
           max_iters,
           resume,
           bucket_cap_mb=25,
           model=None):
    runner, records = build_runner(
        work_dir,
        comm_hook,
        max_iters=max_iters,
        model=model,
        wrapper=dict(
            type='MMDistributedDataParallel',
            device_ids=None,
            bucket_cap_mb=bucket_cap_mb),
        checkpoint=dict(type='CheckpointHook', interval=4, by_epoch=False),
        resume=resume)
    return train_and_gather(runner, records, world_size)


def _whole_and_resumed(tmp_path,
                       cfg,
                       bucket_cap_mb=25,
                       before_resume=None,
                       model=None):
    """Rank 0's weights after 10 uninterrupted steps, and after 4 steps, a
    stop and a resume to 10 (``before_resume(work_dir)`` runs in between),
    with the resumed run's log lines and its work dir."""
    whole, _ = run_ranks(_train, str(tmp_path / 'whole'), cfg, 10, False,
                         bucket_cap_mb, model)[0]
    part = tmp_path / 'part'
    run_ranks(_train, str(part), cfg, 4, False, bucket_cap_mb, model)
    if before_resume is not None:
        before_resume(part)
    resumed, lines = run_ranks(_train, str(part), cfg, 10, True, bucket_cap_mb,
                               model)[0]
    return whole, resumed, lines, str(part)


@pytest.mark.parametrize('bucket_cap_mb,wrapper', [(25, None), (0.002, None),
                                                   (0.002, 'bf16')])
def test_resumed_powersgd_run_matches_the_uninterrupted_one(
        tmp_path, bucket_cap_mb, wrapper):
    """DDP lays buckets out differently before and after its first step, and
    a resumed run starts with the first layout again; with 2 kB buckets the
    parameters also move between buckets."""
    whole, resumed, lines, _ = _whole_and_resumed(
        tmp_path, dict(POWERSGD, wrapper=wrapper), bucket_cap_mb)
    assert any('Restored the powerSGD state' in m for _, m in lines)
    assert torch.equal(resumed[0], whole[0])  # bit for bit
    assert torch.equal(resumed[0], resumed[1])


def test_where_a_gradient_sits_in_its_bucket_changes_no_bit(tmp_path):
    """Odd layer widths put most gradients at unaligned offsets, and other
    ones in a resumed run's first layout (one bucket) than in the rebuilt
    one (2 kB buckets). Matrix-vector kernels round by alignment (PyTorch's
    own PowerSGD hook, which multiplies views of the bucket, resumes 1e-9
    off here): this one computes on aligned tensors of its own."""
    model = dict(type='MLPRegressor', hidden=21, depth=2)
    whole, resumed, lines, _ = _whole_and_resumed(
        tmp_path, POWERSGD, 0.002, model=model)
    assert any('Restored the powerSGD state' in m for _, m in lines)
    assert torch.equal(resumed[0], whole[0])  # bit for bit


def test_without_the_state_the_resumed_run_drifts(tmp_path):
    """Guards the test above: the restored state is what makes it exact. A
    checkpoint without hook state resumes with a warning, not a crash."""
    whole, _ = run_ranks(_train, str(tmp_path / 'whole'), POWERSGD, 10,
                         False)[0]
    part = str(tmp_path / 'part')
    # The first part all-reduces in fp32: no PowerSGD state is saved.
    run_ranks(_train, part, dict(type='allreduce'), 4, False)
    resumed, lines = run_ranks(_train, part, POWERSGD, 10, True)[0]
    warnings = [m for lvl, m in lines if lvl == 'WARNING']
    assert warnings == [
        'Not restoring the powerSGD communication-hook state (all ranks: '
        'the resumed checkpoint holds no communication-hook state). Every '
        'rank starts it afresh at step 4: error feedback from zero and new '
        'warm-start matrices; compression goes on at once (the run is past '
        'start_powerSGD_iter=2).'
    ]
    assert not torch.equal(resumed[0], whole[0])


def test_state_of_another_hook_is_not_restored(tmp_path):
    part = str(tmp_path / 'part')
    run_ranks(_train, part, dict(POWERSGD, wrapper='bf16'), 4, False)
    resumed, lines = run_ranks(_train, part, POWERSGD, 10, True)[0]
    warnings = [m for lvl, m in lines if lvl == 'WARNING']
    assert len(warnings) == 1
    assert ("holds the state of comm_hook type='powerSGD', wrapper='bf16', "
            "not of type='powerSGD', wrapper=None") in warnings[0]
    assert torch.equal(resumed[0], resumed[1])  # and trains on in sync


def _train_keeping_two(rank, world_size, work_dir, max_iters, resume):
    runner, _ = build_runner(
        work_dir,
        POWERSGD,
        max_iters=max_iters,
        checkpoint=dict(
            type='CheckpointHook',
            interval=2,
            by_epoch=False,
            max_keep_ckpts=2),
        resume=resume)
    runner.train()


def test_state_files_go_with_their_checkpoints(tmp_path):
    """``max_keep_ckpts``: when the CheckpointHook deletes a checkpoint,
    every rank deletes its state file for it, and nothing else (another
    run's checkpoint in the same folder keeps its state)."""
    work = tmp_path / 'run'
    work.mkdir()
    foreign = ['iter_100.pth'
               ] + [f'iter_100.pth.comm_hook_rank{r}.pth' for r in range(2)]
    for name in foreign:
        (work / name).write_bytes(b'another run')

    def files():
        return sorted(p.name for p in work.iterdir() if 'iter_' in p.name)

    def expected(*steps):
        # Each file of this run with its digest (mmcv_custom.integrity).
        return sorted(foreign + [
            name + digest for s in steps for name in [f'iter_{s}.pth'] +
            [f'iter_{s}.pth.comm_hook_rank{r}.pth' for r in range(2)]
            for digest in ('', '.sha256')
        ])

    run_ranks(_train_keeping_two, str(work), 8, False)
    assert files() == expected(6, 8)
    # Resumed: the CheckpointHook's list of kept checkpoints comes back
    # with the checkpoint, and so does the pruning.
    run_ranks(_train_keeping_two, str(work), 12, True)
    assert files() == expected(10, 12)


INT8 = dict(type='int8_compress', block_size=32)


@pytest.mark.parametrize('bucket_cap_mb', [25, 0.002])
def test_resumed_int8_run_restores_its_residuals(tmp_path, bucket_cap_mb):
    """int8_compress's error feedback goes into the same state files: a
    resumed run restores every rank's residuals, per parameter, into
    whatever buckets DDP builds, and the blocks and their owners follow the
    parameters, not the buckets (a resumed run's first step uses DDP's
    first layout, the uninterrupted run its rebuilt one), so the resumed
    run is the uninterrupted one bit for bit."""
    whole, resumed, lines, part = _whole_and_resumed(tmp_path, INT8,
                                                     bucket_cap_mb)
    assert ('INFO', 'Restored the int8_compress state (error feedback) of '
            f'all 2 ranks from the files beside {part}/iter_4.pth.') in lines
    assert torch.equal(resumed[0], whole[0])  # bit for bit
    assert torch.equal(resumed[0], resumed[1])


def test_int8_without_its_residuals_starts_them_from_zero(tmp_path):
    part = str(tmp_path / 'part')
    run_ranks(_train, part, dict(type='allreduce'), 4, False)
    resumed, lines = run_ranks(_train, part, INT8, 10, True)[0]
    warnings = [m for lvl, m in lines if lvl == 'WARNING']
    assert warnings == [
        'Not restoring the int8_compress communication-hook state (all '
        'ranks: the resumed checkpoint holds no communication-hook state). '
        'Every rank starts it afresh at step 4: error feedback from zero.'
    ]
    assert torch.equal(resumed[0], resumed[1])


def test_resumed_int8_run_without_its_residuals_drifts(tmp_path):
    """Guards the bit-for-bit test above: the residuals restored are what
    makes it exact. With the state files gone the run resumes (warned, all
    ranks from zero) and parts from the uninterrupted one."""

    def delete_state_files(part):
        for rank in range(2):
            (part / f'iter_4.pth.comm_hook_rank{rank}.pth').unlink()

    whole, resumed, lines, _ = _whole_and_resumed(
        tmp_path, INT8, before_resume=delete_state_files)
    assert [lvl for lvl, m in lines if 'Not restoring' in m] == ['WARNING']
    assert torch.equal(resumed[0], resumed[1])
    assert not torch.equal(resumed[0], whole[0])
