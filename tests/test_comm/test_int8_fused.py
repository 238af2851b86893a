"""The fused int8 kernels (:mod:`mmcv_custom.hooks.int8_fused`) under
Triton's interpreter, on CPU: the same bits as the torch path, the block
table's layouts and every residual mode included. On a GPU,
``tests/test_cuda`` runs the same cases compiled.

Triton comes from ``.venv/triton``, where ``make install`` puts it outside
the venv (``requirements/triton.txt``), added to the path of these tests'
own processes only; or from the environment where it is installed.
Skipped where it is neither."""
import os
import subprocess
import sys

import pytest

from mmcv_custom.hooks import int8_fused

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRITON_DIR = os.path.join(ROOT, '.venv', 'triton')
needs_triton = pytest.mark.skipif(
    not (int8_fused.AVAILABLE
         or os.path.isdir(os.path.join(TRITON_DIR, 'triton'))),
    reason='Triton is not installed (make install puts it in .venv/triton)')


def _run(code_or_module, env=None, module=False):
    env = dict(os.environ, TRITON_INTERPRET='1', **(env or {}))
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (env.get('PYTHONPATH'), TRITON_DIR) if p)
    args = ([sys.executable, '-m', code_or_module]
            if module else [sys.executable, '-c', code_or_module])
    return subprocess.run(
        args + (['cpu'] if module else []),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300)


@needs_triton
def test_the_fused_kernels_are_the_torch_path_bit_for_bit():
    out = _run('tests.test_comm.int8_fused_cases', module=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ['OK'], out.stdout


@needs_triton
def test_the_codec_takes_them_only_when_asked():
    """``MMCV_CUSTOM_INT8_FUSED=1`` routes the codec's calls to them
    (here, past the C kernel's largest block); without it, nothing
    changes."""
    code = '\n'.join([
        'import os, torch',
        'from mmcv_custom.hooks import int8_codec, int8_fused',
        'calls = []',
        'real = int8_fused.quantize',
        'int8_fused.quantize = lambda *a: calls.append(1) or real(*a)',
        'block = int8_codec.C_MAX_BLOCK + 1',
        'x = torch.randn(3 * block)',
        'for flag in ("1", "0"):',
        f'    os.environ[{int8_fused.ENV!r}] = flag',
        '    q, s = int8_codec.quantize(x, block, 0.5)',
        '    back = int8_codec.dequantize(q, s, block)',
        '    print(len(calls), bool((back - x * 0.5).abs().max() < 0.05))',
    ])
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ['1 True', '1 True']
    # Outside the interpreter a CPU tensor never goes to Triton.
    import torch
    assert os.environ.get('TRITON_INTERPRET') != '1'
    assert not int8_fused.usable(torch.zeros(1))
