"""What ``tools/analysis_tools/benchmark_step_time.py`` reports from its
nodes' measurements (see :mod:`.step_time`): the rows per rate and hook,
the overlap bound a link allows, the noise of each row, the verdict on
issue 18's targets, the bytes each node's link carried (measured from
its counters) beside what the cost model predicts, the plot, and the
JSON that ``tools/analysis_tools/comm_cost_model.py --fit`` reads.
"""
import math
import statistics

from ..launching.emulated_cluster.counters import HEADER_BYTES
from .step_time import hook_configs, hook_labels, rate_label

__all__ = [
    'overlap_bound', 'median_error', 'round_error', 'noise_verdict',
    'link_per_step', 'predicted_link_bytes', 'summarize', 'report', 'verdict',
    'plot', 'bench_json', 'report_run'
]


def overlap_bound(buckets,
                  backward_s,
                  fraction,
                  rate_bytes_per_s,
                  codec_s=0.0):
    """The least exposed time a link of ``rate_bytes_per_s`` allows.

    Bucket ``i`` (``bytes`` of gradients, ready ``ready_s`` after the
    backward pass starts) puts ``fraction * bytes`` on the link, no sooner
    than it is ready and than the bucket before it has finished (one link,
    DDP's order). What is still travelling when the backward pass ends is
    exposed. Latency is left out: a physical bound, not a prediction.

    With ``codec_s`` (the hook's local work per step, shared among the
    buckets by their bytes), each bucket's chain is its codec, then its
    bytes; the bound is then what the link adds to the exposed time the
    codec alone leaves (``rate_bytes_per_s`` None: an unshaped link).
    """
    total = sum(b['bytes'] for b in buckets) or 1

    def exposed(rate):
        finish = 0.0
        for bucket in buckets:
            start = max(finish, bucket['ready_s'])
            wire = (fraction * bucket['bytes'] / rate) if rate else 0.0
            finish = start + codec_s * bucket['bytes'] / total + wire
        return max(0.0, finish - backward_s)

    if not codec_s:
        return exposed(rate_bytes_per_s)
    return exposed(rate_bytes_per_s) - exposed(None)


def median_error(times):
    """The standard error of the median of ``times``, from their median
    absolute deviation (robust to the odd slow step of a shared
    machine): ``1.2533 * 1.4826 * MAD / sqrt(n)``, as for normal data."""
    if len(times) < 2:
        return 0.0
    mid = statistics.median(times)
    mad = statistics.median(abs(t - mid) for t in times)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(times))


def round_error(shaped, unshaped, rounds):
    """The standard error of ``exposed`` from its spread over the rounds.

    Each round times every (rate, hook) block once, so the difference of
    the two blocks' medians in one round is one paired estimate of the
    exposed time; the standard error of their median (as in
    :func:`median_error`) includes what the step-to-step spread misses: a
    shared machine drifting between the blocks (measured on the FCN toy at
    300 Mbit/s: one cell read 10 ms in two runs, -8 ms in a third, while
    its steps' spread claimed +-3.5 ms). 0.0 with fewer than 3 rounds.
    """
    if rounds < 3 or not shaped or len(shaped) != len(unshaped) \
            or len(shaped) % rounds:
        return 0.0
    block = len(shaped) // rounds
    diffs = [
        statistics.median(shaped[i:i + block]) -
        statistics.median(unshaped[i:i + block])
        for i in range(0, len(shaped), block)
    ]
    return median_error(diffs)


def noise_verdict(value, limit, noise, fmt=lambda s: f'{1e3 * s:.1f} ms'):
    """``'PASS'`` where ``value`` is below ``limit`` by more than twice
    its ``noise`` (a standard error, :func:`median_error`), ``'FAIL'``
    where above it by more, else ``'within noise (+-N)'``: a verdict only
    where the spread separates the value from the limit.

    Args:
        value (float): What was measured.
        limit (float): The most a pass allows.
        noise (float, optional): The standard error of ``value``; None
            where there is no spread to take it from (one sample): no
            verdict then.
        fmt (Callable): Writes ``noise`` in words. Defaults to
            milliseconds of seconds.
    """
    if noise is None:
        return 'within noise (one round: no spread to judge by)'
    if value + 2 * noise <= limit:
        return 'PASS'
    if value - 2 * noise > limit:
        return 'FAIL'
    return f'within noise (+-{fmt(noise)})'


