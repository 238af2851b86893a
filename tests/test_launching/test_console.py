"""The tools' console (``mmcv_custom.launching.console``, the launchers and
``mmcv_custom/launching/torchrun.py``): a header, the progress and a summary on
the console, everything in the log file, one report of a failure, usage errors
of the shell launchers. Pieces on real MMEngine loggers; end to end through
``tools/dist_train.sh`` on 2 gloo ranks."""
import logging
import os
import os.path as osp
import re
import subprocess
import sys
import uuid
import warnings

import pytest
from mmengine.logging import MMLogger

from mmcv_custom.launching.console import FILE_ONLY, ConsoleFilter, ToolConsole
from mmcv_custom.launching.ports import free_port
from mmcv_custom.launching.torchrun import first_failure, format_report
from tests.tool_utils import toy_set

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOLS = osp.join(ROOT, 'tools')
FCN = osp.join(ROOT, 'configs', 'fcn',
               'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')
MLP = osp.join(ROOT, 'configs', 'demo', 'mlp_2xb32-300iter_synthetic.py')
# As tests/test_models/test_segmentation.py trains it: 10 iterations.
SHORT = [
    'train_cfg.max_iters=10',
    'train_cfg.val_interval=10',
    'default_hooks.checkpoint.interval=5',
    'default_hooks.logger.interval=1',
] + toy_set(64, 16)
# What the console no longer shows (the log file does).
ENV_DUMP = 'System environment:'
CONFIG_DUMP = 'INFO - Config:'
HOOK_TABLE = 'Hooks will be executed in the following order'
THIRD_PARTY = ('``build_loss`` would be deprecated', 'avg_non_ignore',
               '"FileClient" will be deprecated', 'pkg_resources',
               'MKL_NUM_THREADS', 'Setting OMP_NUM_THREADS',
               'The draw is False')


def _record(message, level=logging.INFO):
    return logging.LogRecord('mmengine', level, __file__, 1, message, None,
                             None)


def test_console_filter_keeps_the_dumps_off_the_console():
    keep = ConsoleFilter()
    for message in ('\n' + '-' * 60 + '\nSystem environment:\n    sys',
                    "Config:\nmodel = dict(type='X')",
                    'Hooks will be executed in the following order:\n',
                    '"FileClient" will be deprecated in future. Please use',
                    'The prefix is not set in metric class IoUMetric.'):
        assert not keep.filter(_record(message)), message
    for message in ('Iter(train) [ 1/10]  lr: 3.0000e-03  loss: 1.4042',
                    'Registered DDP communication hook on ...',
                    'resumed epoch: 0, iter: 5', 'Config file is fine'):
        assert keep.filter(_record(message)), message
    assert all(why for _, why in FILE_ONLY)


def _to_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line))


@pytest.fixture
def start_console(monkeypatch):
    """Starts a ToolConsole over a fresh current MMLogger, made in the
    test (its console handler prints to the test's sys.stdout), with
    Python's warnings printed as outside pytest; given back after."""
    monkeypatch.setattr(warnings, 'showwarning', _to_stderr)
    started = []

    def start(verbose=False):
        MMLogger.get_instance(f'console-pre-{uuid.uuid4()}')
        started.append(ToolConsole('tool.py', verbose=verbose).start())
        return started[-1]

    yield start
    for tool in started:
        tool.stop()


def _runner_logger(tmp_path):
    """An MMLogger with a log file, as Runner.build_logger makes it."""
    (tmp_path / 'run').mkdir(exist_ok=True)
    return MMLogger.get_instance(
        f'console-run-{uuid.uuid4()}',
        log_file=str(tmp_path / 'run' / 'run.log'),
        file_mode='a')


