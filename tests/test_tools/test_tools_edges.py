"""The tools as a newcomer runs them: the interpreter the shell scripts pick,
``--out`` on several ranks, ``load_from`` checks, model wrappers on CPU, and
model_stats' labels and errors. Real processes through the real entry
points; what can fail before any work starts is checked to do so."""
import glob
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch

from mmcv_custom.launching.ports import free_port
from tests.tool_utils import toy_set

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOLS = osp.join(ROOT, 'tools')
FCN = osp.join(ROOT, 'configs', 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')
VENV_PYTHON = osp.join(ROOT, '.venv', 'bin', 'python')
MODEL_STATS = osp.join(TOOLS, 'analysis_tools', 'model_stats.py')
# The FCN on a small toy set: 2 iterations, checkpoint at the end.
TINY = [
    'train_cfg.max_iters=2',
    'train_cfg.val_interval=100',
    'default_hooks.checkpoint.interval=2',
    'default_hooks.logger.interval=1',
] + toy_set(16, 8)
# TensorBoard beside the JSON logs, as the hooks guide gives it at launch.
TENSORBOARD = ("visualizer.vis_backends=[dict(type='LocalVisBackend'),"
               "dict(type='TensorboardVisBackend')]")


def _run(args, cwd, env=None, timeout=600):
    env = dict(os.environ if env is None else env, PORT=free_port())
    return subprocess.run(
        args,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout)


def _python_env():
    """The test's environment with PYTHON=this interpreter."""
    return dict(os.environ, PYTHON=sys.executable)


@pytest.fixture(scope='module')
def bare_shell(tmp_path_factory):
    """A fresh shell's environment: no PYTHON, no virtualenv on PATH, and
    a real ``python`` first on PATH that has no torch (a virtualenv made
    without packages), as a newcomer's system Python."""
    base = tmp_path_factory.mktemp('bare')
    subprocess.run(
        [sys.executable, '-m', 'venv', '--without-pip',
         str(base / 'venv')],
        check=True)
    bin_dir = str(base / 'venv' / 'bin')
    ours = {
        osp.realpath(osp.dirname(sys.executable)),
        osp.realpath(osp.dirname(VENV_PYTHON))
    }
    path = [
        p for p in os.environ.get('PATH', '').split(os.pathsep)
        if p and osp.realpath(p) not in ours
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ('PYTHON', 'VIRTUAL_ENV', 'PYTHONHOME')
    }
    env['PATH'] = os.pathsep.join([bin_dir] + path)
    no_torch = subprocess.run(['python', '-c', 'import torch'],
                              env=env,
                              capture_output=True,
                              text=True)
    assert "No module named 'torch'" in no_torch.stderr
    return env


def test_python_overrides_the_venv(bare_shell, tmp_path):
    # PYTHON wins over .venv/bin/python: here a Python without torch.
    no_torch = osp.join(bare_shell['PATH'].split(os.pathsep)[0], 'python')
    for script, args in (('dist_train.sh', [MLP, '1']), ('dist_test.sh',
                                                         [MLP, 'x.pth', '1'])):
        out = _run(['bash', osp.join(TOOLS, script), *args],
                   str(tmp_path),
                   env=dict(bare_shell, PYTHON=no_torch))
        assert out.returncode == 1
        assert out.stderr == (
            f'{script}: {no_torch} cannot run torchrun (ModuleNotFoundError: '
            "No module named 'torch'); set PYTHON to a Python with torch, or "
            'run `make install`\n')


@pytest.fixture(scope='module')
def trained(bare_shell, tmp_path_factory):
    """The FCN trained for 2 iterations on 2 gloo ranks by
    ``bash tools/dist_train.sh`` in a fresh shell (no PYTHON, no torch on
    PATH), in a folder of its own, with TensorBoard."""
    if not os.access(VENV_PYTHON, os.X_OK):
        pytest.skip(f'{VENV_PYTHON} does not exist (make install builds it)')
    cwd = tmp_path_factory.mktemp('fcn')
    out = _run([
        'bash',
        osp.join(TOOLS, 'dist_train.sh'), FCN, '2', '--work-dir', 'work',
        '--cfg-options', *TINY, TENSORBOARD
    ],
               str(cwd),
               env=bare_shell)
    return cwd, out


@pytest.mark.slow
def test_dist_train_uses_the_venv_in_a_fresh_shell(trained):
    cwd, out = trained
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'process group: 2 ranks, backend gloo' in out.stdout + out.stderr
    assert (cwd / 'work' / 'iter_2.pth').is_file()


@pytest.mark.slow
def test_tensorboard_is_turned_on_from_the_command_line(trained):
    """Issue 42: MMEngine's ``--cfg-options`` kept each ``dict(...)`` a
    string and the visualizer raised ``TypeError``. Read as dicts, the
    run writes TensorBoard's events beside the JSON logs the tools read."""
    cwd, out = trained
    assert out.returncode == 0, out.stderr[-3000:]
    vis_data = glob.glob(str(cwd / 'work' / '*' / 'vis_data'))
    assert len(vis_data) == 1, vis_data
    assert glob.glob(osp.join(vis_data[0], 'events.out.tfevents.*'))
    assert osp.isfile(osp.join(vis_data[0], 'scalars.json'))
    page = osp.join(ROOT, 'docs', 'en', 'user_guides', 'comm_hooks.md')
    with open(page) as f:
        assert f'--cfg-options "{TENSORBOARD}"' in f.read()


@pytest.mark.slow
def test_dist_test_out_dir_is_created_for_every_rank(trained):
    # tools/test.py's own example: --out to a folder that does not exist.
    # MMSegmentation's IoUMetric creates it on rank 0 only, while every
    # rank writes its share of the predictions there.
    cwd, out = trained
    assert out.returncode == 0
    tested = _run([
        'bash',
        osp.join(TOOLS, 'dist_test.sh'), FCN,
        str(cwd / 'work' / 'iter_2.pth'), '2', '--out', 'results/fcn',
        '--work-dir', 'eval', '--cfg-options', *TINY
    ],
                  str(cwd),
                  env=_python_env())
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert re.search(r'mIoU: \d+\.\d+', tested.stdout + tested.stderr)
    # One prediction per validation image, from both ranks.
    assert sorted(os.listdir(cwd / 'results' /
                             'fcn')) == [f'{i:04d}.png' for i in range(8)]


@pytest.mark.slow
def test_load_from_is_checked_like_resume(trained, tmp_path):
    """``load_from`` without ``--resume`` gets the safe-loading check: an
    unsafe file is refused before anything starts."""
    import argparse

    from mmcv_custom.integrity.checkpoint_choice import check_checkpoint_file
    cwd, out = trained
    assert out.returncode == 0
    good = str(cwd / 'work' / 'iter_2.pth')
    check_checkpoint_file(good, 'load_from')  # MMEngine's own: allowed

    bad = str(tmp_path / 'bad.pth')
    checkpoint = torch.load(good)
    checkpoint['meta']['args'] = argparse.Namespace(lr=1)
    torch.save(checkpoint, bad)
    config = tmp_path / 'finetune.py'
    config.write_text(f'_base_ = [{FCN!r}]\nload_from = {bad!r}\n')
    refused = _run([
        sys.executable,
        osp.join(TOOLS, 'train.py'),
        str(config), '--work-dir',
        str(tmp_path / 'work')
    ], str(tmp_path))
    assert refused.returncode == 2  # a preflight problem
    assert (f'train.py: error: load_from: Refusing to load {bad}: it '
            'contains argparse.Namespace') in refused.stderr
    assert not (tmp_path / 'work').exists()

    # (A missing one on 2 ranks, named once before the process group
    # starts: test_restart.py.)


@pytest.mark.slow
def test_resume_in_a_copied_work_dir_continues_the_copy(trained, tmp_path):
    # last_checkpoint still names the original run's checkpoint: resuming
    # the copy continues the copy and leaves the original alone.
    import shutil
    cwd, out = trained
    assert out.returncode == 0
    copy = tmp_path / 'copy'
    shutil.copytree(cwd / 'work', copy)
    resumed = _run([
        sys.executable,
        osp.join(TOOLS, 'train.py'), FCN, '--work-dir',
        str(copy), '--resume', '--cfg-options', *TINY, 'train_cfg.max_iters=3'
    ], str(cwd))
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    # (The wording is resolve_resume_checkpoint's, in
    # mmcv_custom.integrity.checkpoint_choice.)
    assert f'{copy}/last_checkpoint names {cwd}/work/iter_2.pth' in log
    assert f'so resuming from {copy}/iter_2.pth.' in log
    assert 'resumed epoch: 0, iter: 2' in log
    assert (copy / 'iter_3.pth').is_file()
    assert not (cwd / 'work' / 'iter_3.pth').exists()


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason='on GPUs MMEngine builds every wrapper itself')
def test_dist_train_refuses_a_wrapper_that_is_not_ddp(tmp_path):
    out = _run([
        'bash',
        osp.join(TOOLS, 'dist_train.sh'), MLP, '2', '--work-dir',
        str(tmp_path / 'work'), '--cfg-options',
        'model_wrapper_cfg.type=MMFullyShardedDataParallel'
    ],
               str(tmp_path),
               env=_python_env())
    log = out.stdout + out.stderr
    assert out.returncode == 1
    assert log.count(
        "ValueError: model_wrapper_cfg type 'MMFullyShardedDataParallel' is "
        'not supported without CUDA: the tools then train on a gloo process '
        'group with a CPU DistributedDataParallel') == 1
    # (Each rank raises it; dist_train.sh says it once.)
    assert 'started a gloo process group' not in log
    assert not (tmp_path / 'work').exists()


