"""``comm_hook = dict(type='auto')``: the run picks its hook by measuring.

Which hook pays depends on the link, the model's buckets, the compute step
and the codec's speed on this device; the cost model projects them, but a
run has them all at hand. So ``auto`` tries every allowed hook on the
run's own links for a few iterations, from the exact ``allreduce`` up, and
keeps the one the class rule picks
(:func:`~.accuracy.choose_by_class`, the rule ``comm_cost_model.py
--recommend`` applies to predicted steps): a lossier class only where it
is at least ``min_gain`` faster than the pick below it, and no class
beyond ``max_loss``.

The candidates are read from the records (:func:`auto_candidates`): every
registered hook, in each setting its record names (its variants), whose
accuracy class ``max_loss`` allows; a hook with a two-level form also in
that form where the run has several nodes of several ranks.

:class:`AutoTrials` keeps the schedule and decides; :class:`AutoDispatch`
is the one DDP communication hook state that hands each bucket to the
hook under trial, then to the chosen one (DDP takes one
``register_comm_hook`` per model). Every rank measures, the slowest
rank's median step of each candidate is agreed on with one all-reduce,
and every rank then applies the same rule to the same numbers: one
decision, at the same iteration everywhere. Imports torch and the
records only; the MMEngine side (timing the iterations, the log table,
the checkpoint) is :mod:`mmcv_custom.engine.auto_comm`.
"""
import ast
import statistics
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ..hooks.validation import require_int, require_real
from .accuracy import (CLASS_WORDS, accuracy_of, check_class, choose_by_class,
                       class_rank, picked)
from .records import record_of
from .registry import COMM_HOOKS

__all__ = [
    'AUTO', 'AUTO_DEFAULTS', 'DECIDING_KEYS', 'check_auto_cfg',
    'auto_settings', 'AutoCandidate', 'auto_candidates', 'AutoDecision',
    'AutoTrials', 'AutoDispatch', 'auto_hook', 'describe_candidates',
    'build_candidates'
]

#: The ``comm_hook.type`` that picks a hook by measuring.
AUTO = 'auto'

#: Its keys and their defaults: the lossiest class allowed, the least
#: speed-up (a fraction) a lossier class must bring, and the timed
#: iterations per candidate (after one untimed: PowerSGD's first step,
#: DDP's rebuilt buckets and cold caches are not the hook's pace); and
#: which registered hooks to try (None: all that ``max_loss`` allows).
AUTO_DEFAULTS = dict(
    max_loss='quantized_ef', min_gain=0.1, trial_iters=3, candidates=None)

#: The keys a decision depends on: a resumed run that changes one decides
#: again (``trial_iters`` only changes how it is measured).
DECIDING_KEYS = ('max_loss', 'min_gain', 'candidates')


