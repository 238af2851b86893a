"""What ``tools/analysis_tools/compare_comm_convergence.py`` compares and
how it reads the runs back: the variants (every registered hook, under
the settings its record names, with its label and colour), each run's
``scalars.json`` and dumped ``comm_hook``, the table, the verdict and the
plot. Training the runs is :mod:`.convergence_runs`.
"""
import ast
import glob
import inspect
import itertools
import json
import os.path as osp
from typing import Dict, List, Mapping, NamedTuple, Optional

from mmcv_custom.comm import states  # noqa: F401 (registers the factories)
from mmcv_custom.comm.records import HookVariant
from mmcv_custom.comm.registry import COMM_HOOK_STATES
from .registered import DEFAULT_COLOURS, registered_hooks

__all__ = [
    'BASELINE', 'Variant', 'variants', 'hook_options', 'find_runs',
    'read_scalars', 'read_comm_hook', 'mismatch', 'debiased_ema',
    'auto_smooth', 'summarize', 'format_table', 'verdict', 'plot',
    'max_iters_options'
]

#: The variant every other is compared with.
BASELINE = 'allreduce'


class Variant(NamedTuple):
    """One hook under one setting, trained as a run of its own.

    Attributes:
        name (str): Its name on the command line and in the table.
        hook_type (str): The ``comm_hook`` type it trains with.
        options (Mapping): The state keys it sets.
        label (str): Its name in the plot's legends.
        colour (str): Its colour there.
        takes_block_size (bool): Whether its hook's state takes
            ``block_size`` (``--block-size`` is passed on to it).
        periodic (bool): Whether its hook synchronises the model across
            nodes every ``period`` steps (``post_local_sgd``, ``diloco``):
            on one node it would compare nothing of that.
    """
    name: str
    hook_type: str
    options: Mapping
    label: str
    colour: str
    takes_block_size: bool
    periodic: bool = False


def _state_params(hook_type: str) -> Mapping[str, inspect.Parameter]:
    """The arguments of the state factory registered for ``hook_type``
    (none for a hook without one)."""
    factory = COMM_HOOK_STATES.module_dict.get(hook_type)
    return {} if factory is None else inspect.signature(factory).parameters


def variants() -> Dict[str, Variant]:
    """Every registered hook's variants, in the order of registration: the
    settings its record names (``HookRecord.variants``), else one named
    as registered with its record's ``benchmark_options``. A hook without
    a record gets its name as label and a colour of
    :data:`~.registered.DEFAULT_COLOURS`."""
    out = {}
    spare = itertools.cycle(DEFAULT_COLOURS)
    for hook in registered_hooks():
        # A periodic hook's block_size is its outer int8's: an fp32 or
        # bf16 outer format refuses it.
        takes_block_size = ('block_size' in _state_params(hook.name)
                            and not hook.record.periodic)
        settings = hook.record.variants or (HookVariant(
            hook.name, hook.record.benchmark_options, hook.label,
            hook.colour), )
        for setting in settings:
            out[setting.name] = Variant(setting.name, hook.name,
                                        dict(setting.options), setting.label,
                                        setting.colour or next(spare),
                                        takes_block_size, hook.record.periodic)
    return out


def _dotted(key: str, value) -> List[str]:
    """``key=value`` as ``--cfg-options`` takes it: a dict as one option
    per leaf, its keys dotted (``comm_hook.inner.type=bf16_compress``),
    since MMEngine merges a dotted key into the config's dict but reads a
    dict's text as a string."""
    if not isinstance(value, Mapping):
        return [f'{key}={value}']
    return [
        option for k, v in value.items()
        for option in _dotted(f'{key}.{k}', v)
    ]


def hook_options(variant: Variant, block_size: int) -> List[str]:
    """The ``--cfg-options`` that select ``variant``'s hook: its type,
    ``block_size`` where its state takes one (the other hooks' states
    reject keys they do not take), and its own settings, a nested one
    (a periodic hook's ``inner``) as dotted keys."""
    options = [f'comm_hook.type={variant.hook_type}']
    if variant.takes_block_size:
        options.append(f'comm_hook.block_size={block_size}')
    for k, v in variant.options.items():
        options += _dotted(f'comm_hook.{k}', v)
    return options


