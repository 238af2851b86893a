"""The preflight of tools/train.py and tools/test.py: every problem of a run
found before the model or the process group exists, said once, with what
to do. Through the real entry points where it matters (the 6B recipe is
never built), unit level for each check."""
import argparse
import os
import os.path as osp
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import mmcv_custom.launching.preflight as preflight_module
from mmcv_custom.engine.process_group import LAUNCH_ENV
from mmcv_custom.launching.preflight import (PreflightError, Problem,
                                             check_preflight, format_problems,
                                             preflight, preflight_report)
from mmcv_custom.launching.preflight import work_dir as work_dir_check
from mmcv_custom.launching.running import load_config

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOLS = osp.join(ROOT, 'tools')
CONFIGS = osp.join(ROOT, 'configs')
VIT_6B = osp.join(CONFIGS, 'intern_vit',
                  'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py')
FEW_SHOT = osp.join(CONFIGS, 'intern_vit',
                    'linear_intern-vit-6b_8xb2-5k_ade20k-1of16-504x504.py')
UPERNET_R50 = osp.join(
    CONFIGS, 'upernet',
    'upernet_r50_4xb4-bf16-compress-160k_ade20k-512x512.py')
FCN = osp.join(CONFIGS, 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
MLP = osp.join(CONFIGS, 'demo', 'mlp_2xb32-300iter_synthetic.py')
VIT_TINY = osp.join(
    CONFIGS, 'intern_vit',
    'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')
ADE_ZIP = ('http://data.csail.mit.edu/places/ADEchallenge/'
           'ADEChallengeData2016.zip')


def _run_measured(args, cwd):
    """Run ``args``; return (exit code, stdout, stderr, wall seconds, peak
    RSS in bytes of that process alone, from ``wait4``)."""
    out, err = osp.join(cwd, 'stdout.txt'), osp.join(cwd, 'stderr.txt')
    start = time.monotonic()
    with open(out, 'w') as fo, open(err, 'w') as fe:
        proc = subprocess.Popen(args, cwd=cwd, stdout=fo, stderr=fe)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    with open(out) as fo, open(err) as fe:
        return proc.returncode, fo.read(), fe.read(), wall, (
            usage.ru_maxrss * 1024)  # kilobytes on Linux


def _lines(stderr, prog):
    """The message's lines: from ``prog: error:`` on."""
    lines = stderr.splitlines()
    first = [
        i for i, line in enumerate(lines) if line.startswith(f'{prog}: error:')
    ]
    assert len(first) == 1, stderr[-3000:]
    return lines[first[0]:]


def test_6b_recipe_says_every_problem_at_once_without_building_it(tmp_path):
    # No ADE20K, no pretrained/ and no load_from file in this folder.
    work = tmp_path / 'work'
    code, _, err, wall, rss = _run_measured([
        sys.executable,
        osp.join(TOOLS, 'train.py'), VIT_6B, '--work-dir',
        str(work), '--cfg-options', 'load_from=nothere.pth'
    ], str(tmp_path))
    assert code == 2, err[-3000:]
    lines = _lines(err, 'train.py')
    assert lines[0] == ('train.py: error: 3 problems, found before building '
                        'the model or starting the process group:')
    where = ('(relative paths are from the current directory, '
             f'{tmp_path})')
    assert lines[1] == (
        '  1. train_dataloader and val_dataloader: data_root '
        f"'data/ade/ADEChallengeData2016' does not exist {where}. Fix: put "
        f'ADE20K there: download {ADE_ZIP} and unzip it in data/ade, so '
        'that data/ade/ADEChallengeData2016 holds images/training, '
        'images/validation (*.jpg) and annotations/training, '
        'annotations/validation (*.png); or set data_root to where the '
        'dataset is (--cfg-options train_dataloader.dataset.data_root=PATH '
        'val_dataloader.dataset.data_root=PATH)')
    assert lines[2] == (
        "  2. model.backbone.pretrained='pretrained/intern_vit_6b_224px.pth'"
        f": no such file {where}. Fix: put InternVL's released "
        'intern_vit_6b_224px.pth there, or convert the downloaded '
        'OpenGVLab/InternViT-6B-224px weights into it: .venv/bin/python '
        'tools/model_converters/internvit2mmseg.py SRC '
        'pretrained/intern_vit_6b_224px.pth --sha256 HEX (SRC: its '
        'model.safetensors, *.index.json or .pth; HEX: the SHA-256 its '
        'download page lists for SRC, once per shard of an index; see '
        'docs/en/user_guides/intern_vit.md)')
    assert lines[3] == (f"  3. load_from='nothere.pth': no such file {where}"
                        '. Fix: correct the path, or leave load_from out')
    assert len(lines) == 4  # nothing after it: said once, no traceback
    assert 'Traceback' not in err
    assert not work.exists()
    # Imports included; the model (23.6 GB in fp32) was never allocated.
    assert wall < 30, wall
    assert rss < 3 * 1024**3, rss


def test_test_tool_says_checkpoint_and_data_at_once(tmp_path):
    code, _, err, _, _ = _run_measured([
        sys.executable,
        osp.join(TOOLS, 'test.py'), UPERNET_R50, 'missing.pth', '--work-dir',
        str(tmp_path / 'eval')
    ], str(tmp_path))
    assert code == 2, err[-3000:]
    lines = _lines(err, 'test.py')
    assert len(lines) == 3 and lines[0].endswith('2 problems, found before '
                                                 'building the model or '
                                                 'starting the process '
                                                 'group:')
    assert lines[1].startswith(
        "  1. test_dataloader: data_root 'data/ade/ADEChallengeData2016' "
        'does not exist')
    assert ADE_ZIP in lines[1]
    assert lines[2].startswith("  2. checkpoint='missing.pth': no such file")
    assert 'Traceback' not in err


@pytest.mark.parametrize('config', [FCN, MLP, VIT_TINY])
def test_toy_and_demo_configs_pass(config, tmp_path, monkeypatch):
    # From an empty folder: the toy data does not exist yet, and need not.
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config, work_dir=str(tmp_path / 'work'))
    assert preflight(cfg, 'train') == []
    assert preflight(cfg, 'test') == []
    assert not os.listdir(tmp_path)  # nothing written, not even the data


