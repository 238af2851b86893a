"""A plugin hook's record: registered the documented way, read as a
built-in's, and what a hook without one shows (``comm_MB: unknown``)."""
import json
import math
import os.path as osp

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.comm.builder import (build_comm_hook, check_comm_hook_cfg,
                                      hook_record)
from mmcv_custom.comm.records import (HookRecord, record_of,
                                      register_hook_record, sends_bucket,
                                      unregister_hook_record)
from mmcv_custom.comm.registry import COMM_HOOKS, CommHookRegistry
from mmcv_custom.comm.telemetry import CommCounter
from mmcv_custom.hooks.half import allreduce_hook, fp16_compress_hook
from mmcv_custom.launching.console import summary_text
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner


@pytest.fixture
def plugins():
    """Hooks registered in the global COMM_HOOKS for this test only (the
    ranks forked during it inherit them); ``plugins.hooks[name]``."""
    registered = {}

    class _Plugins:
        hooks = registered

        @staticmethod
        def add(name, record=None):
            # A fresh function per test: records are kept per function.
            def plugin_fp16(state, bucket):
                return fp16_compress_hook(state, bucket)

            COMM_HOOKS.register_module(
                name=name, module=plugin_fp16, record=record)
            registered[name] = plugin_fp16
            return plugin_fp16

    yield _Plugins
    for name, hook in registered.items():
        COMM_HOOKS.module_dict.pop(name, None)
        unregister_hook_record(hook)


def test_a_plugin_record_is_read_as_a_builtins(plugins):
    record = HookRecord(sent_format='fp16', count_bytes_sent=sends_bucket(2))
    hook = plugins.add('plugin_fp16', record)
    assert record_of(hook) is record
    assert hook_record('plugin_fp16') is record
    # By the decorator, under the function's name, as own_hooks.md shows.
    int8 = HookRecord(sent_format='int8', quantizes=True)

    @COMM_HOOKS.register_module(record=int8)
    def plugin_int8(state, bucket):
        return allreduce_hook(state, bucket)

    plugins.hooks['plugin_int8'] = plugin_int8
    assert COMM_HOOKS.get('plugin_int8') is plugin_int8
    assert hook_record('plugin_int8') is int8
    # Without a record: the empty one, traffic unknown.
    bare = plugins.add('plugin_bare')
    assert record_of(bare) == HookRecord()


def test_a_plugin_record_refuses_a_wrapper_as_a_builtins(plugins):
    plugins.add(
        'plugin_fp16',
        HookRecord(sent_format='fp16', count_bytes_sent=sends_bucket(2)))
    plugins.add('plugin_int8', HookRecord(sent_format='int8', quantizes=True))
    plugins.add('plugin_bare')
    with pytest.raises(ValueError) as info:
        check_comm_hook_cfg(dict(type='plugin_int8', wrapper='bf16'))
    assert str(info.value) == (
        "comm_hook type 'plugin_int8' already quantizes to int8, so "
        "wrapper='bf16' would round twice. Drop the wrapper.")
    with pytest.raises(
            ValueError,
            match="'plugin_fp16' already reduces in "
            "fp16, so wrapper='fp16' would round twice"):
        check_comm_hook_cfg(dict(type='plugin_fp16', wrapper='fp16'))
    # Nothing is known about a hook without a record: it is not refused.
    assert check_comm_hook_cfg(dict(type='plugin_bare',
                                    wrapper='bf16'))['wrapper'] == 'bf16'