# ---------------------------------------------------------------------------
# tools/analysis_tools/model_stats.py

UPERNET_R50 = osp.join(
    ROOT, 'configs', 'upernet',
    'upernet_r50_4xb4-bf16-compress-160k_ade20k-512x512.py')
VIT_TINY = osp.join(
    ROOT, 'configs', 'intern_vit',
    'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py')


def _stats(*args):
    return _run([sys.executable, MODEL_STATS, *args], ROOT)


@pytest.mark.slow
def test_model_stats_names_a_vit_only_where_there_is_one():
    resnet = _stats(UPERNET_R50)
    assert resnet.returncode == 0, resnet.stderr[-3000:]
    assert re.search(r'^parameters        : [\d,]+ \(backbone [\d,]+\)$',
                     resnet.stdout, re.M), resnet.stdout
    assert 'ViT' not in resnet.stdout
    vit = _stats(VIT_TINY, '--cfg-options', 'comm_hook.type=fp16_compress')
    assert vit.returncode == 0, vit.stderr[-3000:]
    assert re.search(
        r'^parameters        : [\d,]+ \(backbone [\d,]+, of which the '
        r'pre-trained ViT [\d,]+\)$', vit.stdout, re.M), vit.stdout
    # --cfg-options as in tools/train.py.
    assert "(type='fp16_compress'; " in vit.stdout
    # No backbone at all; a small model reads in MiB, not 0.000 GiB.
    mlp = _stats(MLP)
    assert mlp.returncode == 0, mlp.stderr[-3000:]
    assert re.search(r'^parameters        : 142,088$', mlp.stdout, re.M)
    assert re.search(
        r'^with comm_hook    : 0\.271 MiB per step '
        r"\(type='bf16_compress'; its flat form on 8 ranks, the first of "
        r'--gpus\)$', mlp.stdout, re.M)