def check_auto_cfg(cfg: dict,
                   runnable: Optional[Callable[[dict], Any]] = None) -> dict:
    """The ``auto`` config with its defaults, every key checked.

    Args:
        cfg (dict): ``dict(type='auto', ...)``.
        runnable (Callable, optional): ``runnable(settings)`` raises when
            the run could try none of the candidates the checked settings
            allow, saying what would help: under FSDP2,
            :func:`~.sharded.sharded_auto_candidates`, where raising
            ``max_loss`` does not always help. Defaults to None: DDP, where
            every hook runs, and a class too low is the one reason.

    Raises:
        TypeError: A key ``auto`` does not take (``wrapper`` and
            ``topology`` included: it chooses them), or a value of the
            wrong type.
        ValueError: A value out of range, e.g. ``min_gain=10`` for 10%,
            or candidates none of which ``max_loss`` allows; a periodic
            hook (``diloco``) among the candidates, or
            ``max_loss='periodic'``, which admits only those besides the
            others: ``auto`` never tries them (:func:`auto_candidates`).
    """
    given = dict(cfg)
    given.pop('type', None)
    unknown = sorted(set(given) - set(AUTO_DEFAULTS))
    if unknown:
        chosen = [k for k in unknown if k in ('wrapper', 'topology')]
        why = (f' ({", ".join(chosen)}: auto tries each setting itself; to '
               'fix one, name a hook instead, e.g. '
               "comm_hook = dict(type='bf16_compress'))" if chosen else '')
        raise TypeError(
            f'comm_hook auto does not take {", ".join(map(repr, unknown))}'
            f'{why}; its keys: ' +
            ', '.join(f'{k} (default {v!r})'
                      for k, v in AUTO_DEFAULTS.items()))
    out = dict(AUTO_DEFAULTS, **given)
    check_class(out['max_loss'], 'comm_hook auto: max_loss')
    if out['max_loss'] == 'periodic':
        raise ValueError(
            "comm_hook auto: max_loss='periodic' adds only "
            f'{", ".join(_periodic_names())} to max_loss=\'low_rank\', and '
            f'auto never tries those: they {_NOT_TRIED}. Give '
            "max_loss='low_rank' to try every per-step hook, or name one as "
            f'the comm_hook type, e.g. {_periodic_example()}')
    require_real('comm_hook auto: min_gain', out['min_gain'], minimum=0)
    if out['min_gain'] >= 1:
        raise ValueError(
            'comm_hook auto: min_gain is a fraction (0.1: a lossier hook '
            f'must be 10% faster), but got {out["min_gain"]!r}; did you mean '
            f'{out["min_gain"] / 100:g}?')
    require_int('comm_hook auto: trial_iters', out['trial_iters'], minimum=1)
    names = out['candidates']
    if names is not None:
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise TypeError('comm_hook auto: candidates should be a list of '
                            f'hook names or None, but got {names!r}')
        unknown = [n for n in names if n not in COMM_HOOKS.module_dict]
        if unknown or not names:
            tried = [
                n for n in COMM_HOOKS.module_dict
                if n not in _periodic_names()
            ]
            raise ValueError(
                'comm_hook auto: candidates should name registered hooks, '
                f'but got {list(names)!r}; registered: {", ".join(tried)}')
        periodic = [n for n in names if n in _periodic_names()]
        if periodic:
            raise ValueError(
                f'comm_hook auto: candidates {periodic!r} {_NOT_TRIED}; name '
                f'{"it" if len(periodic) == 1 else "one"} as the comm_hook '
                f'type instead, e.g. {_periodic_example(periodic[0])}')
        out['candidates'] = list(names)
    settings = dict(type=AUTO, **out)
    (runnable or _ddp_runnable)(settings)
    return settings


#: Why ``auto`` never tries a periodic hook (local SGD, DiLoCo).
_NOT_TRIED = ('synchronise across nodes every period steps, which auto\'s '
              'few trial steps cannot time (and switching hooks would break '
              'their period)')


def _periodic_names() -> List[str]:
    """The registered hooks that synchronise the model every ``period``
    steps (:attr:`~.records.HookRecord.periodic`): never ``auto``'s
    candidates."""
    return [
        name for name, hook in COMM_HOOKS.module_dict.items()
        if record_of(hook).periodic
    ]


def _periodic_example(name: str = 'diloco') -> str:
    return f"dict(type='{name}', period=25)"


def _ddp_runnable(settings: dict) -> None:
    """Under DDP every registered hook runs: only ``max_loss`` can leave
    the named candidates nothing to try."""
    names = settings['candidates']
    if names is not None and not auto_candidates(
            settings['max_loss'], names=names):
        raise ValueError(
            f'comm_hook auto: none of {names} is of class '
            f'{settings["max_loss"]!r} or below (max_loss); raise max_loss '
            'or name other hooks')