def test_the_runner_logger_is_filtered_from_its_first_record(
        start_console, tmp_path, capsys):
    console = start_console()
    # Before the runner: held for the header, kept for the log file.
    MMLogger.get_current_instance().warning('before the runner')
    warnings.warn_explicit('``build_loss`` would be deprecated soon',
                           UserWarning, 'mmseg/models/builder.py', 36)
    warnings.warn_explicit('a warning of your own', UserWarning, 'mine.py', 1)
    first = capsys.readouterr()
    assert first.out == ''
    assert 'a warning of your own' in first.err
    assert 'build_loss' not in first.err
    with console.building():
        logger = _runner_logger(tmp_path)
        logger.info('\n' + '-' * 60 + '\nSystem environment:\n    sys: x')
        logger.info('Config:\nmodel = 1')
        logger.info('Iter(train) [1/1] loss: 1.0')  # held: no header yet
    assert capsys.readouterr().out == ''
    console.open('tool.py config.py', logger)
    logger.info('Iter(train) [2/2] loss: 0.5')
    out = capsys.readouterr().out
    lines = [ln.split(' - ', 3)[-1] for ln in out.splitlines()]
    assert lines == [
        'tool.py config.py', 'before the runner',
        'Iter(train) [1/1] loss: 1.0', 'Iter(train) [2/2] loss: 0.5'
    ]
    text = (tmp_path / 'run' / 'run.log').read_text()
    for seen in ('before the runner', 'System environment:', 'Config:',
                 'py.warnings - WARNING - UserWarning: ``build_loss``',
                 'a warning of your own', 'tool.py config.py',
                 'Iter(train) [2/2]'):
        assert seen in text, seen
    # The records from before the runner come first in the file.
    assert text.index('before the runner') < text.index('System environ')


def test_verbose_prints_everything(start_console, tmp_path, capsys):
    tool = start_console(verbose=True)
    with tool.building():
        logger = _runner_logger(tmp_path)
        logger.info('Config:\nmodel = 1')
        warnings.warn_explicit('``build_loss`` would be deprecated soon',
                               UserWarning, 'mmseg/models/builder.py', 36)
    tool.open('header', logger)
    out, err = capsys.readouterr()
    assert 'Config:\nmodel = 1' in out and 'build_loss' in err


def test_a_failure_before_the_runner_is_reported_once(start_console, tmp_path,
                                                      capsys, monkeypatch):
    console = start_console()
    for name in ('RANK', 'WORLD_SIZE', 'TORCHELASTIC_ERROR_FILE'):
        monkeypatch.delenv(name, raising=False)
    MMLogger.get_current_instance().info('merged the config')
    # No work dir yet: nothing is created, the cause is printed.
    console.work_dir = str(tmp_path / 'work')
    assert console.fail(KeyError("'bogus' is not a comm hook")) == 1
    out, err = capsys.readouterr()
    assert out.endswith('merged the config\n')
    assert err == 'tool.py: error: KeyError: "\'bogus\' is not a comm hook"\n'
    assert not (tmp_path / 'work').exists()
    # An existing work dir gets a log file with the run's records.
    (tmp_path / 'work').mkdir()
    assert console.fail(ValueError('bad value'), plain=True) == 1
    err = capsys.readouterr().err
    (log, ) = (tmp_path / 'work').glob('*/*.log')
    assert err.splitlines() == [
        'tool.py: error: bad value', f'tool.py: the traceback is in {log}'
    ]
    text = log.read_text()
    assert 'merged the config' in text
    assert 'ERROR' in text and 'ValueError: bad value' in text


def test_under_torchrun_the_agent_reports(start_console, tmp_path, capsys,
                                          monkeypatch):
    import json
    console = start_console()
    error_file = tmp_path / 'error.json'
    monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(error_file))
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '2')
    with console.building():
        _runner_logger(tmp_path).info('built')
    try:
        raise RuntimeError('boom')
    except RuntimeError as e:
        assert console.fail(e) == 1
    assert capsys.readouterr().err == ''
    data = json.loads(error_file.read_text())
    assert data['message']['message'] == 'RuntimeError: boom'
    assert 'raise RuntimeError' in data['message']['extraInfo']['py_callstack']
    report = data['mmcv_custom']
    assert (report['rank'], report['world_size']) == (0, 2)
    assert format_report(report).splitlines() == [
        'tool.py: error on rank 0: RuntimeError: boom',
        f'tool.py: the traceback is in {report["log_file"]}'
    ]
    assert 'RuntimeError: boom' in (tmp_path / 'run' / 'run.log').read_text()


