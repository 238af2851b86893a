"""Every comm_hook value is checked before anything is built; the telemetry
counts what DDP would have sent without the hook, in the bucket's dtype."""
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom import (COMM_HOOK_STATES, COMM_HOOKS, CommCounter,
                         CompressState, allreduce_hook, build_comm_hook,
                         check_comm_hook_cfg, require_bool, require_int,
                         require_real, with_args_check)
from mmcv_custom.comm.builder import CommHookConfigError
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner

RANK_RULE = 'matrix_approximation_rank should be an int >= 1, but got'
FACTOR_RULE = 'predivide_factor should be None or a finite real number > 0'
PYTORCH_START_RULE = (
    'start_powerSGD_iter should be > 1 when use_error_feedback or '
    'warm_start is True (both are by default), because PowerSGD can only be '
    "applied after DDP's first two iterations (PyTorch's rule), but got 1. "
    'Set start_powerSGD_iter >= 2, or use_error_feedback=False and '
    'warm_start=False.')

BAD_VALUES = [
    # PowerSGD: PyTorch's PowerSGDState takes all of these as given.
    (dict(type='powerSGD', matrix_approximation_rank=0), ValueError,
     f'comm_hook powerSGD: {RANK_RULE} 0'),
    (dict(type='powerSGD', matrix_approximation_rank=-1), ValueError,
     f'comm_hook powerSGD: {RANK_RULE} -1'),
    (dict(type='powerSGD', matrix_approximation_rank='two'), TypeError,
     f"comm_hook powerSGD: {RANK_RULE} str: 'two'"),
    # bool is a subclass of int, but True is no rank.
    (dict(type='powerSGD', matrix_approximation_rank=True), TypeError,
     f'comm_hook powerSGD: {RANK_RULE} bool: True'),
    (dict(type='powerSGD', matrix_approximation_rank=2.0), TypeError,
     f'comm_hook powerSGD: {RANK_RULE} float: 2.0'),
    # Checked with a wrapper too, and under the other name of the factory.
    (dict(type='powerSGD', wrapper='bf16', matrix_approximation_rank=0),
     ValueError, f'comm_hook powerSGD: {RANK_RULE} 0'),
    (dict(type='batched_powerSGD', matrix_approximation_rank=0), ValueError,
     f'comm_hook batched_powerSGD: {RANK_RULE} 0'),
    (dict(
        type='powerSGD',
        start_powerSGD_iter=0,
        use_error_feedback=False,
        warm_start=False), ValueError,
     'comm_hook powerSGD: start_powerSGD_iter should be an int >= 1, but '
     'got 0'),
    (dict(type='powerSGD', start_powerSGD_iter='1000'), TypeError,
     'comm_hook powerSGD: start_powerSGD_iter should be an int >= 1, but '
     "got str: '1000'"),
    # PyTorch's own rule, which PowerSGDState.__init__ raises at build time.
    (dict(type='powerSGD', start_powerSGD_iter=1), ValueError,
     f'comm_hook powerSGD: {PYTORCH_START_RULE}'),
    (dict(type='powerSGD', start_powerSGD_iter=1, warm_start=False),
     ValueError, f'comm_hook powerSGD: {PYTORCH_START_RULE}'),
    (dict(
        type='batched_powerSGD',
        start_powerSGD_iter=1,
        use_error_feedback=False), ValueError,
     f'comm_hook batched_powerSGD: {PYTORCH_START_RULE}'),
    (dict(type='powerSGD', min_compression_rate=0), ValueError,
     'comm_hook powerSGD: min_compression_rate should be a finite real '
     'number > 0, but got 0'),
    (dict(type='powerSGD', min_compression_rate=-1.5), ValueError,
     'comm_hook powerSGD: min_compression_rate should be a finite real '
     'number > 0, but got -1.5'),
    (dict(type='powerSGD', min_compression_rate=float('inf')), ValueError,
     'comm_hook powerSGD: min_compression_rate should be a finite real '
     'number > 0, but got inf'),
    (dict(type='powerSGD', min_compression_rate='2'), TypeError,
     'comm_hook powerSGD: min_compression_rate should be a finite real '
     "number > 0, but got str: '2'"),
    (dict(type='powerSGD', orthogonalization_epsilon=-1e-8), ValueError,
     'comm_hook powerSGD: orthogonalization_epsilon should be a finite real '
     'number >= 0, but got -1e-08'),
    (dict(type='powerSGD', orthogonalization_epsilon=float('nan')), ValueError,
     'comm_hook powerSGD: orthogonalization_epsilon should be a '
     'finite real number >= 0, but got nan'),
    (dict(type='powerSGD', use_error_feedback='no'), TypeError,
     'comm_hook powerSGD: use_error_feedback should be True or False, but '
     "got str: 'no'"),
    (dict(type='powerSGD', warm_start=1), TypeError,
     'comm_hook powerSGD: warm_start should be True or False, but got int: '
     '1'),
    (dict(type='powerSGD', batch_tensors_with_same_shape='yes'), TypeError,
     'comm_hook powerSGD: batch_tensors_with_same_shape should be True or '
     "False, but got str: 'yes'"),
    (dict(type='powerSGD', random_seed=-1), ValueError,
     'comm_hook powerSGD: random_seed should be an int in [0, 4294967295], '
     'but got -1'),
    (dict(type='powerSGD', random_seed=2**32), ValueError,
     'comm_hook powerSGD: random_seed should be an int in [0, 4294967295], '
     'but got 4294967296'),
    (dict(type='powerSGD', random_seed=0.5), TypeError,
     'comm_hook powerSGD: random_seed should be an int in [0, 4294967295], '
     'but got float: 0.5'),
    # PyTorch quietly raises it to 1.
    (dict(type='powerSGD', compression_stats_logging_frequency=0), ValueError,
     'comm_hook powerSGD: compression_stats_logging_frequency '
     'should be an int >= 1, but got 0'),
    # fp16 and bf16: CompressState.
    (dict(type='fp16_compress', predivide_factor=0), ValueError,
     f'comm_hook fp16_compress: {FACTOR_RULE}, but got 0'),
    (dict(type='fp16_compress', predivide_factor=-2), ValueError,
     f'comm_hook fp16_compress: {FACTOR_RULE}, but got -2'),
    (dict(type='fp16_compress', predivide_factor=float('inf')), ValueError,
     f'comm_hook fp16_compress: {FACTOR_RULE}, but got inf'),
    (dict(type='fp16_compress', predivide_factor=float('nan')), ValueError,
     f'comm_hook fp16_compress: {FACTOR_RULE}, but got nan'),
    (dict(type='fp16_compress', predivide_factor='2'), TypeError,
     f"comm_hook fp16_compress: {FACTOR_RULE}, but got str: '2'"),
    (dict(type='fp16_compress', predivide_factor=True), TypeError,
     f'comm_hook fp16_compress: {FACTOR_RULE}, but got bool: True'),
    (dict(type='fp16_compress', check_finite='no'), TypeError,
     'comm_hook fp16_compress: check_finite should be True or False, but got '
     "str: 'no'"),
    (dict(type='bf16_compress', check_finite='no'), TypeError,
     'comm_hook bf16_compress: check_finite should be True or False, but got '
     "str: 'no'"),
    (dict(type='bf16_compress', check_finite=None), TypeError,
     'comm_hook bf16_compress: check_finite should be True or False, but got '
     'NoneType: None'),
]


