"""What ``tools/analysis_tools/benchmark_comm_hooks.py`` reports from the
ranks' results (see :mod:`.hook_benchmark`): the two tables of
docs/en/notes/benchmarks.md, the verdict on the targets, and the plot.

The rows and columns are the hooks :mod:`.hook_benchmark` compared, read
from the registry and the records; the targets of a wire format (bytes,
int8's phases) apply to the hooks whose record names that format.
"""
import math
import statistics

import torch

from mmcv_custom.hooks.cast import cpu_codec
from .hook_benchmark import INT8_BLOCK, MB, codec_columns, pairs
from .step_time_report import median_error, noise_verdict

__all__ = ['report', 'plot']


def _ratio(a, b):
    return a / b if b > 0 else float('nan')


def _ms(seconds):
    ms = seconds * 1e3
    return f'{ms:.1f} ms' if ms >= 1 else f'{ms:.2f} ms'


def _table(header, rows):
    """A Markdown table, as docs/en/notes/benchmarks.md shows the results."""
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
    return lines


def _dash_or(value, fmt):
    """``value`` formatted, or a dash where there is none (NaN)."""
    return '—' if math.isnan(value) else fmt(value)


# Quantize with error feedback reads the bucket and the residual (4 + 4
# bytes an element), writes the residual and the int8 value (4 + 1); the
# dequantize reads 1 and writes 4: 18 bytes against the copy's 8.
_INT8_CODEC_FLOOR = 18 / 8


def _spread(per_round):
    """The standard error of a statistic from its value in each round
    (:func:`~.step_time_report.median_error`); None from one round, which
    shows no spread."""
    return median_error(per_round) if len(per_round) > 1 else None


def _ratio_noise(value):
    return f'{value:.3f}'


def _every_size(judged):
    """Every size's ``(verdict, ratio, codec, size)`` as one line's end:
    FAIL where one fails, else within noise where one is, else PASS;
    with the ratio that decides it, and the worst where that differs."""
    worst = max(judged, key=lambda j: j[1])
    for word in ('FAIL', 'within noise', 'PASS'):
        found = [j for j in judged if j[0].startswith(word)]
        if found:
            verdict, r, name, size = max(found, key=lambda j: j[1])
            break
    where = f'{r:.2f}x, {name} at {size:g} MB'
    if (r, name, size) == worst[1:]:
        return f'{verdict} (worst {where})'
    return (f'{verdict} ({where}; worst {worst[1]:.2f}x, {worst[2]} at '
            f'{worst[3]:g} MB)')


def _int8_codec_note(results):
    """What ran the int8 codec: each rank asked, as its thread count (and
    device) decides it, not this process."""
    flags = {bool(e.get('int8_c_kernel')) for e in results}
    if flags == {True}:
        return 'C kernel (mmcv_custom._cpu_codec) in every rank'
    if flags == {False}:
        return 'torch ops (no C kernel: not built, GPU, or threads > 1)'
    return 'C kernel at some sizes, torch ops at others'


