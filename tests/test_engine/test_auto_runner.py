"""``comm_hook = dict(type='auto')`` in real 2-rank MMEngine runs (issue
31): the trials and the table in the log, one decision on every rank, the
decision with each checkpoint, a resume that keeps the hook and its state
bit for bit, and one that decides again when the settings changed."""
import logging
import shutil

import pytest
import torch

from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner, train_and_gather

CKPT = dict(type='CheckpointHook', interval=5, by_epoch=False)
# One candidate: the decision does not depend on this machine's timing,
# so the runs can be compared bit for bit.
INT8_ONLY = dict(type='auto', candidates=['int8_compress'], trial_iters=1)


def _train(rank, world_size, work_dir, comm_hook, max_iters, resume):
    runner, records = build_runner(
        work_dir,
        comm_hook,
        max_iters=max_iters,
        checkpoint=CKPT,
        resume=resume)
    weights, _ = train_and_gather(runner, records, world_size)
    hook = next(
        h for h in runner.hooks
        if type(h).__name__ == 'CommHookRegistrationHook')
    auto = hook._auto
    return dict(
        weights=weights,
        key=auto.decision.key if auto.decision else None,
        active=type(hook._installed[0][1].state).__name__,
        lines=[m for _, m in records.lines],
        warnings=[m for lvl, m in records.lines if lvl == 'WARNING'])


def test_auto_tries_each_hook_in_turns_and_every_rank_keeps_one(tmp_path):
    cfg = dict(type='auto', trial_iters=1, min_gain=0.0)
    rank0, rank1 = run_ranks(_train, str(tmp_path), cfg, 9, False)
    assert rank0['key'] == rank1['key'] is not None
    text = '\n'.join(rank0['lines'])
    assert ('comm_hook auto: trying 4 hooks of class \'quantized_ef\' or '
            'below in turns, 2 rounds of an iteration each (the first round '
            'untimed), from iteration 1 to 8') in text
    assert f"comm_hook auto: chose {rank0['key']}" in text
    assert 'after iteration 8' in text
    for key in ('allreduce', 'fp16_compress', 'bf16_compress',
                'int8_compress error_feedback=True'):
        assert f' {key} ' in text
    assert 'Registered DDP communication hook on MMDistributedDataParallel ' \
        '(chosen by comm_hook auto, dict(type=' in text
    # One rank says it: rank 1 logs none of it.
    assert not any('comm_hook auto' in m for m in rank1['lines'])
    ckpt = torch.load(tmp_path / 'iter_5.pth', weights_only=False)
    assert 'comm_hook_auto' not in ckpt  # saved during the trials
    last = torch.load(tmp_path / 'iter_9.pth', weights_only=False)
    assert last['comm_hook_auto']['key'] == rank0['key']
    assert last['comm_hook_auto']['layout'] == [2, 0]


def test_resume_keeps_the_choice_and_its_state_bit_for_bit(tmp_path):
    whole = run_ranks(_train, str(tmp_path / 'whole'), INT8_ONLY, 14, False)
    run_ranks(_train, str(tmp_path / 'part'), INT8_ONLY, 10, False)
    resumed = run_ranks(_train, str(tmp_path / 'part'), INT8_ONLY, 14, True)
    for a, b in zip(whole, resumed):
        for x, y in zip(a['weights'], b['weights']):
            assert x.equal(y)
    text = '\n'.join(resumed[0]['lines'])
    assert ('comm_hook auto: keeping int8_compress error_feedback=True as '
            'chosen before this run resumed') in text
    assert 'trying' not in text
    assert 'Restored the int8_compress state (error feedback) of all 2 ' \
        'ranks' in text
    assert resumed[1]['active'] == 'Int8State'


def test_changed_settings_decide_again_and_say_why(tmp_path):
    run_ranks(_train, str(tmp_path), INT8_ONLY, 5, False)
    shutil.copy(tmp_path / 'iter_5.pth', tmp_path / 'keep.pth')
    assert torch.load(
        tmp_path / 'keep.pth',
        weights_only=False)['comm_hook_auto']['key'] == (
            'int8_compress error_feedback=True')
    other = dict(INT8_ONLY, candidates=['bf16_compress'])
    rank0, _ = run_ranks(_train, str(tmp_path), other, 8, True)
    assert any('comm_hook auto: trying the hooks again: it was made with' in w
               and "'candidates': ['int8_compress']" in w
               for w in rank0['warnings'])
    assert rank0['key'] == 'bf16_compress'


def test_a_run_too_short_for_the_trials_says_so(tmp_path):
    rank0, _ = run_ranks(_train, str(tmp_path), dict(type='auto'), 3, False)
    assert rank0['key'] is None
    assert any('the trials take 16 iterations but the run has 3 left' in w
               for w in rank0['warnings'])


def _train_fsdp2(rank, world_size, work_dir, max_iters, resume):
    """The tiny FSDP2 recipe under a real FlexibleRunner, with auto."""
    import os
    import os.path as osp

    from mmengine.runner import FlexibleRunner

    from tests.test_engine.test_fsdp2 import _cfg
    os.chdir(osp.dirname(work_dir))  # the toy data is generated here
    cfg = _cfg(
        work_dir,
        max_iters,
        comm_hook=dict(type='auto', max_loss='quantized', trial_iters=1))
    cfg.resume = resume
    runner = FlexibleRunner.from_cfg(cfg)
    lines = []
    runner.logger.addHandler(_Lines(lines))
    runner.train()
    hook = next(
        h for h in runner.hooks
        if type(h).__name__ == 'CommHookRegistrationHook')
    ratio = list(runner.message_hub.get_scalar('train/comm_ratio').data[0])
    return dict(
        key=hook._auto.decision.key,
        ratio=ratio,
        lines=lines,
        iter=runner.iter)


class _Lines(logging.Handler):

    def __init__(self, lines):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.slow
def test_fsdp2_tries_each_sharded_form_and_resume_keeps_the_choice(tmp_path):
    work = str(tmp_path / 'run')
    rank0, rank1 = run_ranks(_train_fsdp2, work, 10, False, timeout=300)
    assert rank0['key'] == rank1['key']
    # Each candidate's reduce-scatter ran in its turn: fp32, fp16, bf16,
    # int8 without error feedback (a quarter plus the scales), twice.
    assert rank0['ratio'][:4] == pytest.approx([1, 0.5, 0.5, 0.2578], abs=0.01)
    assert rank0['ratio'][4:8] == rank0['ratio'][:4]
    text = '\n'.join(rank0['lines'])
    assert ('comm_hook auto: trying 4 hooks of class \'quantized\' or below'
            in text)
    assert 'int8_compress error_feedback=False' in text
    assert ('Registered the gradient reduction on the FSDP2 model (8 '
            'sharded modules, chosen by comm_hook auto, dict(type=') in text
    resumed, _ = run_ranks(_train_fsdp2, work, 12, True, timeout=300)
    assert resumed['key'] == rank0['key'] and resumed['iter'] == 12
    text = '\n'.join(resumed['lines'])
    assert f"comm_hook auto: keeping {rank0['key']}" in text
    assert 'trying' not in text
