"""CommHookRegistrationHook inside real MMEngine Runners on gloo ranks."""
import os
import os.path as osp
import re
import tempfile

import pytest
import torch
from torch import nn

from mmcv_custom import CommHookRegistrationHook
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner as _runner

REGISTERED = 'Registered DDP communication hook'


def _train_val_test(rank, world_size, work_dir, comm_hook):
    runner, records = _runner(work_dir, comm_hook)
    runner.train()
    # train() again, val() and test() call before_run (and train() calls
    # before_train) again: the hook must not register a second time, which
    # DDP would refuse.
    runner.train()
    runner.val()
    runner.test()
    hooks = runner.model._comm_hooks
    losses = [m for _, m in records.lines if 'loss:' in m]
    return ([m for _, m in records.lines
             if REGISTERED in m], len(hooks), hooks[0][0].__qualname__, losses)


@pytest.mark.parametrize('comm_hook,expected', [
    (dict(type='bf16_compress'), [
        "type='bf16_compress' (bf16_compress_hook), wrapper=None",
        'CPU casts: C kernel ('
    ]),
    (dict(
        type='powerSGD',
        wrapper='bf16',
        matrix_approximation_rank=2,
        start_powerSGD_iter=2),
     [
         "type='powerSGD' (powersgd_hook), wrapper='bf16'",
         'PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2, '
         'orthogonalization_epsilon=1e-08 (default set by mmcv_custom))',
         'in order on a worker thread, overlapped with backward',
         'CPU casts: C kernel ('
     ]),
])
def test_registers_once_and_logs_once_on_rank0(tmp_path, comm_hook, expected):
    results = run_ranks(_train_val_test, str(tmp_path), comm_hook)
    (lines0, n_hooks0, name0, losses0), (lines1, n_hooks1, _, _) = results
    assert n_hooks0 == n_hooks1 == 1
    assert len(lines0) == 1 and lines1 == []
    assert 'on MMDistributedDataParallel' in lines0[0]
    assert 'process group: 2 ranks, backend gloo' in lines0[0]
    for piece in expected:
        assert piece in lines0[0]
    assert losses0  # it trained
    if comm_hook['type'] == 'bf16_compress':
        assert name0 == 'bf16_compress_hook'


def _registered(rank, world_size, work_dir, fused_flags):
    """For each value of MMCV_CUSTOM_INT8_FUSED, a Runner's int8
    registration line, or its error (registration needs no train step:
    the hooks driven as train() drives them)."""
    out = []
    for i, flag in enumerate(fused_flags):
        os.environ['MMCV_CUSTOM_INT8_FUSED'] = flag
        runner, records = _runner(
            osp.join(work_dir, str(i)), dict(type='int8_compress'))
        try:
            runner.call_hook('before_run')
            runner.call_hook('before_train')
        except ValueError as e:
            out.append(str(e))
            continue
        out.append([m for _, m in records.lines if REGISTERED in m])
    return out


def test_the_line_says_which_int8_codec_runs_and_why_not_the_asked_one(
        tmp_path):
    """Issue 42: MMCV_CUSTOM_INT8_FUSED=1 on CPU buckets is said, not
    ignored; a value that is neither 1 nor 0 stops every rank."""
    flags = ['1', 'yes']
    (lines0, refused0), (lines1, refused1) = run_ranks(_registered,
                                                       str(tmp_path), flags)
    assert len(lines0) == 1 and lines1 == []
    assert "type='int8_compress' (int8_compress_hook)" in lines0[0]
    assert re.search(
        r'backend gloo; int8 codec: C kernel \(\w+\) when single-threaded; '
        'MMCV_CUSTOM_INT8_FUSED=1 asked for the fused kernels, which run '
        r'on CUDA only: CPU buckets use the C kernel\.$', lines0[0]), lines0[0]
    assert refused0 == refused1 == (
        'MMCV_CUSTOM_INT8_FUSED should be 1 (the int8 codec in fused Triton '
        "kernels, on CUDA) or 0 (not), but got 'yes'")


def _not_distributed(rank, world_size, work_dir, comm_hook):
    runner, records = _runner(work_dir, comm_hook, launcher='none')
    runner.train()
    return records.lines, type(runner.model).__name__


def test_not_distributed_logs_one_info_line_and_trains(tmp_path):
    lines, model_type = run_ranks(
        _not_distributed,
        str(tmp_path),
        dict(type='bf16_compress'),
        world_size=1)[0]
    assert model_type == 'MLPRegressor'
    notes = [(lvl, m) for lvl, m in lines if 'not registered' in m]
    assert notes == [('INFO', notes[0][1])]
    assert "comm_hook=dict(type='bf16_compress') not registered" in notes[0][1]
    assert not any(REGISTERED in m for _, m in lines)
    assert any('loss:' in m for _, m in lines)


