"""mmcv_custom.analysis.progress: the tools' progress lines (plain where
the output is not a terminal, a rich bar where it is), and
mmcv_custom.analysis.cli: the checks of their command lines."""
import argparse
import io
import re

import pytest

from mmcv_custom.analysis import Progress, check_output, cli, format_eta
from mmcv_custom.analysis import progress as progress_module
from mmcv_custom.analysis import read_config

# A plain line: [done/total], the note and the step's seconds, an ETA.
LINE = r'\[(\d+)/(\d+)\] (.*): (\d+\.\d) s, ETA (\d+:\d\d:\d\d|-:--:--)'


class _Clock:
    """``time.monotonic`` under the test's control."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(progress_module.time, 'monotonic', fake)
    return fake


class _Captured(io.StringIO):
    """A stream that says whether it is a terminal."""

    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_format_eta():
    assert format_eta(None) == '-:--:--'
    assert format_eta(0) == '0:00:00'
    assert format_eta(40.4) == '0:00:40'
    assert format_eta(3600 + 62) == '1:01:02'
    assert format_eta(-3) == '0:00:00'


def test_plain_lines_when_not_a_terminal(clock):
    out = _Captured(tty=False)
    progress = Progress(4, stream=out)
    for note in ('1 MB', '4 MB', '16 MB'):
        clock.now += 2.0
        progress.advance(note)
    clock.now += 2.5
    progress.advance('64 MB')
    lines = out.getvalue().splitlines()
    # The rate is measured from the end of the first step, which carries
    # what happens once.
    assert lines[:3] == [
        '[1/4] 1 MB: 2.0 s, ETA -:--:--',
        '[2/4] 4 MB: 2.0 s, ETA 0:00:04',
        '[3/4] 16 MB: 2.0 s, ETA 0:00:02',
    ]
    assert re.fullmatch(LINE, lines[1])
    # The last says how long it all took instead of an ETA.
    assert lines[3] == '[4/4] 64 MB: 2.5 s, done in 0:00:08'
    assert '\x1b' not in out.getvalue()  # no terminal codes


def test_weights_make_the_eta_count_big_steps_as_big(clock):
    out = _Captured(tty=False)
    # Step 2 (1 unit) done in 1 s, 9 units left: 9 s, not (as by count)
    # 1 s.
    progress = Progress(3, weights=[5, 1, 9], stream=out)
    clock.now += 5.0
    progress.advance('first')
    assert progress.eta() is None
    clock.now += 1.0
    progress.advance('small')
    assert out.getvalue().splitlines()[1] == '[2/3] small: 1.0 s, ETA 0:00:09'
    # The ETA counts down between steps.
    clock.now += 4.0
    assert progress.eta() == pytest.approx(5.0)


def test_a_run_first_seen_midway_counts_its_rate_from_there(clock):
    # A training run whose first logged iteration is the 10th: its
    # start-up is not training speed.
    out = _Captured(tty=False)
    # started 30 s before its first log line
    progress = Progress(
        100,
        label='int8_ef',
        step_time=False,
        done=10,
        since=clock.now - 30,
        stream=out)
    progress.update(10, 'loss 0.9')
    clock.now += 5.0
    progress.update(20, 'loss 0.7')
    clock.now += 40.0
    progress.update(100, 'loss 0.1')
    assert out.getvalue().splitlines() == [
        '[int8_ef] [10/100] loss 0.9, ETA -:--:--',
        '[int8_ef] [20/100] loss 0.7, ETA 0:00:40',
        '[int8_ef] [100/100] loss 0.1, done in 0:01:15',
    ]


def test_disabled_writes_nothing(clock):
    out = _Captured(tty=True)
    progress = Progress(2, stream=out, enabled=False)
    progress.advance('x')
    progress.close()
    assert out.getvalue() == ''


def test_a_bar_on_a_terminal():
    out = _Captured(tty=True)
    with Progress(3, stream=out, label='bench') as progress:
        for note in ('a', 'b', 'c'):
            progress.advance(note)
    text = out.getvalue()
    # rich drew (and redrew) a bar: terminal codes, the count, the ETA.
    assert '\x1b[' in text
    assert '3/3' in text and 'ETA ' in text and '[bench]' in text
    assert not re.search(r'^\[3/3\]', text, re.M)  # not the plain lines


def test_terminal_can_be_forced_either_way():
    plain = _Captured(tty=True)
    Progress(1, stream=plain, terminal=False).advance('x')
    assert plain.getvalue().startswith('[1/1] x: ')
    bar = _Captured(tty=False)
    with Progress(1, stream=bar, terminal=True) as progress:
        progress.advance('x')
    assert '\x1b[' in bar.getvalue()


@pytest.mark.parametrize('kwargs,match', [
    (dict(total=0), 'total should be an int >= 1, but got 0'),
    (dict(total=2, weights=[1]), 'weights should be 2 numbers > 0'),
    (dict(total=2, weights=[1, 0]), 'with some <= 0'),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Progress(stream=io.StringIO(), **kwargs)


class _Parser(argparse.ArgumentParser):
    """``parser.error`` raises with the message instead of exiting."""

    def error(self, message):
        raise ValueError(message)


def test_check_output_creates_folders_under_work_dirs(tmp_path):
    path = tmp_path / 'work_dirs' / 'bench' / 'deep' / 'b.json'
    check_output(_Parser(), '--json', str(path))
    assert path.parent.is_dir()
    assert not path.exists()  # checked, not written


def test_check_output_elsewhere_needs_the_folder(tmp_path):
    path = tmp_path / 'results' / 'b.json'
    with pytest.raises(ValueError) as error:
        check_output(_Parser(), '--json', str(path))
    assert str(error.value) == (f'--json {path}: cannot write there (No '
                                'such file or directory)')
    assert not path.parent.exists()


def test_read_config_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r'^config nope\.py: no such file$'):
        read_config(_Parser(), 'config', 'nope.py')
    text = tmp_path / 'notes.md'
    text.write_text('# not a config\n')
    with pytest.raises(ValueError) as error:
        read_config(_Parser(), '--config', str(text))
    assert str(error.value) == (
        f'--config {text}: cannot read it as a config (OSError: Only '
        'py/yml/yaml/json type are supported now!)')
    broken = tmp_path / 'broken.py'
    broken.write_text('model = dict(\n')
    with pytest.raises(
            ValueError, match=r'cannot read it as a config '
            r'\(SyntaxError: '):
        read_config(_Parser(), 'config', str(broken))
    good = tmp_path / 'good.py'
    good.write_text('model = dict(depth=18)\n')
    cfg = read_config(_Parser(), 'config', str(good), {'model.depth': 50})
    assert cfg.model.depth == 50


@pytest.mark.parametrize('text,error', [
    ('0', "--n: '0' is not an int >= 1"),
    ('2.5', "--n: '2.5' is not an int >= 1"),
    ('two', "--n: 'two' is not an int >= 1"),
])
def test_positive_int_names_the_option_and_the_rule(text, error, capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument('--n', type=cli.positive_int)
    assert parser.parse_args(['--n', '3']).n == 3
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(['--n', text])
    assert exc.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize('text', ['0', '-1', 'nan', 'inf', 'x'])
def test_positive_float_refuses_what_is_not_a_finite_positive(text):
    with pytest.raises(
            argparse.ArgumentTypeError, match='is not a number > 0'):
        cli.positive_float(text)
    assert cli.positive_float('0.5') == 0.5
