"""What ``benchmark_periodic.py`` measures: the average step and the bytes
across nodes of whole training runs on emulated nodes, per hook setting
and link rate, beside the cost model's bytes.

``benchmark_step_time.py`` times single DDP steps bucket by bucket; a
periodic hook (``post_local_sgd``, ``diloco``) spends its time in the
step that synchronises, once every ``period`` steps, after the optimizer
step, which those timed steps never run. So each hook setting here trains
through the real trainer (``tools/dist_train.sh``) twice on the emulated
nodes, ``n1 < n2`` iterations, both whole periods:

* **The average step** is the mean of MMEngine's per-iteration ``time``
  (IterTimerHook: from one iteration's end to the next, the synchronising
  step and every runner hook included) over whole periods after the first
  one, read from the longer run's ``vis_data/scalars.json``: the logger
  interval and the log processor's window are both the period, so each
  logged ``time`` is one period's mean, synchronisation included (the
  runner hook that synchronises runs before the timer's). Why not the
  difference of the two runs' wall times: it differences two runs whose
  start-up (process start, rendezvous, first iteration) varies by
  seconds on a shared host, which lands on a few periods' difference;
  within one run the first period (DDP's first step, lazy set-up) is left
  out and nothing else is. The shorter run's own mean is kept as a check.
* **The bytes per step** on each node's link are the difference of the
  interface counters around the two runs over ``n2 - n1``: start-up
  traffic (rendezvous, DDP's first broadcast) and the end of a run cancel.
  The payload (headers out, :meth:`LinkBytes.payload`) is compared with
  the model: for a periodic hook its record's ``model_bytes`` (what
  ``model_stats.py`` prints) as a ring puts it on each node's link; for a
  per-step hook the cost model's catalogue, as ``benchmark_step_time.py``
  predicts it. The exchange inside the node (``inner``, every step, with
  several ranks a node) is shown apart: it never crosses the link.
"""
import ast
import json
import math
import os.path as osp
import shutil
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = [
    'DEFAULT_HOOKS', 'HookSetting', 'parse_hook_setting', 'RunPlan',
    'run_plan', 'train_command', 'window_times', 'measure', 'predict',
    'summarize', 'report_lines', 'write_json', 'TARGETS'
]

#: What is compared when ``--hooks`` is not given.
DEFAULT_HOOKS = ('allreduce', 'int8_compress', 'post_local_sgd:period=25',
                 'diloco:period=25')
#: Issue 45's targets: the average step at most this times the unshaped
#: allreduce step; diloco's bytes at most this share of allreduce's
#: (post_local_sgd's: 1 / period).
TARGETS = dict(step_ratio=1.25, diloco_bytes=1 / 12)
_SYNTAX = ('NAME or NAME:KEY=VALUE[,KEY=VALUE...], e.g. diloco:period=25 or '
           'post_local_sgd:period=25,inner.type=bf16_compress')


@dataclass(frozen=True)
class HookSetting:
    """A hook under one setting, as ``--hooks`` names it.

    Attributes:
        text (str): As given (its name in the table).
        hook_type (str): The ``comm_hook`` type.
        options (dict): Its state keys, nested where dotted.
        periodic (bool): Whether its record says it synchronises across
            nodes every ``period`` steps.
        state_kwargs (dict): The checked state keys, defaults included.
    """
    text: str
    hook_type: str
    options: dict = field(default_factory=dict)
    periodic: bool = False
    state_kwargs: dict = field(default_factory=dict)

    @property
    def period(self) -> int:
        return self.state_kwargs.get('period', 1) if self.periodic else 1

    @property
    def start_iter(self) -> int:
        return self.state_kwargs.get('start_iter', 0) if self.periodic else 0

    def config(self) -> dict:
        return dict(type=self.hook_type, **self.options)