def _bad_config(rank, world_size, work_dir, comm_hook, launcher):
    runner, records = _runner(work_dir, comm_hook, launcher=launcher)
    try:
        runner.train()
    except Exception as e:  # the error is what the test checks
        return type(e).__name__, str(e), any('loss:' in m
                                             for _, m in records.lines)
    return None


@pytest.mark.parametrize('launcher', ['none', 'pytorch'])
def test_unknown_type_fails_before_training(tmp_path, launcher):
    world_size = 1 if launcher == 'none' else 2
    result = run_ranks(
        _bad_config,
        str(tmp_path),
        dict(type='bf16compress'),
        launcher,
        world_size=world_size)[0]
    name, message, trained = result
    assert name == 'KeyError'
    assert "'bf16compress'" in message and 'bf16_compress' in message
    assert not trained


def test_bad_hook_argument_fails_when_built():
    with pytest.raises(ValueError, match="but got 'int8'"):
        CommHookRegistrationHook(
            comm_hook=dict(type='allreduce', wrapper='int8'))


def _conflict(rank, world_size, work_dir):
    runner, _ = _runner(
        work_dir,
        dict(type='bf16_compress'),
        launcher='none',
        hook_args=dict(comm_hook=dict(type='fp16_compress')))
    with pytest.raises(ValueError) as info:
        runner.train()
    return str(info.value)


def test_config_and_hook_argument_must_agree(tmp_path):
    message = run_ranks(_conflict, str(tmp_path), world_size=1)[0]
    assert 'set twice' in message
    assert "type='bf16_compress'" in message
    assert "type='fp16_compress'" in message


def _hook_argument_only(rank, world_size, work_dir):
    runner, records = _runner(
        work_dir, hook_args=dict(comm_hook=dict(type='fp16_compress')))
    runner.train()
    return [m for _, m in records.lines if REGISTERED in m]


def test_hook_argument_without_config_key(tmp_path):
    lines = run_ranks(_hook_argument_only, str(tmp_path))[0]
    assert len(lines) == 1 and "type='fp16_compress'" in lines[0]


def _no_comm_hook(rank, world_size, work_dir):
    runner, records = _runner(work_dir)
    runner.train()
    return records.lines, runner.model._comm_hooks


def test_missing_comm_hook_warns_and_keeps_ddp_default(tmp_path):
    lines, hooks = run_ranks(_no_comm_hook, str(tmp_path))[0]
    warnings = [m for lvl, m in lines if lvl == 'WARNING' and 'comm_hook' in m]
    assert len(warnings) == 1 and 'sets no `comm_hook`' in warnings[0]
    assert hooks == []


def _separate(rank, world_size, work_dir):
    from mmengine.model import BaseModel

    class TwoParts(BaseModel):
        """Trained with one optimizer per part, hence the separate DDPs."""

        def __init__(self):
            super().__init__()
            self.generator = nn.Linear(4, 4)
            self.discriminator = nn.Linear(4, 1)
            self.frozen = nn.Linear(4, 4).requires_grad_(False)

        def forward(self, inputs, data_samples=None, mode='tensor'):
            return self.discriminator(self.generator(inputs))

    # Registration needs no train_step: drive the hooks as train() does.
    runner, records = _runner(
        work_dir,
        dict(type='bf16_compress'),
        wrapper=dict(
            type='MMSeparateDistributedDataParallel', device_ids=None),
        model=TwoParts())
    runner.call_hook('before_run')
    runner.call_hook('before_train')
    model = runner.model.module
    x = torch.full((2, 4), float(rank + 1))
    model.discriminator(model.generator(x)).sum().backward()
    return ([m for _, m in records.lines
             if REGISTERED in m], len(model.generator._comm_hooks),
            len(model.discriminator._comm_hooks), type(model.frozen).__name__,
            model.discriminator.module.bias.grad)


def test_separate_ddp_registers_on_each_inner_ddp(tmp_path):
    lines, n_gen, n_disc, frozen_type, bias_grad = run_ranks(
        _separate, str(tmp_path))[0]
    assert n_gen == n_disc == 1
    assert frozen_type == 'Linear'  # frozen parts are not wrapped
    assert len(lines) == 1
    assert 'MMSeparateDistributedDataParallel submodules' in lines[0]
    assert 'submodules generator, discriminator' in lines[0]
    # The bias gradient is the batch size on every rank.
    assert torch.equal(bias_grad, torch.tensor([2.0]))


