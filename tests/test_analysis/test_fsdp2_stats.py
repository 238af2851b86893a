"""Memory under FSDP2: mmcv_custom.analysis.model_stats' per-GPU numbers
(what tools/analysis_tools/model_stats.py prints) against hand
computations, and tools/analysis_tools/benchmark_fsdp2.py, which measures
them on two gloo ranks."""
import json
import math
import os.path as osp
import subprocess
import sys
import types

import pytest
from mmengine.config import Config

from tests.tool_utils import load_script, usage_errors

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
RECIPES = osp.join(ROOT, 'configs', 'intern_vit')
TINY = 'upernet_intern-vit-tiny_2xb8-200iter_toy-shapes-56x56.py'
TINY_FSDP2 = 'upernet_intern-vit-tiny_2xb8-fsdp2-200iter_toy-shapes-56x56.py'
FULL_6B = 'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py'
FULL_6B_FSDP2 = 'upernet_intern-vit-6b_8xb2-fsdp2-80k_ade20k-504x504.py'
STATS = osp.join(ROOT, 'tools', 'analysis_tools', 'model_stats.py')
BENCH = osp.join(ROOT, 'tools', 'analysis_tools', 'benchmark_fsdp2.py')

# The tiny InternViT (width 64, MLP 256, no qkv bias, q/k norms, layer
# scale), counted by hand: norm1, q_norm, k_norm, ls1, norm2, ls2 (64
# each), qkv, proj (+ bias), fc1 (+ bias), fc2 (+ bias).
TINY_BLOCK = 6 * 64 + 3 * 64 * 64 + 64 * 64 + 64 + 2 * 64 * 256 + 256 + 64
# The backbone's own: class token, position embedding (1 + 4 * 4 patches),
# the 14x14 patch embedding (+ bias) and the pyramid: up1 two 2x2
# transposed convolutions (+ biases) around a norm (weight and bias), up2
# one more.
TINY_ONE_ROW = 64 + 17 * 64  # cls_token (1, 1, 64), pos_embed (1, 17, 64)
TINY_BACKBONE_OWN = (
    TINY_ONE_ROW + 64 * 3 * 14 * 14 + 64 + 3 * (64 * 64 * 4 + 64) + 2 * 64)
# InternViT-6B's block: the same layout at width 3200, MLP 12800.
BLOCK_6B = (6 * 3200 + 3 * 3200 * 3200 + 3200 * 3200 + 3200 +
            2 * 3200 * 12800 + 12800 + 3200)


@pytest.fixture(scope='module')
def model_stats():
    from mmcv_custom.analysis import model_stats
    return model_stats


def _stats(model_stats, name, gpus, **options):
    from mmengine.registry import DefaultScope
    cfg = Config.fromfile(osp.join(RECIPES, name))
    cfg.merge_from_dict(options)
    with DefaultScope.overwrite_default_scope('mmseg'):
        return model_stats.stats(cfg, gpus=gpus)


def _model(cfg_name):
    import torch
    from mmengine.registry import init_default_scope
    from mmengine.utils import import_modules_from_strings
    cfg = Config.fromfile(osp.join(RECIPES, cfg_name))
    import_modules_from_strings(**cfg.custom_imports)
    init_default_scope('mmseg')
    from mmseg.registry import MODELS
    with torch.device('meta'):
        return MODELS.build(cfg.model)


@pytest.mark.parametrize('n', [2, 4])
def test_tiny_model_by_hand(model_stats, n):
    s = _stats(model_stats, TINY, gpus=(n, ))
    total = s['params']
    assert s['trainable'] == total and s['bf16_params'] == 0
    assert s['fsdp2_units'] == {
        'InternViTBlock': 4,
        'InternViT': 1,
        'EncoderDecoder': 1
    }
    m = s['fsdp2'][n]
    # Every first dimension divides by 2 and 4 but the one-row class
    # token and position embedding's, which rank 0 holds whole.
    rank0 = (total - TINY_ONE_ROW) // n + TINY_ONE_ROW
    assert (total - TINY_ONE_ROW) % n == 0
    assert m['param_bytes'] == m['grad_bytes'] == 4 * rank0
    assert m['optim_bytes'] == 2 * 4 * rank0
    # Root (heads) + backbone + a block + the next block prefetched: all
    # but two blocks.
    assert m['gathered_bytes'] == 4 * (total - 2 * TINY_BLOCK)
    assert m['prefetch_bytes'] == 4 * TINY_BLOCK
    assert m['total_bytes'] == 4 * (4 * rank0 + total - 2 * TINY_BLOCK)
    # An fp32 model: the all-fp32 variant is the same.
    assert s['fsdp2_fp32'][n] == m
    # And the DDP line's numbers are untouched.
    assert s['param_bytes'] == 4 * total
    assert s['optim_bytes'] == 2 * s['grad_bytes'] == 8 * total