def find_runs(work_dir: str) -> List[str]:
    """Run folders (``YYYYmmdd_HHMMSS``) under ``work_dir`` that hold a
    ``vis_data/scalars.json``, oldest first."""
    return sorted(
        osp.dirname(osp.dirname(p)) for p in glob.glob(
            osp.join(work_dir, '2*_*', 'vis_data', 'scalars.json')))


def read_scalars(path: str) -> dict:
    """Loss curve, validations and telemetry from one ``scalars.json``.

    MMEngine's ``LocalVisBackend`` writes one JSON object per line: training
    lines carry ``loss`` (the mean over the logger's window) and ``iter``;
    validation lines carry the metrics (``mIoU``...) and ``step``. A line
    cut short by a killed run is skipped rather than failing the report.

    Returns:
        dict: ``iters``, ``loss``, ``val`` (a list of ``{'step', 'mIoU',
        ...}``), ``comm_ratio`` and ``comm_MB`` (last logged value, or None).
    """
    iters, losses, val = [], [], []
    comm_ratio = comm_mb = None
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if 'loss' in entry:
                iters.append(entry.get('iter', entry.get('step')))
                losses.append(float(entry['loss']))
                comm_ratio = entry.get('comm_ratio', comm_ratio)
                comm_mb = entry.get('comm_MB', comm_mb)
            elif 'mIoU' in entry:
                val.append(entry)
    return dict(
        iters=iters,
        loss=losses,
        val=val,
        comm_ratio=comm_ratio,
        comm_MB=comm_mb)


def read_comm_hook(run: str) -> Optional[dict]:
    """The ``comm_hook`` a run was trained with, from the config MMEngine
    dumped beside its scalars (``<run>/vis_data/config.py``, overrides
    applied), or None if it has none.

    Read with :mod:`ast`, not executed: a run folder may come from anywhere,
    and the dump spells the dict out as ``dict(key=literal, ...)``, a
    nested one too (a periodic hook's ``inner=dict(type=...)``).
    """
    path = osp.join(run, 'vis_data', 'config.py')
    if not osp.isfile(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == 'comm_hook'):
            try:
                return _literal(node.value)
            except ValueError:
                return None
    return None


def _literal(node: ast.AST):
    """The value of a literal, where a ``dict(key=...)`` call may stand
    for a dict at any depth (as MMEngine dumps them); ``ValueError`` for
    anything else."""
    if isinstance(node, ast.Call):
        if (isinstance(node.func, ast.Name) and node.func.id == 'dict'
                and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return {k.arg: _literal(k.value) for k in node.keywords}
        raise ValueError(f'not a literal: {ast.dump(node)}')
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Dict):
        return {
            _literal(k): _literal(v)
            for k, v in zip(node.keys, node.values)
        }
    return ast.literal_eval(node)


def mismatch(variant: Variant, hook: Optional[dict]) -> Optional[str]:
    """Why ``hook`` (a run's own ``comm_hook``) is not ``variant``'s, or
    None when it is (or the run does not say). A setting the run left out
    counts as its state's default."""
    if not isinstance(hook, dict):
        return None
    if hook.get('type') != variant.hook_type:
        return (f"{variant.name!r} should be comm_hook type "
                f"{variant.hook_type!r}, but the run used "
                f"{hook.get('type')!r}")
    params = _state_params(variant.hook_type)
    for key, value in variant.options.items():
        used = hook.get(key, params[key].default if key in params else None)
        if used != value:
            return (f'{variant.name!r} should have {key}={value}, but the '
                    f'run used {used}')
    return None


