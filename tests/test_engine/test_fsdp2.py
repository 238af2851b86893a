"""FSDP2 under MMEngine's FlexibleRunner: the sharded reduction, the
strategy, its checkpoints, and the tools, on real gloo ranks.

Layers: ``AveragingReduceScatter`` on a real 2- and 3-rank group with exact
expectations; FSDP2 against DDP on one step of a small model; the tiny
InternViT UperNet config trained by a real FlexibleRunner on 2 ranks
(resume equality, checkpoint layout, errors); one end-to-end run through
``tools/dist_train.sh`` and ``tools/test.py``.
"""
import glob
import os
import os.path as osp
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mmcv_custom  # noqa: F401  (registers the strategy and the hook)
from mmcv_custom.comm import CommCounter, build_sharded_comm
from mmcv_custom.hooks.sharded import (AveragingReduceScatter,
                                       install_reduce_scatter)
from mmcv_custom.integrity.checkpoint import is_sharded_checkpoint
from mmcv_custom.integrity.sharded_checkpoint import \
    consolidate_sharded_checkpoint
from mmcv_custom.launching.ports import free_port
from mmcv_custom.testing import run_ranks
from tests.tool_utils import toy_set

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TINY_FSDP2 = osp.join(
    ROOT, 'configs', 'intern_vit',
    'upernet_intern-vit-tiny_2xb8-fsdp2-200iter_toy-shapes-56x56.py')
TINY_DDP = osp.join(
    ROOT, 'configs', 'intern_vit',
    'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')


