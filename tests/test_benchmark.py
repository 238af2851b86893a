"""tools/benchmark_comm_hooks.py end to end, in a small configuration."""
import json
import os.path as osp
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


@pytest.mark.slow
def test_benchmark_runs_and_reports_half_the_bytes(tmp_path):
    out = subprocess.run([
        sys.executable,
        osp.join(ROOT, 'tools', 'benchmark_comm_hooks.py'), '--nproc', '2',
        '--sizes-mb', '0.25', '1', '--repeat', '2', '--warmup', '1',
        '--json', str(tmp_path / 'b.json'), '--plot', str(tmp_path / 'b.png')
    ], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'wire bytes fp16/bf16 = 0.5 x fp32: PASS' in out.stdout
    assert 'CPU casts: C kernel (' in out.stdout
    data = json.load(open(tmp_path / 'b.json'))
    assert data['world_size'] == 2 and data['backend'] == 'gloo'
    assert [e['size_mb'] for e in data['results']] == [0.25, 1]
    for entry in data['results']:
        fp32 = entry['numel'] * 4
        hooks = entry['hooks']
        # Measured from the profiler's record of each all_reduce.
        assert hooks['ours.allreduce_hook']['wire_bytes'] == fp32
        assert hooks['ours.fp16_compress_hook']['wire_bytes'] == fp32 // 2
        assert hooks['ours.bf16_compress_hook']['wire_bytes'] == fp32 // 2
        assert hooks['noop']['wire_bytes'] == 0
        # Errors within each format's rounding of the exact mean.
        assert hooks['ours.allreduce_hook']['rel_error'] < 1e-6
        assert hooks['ours.fp16_compress_hook']['rel_error'] < 2**-10
        assert hooks['ours.bf16_compress_hook']['rel_error'] < 2**-7
        assert set(entry['codec_s']) == {
            'copy_fp32', 'ours.fp16', 'torch.fp16', 'ours.bf16',
            'torch.bf16'
        }
    assert (tmp_path / 'b.png').stat().st_size > 10000