def _value(text: str):
    """A Python literal (``25``, ``0.7``, ``True``, ``'int8'``), else the
    text itself, so ``outer_format=bf16`` needs no quotes."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_hook_setting(text: str) -> HookSetting:
    """``NAME[:KEY=VALUE[,KEY=VALUE...]]`` as a checked
    :class:`HookSetting` (a dotted KEY sets a nested key:
    ``inner.type=bf16_compress``).

    Raises:
        ValueError: Naming the bad part and the syntax, or the config
            check's own message (an unknown hook, key or value).
    """
    from mmcv_custom.comm.builder import check_comm_hook_cfg, hook_record
    name, _, rest = text.partition(':')
    if not name or (':' in text and not rest):
        raise ValueError(f'{text!r} should be {_SYNTAX}')
    if name == 'auto':
        raise ValueError("'auto' picks a hook by timing the candidates "
                         'during the run; name the hooks to compare')
    options: Dict[str, object] = {}
    for item in filter(None, rest.split(',')):
        key, eq, value = item.partition('=')
        if not eq or not key:
            raise ValueError(f'{text!r}: {item!r} is not KEY=VALUE; give '
                             f'{_SYNTAX}')
        *parents, leaf = key.split('.')
        node = options
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _value(value)
    try:
        checked = check_comm_hook_cfg(dict(type=name, **options))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f'{text!r}: {e.args[0]}') from None
    return HookSetting(text, name, options,
                       hook_record(name).periodic, checked['state_kwargs'])


@dataclass(frozen=True)
class RunPlan:
    """The two runs of one hook setting: ``n1 < n2`` iterations, logged
    every ``interval`` (a period), timed after ``warmup``."""
    interval: int
    warmup: int
    n1: int
    n2: int


def run_plan(setting: HookSetting, lengths: Sequence[int],
             window: int) -> RunPlan:
    """Run lengths in whole periods (``window`` iterations for a per-step
    hook) after ``start_iter``: ``lengths`` ``(a, b)`` periods; the first
    period after ``start_iter`` is the warm-up the average leaves out."""
    unit = setting.period if setting.periodic else window
    offset = setting.start_iter
    interval = math.gcd(unit, offset)  # gcd(unit, 0) is unit
    a, b = lengths
    return RunPlan(interval, offset + unit, offset + a * unit,
                   offset + b * unit)


def train_command(dist_train: str, config: str, setting: HookSetting,
                  iters: int, interval: int, work_dir: str,
                  ranks_per_node: int,
                  cfg_options: Sequence[str]) -> List[str]:
    """``dist_train`` (``tools/dist_train.sh``) training ``iters``
    iterations with the setting's hook, ``time`` logged as the mean over
    ``interval``, no validation and no checkpoint (neither is timed; both
    would add traffic)."""
    from .convergence import Variant, hook_options
    variant = Variant(setting.text, setting.hook_type, setting.options,
                      setting.text, '', False, setting.periodic)
    options = hook_options(variant, 0) + [
        f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
        'val_cfg=None', 'val_dataloader=None', 'val_evaluator=None',
        'default_hooks.checkpoint=None',
        f'default_hooks.logger.interval={interval}',
        f'log_processor.window_size={interval}'
    ] + list(cfg_options)
    return [
        dist_train, config,
        str(ranks_per_node), '--work-dir', work_dir, '--cfg-options'
    ] + options


def window_times(work_dir: str) -> Dict[int, float]:
    """``{iteration: mean time over the window ending there}`` from the
    newest run's ``scalars.json`` under ``work_dir``."""
    from .convergence import find_runs
    runs = find_runs(work_dir)
    if not runs:
        raise RuntimeError(f'no vis_data/scalars.json under {work_dir}')
    out = {}
    with open(osp.join(runs[-1], 'vis_data', 'scalars.json')) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if 'time' in entry and 'iter' in entry:
                out[int(entry['iter'])] = float(entry['time'])
    return out


def _average(times: Dict[int, float], plan: RunPlan, n: int) -> float:
    """The mean step over ``(plan.warmup, n]``: the windows' means there,
    each over ``plan.interval`` iterations."""
    ends = range(plan.warmup + plan.interval, n + 1, plan.interval)
    missing = [i for i in ends if i not in times]
    if missing or not ends:
        raise RuntimeError(f'the log lacks the time at iterations '
                           f'{missing or [n]}')
    return sum(times[i] for i in ends) / len(ends)