def _codec(results, name):
    """A hook's codec time per step: the median over the ranks (each
    measured alone; the max would pick the one a busy host slowed most);
    None for a hook whose record names no codec (``allreduce``, the
    PowerSGDs: see :mod:`.step_time`)."""
    times = [r['codec_s'].get(name) for r in results]
    return None if None in times else statistics.median(times)


def _form_cost(costs, name, nodes, ranks_per_node):
    """The cost catalogue's entry for hook form ``name`` as it runs on
    ``nodes`` nodes of ``ranks_per_node`` ranks (its two-level form where
    it runs that one), or None where the catalogue has none."""
    from .hook_forms import resolved_form, split_form
    flat = costs.get(split_form(name)[0])
    if flat is None or resolved_form(name, ranks_per_node) == 'flat':
        return flat
    return flat.two_level(ranks_per_node, nodes)


def _layout(buckets):
    """The buckets as the cost model's :class:`~.cost.Bucket` layout."""
    from mmcv_custom.analysis import cost
    return [
        cost.Bucket(
            tuple(
                cost.ParamSpec(tuple(p['shape']), p['dtype'])
                for p in b['params']), tuple(p['index'] for p in b['params']))
        for b in buckets
    ]


def _catalogue():
    from mmcv_custom.analysis import cost
    return cost.hook_costs(
        powersgd_rank=hook_configs()['powerSGD']['matrix_approximation_rank'])


def predicted_link_bytes(buckets, hooks, nodes, ranks_per_node):
    """Per hook form, the bytes the cost model predicts on each node's
    link per step (each way): the catalogue's collectives of the form as
    it runs, for these buckets, each as
    :func:`~mmcv_custom.analysis.cost.collectives.traffic` puts it on the
    node links (a ring crosses each node once; an all-to-all carries the
    off-node shares of all of a node's ranks; a two-level hook's
    ``'intra'`` collectives stay off the link, its ``'cross'`` ones carry
    those of each local rank). None where the catalogue has no entry
    (``noop``)."""
    from mmcv_custom.analysis.cost.collectives import Cluster, traffic

    # The link rate does not change the bytes.
    cluster = Cluster(nodes, ranks_per_node, link_bps=1.0)
    layout = _layout(buckets)
    costs = _catalogue()
    out = {}
    for name in hooks:
        cost = _form_cost(costs, name, nodes, ranks_per_node)
        out[name] = None if cost is None else sum(
            traffic(c, cluster).node_bytes
            for bucket in cost.collectives(layout, cluster.world_size)
            for c in bucket)
    return out


def link_per_step(results, label, name):
    """``(tx, rx, payload)``: the bytes each node's link sent and received
    per step at rate ``label`` with hook form ``name``, and of those sent
    what TCP carried (headers left out), one value per node in node
    order, from the counters its first rank read around each block of
    steps (all None without counters)."""
    firsts = sorted((r for r in results if r.get('local_rank', 0) == 0),
                    key=lambda r: r.get('node', r['rank']))
    if not firsts or 'link_bytes' not in firsts[0]:
        return None, None, None
    per_node = []
    for r in firsts:
        steps = len(r['steps'][label][name]) or 1
        # Each block: [tx, rx, payload], summed over the blocks.
        per_node.append([
            sum(column) / steps
            for column in zip(*r['link_bytes'][label][name])
        ])
    tx, rx, payload = (list(values) for values in zip(*per_node))
    return tx, rx, payload