def test_toy_data_that_must_exist_is_checked(tmp_path):
    cfg = load_config(
        FCN, {
            'train_dataloader.dataset.generate': False,
            'train_dataloader.dataset.data_root': str(tmp_path / 'toy')
        },
        work_dir=str(tmp_path / 'work'))
    assert preflight(cfg, 'train') == [
        Problem(
            f"train_dataloader: data_root '{tmp_path}/toy' does not "
            'exist', 'put the dataset there; or set data_root to where '
            'the dataset is (--cfg-options '
            'train_dataloader.dataset.data_root=PATH)')
    ]


def test_ade20k_folders_empty_folders_and_few_shot_splits(
        tmp_path, monkeypatch):
    # (The room for a 6B checkpoint is not this test's business.)
    monkeypatch.setattr(
        work_dir_check,
        'checkpoint_size',
        lambda cfg, world_size=1, launcher='none', comm_hook=None: None)
    root = tmp_path / 'ADEChallengeData2016'
    (root / 'images' / 'training').mkdir(parents=True)
    (root / 'images' / 'training' / 'a.jpg').write_bytes(b'')
    (root / 'annotations' / 'training').mkdir(parents=True)  # empty
    cfg = load_config(
        FEW_SHOT, {
            'train_dataloader.dataset.data_root': str(root),
            'val_dataloader.dataset.data_root': str(root),
            'model.backbone.pretrained': None
        },
        work_dir=str(tmp_path / 'work'))
    problems = preflight(cfg, 'train')
    assert [p.what for p in problems] == [
        f"train_dataloader: '{root}/annotations/training' holds no files",
        f"train_dataloader: ann_file '{root}/splits/train_1of16.txt': no "
        'such file',
        f"val_dataloader: '{root}/images/validation': no such folder",
        f"val_dataloader: '{root}/annotations/validation': no such folder",
    ]
    assert problems[0].fix.startswith(f'put ADE20K there: download {ADE_ZIP}'
                                      f' and unzip it in {tmp_path}, ')
    assert problems[1].fix == (
        'write the few-shot splits: .venv/bin/python '
        'tools/dataset_converters/ade20k_fewshot_splits.py --data-root '
        f'{root}')


def test_dataset_wrappers_are_looked_into(tmp_path):
    cfg = load_config(MLP, work_dir=str(tmp_path / 'work'))
    inner = dict(type='X', data_root=str(tmp_path / 'a'))
    cfg.train_dataloader.dataset = dict(
        type='ConcatDataset',
        datasets=[
            dict(type='RepeatDataset', times=2, dataset=inner),
            dict(
                type='X',
                data_root=str(tmp_path),
                data_prefix=dict(img_path='b'))
        ])
    assert [p.what for p in preflight(cfg, 'train')] == [
        f"train_dataloader: data_root '{tmp_path}/a' does not exist",
        f"train_dataloader: '{tmp_path}/b': no such folder",
    ]