def _links(cluster):
    from mmcv_custom.launching.emulated_cluster import namespace_link_bytes
    return [
        namespace_link_bytes(n.namespace, n.interface) for n in cluster.nodes
    ]


def measure(cluster, setting: HookSetting, plan: RunPlan, dist_train: str,
            config: str, work_dir: str, cfg_options: Sequence[str],
            timeout: Optional[float]) -> dict:
    """Train ``plan``'s two runs of ``setting`` on the open ``cluster`` at
    its current rate; the average step and each node's link bytes per
    step (sent, and its payload).

    Raises:
        RuntimeError: A run failed (which, how, and its log folder).
    """
    from mmcv_custom.launching.emulated_cluster import run_on_nodes
    counted, times, walls = [], {}, []
    for n in (plan.n1, plan.n2):
        folder = osp.join(work_dir, f'iters{n}')
        shutil.rmtree(folder, ignore_errors=True)
        before = _links(cluster)
        start = time.monotonic()
        result = run_on_nodes(
            cluster,
            train_command(dist_train, config, setting, n, plan.interval,
                          folder, cluster.ranks_per_node, cfg_options),
            log_dir=folder,
            timeout=timeout)
        walls.append(time.monotonic() - start)
        if result.returncode:
            raise RuntimeError(f'{setting.text}, {n} iterations: '
                               f'{result.describe()} (logs: {folder})')
        counted.append([b - a for a, b in zip(before, _links(cluster))])
        times[n] = window_times(folder)
    steps = plan.n2 - plan.n1
    sent = [(b.tx - a.tx) / steps for a, b in zip(*counted)]
    payload = [(b.payload() - a.payload()) / steps for a, b in zip(*counted)]
    return dict(
        hook=setting.text,
        n1=plan.n1,
        n2=plan.n2,
        step_s=_average(times[plan.n2], plan, plan.n2),
        step_s_short=_average(times[plan.n1], plan, plan.n1),
        link_tx_bytes=sent,
        link_payload_bytes=payload,
        wall_s=walls)


def _buckets(params, bucket_cap_mb):
    """DDP's buckets as ``predicted_link_bytes`` reads them."""
    from .cost.buckets import ddp_buckets
    return [
        dict(params=[
            dict(shape=list(p.shape), dtype=p.dtype, index=i)
            for p, i in zip(b.params, b.indices)
        ]) for b in ddp_buckets(params, bucket_cap_mb)
    ]


def _wire(sent_bytes: Optional[float], ranks: int) -> Optional[float]:
    """A count by the one rule (:mod:`mmcv_custom.comm.traffic`) as the
    bytes a ring over ``ranks`` puts out of each: ``2 (R - 1) / R``."""
    if sent_bytes is None:
        return None
    return sent_bytes * 2 * (ranks - 1) / ranks


def predict(config: str, cfg_options: Optional[dict], setting: HookSetting,
            nodes: int, ranks_per_node: int) -> dict:
    """The model's bytes per step: ``link`` on each node's link (each way),
    and ``inner``, what each rank sends inside its node (a periodic hook's
    inner exchange; None where unknown or not one)."""
    from mmengine.config import Config

    from .model_stats import stats
    from .step_time_report import predicted_link_bytes
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if not setting.periodic:
        from .cost.model import config_params
        params = config_params(config, cfg_options)[0]
        wrapper = cfg.get('model_wrapper_cfg') or {}
        buckets = _buckets(params, wrapper.get('bucket_cap_mb'))
        link = predicted_link_bytes(buckets, [setting.hook_type], nodes,
                                    ranks_per_node)[setting.hook_type]
        return dict(link=link, inner=None)
    cfg.comm_hook = setting.config()
    link = _wire(stats(cfg, gpus=(nodes, ))['hook_bytes'], nodes)
    inner = None
    if ranks_per_node > 1:
        cfg.comm_hook = setting.state_kwargs['inner']
        inner = _wire(
            stats(cfg, gpus=(ranks_per_node, ))['hook_bytes'], ranks_per_node)
    return dict(link=link, inner=inner)