@pytest.mark.parametrize('verbose', [False, True])
def test_a_logged_cause_is_printed_once_by_the_report(start_console, tmp_path,
                                                      capsys, monkeypatch,
                                                      verbose):
    """A hook that logs why it stops the run, then raises it (the fp16
    range guard): the console shows the report alone; the log file keeps
    the record and the traceback."""
    for name in ('RANK', 'WORLD_SIZE', 'TORCHELASTIC_ERROR_FILE'):
        monkeypatch.delenv(name, raising=False)
    console = start_console(verbose)
    with console.building():
        logger = _runner_logger(tmp_path)
    console.open('tool.py config.py', logger)
    logger.error('Iteration 3: stopped', extra={'failure_cause': True})
    logger.error('an error of its own')
    assert console.fail(RuntimeError('Iteration 3: stopped')) == 1
    out, err = capsys.readouterr()
    assert 'an error of its own' in out
    assert (out + err).count('Iteration 3: stopped') == 1
    assert err.splitlines() == [
        'tool.py: error: RuntimeError: Iteration 3: stopped',
        f'tool.py: the traceback is in {tmp_path}/run/run.log'
    ]
    text = (tmp_path / 'run' / 'run.log').read_text()
    assert re.search(r' - ERROR - \S+ - \S+ - \d+ - Iteration 3: stopped\n',
                     text), text
    assert 'RuntimeError: Iteration 3: stopped' in text


class _Failure:

    def __init__(self, timestamp, report=None, exitcode=1):
        self.timestamp, self.exitcode = timestamp, exitcode
        self.error_file_data = {'mmcv_custom': report} if report else {}


def _report(rank, time, error='ValueError: x'):
    return dict(
        prog='train.py',
        error=error,
        rank=rank,
        world_size=4,
        log_file=None,
        time=time,
        exit_code=1)


def test_the_first_report_wins_to_the_microsecond():
    # Rank 2 failed first; rank 0 (stopped by it) reported later in the
    # same second, and rank 3 was killed without a report.
    failures = {
        0: _Failure(100, _report(0, 100.7, 'RuntimeError: peer closed')),
        2: _Failure(100, _report(2, 100.2, 'ValueError: x')),
        3: _Failure(99, exitcode=-15),
    }
    assert first_failure(failures) == (
        2, failures[2].error_file_data['mmcv_custom'])
    # The same error on every rank (a config every rank reads): rank 0.
    failures = {r: _Failure(100, _report(r, 100.5 - r / 10)) for r in range(3)}
    assert first_failure(failures)[0] == 0
    # No report at all (killed): torchrun's order.
    failures = {1: _Failure(5, exitcode=-9), 0: _Failure(6, exitcode=-15)}
    assert first_failure(failures) == (1, None)
    # Every rank exits 2 (one says why, the others quietly), one of them
    # stopped by torchrun on its way out: the exit code is the cause, not
    # torchrun's SIGTERM, whatever the (whole-second) stamps say.
    failures = {0: _Failure(7, exitcode=-15), 1: _Failure(7, exitcode=2)}
    assert first_failure(failures) == (1, None)
    failures = {0: _Failure(6, exitcode=-15), 1: _Failure(7, exitcode=2)}
    assert first_failure(failures) == (1, None)
    # Only SIGTERMs (the whole job was stopped): torchrun's order.
    failures = {1: _Failure(6, exitcode=-15), 0: _Failure(6, exitcode=-15)}
    assert first_failure(failures) == (0, None)


# ---------------------------------------------------------------------------
# The shell launchers' arguments.


