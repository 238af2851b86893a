"""Ordinary mistakes on the tools' command lines are one line, not a
traceback: exit code 2 for a usage error (a missing file, a bad value),
1 for a failure at run time."""
import os.path as osp
import subprocess
import sys

import pytest

from tests.tool_utils import load_script, usage_errors

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SPLITS = osp.join(ROOT, 'tools', 'dataset_converters',
                  'ade20k_fewshot_splits.py')
MODEL_STATS = osp.join(ROOT, 'tools', 'analysis_tools', 'model_stats.py')
FCN = osp.join(ROOT, 'configs', 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')


def _run(*args):
    return subprocess.run([sys.executable, *args],
                          capture_output=True,
                          text=True,
                          timeout=300,
                          cwd=ROOT)


@pytest.fixture(scope='module')
def splits():
    return load_script(SPLITS, '_fewshot_splits')


def _images(root, names, suffix='.jpg'):
    folder = root / 'images' / 'training'
    folder.mkdir(parents=True)
    for name in names:
        (folder / f'{name}{suffix}').write_bytes(b'')


def test_fewshot_splits_missing_data_root_is_one_line(tmp_path):
    missing = tmp_path / 'ADEChallengeData2016'
    out = _run(SPLITS, '--data-root', str(missing))
    assert out.returncode == 2
    assert 'Traceback' not in out.stderr
    assert out.stderr.splitlines()[-1] == (
        f'ade20k_fewshot_splits.py: error: --data-root {missing}: no such '
        'folder; give the ADE20K folder that holds images/training '
        '(ADEChallengeData2016, unpacked where MMSegmentation expects it: '
        'data/ade/ADEChallengeData2016)')
    assert out.stdout == ''


@pytest.mark.parametrize('case', ['no-img-dir', 'no-images'])
def test_fewshot_splits_usage_errors(splits, case, tmp_path, monkeypatch,
                                     capsys):
    parse = usage_errors(splits, SPLITS, monkeypatch, capsys)
    if case == 'no-img-dir':
        expected = (f'--data-root {tmp_path}: no images/training in it; give '
                    'the ADE20K folder that holds it (ADEChallengeData2016), '
                    'or its place with --img-dir')
    else:
        _images(tmp_path, ['a', 'b'], suffix='.png')
        expected = (f'no *.jpg images in {tmp_path}/images/training (wrong '
                    '--suffix or --img-dir?)')
    assert parse(['--data-root', str(tmp_path)
                  ]) == (2, f'ade20k_fewshot_splits.py: error: {expected}')
    assert not (tmp_path / 'splits').exists()


def test_fewshot_splits_write_failure_is_one_line(splits, tmp_path, capsys):
    _images(tmp_path, ['a', 'b', 'c'])
    (tmp_path / 'splits').write_text('a file where the folder goes')
    assert splits.main(['--data-root', str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        'ade20k_fewshot_splits.py: error: cannot write the splits: '
        f'{tmp_path}/splits (File exists)\n')
    assert captured.out == ''


def test_fewshot_splits_are_written(splits, tmp_path, capsys):
    _images(tmp_path, [f'ADE_train_{i:08d}' for i in range(32)])
    assert splits.main(['--data-root', str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f'1/1: 32 images -> {tmp_path}/splits/train_1of1.txt')
    assert out[-1] == (f'1/16: 2 images -> {tmp_path}/splits/'
                       'train_1of16.txt')


@pytest.mark.parametrize(
    'args,code,message',
    [([osp.join(ROOT, 'configs', 'nope.py')
       ], 2, f"config {osp.join(ROOT, 'configs', 'nope.py')}: no such file"),
     ([FCN, '--cfg-options', 'model.backbone.depth=7'
       ], 1, f'cannot build the model of {FCN}: ')],
    ids=['missing-config', 'bad-value'])
def test_model_stats_errors_are_one_line(args, code, message):
    out = _run(MODEL_STATS, *args)
    assert out.returncode == code, out.stderr[-3000:]
    assert 'Traceback' not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f'model_stats.py: error: {message}'), last
    if code == 1:
        assert 'invalid depth 7 for resnet' in last
    assert out.stdout == ''


@pytest.mark.parametrize(
    'args,message',
    [([FCN, '--cfg-options', 'model.backbone.depth'
       ], "--cfg-options 'model.backbone.depth': expected KEY=VALUE"),
     ([FCN, '--cfg-options', 'model.backbone.out_indices=(0,1'
       ], "--cfg-options 'model.backbone.out_indices=(0,1': cannot read its "
      'value (Imbalanced brackets exist in (0,1)'),
     ([FCN, '--gpus', '8', '0'
       ], '--gpus should be positive numbers of GPUs, but got 0')],
    ids=['no-value', 'unbalanced', 'gpus'])
def test_model_stats_usage_errors(args, message, monkeypatch, capsys):
    # In this process: MMEngine's DictAction once raised an AssertionError
    # (a traceback) for the unbalanced bracket.
    tool = load_script(MODEL_STATS, '_model_stats')
    parse = usage_errors(tool, MODEL_STATS, monkeypatch, capsys)
    assert parse(args) == (2, f'model_stats.py: error: {message}')


@pytest.mark.parametrize('args,message', [
    (['--nproc', '0'], '--nproc should be at least 1, but got 0'),
    (['--config', 'configs/nope.py'], '--config configs/nope.py: no such '
     'file'),
])
def test_demo_usage_errors(args, message, monkeypatch, capsys):
    # Before anything starts, not after dist_train.sh failed.
    demo = osp.join(ROOT, 'tools', 'demo.py')
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv('PORT', raising=False)
    parse = usage_errors(
        load_script(demo, '_demo_errors'), demo, monkeypatch, capsys)
    assert parse(args) == (2, f'demo.py: error: {message}')