# -- the reduction itself ---------------------------------------------------
def _reduce(rank, world_size, wire, dtype, values):
    """Each rank's input is ``values[rank]`` (world_size x 2 numbers);
    returns this rank's averaged shard and the bytes counted."""
    counter = CommCounter()
    comm = AveragingReduceScatter(wire, counter)
    inp = torch.tensor(values[rank], dtype=dtype)
    out = comm.allocate((inp.numel() // world_size, ),
                        dtype=dtype,
                        device=inp.device)
    comm(
        output_tensor=out,
        input_tensor=inp,
        group=dist.group.WORLD,
        op=dist.ReduceOp.SUM)
    return out, counter.pop()


@pytest.mark.parametrize('world_size', [2, 3])
def test_fp32_reduce_scatter_is_the_mean(world_size):
    values = [[float(r * 10 + i) for i in range(2 * world_size)]
              for r in range(world_size)]
    results = run_ranks(
        _reduce, None, torch.float32, values, world_size=world_size)
    for rank, (out, (baseline, wire)) in enumerate(results):
        expected = torch.tensor(values).mean(0)[2 * rank:2 * rank + 2]
        assert torch.allclose(out, expected, rtol=0, atol=1e-5)
        assert baseline == wire == 2 * world_size * 4


def test_fp16_divides_before_the_cast():
    # 1e5 is out of fp16's range; the mean of 1e5 and -2e4 (4e4) is not.
    values = [[1e5, 1.0, 3.0, 5.0], [-2e4, 2.0, 3.0, 7.0]]
    results = run_ranks(_reduce, torch.float16, torch.float32, values)
    (out0, (baseline, wire)), (out1, _) = results
    assert out0.dtype is torch.float32
    assert out0.tolist() == [40000.0, 1.5]
    assert out1.tolist() == [3.0, 6.0]
    assert (baseline, wire) == (16, 8)  # 4 numbers: fp32, then fp16


def test_bf16_rounds_once_and_counts_half():
    values = [[1.001, 2.0, 3.0, 4.0], [1.002, 2.0, 3.0, 4.0]]
    (out0, (baseline, wire)), _ = run_ranks(_reduce, torch.bfloat16,
                                            torch.float32, values)
    halves = [torch.tensor(v[:2]) * 0.5 for v in values]
    expected = (halves[0].bfloat16() + halves[1].bfloat16()).float()
    assert torch.equal(out0, expected)
    assert (baseline, wire) == (16, 8)


def test_bf16_gradients_are_sent_as_they_are_under_fp16():
    # 3 * 2**16 and 2**16: exact in bf16, beyond fp16's 65504.
    values = [[196608.0, 1.0, 2.0, 4.0], [65536.0, 3.0, 2.0, 4.0]]
    (out0, (baseline, wire)), _ = run_ranks(_reduce, torch.float16,
                                            torch.bfloat16, values)
    # In fp16 these would be inf; the bf16 buffer is averaged as it is.
    assert out0.dtype is torch.bfloat16
    assert out0.tolist() == [131072.0, 2.0]
    assert (baseline, wire) == (8, 8)


def test_a_non_sum_op_is_refused():
    comm = AveragingReduceScatter(torch.bfloat16)
    with pytest.raises(RuntimeError, match='needs FSDP to ask for a plain'):
        comm(torch.empty(1), torch.empty(2), None, op=dist.ReduceOp.AVG)
    with pytest.raises(ValueError, match='wire_dtype should be'):
        AveragingReduceScatter(torch.float64)


class _Net(nn.Module):

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _fsdp_against_ddp(rank, world_size, wire, int8_block_size=None):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    sharded, reference = _Net(), _Net()
    reference.load_state_dict(sharded.state_dict())
    fully_shard(sharded.a)
    fully_shard(sharded)
    counter = CommCounter()
    assert install_reduce_scatter(sharded, wire, counter, int8_block_size) == 2
    ddp = nn.parallel.DistributedDataParallel(reference)
    torch.manual_seed(rank)
    x = torch.randn(4, 8) * 100
    sharded(x).sum().backward()
    ddp(x).sum().backward()
    return ({
        n: p.grad.full_tensor()
        for n, p in sharded.named_parameters()
    }, {
        n: p.grad
        for n, p in reference.named_parameters()
    }, counter.pop())


@pytest.mark.parametrize('wire', [None, torch.bfloat16, torch.float16])
def test_fsdp2_gradients_match_ddp(wire):
    for sharded, reference, (baseline,
                             sent) in run_ranks(_fsdp_against_ddp, wire):
        for name, grad in reference.items():
            if wire is None:
                # Two ranks: one sum, one exact halving, as DDP.
                assert torch.equal(sharded[name], grad), name
            else:
                assert torch.allclose(
                    sharded[name],
                    grad,
                    rtol=1e-2,
                    atol=1e-2 * grad.abs().max()), name
        # FSDP2 pads dim 0 of each parameter to a multiple of the ranks:
        # b.weight (3, 16) and b.bias (3,) go as 4 rows.
        numel = 16 * 8 + 16 + 4 * 16 + 4
        assert baseline == 4 * numel
        assert sent == (4 if wire is None else 2) * numel


def test_fsdp2_int8_gradients_are_ddp_s_within_the_rounding():
    for sharded, reference, (baseline,
                             sent) in run_ranks(_fsdp_against_ddp, None, 32):
        for name, grad in reference.items():
            # Each rank's half is off by at most half an int8 step of its
            # block: 1/254 of the block's largest value, twice.
            assert (sharded[name] -
                    grad).abs().max() <= (grad.abs().max() / 127 + 1e-6), name
        # Rounded, not sent as is (b.bias, all 4s, is exact in int8).
        assert not torch.equal(sharded['a.weight'], reference['a.weight'])
        numel = 16 * 8 + 16 + 4 * 16 + 4
        assert baseline == 4 * numel
        # Per rank's chunk: a (144 values) 72 in 3 blocks of 32; the root
        # (b: 68 values) 34 in 2 blocks, its int8 values padded to 36 bytes.
        assert sent == 2 * (4 * 3 + 72) + 2 * (4 * 2 + 36)


# -- configuration errors -----------------------------------------------------
@pytest.mark.parametrize('cfg,message', [
    (dict(type='powerSGD'),
     "comm_hook type='powerSGD' has no sharded form: under FSDP2 "
     '(FSDP2Strategy) gradients are reduce-scattered, not all-reduced '
     "through DDP communication hooks. Use one of 'allreduce', "
     "'fp16_compress', 'bf16_compress', or train this hook with DDP (the "
     'default Runner).'),
    (dict(type='allreduce', wrapper='bf16'),
     "comm_hook type='allreduce', wrapper='bf16': wrappers have no sharded "
     "form under FSDP2; use type='bf16_compress' instead."),
    (dict(type='fp16_compress', predivide_factor=2.0),
     "comm_hook type='fp16_compress': predivide_factor=2.0 is not "
     'supported under FSDP2'),
    (dict(type='bf16_compress', check_finite=True),
     "comm_hook type='bf16_compress': check_finite=True is not supported"),
])
def test_hooks_without_a_sharded_form_are_refused(cfg, message):
    with pytest.raises(ValueError) as info:
        build_sharded_comm(cfg)
    assert str(info.value).startswith(message)


def test_sharded_form_of_each_type():
    assert build_sharded_comm(dict(type='allreduce')).sent_dtype is None
    spec = build_sharded_comm(dict(type='bf16_compress', check_finite=False))
    assert spec.sent_dtype is torch.bfloat16
    assert spec.describe() == (
        "type='bf16_compress' (FSDP2 reduce-scatter in bfloat16, averaged "
        'before the cast)')
    with pytest.raises(KeyError, match='Valid types'):
        build_sharded_comm(dict(type='bf16'))


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(mp_policy=dict(reduce_dtype='bfloat16')), ValueError,
     'FSDP2Strategy mp_policy: reduce_dtype is set by the comm_hook key'),
    (dict(mp_policy=dict(param_dtype='bf16')), ValueError,
     "mp_policy param_dtype should be one of ['bfloat16', 'float16', "
     "'float32'] or None, but got 'bf16'"),
    (dict(mp_policy=dict(params='bfloat16')), TypeError,
     "FSDP2Strategy mp_policy got unknown keys ['params']"),
    (dict(shard_modules='InternViTBlock'), TypeError,
     'shard_modules should be a list of module classes or class names'),
    (dict(reshard_after_forward='yes'), TypeError,
     "reshard_after_forward should be True or False, but got 'yes'"),
    (dict(model_wrapper=dict(type='MMDistributedDataParallel')), TypeError,
     'FSDP2Strategy takes no model_wrapper'),
])
def test_strategy_arguments_are_checked(kwargs, error, message):
    from mmcv_custom.engine import FSDP2Strategy
    with pytest.raises(error) as info:
        FSDP2Strategy(**kwargs)
    assert message in str(info.value)