def report(results, world_size, backend, repeat=None):
    """The results as the two tables of docs/en/notes/benchmarks.md, then
    the verdict on the targets, as text."""
    rounds = '' if repeat is None else f', {repeat} rounds'
    lines = [
        f'{world_size} ranks, backend {backend}, torch '
        f'{torch.__version__}{rounds}'
    ]
    if backend == 'gloo':
        lines.append(f'CPU casts: {cpu_codec()}')
    lines.append(f'int8 codec (block {INT8_BLOCK}): '
                 f'{_int8_codec_note(results)}')
    # The hooks and codecs the results hold: results saved before a hook
    # was registered report what they measured (the published tables
    # are checked so against their JSON).
    held = results[0] if results else dict(hooks={}, codec_s={})
    compared = [p for p in pairs() if p.ours in held['hooks']]
    columns = [c for c in codec_columns() if c[0] in held['codec_s']]
    # Only pairs with a PyTorch hook have a ratio and a target; per
    # family, the ratio per size and, per size, the paired ratio of each
    # round (the hooks take turns in every round).
    ratios = {p.family: [] for p in compared if p.theirs}
    rounds = {p.family: [] for p in compared if p.theirs}
    # Where int8's numbers are compared to bf16's, and codecs to a copy.
    bf16 = next((p.ours for p in compared if p.record.sent_format == 'bf16'),
                None)
    codec_of = {
        record.sent_format: key
        for key, _, record in columns if key.startswith('ours.')
    }
    bytes_ok = True
    int8_phases = []  # (size, all_to_all send / fp32, gathered / fp32)
    int8_vs_bf16, int8_cost = [], []  # step / bf16's; codec / copy, bf16
    step_rows, codec_rows, codec_verdicts = [], [], []
    for entry in results:
        hooks = entry['hooks']
        fp32_bytes = entry['numel'] * 4
        bucket = f'{entry["size_mb"]:g} MB'
        for family, ours, theirs, record, _, _ in compared:
            data = hooks[ours]
            theirs_s = hooks[theirs]['hook_s'] if theirs else math.nan
            r = (
                _ratio(data['step_s'], hooks[theirs]['step_s'])
                if theirs else math.nan)
            if theirs:
                ratios[family].append(r)
                rounds[family].append([
                    _ratio(a, b)
                    for a, b in zip(data['times'], hooks[theirs]['times'])
                ])
            # By the one counting rule (mmcv_custom.comm.traffic), as the
            # ranks counted it.
            wire = data['wire_bytes']
            if record.half_precision:
                bytes_ok &= wire == fp32_bytes // 2
            elif record.sent_format == 'int8':
                by = data['wire_bytes_by_collective']
                int8_phases.append(
                    (entry['size_mb'], by['all_to_all'] / fp32_bytes,
                     by['all_gather'] * world_size / fp32_bytes))
                if bf16:
                    int8_vs_bf16.append(
                        _ratio(data['step_s'], hooks[bf16]['step_s']))
            step_rows.append([
                bucket, f'`{ours[len("ours."):]}`',
                _ms(data['hook_s']),
                _dash_or(theirs_s, _ms),
                _dash_or(r, '{:.2f}'.format), f'{wire / MB:.4g}',
                f'{data["rel_error"]:.1e}'
            ])
        codec = entry['codec_s']
        cells = [bucket, _ms(codec['copy_fp32'])]
        for name, _, record in columns:
            r = _ratio(codec[name], codec['copy_fp32'])
            if name.startswith('ours.') and record.half_precision:
                # Each round's codec against the same round's copy.
                each = entry['codec_rounds']
                noise = _spread([
                    _ratio(a, b) for a, b in zip(each[name], each['copy_fp32'])
                ])
                codec_verdicts.append(
                    (noise_verdict(r, 1.5, noise,
                                   _ratio_noise), r, name, entry['size_mb']))
            cells.append(f'{r:.2f}x')
        if 'int8' in codec_of:
            int8 = codec[codec_of['int8']]
            int8_cost.append((_ratio(int8, codec['copy_fp32']),
                              _ratio(int8, codec[codec_of['bf16']])
                              if 'bf16' in codec_of else math.nan))
        codec_rows.append(cells)
    lines += [
        '', 'Time per bucket: `ours` and `PyTorch` are the hook\'s own time '
        '(the step minus that of a hook that communicates nothing); '
        '`ours / PyTorch` is the ratio of whole step times (medians; the '
        'slowest rank sets each step); PyTorch has no int8 hook that runs '
        'here (—). `wire MB (ours)`: MiB a rank sends, as a training '
        'run\'s comm_MB counts them (the one counting rule, '
        'mmcv_custom.comm.traffic), from what it hands to its collectives '
        '(the most of any rank, from the profiler): the tensor an '
        'all-reduce would carry to move the same bytes, i.e. the '
        'all_reduce\'s tensor, half an all_to_all\'s send tensor, half '
        'what an all_gather gathers (int8\'s pair: its quantized bucket '
        'about once). A ring all-reduce sends 2 (N - 1) / N of it.', ''
    ]
    lines += _table([
        'bucket', 'hook', 'ours', 'PyTorch', 'ours / PyTorch',
        'wire MB (ours)', 'rel. error'
    ], step_rows)
    lines += [
        '', 'Compress + decompress on every rank at once, as a '
        'multiple of a plain copy of the fp32 bucket (int8: quantize '
        'with error feedback, then dequantize):', ''
    ]
    lines += _table(['bucket', 'fp32 copy'] +
                    [header for _, header, _ in columns], codec_rows)
    lines.append('')
    lines.append('Targets (step time incl. the shared backward; median '
                 'over bucket sizes; a verdict only where the rounds\' '
                 'spread, twice its standard error, keeps clear of the '
                 'target, else within noise):')
    for family, values in ratios.items():
        med = statistics.median(values)
        # The statistic in each round: its spread is the noise.
        per_round = [
            statistics.median(sizes) for sizes in zip(*rounds[family])
        ]
        verdict = noise_verdict(med, 1.05, _spread(per_round), _ratio_noise)
        lines.append(f'  ours/torch {family:<9}: {med:.3f} {verdict} '
                     '(<= 1.05)')
    lines.append(f'  wire bytes fp16/bf16 = 0.5 x fp32: '
                 f'{"PASS" if bytes_ok else "FAIL"}')
    # Each phase moves the quantized bucket: 1 byte an element plus a 4-byte
    # scale a block, against 4 bytes of fp32 (0.2539 for blocks of 256);
    # 0.27 leaves room for padding to whole blocks and equal segments.
    if int8_phases:
        target = (1 + 4 / INT8_BLOCK) / 4
        send = max(int8_phases, key=lambda p: p[1])
        gathered = max(int8_phases, key=lambda p: p[2])
        ok = send[1] <= 0.27 and gathered[2] <= 0.27
        lines.append(
            f'  wire bytes int8 <= 0.27 x fp32 per phase ((1 + 4/'
            f'{INT8_BLOCK}) / 4 = {target:.4f}), every size: '
            f'{"PASS" if ok else "FAIL"} (worst: all_to_all send '
            f'{send[1]:.4f} at {send[0]:g} MB, {world_size} x all_gather '
            f'input {gathered[2]:.4f} at {gathered[0]:g} MB)')
    # 1.5 is the byte ratio of the two (read 4 + write 2, then read 2 +
    # write 4, against read 4 + write 4): the floor for memory-bound passes.
    if codec_verdicts:
        lines.append(f'  compress+decompress <= 1.5 x fp32 copy, every size: '
                     f'{_every_size(codec_verdicts)}')
    lines.append('Reported, no target:')
    if int8_vs_bf16:
        lines.append(f'  int8/bf16 step time (ours, median over sizes): '
                     f'{statistics.median(int8_vs_bf16):.3f}')
    if int8_cost:
        copies = [c for c, _ in int8_cost]
        bf16s = [b for _, b in int8_cost]
        lines.append(
            f'  int8 compress+decompress: {min(copies):.2f}x to '
            f'{max(copies):.2f}x an fp32 copy (it moves '
            f'{_INT8_CODEC_FLOOR:.2f}x the copy\'s bytes), {min(bf16s):.2f}x '
            f'to {max(bf16s):.2f}x ours bf16')
    return '\n'.join(lines)