@pytest.mark.parametrize('cfg,error,message', BAD_VALUES)
def test_bad_values_are_rejected_with_key_rule_and_value(cfg, error, message):
    with pytest.raises(error) as info:
        check_comm_hook_cfg(cfg)
    assert type(info.value) is error
    assert str(info.value) == message


@pytest.mark.parametrize('name,hint',
                         [('DiLoCo', " (did you mean 'diloco'?)"),
                          ('bf16', " (did you mean 'bf16_compress'?)"),
                          ('powersgd', " (did you mean 'powerSGD' or "
                           "'batched_powerSGD'?)"),
                          ('local_sgd', " (did you mean 'post_local_sgd'?)"),
                          ('nope', '')])
def test_an_unknown_type_names_the_close_ones(name, hint):
    with pytest.raises(KeyError) as info:
        check_comm_hook_cfg(dict(type=name))
    assert info.value.args[0].startswith(
        f"comm_hook type {name!r} is not in the mmcv_custom::DDP "
        f'communication hook registry{hint}. Valid types: allreduce, ')


def test_every_problem_is_named_at_once():
    # One problem: its own error, as before.
    with pytest.raises(TypeError, match=r"unexpected keys \['rank'\]"):
        check_comm_hook_cfg(dict(type='powerSGD', rank=2))
    # Several: one error naming each, in the order of the config.
    with pytest.raises(CommHookConfigError) as info:
        check_comm_hook_cfg(
            dict(
                type='powerSGD',
                wrapper='fp8',
                rank=2,
                matrix_approximation_rank=0,
                min_compression_rate='high'))
    assert [type(e) for e in info.value.errors
            ] == [ValueError, TypeError, ValueError, TypeError]
    assert str(info.value) == (
        "comm_hook has 4 problems: (1) comm_hook wrapper should be 'fp16', "
        "'bf16' or None, but got 'fp8'; (2) comm_hook type 'powerSGD' got "
        "unexpected keys ['rank']. Valid keys: type, wrapper, "
        'matrix_approximation_rank, start_powerSGD_iter, '
        'min_compression_rate, use_error_feedback, warm_start, '
        'orthogonalization_epsilon, random_seed, '
        'compression_stats_logging_frequency, batch_tensors_with_same_shape '
        "(the process group is the DDP model's own).; (3) comm_hook "
        'powerSGD: matrix_approximation_rank should be an int >= 1, but got '
        '0; (4) comm_hook powerSGD: min_compression_rate should be a '
        "finite real number > 0, but got str: 'high'")
    # A rule between keys is not taken for a bad value of one of them:
    # start_powerSGD_iter=1 is right beside use_error_feedback=False.
    with pytest.raises(ValueError) as info:
        check_comm_hook_cfg(
            dict(
                type='batched_powerSGD',
                start_powerSGD_iter=1,
                use_error_feedback=False,
                warm_start=False,
                matrix_approximation_rank=0))
    assert str(info.value) == ('comm_hook batched_powerSGD: '
                               'matrix_approximation_rank should be an int '
                               '>= 1, but got 0')
    # An unknown type: the keys cannot be judged, the wrapper can.
    with pytest.raises(CommHookConfigError) as info:
        check_comm_hook_cfg(dict(type='int9', wrapper='fp8', rank=2))
    assert [type(e) for e in info.value.errors] == [KeyError, ValueError]


