"""``comm_hook = dict(type='auto')`` below the runner (issue 31): its
config, its candidates read from the records, the class rule it shares
with ``--recommend``, and one decision agreed on by ranks that measured
different steps."""
import pytest

from mmcv_custom.comm.accuracy import choose_by_class, picked
from mmcv_custom.comm.auto import (AutoTrials, auto_candidates, auto_settings,
                                   check_auto_cfg)
from mmcv_custom.comm.builder import build_comm_hook, check_comm_hook_cfg
from mmcv_custom.comm.config import comm_hook_config
from mmcv_custom.comm.sharded import (build_sharded_comm, check_sharded_cfg,
                                      sharded_auto_candidates)
from mmcv_custom.testing import run_ranks


def test_defaults_and_every_bad_value_named():
    assert check_comm_hook_cfg(dict(type='auto')) == dict(
        type='auto',
        max_loss='quantized_ef',
        min_gain=0.1,
        trial_iters=3,
        candidates=None)
    bad = {
        'min_gain=10': (ValueError, 'did you mean 0.1'),
        'min_gain=-0.1': (ValueError, 'min_gain should be'),
        "max_loss='lossy'": (ValueError, 'exact, half, quantized_ef'),
        'trial_iters=0': (ValueError, 'trial_iters should be an int >= 1'),
        "topology='flat'": (TypeError, 'name a hook instead'),
        "wrapper='bf16'": (TypeError, 'name a hook instead'),
        'rounds=3': (TypeError, 'its keys: max_loss'),
        "candidates='int8_compress'": (TypeError, 'a list of hook names'),
        "candidates=['int9']": (ValueError, 'registered: allreduce'),
        "candidates=['powerSGD']": (ValueError, 'raise max_loss'),
    }
    for pair, (kind, words) in bad.items():
        with pytest.raises(kind, match=words):
            auto_settings([pair])
    with pytest.raises(ValueError, match='KEY=VALUE'):
        auto_settings(['max_loss'])


def test_auto_is_no_hook_to_build_and_under_fsdp2_tries_sharded_forms():
    with pytest.raises(ValueError, match='not one hook'):
        build_comm_hook(dict(type='auto'))
    with pytest.raises(ValueError, match='not one reduce-scatter'):
        build_sharded_comm(dict(type='auto'))
    # Under FSDP2: the forms with a reduce-scatter; int8 only without
    # error feedback, a lossier class than the default max_loss.
    assert [c.key for c in sharded_auto_candidates(auto_settings([]))] == [
        'allreduce', 'fp16_compress', 'fp16_compress, two-level',
        'bf16_compress', 'bf16_compress, two-level'
    ]
    assert 'int8_compress error_feedback=False' in [
        c.key for c in sharded_auto_candidates(
            auto_settings(['max_loss=quantized']))
    ]
    with pytest.raises(KeyError, match=r"\(or 'auto'\)"):
        check_comm_hook_cfg(dict(type='autoo'))


# What runs under FSDP2, and the max_loss each needs (issue 42).
UNDER_FSDP2 = (
    ". The candidates that run under FSDP2, with the max_loss each needs: "
    "allreduce (max_loss='exact'), fp16_compress (max_loss='half'), "
    "bf16_compress (max_loss='half'), int8_compress error_feedback=False "
    "(max_loss='quantized'); name those in candidates (or leave candidates "
    'out)')


def _fsdp2_refusal(cfg: dict) -> str:
    with pytest.raises(ValueError) as info:
        check_sharded_cfg(cfg)
    return str(info.value)