def test_weights_and_checkpoints_are_collected_not_raised(tmp_path):
    # (Apart from the checkpoints, which keep digests.)
    os.makedirs(tmp_path / 'pretrained')
    unsafe = str(tmp_path / 'pretrained' / 'unsafe.pth')
    torch.save({'meta': argparse.Namespace(lr=1)}, unsafe)
    damaged = tmp_path / 'iter_4.pth'
    torch.save({'state_dict': {}}, damaged)
    (tmp_path / 'iter_4.pth.sha256').write_text('0' * 64 + '  iter_4.pth\n')
    cfg = load_config(
        FCN, {
            'model.pretrained':
            unsafe,
            'model.decode_head.init_cfg':
            dict(type='Pretrained', checkpoint=str(tmp_path / 'head.pth')),
            'load_from':
            str(damaged),
        },
        work_dir=str(tmp_path / 'work'))
    with pytest.raises(PreflightError) as raised:
        check_preflight(cfg, 'train', resume_checkpoint=str(tmp_path))
    problems = raised.value.problems
    assert [p.what.split(':')[0] for p in problems] == [
        'model.pretrained',
        f"model.decode_head.init_cfg.checkpoint='{tmp_path}/head.pth'",
        'load_from',
        f"the checkpoint to resume from='{tmp_path}'",
    ]
    assert problems[0].what.startswith(
        f'model.pretrained: Refusing to load {unsafe}: it '
        'contains argparse.Namespace')
    assert problems[2].what.startswith(f'load_from: {damaged} is damaged: '
                                       'its SHA-256 is ')
    assert 'a directory, not a checkpoint file' in problems[3].what
    assert str(raised.value) == format_problems(problems)
    # Not checked: URLs, and pretrained files in test mode (Runner.test
    # does not initialise weights).
    cfg.model.pretrained = 'https://example.com/w.pth'
    cfg.load_from = 'open-mmlab://resnet18'
    assert [p.what.split(':')[0] for p in preflight(cfg, 'train')] == [
        f"model.decode_head.init_cfg.checkpoint='{tmp_path}/head.pth'"
    ]
    assert preflight(cfg, 'test') == []


def test_a_work_dir_under_a_file_is_reported(tmp_path):
    plain = tmp_path / 'plain'
    plain.write_text('')
    cfg = load_config(MLP, work_dir=str(plain / 'work'))
    assert preflight(cfg, 'train') == [
        Problem(
            f"work_dir '{plain}/work': {plain} is a file, not a folder, so "
            'the work dir cannot be made', 'choose another --work-dir')
    ]
    cfg.work_dir = str(plain)
    assert preflight(cfg, 'test')[0].what.endswith('so the work dir cannot '
                                                   'be used')
    assert os.listdir(tmp_path) == ['plain']  # nothing left behind
    # A folder the system will not make: its own words, what to do.
    cfg.work_dir = '/proc/nope'
    assert preflight(cfg, 'test') == [
        Problem(
            "work_dir '/proc/nope': cannot be made: making a folder in /proc "
            'fails (No such file or directory: /proc exists, but its file '
            'system takes no new folders)',
            'choose another --work-dir, one you can write to')
    ]


def _mkdir_error(path):
    """The OSError this system raises for making ``path``, or None."""
    try:
        os.mkdir(path)
    except OSError as e:
        return e
    os.rmdir(path)
    return None


OUT_DIR = 'default_hooks.checkpoint.out_dir'
# Every key other than the work dir is set alike.
OUT_DIR_FIX = (f'. Fix: set {OUT_DIR} to another folder, one you can '
               f'write to (--cfg-options {OUT_DIR}=PATH)')


@pytest.mark.parametrize('out_dir, expected', [
    ('/proc/nope', "'/proc/nope': cannot be made: making a folder in /proc "
     'fails (No such file or directory: /proc exists, but its file system '
     'takes no new folders)'),
    ('/proc', "'/proc': cannot write in it (No such file or directory: "
     '/proc exists, but its file system takes no new folders)'),
    ('/sys/nope', "'/sys/nope': cannot be made: making a folder in /sys "
     'fails ({sys})'),
    ('{tmp}/plain/ckpt', "'{tmp}/plain/ckpt': {tmp}/plain is a file, not a "
     'folder, so the folder cannot be made. Fix: set '
     f'{OUT_DIR} to another folder (--cfg-options {OUT_DIR}=PATH)'),
])
def test_an_out_dir_that_cannot_be_made_says_why(out_dir, expected, tmp_path):
    """Before any training: the key, the path, the error the system gives
    (EACCES, EROFS, EPERM, ENOENT on /proc) and what to do; not that the
    folder "kept disappearing". (Through tools/train.py: the test below.)"""
    sys_error = _mkdir_error('/sys/nope')
    if '{sys}' in expected and sys_error is None:
        pytest.skip('/sys takes new folders here')
    (tmp_path / 'plain').write_text('')
    out_dir = out_dir.format(tmp=tmp_path)
    expected = expected.format(
        tmp=tmp_path, sys=sys_error and sys_error.strerror)
    if 'Fix:' not in expected:
        expected += OUT_DIR_FIX
    work = tmp_path / 'work'
    cfg = load_config(MLP, {OUT_DIR: out_dir}, work_dir=str(work))
    problems = preflight(cfg, 'train')
    assert [str(p) for p in problems] == [f'{OUT_DIR} {expected}']
    assert not work.exists()