def debiased_ema(values: List[float], weight: float) -> List[float]:
    """TensorBoard's debiased exponential moving average: early points are
    not pulled towards zero, so curves of different runs compare from the
    first logged iteration."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i) if weight else v)
    return out


def auto_smooth(runs: Dict[str, dict]) -> float:
    """An EMA weight whose lag is about 3% of the longest curve: a fixed
    weight that suits 60 logged points would drag a 20-point curve far
    behind its raw values."""
    points = max([len(r['loss']) for r in runs.values() if r] or [1])
    lag = points / 30
    return lag / (1 + lag)


def summarize(runs: Dict[str, dict], smooth: float) -> List[dict]:
    """One row per variant (in ``runs``' order): the final mIoU, its
    difference to ``allreduce`` in points, comm_ratio, final smoothed loss.
    A variant whose run failed (``None`` in ``runs``) keeps its row, with
    its values empty."""
    base = runs.get(BASELINE)
    base_miou = base['val'][-1]['mIoU'] if base and base['val'] else None
    rows = []
    for variant, run in runs.items():
        row = dict(
            variant=variant,
            mIoU=None,
            delta_mIoU=None,
            comm_ratio=None,
            final_loss=None,
            final_iter=None)
        if run is not None:
            if run['val']:
                row['mIoU'] = run['val'][-1]['mIoU']
                if base_miou is not None:
                    row['delta_mIoU'] = row['mIoU'] - base_miou
            if run['loss']:
                row['final_loss'] = debiased_ema(run['loss'], smooth)[-1]
                row['final_iter'] = run['iters'][-1]
            row['comm_ratio'] = run['comm_ratio']
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    if value is None:
        return '-'
    # NaN: what a run logged as unknown (the comm_ratio of a hook without
    # a record, whose bytes are not counted).
    return 'unknown' if value != value else format(value, spec)


def format_table(rows: List[dict]) -> str:
    """The rows as a Markdown table."""
    lines = [
        '| variant | final mIoU | vs fp32 (points) | comm_ratio | '
        'final loss (smoothed) |', '|---|---|---|---|---|'
    ]
    for row in rows:
        lines.append(f"| `{row['variant']}` | {_fmt(row['mIoU'], '.2f')} | "
                     f"{_fmt(row['delta_mIoU'], '+.2f')} | "
                     f"{_fmt(row['comm_ratio'], '.3f')} | "
                     f"{_fmt(row['final_loss'], '.4f')} |")
    return '\n'.join(lines)


def verdict(rows: List[dict], tolerance: float) -> Optional[str]:
    """PASS/FAIL for ``int8_ef`` against ``allreduce``, and where
    ``int8_noef`` lands (informational), or None when the runs compared
    do not include both."""
    by = {row['variant']: row for row in rows}
    lines = []
    ef = by.get('int8_ef')
    if ef and BASELINE in by:
        if ef['delta_mIoU'] is None:
            lines.append(
                'int8_ef within {:g} mIoU point(s) of fp32 '
                'all-reduce: FAIL (no mIoU to compare)'.format(tolerance))
        else:
            ok = abs(ef['delta_mIoU']) <= tolerance
            lines.append(f'int8_ef within {tolerance:g} mIoU point(s) of fp32 '
                         f"all-reduce: {'PASS' if ok else 'FAIL'} "
                         f"({ef['delta_mIoU']:+.2f})")
    noef = by.get('int8_noef')
    if noef and noef['delta_mIoU'] is not None:
        lines.append(f"int8_noef vs fp32 all-reduce: "
                     f"{noef['delta_mIoU']:+.2f} mIoU points" +
                     (f" (int8_noef - int8_ef: "
                      f"{noef['delta_mIoU'] - ef['delta_mIoU']:+.2f})"
                      if ef and ef['delta_mIoU'] is not None else ''))
    return '\n'.join(lines) or None


def _colour(known: Dict[str, Variant], variant: str) -> str:
    """``variant``'s plot colour (the first default one for a variant no
    longer registered)."""
    return known[variant].colour if variant in known else DEFAULT_COLOURS[0]


def plot(runs: Dict[str, dict],
         rows: List[dict],
         path: str,
         title: str,
         smooth: float,
         tolerance: float = 1.0) -> None:
    """Three panels: loss curves (smoothed, raw faint), smoothed loss
    relative to fp32's, final mIoU per variant."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    known = variants()
    fig, (ax1, ax2, ax3) = plt.subplots(
        1, 3, figsize=(16, 4.6), gridspec_kw=dict(width_ratios=[5, 5, 3]))
    done = {v: r for v, r in runs.items() if r is not None and r['loss']}
    base = done.get(BASELINE)
    base_smooth = (
        dict(zip(base['iters'], debiased_ema(base['loss'], smooth)))
        if base else {})
    for variant, run in done.items():
        color = _colour(known, variant)
        label = known[variant].label if variant in known else variant
        smoothed = debiased_ema(run['loss'], smooth)
        ax1.plot(run['iters'], run['loss'], color=color, alpha=0.25, lw=0.8)
        ax1.plot(run['iters'], smoothed, color=color, lw=1.8, label=label)
        if base_smooth and variant != BASELINE:
            pairs = [(i, 100 * (s / base_smooth[i] - 1))
                     for i, s in zip(run['iters'], smoothed)
                     if i in base_smooth]
            ax2.plot([p[0] for p in pairs], [p[1] for p in pairs],
                     color=color,
                     lw=1.8,
                     label=label)
    ax1.set(
        yscale='log',
        xlabel='iteration',
        ylabel='training loss',
        title=f'Loss (EMA {smooth:.2f}; raw faint)')
    ax1.legend(fontsize=8)
    ax2.axhline(0.0, color='black', lw=0.8)
    ax2.set(
        xlabel='iteration',
        ylabel='smoothed loss vs fp32 all-reduce (%)',
        title='Loss relative to fp32 all-reduce')
    if base_smooth and len(done) > 1:
        ax2.legend(fontsize=8)
    scored = [r for r in rows if r['mIoU'] is not None]
    names = [
        known[r['variant']].label if r['variant'] in known else r['variant']
        for r in scored
    ]
    values = [r['mIoU'] for r in scored]
    bars = ax3.bar(
        range(len(scored)),
        values,
        color=[_colour(known, r['variant']) for r in scored],
        alpha=0.85)
    for bar, value in zip(bars, values):
        ax3.text(
            bar.get_x() + bar.get_width() / 2,
            value,
            f'{value:.2f}',
            ha='center',
            va='bottom',
            fontsize=8)
    base_row = next((r for r in scored if r['variant'] == BASELINE), None)
    if base_row:
        # Lines, not a shaded band: a band would hide behind the bars.
        for edge in (-tolerance, tolerance):
            ax3.axhline(
                base_row['mIoU'] + edge,
                color='grey',
                ls='--',
                lw=1,
                label=f'fp32 +/- {tolerance:g} point' if edge < 0 else None)
        ax3.legend(fontsize=8, loc='lower right')
    if values:
        low = min(values +
                  ([base_row['mIoU'] - tolerance] if base_row else []))
        ax3.set_ylim(max(0, low - 3), min(100, max(values) + 2))
    ax3.set_xticks(range(len(scored)))
    ax3.set_xticklabels(names, rotation=20, ha='right', fontsize=8)
    ax3.set(ylabel='mIoU (last validation)', title='Final mIoU')
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interval(cfg, key: str) -> Optional[int]:
    """The int at dotted ``key`` of ``cfg``, or None where it has none."""
    node = cfg
    for part in key.split('.'):
        node = node.get(part) if hasattr(node, 'get') else None
        if node is None:
            return None
    return node if isinstance(node, int) else None


#: What ``--max-iters`` lowers to N where the config's value is longer.
_INTERVALS = ('train_cfg.val_interval', 'default_hooks.checkpoint.interval')


def max_iters_options(cfg, max_iters: int) -> List[str]:
    """The ``--cfg-options`` of ``--max-iters``: the run's length, and
    the validation and checkpoint intervals at most that long."""
    options = [f'train_cfg.max_iters={max_iters}']
    for key in _INTERVALS:
        value = _interval(cfg, key)
        if value is not None and value > max_iters:
            options.append(f'{key}={max_iters}')
    return options
