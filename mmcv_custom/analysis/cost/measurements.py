"""A benchmark JSON (version 1, written by
``tools/analysis_tools/benchmark_step_time.py``), read and checked: what
the fit (:mod:`.fit`) and the catalogue check
(:func:`~.hooks.check_benchmark`) take; and a training run's own step
(:func:`step_from_log`, ``--from-log``). Standard library only."""
import dataclasses
import json
import math
import statistics
from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from .collectives import COLLECTIVE_KINDS, FORMS, LEVELS, Collective

__all__ = ['Benchmark', 'load_benchmark', 'LoggedStep', 'step_from_log']


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A benchmark JSON (version 1), read and checked.

    Attributes:
        source (str): Its path (or ``'<dict>'``).
        nodes (int): Emulated nodes.
        ranks_per_node (int): Ranks per node.
        grad_bytes (float): All trainable gradients per step.
        bucket_bytes (tuple[float]): Per bucket, in DDP's order.
        ready_s (tuple[float]): When each bucket reached the hook.
        backward_s (float): Backward time with a hook that sends nothing.
        compute_step_s (float): The whole step with that hook, unshaped.
        hooks (dict): Name -> ``dict(collectives=[Collective...],
            codec_s=float, form=str)``: the form it ran, ``'flat'`` or
            ``'two-level'`` (whose collectives name their level).
        rates (tuple[dict]): ``mbit`` (None: unshaped),
            ``calibrated_mbit`` and ``median_step_s`` (hook -> seconds).
        config (str, optional): The config measured.
        bucket_cap_mb (float, optional): DDP's setting in the run.
        notes (tuple[str]): What was read but cannot be modelled (a hook
            without its ``collectives``).
        comm_only (bool): Measured without the model's compute (the
            benchmark's ``--comm-only``): every bucket ready at once.
    """
    source: str
    nodes: int
    ranks_per_node: int
    grad_bytes: float
    bucket_bytes: Tuple[float, ...]
    ready_s: Tuple[float, ...]
    backward_s: float
    compute_step_s: float
    hooks: Mapping[str, Mapping]
    rates: Tuple[Mapping, ...]
    config: Optional[str] = None
    bucket_cap_mb: Optional[float] = None
    notes: Tuple[str, ...] = ()
    comm_only: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def measured_rates(self) -> List[float]:
        """The shaped rates, Mbit/s."""
        return [r['mbit'] for r in self.rates if r['mbit'] is not None]


def _field(data: Mapping, key: str, where: str, kind=(int, float)):
    if not isinstance(data, Mapping) or key not in data:
        raise ValueError(f'{where}: the key {key!r} is missing')
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = (
            kind.__name__ if isinstance(kind, type) else ' or '.join(
                k.__name__ for k in kind))
        raise ValueError(f'{where}: {key!r} should be a {names}, but got '
                         f'{type(value).__name__}: {value!r}')
    return value


def load_benchmark(source: Union[str, Mapping]) -> Benchmark:
    """Read a benchmark JSON (a path or the parsed dict) and check it.

    Raises:
        ValueError: Not JSON, another ``version``, or a key missing or of
            the wrong type (the message names it).
        OSError: The file cannot be read.
    """
    name = '<dict>'
    if isinstance(source, str):
        name = source
        with open(source) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f'{name}: not JSON ({e})') from None
    else:
        data = source
    if not isinstance(data, Mapping):
        raise ValueError(f'{name}: should hold a JSON object, but got '
                         f'{type(data).__name__}')
    if data.get('version') != 1:
        raise ValueError(f'{name}: version should be 1, but got '
                         f'{data.get("version")!r}')
    nodes = _field(data, 'nodes', name, int)
    per_node = _field(data, 'ranks_per_node', name, int)
    if nodes < 1 or per_node < 1:
        raise ValueError(f'{name}: nodes and ranks_per_node should be >= 1, '
                         f'but got {nodes} and {per_node}')
    buckets = _field(data, 'buckets', name, list)
    if not buckets:
        raise ValueError(f'{name}: buckets is empty')
    bucket_bytes, ready = [], []
    for i, bucket in enumerate(buckets):
        where = f'{name}: buckets[{i}]'
        bucket_bytes.append(_field(bucket, 'bytes', where))
        ready.append(_field(bucket, 'ready_s', where))
    hooks, notes = _read_hooks(data, name, len(buckets))
    rates = _read_rates(data, name)
    return Benchmark(
        source=name,
        nodes=nodes,
        ranks_per_node=per_node,
        grad_bytes=_field(data, 'grad_bytes', name),
        bucket_bytes=tuple(bucket_bytes),
        ready_s=tuple(ready),
        backward_s=_field(data, 'backward_s', name),
        compute_step_s=_compute_step(data, rates, name),
        hooks=hooks,
        rates=tuple(rates),
        notes=tuple(notes),
        config=data.get('config')
        if isinstance(data.get('config'), str) else None,
        bucket_cap_mb=data.get('bucket_cap_mb'),
        comm_only=data.get('comm_only') is True)


def _read_hooks(data: Mapping, name: str, num_buckets: int):
    """The benchmark's ``hooks``: each one's collectives and codec time;
    ``(hooks, notes)``, a note for each hook whose traffic is unknown."""
    hooks, notes = {}, []
    for hook, entry in _field(data, 'hooks', name, dict).items():
        where = f'{name}: hooks.{hook}'
        if isinstance(entry, Mapping) and entry.get('collectives') is None:
            # What it sent is unknown: it cannot be predicted, only shown.
            if hook != 'noop':
                notes.append(f'{where} lists no collectives: its points '
                             'are not fitted')
            continue
        collectives = []
        for j, c in enumerate(_field(entry, 'collectives', where, list)):
            at = f'{where}.collectives[{j}]'
            bucket = _field(c, 'bucket', at, int)
            if not 0 <= bucket < num_buckets:
                raise ValueError(f'{at}: bucket should be in [0, '
                                 f'{num_buckets - 1}], but got {bucket}')
            kind = _field(c, 'kind', at, str)
            if kind not in COLLECTIVE_KINDS:
                raise ValueError(f'{at}: kind should be one of '
                                 f'{list(COLLECTIVE_KINDS)}, but got '
                                 f'{kind!r}')
            level = c.get('level')
            if level is not None and level not in LEVELS:
                raise ValueError(f'{at}: level should be absent (all ranks) '
                                 f'or one of {list(LEVELS)}, but got '
                                 f'{level!r}')
            collectives.append(
                Collective(kind, _field(c, 'bytes', at), bucket, level))
        form = entry.get('form') or ('two-level' if any(
            c.level for c in collectives) else 'flat')
        if form not in FORMS:
            raise ValueError(f'{where}.form should be one of {list(FORMS)}, '
                             f'but got {form!r}')
        hooks[hook] = dict(
            collectives=collectives,
            codec_s=_field(entry, 'codec_s', where),
            form=form)
    return hooks, notes


def _read_rates(data: Mapping, name: str) -> list:
    """The benchmark's ``rates``: each link rate and its measured steps."""
    rates = []
    for i, rate in enumerate(_field(data, 'rates', name, list)):
        where = f'{name}: rates[{i}]'
        if not isinstance(rate, Mapping) or 'mbit' not in rate:
            raise ValueError(f'{where}: the key \'mbit\' is missing')
        mbit = rate['mbit']
        if mbit is not None:
            mbit = _field(rate, 'mbit', where)
            if mbit <= 0:
                raise ValueError(f'{where}: mbit should be > 0 or null, but '
                                 f'got {mbit}')
        steps = _field(rate, 'median_step_s', where, dict)
        # A hook that was not measured at this rate may be null.
        steps = {
            h: t
            for h, t in steps.items()
            if isinstance(t, (int,
                              float)) and not isinstance(t, bool) and t > 0
        }
        rates.append(
            dict(
                mbit=mbit,
                calibrated_mbit=rate.get('calibrated_mbit'),
                median_step_s=steps))
    return rates