def auto_settings(pairs: Sequence[str]) -> dict:
    """An ``auto`` config from ``KEY=VALUE`` pairs (a tool's command line;
    values read as Python literals, else as strings), checked.

    Raises:
        ValueError: A pair without ``=``; the errors of
            :func:`check_auto_cfg`.
    """
    cfg = dict(type=AUTO)
    for pair in pairs:
        key, sep, value = pair.partition('=')
        if not sep:
            raise ValueError(f'give KEY=VALUE pairs, but got {pair!r}')
        try:
            cfg[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            cfg[key] = value
    return check_auto_cfg(cfg)


class AutoCandidate(NamedTuple):
    """One hook setting ``auto`` may try.

    Attributes:
        key (str): Its name in the log table, e.g. ``'int8_compress
            error_feedback=True, two-level'``.
        config (dict): The ``comm_hook`` config that runs it.
        klass (str): Its accuracy class.
        evidence (str): The convergence runs behind the class.
    """
    key: str
    config: dict
    klass: str
    evidence: str


def _key(config: dict) -> str:
    keys = ', '.join(f'{k}={v!r}' for k, v in config.items()
                     if k not in ('type', 'topology'))
    form = ', two-level' if config.get('topology') == 'auto' else ''
    return config['type'] + (f' {keys}' if keys else '') + form


def auto_candidates(
        max_loss: str,
        two_level: bool = True,
        names: Optional[Sequence[str]] = None) -> List[AutoCandidate]:
    """The hook settings ``max_loss`` allows, read from the records:
    every registered hook in each of its variants' settings (else its
    defaults), and, with ``two_level``, a hook with a two-level form in
    that form too (``topology='auto'``: it is two-level only where the
    run has several nodes of several ranks; a candidate that turns out
    flat is the flat one twice, and the caller drops it). ``names``: only
    these registered hooks (None: all). Never a periodic hook
    (:attr:`~.records.HookRecord.periodic`: local SGD, DiLoCo), whatever
    ``max_loss``: a few trial steps cannot time a synchronisation every
    ``period`` steps, and switching hooks would break the period.

    Returns:
        list[AutoCandidate]: In the order of registration, ``allreduce``
        first: the exact hook is tried first and is the pick to beat.
    """
    limit = class_rank(check_class(max_loss))
    out = []
    for name, hook in COMM_HOOKS.module_dict.items():
        if names is not None and name not in names:
            continue
        record = record_of(hook)
        if record.periodic:
            continue  # see check_auto_cfg: its trials could not time it
        settings = [dict(v.options) for v in record.variants] or [{}]
        for options in settings:
            accuracy = accuracy_of(record, options)
            if class_rank(accuracy.klass) > limit:
                continue
            forms = [{}]
            if record.two_level:
                forms = [dict(topology='flat')]
                if two_level:
                    forms.append(dict(topology='auto'))
            for form in forms:
                config = dict(type=name, **options, **form)
                out.append(
                    AutoCandidate(
                        _key(config), config, accuracy.klass,
                        accuracy.evidence))
    out.sort(key=lambda c: c.config['type'] != 'allreduce')
    return out


class AutoDecision(NamedTuple):
    """What ``auto`` chose and what from, saved with each checkpoint.

    Attributes:
        key (str): The chosen candidate's key.
        config (dict): The ``comm_hook`` config it runs.
        klass (str): Its accuracy class.
        table (list): One row per candidate tried: ``dict(key, klass,
            step_s)``, ``step_s`` the slowest rank's median.
        notes (list[str]): Why each lossier class was or was not taken.
        layout (list[int]): The world size and the ranks per node it was
            decided on (0: the launcher named none).
        settings (dict): The ``auto`` config's :data:`DECIDING_KEYS`.
    """
    key: str
    config: dict
    klass: str
    table: list
    notes: list
    layout: list
    settings: dict

    def to_dict(self) -> dict:
        """Plain types, for the checkpoint."""
        return dict(self._asdict())

    @classmethod
    def from_dict(cls, data: Any) -> Optional['AutoDecision']:
        """The decision a checkpoint holds; None where it holds none or a
        damaged one (then the run decides again)."""
        if not isinstance(data, dict) or set(data) != set(cls._fields):
            return None
        if not isinstance(data['config'],
                          dict) or 'type' not in (data['config']):
            return None
        return cls(**data)

    def lines(self) -> List[str]:
        """The table it was decided from, a line per candidate, and why."""
        fastest = min(row['step_s'] for row in self.table)
        rows = [
            f"  {'*' if row['key'] == self.key else ' '} {row['key']:<48} "
            f"{row['klass']:<12} {row['step_s']:8.4f} s "
            f"({row['step_s'] / fastest:5.2f}x the fastest)"
            for row in self.table
        ]
        return rows + [f'  {note}' for note in self.notes]


class AutoTrials:
    """The schedule of the trials and the decision.

    The candidates take turns, an iteration each, for ``1 + trial_iters``
    rounds, the first untimed (the run's first iterations, DDP's rebuilt
    buckets, a hook's first step are nobody's pace). Taking turns, a
    machine that slows down or speeds up meanwhile weighs on every
    candidate alike: they are compared side by side. After the last
    round, :meth:`step_done` agrees on the medians and decides. The
    caller calls :meth:`step_done` once per iteration on every rank, so
    every rank switches and decides at the same iteration.

    Args:
        candidates (Sequence[AutoCandidate]): In the order to try them.
        settings (dict): The checked ``auto`` config
            (:func:`check_auto_cfg`).
        layout (Sequence[int]): World size and ranks per node, recorded
            in the decision.
        group (ProcessGroup, optional): The ranks that decide together.
            Defaults to None: the world.
    """

    def __init__(self,
                 candidates: Sequence[AutoCandidate],
                 settings: dict,
                 layout: Sequence[int],
                 group: Optional[dist.ProcessGroup] = None) -> None:
        if not candidates:
            raise ValueError('comm_hook auto: no registered hook is of class '
                             f'{settings["max_loss"]!r} or below')
        self.candidates = list(candidates)
        self.settings = settings
        self.layout = list(layout)
        self.group = group
        self.current = 0
        self._iters = 0
        self._times: Dict[int, List[float]] = {}
        self.decision: Optional[AutoDecision] = None

    @property
    def trying(self) -> Optional[AutoCandidate]:
        """The candidate under trial; None once decided."""
        return None if self.decision else self.candidates[self.current]

    @property
    def iterations(self) -> int:
        """Iterations the trials take in all."""
        return len(self.candidates) * (1 + self.settings['trial_iters'])

    def restart(self) -> None:
        """Try every candidate again from the first (the step-time
        benchmark decides afresh at each link rate)."""
        self.current = self._iters = 0
        self._times = {}
        self.decision = None

    def step_done(self, seconds: float) -> bool:
        """Note an iteration of ``seconds`` under the current candidate;
        move on to the next; True when this call decided."""
        if self.decision is not None:
            return False
        count = len(self.candidates)
        if self._iters >= count:
            self._times.setdefault(self.current, []).append(seconds)
        self._iters += 1
        self.current = self._iters % count
        if self._iters < self.iterations:
            return False
        self.decision = self._decide()
        self.current = next(i for i, c in enumerate(self.candidates)
                            if c.key == self.decision.key)
        return True

    def _decide(self) -> AutoDecision:
        medians = torch.tensor([
            statistics.median(self._times[i])
            for i in range(len(self.candidates))
        ],
                               dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            # The step is the slowest rank's; every rank gets the same
            # numbers, so every rank decides the same.
            dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.group)
        step_s = {
            c.key: float(t)
            for c, t in zip(self.candidates, medians.tolist())
        }
        classes = {c.key: c.klass for c in self.candidates}
        order = {c.key: i for i, c in enumerate(self.candidates)}
        steps = choose_by_class(
            step_s,
            classes,
            self.settings['max_loss'],
            self.settings['min_gain'],
            tie=order.get)
        key = picked(steps)
        notes = []
        before = None
        for step in steps:
            short = CLASS_WORDS[classes[step.key]].split(' (')[0]
            if step.gain is not None:
                verb = 'taken' if step.taken else 'not taken'
                pace = 'faster' if step.gain >= 0 else 'slower'
                notes.append(f'{short}: {step.key} {verb}, '
                             f'{abs(step.gain):.0%} {pace} than {before} '
                             f'(at least {self.settings["min_gain"]:.0%} '
                             'faster asked)')
            if step.taken:
                before = step.key
        chosen = self.candidates[order[key]]
        return AutoDecision(
            key=key,
            config=dict(chosen.config),
            klass=chosen.klass,
            table=[
                dict(key=c.key, klass=c.klass, step_s=step_s[c.key])
                for c in self.candidates
            ],
            notes=notes,
            layout=self.layout,
            settings={k: self.settings[k]
                      for k in DECIDING_KEYS})


class AutoDispatch:
    """The state ``auto`` registers on a DDP model with :func:`auto_hook`:
    one built hook per candidate (a ``CommHookSpec``), the one under trial
    taking the buckets, then the chosen one (:meth:`settle`).

    Args:
        trials (AutoTrials): Which candidate is current.
        specs (Sequence): One built hook per candidate, in the trials'
            order: anything with ``hook`` and ``state``.
    """

    def __init__(self, trials: AutoTrials, specs: Sequence) -> None:
        if len(specs) != len(trials.candidates):
            raise ValueError(f'{len(specs)} hooks for '
                             f'{len(trials.candidates)} candidates')
        self.trials = trials
        self.specs = list(specs)
        self.settled = None

    @property
    def active(self):
        """The built hook that takes the next bucket."""
        if self.settled is not None:
            return self.settled
        return self.specs[self.trials.current]

    def restart(self) -> None:
        """Try every candidate again (:meth:`AutoTrials.restart`), the
        buckets back to the candidate under trial."""
        self.trials.restart()
        self.settled = None

    def settle(self, spec=None) -> None:
        """From now on every bucket goes to ``spec``: the chosen hook built
        afresh, so that its state starts from the decision, and the
        candidates' hooks are let go; or, None, the chosen candidate's
        hook as the trials left it (kept with the others, for a
        benchmark that restarts the trials)."""
        if spec is None:
            self.settled = self.specs[self.trials.current]
            return
        self.settled = spec
        self.specs = []


def auto_hook(state: AutoDispatch,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The one DDP communication hook of ``auto``: the bucket goes to the
    hook under trial, or to the chosen one, with that hook's own state."""
    spec = state.active
    return spec.hook(spec.state, bucket)


def describe_candidates(candidates: Sequence[AutoCandidate]) -> str:
    """``'allreduce, fp16_compress, ...'`` for the log line."""
    return ', '.join(c.key for c in candidates)


def _resolved_two_level(spec) -> bool:
    """Whether a built DDP hook (a ``CommHookSpec``) runs in two levels."""
    return str(getattr(spec, 'topology', '')).startswith('two-level')


def build_candidates(candidates: Sequence[AutoCandidate],
                     build: Callable[[Any], Any],
                     two_level: Callable[[Any], bool] = _resolved_two_level,
                     configs: Optional[Sequence] = None) -> tuple:
    """Build every candidate with ``build`` (a config -> its built hook,
    collective for a two-level form: every rank builds in this order);
    a two-level candidate that resolved flat (one node, or one rank per
    node) is left out, as the flat one twice.

    Args:
        candidates (Sequence[AutoCandidate]): In the order to try them.
        build (Callable): A config -> what it builds.
        two_level (Callable): What ``build`` gave -> whether it runs in
            two levels. Defaults to reading a ``CommHookSpec``'s
            ``topology``.
        configs (Sequence, optional): What ``build`` is given for each
            candidate, e.g. their configs checked once beforehand
            (``CommHookConfig``). Defaults to None: a copy of each
            candidate's ``config``.

    Returns:
        tuple: ``(candidates, built)`` kept, in order.
    """
    if configs is None:
        configs = [dict(c.config) for c in candidates]
    kept, specs = [], []
    for candidate, config in zip(candidates, configs):
        spec = build(config)
        if candidate.config.get('topology') == 'auto' and not two_level(spec):
            continue
        kept.append(candidate)
        specs.append(spec)
    return kept, specs