def test_auto_under_fsdp2_names_what_runs_there_not_raise_max_loss():
    # DDP runs every hook: raising max_loss is what lets powerSGD in.
    with pytest.raises(ValueError, match='raise max_loss or name other'):
        check_comm_hook_cfg(dict(type='auto', candidates=['powerSGD']))
    # Under FSDP2 no max_loss would: it has no sharded form.
    for cfg in (dict(type='auto', candidates=['powerSGD']),
                dict(type='auto', candidates=['powerSGD'], max_loss='any')):
        message = _fsdp2_refusal(cfg)
        allowed = ('at any max_loss' if 'max_loss' in cfg else
                   "at max_loss='quantized_ef' or below")
        assert message == (
            "comm_hook type='auto' under FSDP2 (FSDP2Strategy): none of "
            f"['powerSGD'] runs under FSDP2 {allowed}" +
            '; powerSGD has no sharded form at any max_loss (FSDP2 '
            'reduce-scatters; DDP communication hooks do not run under it)' +
            UNDER_FSDP2)
        assert 'raise max_loss' not in message
    # Where a named hook does run at a lossier class, raising max_loss
    # is the fix, and says to what.
    named = ['batched_powerSGD', 'int8_compress']
    assert _fsdp2_refusal(dict(type='auto', candidates=named)) == (
        "comm_hook type='auto' under FSDP2 (FSDP2Strategy): none of "
        "['batched_powerSGD', 'int8_compress'] runs under FSDP2 at "
        "max_loss='quantized_ef' or below; int8_compress "
        "error_feedback=False does from max_loss='quantized' on: raise "
        "max_loss to 'quantized'; batched_powerSGD has no sharded form at "
        'any max_loss (FSDP2 reduce-scatters; DDP communication hooks do '
        'not run under it)' + UNDER_FSDP2)
    assert "raise max_loss to 'half'" in _fsdp2_refusal(
        dict(type='auto', candidates=['fp16_compress'], max_loss='exact'))
    check_sharded_cfg(
        dict(type='auto', candidates=['int8_compress'], max_loss='quantized'))


def test_candidates_are_the_records_settings_the_class_allows():
    keys = {c.key: c.klass for c in auto_candidates('quantized_ef')}
    assert keys == {
        'allreduce': 'exact',
        'fp16_compress': 'half',
        'fp16_compress, two-level': 'half',
        'bf16_compress': 'half',
        'bf16_compress, two-level': 'half',
        'int8_compress error_feedback=True': 'quantized_ef',
        'int8_compress error_feedback=True, two-level': 'quantized_ef',
    }
    # Each config is one a run accepts; the exact hook comes first.
    every = auto_candidates('any')
    assert every[0].key == 'allreduce'
    for candidate in every:
        check_comm_hook_cfg(dict(candidate.config))
    assert {c.klass
            for c in every
            } == {'exact', 'half', 'quantized_ef', 'quantized', 'low_rank'}
    assert [c.key for c in auto_candidates('exact')] == ['allreduce']
    assert [
        c.key for c in auto_candidates(
            'half', two_level=False, names=['bf16_compress'])
    ] == ['bf16_compress']


_NOT_TRIED = ("synchronise across nodes every period steps, which auto's "
              'few trial steps cannot time (and switching hooks would break '
              'their period)')


def test_auto_never_tries_a_periodic_hook_and_says_so_at_start():
    """Local SGD and DiLoCo (issue 45): no max_loss makes them candidates,
    and naming them is refused before anything starts, with the config
    that does run them; under FSDP2 the same refusal comes first."""
    assert not auto_candidates('any', names=['post_local_sgd', 'diloco'])
    # Every candidate auto lists is one a run accepts as it is (a
    # periodic one would be refused for its missing period).
    found = comm_hook_config(dict(type='auto', max_loss='any')).candidates
    assert found and not {c.config['type']
                          for c, _ in found} & {'post_local_sgd', 'diloco'}
    for cfg in (dict(type='auto', candidates=['diloco']),
                dict(
                    type='auto',
                    candidates=['allreduce', 'diloco'],
                    max_loss='any')):
        for check in (check_comm_hook_cfg, check_sharded_cfg):
            with pytest.raises(ValueError) as info:
                check(cfg)
            assert str(info.value) == (
                f"comm_hook auto: candidates ['diloco'] {_NOT_TRIED}; name "
                "it as the comm_hook type instead, e.g. dict(type='diloco', "
                'period=25)')
    with pytest.raises(ValueError) as info:
        auto_settings(["candidates=['post_local_sgd', 'diloco']"])
    assert str(info.value) == (
        "comm_hook auto: candidates ['post_local_sgd', 'diloco'] "
        f'{_NOT_TRIED}; name one as the comm_hook type instead, e.g. '
        "dict(type='post_local_sgd', period=25)")
    with pytest.raises(ValueError) as info:
        check_comm_hook_cfg(dict(type='auto', max_loss='periodic'))
    assert str(info.value) == (
        "comm_hook auto: max_loss='periodic' adds only post_local_sgd, "
        "diloco to max_loss='low_rank', and auto never tries those: they "
        f"{_NOT_TRIED}. Give max_loss='low_rank' to try every per-step "
        "hook, or name one as the comm_hook type, e.g. dict(type='diloco', "
        'period=25)')
    # The names auto can try, and only those.
    with pytest.raises(ValueError) as info:
        check_comm_hook_cfg(dict(type='auto', candidates=['dilocco']))
    assert str(info.value).endswith(
        'registered: allreduce, fp16_compress, bf16_compress, powerSGD, '
        'batched_powerSGD, int8_compress')