def _compute_step(data: Mapping, rates: Sequence[Mapping], name: str) -> float:
    """``compute_step_s``, or where it is null the unshaped rate's
    ``noop`` step (the same measurement: a hook that sends nothing)."""
    if data.get('compute_step_s') is not None:
        return _field(data, 'compute_step_s', name)
    for rate in rates:
        if rate['mbit'] is None and 'noop' in rate['median_step_s']:
            return rate['median_step_s']['noop']
    raise ValueError(f'{name}: compute_step_s is null and no unshaped rate '
                     'has a noop step to take it from')


class LoggedStep(NamedTuple):
    """A real run's step, from its log (:func:`step_from_log`).

    Attributes:
        compute_step_s (float): The median iteration time less the
            communication it waited for (``comm_wait``), where logged.
        backward_s (float): Two thirds of that: the backward's share of a
            step whose forward costs half its backward (not logged).
        how (str): Where the figures come from, in words.
    """
    compute_step_s: float
    backward_s: float
    how: str


#: Iterations left out at the start of a run: the first ones build
#: buckets, warm caches and (with comm_hook auto) try hooks.
_SKIP = 0.2


def step_from_log(path: str) -> LoggedStep:
    """The compute step of the run that wrote ``path``: an MMEngine JSON
    log (``vis_data/<timestamp>.json`` or ``vis_data/scalars.json``), one
    object per logged iteration. The first fifth of the training lines is
    left out; the median of ``time - comm_wait`` over the rest is the step
    without its exposed communication.

    Raises:
        ValueError: The file cannot be read, is not text, is empty, holds
            a line that is not JSON or a ``time`` that is not a number, or
            holds no training line with ``time`` (each one line naming
            the file and what it should be).
    """
    what = ('an MMEngine JSON log of a training run (work_dirs/RUN/'
            'TIMESTAMP/vis_data/TIMESTAMP.json or scalars.json)')
    try:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    except IsADirectoryError:
        raise ValueError(f'--from-log {path}: is a directory; expected '
                         f'{what}') from None
    except OSError as e:
        raise ValueError(
            f'--from-log {path}: cannot read it ({e.strerror})') from None
    except UnicodeDecodeError as e:
        # A checkpoint, an image: not the text of a log.
        raise ValueError(f'--from-log {path}: not a text file (byte '
                         f'{e.start} is not UTF-8); expected {what}') from None
    if not text.strip():
        raise ValueError(f'--from-log {path}: the file is empty; expected '
                         f'{what}')
    steps, waits = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f'--from-log {path}: line {number} is not JSON; '
                             f'expected {what}') from None
        if not isinstance(entry, dict) or 'time' not in entry or (
                'loss' not in entry and 'lr' not in entry):
            continue  # a validation or test line
        time = entry['time']
        if isinstance(time, bool) or not isinstance(
                time, (int, float)) or not math.isfinite(time):
            raise ValueError(f'--from-log {path}: line {number} has time '
                             f'{time!r}, not a number of seconds; expected '
                             f'{what}')
        wait = entry.get('comm_wait')
        if isinstance(wait, (int, float)) and math.isfinite(wait):
            waits += 1
        else:
            wait = 0.0
        steps.append(float(time) - float(wait))
    if not steps:
        raise ValueError(f'--from-log {path}: no training line with a '
                         f'`time` in it; expected {what}')
    kept = steps[int(len(steps) * _SKIP):]
    step = statistics.median(kept)
    waited = ('less comm_wait' if waits == len(steps) else
              'with its communication: comm_wait is not logged')
    return LoggedStep(
        step, 2 * step / 3, f'measured by {path}: the median time of '
        f'{len(kept)} logged iterations, {waited}; the backward taken as '
        '2/3 of it')