def test_units_are_the_strategys(model_stats):
    from mmcv_custom.engine import FSDP2Strategy
    model = _model(TINY)
    ours = [u['name'] for u in model_stats.fsdp2_units(model)]
    stub = types.SimpleNamespace(shard_modules=None)
    theirs = [n for n, _ in FSDP2Strategy._select_units(stub, model)]
    assert ours == theirs + ['']
    blocks = model_stats.fsdp2_units(model)[:4]
    assert [sum(p.numel() for p in u['params'])
            for u in blocks] == [TINY_BLOCK] * 4
    backbone = model_stats.fsdp2_units(model)[4]
    assert backbone['name'] == 'backbone'
    assert sum(p.numel() for p in backbone['params']) == TINY_BACKBONE_OWN
    assert backbone['ancestors'] == ['']


def test_fsdp2_config_and_its_strategy_arguments(model_stats):
    ddp = _stats(model_stats, TINY, gpus=(2, ))
    fsdp2 = _stats(model_stats, TINY_FSDP2, gpus=(2, ))
    assert fsdp2['fsdp2_shard_modules'] == ('InternViTBlock', 'InternViT',
                                            'UPerHead', 'FCNHead')
    # The heads as units: the same shards, fewer bytes gathered at once.
    assert fsdp2['fsdp2'][2]['param_bytes'] == ddp['fsdp2'][2]['param_bytes']
    assert (fsdp2['fsdp2'][2]['gathered_bytes']
            < ddp['fsdp2'][2]['gathered_bytes'])
    default = _stats(
        model_stats,
        TINY_FSDP2,
        gpus=(2, ),
        strategy=dict(shard_modules=['InternViTBlock', 'InternViT']))
    assert default['fsdp2'] == ddp['fsdp2']
    total = ddp['params']
    # Only the backbone as a unit: backbone and heads gathered at once,
    # nothing to prefetch.
    one = _stats(
        model_stats,
        TINY_FSDP2,
        gpus=(2, ),
        strategy=dict(shard_modules=['InternViT']))
    assert one['fsdp2_units'] == {'InternViT': 1, 'EncoderDecoder': 1}
    assert one['fsdp2'][2]['gathered_bytes'] == 4 * total
    assert one['fsdp2'][2]['prefetch_bytes'] == 0
    # A bf16 compute dtype gathers half the bytes; the shards keep theirs.
    bf16 = _stats(
        model_stats,
        TINY_FSDP2,
        gpus=(2, ),
        strategy=dict(
            shard_modules=['InternViTBlock', 'InternViT'],
            mp_policy=dict(param_dtype='bfloat16')))
    assert bf16['fsdp2'][2]['gathered_bytes'] == 2 * (total - 2 * TINY_BLOCK)
    assert bf16['fsdp2'][2]['param_bytes'] == ddp['fsdp2'][2]['param_bytes']
    with pytest.raises(
            ValueError,
            match=r"shard_modules \['Block'\] match "
            r'no module of the model; its module classes are: '):
        _stats(
            model_stats,
            TINY_FSDP2,
            gpus=(2, ),
            strategy=dict(shard_modules=['Block']))
    with pytest.raises(
            ValueError,
            match=r"param_dtype should be one of "
            r"\['float32', 'bfloat16', 'float16'\] or None, but "
            r"got 'fp8'"):
        _stats(
            model_stats,
            TINY_FSDP2,
            gpus=(2, ),
            strategy=dict(mp_policy=dict(param_dtype='fp8')))


