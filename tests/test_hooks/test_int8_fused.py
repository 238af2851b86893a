"""The fused int8 kernels (:mod:`mmcv_custom.hooks.int8_fused`) under
Triton's interpreter, on CPU: the same bits as the torch path, the block
table's layouts and every residual mode included. On a GPU,
``tests/test_cuda`` runs the same cases compiled.

Triton comes from ``.venv/triton``, where ``make install`` puts it outside
the venv (``requirements/triton.txt``), added to the path of these tests'
own processes only; or from the environment where it is installed.
Skipped where it is neither."""
import os
import re
import subprocess
import sys

import pytest
import torch

from mmcv_custom.hooks import int8_codec, int8_fused

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
    out = _run('tests.test_hooks.int8_fused_cases', module=True)
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
        # What the registration line says, flag on.
        f'os.environ[{int8_fused.ENV!r}] = "1"',
        'print(int8_codec.codec_in_use(torch.device("cpu"), block))',
        'print(int8_codec.codec_in_use(torch.device("cpu"), 256))',
    ])
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:3] == [
        '1 True', '1 True', 'fused Triton kernels (MMCV_CUSTOM_INT8_FUSED=1)'
    ]
    assert re.fullmatch(
        r'C kernel \(\w+\) when single-threaded; MMCV_CUSTOM_INT8_FUSED=1 '
        'asked for the fused kernels, but the C kernel comes first: CPU '
        'buckets use the C kernel', lines[3]), lines[3]
    # Outside the interpreter a CPU tensor never goes to Triton.
    assert os.environ.get('TRITON_INTERPRET') != '1'
    assert not int8_fused.usable(torch.zeros(1))


def test_the_codec_in_use_is_said_and_the_switch_never_ignored(monkeypatch):
    """Issue 42: what the registration line of an int8 hook says
    (:func:`int8_codec.codec_in_use`), flag on or off; a value that is
    neither 1 nor 0 is refused, by the line and by the codec itself."""
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    cpu, cuda = torch.device('cpu'), torch.device('cuda')
    over = int8_codec.C_MAX_BLOCK + 1
    c_kernel = r'C kernel \(\w+\) when single-threaded'
    slow = (f'torch ops (block_size={over} is over the C kernel\'s '
            f'{int8_codec.C_MAX_BLOCK})')
    for flag in (None, '0'):
        if flag is None:
            monkeypatch.delenv(int8_fused.ENV, raising=False)
        else:
            monkeypatch.setenv(int8_fused.ENV, flag)
        assert re.fullmatch(c_kernel, int8_codec.codec_in_use(cpu, 256))
        assert int8_codec.codec_in_use(cpu, over) == slow
        assert int8_codec.codec_in_use(cuda, 256) == 'torch ops'
    monkeypatch.setenv(int8_fused.ENV, '1')
    asked = 'MMCV_CUSTOM_INT8_FUSED=1 asked for the fused kernels, '
    assert re.fullmatch(
        c_kernel + '; ' + asked + 'which run on CUDA only: CPU buckets use '
        'the C kernel', int8_codec.codec_in_use(cpu, 256))
    assert int8_codec.codec_in_use(cpu, over) == (
        f"{slow}; {asked}which run on CUDA only: CPU buckets use torch's ops")
    assert int8_codec.codec_in_use(cuda, 256) == (
        'fused Triton kernels (MMCV_CUSTOM_INT8_FUSED=1)'
        if int8_fused.AVAILABLE else
        f"torch ops; {asked}but Triton is not installed: CUDA buckets use "
        "torch's ops")
    x = torch.randn(2 * over)
    for bad in ('yes', '2', 'true', ' 1'):
        monkeypatch.setenv(int8_fused.ENV, bad)
        message = ('MMCV_CUSTOM_INT8_FUSED should be 1 (the int8 codec in '
                   'fused Triton kernels, on CUDA) or 0 (not), but got '
                   f'{bad!r}')
        with pytest.raises(ValueError, match=re.escape(message)):
            int8_codec.codec_in_use(cpu, 256)
        # Where the fused kernels could be chosen (past the C kernel).
        with pytest.raises(ValueError, match=re.escape(message)):
            int8_codec.quantize(x, over)
