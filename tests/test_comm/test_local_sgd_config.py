"""``post_local_sgd`` and ``diloco`` configs checked at start (issue 45's
bad-input list): every mistake named with what would be right, before
anything is built, in one process (no process group)."""
import pytest

from mmcv_custom.comm.config import comm_hook_config

_INNER = ("a per-step hook such as dict(type='allreduce'), "
          "dict(type='bf16_compress') or dict(type='int8_compress')")


@pytest.mark.parametrize('cfg,error,message', [
    (dict(type='diloco'), TypeError,
     "comm_hook type 'diloco' needs period: the optimizer steps between "
     'synchronisations across nodes, an int >= 1 (e.g. period=25)'),
    (dict(type='diloco', period=0), ValueError,
     'comm_hook diloco: period should be an int >= 1, but got 0'),
    (dict(type='post_local_sgd', period=-3), ValueError,
     'comm_hook post_local_sgd: period should be an int >= 1, but got -3'),
    (dict(type='post_local_sgd', period=2.5), TypeError,
     'comm_hook post_local_sgd: period should be an int >= 1, but got '
     'float: 2.5'),
    (dict(type='diloco', period=True), TypeError,
     'comm_hook diloco: period should be an int >= 1, but got bool: True'),
    (dict(type='post_local_sgd', period=4, start_iter=-1), ValueError,
     'comm_hook post_local_sgd: start_iter should be an int >= 0, but got '
     '-1'),
    (dict(type='diloco', period=4, outer_lr=0), ValueError,
     'comm_hook diloco: outer_lr should be a finite real number > 0, but '
     'got 0'),
    (dict(type='diloco', period=4, outer_lr=3), ValueError,
     'comm_hook diloco: outer_lr should be in (0, 2.0] (the paper uses 0.7; '
     '1 with outer_momentum=0 averages the nodes), but got 3'),
    (dict(type='diloco', period=4, outer_lr='0.7'), TypeError,
     "comm_hook diloco: outer_lr should be a finite real number > 0, but "
     "got str: '0.7'"),
    (dict(type='diloco', period=4, outer_momentum=1.0), ValueError,
     'comm_hook diloco: outer_momentum should be in [0, 1) (the paper uses '
     '0.9), but got 1.0'),
    (dict(type='diloco', period=4, outer_momentum=-0.1), ValueError,
     'comm_hook diloco: outer_momentum should be a finite real number >= 0, '
     'but got -0.1'),
    (dict(type='diloco', period=4, nesterov='yes'), TypeError,
     "comm_hook diloco: nesterov should be True or False, but got str: "
     "'yes'"),
    (dict(type='diloco', period=4, outer_format='fp8'), ValueError,
     "comm_hook diloco: outer_format should be one of 'fp32', 'bf16', "
     "'int8', but got 'fp8'"),
    (dict(type='diloco', period=4, outer_format='fp32', block_size=64),
     ValueError, "comm_hook diloco: block_size applies to "
     "outer_format='int8' only, but outer_format='fp32': remove block_size, "
     'or send int8'),
    (dict(type='diloco', period=4, outer_format='bf16', error_feedback=True),
     ValueError, "comm_hook diloco: error_feedback applies to "
     "outer_format='int8' only, but outer_format='bf16': remove "
     'error_feedback, or send int8'),
    (dict(type='diloco', period=4, fragments=0), ValueError,
     'comm_hook diloco: fragments should be an int >= 1, but got 0'),
    (dict(type='diloco', period=4, fragments=5), ValueError,
     'comm_hook diloco: fragments should be at most period=4 (each fragment '
     'synchronises at its own step of the period), but got 5'),
    (dict(type='diloco', period=4, overlap=1.5), TypeError,
     'comm_hook diloco: overlap should be an int >= 0, but got float: 1.5'),
    (dict(type='diloco', period=8, fragments=4, overlap=2), ValueError,
     'comm_hook diloco: overlap should be below period // fragments = 2 (a '
     "fragment's exchange is applied before the next fragment's place), but "
     'got 2'),
    (dict(type='diloco', period=8, fragments=2, mix=0.5), ValueError,
     'comm_hook diloco: mix applies with overlap > 0 only (without it the '
     'fragment takes the global values as they are): remove mix, or give '
     'overlap'),
    (dict(type='diloco', period=8, overlap=2, mix=1), ValueError,
     'comm_hook diloco: mix should be in [0, 1) (the share of the local '
     'values kept; the paper uses 0.5), but got 1'),
    (dict(type='diloco', period=4, inner='allreduce'), TypeError,
     f'comm_hook diloco: inner should be {_INNER} (the exchange inside each '
     "node), but got str: 'allreduce'"),
    (dict(type='diloco', period=4, inner=dict(type='auto')), ValueError,
     "comm_hook diloco inner: type='auto' cannot carry the exchange inside "
     f'the node (it is not one hook that runs every step); give {_INNER}'),
    (dict(
        type='post_local_sgd', period=4, inner=dict(type='diloco',
                                                    period=2)), ValueError,
     "comm_hook post_local_sgd inner: type='diloco' cannot carry the "
     'exchange inside the node (it is not one hook that runs every step); '
     f'give {_INNER}'),
    (dict(type='diloco', period=4, inner=dict(type='fp16_compress')),
     ValueError, "comm_hook diloco inner: fp16_compress's range guard "
     '(check_finite) stops the run when an average is not finite, and '
     'between synchronisations each node averages alone: one node would '
     'stop without the others. Give check_finite=False, or use '
     "dict(type='bf16_compress')"),
    (dict(
        type='diloco',
        period=4,
        inner=dict(type='int8_compress', topology='flat')), ValueError,
     'comm_hook diloco inner: it takes no topology: it runs inside the '
     'node; give the layout as comm_hook topology=dict(ranks_per_node=N), '
     "not inner topology='flat'"),
    (dict(
        type='diloco',
        period=4,
        inner=dict(type='int8_compress', block_size=0)), ValueError,
     'comm_hook diloco inner: comm_hook int8_compress: block_size should be '
     'an int >= 1, but got 0'),
    (dict(type='diloco', period=4, wrapper='bf16'), ValueError,
     "comm_hook type 'diloco' exchanges the gradients inside the node "
     "through its inner hook: put the wrapper there, inner=dict("
     "type='allreduce', wrapper='bf16'), not on 'diloco'"),
    (dict(type='post_local_sgd', period=4, topology='flat'), ValueError,
     "comm_hook type 'post_local_sgd' synchronises across nodes, so it "
     "needs the node layout: topology='auto' (the launcher's) or "
     "dict(ranks_per_node=N), not 'flat'"),
    (dict(type='post_local_sgd', period=16, group_periods={5: 2}), ValueError,
     'comm_hook post_local_sgd: group_periods should be a dict '
     '{period: nodes} of shorter periods, each averaging within groups of '
     'that many nodes (e.g. {4: 2} with period=16): its period 5 should '
     'divide period=16 and be shorter'),
    (dict(type='post_local_sgd', period=16, group_periods={4: 1}), ValueError,
     'comm_hook post_local_sgd: group_periods[4] (nodes) should '
     'be an int >= 2, but got 1'),
    (dict(type='post_local_sgd', period=16, group_periods=[4, 2]), TypeError,
     'comm_hook post_local_sgd: group_periods should be a dict '
     '{period: nodes} of shorter periods, each averaging within groups of '
     'that many nodes (e.g. {4: 2} with period=16), but got [4, 2]'),
])
def test_a_bad_setting_is_named_with_what_is_right(cfg, error, message):
    with pytest.raises(error) as caught:
        comm_hook_config(cfg)
    text = caught.value.args[0] if isinstance(caught.value, KeyError) else str(
        caught.value)
    assert text == message