def test_train_py_stops_on_an_out_dir_it_cannot_make(tmp_path):
    """Through tools/train.py: exit 2, the preflight's one line, no
    traceback, and nothing left behind."""
    work = tmp_path / 'work'
    code, out, err, _, _ = _run_measured([
        sys.executable,
        osp.join(TOOLS, 'train.py'), MLP, '--work-dir',
        str(work), '--cfg-options', f'{OUT_DIR}=/proc/nope'
    ], str(tmp_path))
    assert code == 2, err[-3000:]
    assert _lines(err, 'train.py') == [
        f"train.py: error: {OUT_DIR} '/proc/nope': cannot be made: making a "
        'folder in /proc fails (No such file or directory: /proc exists, but '
        f'its file system takes no new folders){OUT_DIR_FIX}'
    ]
    assert 'Traceback' not in err and 'disappearing' not in err
    assert not work.exists()  # a refused start leaves nothing behind


def test_a_folder_that_vanishes_while_checked(tmp_path, monkeypatch):
    """"Kept disappearing" only when it did: a folder removed between
    finding it and writing in it (another rank's refused lock) is looked
    for again."""
    made = tempfile.mkdtemp
    work = tmp_path / 'work'
    vanishing = []

    def remove_then_make(prefix, dir):
        if vanishing:
            vanishing.pop()
            os.rmdir(dir)  # what the other process does meanwhile
        return made(prefix=prefix, dir=dir)

    cfg = load_config(MLP, work_dir=str(work))
    monkeypatch.setattr(work_dir_check.tempfile, 'mkdtemp', remove_then_make)
    # Once: found again (its parent), nothing to say.
    work.mkdir()
    vanishing[:] = [1]
    assert work_dir_check.work_dir_problems(cfg, 'test') == []
    # Every time: said as it is.
    vanishing[:] = [1] * work_dir_check._VANISHING_TRIES
    for _ in vanishing:
        work.mkdir()
        work = work / 'again'
    cfg.work_dir = str(work)
    assert work_dir_check.work_dir_problems(cfg, 'test') == [
        Problem(
            f"work_dir '{work}': it kept disappearing while it was checked "
            '(another process makes and removes it)',
            'choose another --work-dir')
    ]


def test_what_one_save_writes(tmp_path):
    cfg = load_config(FCN, work_dir=str(tmp_path / 'work'))
    size = preflight_module.checkpoint_size(cfg)
    # The FCN's 0.9 M fp32 parameters (and BN buffers), AdamW's two
    # moments of each; bf16_compress keeps no state.
    assert 0.9e6 * 4 < size.weights < 1.0e6 * 4
    trainable = size.optimizer // 2
    assert 0.9e6 * 4 < trainable <= size.weights
    assert size.hook_state == 0
    assert size.total == preflight_module.estimate_checkpoint_bytes(cfg)
    # int8 on 2 ranks: each rank's error feedback, one fp32 copy of the
    # gradients; none without error feedback. PowerSGD alike.
    cfg.comm_hook = dict(type='int8_compress')
    assert preflight_module.checkpoint_size(cfg, 2).hook_state == \
        2 * trainable
    cfg.comm_hook = dict(type='int8_compress', error_feedback=False)
    assert preflight_module.checkpoint_size(cfg, 2).hook_state == 0
    cfg.comm_hook = dict(type='powerSGD')
    assert preflight_module.checkpoint_size(cfg, 4).hook_state == \
        4 * trainable
    # A model that cannot be built on the meta device: unknown.
    cfg.model = dict(type='NoSuchModel')
    assert preflight_module.estimate_checkpoint_bytes(cfg) is None
    assert preflight(cfg, 'train') == []
    assert preflight_module.format_size(1.5 * 2**30) == '1.5 GiB'
    assert preflight_module.format_size(18.7 * 2**20) == '18.7 MiB'


