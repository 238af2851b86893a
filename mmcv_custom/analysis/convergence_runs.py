"""The runs of ``tools/analysis_tools/compare_comm_convergence.py``: each
variant trained through ``tools/dist_train.sh`` in a folder of its own, its
iterations reported from its log while it trains (:class:`TrainLog`), or
found under ``--from-work-dirs``; and each run read back.
"""
import os
import os.path as osp
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from mmcv_custom.launching.ports import free_port
from .convergence import (find_runs, hook_options, mismatch, read_comm_hook,
                          read_scalars, variants)
from .progress import Progress, format_eta

__all__ = [
    'train_options', 'select_variants', 'check_run_options', 'TrainLog',
    'train', 'collect', 'from_work_dirs'
]


def train_options(args, variant: str) -> List[str]:
    """The ``--cfg-options`` of ``variant``'s run: its hook, the log
    interval, the seed, ``--max-iters``' and the user's own (last, so
    they win)."""
    options = hook_options(variants()[variant], args.block_size)
    options.append(f'default_hooks.logger.interval={args.log_interval}')
    if args.seed is not None:
        options.append(f'randomness.seed={args.seed}')
    return options + args.max_iters_options + args.cfg_options


def select_variants(parser, args) -> List[str]:
    """``--variants`` made whole, or ``parser.error``: ``all`` (alone) as
    every variant. On one node (``--ranks-per-node`` = ``--nproc``) a
    periodic variant (``post_local_sgd``, ``diloco``) has no nodes to
    synchronise across: naming one to train is refused, and ``all``
    leaves them out (so it trains, or reads back, what it did before they
    were registered). Returns the lines the tool prints about it (one, or
    none)."""
    known = variants()
    everything = 'all' in args.variants
    if everything:
        if args.variants != ['all']:
            parser.error('--variants all stands alone: it trains every '
                         'variant')
        args.variants = list(known)
    periodic = [v for v in args.variants if known[v].periodic]
    if args.ranks_per_node != args.nproc or not periodic:
        return []
    fix = ('--ranks-per-node 1'
           if args.nproc > 1 else '--nproc 2 --ranks-per-node 1')
    if not everything:
        if args.from_work_dirs is not None:
            return []  # read back, not trained here
        parser.error(f'--variants {" ".join(periodic)} '
                     f'synchronise{"s" if len(periodic) == 1 else ""} across '
                     'nodes, but the --nproc ranks are one node: give '
                     f'--ranks-per-node below --nproc (e.g. {fix})')
    args.variants = [v for v in args.variants if v not in periodic]
    return [
        f'--variants all on one node leaves out {", ".join(periodic)}: they '
        f'synchronise across nodes (train them with {fix})'
    ]


def check_run_options(parser, args) -> None:
    """``--cfg-options`` as every run takes them, or ``parser.error``:
    one that is not ``KEY=VALUE``, one that sets what the variants set
    (``comm_hook``; its other keys, int8's ``residual_dtype`` under hybrid
    sharding, go to every run), or the length ``--max-iters`` gives."""
    known = variants()
    chosen = [known[v] for v in args.variants if v in known]
    taken = {o.split('=')[0] for v in chosen for o in hook_options(v, 1)}
    for option in args.cfg_options:
        key = option.split('=')[0]
        if key in ('comm_hook', 'comm_hook.type') or key in taken:
            parser.error(f'--cfg-options {option}: comm_hook is set by the '
                         'tool per variant (use --variants, --block-size)')
        if '=' not in option:
            parser.error(f'--cfg-options expects KEY=VALUE, but got '
                         f'{option!r}')
        if (args.max_iters is not None
                and option.startswith('train_cfg.max_iters=')):
            parser.error(f'--cfg-options {option}: give the length once, '
                         'as --max-iters or in --cfg-options')


#: MMEngine's training log line: ``Iter(train) [ 50/600]  ... loss: 0.51``.
_TRAIN_LINE = re.compile(r'Iter\(train\)\s*\[\s*(\d+)/(\d+)\]')
_LOSS = re.compile(r'\bloss: (\S+)')