@pytest.mark.parametrize('hybrid', [False, True])
@pytest.mark.parametrize('cfg', [
    dict(type='diloco', period=25, outer_format='bf16'),
    dict(type='post_local_sgd', period=4),
    dict(type='diloco'),
])
def test_a_periodic_hook_has_no_form_under_fsdp2(cfg, hybrid):
    """Refused under full and hybrid sharding alike, before its own keys
    are checked: no ``period`` would make it run."""
    with pytest.raises(ValueError) as info:
        check_sharded_cfg(cfg, hybrid=hybrid)
    assert str(info.value) == (
        f"comm_hook type={cfg['type']!r} synchronises the model across "
        "nodes every period steps through DDP's buckets and the run's "
        'step; FSDP2 (FSDP2Strategy) shards the parameters, so it has no '
        'form of it: train it with DDP (the default Runner), or use a '
        "per-step hook with a sharded form, such as 'bf16_compress', or "
        "'int8_compress' under hybrid sharding")


def test_the_class_rule_needs_min_gain_for_each_lossier_class():
    classes = dict(a='exact', h='half', q='quantized_ef', r='low_rank')
    steps = dict(a=1.0, h=0.95, q=0.5, r=0.1)
    # half gains 5% < 10%: not taken; int8 gains 100% over allreduce.
    rule = choose_by_class(steps, classes, 'quantized_ef', 0.1)
    assert [(s.key, s.taken) for s in rule] == [('a', True), ('h', False),
                                                ('q', True)]
    assert picked(rule) == 'q'
    assert picked(choose_by_class(steps, classes, 'half', 0.1)) == 'a'
    assert picked(choose_by_class(steps, classes, 'any', 0.1)) == 'r'
    assert picked(choose_by_class(steps, classes, 'half', 0.0)) == 'h'


def _decide(rank, world_size, times):
    candidates = auto_candidates('quantized_ef', two_level=False)
    settings = check_auto_cfg(dict(type='auto', trial_iters=2))
    trials = AutoTrials(candidates, settings, [world_size, 0])
    decided_at = None
    for i in range(trials.iterations):
        seconds = times[rank][candidates[trials.current].key]
        if trials.step_done(seconds):
            decided_at = i
    return decided_at, trials.decision, trials.current


def test_every_rank_takes_one_decision_from_the_slowest_rank_s_steps():
    # Rank 0 finds int8 fastest by far, rank 1 finds it slow: the step is
    # the slowest rank's, so both keep bf16 (30% over allreduce; int8's
    # 0.72 s gains 7% over bf16's 0.77 s, under the 10% asked).
    fast = {
        'allreduce': 1.0,
        'fp16_compress': 0.8,
        'bf16_compress': 0.77,
        'int8_compress error_feedback=True': 0.3
    }
    slow = dict(fast, **{'int8_compress error_feedback=True': 0.72})
    slow['allreduce'] = 0.9
    results = run_ranks(_decide, [fast, slow])
    (at0, decision0, current0), (at1, decision1, current1) = results
    assert at0 == at1 == 4 * 3 - 1
    assert decision0 == decision1
    assert decision0.key == 'bf16_compress' and current0 == current1 == 2
    table = {row['key']: row['step_s'] for row in decision0.table}
    assert table['allreduce'] == 1.0
    assert table['int8_compress error_feedback=True'] == 0.72
    text = '\n'.join(decision0.lines())
    assert '* bf16_compress' in text
    assert 'not taken, 7% faster than bf16_compress' in text