def summarize(rows: List[dict]) -> List[dict]:
    """Each row with ``x_unshaped`` (its average step over the unshaped
    allreduce step), ``x_bytes`` (its payload per step over allreduce's at
    the same rate, else any) and ``verdict`` (issue 45's targets, for the
    periodic hooks)."""
    ref = {r['rate']: r for r in rows if r['hook'] == 'allreduce'}
    unshaped = ref.get('unshaped')
    for row in rows:
        base = ref.get(row['rate']) or next(iter(ref.values()), None)
        row['x_unshaped'] = (
            row['step_s'] / unshaped['step_s'] if unshaped else None)
        row['x_bytes'] = (
            max(row['link_payload_bytes']) /
            max(base['link_payload_bytes']) if base else None)
        row['verdict'] = _verdict(row)
    return rows


def _verdict(row) -> Optional[str]:
    if not row['periodic'] or row['x_bytes'] is None:
        return None
    limit = (
        TARGETS['diloco_bytes'] if row['type'] == 'diloco' else 1 /
        row['period'])
    bytes_ok = row['x_bytes'] <= limit
    words = [
        f"bytes {row['x_bytes']:.4f} x allreduce's "
        f"{'<=' if bytes_ok else '>'} {limit:.4f}: "
        f"{'PASS' if bytes_ok else 'FAIL'}"
    ]
    if row['x_unshaped'] is not None:
        step_ok = row['x_unshaped'] <= TARGETS['step_ratio']
        words.append(f"average step {row['x_unshaped']:.2f} x unshaped "
                     f"allreduce {'<=' if step_ok else '>'} "
                     f"{TARGETS['step_ratio']}: "
                     f"{'PASS' if step_ok else 'FAIL'}")
    return '; '.join(words)


def _mb(value) -> str:
    if value is None:
        return '—'
    if isinstance(value, (list, tuple)):
        return '/'.join(f'{v / 1e6:.3f}' for v in value)
    return f'{value / 1e6:.3f}'


def report_lines(rows: List[dict], meta: dict) -> List[str]:
    """The Markdown table and the verdicts."""
    lines = [
        f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks, "
        f"{meta['config']}. step: the mean over whole periods after the "
        'first, sync steps included; link: what each node\'s link sent per '
        'step (counters, n2 - n1 iterations), payload: less headers; '
        'model: predicted payload; inner: what a rank sends inside its node '
        'per step (not on the link).', '',
        '| rate | hook | iters | step (s) | short run (s) | x unshaped '
        'allreduce | link (MB/step) | payload (MB/step) | model (MB/step) | '
        'inner (MB/step) | x allreduce bytes |', '|' + '---|' * 11
    ]
    for r in rows:
        ratio = '—' if r['x_unshaped'] is None else f"{r['x_unshaped']:.2f}"
        share = '—' if r['x_bytes'] is None else f"{r['x_bytes']:.4f}"
        lines.append(
            f"| {r['rate']} | {r['hook']} | {r['n1']}/{r['n2']} | "
            f"{r['step_s']:.3f} | {r['step_s_short']:.3f} | {ratio} | "
            f"{_mb(r['link_tx_bytes'])} | {_mb(r['link_payload_bytes'])} | "
            f"{_mb(r['model_bytes'])} | {_mb(r['inner_bytes'])} | {share} |")
    verdicts = [
        f"{r['rate']}, {r['hook']}: {r['verdict']}" for r in rows
        if r['verdict']
    ]
    return lines + ([''] + verdicts if verdicts else [])


def write_json(path: str, rows: List[dict], meta: dict) -> None:
    """``{'meta': ..., 'rows': [...]}``, written through a temporary
    name."""
    from mmcv_custom.integrity.files import atomic_write_text
    atomic_write_text(path, json.dumps(dict(meta=meta, rows=rows), indent=1))
