"""Every hook's accuracy class and evidence, read from its record (issue
31): the classes the recommendation weighs, and the variants the
convergence comparison trains."""
import os.path as osp
import re
import warnings

import pytest

from mmcv_custom.analysis.convergence import variants
from mmcv_custom.comm import COMM_HOOKS
from mmcv_custom.comm.accuracy import (ACCURACY_CLASSES, accuracy_of,
                                       check_class, class_rank)
from mmcv_custom.comm.builtins import BUILTIN_HOOKS
from mmcv_custom.comm.records import HookRecord, HookVariant, record_of

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
BENCHMARKS = osp.join(ROOT, 'docs', 'en', 'notes', 'benchmarks.md')


def _published_classes() -> dict:
    """Variant -> its class, as the convergence table of the benchmarks
    page publishes them (first column: the variant's name in backquotes,
    second: its class)."""
    with open(BENCHMARKS, encoding='utf-8') as f:
        text = f.read()
    section = text.split('## Does each hook train like fp32?')[1]
    section = section.split('\n## ')[0]
    rows = re.findall(r'^\| `(\w+)`[^|]* \| (\w+) \|', section, re.M)
    assert rows, 'no convergence table on the benchmarks page'
    return dict(rows)


def test_every_builtin_hook_states_its_class_and_its_evidence_is_published():
    """Every built-in hook, and every setting the convergence comparison
    trains it under, states one of the classes; where its record names
    evidence, the benchmarks page's convergence table has its row with
    the same class. A hook without evidence is not yet benchmarked: it is
    listed (a warning), not a failure."""
    published = _published_classes()
    builtins = {builtin.name for builtin in BUILTIN_HOOKS}
    checked, not_yet = [], []
    for variant in variants().values():
        if variant.hook_type not in builtins:
            continue  # a plugin registered by another test
        record = record_of(COMM_HOOKS.get(variant.hook_type))
        accuracy = accuracy_of(record, variant.options)
        assert accuracy.klass in ACCURACY_CLASSES, variant
        if not accuracy.evidence:
            not_yet.append(variant.name)
            continue
        # The runs' figures, and where they are published (the exact
        # hook is the reference the others are compared with).
        assert ('benchmarks.md' in accuracy.evidence
                or accuracy.klass == 'exact'), variant.name
        assert published.get(variant.name) == accuracy.klass, (
            f'{variant.name}: its record says {accuracy.klass} with evidence'
            f', the page says {published.get(variant.name)}')
        checked.append(variant.name)
    # And every row of the table is a setting whose record cites it.
    assert set(published) <= set(checked), sorted(
        set(published) - set(checked))
    if not_yet:
        warnings.warn('not yet benchmarked (no convergence evidence on '
                      f'{osp.relpath(BENCHMARKS, ROOT)}): '
                      f'{", ".join(not_yet)}')


def test_a_setting_that_changes_the_class_is_the_variant_s():
    record = record_of(COMM_HOOKS.get('int8_compress'))
    assert accuracy_of(record, dict(error_feedback=False)).klass == 'quantized'
    assert accuracy_of(record,
                       dict(error_feedback=True)).klass == ('quantized_ef')
    # Keys the variants do not set leave the default variant's.
    assert accuracy_of(record, dict(block_size=32)).klass == 'quantized_ef'
    assert 'FSDP2' in accuracy_of(record, dict(error_feedback=False)).evidence


def test_a_plugin_hook_without_a_class_is_unknown_and_ranked_last():
    assert accuracy_of(HookRecord()).klass == 'unknown'
    assert class_rank('unknown') > class_rank('periodic')
    assert [class_rank(k)
            for k in ACCURACY_CLASSES] == list(range(len(ACCURACY_CLASSES)))


def test_the_periodic_hooks_are_a_class_of_their_own_after_low_rank():
    """Local SGD and DiLoCo change the optimizer, not the average: no
    per-step class bounds them, so they come after the lossiest per-step
    class and only ``max_loss='periodic'`` (or ``'any'``) admits them."""
    assert class_rank('periodic') > class_rank('low_rank')
    for name in ('post_local_sgd', 'diloco'):
        record = record_of(COMM_HOOKS.get(name))
        assert record.periodic
        assert accuracy_of(record).klass == 'periodic'
    assert check_class('periodic') == 'periodic'


def test_a_wrong_class_is_refused_where_it_is_written():
    with pytest.raises(ValueError, match="accuracy should be one of"):
        HookRecord(accuracy='lossless')
    with pytest.raises(ValueError, match="'lossy'"):
        HookRecord(variants=(HookVariant('x', {}, 'x', None, 'lossy'), ))
    with pytest.raises(ValueError) as raised:
        check_class('int8')
    assert str(raised.value) == (
        'max_loss should be one of exact, half, quantized_ef, quantized, '
        "low_rank, periodic, any (from the least lossy to any), but got "
        "'int8'")


def test_the_convergence_comparison_trains_every_hook_and_setting():
    """Names from the records: every registered hook, PowerSGD at rank 4,
    rank 1 and under a wrapper."""
    known = variants()
    assert {v.hook_type
            for v in known.values()} >= {name
                                         for name, _, _ in BUILTIN_HOOKS}
    assert known['powerSGD_r1'].options == dict(
        matrix_approximation_rank=1, start_powerSGD_iter=2)
    assert known['batched_powerSGD_bf16'].options['wrapper'] == 'bf16'
    assert list(known)[:3] == ['allreduce', 'fp16_compress', 'bf16_compress']