class TrainLog:
    """The training iterations a run has logged, read from its log file
    as it grows (MMEngine's logger line, on rank 0's output).

    Args:
        path (str): The run's log file (``dist_train.log``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b''

    def poll(self) -> Optional[Tuple[int, int, Optional[float]]]:
        """The newest training line since the last call, as
        ``(iteration, max_iters, loss or None)``; None if none came."""
        try:
            with open(self.path, 'rb') as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return None
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b'\n')
        newest = None
        for raw in lines:
            line = raw.decode('utf-8', 'replace')
            match = _TRAIN_LINE.search(line)
            if match is None:
                continue
            loss = _LOSS.search(line, match.end())
            try:
                value = float(loss.group(1)) if loss else None
            except ValueError:
                value = None
            newest = (int(match.group(1)), int(match.group(2)), value)
        return newest


#: Seconds between two looks at a training run's log.
_POLL_S = 2.0


def _wait(proc: subprocess.Popen, log: str, variant: str) -> int:
    """Wait for ``proc``, reporting its iterations from ``log`` (done of
    total, loss, ETA) on stderr; its exit code."""
    watch, progress = TrainLog(log), None
    start = time.monotonic()
    try:
        while True:
            try:
                code = proc.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                code = None
            seen = watch.poll()
            if seen is not None:
                done, total, loss = seen
                if progress is None:
                    # From the first logged iteration on: start-up (data,
                    # model, process group) is not training speed.
                    progress = Progress(
                        max(total, 1),
                        label=variant,
                        step_time=False,
                        done=done,
                        since=start)
                progress.update(done,
                                '' if loss is None else f'loss {loss:.4g}')
            if code is not None:
                return code
    except BaseException:
        # Ctrl-C or any error here: the run does not outlive the tool.
        proc.terminate()
        proc.wait()
        raise
    finally:
        if progress is not None:
            progress.close()


def train(args, variant: str, number: str, dist_train: str) -> Optional[str]:
    """Train ``variant`` (run ``number``, e.g. ``'2/3'``) with the
    ``dist_train.sh`` at ``dist_train``; its new run
    folder, or None if it failed (its log,
    ``<work-dir>/<variant>/dist_train.log``, says why)."""
    work_dir = args.run_dirs[variant]
    try:
        os.makedirs(work_dir, exist_ok=True)
    except OSError as e:
        print(
            f'[{variant}] FAILED: cannot create {work_dir} '
            f'({e.strerror})',
            file=sys.stderr,
            flush=True)
        return None
    before = set(find_runs(work_dir))
    per_node = getattr(args, 'ranks_per_node', None) or args.nproc
    nodes = args.nproc // per_node
    cmd = [
        'bash', dist_train, args.config,
        str(per_node), '--work-dir', work_dir, '--cfg-options',
        *train_options(args, variant)
    ]
    port = args.port or free_port()
    log = osp.join(work_dir, 'dist_train.log')
    envs = [dict(os.environ, PORT=port)]
    if nodes > 1:
        # Nodes of one machine, as torchrun starts them on a cluster: each
        # rank's launcher says which node it is on, and topology='auto'
        # follows that word. They share this machine's cores: torchrun
        # leaves a node of one rank all of them (OMP_NUM_THREADS unset), so
        # the nodes' threads would oversubscribe the cores (and spin: runs
        # of 1 rank a node took 10-20x as long). A user's own setting wins.
        threads = os.environ.get('OMP_NUM_THREADS') or str(
            max(1, (os.cpu_count() or 1) // args.nproc))
        envs = [
            dict(
                os.environ,
                OMP_NUM_THREADS=threads,
                PORT=port,
                NNODES=str(nodes),
                NODE_RANK=str(node),
                MASTER_ADDR='127.0.0.1') for node in range(nodes)
        ]
    shown = (f'NNODES={nodes} ' if nodes > 1 else '') + f'PORT={port}'
    print(
        f'[{variant}] run {number} starts: {shown} {" ".join(cmd[1:])}',
        file=sys.stderr,
        flush=True)
    start = time.time()
    others, code = [], None
    with open(log, 'w') as f:
        try:
            for node, env in enumerate(envs[1:], 1):
                with open(
                        osp.join(work_dir, f'dist_train.node{node}.log'),
                        'w') as other_log:
                    others.append(
                        subprocess.Popen(
                            cmd,
                            stdout=other_log,
                            stderr=subprocess.STDOUT,
                            env=env))
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=envs[0])
            code = _wait(proc, log, variant)
        finally:
            # The other nodes end with the first (failed or interrupted:
            # stopped; done: they finish too).
            for other in others:
                if code != 0:
                    other.terminate()
                other_code = other.wait()
                if code is not None:
                    code = code or other_code
    new = [r for r in find_runs(work_dir) if r not in before]
    if code != 0 or not new:
        print(
            f'[{variant}] FAILED (exit code {code}) after '
            f'{time.time() - start:.0f} s; log: {log}',
            file=sys.stderr,
            flush=True)
        return None
    print(
        f'[{variant}] run {number} done in {time.time() - start:.0f} s: '
        f'{new[-1]}',
        file=sys.stderr,
        flush=True)
    return new[-1]


def collect(args, dist_train: str) -> tuple:
    """Train every variant of ``args.variants`` in turn (with the
    ``dist_train.sh`` at ``dist_train``), or with ``--from-work-dirs`` find
    its latest run, and read each run back.

    Returns:
        tuple: ``(runs, folders, hooks, failed)``: variant -> its scalars
        (None for a failed run), its run folder and its ``comm_hook``; the
        variants whose training failed.
    """
    known = variants()
    runs, folders, hooks, failed = {}, {}, {}, []
    started = time.time()
    for i, variant in enumerate(args.variants):
        if args.from_work_dirs is not None:
            folder = find_runs(args.run_dirs[variant])[-1]
        else:
            folder = train(args, variant, f'{i + 1}/{len(args.variants)}',
                           dist_train)
            left = len(args.variants) - i - 1
            if left:
                # The runs are alike: the ones left take as long.
                eta = (time.time() - started) / (i + 1) * left
                print(
                    f'{left} run(s) left, ETA {format_eta(eta)}',
                    file=sys.stderr,
                    flush=True)
        if folder is None:
            failed.append(variant)
            runs[variant] = None
            continue
        folders[variant] = folder
        hooks[variant] = read_comm_hook(folder)
        wrong = mismatch(known[variant], hooks[variant])
        if wrong:
            print(f'warning: {folder}: {wrong}', file=sys.stderr)
        runs[variant] = read_scalars(
            osp.join(folder, 'vis_data', 'scalars.json'))
    return runs, folders, hooks, failed


def from_work_dirs(parser, args) -> Dict[str, str]:
    """``--from-work-dirs``: ``{variant: work dir}``, every one holding a
    run with a ``scalars.json`` (a usage error through ``parser``
    otherwise)."""
    known = variants()
    if args.from_work_dirs:
        dirs = {}
        for item in args.from_work_dirs:
            variant, sep, folder = item.partition('=')
            if not sep or not folder:
                parser.error(f'--from-work-dirs expects VARIANT=DIR, but got '
                             f'{item!r}')
            if variant not in known:
                parser.error(f'--from-work-dirs: unknown variant '
                             f'{variant!r}; valid variants: '
                             f"{', '.join(known)}")
            if variant in dirs:
                parser.error(f'--from-work-dirs names {variant!r} twice')
            dirs[variant] = folder
    else:
        dirs = {v: osp.join(args.work_dir, v) for v in args.variants}
    for variant, folder in dirs.items():
        if not find_runs(folder):
            parser.error(f'--from-work-dirs: no run with '
                         f'vis_data/scalars.json under {folder} (for '
                         f'{variant!r})')
    return dirs
