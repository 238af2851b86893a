"""``--cfg-options`` as every tool reads it: MMEngine's ``DictAction``,
and a dict of several keys, which ``DictAction`` alone cannot read."""
import argparse

import pytest

from mmcv_custom.launching.cfg_options import (CfgOptionsAction,
                                               parse_cfg_option)


@pytest.mark.parametrize(
    'item,parsed',
    [
        ("comm_hook=dict(type='post_local_sgd',period=5)",
         dict(type='post_local_sgd', period=5)),
        ("comm_hook=dict(type='diloco', period=25, "
         "inner=dict(type='int8_compress'), group_periods={4: 2})",
         dict(
             type='diloco',
             period=25,
             inner=dict(type='int8_compress'),
             group_periods={4: 2})),
        ("comm_hook={'type': 'bf16_compress', 'check_finite': False}",
         dict(type='bf16_compress', check_finite=False)),
        ("vis_backends=[dict(type='LocalVisBackend'), dict(type='X', n=-1)]",
         [dict(type='LocalVisBackend'),
          dict(type='X', n=-1)]),
        ("v=(dict(a=(1, 2)), 3)", (dict(a=(1, 2)), 3)),
        # The rest as DictAction reads it: bare words, lists, tuples.
        ('train_cfg.max_iters=100', 100),
        ('comm_hook.type=bf16_compress', 'bf16_compress'),
        ('v=[a,b]', ['a', 'b']),
        ('v=1,2', [1, 2]),
        ('v=true', True),
        ('v=None', None),
        ('work_dir=/tmp/a=b', '/tmp/a=b'),
    ],
    ids=[
        'dict', 'nested', 'braces', 'in-a-list', 'in-a-tuple', 'int', 'word',
        'list', 'commas', 'bool', 'none', 'equals-in-value'
    ])
def test_values_are_read(item, parsed):
    key, value = parse_cfg_option(item)
    assert key == item.partition('=')[0]
    assert value == parsed and type(value) is type(parsed)


HOW = ('write strings in quotes and quote the whole item for the shell: ')
EXAMPLE = HOW + '"comm_hook=dict(type=\'name\', period=25)"'


@pytest.mark.parametrize(
    'item,message', [
        ('comm_hook.type', "'comm_hook.type': expected KEY=VALUE"),
        ('=3', "'=3': expected KEY=VALUE"),
        ('comm_hook=dict(type=bf16_compress, period=5)',
         "'comm_hook=dict(type=bf16_compress, period=5)': cannot read its "
         'value (bf16_compress is not a literal); ' + HOW +
         '"comm_hook=dict(type=\'bf16_compress\', period=5)"'),
        ("comm_hook=dict(type='diloco', period=25",
         '"comm_hook=dict(type=\'diloco\', period=25": cannot read its '
         "value ('(' was never closed); " + EXAMPLE),
        ('comm_hook=dict(**base)',
         "'comm_hook=dict(**base)': cannot read its value (dict(**base) is a "
         'call; only dict(...) of literal values is read); ' + EXAMPLE),
        ('v=(0,1', "'v=(0,1': cannot read its value (Imbalanced brackets "
         'exist in (0,1)'),
    ],
    ids=[
        'no-equals', 'no-key', 'unquoted', 'unclosed', 'unpacking',
        'unbalanced'
    ])
def test_what_cannot_be_read_is_named(item, message):
    with pytest.raises(ValueError) as info:
        parse_cfg_option(item)
    assert str(info.value) == message


def test_the_action_collects_one_dict_and_fails_as_usage(capsys):
    parser = argparse.ArgumentParser(prog='train.py')
    parser.add_argument('--cfg-options', nargs='+', action=CfgOptionsAction)
    args = parser.parse_args([
        '--cfg-options', "comm_hook=dict(type='diloco', period=25)",
        'train_cfg.max_iters=4', '--cfg-options', 'comm_hook.period=5'
    ])
    assert args.cfg_options == {
        'comm_hook': dict(type='diloco', period=25),
        'train_cfg.max_iters': 4,
        'comm_hook.period': 5
    }
    with pytest.raises(SystemExit) as info:
        parser.parse_args(['--cfg-options', 'comm_hook=dict(type=x, n=1)'])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "train.py: error: --cfg-options 'comm_hook=dict(type=x, n=1)': "
        'cannot read its value (x is not a literal); ' + HOW +
        '"comm_hook=dict(type=\'x\', n=1)"\n')