def test_a_plugin_cannot_take_a_builtins_name_or_record():

    def my_allreduce(state, bucket):
        return allreduce_hook(state, bucket)

    with pytest.raises(KeyError) as info:
        COMM_HOOKS.register_module(name='allreduce', module=my_allreduce)
    message = info.value.args[0]
    assert message.startswith(
        "comm hook name 'allreduce' is the built-in hook "
        'mmcv_custom.hooks.half.allreduce_hook, so the plugin hook '
        'tests.test_comm.test_plugin_records.'
        'test_a_plugin_cannot_take_a_builtins_name_or_record.'
        '<locals>.my_allreduce cannot take it.')
    assert "register_module(name='...')" in message
    assert COMM_HOOKS.get('allreduce') is allreduce_hook
    # With a record too, and the record is not left behind.
    with pytest.raises(KeyError, match="'allreduce' is the built-in hook"):
        COMM_HOOKS.register_module(
            name='allreduce', module=my_allreduce, record=HookRecord())
    assert record_of(my_allreduce) == HookRecord()
    # A built-in's record is the project's.
    with pytest.raises(ValueError) as info:
        register_hook_record(allreduce_hook, HookRecord())
    assert str(info.value).startswith(
        'mmcv_custom.hooks.half.allreduce_hook is a built-in hook of '
        'mmcv_custom with its own record')
    with pytest.raises(
            TypeError,
            match='record should be a HookRecord, but '
            "got dict: {'sent_format': 'fp16'}"):
        COMM_HOOKS.register_module(
            module=my_allreduce, record=dict(sent_format='fp16'))


def test_a_builtin_that_comes_after_a_plugin_of_its_name_names_both():
    registry = CommHookRegistry('DDP communication hook', scope='mmcv_custom')

    def int8_compress(state, bucket):
        return allreduce_hook(state, bucket)

    registry.register_module(module=int8_compress)
    with pytest.raises(KeyError) as info:
        registry.register_module(name='int8_compress', module=allreduce_hook)
    assert info.value.args[0].startswith(
        "comm hook name 'int8_compress' is now a built-in hook of "
        'mmcv_custom, mmcv_custom.hooks.half.allreduce_hook, but the plugin '
        'hook tests.test_comm.test_plugin_records.'
        'test_a_builtin_that_comes_after_a_plugin_of_its_name_names_both.'
        '<locals>.int8_compress already has it.')
    # force=True takes the name, and says so.
    registry.register_module(
        name='int8_compress', module=allreduce_hook, force=True)
    assert registry.get('int8_compress') is allreduce_hook


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(quantizes=True), ValueError,
     "quantizes=True should name the format below half precision it sends "
     "(e.g. sent_format='int8'), but got sent_format=None"),
    (dict(sent_format='bf16',
          quantizes=True), ValueError, "but got sent_format='bf16'"),
    (dict(waits_per_bucket=True), ValueError,
     'waits_per_bucket=True needs on_worker=True'),
    (dict(fsdp2_form='reduce_scatter'), ValueError,
     "fsdp2_form should be one of ('averaging_reduce_scatter', "
     "'int8_reduce_scatter') or None, but got 'reduce_scatter'"),
    (dict(sent_format=torch.float16), TypeError,
     "sent_format should be a str such as 'fp16' or None"),
    (dict(count_bytes_sent=2), TypeError,
     'count_bytes_sent should be callable or None, but got 2'),
    (dict(periodic=True, fsdp2_form='averaging_reduce_scatter'), ValueError,
     "HookRecord periodic=True takes no fsdp2_form, but got "
     "fsdp2_form='averaging_reduce_scatter': FSDP2 shards the parameters"),
    (dict(periodic=True, codec=lambda bucket, world_size, rank: None),
     ValueError, 'HookRecord periodic=True takes no codec, but got codec=<'),
    (dict(periodic=True, two_level=True), ValueError,
     'HookRecord periodic=True takes no two_level, but got two_level=True: '
     'a periodic hook always takes the node layout'),
])
def test_a_record_that_contradicts_itself_is_refused(kwargs, error, message):
    with pytest.raises(error) as info:
        HookRecord(**kwargs)
    assert message in str(info.value)
    with pytest.raises(ValueError, match='element_bytes should be an int'):
        sends_bucket(0)


def _counted(rank, world_size):
    out = {}
    for name in ('plugin_fp16', 'plugin_bare'):
        counter = CommCounter()
        spec = build_comm_hook(dict(type=name), counter=counter)
        model = DDP(nn.Linear(8, 4))
        model.register_comm_hook(spec.state, spec.hook)
        model(torch.ones(2, 8) * (rank + 1)).sum().backward()
        out[name] = counter.pop(), model.module.weight.grad
    return out