def test_fsdp1_strategy_is_refused_on_cpu_before_gloo_starts():
    from mmengine.config import Config

    from mmcv_custom.launching.cpu_start import check_cpu_strategy
    cfg = Config(
        dict(runner_type='FlexibleRunner', strategy=dict(type='FSDPStrategy')))
    with pytest.raises(ValueError) as info:
        check_cpu_strategy(cfg)
    assert str(info.value) == (
        "strategy type 'FSDPStrategy' needs CUDA, but there is none: on "
        'CPUs the tools run DDPStrategy or FSDP2Strategy on a gloo process '
        "group. Use strategy=dict(type='FSDP2Strategy') (PyTorch's FSDP2, "
        'which runs on CPUs) instead.')
    cfg.strategy = dict(type='FSDP2Strategy')
    check_cpu_strategy(cfg)


# -- a real FlexibleRunner on 2 ranks -----------------------------------------
def _cfg(work_dir, max_iters, **overrides):
    """The tiny FSDP2 config, deterministic (no drop path, dropout or flip),
    on 16 toy images, checkpointing every 2 iterations."""
    from mmengine.config import Config

    from mmcv_custom.launching.cpu_start import prepare_launch
    cfg = Config.fromfile(overrides.pop('config', TINY_FSDP2))
    cfg.work_dir = work_dir
    prepare_launch(cfg, overrides.pop('launcher', 'pytorch'), cuda=False)
    cfg.model.backbone.drop_path_rate = 0.
    cfg.model.decode_head.dropout_ratio = 0.
    cfg.model.auxiliary_head.dropout_ratio = 0.
    cfg.train_dataloader.dataset.pipeline = [
        p for p in cfg.train_dataloader.dataset.pipeline
        if p['type'] != 'RandomFlip'
    ]
    cfg.train_cfg = dict(
        type='IterBasedTrainLoop', max_iters=max_iters, val_interval=1000)
    cfg.param_scheduler = []
    cfg.default_hooks.logger.interval = 1
    cfg.default_hooks.checkpoint = dict(
        type='CheckpointHook', interval=2, by_epoch=False, max_keep_ckpts=2)
    for loader in (cfg.train_dataloader, cfg.val_dataloader):
        loader.batch_size = 4
        loader.dataset.generate = dict(num_train=16, num_val=4)
    cfg.test_dataloader = cfg.val_dataloader
    cfg.merge_from_dict(overrides)
    return cfg


def _train(rank, world_size, work_dir, max_iters, resume=False, **overrides):
    from mmengine.runner import FlexibleRunner
    os.chdir(osp.dirname(work_dir))  # the toy data is generated here
    cfg = _cfg(work_dir, max_iters, **overrides)
    cfg.resume = resume
    runner = FlexibleRunner.from_cfg(cfg)
    runner.train()
    model = runner.model
    hub = runner.message_hub
    out = dict(
        losses=list(hub.get_scalar('train/loss').data[0]),
        comm_ratio=list(hub.get_scalar('train/comm_ratio').data[0]),
        comm_MB=list(hub.get_scalar('train/comm_MB').data[0]),
        local_numel=sum(p.to_local().numel() for p in model.parameters()),
        numel=sum(p.numel() for p in model.parameters()),
        groups=[(len(g['params']), g['lr'])
                for g in runner.optim_wrapper.optimizer.param_groups],
        iter=runner.iter)
    del runner
    return out