@pytest.mark.slow
def test_test_tool_names_what_a_config_lacks(tmp_path):
    config = tmp_path / 'no_test.py'
    config.write_text(f'_base_ = [{MLP!r}]\ntest_dataloader = None\n'
                      'test_evaluator = None\n')
    checkpoint = tmp_path / 'weights.pth'
    torch.save({'state_dict': {}}, checkpoint)
    out = _run([
        sys.executable,
        osp.join(TOOLS, 'test.py'),
        str(config),
        str(checkpoint), '--out',
        str(tmp_path / 'out')
    ], str(tmp_path))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f'test.py: error: ValueError: {config} sets no test_dataloader, '
        'test_evaluator, '
        'which this tool evaluates with. Add them to the config (to test on '
        'the validation set: test_dataloader = val_dataloader, test_cfg = '
        'dict(), test_evaluator = val_evaluator).')


@pytest.mark.parametrize('option,error', [
    ('comm_hook.type=nope', "comm_hook type 'nope' is not in the "),
    ('comm_hook.wrapper=fp8',
     "comm_hook wrapper should be 'fp16', 'bf16' or None, but got 'fp8'"),
])
def test_model_stats_rejects_a_bad_comm_hook_in_one_line(option, error):
    out = _stats(UPERNET_R50, '--cfg-options', option)
    assert out.returncode == 1
    assert 'Traceback' not in out.stderr
    # (Above it, only the warnings of imported packages, if any.)
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f'model_stats.py: error: {error}'), last
    assert out.stdout == ''


