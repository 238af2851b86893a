"""tools/analysis_tools/compare_comm_convergence.py: its argument checks
(usage errors before any run starts) and, end to end, real 2-rank runs of
the toy FCN read back from their own scalars.json."""
import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest

from mmcv_custom.analysis import convergence
from mmcv_custom.analysis.convergence_runs import TrainLog, train_options
from mmcv_custom.analysis.registered import DEFAULT_COLOURS
from mmcv_custom.comm.records import record_of
from mmcv_custom.comm.registry import COMM_HOOKS
from mmcv_custom.launching.ports import free_port
from tests.tool_utils import load_script, plugin_hook, usage_errors

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'analysis_tools', 'compare_comm_convergence.py')
FCN = osp.join(ROOT, 'configs', 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
# Four iterations and one validation: the shortest run that still logs a
# loss curve (two points) and an mIoU.
SHORT = ['--max-iters', '4', '--log-interval', '2']
# Every registered hook's variants, as the tool reads them.
VALID = tuple(convergence.variants())


def _tool(*args, timeout=300, env=None):
    # From the repository root, where the toy data already lies; everything
    # the tool writes goes to the tmp paths the tests name.
    return subprocess.run([sys.executable, TOOL, *args],
                          capture_output=True,
                          text=True,
                          timeout=timeout,
                          cwd=ROOT,
                          env=env)


def _usage_error(out, *words):
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith('usage:'), out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


def test_unknown_variant_names_it_and_the_valid_ones(tmp_path):
    out = _tool(FCN, '--variants', 'allreduce', 'int4_ef', '--work-dir',
                str(tmp_path))
    _usage_error(out, "'int4_ef'", *(f"'{v}'" for v in VALID))
    assert not os.listdir(tmp_path)  # nothing trained


def test_bad_arguments_are_usage_errors(tool, tmp_path, monkeypatch, capsys):
    # One case through the command line (the usage line, exit code 2) ...
    missing = str(tmp_path / 'nope.py')
    _usage_error(_tool(missing), missing, 'no such file')
    # ... the rest through the tool's own parse_args, in this process.
    parse = usage_errors(tool, TOOL, monkeypatch, capsys)

    def _refused(args, *words):
        code, last = parse(args)
        assert code == 2, last
        for word in words:
            assert word in last, last

    _refused(
        [FCN, '--variants', 'int8_ef', 'int8_ef', '--work-dir',
         str(tmp_path)], 'twice')
    _refused(
        [FCN, '--variants', 'all', 'allreduce', '--work-dir',
         str(tmp_path)],
        '--variants all stands alone: it trains every variant')
    # Alone, every variant the records name, in their order; on one node
    # (the default) but the periodic ones, said in one line.
    known = convergence.variants()
    periodic = [v for v in known.values() if v.periodic]
    assert [v.hook_type
            for v in periodic] == ['post_local_sgd'] * 3 + ['diloco'] * 3
    assert tool.parse_args([
        FCN, '--variants', 'all', '--work-dir',
        str(tmp_path)
    ]).variants == [v.name for v in known.values() if not v.periodic]
    assert capsys.readouterr().err.splitlines() == [
        '--variants all on one node leaves out post_local_sgd_p5, '
        'post_local_sgd_p25, post_local_sgd_p100, diloco_h5, diloco_h25, '
        'diloco_h100: they synchronise across nodes (train them with '
        '--ranks-per-node 1)'
    ]
    assert tool.parse_args([
        FCN, '--variants', 'all', '--nproc', '2', '--ranks-per-node', '1',
        '--work-dir',
        str(tmp_path)
    ]).variants == list(known)
    assert capsys.readouterr().err == ''
    # Named on one node: refused, with the way to several.
    assert parse([
        FCN, '--variants', 'allreduce', 'diloco_h25', '--work-dir',
        str(tmp_path)
    ]) == (2, 'compare_comm_convergence.py: error: --variants diloco_h25 '
           'synchronises across nodes, but the --nproc ranks are one node: '
           'give --ranks-per-node below --nproc (e.g. --ranks-per-node 1)')
    assert parse([
        FCN, '--variants', 'post_local_sgd_p5', 'diloco_h100', '--nproc', '1',
        '--work-dir',
        str(tmp_path)
    ]) == (2, 'compare_comm_convergence.py: error: --variants '
           'post_local_sgd_p5 diloco_h100 synchronise across nodes, but the '
           '--nproc ranks are one node: give --ranks-per-node below --nproc '
           '(e.g. --nproc 2 --ranks-per-node 1)')
    # Read back, not trained: not refused for the nodes (the folder is
    # looked for).
    _refused([FCN, '--from-work-dirs', f'diloco_h25={tmp_path}'],
             str(tmp_path), 'scalars.json')
    _refused([FCN, '--block-size', '0', '--work-dir',
              str(tmp_path)], '--block-size should be at least 1, but got 0')
    _refused([
        FCN, '--nproc', '4', '--ranks-per-node', '3', '--work-dir',
        str(tmp_path)
    ], '--ranks-per-node should divide --nproc (4) into whole nodes (a '
             'divisor from 1 to 4), but got 3')
    # What numpy's generator takes, which every run seeds.
    _refused(
        [FCN, '--seed', str(2**32), '--work-dir',
         str(tmp_path)],
        '--seed should be an int from 0 to 4294967295, but got '
        '4294967296')
    _refused([
        FCN, '--cfg-options', 'comm_hook.block_size=8', '--work-dir',
        str(tmp_path)
    ], 'comm_hook.block_size=8', '--variants')
    _refused([
        FCN, '--variants', 'int8_ef', '--cfg-options',
        'comm_hook.error_feedback=False', '--work-dir',
        str(tmp_path)
    ], 'comm_hook.error_feedback=False: comm_hook is set by the tool')
    plot = str(tmp_path / 'no_such_dir' / 'c.png')
    _refused([FCN, '--plot', plot, '--work-dir',
              str(tmp_path)], plot, 'cannot write there')
    _refused([FCN, '--json',
              str(tmp_path), '--work-dir',
              str(tmp_path)], 'is a directory')
    # --from-work-dirs: a variant name checked as for --variants, and a
    # folder without a run is named.
    _refused([FCN, '--from-work-dirs', f'int4={tmp_path}'], "'int4'",
             *(v for v in VALID))
    _refused([FCN, '--from-work-dirs', f'int8_ef={tmp_path}'], str(tmp_path),
             'scalars.json')
    _refused([FCN, '--from-work-dirs', str(tmp_path)], 'VARIANT=DIR')
    assert sorted(os.listdir(tmp_path)) == []
    # Never over the runs of an earlier comparison: read, not retrained.
    earlier = tmp_path / 'earlier'
    os.makedirs(earlier / 'int8_ef')
    (earlier / 'int8_ef' / 'iter_600.pth').write_bytes(b'')
    _refused([FCN, '--work-dir', str(earlier)],
             f'--work-dir {earlier} holds the runs of an earlier comparison '
             '(int8_ef/iter_600.pth): read them with --from-work-dirs, or '
             'choose another --work-dir')
    # A key no variant sets goes to every run (int8's residual_dtype under
    # hybrid sharding).
    assert tool.parse_args([
        FCN, '--variants', 'int8_ef', '--cfg-options',
        'comm_hook.residual_dtype=bfloat16', 'strategy.sharding=hybrid',
        '--work-dir',
        str(tmp_path / 'runs')
    ]).cfg_options[0] == 'comm_hook.residual_dtype=bfloat16'


@pytest.fixture(scope='module')
def tool():
    return load_script(TOOL, '_compare_comm_convergence')


@pytest.mark.parametrize('value', ['0', '-5', 'ten', '2.5'])
def test_max_iters_must_be_a_positive_int(tool, value, tmp_path, monkeypatch,
                                          capsys):
    parse = usage_errors(tool, TOOL, monkeypatch, capsys)
    assert parse([FCN, '--max-iters', value, '--work-dir',
                  str(tmp_path)
                  ]) == (2, 'compare_comm_convergence.py: error: argument '
                         f"--max-iters: '{value}' is not an int >= 1")


@pytest.mark.parametrize('extra,message', [
    (['--cfg-options', 'train_cfg.max_iters=8'
      ], '--cfg-options train_cfg.max_iters=8: give the length once, as '
     '--max-iters or in --cfg-options'),
    (['--from-work-dirs'
      ], '--max-iters sets how long runs train, but --from-work-dirs trains '
     'none'),
])
def test_max_iters_conflicts_are_usage_errors(tool, extra, message, tmp_path,
                                              monkeypatch, capsys):
    parse = usage_errors(tool, TOOL, monkeypatch, capsys)
    assert parse(
        [FCN, '--max-iters', '8', '--work-dir',
         str(tmp_path),
         *extra]) == (2, f'compare_comm_convergence.py: error: {message}')


def test_max_iters_shortens_every_run(tool, tmp_path):
    # The FCN config: 600 iterations, validation at 600, checkpoints every
    # 200, loss logged every 50.
    args = tool.parse_args(
        [FCN, '--max-iters', '100', '--work-dir',
         str(tmp_path)])
    options = train_options(args, 'int8_ef')
    assert options == [
        'comm_hook.type=int8_compress', 'comm_hook.block_size=256',
        'comm_hook.error_feedback=True', 'default_hooks.logger.interval=10',
        'train_cfg.max_iters=100', 'train_cfg.val_interval=100',
        'default_hooks.checkpoint.interval=100'
    ]
    # Intervals already shorter stay; a short run logs at least twice;
    # the user's own options come last and win.
    args = tool.parse_args([
        FCN, '--max-iters', '300', '--work-dir',
        str(tmp_path), '--cfg-options', 'train_cfg.val_interval=50'
    ])
    assert train_options(args, 'allreduce') == [
        'comm_hook.type=allreduce', 'default_hooks.logger.interval=10',
        'train_cfg.max_iters=300', 'train_cfg.val_interval=300',
        'train_cfg.val_interval=50'
    ]
    args = tool.parse_args(
        [FCN, '--max-iters', '6', '--work-dir',
         str(tmp_path)])
    assert 'default_hooks.logger.interval=3' in train_options(
        args, 'allreduce')
    # Without it, the config's length.
    args = tool.parse_args([FCN, '--work-dir', str(tmp_path)])
    assert not any('max_iters' in o for o in train_options(args, 'allreduce'))


def test_the_variants_are_every_registered_hook_from_its_record():
    variants = convergence.variants()
    # Every registered hook, in the registry's order: each setting its
    # record names, else one named as registered, with the record's
    # label (else its name) and colour (else one of the defaults).
    expected = []
    for name, hook in COMM_HOOKS.module_dict.items():
        record = record_of(hook)
        expected += [(v.name, name, v.label, v.colour) for v in record.variants
                     ] or [(name, name, record.label or name, record.colour)]
    got = [(v.name, v.hook_type, v.label, v.colour) for v in variants.values()]
    assert len(got) == len(expected)
    for (name, hook_type, label, colour), want in zip(got, expected):
        assert (name, hook_type, label) == want[:3]
        assert colour == want[3] or (want[3] is None
                                     and colour in DEFAULT_COLOURS), name
    # Today's hooks among them, in their order, labels and colours as
    # before they were read from the records.
    assert [(v.name, v.label, v.colour) for v in variants.values()
            if v.name in ('allreduce', 'fp16_compress', 'bf16_compress',
                          'int8_ef', 'int8_noef')] == [
                              ('allreduce', 'fp32 all-reduce', 'black'),
                              ('fp16_compress', 'fp16', 'tab:green'),
                              ('bf16_compress', 'bf16', 'tab:purple'),
                              ('int8_ef', 'int8 + error feedback', 'tab:blue'),
                              ('int8_noef', 'int8, no error feedback',
                               'tab:red'),
                          ]
    # The periodic hooks every 5, 25 and 100 steps, in colours of their
    # own; their accuracy class is the record's.
    builtin = {
        v.colour
        for v in variants.values() if not v.periodic and v.hook_type in (
            'allreduce', 'fp16_compress', 'bf16_compress', 'powerSGD',
            'batched_powerSGD', 'int8_compress')
    }
    for name, period in (('post_local_sgd', 'p'), ('diloco', 'h')):
        record = record_of(COMM_HOOKS.get(name))
        assert [(v.name, v.options, v.accuracy) for v in record.variants] == [
            (f'{name}_{period}{n}', dict(period=n), None) for n in (5, 25, 100)
        ]
        assert all(variants[v.name].periodic for v in record.variants)
    assert [variants[f'post_local_sgd_p{n}'].label for n in (5, 25, 100)] == [
        'post-local SGD, period 5', 'post-local SGD, period 25',
        'post-local SGD, period 100'
    ]
    assert [variants[f'diloco_h{n}'].label for n in (5, 25, 100)
            ] == ['DiLoCo, H=5', 'DiLoCo, H=25', 'DiLoCo, H=100']
    colours = [v.colour for v in variants.values() if v.periodic]
    assert len(set(colours)) == 6 and not set(colours) & builtin
    # Its period as a key (no --block-size: its block is its outer int8's,
    # which an fp32 outer format refuses), and a nested setting (the inner
    # exchange) as dotted keys, which --cfg-options merges into the
    # config's dict.
    assert convergence.hook_options(variants['diloco_h25'], 64) == [
        'comm_hook.type=diloco', 'comm_hook.period=25'
    ]
    nested = variants['post_local_sgd_p25']._replace(
        options=dict(
            period=25, inner=dict(type='int8_compress', error_feedback=False)))
    assert convergence.hook_options(nested, 256) == [
        'comm_hook.type=post_local_sgd', 'comm_hook.period=25',
        'comm_hook.inner.type=int8_compress',
        'comm_hook.inner.error_feedback=False'
    ]
    # PowerSGD trains as its record asks: compressing from step 2.
    assert convergence.hook_options(variants['powerSGD'], 256) == [
        'comm_hook.type=powerSGD', 'comm_hook.matrix_approximation_rank=4',
        'comm_hook.start_powerSGD_iter=2'
    ]
    # A run without its setting spelled out has its state's default.
    assert convergence.mismatch(variants['int8_ef'],
                                dict(type='int8_compress')) is None
    assert convergence.mismatch(
        variants['int8_ef'],
        dict(type='int8_compress', error_feedback=False)) == (
            "'int8_ef' should have error_feedback=True, but the run used "
            'False')


def test_a_dumped_nested_comm_hook_is_read_back(tmp_path):
    """A periodic hook's config nests its inner exchange; MMEngine dumps
    it as ``inner=dict(...)``, which is read back (not executed), and
    checked against the variant."""
    from mmengine.config import Config
    run = tmp_path / 'diloco_h25' / '20261207_000000'
    os.makedirs(run / 'vis_data')
    hook = dict(
        type='diloco',
        period=25,
        block_size=256,
        inner=dict(type='int8_compress', error_feedback=True),
        topology=dict(ranks_per_node=1))
    Config(dict(comm_hook=hook,
                steps=[dict(a=1),
                       (2, 3)])).dump(str(run / 'vis_data' / 'config.py'))
    assert 'inner=dict(' in (run / 'vis_data' / 'config.py').read_text()
    assert convergence.read_comm_hook(str(run)) == hook
    variants = convergence.variants()
    assert convergence.mismatch(variants['diloco_h25'], hook) is None
    assert convergence.mismatch(
        variants['diloco_h5'],
        hook) == ("'diloco_h5' should have period=5, but the run used 25")
    # A call that is not dict(...) is not read: no hook rather than code.
    (run / 'vis_data' / 'config.py'
     ).write_text("comm_hook = dict(type='diloco', inner=open('x'))\n")
    assert convergence.read_comm_hook(str(run)) is None


def test_a_plugin_hook_is_a_variant_with_its_record_label(
        tool, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, 'argv', [TOOL])
    with plugin_hook() as (name, record):
        [variant] = [
            v for v in convergence.variants().values() if v.hook_type == name
        ]
        assert (variant.name, variant.label,
                variant.colour) == ('int4_plugin', record.label, record.colour)
        args = tool.parse_args(
            [FCN, '--variants', 'int4_plugin', '--work-dir',
             str(tmp_path)])
        assert train_options(args,
                             'int4_plugin')[0] == (f'comm_hook.type={name}')
    # Registered without a record: its name as label, a default colour.
    COMM_HOOKS.register_module(name='plugin_bare', module=lambda s, b: None)
    try:
        bare = convergence.variants()['plugin_bare']
        assert bare.label == 'plugin_bare'
        assert bare.colour in DEFAULT_COLOURS
    finally:
        del COMM_HOOKS.module_dict['plugin_bare']


def test_train_log_reads_the_iterations_as_the_run_writes_them(tmp_path):
    log = tmp_path / 'dist_train.log'
    watch = TrainLog(str(log))
    assert watch.poll() is None  # no file yet
    with open(log, 'w') as f:
        f.write('12/04 13:55:15 - mmengine - INFO - Checkpoints will be '
                'saved to ...\n')
        f.write('12/04 13:55:20 - mmengine - INFO - Iter(train) [ 10/600]'
                '  base_lr: 3.0e-03 lr: 3.0e-03  eta: 0:04:01  time: 0.40'
                '  data_time: 0.01  memory: 0  loss: 0.9121  decode.loss_ce:'
                ' 0.9121  comm_MB: 1.8\n')
        f.write('12/04 13:55:24 - mmengine - INFO - Iter(train) [ 20/600]'
                '  loss: 0.7')  # not yet a whole line
        f.flush()
        assert watch.poll() == (10, 600, 0.9121)
        assert watch.poll() is None  # nothing new
        f.write('017\n12/04 - Iter(val) [5/10]  eta: 0:00:01\n')
        f.flush()
        assert watch.poll() == (20, 600, 0.7017)


def _scalars(run_dir):
    """Every JSON line of the one run under ``run_dir``, parsed here
    independently of the tool."""
    [stamp] = [d for d in os.listdir(run_dir) if d.startswith('2')]
    with open(osp.join(run_dir, stamp, 'vis_data', 'scalars.json')) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_trains_each_variant_then_rereads_the_runs(tmp_path):
    work = tmp_path / 'runs'
    # Both runs on the PORT given, one after the other, as dist_train.sh.
    port = free_port()
    out = _tool(
        FCN,
        '--variants',
        'allreduce',
        'int8_noef',
        '--block-size',
        '64',
        '--work-dir',
        str(work),
        *SHORT,
        env=dict(os.environ, PORT=port))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    # On stderr, while it trains: each run's start, its iterations (from
    # its log: done of total, loss, ETA) and its end; the table on stdout.
    assert f'[allreduce] run 1/2 starts: PORT={port} ' in out.stderr
    assert f'[int8_noef] run 2/2 starts: PORT={port} ' in out.stderr
    assert re.search(
        r'^\[int8_noef\] \[4/4\] loss [\d.]+, done in '
        r'\d:\d\d:\d\d$', out.stderr, re.M), out.stderr
    assert re.search(r'^1 run\(s\) left, ETA \d:\d\d:\d\d$', out.stderr, re.M)
    assert '[int8_noef] run 2/2 done in ' in out.stderr
    assert '[allreduce]' not in out.stdout
    lines = out.stdout.splitlines()
    header = lines.index('| variant | final mIoU | vs fp32 (points) | '
                         'comm_ratio | final loss (smoothed) |')
    rows = [r.split(' | ') for r in lines[header + 2:header + 4]]
    assert [r[0] for r in rows] == ['| `allreduce`', '| `int8_noef`']
    assert rows[0][2] == '+0.00'
    # The hooks really differ: int8 sends about a quarter of fp32's bytes.
    assert float(rows[0][3]) == 1.0 and 0.25 < float(rows[1][3]) < 0.35
    assert (work / 'convergence.png').stat().st_size > 10_000
    summary = json.load(open(work / 'summary.json'))
    for variant in ('allreduce', 'int8_noef'):
        scalars = _scalars(work / variant)
        losses = [s for s in scalars if 'loss' in s]
        [val] = [s for s in scalars if 'mIoU' in s]
        run = summary['runs'][variant]
        assert run['iters'] == [2, 4]
        assert run['loss'] == [s['loss'] for s in losses]
        assert run['val'][-1]['mIoU'] == val['mIoU']
    assert summary['runs']['int8_noef']['comm_hook'] == dict(
        type='int8_compress', block_size=64, error_feedback=False)
    by = {r['variant']: r for r in summary['rows']}
    assert by['int8_noef']['delta_mIoU'] == pytest.approx(
        by['int8_noef']['mIoU'] - by['allreduce']['mIoU'])

    # Read back only, from named folders; a run under the wrong name is
    # flagged from its own config dump.
    again = _tool(FCN, '--from-work-dirs', f"allreduce={work / 'allreduce'}",
                  f"int8_ef={work / 'int8_noef'}", '--json',
                  str(tmp_path / 'again.json'), '--plot',
                  str(tmp_path / 'again.png'))
    assert again.returncode == 0, again.stderr[-3000:]
    assert ("'int8_ef' should have error_feedback=True, but the run used "
            'False') in again.stderr
    assert 'int8_ef within 1 mIoU point(s) of fp32 all-reduce:' in \
        again.stdout
    reread = json.load(open(tmp_path / 'again.json'))
    assert reread['runs']['allreduce']['loss'] == \
        summary['runs']['allreduce']['loss']
    assert (tmp_path / 'again.png').is_file()


@pytest.mark.slow
def test_a_failed_run_is_named_with_its_log(tmp_path):
    # AdamW refuses a negative learning rate when the runner builds it.
    out = _tool(FCN, '--variants', 'int8_ef', '--work-dir', str(tmp_path),
                *SHORT, '--cfg-options', 'optim_wrapper.optimizer.lr=-1')
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    log = str(tmp_path / 'int8_ef' / 'dist_train.log')
    assert f'int8_ef: training failed; log: {log}' in out.stderr
    assert 'Invalid learning rate' in open(log).read()
    # The report is still written, with the failed variant's row empty.
    summary = json.load(open(tmp_path / 'summary.json'))
    assert summary['failed'] == ['int8_ef']
    assert summary['rows'][0]['mIoU'] is None