def test_a_plugin_record_counts_the_bytes_on_real_ddp(plugins):
    plugins.add(
        'plugin_fp16',
        HookRecord(sent_format='fp16', count_bytes_sent=sends_bucket(2)))
    plugins.add('plugin_bare')
    out = run_ranks(_counted)[0]
    numel = 8 * 4 + 4
    assert out['plugin_fp16'][0] == (numel * 4, numel * 2)
    # Unknown, not zero and not missing.
    assert out['plugin_bare'][0] == (numel * 4, None)
    # Both trained as registered: rows of (rank + 1), averaged to 3.
    for _, grad in out.values():
        assert torch.equal(grad, torch.full((4, 8), 3.0))


def _logged(rank, world_size, work_dir, hook_type):
    runner, records = build_runner(work_dir, dict(type=hook_type))
    runner.train()
    logged = [m for _, m in records.lines if 'comm_MB:' in m]
    notes = [
        m for level, m in records.lines
        if level == 'WARNING' and 'bytes it sends are unknown' in m
    ]
    scalars = None
    if rank == 0:
        path = osp.join(runner.log_dir, 'vis_data', 'scalars.json')
        with open(path) as f:
            scalars = [json.loads(line) for line in f]
    return logged, notes, summary_text(runner, 'train', None, 1.0), scalars


def test_the_log_and_the_summary_show_a_plugins_traffic(tmp_path, plugins):
    plugins.add(
        'plugin_fp16',
        HookRecord(sent_format='fp16', count_bytes_sent=sends_bucket(2)))
    (logged, notes, summary, _), _ = run_ranks(_logged, str(tmp_path),
                                               'plugin_fp16')
    assert len(logged) == 3 and all('comm_ratio: 0.5000' in m for m in logged)
    assert notes == []
    assert '(50%) saved' in summary


def test_a_hook_without_a_record_shows_unknown_traffic(tmp_path, plugins):
    plugins.add('plugin_bare')
    (logged, notes, summary,
     scalars), (_, notes1, *_) = run_ranks(_logged, str(tmp_path),
                                           'plugin_bare')
    assert len(logged) == 3
    for line in logged:
        assert 'comm_MB: unknown' in line and 'comm_ratio: unknown' in line
    # Said once, on rank 0, with the way to give it a record.
    assert len(notes) == 1 and notes1 == []
    assert "comm_hook type='plugin_bare'" in notes[0]
    assert 'register_module(record=HookRecord(' in notes[0]
    assert 'own_hooks.md' in notes[0]
    assert 'comm hook  : comm_MB: unknown' in summary
    # Visualizer backends get a number: NaN.
    trained = [s for s in scalars if 'comm_MB' in s]
    assert len(trained) == 3
    assert all(math.isnan(s['comm_MB']) for s in trained)


def test_the_record_example_of_own_hooks_md_does_what_it_says():
    page = osp.join(
        osp.dirname(__file__), '..', '..', 'docs', 'en', 'advanced_guides',
        'own_hooks.md')
    with open(page) as f:
        text = f.read()
    section = text[text.index('## Giving your hook a record'):]
    example = section.split('```python\n')[1].split('```')[0]
    scope = {}
    exec(example, scope)
    try:
        hook = scope['my_int8_hook']
        assert COMM_HOOKS.get('my_int8_hook') is hook
        assert record_of(hook).quantizes
        with pytest.raises(ValueError) as info:
            check_comm_hook_cfg(dict(type='my_int8_hook', wrapper='bf16'))
        # As the page words it (wrapped over two lines there).
        assert ' '.join(str(info.value).split()) in ' '.join(section.split())
    finally:
        COMM_HOOKS.module_dict.pop('my_int8_hook', None)
        unregister_hook_record(scope.get('my_int8_hook'))