@pytest.mark.parametrize(
    'cfg',
    [
        dict(
            type='powerSGD',
            matrix_approximation_rank=np.int64(4),
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
            orthogonalization_epsilon=0,
            random_seed=2**32 - 1,
            compression_stats_logging_frequency=1,
            batch_tensors_with_same_shape=True),
        # PyTorch allows iteration 1 without error feedback and warm start.
        dict(
            type='batched_powerSGD',
            start_powerSGD_iter=1,
            use_error_feedback=False,
            warm_start=False),
        dict(type='fp16_compress', predivide_factor=2.5, check_finite=False),
        dict(type='fp16_compress', predivide_factor=None),
        dict(type='bf16_compress', check_finite=True),
    ])
def test_good_values_pass_unchanged(cfg):
    checked = check_comm_hook_cfg(cfg)
    expected = {k: v for k, v in cfg.items() if k != 'type'}
    if 'powerSGD' in cfg['type'] and 'orthogonalization_epsilon' not in cfg:
        expected['orthogonalization_epsilon'] = 1e-8
    assert checked['state_kwargs'] == expected


def test_compress_state_checks_its_arguments_without_the_registry():
    with pytest.raises(TypeError) as info:
        CompressState(predivide_factor='2')
    assert str(info.value) == f"{FACTOR_RULE}, but got str: '2'"
    with pytest.raises(ValueError) as info:
        CompressState(predivide_factor=float('inf'))
    assert str(info.value) == f'{FACTOR_RULE}, but got inf'
    with pytest.raises(TypeError) as info:
        CompressState(check_finite='no')
    assert str(info.value) == ("check_finite should be True or False, but "
                               "got str: 'no'")