def test_6b_full_tuning_on_8_gpus(model_stats):
    import torch
    s = _stats(model_stats, FULL_6B, gpus=(8, ))
    model = _model(FULL_6B)
    heads = s['params'] - s['backbone_params']
    backbone_own = s['backbone_params'] - 48 * BLOCK_6B
    assert backbone_own > BLOCK_6B  # so the peak is around a block

    def rank0(p):  # torch.chunk's first piece along dim 0, as fully_shard
        return torch.empty(p.shape or (1, ), device='meta').chunk(8)[0].numel()

    for key, fp32 in (('fsdp2', False), ('fsdp2_fp32', True)):
        m = s[key][8]
        size = (lambda p: 4) if fp32 else (lambda p: p.element_size())
        shards = sum(rank0(p) * size(p) for p in model.parameters())
        assert m['param_bytes'] == m['grad_bytes'] == shards
        assert m['optim_bytes'] == 2 * shards
        # About an eighth of DDP's: only the one-row parameters (the
        # position embedding, 16.6 MB in fp32, and the class token), which
        # rank 0 holds whole, and the 150 classes round up.
        ddp = 4 * s['params'] if fp32 else s['param_bytes']
        one_row = (1 + 1297) * 3200 * (4 if fp32 else 2)
        assert ddp / 8 < shards < ddp / 8 + one_row * 7 / 8 + 2**20
        vit = 4 if fp32 else 2  # the backbone in bf16 as built
        assert m['gathered_bytes'] == 4 * heads + vit * (
            backbone_own + 2 * BLOCK_6B)
        assert m['total_bytes'] == 4 * shards + m['gathered_bytes']
    # As printed: 8.335 GiB as built, 14.675 GiB in fp32.
    assert round(s['fsdp2'][8]['total_bytes'] / 2**30, 3) == 8.335
    assert round(s['fsdp2_fp32'][8]['total_bytes'] / 2**30, 3) == 14.675
    # The DDP keys the other tests read are unchanged.
    assert s['param_bytes'] == 2 * s['backbone_params'] + 4 * heads
    # The FSDP2 recipe also makes each head a unit: the same shards, and
    # the fp32 heads are no longer gathered while the blocks run.
    fsdp2 = _stats(model_stats, FULL_6B_FSDP2, gpus=(8, ))
    for key in ('fsdp2', 'fsdp2_fp32'):
        ours, default = fsdp2[key][8], s[key][8]
        for part in ('param_bytes', 'grad_bytes', 'optim_bytes'):
            assert ours[part] == default[part]
        assert ours['gathered_bytes'] < default['gathered_bytes']
    # As printed: 7.940 GiB as built, 14.051 GiB in fp32.
    assert round(fsdp2['fsdp2'][8]['total_bytes'] / 2**30, 3) == 7.940
    assert round(fsdp2['fsdp2_fp32'][8]['total_bytes'] / 2**30, 3) == 14.051


def _run(*args):
    return subprocess.run([sys.executable, *args],
                          capture_output=True,
                          text=True,
                          timeout=300,
                          cwd=ROOT)


def test_model_stats_prints_fsdp2_lines():
    out = _run(STATS, osp.join('configs', 'intern_vit', TINY_FSDP2), '--gpus',
               '2', '4')
    assert out.returncode == 0, out.stderr[-3000:]
    # MMSegmentation's warnings on building the model, which no user of
    # the tool can act on, stay off the console.
    assert 'build_loss' not in out.stderr, out.stderr
    assert 'avg_non_ignore' not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(':')[0].strip() for line in lines] == [
        'config', 'parameters', 'trainable', 'gradients', 'with comm_hook',
        'memory per GPU', 'DDP buckets', 'hook state', 'in all', 'FSDP2 units',
        'FSDP2 hook state', 'FSDP2 per GPU', '2 GPUs', '4 GPUs',
        'FSDP2 per GPU', '2 GPUs', '4 GPUs', 'FSDP2 hybrid', '2 GPUs a node',
        '4 GPUs a node'
    ]
    # Issue 43: the recipe's sharding='auto' runs hybrid on several nodes:
    # on nodes of each --gpus, full sharding's count over the node, and
    # bf16_compress keeps nothing there either.
    assert lines[-2] == ('  2 GPUs a node   : 8.287 MiB (sharded over the '
                         'node 8.287 MiB, hook state none)')
    assert lines[12].startswith('     2 GPUs       : 8.287 MiB (')
    # Issue 43: DDP's buckets and the hook's state on top of DDP's line
    # (bf16 keeps none; its FSDP2 form neither).
    assert lines[6].startswith('  DDP buckets     : + 2.973 MiB (a second '
                               'copy of the gradients; gradient_as_bucket_'
                               "view=False, DDP's default")
    assert lines[7] == ('  hook state      : none kept from step to step '
                        "(type='bf16_compress')")
    assert lines[10] == ('FSDP2 hook state  : its FSDP2 form keeps none (the '
                         'counts below hold no hook state)')
    del lines[6:9], lines[7]
    # Issue 42: the traffic is counted on the first of --gpus, and the
    # line says so (bf16_compress has a two-level form, not counted).
    assert lines[4] == (
        "with comm_hook    : 1.487 MiB per step (type='bf16_compress'; its "
        'flat form on 2 ranks, the first of --gpus)')
    assert lines[6] == (
        'FSDP2 units       : 1 FCNHead, 1 UPerHead, 4 InternViTBlock, 1 '
        'InternViT, 1 EncoderDecoder (the last: the root, with what the '
        "others leave); shard_modules=['InternViTBlock', 'InternViT', "
        "'UPerHead', 'FCNHead']")
    assert 'parameters fp32 as built' in lines[7]
    assert 'parameters all fp32' in lines[10]
    # 4 * ((779464 - 1152) / 2 + 1152) bytes of parameters on rank 0.
    assert lines[8].strip().startswith('2 GPUs       : ')
    assert 'parameters 1.489 MiB, gradients 1.489 MiB, AdamW moments ' \
        '2.978 MiB' in lines[8]


