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
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional

__all__ = [
    'ACCURACY_CLASSES', 'CLASS_WORDS', 'Accuracy', 'accuracy_of', 'class_rank',
    'check_class', 'ClassStep', 'choose_by_class', 'picked'
]

#: From the least lossy to the most; ``'unknown'`` (a hook whose record
#: names none) is ranked above all of them. ``'periodic'`` (local SGD,
#: DiLoCo) is last: its nodes train apart between synchronisations, so it
#: changes the optimizer rather than rounding an average, and no per-step
#: bound on its loss holds.
ACCURACY_CLASSES = ('exact', 'half', 'quantized_ef', 'quantized', 'low_rank',
                    'periodic')

#: Each class in words, for tables and messages.
CLASS_WORDS = {
    'exact': 'exact (the fp32 average, or the gradients\' own dtype)',
    'half': 'half precision (one rounding to fp16 or bf16)',
    'quantized_ef': 'quantized with error feedback (what rounding drops is '
    'sent later)',
    'quantized': 'quantized without error feedback',
    'low_rank': 'low rank (an approximation, with error feedback)',
    'periodic': 'synchronised every period steps (the nodes train apart in '
    'between: a different optimizer, not a different average)',
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


class ClassStep(NamedTuple):
    """One class's turn in :func:`choose_by_class`: its fastest allowed
    candidate, whether it was taken, and what it would gain over the pick
    before it (None for the first class, taken as it is)."""
    key: str
    taken: bool
    gain: Optional[float]


def choose_by_class(
        step_s: Mapping[str, float],
        classes: Mapping[str, str],
        max_loss: str = 'quantized_ef',
        min_gain: float = 0.1,
        tie: Optional[Callable[[str], Any]] = None) -> List[ClassStep]:
    """The one rule by which a hook is picked for its speed and its loss,
    whether the steps are predicted (``comm_cost_model.py --recommend``)
    or measured (``comm_hook = dict(type='auto')``).

    From the least lossy class up, the fastest candidate of each class
    allowed by ``max_loss`` is taken only if it is at least ``min_gain``
    (a fraction) faster than the pick so far: a 1% saving never trades
    exactness for rounding, nor rounding for a low-rank approximation.
    The pick is the last step taken.

    Args:
        step_s (Mapping[str, float]): Candidate -> its step, in seconds.
        classes (Mapping[str, str]): Candidate -> its accuracy class.
        max_loss (str): The lossiest class allowed, or ``'any'``.
        min_gain (float): The least speed-up of a lossier class.
        tie (Callable, optional): Of two equal steps, the candidate with
            the lower ``tie(key)`` first (e.g. the format that does not
            overflow). Defaults to none.

    Returns:
        list[ClassStep]: One per class with an allowed candidate, from the
        least lossy; empty when none is allowed.
    """
    limit = class_rank(check_class(max_loss))
    by_class: Dict[int, List[str]] = {}
    for key in step_s:
        rank = class_rank(classes[key])
        if rank <= limit:
            by_class.setdefault(rank, []).append(key)
    steps: List[ClassStep] = []
    pick = None
    for rank in sorted(by_class):
        fastest = min(
            by_class[rank], key=lambda k: (step_s[k], tie(k) if tie else 0))
        if pick is None:
            steps.append(ClassStep(fastest, True, None))
            pick = fastest
            continue
        gain = step_s[pick] / step_s[fastest] - 1
        taken = gain >= min_gain
        steps.append(ClassStep(fastest, taken, gain))
        if taken:
            pick = fastest
    return steps


def picked(steps: List[ClassStep]) -> Optional[str]:
    """The pick of :func:`choose_by_class`'s steps (None: no candidate)."""
    taken = [step.key for step in steps if step.taken]
    return taken[-1] if taken else None