def _train_with(rank, world_size, work_dir, max_iters, overrides):
    return _train(rank, world_size, work_dir, max_iters, **overrides)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp('fsdp2')
    work = str(root / 'whole')
    results = run_ranks(_train, work, 6, timeout=300)
    return root, work, results


def test_flexible_runner_trains_sharded(uninterrupted):
    _, work, results = uninterrupted
    for r in results:
        assert r['losses'][-1] < r['losses'][0]
        # Every parameter is sharded: each rank holds about half.
        assert r['local_numel'] < 0.55 * r['numel']
        assert r['comm_ratio'] == [0.5] * 6  # bf16_compress, fp32 model
    assert results[0]['local_numel'] + results[1]['local_numel'] >= (
        results[0]['numel'])
    # max_keep_ckpts=2: iterations 4 and 6 are kept, whole directories.
    kept = sorted(n for n in os.listdir(work) if n.startswith('iter_'))
    assert kept == ['iter_4.pth', 'iter_6.pth']
    assert all(is_sharded_checkpoint(osp.join(work, n)) for n in kept)
    assert not any(n.endswith('.partial') for n in os.listdir(work))
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == osp.join(work, 'iter_6.pth')


def test_layer_decay_groups_are_those_of_ddp(uninterrupted, tmp_path):
    _, _, results = uninterrupted

    def ddp_groups(rank, world_size):
        from mmengine.runner import Runner
        os.chdir(str(tmp_path))
        cfg = _cfg(str(tmp_path / 'ddp'), 1, config=TINY_DDP)
        runner = Runner.from_cfg(cfg)
        runner.train()
        return [(len(g['params']), g['lr'])
                for g in runner.optim_wrapper.optimizer.param_groups]

    assert run_ranks(ddp_groups, timeout=300)[0] == results[0]['groups']


def test_resume_ends_with_the_weights_of_an_uninterrupted_run(uninterrupted):
    """The uninterrupted run's iter_4.pth, copied into a work dir of its
    own (as a run stopped there leaves it), resumed up to 6."""
    root, whole, results = uninterrupted
    part = str(root / 'part')
    os.makedirs(part)
    shutil.copytree(
        osp.join(whole, 'iter_4.pth'), osp.join(part, 'iter_4.pth'))
    with open(osp.join(part, 'last_checkpoint'), 'w') as f:
        f.write(osp.join(part, 'iter_4.pth'))
    resumed = run_ranks(_train, part, 6, True, timeout=300)
    assert resumed[0]['iter'] == 6
    # The message hub's history comes back with the checkpoint: the same
    # losses for iterations 1-4, then 5 and 6 as without the stop; and the
    # same final weights.
    assert resumed[0]['losses'] == results[0]['losses']
    a = consolidate_sharded_checkpoint(osp.join(whole, 'iter_6.pth'))
    b = consolidate_sharded_checkpoint(osp.join(part, 'iter_6.pth'))
    assert a['state_dict'].keys() == b['state_dict'].keys()
    for key, value in a['state_dict'].items():
        assert torch.equal(value, b['state_dict'][key]), key
    assert a['meta']['iter'] == b['meta']['iter'] == 6
    assert a['meta']['sharded'] == dict(
        world_size=2, format='dcp', sharding='full')


def test_resume_on_one_process_reshards(uninterrupted, tmp_path):
    """DCP reshards: a checkpoint of 2 ranks resumes on 1 (not sharded)."""
    from mmengine.runner import FlexibleRunner
    _, whole, _ = uninterrupted
    work = tmp_path / 'one'
    work.mkdir()
    shutil.copytree(osp.join(whole, 'iter_6.pth'), work / 'iter_6.pth')
    os.chdir(str(tmp_path))
    cfg = _cfg(str(work), 7, launcher='none')
    cfg.load_from = str(work / 'iter_6.pth')
    cfg.resume = True
    runner = FlexibleRunner.from_cfg(cfg)
    runner.train()
    assert runner.iter == 7
    assert is_sharded_checkpoint(str(work / 'iter_7.pth'))