def test_require_helpers_word_errors_alike():
    with pytest.raises(ValueError) as info:
        require_int('n', 11, minimum=1, maximum=10)
    assert str(info.value) == 'n should be an int in [1, 10], but got 11'
    with pytest.raises(ValueError) as info:
        require_real('x', 0.0, minimum=0, inclusive=False)
    assert str(info.value) == 'x should be a finite real number > 0, but ' \
        'got 0.0'
    with pytest.raises(TypeError) as info:
        require_real('x', [1], allow_none=True)
    assert str(info.value) == 'x should be None or a finite real number, ' \
        'but got list: [1]'
    require_real('x', None, minimum=0, allow_none=True)
    with pytest.raises(TypeError) as info:
        require_bool('flag', 0)
    assert str(info.value) == 'flag should be True or False, but got int: 0'
    with pytest.raises(TypeError) as info:
        with_args_check('not callable')
    assert str(info.value) == ('with_args_check needs a callable '
                               "check(args), but got str: 'not callable'")


def _bad_value_run(rank, world_size, work_dir, cfg, launcher):
    runner, records = build_runner(work_dir, cfg, launcher=launcher)
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    try:
        runner.train()
    except (TypeError, ValueError) as e:
        unchanged = all(
            torch.equal(v, before[k])
            for k, v in runner.model.state_dict().items())
        return (type(e).__name__, str(e), runner.iter,
                any('loss:' in m for _, m in records.lines), unchanged)
    return None


# Values rejected at the start of a run, before any iteration; a single
# process (launcher 'none', no DDP, nothing registered) included.
@pytest.mark.parametrize('cfg,error,message', [
    (dict(type='powerSGD', matrix_approximation_rank=0, start_powerSGD_iter=2),
     'ValueError', f'comm_hook powerSGD: {RANK_RULE} 0'),
    (dict(type='fp16_compress', predivide_factor=0), 'ValueError',
     f'comm_hook fp16_compress: {FACTOR_RULE}, but got 0'),
    (dict(type='bf16_compress', check_finite='no'), 'TypeError',
     'comm_hook bf16_compress: check_finite should be True or False, but '
     "got str: 'no'"),
])
def test_single_process_runner_fails_before_training(tmp_path, cfg, error,
                                                     message):
    # In a forked process, as the suite's other Runners: MMEngine names its
    # logger and visualizer by the second, and later forks need a pytest
    # process without OpenMP threads.
    (name, text, *rest), = run_ranks(
        _bad_value_run, str(tmp_path), cfg, 'none', world_size=1)
    assert name == error and rest == [0, False, True]
    if error == 'TypeError':
        # MMEngine's Runner.call_hook names the hook after a TypeError.
        message += (' in <mmcv_custom.engine.comm_hook_registration_hook.'
                    'CommHookRegistrationHook object at ')
        assert text.startswith(message)
    else:
        assert text == message