def test_model_stats_names_the_ranks_a_hook_s_traffic_is_counted_on(
        model_stats, monkeypatch, capsys):
    """Issue 42: a hook's traffic was counted on the first of --gpus
    (documented for FSDP2 only) without a word. A hook without a
    two-level form: the ranks alone (the tool's own main, in this
    process); one whose traffic depends on DDP's buckets is counted on no
    world size, and names none."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, 'argv', [
        STATS,
        osp.join('configs', 'intern_vit', TINY), '--gpus', '4', '16',
        '--cfg-options', 'comm_hook.type=allreduce'
    ])
    load_script(STATS, '_model_stats_world').main()
    assert capsys.readouterr().out.splitlines()[4] == (
        "with comm_hook    : 2.973 MiB per step (type='allreduce'; on 4 "
        'ranks, the first of --gpus)')
    int8 = _stats(
        model_stats, TINY, gpus=(4, ), comm_hook=dict(type='int8_compress'))
    assert (int8['hook_bytes'], int8['hook_world_size'],
            int8['hook_flat']) == (None, None, False)


#: The tiny InternViT's trainable values and their int8 blocks of 256.
TINY_TRAINABLE = 779464
TINY_BLOCKS = math.ceil(TINY_TRAINABLE / 256)


@pytest.mark.parametrize(
    'options,hook,synced,kept',
    [
        # int8 blocks and their fp32 scales all-gathered over 4 nodes every
        # 25 steps; global parameters, momentum and residual in fp32.
        ('type=diloco period=25', "type='diloco', period=25", 4 *
         (TINY_TRAINABLE + 4 * TINY_BLOCKS) / 2 / 25, 12),
        # bf16 all-reduced; no residual, but the inner int8's (4 B a value).
        ('type=diloco period=25 outer_format=bf16 inner.type=int8_compress',
         "type='diloco', period=25, outer_format='bf16', inner={'type': "
         "'int8_compress'}", 2 * TINY_TRAINABLE / 25, 8 + 4),
        # The parameters all-reduced in fp32 every 5 steps; nothing kept.
        ('type=post_local_sgd period=5', "type='post_local_sgd', period=5",
         4 * TINY_TRAINABLE / 5, 0),
    ],
    ids=['diloco-int8', 'diloco-bf16-int8-inner', 'post_local_sgd'])
def test_model_stats_counts_a_periodic_hook(monkeypatch, capsys, options, hook,
                                            synced, kept):
    """Issue 45: their traffic does not depend on DDP's buckets, nor is
    their state unknown: what a rank sends across the 4 nodes per step
    (the synchronisation over the period), and DiLoCo's fp32 outer state
    with the inner hook's; the tool's own main, as a user runs it."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, 'argv', [
        STATS,
        osp.join('configs', 'intern_vit', TINY), '--gpus', '4', '--cfg-options'
    ] + [f'comm_hook.{o}' for o in options.split()])
    load_script(STATS, '_model_stats_periodic').main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == (
        f'with comm_hook    : {synced / 2**20:.3f} MiB per step across nodes, '
        f'averaged over the period ({hook}; on 4 nodes of one rank each, '
        'the first of --gpus: with R ranks a node each sends 1/R of it; '
        'plus the inner exchange inside the node every step)')
    if kept:
        assert lines[7] == (
            f'  hook state      : + {kept * TINY_TRAINABLE / 2**20:.3f} MiB '
            f'per GPU, kept from step to step ({hook}; with one rank a node '
            '(with R, each keeps 1/R of the outer state), the inner hook\'s '
            'state included)')
    else:
        assert lines[7] == ('  hook state      : none kept from step to step '
                            f"({hook}; the inner hook's included)")