def test_a_bf16_backbone_must_be_a_unit_of_its_own(tmp_path):

    def build(rank, world_size, shard_modules):
        from mmengine.runner import FlexibleRunner
        os.chdir(str(tmp_path))
        cfg = _cfg(str(tmp_path / 'w'), 2)
        cfg.model.backbone.dtype = 'bfloat16'
        cfg.strategy.shard_modules = shard_modules
        try:
            r = FlexibleRunner.from_cfg(cfg)
            r.train()
        except ValueError as e:
            return str(e)
        return r.message_hub.get_scalar('train/comm_MB').data[0][-1]

    message = run_ranks(build, ['InternViTBlock'], timeout=300)[0]
    assert message.startswith(
        'FSDP2Strategy: unit (the whole model) holds parameters of several '
        'dtypes, e.g. backbone.cls_token (bfloat16), '
        'decode_head.conv_seg.weight (float32)')
    assert 'Add the module class that holds the other dtype' in message
    # The default units (blocks, then the backbone) keep dtypes apart.
    assert run_ranks(
        build, ['InternViTBlock', 'InternViT'], timeout=300)[0] > 0
    assert 'match no module' in run_ranks(build, ['Block'], timeout=300)[0]


# -- through the tools --------------------------------------------------------
def _tool(args, cwd):
    env = dict(os.environ, PYTHON=sys.executable, PORT=free_port())
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _tools_at_once(commands, cwd):
    """Each of ``commands`` run as :func:`_tool` runs it, all at the same
    time; their results in order. For independent tools that read one
    run's checkpoint: each spends most of its time starting Python and
    importing torch and MMSegmentation, which the cores do side by side.
    Their output goes to files, so that none waits on a full pipe."""
    started = []
    try:
        for i, args in enumerate(commands):
            out = open(osp.join(cwd, f'.tool{i}.out'), 'w+')
            err = open(osp.join(cwd, f'.tool{i}.err'), 'w+')
            env = dict(os.environ, PYTHON=sys.executable, PORT=free_port())
            started.append((args,
                            subprocess.Popen(
                                args,
                                cwd=cwd,
                                env=env,
                                stdout=out,
                                stderr=err,
                                text=True), out, err))
        results = []
        for args, process, out, err in started:
            code = process.wait(timeout=600)
            out.seek(0)
            err.seek(0)
            results.append(
                subprocess.CompletedProcess(args, code, out.read(),
                                            err.read()))
        return results
    finally:
        for _, process, out, err in started:
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()


# One toy set for every split (the dataset draws it anew when a split asks
# for other sizes than the files on disk were drawn with).
TOY_SET = toy_set(16, 8)
SHORT = [
    'train_cfg.max_iters=4',
    'train_cfg.val_interval=4',
    'default_hooks.checkpoint.interval=4',
    'default_hooks.logger.interval=2',
] + TOY_SET