def _fsdp(rank, world_size, work_dir):
    runner, _ = _runner(
        work_dir,
        dict(type='bf16_compress'),
        wrapper=dict(
            type='MMFullyShardedDataParallel', device_id=torch.device('cpu')))
    with pytest.raises(TypeError) as info:
        runner.train()
    return str(info.value)


def test_non_ddp_wrapper_is_an_error_naming_it(tmp_path):
    message = run_ranks(_fsdp, str(tmp_path))[0]
    assert 'wrapped by MMFullyShardedDataParallel' in message
    assert 'MMDistributedDataParallel' in message


def test_base_config_fragment_enables_the_hook():
    from mmengine.config import Config
    here = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    with tempfile.TemporaryDirectory() as d:
        path = osp.join(d, 'cfg.py')
        base = osp.join(here, 'configs', '_base_', 'comm_hook.py')
        with open(path, 'w') as f:
            f.write(f'_base_ = [{base!r}]\n'
                    "comm_hook = dict(type='bf16_compress')\n")
        cfg = Config.fromfile(path)
    assert cfg.custom_imports.imports == ['mmcv_custom']
    assert cfg.custom_hooks == [dict(type='CommHookRegistrationHook')]


def _losses(rank, world_size, work_dir, hook_type):
    runner, _ = _runner(work_dir, dict(type=hook_type), max_iters=40)
    runner.train()
    return runner.message_hub.get_scalar('train/loss').data[0].tolist()


def test_bf16_training_follows_fp32_training(tmp_path):
    """Same seed, same data: the per-iteration losses of bf16_compress stay
    within 1% of full-precision all-reduce over 40 SGD steps (measured:
    5e-5)."""
    exact = run_ranks(_losses, str(tmp_path / 'fp32'), 'allreduce')[0]
    half = run_ranks(_losses, str(tmp_path / 'bf16'), 'bf16_compress')[0]
    assert len(exact) == len(half) == 40
    assert exact[-1] < 0.8 * exact[0]  # it learns
    rel = [abs(h - e) / e for h, e in zip(half, exact)]
    assert max(rel) < 0.01, max(rel)
    assert half != exact  # and bf16 was really on the wire


# (where the config is given, the config, iterations): a stateful hook
# saving its state files, one given as the runner hook's argument, auto.
_ONCE = [
    ('config', dict(type='powerSGD', start_powerSGD_iter=2), 2),
    ('argument', dict(type='int8_compress'), 1),
    ('config',
     dict(
         type='auto', candidates=['allreduce', 'bf16_compress'],
         trial_iters=1), 5),
]


def _checks(rank, world_size, work_dir):
    """For each of :data:`_ONCE`, the configs ``CommHookConfig.check``
    (every check of a comm_hook config goes through it) saw while a real
    Runner was built and trained, and the registration lines."""
    from mmcv_custom.comm.builder import CommHookConfig
    check = CommHookConfig.check.__func__
    seen = []

    def counted(cls, cfg, *args, **kwargs):
        seen.append(dict(cfg))
        return check(cls, cfg, *args, **kwargs)

    out = []
    CommHookConfig.check = classmethod(counted)
    try:
        for i, (where, comm_hook, max_iters) in enumerate(_ONCE):
            seen.clear()
            runner, records = _runner(
                osp.join(work_dir, str(i)),
                comm_hook if where == 'config' else None,
                hook_args=dict(
                    comm_hook=comm_hook) if where == 'argument' else None,
                max_iters=max_iters,
                checkpoint=dict(type='CheckpointHook', interval=2))
            runner.train()
            out.append(
                (list(seen), [m for _, m in records.lines if REGISTERED in m]))
            del runner
    finally:
        CommHookConfig.check = classmethod(check)
    return out


def test_each_rank_checks_its_comm_hook_once(tmp_path):
    """Issue 44: the config is checked once on each rank (where it is
    read: ``before_run``, or the runner hook's argument when it is built)
    and the checked config handed on, to the DDP registration, the state
    files and auto's trials; auto's candidates are each checked once with
    it, the chosen one not again."""
    ranks = run_ranks(_checks, str(tmp_path))
    for (where, comm_hook, _), *both in zip(_ONCE, *ranks):
        for seen, _ in both:
            assert seen[0] == comm_hook and seen.count(comm_hook) == 1, seen
            # No config is checked twice, auto's candidates included.
            assert len({repr(c) for c in seen}) == len(seen), seen
        (seen, registered), (_, on_rank1) = both
        assert len(registered) == 1 and on_rank1 == [], where
        if comm_hook['type'] == 'auto':
            assert 'chosen by comm_hook auto' in registered[0]
            assert sorted(c['type'] for c in seen[1:]) == [
                'allreduce', 'bf16_compress', 'bf16_compress'
            ]
        else:
            assert len(seen) == 1