def test_a_periodic_hook_sends_nothing_across_one_node(model_stats):
    """On one GPU (one node) nothing crosses nodes; its state is kept all
    the same (DiLoCo on one node is a Lookahead optimizer)."""
    s = _stats(
        model_stats, TINY, gpus=(1, ), comm_hook=dict(type='diloco', period=5))
    assert (s['hook_bytes'], s['hook_world_size'], s['hook_periodic'],
            s['hook_state_bytes']) == (0, 1, True, 12 * TINY_TRAINABLE)


def test_model_stats_counts_the_hooks_state_per_gpu(monkeypatch, capsys):
    """Issue 43: int8's error feedback keeps an fp32 residual per gradient
    element, 6.39e9 x 4 B = 23.79 GiB per GPU for the 6B recipe under DDP
    (the tool's own main, with --cfg-options as a user gives it)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, 'argv', [
        STATS,
        osp.join('configs', 'intern_vit', FULL_6B), '--gpus', '32',
        '--cfg-options', 'comm_hook.type=int8_compress'
    ])
    load_script(STATS, '_model_stats_state').main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[5].startswith('memory per GPU    : 50.239 GiB under DDP')
    assert lines[6].startswith('  DDP buckets     : + 12.560 GiB')
    assert lines[7] == ('  hook state      : + 23.790 GiB per GPU, kept from '
                        "step to step (type='int8_compress')")
    assert lines[8] == ('  in all          : 86.588 GiB per GPU under DDP '
                        'with this comm_hook, activations aside')
    # FSDP2's full sharding refuses int8's error feedback (hybrid keeps
    # the shard's: the next test).
    assert lines[10].startswith('FSDP2 hook state  : it does not run under '
                                'full sharding')


def test_model_stats_counts_int8s_residual_under_hybrid_sharding(
        model_stats, monkeypatch, capsys):
    """Issue 43: under hybrid sharding int8 with error feedback keeps the
    residual of the rank's shard; the tool printed 0 (its full-sharding
    form's). The 6B FSDP2 recipe (sharding='auto') with int8 (the tool's
    own main, as a user runs it): on nodes of 8, 7.94 GiB sharded over the
    node and 2.99 GiB of fp32 residual; full sharding refuses the hook.
    With the config's ranks_per_node the nodes are known, and the count is
    the cost model's to the byte; in bf16, half."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, 'argv', [
        STATS,
        osp.join('configs', 'intern_vit', FULL_6B_FSDP2), '--gpus', '8',
        '--cfg-options', 'comm_hook.type=int8_compress'
    ])
    load_script(STATS, '_model_stats_hybrid').main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[10] == ('FSDP2 hook state  : it does not run under full '
                         'sharding (the counts below hold no hook state)')
    assert lines[-2].startswith(
        "FSDP2 hybrid      : the config's sharding='auto' (hybrid on several "
        "nodes of several ranks where the node's shard fits the GPU, else "
        'full), on nodes of each of --gpus (the config states no '
        'ranks_per_node, and the tool does not know the nodes')
    assert lines[-2].endswith("(int8_compress with error feedback: an fp32 "
                              "residual of the rank's shard)")
    assert lines[-1] == ('  8 GPUs a node   : 10.927 GiB (sharded over the '
                         'node 7.940 GiB, hook state 2.987 GiB)')
    from mmcv_custom.analysis import cost
    bf16 = dict(type='int8_compress', residual_dtype='bfloat16')
    s = _stats(
        model_stats,
        FULL_6B_FSDP2,
        gpus=(8, 32),
        comm_hook=bf16,
        strategy=dict(ranks_per_node=8))
    (layout, ) = s['hybrid']['layouts']  # 8 GPUs: one node, full there
    assert (layout['ranks_per_node'], layout['nodes']) == (8, 4)
    # The cost model's residual of the 6B's shard on 4 x 8 (its test):
    # 801,881,288 values, 2 bytes each.
    assert layout['state_bytes'] == 2 * 801_881_288
    assert layout['memory'] == s['fsdp2'][8]
    assert (layout['memory']['total_bytes'] + layout['state_bytes']
            ) / cost.GiB <= 1.2 * s['fsdp2'][8]['total_bytes'] / cost.GiB
    assert s['hook_state_fsdp2'] is None
    assert s['ddp_note'] == ("under DDP int8's residual is fp32: "
                             "residual_dtype is hybrid sharding's")