@pytest.mark.slow
def test_dist_train_then_evaluate_the_sharded_checkpoint(tmp_path):
    work = str(tmp_path / 'work')
    out = _tool([
        'bash',
        osp.join(ROOT, 'tools', 'dist_train.sh'), TINY_FSDP2, '2',
        '--work-dir', work, '--cfg-options', *SHORT
    ], str(tmp_path))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert (
        'FSDP2Strategy: sharded 1 FCNHead, 1 UPerHead, 4 InternViTBlock, '
        '1 InternViT, and the whole EncoderDecoder over 2 ranks (gloo)') in log
    assert ("Registered the gradient reduction on the FSDP2 model (8 "
            "sharded modules): type='bf16_compress' (FSDP2 reduce-scatter "
            'in bfloat16, averaged before the cast, topology: flat (one '
            'node of 2 ranks)); process group: 2 ranks, backend gloo.') in log
    assert 'comm_ratio: 0.5000' in log
    trained = re.findall(r'mIoU: (\d+\.\d+)', log)[-1]
    ckpt = osp.join(work, 'iter_4.pth')
    assert is_sharded_checkpoint(ckpt)

    # What reads the checkpoint, at once: the test, the converter, a
    # fine-tuning run and a resume, each in a process and a folder of its
    # own.
    converted = str(tmp_path / 'model.pth')
    tested, tested_sharded, conv, tuned, resumed = _tools_at_once(
        [
            # One process, the DDP config: its consolidated weights.
            [
                sys.executable,
                osp.join(ROOT, 'tools', 'test.py'), TINY_DDP, ckpt,
                '--work-dir',
                str(tmp_path / 'eval'), '--cfg-options', *TOY_SET
            ],
            # One process, the FSDP2 config: the shards, resharded.
            [
                sys.executable,
                osp.join(ROOT, 'tools', 'test.py'), TINY_FSDP2, ckpt,
                '--work-dir',
                str(tmp_path / 'eval_sharded'), '--cfg-options', *TOY_SET
            ],
            [
                sys.executable,
                osp.join(ROOT, 'tools', 'model_converters', 'fsdp2_to_pth.py'),
                ckpt, converted
            ],
            # Fine-tuning the DDP config from the sharded run; resuming it
            # cannot. (In a work dir of its own: in 'tuned', --resume continues
            # that run from its own checkpoint, whatever load_from says.)
            [
                sys.executable,
                osp.join(ROOT, 'tools', 'train.py'), TINY_DDP, '--work-dir',
                str(tmp_path / 'tuned'), '--cfg-options', f'load_from={ckpt}',
                *SHORT
            ],
            [
                sys.executable,
                osp.join(ROOT, 'tools', 'train.py'), TINY_DDP, '--work-dir',
                str(tmp_path / 'moved'), '--resume', '--cfg-options',
                f'load_from={ckpt}', *SHORT
            ],
        ],
        str(tmp_path))

    # Validation used rank 0's BN statistics, as the checkpoint does: same
    # mIoU.
    # Either way its SHA256SUMS vouches for it, said once (issue 42: the
    # consolidated copy was called "loaded unverified").
    verified = f'{ckpt}: 4 files, SHA-256 verified (SHA256SUMS)'
    for run in (tested, tested_sharded):
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-3000:]
        assert log.count(verified) == 1, log[-3000:]
        assert 'unverified' not in log
        assert re.findall(r'mIoU: (\d+\.\d+)', log)[-1] == trained
    assert 'is a sharded checkpoint: evaluating its consolidated' in (
        tested.stdout + tested.stderr)

    assert conv.returncode == 0, conv.stderr
    assert 'saved by 2 ranks at iteration 4' in conv.stdout
    state = torch.load(converted, weights_only=True)['state_dict']
    assert state['backbone.cls_token'].shape == (1, 1, 64)

    log = tuned.stdout + tuned.stderr
    assert tuned.returncode == 0, log[-3000:]
    assert 'is a sharded checkpoint: loading its consolidated weights' in log
    assert log.count(verified) == 1 and 'unverified' not in log
    assert resumed.returncode == 2  # said before anything starts
    assert resumed.stderr.startswith(
        f'train.py: error: {ckpt} is a sharded checkpoint of FSDP2Strategy: '
        'it resumes under an FSDP2 config only')
    assert not osp.exists(tmp_path / 'moved')