def test_two_rank_runner_fails_before_training(tmp_path):
    results = run_ranks(
        _bad_value_run, str(tmp_path),
        dict(
            type='powerSGD',
            matrix_approximation_rank=-1,
            start_powerSGD_iter=2), 'pytorch')
    assert results == [
        ('ValueError', f'comm_hook powerSGD: {RANK_RULE} -1', 0, False, True)
    ] * 2


# -- a user's stateful hook with a check of its own -----------------------


@pytest.fixture
def register():
    """``register(name, hook, factory=None)`` for this test only: the
    registries are global, and test_registry.py checks the built-in names.
    Ranks forked during the test inherit the registrations."""
    names = []

    def _register(name, hook, factory=None):
        COMM_HOOKS.register_module(name=name, module=hook, force=True)
        if factory is not None:
            COMM_HOOK_STATES.register_module(
                name=name, module=factory, force=True)
        names.append(name)

    yield _register
    for name in names:
        COMM_HOOKS.module_dict.pop(name, None)
        COMM_HOOK_STATES.module_dict.pop(name, None)


def _check_scale(args):
    require_real('scale', args['scale'], minimum=0, inclusive=False)


@with_args_check(_check_scale)
def _scaled_state(process_group, scale=1.0):
    return dict(group=process_group, scale=scale, calls=[])


def _scaled_allreduce(state, bucket):
    """Average, then scale the gradients (scale=0 would stop training)."""
    state['calls'].append(bucket.index())
    return allreduce_hook(
        state['group'],
        bucket).then(lambda fut: fut.value().mul_(state['scale']))


def test_user_check_rejects_and_accepts(register):
    register('scaled_allreduce', _scaled_allreduce, _scaled_state)
    with pytest.raises(ValueError) as info:
        check_comm_hook_cfg(dict(type='scaled_allreduce', scale=0))
    assert str(info.value) == ('comm_hook scaled_allreduce: scale should be '
                               'a finite real number > 0, but got 0')
    with pytest.raises(TypeError) as info:
        check_comm_hook_cfg(dict(type='scaled_allreduce', scale='half'))
    assert str(info.value) == ('comm_hook scaled_allreduce: scale should be '
                               "a finite real number > 0, but got str: "
                               "'half'")
    checked = check_comm_hook_cfg(
        dict(type='scaled_allreduce', wrapper='bf16', scale=0.5))
    assert checked['state_kwargs'] == dict(scale=0.5)
    # The default is checked too, and passes.
    assert check_comm_hook_cfg(
        dict(type='scaled_allreduce'))['state_kwargs'] == {}


def _user_hook_trains(rank, world_size, work_dir):
    runner, _ = build_runner(
        work_dir, dict(type='scaled_allreduce', scale=0.5), max_iters=3)
    start = [p.detach().clone() for p in runner.model.parameters()]
    runner.train()
    after = [p.detach().clone() for p in runner.model.parameters()]
    # And the exact gradient through a plain DDP model.
    built = build_comm_hook(dict(type='scaled_allreduce', scale=0.5))
    model = DDP(nn.Linear(4, 2))
    model.register_comm_hook(built.state, built.hook)
    model(torch.ones(2, 4) * (rank + 1)).sum().backward()
    return start, after, model.module.weight.grad, built.state['calls']


def test_user_stateful_hook_with_check_trains_on_two_ranks(tmp_path, register):
    register('scaled_allreduce', _scaled_allreduce, _scaled_state)
    (start0, after0, grad, calls), (start1, after1,
                                    *_) = run_ranks(_user_hook_trains,
                                                    str(tmp_path))
    for a, b, s in zip(after0, after1, start0):
        assert torch.equal(a, b)  # in sync
        assert not torch.equal(a, s)  # trained
    # Two rows of (rank + 1): gradients 2 and 4, averaged to 3, scaled.
    assert torch.equal(grad, torch.full((2, 4), 1.5))
    assert calls == [0]