def test_a_key_of_the_other_algorithm_is_unknown():
    with pytest.raises(
            TypeError, match="got unexpected keys "
            r"\['group_periods'\]"):
        comm_hook_config(dict(type='diloco', period=4, group_periods={2: 2}))
    with pytest.raises(TypeError, match=r"got unexpected keys \['outer_lr'\]"):
        comm_hook_config(dict(type='post_local_sgd', period=4, outer_lr=0.7))
    with pytest.raises(
            TypeError, match=r"got unexpected keys \['fragments'\]"):
        comm_hook_config(dict(type='post_local_sgd', period=4, fragments=2))


def test_every_mistake_of_one_config_is_named_at_once():
    with pytest.raises(ValueError) as caught:
        comm_hook_config(
            dict(
                type='diloco',
                period=0,
                outer_momentum=1.0,
                inner=dict(type='auto')))
    errors = [str(e) for e in caught.value.errors]
    assert len(errors) == 3
    assert any('period should be' in e for e in errors)
    assert any('outer_momentum' in e for e in errors)
    assert any("inner: type='auto'" in e for e in errors)


def test_the_defaults_a_config_leaves_out():
    checked = comm_hook_config(dict(type='diloco', period=25))
    assert dict(checked.state_kwargs) == dict(
        period=25, inner=dict(type='allreduce'))
    assert checked.defaults_set == ('inner', )
    assert checked.inner.type == 'allreduce'
    assert checked.record.periodic and checked.record.accuracy == 'periodic'
    local = comm_hook_config(
        dict(
            type='post_local_sgd',
            period=8,
            start_iter=100,
            inner=dict(type='int8_compress', block_size=128),
            topology=dict(ranks_per_node=8)))
    assert local.inner.type == 'int8_compress'
    assert dict(local.inner.state_kwargs)['block_size'] == 128
    assert local.topology == dict(ranks_per_node=8)
