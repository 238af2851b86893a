"""``tools/device_check.sh``, the GPU checks of issue 32 as one script: its
CPU half, so that it still runs when a GPU is next lent, and the codec
benchmark's argument checks."""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest

from tests.tool_utils import load_script, usage_errors

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SCRIPT = osp.join(ROOT, 'tools', 'device_check.sh')
BENCH = osp.join(ROOT, 'tools', 'analysis_tools', 'benchmark_codec.py')


def test_the_cpu_half_leaves_its_log_and_summary(tmp_path):
    """The CUDA tests are collected and skip with their reason, the codec
    benchmark runs on the CPU, and the summary says both, with the
    device."""
    out = tmp_path / 'out'
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(['bash', SCRIPT, '--cpu'],
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert sorted(os.listdir(out)) == [
        'codec.json', 'device_check.json', 'device_check.log', 'tests.xml'
    ]
    with open(out / 'device_check.json') as f:
        summary = json.load(f)
    assert summary['mode'] == 'cpu'
    assert (summary['tests_rc'], summary['bench_rc']) == (0, 0)
    assert summary['problems'] == []
    assert summary['failed'] == 0 and summary['skipped'] >= 10
    assert summary['device'].startswith('CPU')
    assert {
        'copy 4 MiB', 'int8 quantize 4 MiB', 'int8 dequantize 4 MiB',
        'bfloat16 compress 4 MiB'
    } <= set(summary['codec'])
    log = (out / 'device_check.log').read_text()
    assert 'no CUDA device: tools/device_check.sh runs these' in log


def test_without_a_cuda_device_it_says_nothing_was_checked(tmp_path):
    """Issue 42: without a GPU it exited 1 saying "tests exited with 0"
    (the CUDA tests had all skipped). Now it runs neither step and says
    why, in its last line and its summary, and still exits 1."""
    import torch
    if torch.cuda.is_available():
        pytest.skip('a CUDA device is present')
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(['bash', SCRIPT],
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    reason = (f'no CUDA device (torch {torch.__version__} cuda '
              f'{torch.version.cuda} available False): nothing was checked '
              'on a GPU; tests/test_cuda and the codec benchmark did not run '
              '(tools/device_check.sh --cpu runs the CPU half)')
    assert done.stderr.splitlines()[-1] == (
        f'device_check.sh: {reason} (see {tmp_path}/device_check.log)')
    assert sorted(
        os.listdir(tmp_path)) == ['device_check.json', 'device_check.log']
    with open(tmp_path / 'device_check.json') as f:
        summary = json.load(f)
    assert summary == dict(
        mode='cuda', tests_rc=None, bench_rc=None, problems=[reason])


def test_a_wrong_argument_is_a_usage_error(tmp_path):
    done = subprocess.run(['bash', SCRIPT, '--gpu'],
                          env=dict(os.environ, OUT=str(tmp_path)),
                          capture_output=True,
                          text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "device_check.sh: error: unknown argument '--gpu' (only --cpu)")
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope='module')
def bench():
    return load_script(BENCH, '_benchmark_codec')


@pytest.mark.parametrize('args,message', [
    (['--device', 'tpu'], "--device should be cpu or cuda[:N], but got 'tpu'"),
    (['--device', 'cuda'], '--device cuda: this torch sees no CUDA device'),
    (['--sizes-mb', '0'], '--sizes-mb should be above 0, but got 0'),
    (['--repeat', '0'], '--repeat should be at least 1, but got 0'),
])
def test_the_benchmark_s_bad_arguments(bench, monkeypatch, capsys, args,
                                       message):
    import torch
    if args[:2] == ['--device', 'cuda'] and torch.cuda.is_available():
        pytest.skip('a CUDA device is present')
    code, last = usage_errors(bench, BENCH, monkeypatch, capsys)(args)
    assert code == 2
    assert last.endswith(f'error: {message}')