def test_train_py_refuses_powersgd_under_fsdp2_before_any_work(tmp_path):
    """Rank 0 of a 2-rank torchrun launch (its environment; the preflight
    stops it before the process group, so no other rank is needed): the
    preflight's one line, exit 2, nothing written. (Every rank of a launch
    stopping so, one of them saying why: test_fsdp2_layouts.py.)"""
    env = dict(
        os.environ,
        RANK='0',
        LOCAL_RANK='0',
        WORLD_SIZE='2',
        LOCAL_WORLD_SIZE='2',
        GROUP_RANK='0',
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=free_port())
    out = subprocess.run([
        sys.executable,
        osp.join(ROOT, 'tools', 'train.py'), TINY_FSDP2, '--launcher',
        'pytorch', '--work-dir',
        str(tmp_path / 'w'), '--cfg-options', *SHORT, 'comm_hook.type=powerSGD'
    ],
                         cwd=str(tmp_path),
                         env=env,
                         capture_output=True,
                         text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith(
        "train.py: error: comm_hook type='powerSGD' has no sharded form: "
        'under FSDP2'), out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stdout == ''
    assert not osp.exists(tmp_path / 'w')


def test_auto_with_no_sharded_candidate_is_refused_before_any_work(tmp_path):
    """Issue 42: ``auto`` whose candidates have no sharded form is refused
    by train.py's start-up check, naming what runs under FSDP2, not
    advising a max_loss that cannot help."""
    out = _tool([
        sys.executable,
        osp.join(ROOT, 'tools', 'train.py'), TINY_FSDP2, '--work-dir',
        str(tmp_path / 'w'), '--cfg-options', 'comm_hook.type=auto',
        'comm_hook.candidates=[powerSGD]', *TOY_SET
    ], str(tmp_path))
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith(
        "train.py: error: comm_hook type='auto' under FSDP2 (FSDP2Strategy): "
        "none of ['powerSGD'] runs under FSDP2 at max_loss='quantized_ef' "
        'or below; powerSGD has no sharded form at any max_loss'), out.stderr
    assert ("The candidates that run under FSDP2, with the max_loss each "
            "needs: allreduce (max_loss='exact'), ") in out.stderr
    assert 'raise max_loss' not in out.stderr
    assert not osp.exists(tmp_path / 'w')


def _unsavable_hook():
    """A hook that puts what torch.save cannot write (a lambda) into the
    checkpoint of iteration 4, as a broken user hook would."""
    from mmengine.hooks import Hook

    class UnsavableHook(Hook):

        def before_save_checkpoint(self, runner, checkpoint):
            if runner.iter + 1 == 4:
                checkpoint['broken'] = lambda: None

    return UnsavableHook()


def _train_with_a_failing_save(rank, world_size, work_dir):
    from mmengine.runner import FlexibleRunner
    os.chdir(osp.dirname(work_dir))
    cfg = _cfg(work_dir, 6)
    runner = FlexibleRunner.from_cfg(cfg)
    runner.register_hook(_unsavable_hook())
    try:
        runner.train()
    except Exception as e:
        return type(e).__name__, str(e), runner.iter
    return None


def test_a_failed_save_stops_every_rank_and_leaves_no_checkpoint(tmp_path):
    work = str(tmp_path / 'w')
    results = run_ranks(_train_with_a_failing_save, work, timeout=300)
    # Rank 0 raises what torch.save raised; rank 1 that rank 0 failed.
    assert results[0][0] in ('PicklingError', 'AttributeError')
    assert 'lambda' in results[0][1]
    assert results[1][0] == 'RuntimeError'
    assert re.fullmatch(
        re.escape(f'Saving {work}/iter_4.pth failed on rank 0 (see its log); '
                  'nothing of that name was written (the temporary '
                  'directory .iter_4.pth.') + r'\d+-[0-9a-f]{8}\.tmp was '
        r'removed\)\.', results[1][1]), results[1][1]
    # Nor anything under a temporary name.
    assert sorted(
        n for n in os.listdir(work)
        if n.startswith(('iter_', '.iter_'))) == ['iter_2.pth']
    with open(osp.join(work, 'last_checkpoint')) as f:
        assert f.read() == osp.join(work, 'iter_2.pth')


@pytest.mark.parametrize(
    'comm_hook,ratio,extra',
    [
        (dict(type='allreduce'), 1.0, {}),
        (dict(type='fp16_compress'), 0.5, {}),
        # Accumulation: every micro-batch is reduce-scattered and accumulated
        # sharded (FSDP2 modules have no no_sync: skipping the reduction would
        # keep whole unsharded gradients on every rank).
        (dict(type='bf16_compress'), 0.5, {
            'optim_wrapper.accumulative_counts': 2
        }),
    ])
def test_each_sharded_type_trains(tmp_path, comm_hook, ratio, extra):
    results = run_ranks(
        _train_with,
        str(tmp_path / 'w'),
        4,
        dict(extra, comm_hook=comm_hook),
        timeout=300)
    for r in results:
        assert r['comm_ratio'] == [ratio] * 4
        assert r['losses'][-1] < r['losses'][0]
        # An iteration is one micro-batch, each reduce-scattered.
        assert r['comm_MB'] == [_modelled_mb(comm_hook['type'])] * 4


def _modelled_mb(hook):
    """What the cost model says the tiny FSDP2 config's reduce-scatters
    send per step on 2 ranks, in MiB (as comm_MB counts them): FSDP2's
    units and per-parameter padding (its pos_embed, 1 row, is padded to
    2), each hook's wire format."""
    from mmcv_custom.analysis.cost import (config_params, hook_costs,
                                           sharded_costs)
    _, _, facts = config_params(TINY_FSDP2)
    return sharded_costs(hook_costs())[hook].sent_bytes(
        facts['fsdp2_units'], 2) / 2**20


def test_int8_without_error_feedback_trains_sharded(tmp_path):
    """The FlexibleRunner with int8_compress, error_feedback=False: a
    quarter of fp32's bytes, give or take each chunk's last block; the
    bytes the cost model gives FSDP2's int8 reduce-scatter."""
    cfg = dict(type='int8_compress', error_feedback=False)
    results = run_ranks(
        _train_with, str(tmp_path / 'w'), 4, dict(comm_hook=cfg), timeout=300)
    for r in results:
        assert all(0.25 < ratio < 0.26 for ratio in r['comm_ratio'])
        assert r['losses'][-1] < r['losses'][0]
        assert r['comm_MB'] == [_modelled_mb('int8_compress')] * 4
    # Which codec quantizes, as the DDP hook's line says (issue 42).
    [log] = glob.glob(str(tmp_path / 'w' / '*' / '*.log'))
    with open(log) as f:
        line = next(t for t in f if 'Registered the gradient reduction' in t)
    assert re.search(
        r"type='int8_compress' \(FSDP2 reduce-scatter in int8, .* backend "
        r'gloo; int8 codec: C kernel \(\w+\) when single-threaded\.$', line)


def test_unsafe_contents_of_a_sharded_checkpoint_are_refused(tmp_path):
    """A crafted sharded checkpoint: DCP's own planner would unpickle any
    object; ours refuses it, and meta.pth is checked like any file."""
    import argparse

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from mmcv_custom.integrity.checkpoint import UnsafeCheckpointError
    from mmcv_custom.integrity.checkpoint_choice import check_checkpoint_file
    from mmcv_custom.integrity.sharded_checkpoint import safe_dcp_load

    path = str(tmp_path / 'iter_1.pth')
    state = {
        'model': {
            'w': torch.ones(2)
        },
        'optimizer': {
            'hyper': argparse.Namespace(lr=1)
        }
    }
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({
        'meta': {
            'iter': 1
        },
        'x': argparse.Namespace()
    }, osp.join(path, 'meta.pth'))
    assert is_sharded_checkpoint(path)

    def fresh():
        return {'model': {'w': torch.zeros(2)}, 'optimizer': {'hyper': None}}

    loaded = fresh()
    dcp.load(
        loaded, checkpoint_id=path, planner=DefaultLoadPlanner(), no_dist=True)
    assert isinstance(loaded['optimizer']['hyper'], argparse.Namespace)
    with pytest.raises(UnsafeCheckpointError) as info:
        safe_dcp_load(fresh(), path)
    assert str(info.value).startswith(
        f'Refusing to load {path}: its entry optimizer.hyper holds '
        'argparse.Namespace, which is not on the allow-list')
    with pytest.raises(UnsafeCheckpointError, match='argparse.Namespace'):
        check_checkpoint_file(path, 'load_from')


def test_model_wrapper_cfg_with_a_flexible_runner_is_refused():
    from mmengine.config import Config

    from mmcv_custom.launching.cpu_start import prepare_launch
    cfg = Config(
        dict(
            runner_type='FlexibleRunner',
            strategy=dict(type='FSDP2Strategy'),
            model_wrapper_cfg=dict(
                type='MMDistributedDataParallel',
                find_unused_parameters=True)))
    with pytest.raises(
            ValueError,
            match="model_wrapper_cfg is not used with "
            "runner_type='FlexibleRunner': the strategy "
            r'\(FSDP2Strategy\) wraps or shards the model'):
        prepare_launch(cfg, 'none', cuda=False)


def test_activation_checkpointing_composes_with_sharding(
        uninterrupted, tmp_path):
    """InternViT's with_cp recomputes each block inside its FSDP2 unit
    during backward: the same losses, step for step, as without it (the
    uninterrupted run's first 3: the same seed, data and constant rate)."""
    _, _, plain = uninterrupted
    cp = run_ranks(
        _train_with,
        str(tmp_path / 'cp'),
        3, {'model.backbone.with_cp': True},
        timeout=300)
    assert cp[0]['losses'] == plain[0]['losses'][:3]
    assert cp[0]['losses'][-1] < cp[0]['losses'][0]


def test_a_damaged_checkpoint_is_named_before_any_work(tmp_path):
    """A truncated file (an ordinary checkpoint, or a sharded checkpoint's
    meta.pth) fails the start-up check in words, not in torch's."""
    import torch.distributed.checkpoint as dcp

    from mmcv_custom.integrity.checkpoint_choice import check_checkpoint_file
    plain = tmp_path / 'iter_2.pth'
    torch.save({'state_dict': {'w': torch.ones(2)}}, plain)
    plain.write_bytes(plain.read_bytes()[:100])
    sharded = str(tmp_path / 'iter_4.pth')
    dcp.save({'model': {
        'w': torch.ones(2)
    }},
             checkpoint_id=sharded,
             no_dist=True)
    meta = osp.join(sharded, 'meta.pth')
    torch.save({'meta': {'iter': 4}}, meta)
    with open(meta, 'r+b') as f:
        f.truncate(100)
    for path, shown in ((str(plain), str(plain)), (sharded, meta)):
        with pytest.raises(RuntimeError) as info:
            check_checkpoint_file(path, 'load_from')
        assert str(info.value).startswith(
            f"load_from={shown!r} is not a readable torch checkpoint: it is "
            'damaged or truncated (')