def test_what_one_save_writes_under_hybrid_sharding(monkeypatch):
    """Issue 43: under hybrid sharding every rank writes int8's residual
    of its shard beside each checkpoint (4 bytes a value, 2 in bf16);
    the preflight counted nothing for any FSDP2 config. The tiny recipe's
    sharding='auto' on torchrun's 2 nodes of 2 is hybrid (the strategy's
    own decision): 4 files of the shard the cost model counts; on one node
    full sharding, and nothing."""
    from mmcv_custom.analysis import cost
    from mmcv_custom.comm.builder import hook_record
    tiny = osp.join(
        CONFIGS, 'intern_vit', 'upernet_intern-vit-tiny_2xb8-'
        'fsdp2-200iter_toy-shapes-56x56.py')
    torchrun = LAUNCH_ENV['pytorch']
    for name, value in ((torchrun.rank, '0'), (torchrun.world, '4'),
                        (torchrun.local, '0'), (torchrun.local_world, '2')):
        monkeypatch.setenv(name, value)
    cfg = load_config(tiny, {'comm_hook': dict(type='int8_compress')})
    units = cost.config_params(tiny)[2]['fsdp2_units']
    shard = cost.hybrid_state_bytes(
        hook_record('int8_compress'), dict(error_feedback=True), units, 2) // 4
    size = preflight_module.checkpoint_size(cfg, 4, 'pytorch')
    assert size.hook_state == 4 * 4 * shard
    # About half the trainable parameters a rank (the optimizer's two
    # moments of them, fp32), rounded up per parameter.
    assert 0.5 * size.optimizer / 2 < 4 * shard < 0.51 * size.optimizer / 2
    cfg.comm_hook.residual_dtype = 'bfloat16'
    lean = preflight_module.checkpoint_size(cfg, 4, 'pytorch')
    assert lean.hook_state == 4 * 2 * shard
    # Without error feedback, without the launcher's layout, under full
    # sharding, or on one node: no file.
    for hook, strategy, launcher in (
        (dict(type='int8_compress', error_feedback=False), 'auto', 'pytorch'),
        (dict(type='int8_compress'), 'auto', 'none'),
        (dict(type='int8_compress'), 'full', 'pytorch'),
    ):
        cfg.comm_hook, cfg.strategy.sharding = hook, strategy
        assert preflight_module.checkpoint_size(cfg, 4,
                                                launcher).hook_state == 0
    cfg.strategy.sharding = 'auto'
    monkeypatch.setenv(torchrun.local_world, '4')
    assert preflight_module.checkpoint_size(cfg, 4, 'pytorch').hook_state == 0


def test_room_for_a_checkpoint_on_a_small_disk(tmp_path, small_disk,
                                               monkeypatch):
    """The tester's case: 14 MB free passed where a save takes 18.7 MB
    (the hook state files were not counted), and said "0.0 GiB"."""
    for name, value in (('RANK', '0'), ('LOCAL_RANK', '0'),
                        ('WORLD_SIZE', '2'), ('MASTER_ADDR', '127.0.0.1'),
                        ('MASTER_PORT', '29500')):
        monkeypatch.setenv(name, value)
    work = small_disk / 'work'
    cfg = load_config(
        FCN, {'comm_hook': dict(type='int8_compress')}, work_dir=str(work))
    size = preflight_module.checkpoint_size(cfg, 2)
    [problem] = preflight(cfg, 'train', launcher='pytorch')
    mib = preflight_module.format_size
    assert problem.what == (
        f"work_dir '{work}': 8.0 MiB free on its disk, but one checkpoint of "
        f'this run takes about {mib(size.total)} (weights '
        f'{mib(size.weights)}, optimizer state {mib(size.optimizer)}, '
        f'communication-hook state files {mib(size.hook_state)})')
    assert problem.fix == ('free space there, or choose another --work-dir '
                           'on a disk with room')
    assert preflight(cfg, 'test', launcher='pytorch') == []  # no save
    # The checkpoints in out_dir: its disk is the one that counts.
    cfg.work_dir = str(tmp_path / 'work')
    cfg.default_hooks.checkpoint.out_dir = str(small_disk)
    [problem] = preflight(cfg, 'train', launcher='pytorch')
    assert problem.what.startswith(
        f"default_hooks.checkpoint.out_dir '{small_disk}': 8.0 MiB free on "
        'its disk, but one checkpoint of this run takes about ')
    assert problem.fix == ('free space there, or set '
                           'default_hooks.checkpoint.out_dir to a disk with '
                           'room')
    # An out_dir that cannot be made is named like a work dir.
    (tmp_path / 'plain').write_text('')
    cfg.default_hooks.checkpoint.out_dir = str(tmp_path / 'plain' / 'ckpt')
    assert preflight(
        cfg, 'train', launcher='pytorch') == [
            Problem(
                "default_hooks.checkpoint.out_dir "
                f"'{tmp_path}/plain/ckpt': {tmp_path}/plain is a file, not a "
                'folder, so the folder cannot be made',
                'set default_hooks.checkpoint.out_dir to another folder '
                '(--cfg-options default_hooks.checkpoint.out_dir=PATH)')
        ]