@pytest.mark.parametrize(
    'script,args,error', [
        ('dist_train.sh', [], 'CONFIG and NPROC_PER_NODE are required'),
        ('dist_train.sh', [MLP], 'NPROC_PER_NODE is missing'),
        ('dist_train.sh', [MLP, '0'],
         "NPROC_PER_NODE should be a whole number >= 1, but got '0'"),
        ('dist_train.sh', [MLP, 'two'],
         "NPROC_PER_NODE should be a whole number >= 1, but got 'two'"),
        ('dist_train.sh', ['2', MLP],
         f"CONFIG comes first, then NPROC_PER_NODE (got '2' '{MLP}')"),
        ('dist_train.sh', ['nothere.py', '2'
                           ], "CONFIG 'nothere.py': no such file"),
        ('dist_train.sh', ['x.pth', '2'], "CONFIG 'x.pth' is not a config "
         'file (.py, .json, .yaml or .yml)'),
        ('dist_test.sh', [MLP], 'CHECKPOINT and NPROC_PER_NODE are missing'),
        ('dist_test.sh', [MLP, '2'], 'CHECKPOINT is missing'),
        ('dist_test.sh', [MLP, 'x.pth'], 'NPROC_PER_NODE is missing'),
        ('dist_test.sh', ['x.pth', MLP, '2'],
         f"CONFIG comes first, then CHECKPOINT (got 'x.pth' '{MLP}')"),
        ('dist_test.sh', [MLP, '2', 'x.pth'],
         "CHECKPOINT comes before NPROC_PER_NODE (got '2' 'x.pth')"),
        ('slurm_train.sh', ['part', 'job'
                            ], 'PARTITION, JOB_NAME and CONFIG are required'),
        ('slurm_test.sh', ['part', 'job', 'x.pth', MLP],
         f"CONFIG comes first, then CHECKPOINT (got 'x.pth' '{MLP}')"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.endswith('.sh') else None)
def test_launcher_mistakes_are_usage_errors(script, args, error, tmp_path):
    out = subprocess.run(['bash', osp.join(TOOLS, script), *args],
                         cwd=str(tmp_path),
                         capture_output=True,
                         text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ''
    usage, message = out.stderr.splitlines()
    assert usage.startswith('usage: ') and script in usage
    assert message == f'{script}: error: {error}'


def test_launcher_help_and_slurm_counts(tmp_path):
    out = subprocess.run(
        ['bash', osp.join(TOOLS, 'dist_train.sh'), '-h'],
        capture_output=True,
        text=True)
    assert (out.returncode, out.stdout) == (
        0, 'usage: dist_train.sh CONFIG NPROC_PER_NODE [train.py args...]\n')
    out = subprocess.run(
        ['bash', osp.join(TOOLS, 'slurm_train.sh'), 'part', 'job', MLP],
        env=dict(os.environ, GPUS='x'),
        capture_output=True,
        text=True)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        "slurm_train.sh: error: GPUS should be a whole number >= 1, but got "
        "'x'")


def test_slurm_train_usage_comment_matches_the_docs():
    """The work dir is train.py's --work-dir (the script passes every
    argument after CONFIG to train.py), as docs/en/user_guides/launching.md
    writes it."""
    with open(osp.join(TOOLS, 'slurm_train.sh')) as f:
        head = f.read(600)
    assert 'PARTITION JOB_NAME CONFIG [train.py args...]' in head
    assert '[WORK_DIR]' not in head
    with open(osp.join(ROOT, 'docs', 'en', 'user_guides',
                       'launching.md')) as f:
        assert 'slurm_train.sh PARTITION JOB CONFIG --work-dir DIR' in f.read()


# ---------------------------------------------------------------------------
# End to end through tools/dist_train.sh, 2 gloo ranks.


def _run(args, cwd, **env):
    return subprocess.run(
        args,
        cwd=str(cwd),
        env=dict(os.environ, PYTHON=sys.executable, PORT=free_port(), **env),
        capture_output=True,
        text=True,
        timeout=600)


def _log_file(console_text):
    """The log file the header or a report names, relative paths from the
    run's folder."""
    found = re.search(r'(?:log file   :|the traceback is in) (\S+\.log)',
                      console_text)
    assert found, console_text
    return found.group(1)


@pytest.mark.slow
def test_a_training_prints_a_header_progress_and_a_summary(tmp_path):
    """One 10-iteration run of the toy segmenter; then --resume --verbose
    of the finished run (in one process: it trains nothing); then
    tools/test.py on its checkpoint."""
    out = _run([
        'bash',
        osp.join(TOOLS, 'dist_train.sh'), FCN, '2', '--work-dir', 'work',
        '--cfg-options', *SHORT
    ], tmp_path)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-3000:]
    lines = console.splitlines()
    header = lines.index(next(ln for ln in lines if 'INFO - train.py ' in ln))
    assert lines[header].endswith(f'INFO - train.py {FCN}')
    assert lines[header + 1:header + 4] == [
        '  work dir   : work',
        f'  log file   : {_log_file(console)} (with the environment, the '
        'full config and the hooks)', '  ranks      : 2, backend gloo, on CPU'
    ]
    for gone in (ENV_DUMP, CONFIG_DUMP, HOOK_TABLE) + THIRD_PARTY:
        assert gone not in console, gone
    assert "type='bf16_compress' (bf16_compress_hook)" in console
    assert console.count('Iter(train) [') == 10
    assert re.search(
        r'INFO - Training done: iteration 10 of 10; wall time [\d.]+ s\n'
        r'  loss       : [\d.]+\n'
        r'  val        : aAcc [\d.]+, mIoU [\d.]+, mAcc [\d.]+\n'
        r'  checkpoints: work \(last: iter_10\.pth\)\n'
        r'  comm hook  : rank 0 sent [\d.]+ MiB where DDP sends [\d.]+ MiB '
        r'without the hook: [\d.]+ MiB \(50%\) saved\n'
        r'  log file   : \S+\.log\n$', out.stdout), out.stdout[-2000:]
    assert out.stderr == ''
    assert len(lines) < 50
    log = (tmp_path / _log_file(console)).read_text()
    for kept in (ENV_DUMP, CONFIG_DUMP, HOOK_TABLE, 'build_loss',
                 'avg_non_ignore', '"FileClient" will be deprecated',
                 'Training done'):
        assert kept in log, kept

    # Resumed at its end: nothing left to train; --verbose prints the
    # config and the environment again.
    again = _run([
        sys.executable,
        osp.join(TOOLS, 'train.py'), FCN, '--work-dir', 'work', '--resume',
        '--verbose', '--cfg-options', *SHORT
    ], tmp_path)
    console = again.stdout + again.stderr
    assert again.returncode == 0, console[-3000:]
    nothing = 'Nothing left to train (iteration 10 of 10): the run is finished'
    assert nothing in console
    assert 'Training done' not in console
    assert CONFIG_DUMP in console and ENV_DUMP in console
    assert nothing in (tmp_path / _log_file(console)).read_text()

    tested = _run([
        sys.executable,
        osp.join(TOOLS, 'test.py'), FCN, 'work/iter_10.pth', '--work-dir',
        'eval', '--cfg-options', *SHORT
    ], tmp_path)
    console = tested.stdout + tested.stderr
    assert tested.returncode == 0, console[-3000:]
    assert 'INFO - test.py ' in console
    assert '  checkpoint : work/iter_10.pth' in console
    assert re.search(
        r'Test done; wall time [\d.]+ s\n  metrics    : aAcc [\d.]+, '
        r'mIoU [\d.]+, mAcc [\d.]+\n', console), console[-2000:]
    for gone in (ENV_DUMP, CONFIG_DUMP, HOOK_TABLE) + THIRD_PARTY:
        assert gone not in console, gone


@pytest.mark.slow
def test_a_failure_on_every_rank_is_reported_once(tmp_path):
    """fp16 gradients the all-reduce overflows (a loss weighted 1e9): the
    fp16 range guard stops both ranks at iteration 1, rank 0 logging why.
    The console says why once (the report, not the guard's ERROR record
    too), names the log file and the exit code, and ends there; the log
    file keeps the record and the tracebacks."""
    out = _run([
        'bash',
        osp.join(TOOLS, 'dist_train.sh'), FCN, '2', '--work-dir', 'work',
        '--cfg-options', *SHORT, 'comm_hook.type=fp16_compress',
        'model.decode_head.loss_decode.loss_weight=1e9'
    ], tmp_path)
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-3000:]
    assert len(console.splitlines()) <= 15, console
    cause = ('Iteration 1: the optimizer applied non-finite gradients, and '
             'the parameters backbone.stem.0.weight, ')
    assert console.count(cause) == 1, console
    report = out.stderr.splitlines()
    assert re.fullmatch(
        r'train\.py: error on rank [01]: NonFiniteGradientsError: '
        + re.escape(cause) + r'.* so training cannot recover\. Stopped '
        r'before saving a checkpoint of these weights\. fp16 already '
        r'divides by the world size before the all-reduce, .*', report[0]), \
        out.stderr
    log = _log_file(out.stderr)
    assert report[1:] == [
        f'train.py: the traceback is in {log}', 'dist_train.sh: exit code 1'
    ]
    for gone in ('Traceback', 'ChildFailedError', 'To enable traceback',
                 'closing signal', 'OMP_NUM_THREADS', ' - ERROR - '):
        assert gone not in console, gone
    text = (tmp_path / log).read_text()
    assert re.search(
        r' - ERROR - \S+nonfinite_guard\.py - _stop - \d+ - ' +
        re.escape(cause), text)
    assert re.search(
        r'ERROR - train\.py - main - 0 - train\.py failed on '
        r'rank [01] of 2:\nTraceback', text)
    assert 'NonFiniteGradientsError: ' + cause in text
