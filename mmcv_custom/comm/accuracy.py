"""How far each hook's average may be from the fp32 average: its accuracy
class, and the evidence behind it.

A user picks a hook by what it saves and what it may cost in accuracy; the
second half needs words the tools can act on. Every built-in hook's record
(:attr:`~.records.HookRecord.accuracy`, or its variant's where a setting
changes it, as ``int8_compress`` without error feedback) names one of
:data:`ACCURACY_CLASSES`, from the least lossy to the most, and the
convergence runs behind it (:attr:`~.records.HookRecord.evidence`).
``comm_cost_model.py --recommend --max-loss CLASS`` then weighs only the
hooks of that class or below. A plugin hook without a class is
``'unknown'``: weighed only where the user accepts any loss. Imports only
torch (through the records).
"""
from typing import Any, Mapping, NamedTuple

__all__ = [
    'ACCURACY_CLASSES', 'CLASS_WORDS', 'Accuracy', 'accuracy_of', 'class_rank',
    'check_class'
]

#: From the least lossy to the most; ``'unknown'`` (a hook whose record
#: names none) is ranked above all of them.
ACCURACY_CLASSES = ('exact', 'half', 'quantized_ef', 'quantized', 'low_rank')

#: Each class in words, for tables and messages.
CLASS_WORDS = {
    'exact': 'exact (the fp32 average, or the gradients\' own dtype)',
    'half': 'half precision (one rounding to fp16 or bf16)',
    'quantized_ef': 'quantized with error feedback (what rounding drops is '
    'sent later)',
    'quantized': 'quantized without error feedback',
    'low_rank': 'low rank (an approximation, with error feedback)',
    'unknown': 'unknown (a hook whose record names no class)',
}


class Accuracy(NamedTuple):
    """A hook's class under some settings, and the evidence for it (empty
    where none is recorded)."""
    klass: str
    evidence: str = ''


def check_class(value: Any, what: str = 'max_loss') -> str:
    """``value`` if it names a class (``'any'`` accepts every hook).

    Raises:
        ValueError: It does not, naming the valid values.
    """
    valid = ACCURACY_CLASSES + ('any', )
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f'{what} should be one of {", ".join(valid)} (from '
                         f'the least lossy to any), but got {value!r}')
    return value


def class_rank(klass: str) -> int:
    """Where ``klass`` stands from the least lossy (0); ``'unknown'`` and
    ``'any'`` after every class."""
    if klass in ACCURACY_CLASSES:
        return ACCURACY_CLASSES.index(klass)
    return len(ACCURACY_CLASSES)


def accuracy_of(record, settings: Mapping[str, Any] = None) -> Accuracy:
    """The class and evidence of a hook with ``record`` under ``settings``
    (its state keys as a config gives them; absent keys: the defaults).

    A record's variants (:class:`~.records.HookVariant`) that name a class
    override the record's own, the first whose options ``settings`` do not
    contradict: the first variant is the hook's default setting, so a
    config that leaves the key out gets it.
    """
    settings = settings or {}
    for variant in record.variants:
        if variant.accuracy is None:
            continue
        if all(settings.get(k, v) == v for k, v in variant.options.items()):
            return Accuracy(variant.accuracy, variant.evidence)
    if record.accuracy is None:
        return Accuracy('unknown', '')
    return Accuracy(record.accuracy, record.evidence)