def test_check_sees_config_values_over_factory_defaults(register):
    seen = []

    def _seen_state(process_group, a=1, b='x', *, c=None):
        return None

    # The attribute works as the decorator does.
    _seen_state.check_args = seen.append
    register('seen_allreduce', allreduce_hook, _seen_state)
    check_comm_hook_cfg(dict(type='seen_allreduce', b='y'))
    assert seen == [dict(a=1, b='y', c=None)]


def _unchecked_state(process_group, tag=None):
    return dict(group=process_group, tag=tag)


def _unchecked_allreduce(state, bucket):
    return allreduce_hook(state['group'], bucket)


def _unchecked_rank(rank, world_size):
    spec = build_comm_hook(dict(type='unchecked_allreduce', tag=['any', 1]))
    model = DDP(nn.Linear(4, 2))
    model.register_comm_hook(spec.state, spec.hook)
    model(torch.ones(2, 4) * (rank + 1)).sum().backward()
    return spec.state['tag'], model.module.weight.grad


def test_user_factory_without_check_works_as_before(register):
    register('unchecked_allreduce', _unchecked_allreduce, _unchecked_state)
    assert not hasattr(_unchecked_state, 'check_args')
    checked = check_comm_hook_cfg(dict(type='unchecked_allreduce', tag=0))
    assert checked['state_kwargs'] == dict(tag=0)
    (tag, grad), _ = run_ranks(_unchecked_rank)
    assert tag == ['any', 1]
    assert torch.equal(grad, torch.full((2, 4), 3.0))


# -- telemetry --------------------------------------------------------------