def summarize(results, rates, hooks, world_size, rounds=1, ranks_per_node=1):
    """Merge the ranks' results into the report's rows (rank 0's times;
    the slowest rank's bytes; each node's link bytes, measured and
    predicted). ``noise_s`` is the larger of the two standard errors:
    from the steps' spread and from the rounds'."""
    rank0 = results[0]
    predicted = {}
    if 'link_bytes' in rank0:
        predicted = predicted_link_bytes(rank0['buckets'], hooks,
                                         world_size // ranks_per_node,
                                         ranks_per_node)
    ring = 2 * (world_size - 1) / world_size
    buckets = rank0['buckets']
    total = sum(b['bytes'] for b in buckets)
    rows = []
    median = {
        label: {
            n: statistics.median(t)
            for n, t in rank0['steps'][label].items()
        }
        for label in rank0['steps']
    }
    error = {
        label: {
            n: median_error(t)
            for n, t in rank0['steps'][label].items()
        }
        for label in rank0['steps']
    }
    unshaped = median.get(rate_label(None), {})
    for mbit in rates:
        label = rate_label(mbit)
        for name in hooks:
            wire_bytes = max(r['wire_bytes'].get(name, 0) for r in results)
            # None: not counted (a hook without a record), so its wire time
            # and bounds are unknown; its link bytes are measured all the same.
            sent = ring * wire_bytes if wire_bytes or name == 'noop' else None
            row = dict(
                rate=label,
                mbit=mbit,
                hook=name,
                step_s=median[label][name],
                compute_s=median[label]['noop'],
                codec_s=_codec(results, name),
                sent_bytes=sent)
            tx, rx, payload = link_per_step(results, label, name)
            if tx is not None:
                row.update(
                    link_tx_bytes=tx,
                    link_rx_bytes=rx,
                    link_payload_bytes=payload,
                    predicted_link_bytes=predicted.get(name))
            if mbit is not None and name in unshaped:
                rate = mbit * 1e6 / 8
                row['exposed_s'] = row['step_s'] - unshaped[name]
                # The standard error of that difference of two medians.
                row['noise_s'] = max(
                    math.hypot(error[label][name],
                               error[rate_label(None)][name]),
                    round_error(rank0['steps'][label][name],
                                rank0['steps'][rate_label(None)][name],
                                rounds))
            if mbit is not None and name in unshaped and sent is not None:
                row['wire_s'] = row['sent_bytes'] / rate
                fraction = (row['sent_bytes'] / total) if total else 0.0
                row['bound_s'] = overlap_bound(buckets, rank0['backward_s'],
                                               fraction, rate)
                row['codec_bound_s'] = overlap_bound(buckets,
                                                     rank0['backward_s'],
                                                     fraction, rate,
                                                     row['codec_s'] or 0.0)
            if 'allreduce' in median[label]:
                row['vs_allreduce'] = (
                    row['step_s'] / median[label]['allreduce'])
            rows.append(row)
    return rows


def _fmt(value, fmt='{:.3f}', missing='-'):
    return missing if value is None else fmt.format(value)


def _pct(part, whole):
    if part is None or not whole:
        return None
    return 100.0 * part / whole


def _mb(nbytes):
    return None if nbytes is None else nbytes / 1e6


def _codec_ms(seconds):
    """The codec column: milliseconds per step, or a dash for a hook
    that has no codec (nothing to time, so nothing shown as 0)."""
    return '—' if seconds is None else f'{seconds * 1e3:.1f}'


def _link_mb(row, key='link_tx_bytes'):
    """Each node's link, sent per step, in MB: ``5.58/5.58``."""
    sent = row.get(key)
    if sent is None:
        return '-'
    return '/'.join(f'{b / 1e6:.2f}' for b in sent)