def test_one_report_per_node(monkeypatch):
    error = PreflightError([Problem('a', 'b'), Problem('c')])
    assert str(error) == ('2 problems, found before building the model or '
                          'starting the process group:\n  1. a. Fix: b\n'
                          '  2. c')
    for name in ('LOCAL_RANK', 'RANK', 'SLURM_LOCALID', 'SLURM_PROCID'):
        monkeypatch.delenv(name, raising=False)
    report = preflight_report(error, 'train.py', 'none')
    assert report == f'train.py: error: {error}'
    monkeypatch.setenv('LOCAL_RANK', '1')
    assert preflight_report(error, 'train.py', 'pytorch') is None
    # Slurm: the launcher's variables, not the LOCAL_RANK train.py sets.
    monkeypatch.setenv('SLURM_LOCALID', '0')
    monkeypatch.setenv('SLURM_PROCID', '8')
    assert preflight_report(error, 'train.py',
                            'slurm').startswith('train.py (on ')
    assert ', rank 8): error: 2 problems' in preflight_report(
        error, 'train.py', 'slurm')
    with pytest.raises(ValueError, match="mode should be 'train' or 'test'"):
        preflight(None, 'val')


def test_comm_hook_is_checked_with_the_rest(tmp_path):
    """A bad comm_hook is named in the same message as missing data: the
    runner hook would find it only after the model is built."""
    cfg = load_config(
        VIT_6B,
        dict(comm_hook=dict(type='powerSGD', matrix_approximation_rank=0)),
        work_dir=str(tmp_path / 'work'))
    problems = preflight(cfg, 'train')
    assert problems[0] == Problem('comm_hook powerSGD: '
                                  'matrix_approximation_rank should be an '
                                  'int >= 1, but got 0')
    assert [p.what.split(':')[0] for p in problems[1:]] == [
        'train_dataloader and val_dataloader',
        "model.backbone.pretrained='pretrained/intern_vit_6b_224px.pth'"
    ]
    cfg = load_config(FCN, dict(comm_hook=dict(type='nope')))
    [problem] = preflight(cfg, 'test')
    assert problem.what.startswith(
        "comm_hook type 'nope' is not in the mmcv_custom::DDP communication "
        'hook registry. Valid types: allreduce, batched_powerSGD, ')
    # Under FSDP2, only the types with a sharded form.
    cfg = load_config(
        VIT_TINY,
        dict(
            comm_hook=dict(type='powerSGD'),
            runner_type='FlexibleRunner',
            strategy=dict(type='FSDP2Strategy')))
    [problem] = preflight(cfg, 'train')
    assert problem.what.startswith(
        "comm_hook type='powerSGD' has no sharded form: under FSDP2")
    cfg.comm_hook = dict(type='bf16_compress')
    assert preflight(cfg, 'train') == []


def test_custom_hooks_are_checked_with_the_rest(tmp_path):
    """The runner builds custom_hooks only after the model: a hook that is
    not a config (what --cfg-options makes of a dict in a list) or whose
    type is not registered is named first, with the nearest names."""
    cfg = load_config(
        FCN,
        dict(custom_hooks=[
            'dict(type=EMAHook)',
            dict(type='CommHookRegistrationHoook'),
            dict(type='EMAHook'),
            dict(priority='LOW'),
            dict(type='NoSuchHookAtAll'),
        ]),
        work_dir=str(tmp_path / 'work'))
    assert [str(p) for p in preflight(cfg, 'train')] == [
        "custom_hooks[0] should be a hook config such as dict(type='...'), "
        "but got 'dict(type=EMAHook)'. Fix: give dicts, not strings: "
        "custom_hooks = [dict(type='EMAHook')] in a config (one that "
        "inherits this one: _base_ = ['...']), or --cfg-options "
        '"custom_hooks=[dict(type=\'EMAHook\')]"',
        "custom_hooks[1]: 'CommHookRegistrationHoook' is not a registered "
        "hook (did you mean 'CommHookRegistrationHook'?). Fix: correct the "
        'type, or import the module that registers it in custom_imports',
        "custom_hooks[3] should be a hook config such as dict(type='...'), "
        "but got {'priority': 'LOW'}",
        "custom_hooks[4]: 'NoSuchHookAtAll' is not a registered hook. Fix: "
        'correct the type, or import the module that registers it in '
        'custom_imports',
    ]
    cfg.custom_hooks = 'EMAHook'
    [problem] = preflight(cfg, 'train')
    assert problem.what == ('custom_hooks should be a list of hook configs '
                            "such as [dict(type='...')], but got 'EMAHook'")
    # A type its custom_imports would register is not judged when they
    # fail: that failure is the problem.
    cfg = load_config(
        FCN,
        dict(
            custom_imports=dict(imports=['no_such_module_x']),
            custom_hooks=[dict(type='HookOfNoSuchModule')]),
        work_dir=str(tmp_path / 'work'))
    [problem] = preflight(cfg, 'train')
    assert problem.what.startswith('custom_imports: ')