def plot(results, path):
    """Two panels against the bucket size: each hook's time per bucket,
    and each codec's cost as a multiple of a plain copy."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    sizes = [e['size_mb'] for e in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    # The hooks and codecs the ranks measured, in their order.
    for name in results[0]['hooks']:
        if name == 'noop':
            continue
        style = '-' if name.startswith('ours.') else '--'
        ax1.plot(
            sizes, [e['hooks'][name]['hook_s'] * 1e3 for e in results],
            style,
            marker='o',
            label=name)
    ax1.set(
        xscale='log',
        yscale='log',
        xlabel='bucket size (MB of fp32)',
        ylabel='ms per bucket (hook only)',
        title='Time per bucket')
    ax1.legend(fontsize=7)
    for name in list(results[0]['codec_s'])[1:]:
        style = '-' if name.startswith('ours.') else '--'
        ax2.plot(
            sizes,
            [e['codec_s'][name] / e['codec_s']['copy_fp32'] for e in results],
            style,
            marker='o',
            label=name)
    ax2.axhline(1.5, color='grey', lw=0.8, ls=':', label='target 1.5x')
    ax2.set(
        xscale='log',
        xlabel='bucket size (MB of fp32)',
        ylabel='x time of a plain fp32 copy',
        title='Compress + decompress cost')
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
