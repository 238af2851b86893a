"""A plugin hook in every analysis tool that takes hook names, written as a
user writes one (a module on ``PYTHONPATH`` that registers a bf16
all-reduce with a plain ``@COMM_HOOKS.register_module()``, no record) and
reached both ways: through a config's ``custom_imports`` and through
``--import MODULE``. The tools import it before they build their choices
(:mod:`mmcv_custom.analysis.plugins`): it is a choice, projected or
measured where that is possible and named as unknown where it is not; a
misspelled name or a module that does not import is a usage error.

The command lines run as a user runs them (a fresh interpreter) where the
output is the point; the argument checks run in this process, the plugin's
registration removed again after each test."""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest

from mmcv_custom.analysis.hook_forms import takes_topology
from mmcv_custom.analysis.plugins import PLUGIN_HINT
from mmcv_custom.comm.registry import COMM_HOOKS
from tests.test_analysis.test_benchmark_step_time import _report
from tests.tool_utils import load_script, usage_errors

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOLS = osp.join(ROOT, 'tools', 'analysis_tools')
FCN = osp.join(ROOT, 'configs', 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')
MODULE, HOOK = 'half_plugin_for_tools', 'plain_bf16_plugin'

PLUGIN = f'''"""bf16 all-reduce, registered with no record."""
import torch
import torch.distributed as dist

from mmcv_custom.comm import COMM_HOOKS


@COMM_HOOKS.register_module()
def {HOOK}(state, bucket):
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(sent, group=group, async_op=True).get_future()

    def done(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(done)
'''

#: What the cost model says of it.
UNKNOWN = (f'- not projected, its traffic unknown: {HOOK} (it has no '
           'record); give a hook a record with its cost where it is '
           'registered: @COMM_HOOKS.register_module(record=HookRecord(..., '
           'cost=CostRecord(...))) (docs/en/advanced_guides/own_hooks.md)')


def _config(folder, name, base, imports) -> str:
    path = osp.join(folder, name)
    with open(path, 'w') as f:
        f.write(f'_base_ = [{base!r}]\n'
                f'custom_imports = dict(imports={imports!r}, '
                'allow_failed_imports=False)\n'
                f'comm_hook = dict(type={HOOK!r})\n')
    return path


@pytest.fixture(scope='module')
def plugin(tmp_path_factory):
    """The plugin's folder, and configs that import it: the toy FCN's
    (``fcn``), the demo MLP's (``mlp``), and one whose custom_imports
    name a module that does not exist (``broken``)."""
    folder = str(tmp_path_factory.mktemp('plugin'))
    with open(osp.join(folder, f'{MODULE}.py'), 'w') as f:
        f.write(PLUGIN)
    with open(osp.join(folder, 'clashing_plugin.py'), 'w') as f:
        f.write('from mmcv_custom.comm import COMM_HOOKS\n\n\n'
                "@COMM_HOOKS.register_module(name='allreduce')\n"
                'def my_allreduce(state, bucket):\n'
                '    raise NotImplementedError\n')
    return dict(
        folder=folder,
        fcn=_config(folder, 'fcn_plugin.py', FCN,
                    ['mmcv_custom', 'mmcv_custom.datasets', MODULE]),
        mlp=_config(folder, 'mlp_plugin.py', MLP,
                    ['mmcv_custom', 'mmcv_custom.demo', MODULE]),
        broken=_config(folder, 'mlp_broken.py', MLP,
                       ['mmcv_custom', 'no_such_plugin_mod']))


@pytest.fixture
def here(plugin, monkeypatch):
    """The plugin's folder on this process's path, and every module and
    hook it registers gone again afterwards (the other tests read the
    registry)."""
    monkeypatch.syspath_prepend(plugin['folder'])
    yield plugin
    COMM_HOOKS.module_dict.pop(HOOK, None)
    for name in (MODULE, 'clashing_plugin', 'no_such_plugin_mod'):
        sys.modules.pop(name, None)
    takes_topology.cache_clear()


def _run(plugin, tool, *args, timeout=300):
    """``tool`` run as a user runs it, with the plugin on PYTHONPATH."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [plugin['folder'], ROOT,
             os.environ.get('PYTHONPATH', '')]))
    return subprocess.run(
        [sys.executable, osp.join(TOOLS, tool), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env)


def _parse(tool, monkeypatch, capsys):
    """The tool loaded here, and its usage errors read back."""
    script = load_script(osp.join(TOOLS, tool), tool[:-3].replace('.', '_'))
    return script, usage_errors(script, tool, monkeypatch, capsys)


def test_cost_model_projects_beside_a_plugin_named_unknown(plugin):
    # Through --import: allreduce projected, the plugin named as unknown
    # (it has no record, so no cost), with how to give it one.
    out = _run(plugin, 'comm_cost_model.py', '--config', MLP, '--import',
               MODULE, '--hooks', 'allreduce', HOOK, '--nodes', '2',
               '--gpus-per-node', '1', '--gbps', '100')
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert UNKNOWN in lines
    assert any(line.startswith('| allreduce | ') for line in lines)
    assert not any(line.startswith(f'| {HOOK}') for line in lines)


def test_cost_model_takes_a_plugin_from_the_configs_imports(
        here, tmp_path, capsys):
    # Only hooks without a cost: said so, and nothing to project.
    tool = load_script(osp.join(TOOLS, 'comm_cost_model.py'), 'cost_model')
    json_path = str(tmp_path / 'cost.json')
    tool.main(['--config', here['mlp'], '--hooks', HOOK, '--json', json_path])
    assert capsys.readouterr().out.splitlines() == [
        '## Projected step time per hook: mlp_plugin.py', '', UNKNOWN
    ]
    with open(json_path) as f:
        projection = json.load(f)['projection']
    assert projection['unknown'] == {HOOK: 'it has no record'}


def test_model_stats_says_a_plugins_bytes_are_unknown(plugin):
    out = _run(plugin, 'model_stats.py', plugin['mlp'], '--gpus', '2')
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert (f"with comm_hook    : unknown (type='{HOOK}': it has no record; "
            'register it with @COMM_HOOKS.register_module(record=HookRecord('
            '...)), see docs/en/advanced_guides/own_hooks.md)') in lines
    assert '  hook state      : unknown (the hook has no record)' in lines


def test_model_stats_counts_a_plugin_hook_given_by_import(
        here, monkeypatch, capsys):
    tool = load_script(osp.join(TOOLS, 'model_stats.py'), 'model_stats')
    monkeypatch.setattr(sys, 'argv', [
        'model_stats.py', MLP, '--import', MODULE, '--cfg-options',
        f'comm_hook.type={HOOK}', '--gpus', '2'
    ])
    tool.main()
    assert f"(type='{HOOK}': it has no record;" in capsys.readouterr().out


def test_step_time_and_convergence_take_a_plugin_both_ways(
        here, tmp_path, monkeypatch, capsys):
    step_time, _ = _parse('benchmark_step_time.py', monkeypatch, capsys)
    work_dir = ['--work-dir', str(tmp_path / 'nodes')]
    # The config's custom_imports: a choice, beside the baselines.
    args = step_time.parse_args([here['fcn'], '--hooks', HOOK, *work_dir])
    assert args.hooks == ['noop', 'allreduce', HOOK]
    assert args.imports == []
    # --import: every node imports it too (the spec carries it).
    args = step_time.parse_args(
        [FCN, '--import', MODULE, '--hooks', HOOK, *work_dir])
    assert args.imports == [MODULE]

    compare, _ = _parse('compare_comm_convergence.py', monkeypatch, capsys)
    from mmcv_custom.analysis.convergence_runs import train_options
    args = compare.parse_args([
        FCN, '--import', MODULE, '--variants', 'allreduce', HOOK, '--work-dir',
        str(tmp_path / 'runs')
    ])
    assert args.variants == ['allreduce', HOOK]
    # Every run imports it after the config's own custom_imports.
    options = train_options(args, HOOK)
    assert f'comm_hook.type={HOOK}' in options
    assert (f'custom_imports.imports=[mmcv_custom,mmcv_custom.datasets,'
            f'{MODULE}]') in options
    args = compare.parse_args([
        here['fcn'], '--variants', HOOK, '--work-dir',
        str(tmp_path / 'runs2')
    ])
    assert not any(
        o.startswith('custom_imports') for o in train_options(args, HOOK))


def test_step_time_report_leaves_an_uncounted_hooks_wire_unknown(tmp_path):
    # A hook without a record counts no bytes (0 from every rank): its wire
    # time and bounds are unknown, not 0; its step is reported.
    from mmcv_custom.analysis import step_time_report as st
    buckets = [
        dict(index=i, bytes=10**6, ready_s=0.01 * (i + 1)) for i in range(3)
    ]
    steps = {
        'unshaped': dict(noop=[0.1], allreduce=[0.11], **{HOOK: [0.12]}),
        '80 Mbit/s': dict(noop=[0.1], allreduce=[0.41], **{HOOK: [0.25]}),
    }
    rank = dict(
        steps=steps,
        wire_bytes=dict(noop=0, allreduce=3 * 10**6, **{HOOK: 0}),
        backward_s=0.04,
        buckets=buckets,
        codec_s=dict(noop=None, allreduce=None, **{HOOK: None}),
        grad_bytes=3 * 10**6)
    rows = st.summarize(
        [dict(rank, rank=0), dict(rank, rank=1)], [80.0, None],
        ['noop', 'allreduce', HOOK], 2)
    by = {(r['rate'], r['hook']): r for r in rows}
    ours = by['80 Mbit/s', HOOK]
    assert ours['sent_bytes'] is None
    assert 'wire_s' not in ours and 'bound_s' not in ours
    assert ours['exposed_s'] == pytest.approx(0.13)
    assert by['80 Mbit/s', 'allreduce']['wire_s'] == pytest.approx(0.3)
    table = _report(rows)
    row = f'| 80 Mbit/s | {HOOK} | 0.250 | 0.61 | 0.130 | - | - | - | - | — |'
    assert row in table
    st.plot(rows, str(tmp_path / 'step.png'))  # no bound line for it
    assert osp.getsize(tmp_path / 'step.png') > 0


def test_convergence_table_says_an_uncounted_comm_ratio_is_unknown():
    # A run logs comm_ratio as NaN where its hook counts no bytes.
    from mmcv_custom.analysis.convergence import format_table
    row = dict(
        variant=HOOK,
        mIoU=20.79,
        delta_mIoU=0.0,
        comm_ratio=float('nan'),
        final_loss=1.2596)
    assert format_table([
        row
    ]).splitlines()[-1] == (f'| `{HOOK}` | 20.79 | +0.00 | unknown | 1.2596 |')


@pytest.mark.parametrize('tool, before',
                         [('comm_cost_model.py', ['--config', MLP]),
                          ('benchmark_step_time.py', [FCN]),
                          ('benchmark_comm_hooks.py', []),
                          ('compare_comm_convergence.py', [FCN]),
                          ('model_stats.py', [MLP])])
def test_an_import_that_fails_is_a_usage_error_naming_it(
        here, tool, before, monkeypatch, capsys):
    _, parse = _parse(tool, monkeypatch, capsys)
    assert parse([
        *before, '--import', 'no_such_plugin_mod'
    ]) == (2, f'{tool}: error: --import no_such_plugin_mod: cannot import it '
           "(No module named 'no_such_plugin_mod')")


def test_misspelled_hooks_and_broken_plugins_are_usage_errors(
        here, monkeypatch, capsys):
    _, parse = _parse('comm_cost_model.py', monkeypatch, capsys)
    code, line = parse(
        ['--config', MLP, '--import', MODULE, '--hooks', 'plain_bf61'])
    assert code == 2
    assert line.startswith("comm_cost_model.py: error: argument --hooks: "
                           "invalid choice: 'plain_bf61' (choose from "
                           "'allreduce', ")
    assert line.endswith(f"'{HOOK}')" + PLUGIN_HINT)
    # A name not imported says how a plugin's hook becomes a choice.
    assert PLUGIN_HINT == ("; a plugin's hook is a choice once its module "
                           "is imported: --import MODULE, or the config's "
                           'custom_imports')
    # A config whose custom_imports fail: that, not "invalid choice".
    assert parse([
        '--config', here['broken'], '--hooks', HOOK
    ]) == (2, f"comm_cost_model.py: error: --config {here['broken']}: its "
           "custom_imports cannot be imported (No module named "
           "'no_such_plugin_mod')")
    # A plugin that fails as it runs: its error, named.
    code, line = parse(['--import', 'clashing_plugin'])
    assert code == 2
    assert line.startswith("comm_cost_model.py: error: --import "
                           "clashing_plugin: cannot import it (KeyError: "
                           "comm hook name 'allreduce' is the built-in hook")

    _, parse = _parse('benchmark_step_time.py', monkeypatch, capsys)
    code, line = parse([FCN, '--import', MODULE, '--hooks', 'plain_bf61'])
    assert code == 2
    assert "invalid choice: 'plain_bf61'" in line
    assert f"'{HOOK}'" in line


@pytest.mark.slow
def test_benchmark_comm_hooks_times_and_counts_a_plugin_without_record(plugin):
    out = _run(plugin, 'benchmark_comm_hooks.py', '--nproc', '2', '--sizes-mb',
               '0.01', '--repeat', '1', '--warmup', '1', '--import', MODULE)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        cells[1]: cells
        for cells in (line.split(' | ') for line in out.stdout.splitlines())
        if len(cells) == 7
    }
    ours, fp32 = rows[f'`{HOOK}_hook`'], rows['`allreduce_hook`']
    # Its bytes, counted from its collectives: bf16, half of fp32's.
    assert float(ours[5]) == pytest.approx(float(fp32[5]) / 2, rel=1e-3)
