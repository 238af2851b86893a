"""tools/analysis_tools/benchmark_periodic.py: its hook settings, run
lengths and verdicts (:mod:`mmcv_custom.analysis.periodic_bench`), its
usage errors, and (slow) one real run on two emulated nodes."""
import json
import os
import subprocess
import sys

import pytest

from mmcv_custom.analysis import periodic_bench as pb
from mmcv_custom.launching import emulated_cluster
from tests.tool_utils import load_script, netns_names, usage_errors

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, 'tools', 'analysis_tools', 'benchmark_periodic.py')
bench = load_script(TOOL, 'benchmark_periodic')

_REASON = emulated_cluster.check_available()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


def test_a_setting_reads_literals_bare_words_and_dotted_keys():
    s = pb.parse_hook_setting(
        'diloco:period=25,outer_format=bf16,outer_lr=0.5,'
        'inner.type=bf16_compress')
    assert s.hook_type == 'diloco' and s.periodic and s.period == 25
    assert s.options == dict(
        period=25,
        outer_format='bf16',
        outer_lr=0.5,
        inner=dict(type='bf16_compress'))
    flat = pb.parse_hook_setting('int8_compress')
    assert (flat.periodic, flat.period, flat.options) == (False, 1, {})


def test_runs_are_whole_periods_after_start_iter():
    local = pb.parse_hook_setting('post_local_sgd:period=25,start_iter=10')
    # Logged every gcd(25, 10) = 5 iterations, so that a window ends at
    # start_iter + k * period; the first period after start_iter is
    # warm-up.
    assert pb.run_plan(local, (2, 6), 4) == pb.RunPlan(5, 35, 60, 160)
    step = pb.parse_hook_setting('allreduce')
    assert pb.run_plan(step, (2, 4), 3) == pb.RunPlan(3, 3, 6, 12)


def test_the_average_is_over_whole_windows_after_the_warm_up():
    plan = pb.RunPlan(interval=5, warmup=5, n1=10, n2=20)
    # The first window (DDP's first step) is left out.
    times = {5: 9.0, 10: 1.0, 15: 2.0, 20: 3.0}
    assert pb._average(times, plan, 20) == pytest.approx(2.0)
    with pytest.raises(
            RuntimeError,
            match=r'the log lacks the time at iterations \[15\]'):
        pb._average({5: 9.0, 10: 1.0, 20: 3.0}, plan, 20)


def _row(hook, rate, step, payload, periodic=False, period=1):
    return dict(
        hook=hook,
        type=hook.split(':')[0],
        rate=rate,
        step_s=step,
        link_payload_bytes=[payload, payload],
        periodic=periodic,
        period=period)


def test_ratios_and_verdicts_against_allreduce():
    rows = pb.summarize([
        _row('allreduce', 'unshaped', 0.2, 1200),
        _row('allreduce', '25 Mbit/s', 1.2, 1200),
        _row('diloco:period=25', '25 Mbit/s', 0.24, 99, True, 25),
        _row('post_local_sgd:period=25', '25 Mbit/s', 0.3, 49, True, 25),
    ])
    assert [r['x_unshaped'] for r in rows] == pytest.approx([1, 6, 1.2, 1.5])
    assert rows[0]['verdict'] is None  # not a periodic hook
    assert rows[2]['verdict'] == (
        "bytes 0.0825 x allreduce's <= 0.0833: PASS; average step 1.20 x "
        'unshaped allreduce <= 1.25: PASS')
    assert rows[3]['verdict'] == (
        "bytes 0.0408 x allreduce's > 0.0400: FAIL; average step 1.50 x "
        'unshaped allreduce > 1.25: FAIL')


@pytest.mark.parametrize('args,message', [
    (['--hooks', 'diloco'], "argument --hooks: 'diloco': comm_hook type "
     "'diloco' needs period: the optimizer steps between "
     'synchronisations across nodes, an int >= 1 (e.g. period=25)'),
    (['--hooks', 'diloco:period=0'
      ], "argument --hooks: 'diloco:period=0': comm_hook diloco: period "
     'should be an int >= 1, but got 0'),
    (['--hooks', 'diloco:period'
      ], "argument --hooks: 'diloco:period': 'period' is not KEY=VALUE; "
     'give NAME or NAME:KEY=VALUE[,KEY=VALUE...], e.g. diloco:period=25 '
     'or post_local_sgd:period=25,inner.type=bf16_compress'),
    (['--hooks', 'int8_compress:'], "argument --hooks: 'int8_compress:' "
     'should be NAME or NAME:KEY=VALUE'),
    (['--hooks', 'allreduce:period=3'
      ], "argument --hooks: 'allreduce:period=3': comm_hook type "
     "'allreduce' takes no arguments besides type and wrapper, but got "
     "['period']"),
    (['--hooks', 'fp8'], "argument --hooks: 'fp8': comm_hook type 'fp8' "
     'is not in the mmcv_custom::DDP communication hook registry'),
    (['--hooks', 'auto'], "argument --hooks: 'auto' picks a hook by "
     'timing the candidates during the run; name the hooks to compare'),
    (['--hooks', 'diloco:period=5', 'diloco:period=5'
      ], '--hooks repeats a setting: diloco:period=5 diloco:period=5'),
    (['--lengths', '1', '3'], '--lengths should be A B with 2 <= A < B '
     '(the first period is warm-up), but got 1 3'),
    (['--rates', '5', '5'], '--rates repeats a rate: 5 Mbit/s 5 Mbit/s'),
    (['--rates', '1e-9'], "argument --rates: '1e-9' is not a rate: give "
     'Mbit/s from 0.002 to 600000'),
    (['--window', '0'], "argument --window: '0' is not an int >= 1"),
    (['--nodes', '1'], '--nodes should be an int from 2 to'),
])
def test_usage_errors_before_any_node_starts(args, message, monkeypatch,
                                             capsys):
    monkeypatch.chdir(ROOT)
    code, last = usage_errors(bench, TOOL, monkeypatch, capsys)(args)
    assert code == 2
    assert last.startswith('benchmark_periodic: error: ')
    assert message in last


@pytest.mark.slow
@needs_netns
def test_a_real_run_measures_bytes_as_the_model_says(tmp_path):
    """Two emulated nodes, unshaped: allreduce (added by the tool) and
    diloco with a period of 2, each trained twice. The counters' payload
    per step is the model's within 3% (the buffers' averaging and
    gloo's small messages aside), diloco's a fraction of allreduce's, and
    no namespace outlives the tool."""
    before = netns_names()
    out = tmp_path / 'p.json'
    done = subprocess.run([
        sys.executable, TOOL, '--hooks', 'diloco:period=2', '--rates',
        'unshaped', '--lengths', '2', '3', '--window', '2', '--work-dir',
        str(tmp_path / 'runs'), '--json',
        str(out)
    ],
                          cwd=ROOT,
                          capture_output=True,
                          text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert netns_names() <= before
    rows = {r['hook']: r for r in json.loads(out.read_text())['rows']}
    assert set(rows) == {'allreduce', 'diloco:period=2'}
    for row in rows.values():
        assert max(row['link_payload_bytes']) == pytest.approx(
            row['model_bytes'], rel=0.03)
        assert row['step_s'] > 0
    assert rows['allreduce']['x_unshaped'] == 1
    assert rows['diloco:period=2']['x_bytes'] < 1 / 2
    assert '| unshaped | diloco:period=2 | 4/6 |' in done.stdout