def report(summary, meta):
    per_node = meta.get('ranks_per_node', 1)
    lines = [
        f"{meta['nodes']} emulated nodes x {per_node} "
        f"rank{'' if per_node == 1 else 's'} (gloo), "
        f"{meta['config']}, {meta['buckets']} buckets "
        f"(bucket_cap_mb={meta['bucket_cap_mb']}), "
        f"{meta['grad_bytes'] / 2**20:.2f} MiB of gradients; backward "
        f"{meta['backward_s'] * 1e3:.1f} ms; median of "
        f"{meta['rounds']} x {meta['steps']} steps per cell." +
        (" Communication only: the model's parameters' buckets without "
         'its compute, all ready at once.' if meta.get('comm_only') else ''),
        'Rate: tc tbf on every node link, both directions; no propagation '
        'delay is emulated. link: what each node\'s link sent per step '
        '(node0/node1/...), from its counters, headers and TCP '
        'acknowledgements included; payload: the same less '
        f'{HEADER_BYTES} bytes of headers a packet (what TCP carried); '
        'predicted: by the cost model. codec: the compress and decompress '
        "of the hook's record, timed alone on each rank on a copy of the "
        "step's buckets (int8 runs it on its communication thread, beside "
        "the backward); — where the record names none.", '',
        '| rate | hook | step (s) | x allreduce | exposed (s) | wire (s) '
        '| exposed / wire | bound / wire | bound+codec / wire | codec (ms) '
        '| link (MB/step) | payload (MB/step) | predicted (MB) |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|---|'
    ]
    for row in summary:
        wire = row.get('wire_s')
        share = [
            _fmt(_pct(row.get(key), wire), '{:.0f}%')
            for key in ('exposed_s', 'bound_s', 'codec_bound_s')
        ]
        lines.append(
            f"| {row['rate']} | {row['hook']} | {_fmt(row['step_s'])} | "
            f"{_fmt(row.get('vs_allreduce'), '{:.2f}')} | "
            f"{_fmt(row.get('exposed_s'))} | {_fmt(wire)} | "
            f"{' | '.join(share)} | {_codec_ms(row['codec_s'])} | "
            f"{_link_mb(row)} | {_link_mb(row, 'link_payload_bytes')} | "
            f"{_fmt(_mb(row.get('predicted_link_bytes')), '{:.2f}')} |")
    return '\n'.join(lines)


def verdict(summary, slack=0.15, comm_bound=1.1):
    """Issue 18's targets, per shaped row: exposed at most the overlap
    bound (with the codec in each bucket's chain) plus ``slack`` of the
    wire time, and at most ``comm_bound`` times the wire time (bytes
    become time, nothing added).

    A row within twice its noise of a target, on either side (the
    standard error of ``exposed``, see :func:`median_error` and
    :func:`round_error`), is marked ``within noise`` (:func:`noise_verdict`):
    the measurement cannot tell. Small wire times (a PowerSGD's few kB)
    are often that.
    """

    out = []
    for row in summary:
        if row.get('wire_s') in (None, 0) or row['hook'] == 'noop':
            continue
        exposed, wire = row['exposed_s'], row['wire_s']
        bound = max(row['bound_s'], row.get('codec_bound_s', 0.0))
        noise = row.get('noise_s', 0.0)
        out.append(
            f"{row['rate']}, {row['hook']}: exposed "
            f"{1e3 * exposed:.1f} ms = {100 * exposed / wire:.0f}% of wire "
            f"({1e3 * wire:.1f} ms); bound+codec {100 * bound / wire:.0f}% + "
            f"{100 * slack:.0f} points: "
            f"{noise_verdict(exposed, bound + slack * wire, noise)}; <= "
            f"{comm_bound}x wire: "
            f"{noise_verdict(exposed, comm_bound * wire, noise)}")
    return out