@pytest.mark.parametrize('launcher, names, fix', [
    ('pytorch', 'RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are',
     'start it with tools/dist_train.sh CONFIG NPROC (torchrun)'),
    ('slurm', 'SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID are',
     'start it with tools/slurm_train.sh PARTITION JOB_NAME CONFIG (srun)'),
    ('mpi', 'OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, '
     'OMPI_COMM_WORLD_LOCAL_RANK are', 'start it with mpirun -np N'),
])
def test_a_launcher_that_did_not_start_the_process(launcher, names, fix,
                                                   tmp_path, monkeypatch):
    for env in LAUNCH_ENV.values():
        for name in (env.rank, env.world, env.local) + env.others:
            monkeypatch.delenv(name, raising=False)
    cfg = load_config(MLP, work_dir=str(tmp_path / 'work'))
    [problem] = preflight(cfg, 'train', launcher=launcher)
    assert problem.what.startswith(f'--launcher {launcher}: {names} not set')
    assert problem.fix == (f'{fix}, or leave --launcher out to run one '
                           'process')
    assert preflight(cfg, 'train', launcher='none') == []
    # One missing variable is named alone.
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    [problem] = preflight(cfg, 'test', launcher='pytorch')
    assert problem.what.startswith(
        '--launcher pytorch: MASTER_PORT is not set, so torchrun did not '
        'start this process')
    monkeypatch.setenv('MASTER_PORT', '29500')
    assert preflight(cfg, 'test', launcher='pytorch') == []