def test_resume_checkpoint_is_the_work_dirs_own(tmp_path):
    """What tools/train.py --resume continues from, for a work dir whose
    last_checkpoint names another folder (moved, copied, or a CheckpointHook
    out_dir)."""
    from mmcv_custom.integrity.checkpoint_choice import \
        resolve_resume_checkpoint
    here, there = tmp_path / 'here', tmp_path / 'there'
    here.mkdir()
    there.mkdir()
    assert resolve_resume_checkpoint(str(here)) == (None, None)
    (here / 'last_checkpoint').write_text(f'{there}/iter_8.pth\n')
    # Not here: another run's, not followed unless named.
    assert resolve_resume_checkpoint(str(here)) == (
        None, f"{here}/last_checkpoint names {there}/iter_8.pth, outside "
        f"this run's checkpoint folder {here}, which has no iter_8.pth: "
        "that is another run's checkpoint (or this work dir was moved "
        'without it), and it is not continued unless named: --resume '
        f'{there}/iter_8.pth')
    # Here and there (a copy): this work dir's own.
    (here / 'iter_8.pth').write_bytes(b'')
    (there / 'iter_8.pth').write_bytes(b'')
    path, note = resolve_resume_checkpoint(str(here))
    assert path == f'{here}/iter_8.pth'
    assert note.endswith('the work dir is a copy of another run (which is '
                         f'left alone), so resuming from {here}/iter_8.pth.')
    # Only here (moved).
    (there / 'iter_8.pth').unlink()
    path, note = resolve_resume_checkpoint(str(here))
    assert path == f'{here}/iter_8.pth' and 'the work dir was moved' in note
    # An explicit load_from always wins; a recorded path in this work dir
    # is used as it is.
    assert resolve_resume_checkpoint(str(here), 'x.pth') == ('x.pth', None)
    (here / 'last_checkpoint').write_text(f'{here}/iter_8.pth')
    assert resolve_resume_checkpoint(str(here)) == (f'{here}/iter_8.pth', None)


def test_train_adds_its_hooks_once_whatever_form_the_config_gives():
    """train.py adds RandomStateHook and RunIdentityHook, and the runner
    hook when comm_hook is set, unless custom_hooks has them: by name, by
    class or as Hook objects (all of which MMEngine takes)."""
    from mmengine.config import Config

    from mmcv_custom.engine import CommHookRegistrationHook, RunIdentityHook
    from mmcv_custom.engine.random_state import RandomStateHook
    from tests.tool_utils import load_script
    train = load_script(osp.join(TOOLS, 'train.py'), 'train_tool')

    def added(hooks):
        cfg = Config(
            dict(custom_hooks=list(hooks), comm_hook=dict(type='allreduce')))
        train.add_comm_hook_runner_hook(cfg)
        train.add_random_state_hook(cfg)
        return cfg.custom_hooks[len(hooks):]

    assert added([]) == [
        dict(type='CommHookRegistrationHook'),
        dict(type='RandomStateHook'),
        dict(type='RunIdentityHook')
    ]
    assert added([dict(type='RandomStateHook')]) == [
        dict(type='CommHookRegistrationHook'),
        dict(type='RunIdentityHook')
    ]
    for hooks in ([
            dict(type='RandomStateHook'),
            dict(type='mmcv_custom.RunIdentityHook'),
            dict(type='mmcv_custom.CommHookRegistrationHook')
    ], [
            dict(type=RandomStateHook),
            dict(type=RunIdentityHook),
            dict(type=CommHookRegistrationHook)
    ], [RandomStateHook(),
            RunIdentityHook(),
            CommHookRegistrationHook()]):
        assert added(hooks) == []