def test_model_stats_refuses_residual_dtype_where_nothing_shards_hybrid():
    out = _run(STATS, osp.join('configs', 'intern_vit', TINY), '--cfg-options',
               'comm_hook.type=int8_compress',
               'comm_hook.residual_dtype=bfloat16')
    assert out.returncode == 1 and out.stdout == ''
    assert out.stderr.splitlines()[-1] == (
        "model_stats.py: error: comm_hook int8_compress residual_dtype="
        "'bfloat16' is hybrid sharding's (FSDP2Strategy sharding='hybrid', "
        "or 'auto' on several nodes of several ranks), where the error "
        "feedback of each rank's shard is kept; under full sharding int8 "
        'keeps none and under DDP its residual is fp32. Remove '
        'residual_dtype, or shard hybrid.')


def test_model_stats_bad_gpus_is_a_usage_error():
    out = _run(STATS, osp.join('configs', 'intern_vit', TINY), '--gpus', '8',
               '0')
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        'model_stats.py: error: --gpus should be positive numbers of GPUs, '
        'but got 0')


@pytest.fixture
def bench_args(monkeypatch, capsys):
    return usage_errors(
        load_script(BENCH, '_benchmark_fsdp2'), BENCH, monkeypatch, capsys)


@pytest.mark.parametrize(
    'args,message', [
        (['--nproc', '1'], '--nproc should be at least 2 (FSDP2 against DDP '
         'needs ranks to shard over), but got 1'),
        (['--iters', '0'], '--iters should be at least 1, but got 0'),
        (['--warmup', '0'], '--warmup should be at least 1, but got 0'),
        (['--config', 'configs/none.py'
          ], f'--config configs/none.py: no such file in {ROOT}'),
        (['--json', '/nonexistent/f.json'
          ], '--json /nonexistent/f.json: cannot write there (No such file or '
         'directory)'),
        (['--json', '.'], '--json .: is a directory, not a file'),
        (['--config', 'README.md'
          ], f'--config {ROOT}/README.md: cannot read it as a config '
         '(OSError: Only py/yml/yaml/json type are supported now!)'),
    ],
    ids=[
        'nproc', 'iters', 'warmup', 'config', 'json-dir-missing',
        'json-is-a-dir', 'config-not-a-config'
    ])
def test_benchmark_usage_errors(bench_args, args, message):
    assert bench_args(args) == (2, f'benchmark_fsdp2.py: error: {message}')


@pytest.mark.slow
def test_benchmark_measures_a_half_per_rank(tmp_path):
    out = _run(BENCH, '--nproc', '2', '--iters', '1', '--warmup', '1',
               '--json', str(tmp_path / 'f.json'))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = lines.index('| per rank | DDP | FSDP2 (rank 0) | FSDP2 / DDP '
                         '| 1/N | model_stats (rank 0) |')
    rows = [
        line.split(' | ')[0][2:] for line in lines[header + 2:]
        if line.startswith('|')
    ]
    assert rows == [
        'parameters', 'gradients', 'optimizer state', 'all three',
        'gathered at once (FSDP2)', 'step time (median)'
    ]
    data = json.load(open(tmp_path / 'f.json'))
    assert data['world_size'] == 2
    predicted = data['predicted_fsdp2_rank0']
    ranks = data['ranks']
    ddp = ranks[0]['ddp']
    for r in ranks:
        assert r['ddp'] == ddp  # DDP replicates everything
    steps = ddp['optim_step_bytes']
    assert steps == 4 * data['trainable_tensors']  # one fp32 step each
    for key in ('param_bytes', 'grad_bytes', 'optim_bytes'):
        shards = [
            r['fsdp2'][key] - (steps if key == 'optim_bytes' else 0)
            for r in ranks
        ]
        whole = ddp[key] - (steps if key == 'optim_bytes' else 0)
        # The shards add up to the whole, rank 0's is the largest, as
        # model_stats.py predicts, and about half.
        assert sum(shards) == whole, key
        assert shards[0] == max(shards) == predicted[key], key
        assert math.isclose(shards[0] / whole, 0.5, abs_tol=0.01), key
    assert ranks[0]['fsdp2']['gathered_peak_bytes'] == (
        predicted['gathered_bytes'] - predicted['prefetch_bytes'])
    assert set(data['step_s']) == {'ddp', 'fsdp2'}