def plot(summary, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    shaped = sorted({r['mbit'] for r in summary if r['mbit'] is not None})
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    from .hook_forms import form_label
    labels = hook_labels()
    for name in dict.fromkeys(r['hook'] for r in summary):
        rows = {r['mbit']: r for r in summary if r['hook'] == name}
        xs = [m for m in shaped if m in rows]
        line, = ax.plot(
            xs, [rows[m]['step_s'] for m in xs],
            marker='o',
            label=form_label(name, labels))
        if (None in rows and name != 'noop'
                and all('bound_s' in rows[m] for m in xs)):
            base = rows[None]['step_s']
            ax.plot(
                xs, [
                    base + max(rows[m]['bound_s'], rows[m]['codec_bound_s'])
                    for m in xs
                ],
                linestyle=':',
                color=line.get_color())
    ax.set_xscale('log')
    ax.set_xlabel('link rate per node and direction (Mbit/s)')
    ax.set_ylabel('median training step (s)')
    ax.set_title(
        'Step time on emulated nodes (dotted: unshaped step + '
        'overlap bound, codec in each chain)',
        fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which='both', alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _collectives(buckets, hooks, world_size, counted, ranks_per_node=1):
    """Each hook form's collectives per bucket, as the cost model's
    catalogue derives them from the buckets' real parameters (the step's
    layout as DDP handed it over) for the form the hook ran (flat, or
    two-level where it ran that one: each collective then names its
    level), checked against the bytes the hooks counted. A two-level
    form counts what crosses nodes, its ``'cross'`` collectives among
    one rank of each node. ``counted``: hook -> the bytes each rank
    counted.

    Returns:
        tuple[dict, dict, list[str]]: Hook form -> collectives (JSON
        form), hook form -> the form it ran (``'flat'`` or
        ``'two-level'``), and the hook forms whose counted bytes the
        catalogue does not match.
    """
    from mmcv_custom.comm.traffic import sent_bytes
    layout = _layout(buckets)
    costs = _catalogue()
    nodes = world_size // ranks_per_node
    out, forms, mismatched = {}, {}, []
    for name in hooks:
        cost = _form_cost(costs, name, nodes, ranks_per_node)
        if cost is None:
            continue
        forms[name] = cost.form
        every = [
            c for bucket in cost.collectives(layout, world_size)
            for c in bucket
        ]
        out[name] = [
            dict(
                bucket=c.bucket,
                kind=c.kind,
                bytes=c.nbytes,
                **({} if c.level is None else dict(level=c.level)))
            for c in every
        ]
        # CommCounter and the catalogue count by the same rule. A
        # two-level form's ranks share their node's link, each sending a
        # part that may differ (whole tensors to owners): the catalogue
        # states the mean part, a flat form's the most any rank sends.
        crossing = [(c.kind, c.nbytes) for c in every if c.level != 'intra']
        if cost.form == 'flat':
            sent, mine = sent_bytes(crossing, world_size), max(counted[name])
        else:
            sent = sent_bytes(crossing, nodes)
            mine = statistics.mean(counted[name])
        if abs(sent - mine) > 0.01 * max(mine, 1):
            mismatched.append(f'{name}: counted {mine:.0f} bytes, the '
                              f'catalogue {sent:.0f}')
    return out, forms, mismatched


def bench_json(results, summary, meta, hooks, rates, world_size):
    """What ``comm_cost_model.py --fit`` reads (format version 1).
    ``world_size`` is every rank: ``meta['nodes']`` times
    ``meta['ranks_per_node']`` (1 when absent)."""
    rank0 = results[0]
    per_node = meta.get('ranks_per_node', 1)
    each = {n: [r['wire_bytes'].get(n, 0) for r in results] for n in hooks}
    counted = {n: max(each[n]) for n in hooks}
    collectives, forms, mismatched = _collectives(rank0['buckets'], hooks,
                                                  world_size, each, per_node)
    return dict(
        version=1,
        config=meta['config'],
        comm_only=bool(meta.get('comm_only')),
        nodes=world_size // per_node,
        ranks_per_node=per_node,
        world_size=world_size,
        backend='gloo',
        bucket_cap_mb=meta['bucket_cap_mb'],
        grad_bytes=meta['grad_bytes'],
        buckets=rank0['buckets'],
        backward_s=rank0['backward_s'],
        compute_step_s=statistics.median(
            rank0['steps'][rate_label(None)]['noop'])
        if rate_label(None) in rank0['steps'] else None,
        hooks={
            name:
            dict(
                wire_bytes=counted[name],
                # The fit adds it to each bucket's chain: nothing for a
                # hook without a codec.
                codec_s=_codec(results, name) or 0.0,
                form=forms.get(name),
                collectives=collectives.get(name))
            for name in hooks
        },
        collectives_mismatched=mismatched,
        rates=[
            dict(
                mbit=mbit,
                calibrated_mbit=meta['calibrated'].get(rate_label(mbit)),
                median_step_s={
                    row['hook']: row['step_s']
                    for row in summary if row['mbit'] == mbit
                }) for mbit in rates
        ],
        rows=summary,
        steps=rank0['steps'])


def auto_rows(results, hooks, rates, settings):
    """``comm_hook auto`` beside the fixed hooks, per rate: its median step
    (rank 0's, as theirs), what it chose in each round, and the fastest
    fixed hook of a class ``settings['max_loss']`` allows (among its
    ``candidates``, where named), measured in the same blocks: the target
    is ``auto`` within 10% of it."""
    from mmcv_custom.comm.accuracy import accuracy_of, class_rank
    from mmcv_custom.comm.builder import hook_record
    from .hook_forms import form_config
    rank0 = results[0]
    limit = class_rank(settings['max_loss'])
    allowed = []
    only = settings.get('candidates')
    for name in hooks:
        config = form_config(name)
        if config is None or (only and config['type'] not in only):
            continue
        klass = accuracy_of(hook_record(config['type']), config).klass
        if class_rank(klass) <= limit:
            allowed.append(name)
    rows = []
    for mbit in rates:
        label = rate_label(mbit)
        median = {
            n: statistics.median(rank0['steps'][label][n])
            for n in allowed
        }
        best = min(median, key=median.get) if median else None
        step = statistics.median(rank0['auto']['steps'][label])
        rows.append(
            dict(
                rate=label,
                auto_step_s=step,
                chosen=rank0['auto']['choices'][label],
                fastest_allowed=best,
                fastest_allowed_step_s=median.get(best),
                ratio=step / median[best] if best else None))
    return rows


def auto_report(rows, settings) -> list:
    """The lines of :func:`auto_rows`' table."""
    out = [
        '', f"comm_hook auto (max_loss={settings['max_loss']!r}, "
        f"min_gain={settings['min_gain']:g}), deciding afresh at each rate "
        'in each round, against the fastest fixed hook it allows:',
        '| rate | auto step | chose | fastest allowed fixed hook | its step '
        '| auto / it |', '|---|---|---|---|---|---|'
    ]
    for row in rows:
        chosen = ', '.join(f'{key} x{n}'
                           for key, n in sorted(((k, row['chosen'].count(k))
                                                 for k in set(row['chosen'])),
                                                key=lambda kn: -kn[1]))
        out.append(f"| {row['rate']} | {row['auto_step_s']:.3f} | {chosen} "
                   f"| {row['fastest_allowed'] or '-'} | "
                   f"{_fmt(row['fastest_allowed_step_s'])} | "
                   f"{_fmt(row['ratio'], '{:.2f}')} |")
    return out


def report_run(results, meta, hooks, rates, json_path=None, plot_path=None):
    """The whole report of a run: the table and the verdict (returned as
    lines), the JSON and the plot (written where asked).

    Args:
        results (list[dict]): Every rank's measurements.
        meta (dict): ``nodes``, ``ranks_per_node``, ``config``,
            ``rounds``, ``steps`` and ``calibrated`` (rate -> bus
            bandwidth); rank 0's bucket facts are added here.
    """
    import json
    rank0 = results[0]
    meta = dict(
        meta,
        bucket_cap_mb=rank0['bucket_cap_mb'],
        buckets=len(rank0['buckets']),
        grad_bytes=rank0['grad_bytes'],
        backward_s=rank0['backward_s'])
    world_size = meta['nodes'] * meta['ranks_per_node']
    summary = summarize(results, rates, hooks, world_size, meta['rounds'],
                        meta['ranks_per_node'])
    lines = [report(summary, meta), ''] + verdict(summary)
    data = bench_json(results, summary, meta, hooks, rates, world_size)
    lines += [
        "warning: the cost model's collectives do not match the bytes "
        f'counted: {line}' for line in data['collectives_mismatched']
    ]
    if 'auto' in rank0:
        rows = auto_rows(results, hooks, rates, meta['auto'])
        lines += auto_report(rows, meta['auto'])
        data['auto'] = dict(settings=meta['auto'], rows=rows)
    if json_path:
        with open(json_path, 'w') as f:
            json.dump(data, f, indent=1)
    if plot_path:
        plot(summary, plot_path)
    return lines