class _TwoLayers(nn.Module):
    """Linear(16, 64) then Linear(64, 4): 1348 numbers in one bucket."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 4)

    def forward(self, x):
        return self.b(self.a(x)).sum()


NUMEL = 64 * 16 + 64 + 4 * 64 + 4  # 1348


def _traffic(rank, world_size, cfg, dtype, steps, rank0_after_build=False):
    torch.manual_seed(0)
    model = DDP(_TwoLayers().to(dtype))
    counter = CommCounter()
    spec = build_comm_hook(cfg, counter=counter)
    if rank0_after_build:
        # A state changed by hand after the checks: compresses to nothing.
        spec.state.matrix_approximation_rank = 0
    model.register_comm_hook(spec.state, spec.hook)
    popped = []
    for step in range(steps):
        model.zero_grad()
        torch.manual_seed(step + 10 * rank)
        model(torch.randn(8, 16, dtype=dtype)).backward()
        popped.append(counter.pop())
    return popped, [p.grad.dtype for p in model.parameters()]


@pytest.mark.parametrize(
    'cfg,dtype,baseline,wire',
    [
        # A bf16 model's buckets are bf16: DDP alone would send 2 bytes each.
        (dict(type='bf16_compress'), torch.bfloat16, NUMEL * 2, NUMEL * 2),
        (dict(type='allreduce'), torch.bfloat16, NUMEL * 2, NUMEL * 2),
        (dict(type='bf16_compress'), torch.float32, NUMEL * 4, NUMEL * 2),
        (dict(type='allreduce'), torch.float64, NUMEL * 8, NUMEL * 8),
    ])
def test_baseline_is_what_ddp_would_send_in_the_bucket_dtype(
        cfg, dtype, baseline, wire):
    popped, grad_dtypes = run_ranks(_traffic, cfg, dtype, 1)[0]
    assert grad_dtypes == [dtype] * 4
    assert popped == [(baseline, wire)]


@pytest.mark.parametrize(
    'cfg',
    [dict(type='fp16_compress'),
     dict(type='allreduce', wrapper='fp16')])
def test_fp16_sends_bf16_buckets_as_they_are(cfg):
    # fp16 has less range than bf16: a bf16 bucket goes out as bf16 (same
    # bytes), the gradients stay bf16 (tests/test_bf16_backbone.py checks
    # the values).
    popped, grad_dtypes = run_ranks(_traffic, cfg, torch.bfloat16, 1)[0]
    assert grad_dtypes == [torch.bfloat16] * 4
    assert popped == [(NUMEL * 2, NUMEL * 2)]


# By hand, rank 2 and min_compression_rate 2: a (rows, cols) matrix is
# compressed when 2 * (rows + cols) * rank < rows * cols, and then sent as
# P (rows x rank) and Q (cols x rank); anything else is sent as it is, a
# bias of n as an (n, 1) matrix.
#   a.weight (64, 16): 2 * 80 * 2 = 320 < 1024, sent as 128 + 32 = 160
#   b.weight (4, 64):  rank min(4, 64, 2) = 2, 2 * 68 * 2 = 272 >= 256: 256
#   a.bias (64, 1):    rank 1, 2 * 65 = 130 >= 64: 64
#   b.bias (4, 1):     4
POWERSGD_SENT = 160 + 256 + 64 + 4  # 484


@pytest.mark.parametrize('wrapper,size', [(None, 4), ('bf16', 2), ('fp16', 2)])
def test_powersgd_counts_factors_and_uncompressed_tensors(wrapper, size):
    cfg = dict(
        type='powerSGD',
        wrapper=wrapper,
        matrix_approximation_rank=2,
        start_powerSGD_iter=2)
    popped, _ = run_ranks(_traffic, cfg, torch.float32, 4)[0]
    # Plain all-reduces in the sent format until iteration 2, then the
    # factors and the uncompressed tensors.
    assert popped == [(NUMEL * 4, NUMEL * size)
                      ] * 2 + [(NUMEL * 4, POWERSGD_SENT * size)] * 2


def test_powersgd_that_sends_nothing_is_counted_as_nothing():
    # With rank 0 every tensor "compresses" to 0 numbers: the gradients
    # become zero and nothing is sent. Only the warm-up all-reduces count.
    cfg = dict(type='powerSGD', start_powerSGD_iter=2)
    popped, _ = run_ranks(_traffic, cfg, torch.float32, 3, True)[0]
    assert popped == [(NUMEL * 4, NUMEL * 4)] * 2 + [(NUMEL * 4, 0)]


def _described(rank, world_size):
    """What the runner hook's log line says of each compressing state,
    with the process group up."""
    return [
        repr(build_comm_hook(cfg).state) for cfg in (
            dict(type='fp16_compress'),
            dict(type='fp16_compress', predivide_factor=4, check_finite=False),
            dict(type='bf16_compress'),
        )
    ] + [repr(CompressState(None))]


def test_compress_state_says_the_predivide_factor_in_effect():
    # fp16: the value the hook will divide by, its default from the world
    # size; bf16 has none (it divides before the cast).
    assert run_ranks(
        _described, world_size=4
    )[0] == [
        'CompressState(predivide_factor=2 (default for 4 ranks), '
        'check_finite=True)',
        'CompressState(predivide_factor=4, check_finite=False)',
        'CompressState(divides by the world size before the bf16 cast, '
        'check_finite=False)',
        # Built by hand, not told which hook it goes with.
        'CompressState(predivide_factor=2 (default for 4 ranks) (fp16 only), '
        'check_finite=False)',
    ]
    # Before any process group exists, the rule.
    assert repr(CompressState(None, wire='fp16')) == (
        'CompressState(predivide_factor=default_predivide_factor(world '
        'size), check_finite=False)')


def test_compress_state_wire_is_checked():
    with pytest.raises(ValueError) as info:
        CompressState(wire='int8')
    assert str(info.value) == ("wire should be 'fp16', 'bf16' or None, but "
                               "got 'int8'")
    with pytest.raises(ValueError) as info:
        CompressState(predivide_factor=2, wire='bf16')
    assert str(info.value) == (
        "predivide_factor applies to fp16 only, but got 2 with wire='bf16': "
        "bf16 has fp32's range and always divides by the world size before "
        'the cast')