def test_the_tools_name_a_config_they_cannot_read(tmp_path):
    """Through the real entry points: a usage error (exit 2), one line,
    before any process group; the launcher's mistake, an unregistered
    hook and an unknown comm_hook said together."""
    broken = tmp_path / 'broken.py'
    broken.write_text('model = dict(\n')
    cases = [
        (['train.py',
          'nothere.py'], 'train.py: error: config nothere.py: no such file'),
        (['test.py', str(broken), 'x.pth'],
         f'test.py: error: config {broken}: cannot read it as a config '
         "(SyntaxError: '(' was never closed"),
        (['train.py', MLP, '--cfg-options', 'custom_hooks=[dict(type=X)]'],
         "train.py: error: --cfg-options 'custom_hooks=[dict(type=X)]': "
         'cannot read its value (X is not a literal); write strings in '
         'quotes and quote the whole item for the shell: '
         '"custom_hooks=[dict(type=\'X\')]"'),
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ('RANK', 'WORLD_SIZE', 'OMPI_COMM_WORLD_RANK')
    }
    for args, expected in cases:
        out = subprocess.run(
            [sys.executable, osp.join(TOOLS, args[0])] + args[1:],
            cwd=str(tmp_path),
            env=env,
            capture_output=True,
            text=True)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.startswith(expected), out.stderr
        assert len(out.stderr.splitlines()) == 1 and out.stdout == ''
    out = subprocess.run([
        sys.executable,
        osp.join(TOOLS, 'train.py'), MLP, '--launcher', 'mpi', '--cfg-options',
        'comm_hook.type=fp8_compress', "custom_hooks=[dict(type='X')]"
    ],
                         cwd=str(tmp_path),
                         env=env,
                         capture_output=True,
                         text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = _lines(out.stderr, 'train.py')
    assert lines[0].endswith('3 problems, found before building the model '
                             'or starting the process group:')
    assert lines[1].startswith('  1. --launcher mpi: OMPI_COMM_WORLD_RANK, ')
    assert lines[2] == ("  2. custom_hooks[0]: 'X' is not a registered hook. "
                        'Fix: correct the type, or import the module that '
                        'registers it in custom_imports')
    assert lines[3].startswith("  3. comm_hook type 'fp8_compress' is not ")
    assert len(lines) == 4
    assert not (tmp_path / 'work_dirs').exists()


def test_a_periodic_hook_on_the_launchers_nodes(monkeypatch):
    """post_local_sgd on one node, or a stated layout the launcher
    contradicts, is said before the ranks start, in the runner hook's
    words; DiLoCo on one node runs (Lookahead), and a checkpoint of
    either counts each rank's parameters and optimizer state."""
    from mmcv_custom.comm.config import comm_hook_config
    from mmcv_custom.launching.preflight.periodic import periodic_problems
    torchrun = LAUNCH_ENV['pytorch']
    for name, value in ((torchrun.rank, '0'), (torchrun.world, '2'),
                        (torchrun.local, '0'), (torchrun.local_world, '2')):
        monkeypatch.setenv(name, value)

    def problems(**cfg):
        return [
            p.what
            for p in periodic_problems(comm_hook_config(cfg), 'pytorch')
        ]

    assert problems(
        type='post_local_sgd', period=5
    ) == [
        'comm_hook post_local_sgd on one node (1 node x 2 ranks (ranks '
        '(0, 1) on node 0)) averages nothing across nodes: the gradients of '
        'every step are averaged over all ranks already, so it would be '
        'plain DDP with redundant parameter averaging. Use the inner hook '
        "itself (e.g. comm_hook = dict(type='allreduce')) on one node"
    ]
    assert problems(type='diloco', period=5) == []
    assert problems(
        type='diloco', period=5, topology=dict(ranks_per_node=1)) == [
            'comm_hook diloco: topology says ranks_per_node=1 (2 nodes x 1 '
            'rank (ranks (0,) on node 0, (1,) on node 1)), but the launcher '
            'placed the ranks as 1 node x 2 ranks (ranks (0, 1) on node 0): '
            'remove ranks_per_node to follow the launcher, or launch the '
            'ranks as stated'
        ]
    # Other hooks, and a process no launcher started: nothing to say.
    assert problems(type='int8_compress') == []
    assert periodic_problems(
        comm_hook_config(dict(type='post_local_sgd', period=5)), 'none') == []
    monkeypatch.setenv(torchrun.local_world, '1')
    assert problems(type='post_local_sgd', period=5) == []
    cfg = load_config(FCN, {'comm_hook': dict(type='diloco', period=5)})
    size = preflight_module.checkpoint_size(cfg, 2, 'pytorch')
    plain = preflight_module.checkpoint_size(
        load_config(FCN, {'comm_hook': dict(type='allreduce')}), 2, 'pytorch')
    # Each rank's parameters and optimizer state, and DiLoCo's outer state.
    assert size.hook_state > 2 * plain.weights


def test_a_periodic_hooks_files_count_the_nodes_slices(monkeypatch):
    """Every rank's file holds its parameters and optimizer state
    (AdamW: two copies); DiLoCo's three fp32 copies are split over a
    node's ranks; the inner exchange's state is counted once for each
    exchange the run keeps (inside the node; over every rank during
    start_iter)."""
    torchrun = LAUNCH_ENV['pytorch']
    for name, value in ((torchrun.rank, '0'), (torchrun.world, '4'),
                        (torchrun.local, '0'), (torchrun.local_world, '2')):
        monkeypatch.setenv(name, value)

    def state(**hook):
        cfg = load_config(FCN, {'comm_hook': hook})
        return preflight_module.checkpoint_size(cfg, 4, 'pytorch').hook_state

    cfg = load_config(FCN, {'comm_hook': dict(type='allreduce')})
    assert cfg.optim_wrapper.optimizer.type == 'AdamW'
    values = preflight_module.checkpoint_size(cfg, 4, 'pytorch').optimizer // 8
    own = 3 * 4 * values  # the fp32 parameters and AdamW's two moments

    def slice_of(ranks):
        return -(-values // ranks)

    # 2 nodes x 2 ranks (the launcher's layout): each rank keeps half.
    assert state(type='diloco', period=5) == 4 * (own + 12 * slice_of(2))
    assert state(
        type='diloco', period=5, outer_format='bf16') == 4 * (
            own + 8 * slice_of(2))
    # int8 inside the node keeps its residual (4 B a value) per rank.
    assert state(
        type='diloco', period=5, inner=dict(type='int8_compress')) == 4 * (
            own + 12 * slice_of(2) + 4 * values)
    assert state(type='post_local_sgd', period=5) == 4 * own
    # ... and a second one where start_iter exchanges over every rank.
    assert state(
        type='post_local_sgd',
        period=5,
        start_iter=10,
        inner=dict(type='int8_compress')) == 4 * (
            own + 2 * 4 * values)
    # On 4 nodes of one rank each keeps the whole of DiLoCo's state.
    monkeypatch.setenv(torchrun.local_world, '1')
    assert state(type='diloco', period=5) == 4 * (own + 12 * values)
    # The optimizer's copies as the config's optimizer keeps them: SGD
    # without momentum none, even where the checkpoint saves none.
    sgd = {'optim_wrapper.optimizer': dict(type='SGD', lr=0.01)}
    cfg = load_config(
        FCN, {
            'comm_hook': dict(type='post_local_sgd', period=5),
            'default_hooks.checkpoint.save_optimizer': False,
            **sgd
        })
    assert preflight_module.checkpoint_size(
        cfg, 4, 'pytorch').hook_state == 4 * 4 * values
