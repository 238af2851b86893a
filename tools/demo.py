"""Run the quick-start demo: train, evaluate, and print a short summary.

Trains a config (by default the toy segmenter with ``bf16_compress``) on
``--nproc`` ranks through ``tools/dist_train.sh`` (gloo on CPU, NCCL on
GPUs), evaluates the final checkpoint with ``tools/dist_test.sh``, then
reads the runs' own logs back to say which hook was registered, the final
loss, the metrics of the last validation during training and of the test
of the final checkpoint (each labelled), and the wall time. ``make demo``
calls this.

The work dir is ``--work-dir``, else ``work_dirs/demo`` for the default
config and ``work_dirs/<config name>`` for any other (as tools/train.py
names it), so that two demos never share checkpoints. A demo always
trains anew: run again, it starts over in its work dir, and the earlier
demo's checkpoints are moved into ``superseded_iter_N/`` there
(``tools/train.py --overwrite``), not overwritten.

Both runs rendezvous on ``PORT`` when it is set (``PORT=29600 make
demo``, as ``tools/dist_train.sh`` takes it), else each on a free port.
The arguments and ``PORT`` are checked before anything starts: a bad one
is a usage error (one line, exit code 2).
"""
import argparse
import glob
import json
import os
import os.path as osp
import subprocess
import sys
import time
from typing import Optional

from mmcv_custom.analysis import read_config
from mmcv_custom.launching.ports import free_port, rendezvous_port

HERE = osp.dirname(osp.abspath(__file__))
ROOT = osp.dirname(HERE)
DEFAULT_CONFIG = osp.join(ROOT, 'configs', 'fcn',
                          'fcn_r18-w16-d8_2xb8-600iter_toy-shapes-64x64.py')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default=DEFAULT_CONFIG)
    parser.add_argument('--nproc', type=int, default=2, help='ranks per run')
    parser.add_argument(
        '--work-dir',
        help='default: work_dirs/demo for the default config, else '
        'work_dirs/<config name>')
    parser.add_argument(
        '--no-eval',
        action='store_true',
        help='skip the test of the final checkpoint (tools/dist_test.sh); '
        'the summary still shows the last validation during training')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=[],
        help='passed on to tools/train.py and tools/test.py')
    args = parser.parse_args(argv)
    # Before anything starts: a typo fails in a second, in one line.
    if args.nproc < 1:
        parser.error(f'--nproc should be at least 1, but got {args.nproc}')
    read_config(parser, '--config', args.config)
    args.port = rendezvous_port(parser)
    if args.work_dir is None:
        args.work_dir = default_work_dir(args.config)
    return args


def default_work_dir(config: str) -> str:
    """``work_dirs/demo`` for the default config (what ``make demo`` and
    docs/en/get_started.md show), ``work_dirs/<config name>`` for any other."""
    if osp.abspath(config) == DEFAULT_CONFIG:
        return osp.join('work_dirs', 'demo')
    return osp.join('work_dirs', osp.splitext(osp.basename(config))[0])


def _runs(work_dir: str):
    """Run folders (``YYYYmmdd_HHMMSS``) under ``work_dir``, oldest first."""
    return sorted(
        d for d in glob.glob(osp.join(work_dir, '2*_*')) if osp.isdir(d))


def _run(cmd, what: str, port: Optional[str]) -> None:
    env = dict(os.environ, PORT=port or free_port(), PYTHON=sys.executable)
    # Which port, should it clash with another job's.
    print(f'demo: {what} on PORT={env["PORT"]}', file=sys.stderr, flush=True)
    code = subprocess.call(cmd, env=env, cwd=os.getcwd())
    if code != 0:
        sys.exit(f'{what} failed with exit code {code}; logs and '
                 'checkpoints are kept under the work dir')


def _last_checkpoint(work_dir: str) -> str:
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        return f.read().strip()


def _shown(metrics: dict) -> dict:
    """The metrics to four significant digits (mIoU percentages and small
    MSEs alike), without MMEngine's bookkeeping keys."""
    return {
        k: float(f'{v:.4g}')
        for k, v in metrics.items() if k not in ('step', 'time', 'data_time')
    }


def summarize(train_dir: str,
              eval_dir: Optional[str],
              wall: float,
              checkpoint: Optional[str] = None) -> str:
    """The summary block, read from the runs' logs and scalars.

    Two evaluations may show, each labelled: ``validation``, the last one
    during training (its iteration in brackets), and ``test``, of the final
    checkpoint by ``tools/dist_test.sh`` (``eval_dir``, None with
    ``--no-eval``). They need not agree to the digit: the validation runs
    on the training ranks' own models, the test on the checkpoint loaded
    afresh.
    """
    run = _runs(train_dir)[-1]
    log = open(glob.glob(osp.join(run, '*.log'))[0]).read()
    registered = [
        ln.split(' - INFO - ', 1)[-1] for ln in log.splitlines()
        if 'DDP communication hook' in ln or 'not registered' in ln
    ]
    scalars = [
        json.loads(ln)
        for ln in open(osp.join(run, 'vis_data', 'scalars.json'))
    ]
    losses = [s for s in scalars if 'loss' in s]
    validations = [s for s in scalars if 'loss' not in s]
    tested = {}
    evals = _runs(eval_dir) if eval_dir else []
    if evals:
        found = glob.glob(osp.join(evals[-1], '*.json'))
        if found:
            # Every rank of a distributed test run writes this file (MMEngine
            # 0.10's LoggerHook does not restrict it to rank 0), so a
            # shorter write can leave the tail of a longer one behind: read
            # the first JSON object and ignore the rest.
            with open(found[0]) as f:
                tested = json.JSONDecoder().raw_decode(f.read())[0]
    rows = [('comm hook', registered[0] if registered else 'none registered')]
    if losses:
        rows.append(('loss', f"{losses[0]['loss']:.4f} (iter "
                     f"{losses[0]['step']}) -> {losses[-1]['loss']:.4f} "
                     f"(iter {losses[-1]['step']})"))
    if validations and _shown(validations[-1]):
        last = validations[-1]
        rows.append((f"validation (iter {last.get('step', '?')})",
                     f'{_shown(last)} (during training)'))
    if tested:
        of = f' of {osp.basename(checkpoint)}' if checkpoint else ''
        rows.append(('test', f'{_shown(tested)} (tools/dist_test.sh{of})'))
    what = 'training and test' if eval_dir else 'training'
    rows.append(('wall time', f'{wall:.1f} s ({what})'))
    rows.append(('work dir', osp.abspath(train_dir)))
    width = max(len(label) for label, _ in rows)
    lines = ['', '=' * 72, 'Demo summary']
    lines += [f'  {label:<{width}} : {value}' for label, value in rows]
    lines.append('=' * 72)
    return '\n'.join(lines)


def main():
    args = parse_args()
    options = ['--cfg-options', *args.cfg_options] if args.cfg_options else []
    start = time.time()
    _run([
        'bash',
        osp.join(HERE, 'dist_train.sh'), args.config,
        str(args.nproc), '--work-dir', args.work_dir, '--overwrite', *options
    ], 'training', args.port)
    eval_dir = checkpoint = None
    if not args.no_eval:
        eval_dir = osp.join(args.work_dir, 'eval')
        checkpoint = _last_checkpoint(args.work_dir)
        _run([
            'bash',
            osp.join(HERE, 'dist_test.sh'), args.config, checkpoint,
            str(args.nproc), '--work-dir', eval_dir, *options
        ], 'evaluation', args.port)
    print(summarize(args.work_dir, eval_dir, time.time() - start, checkpoint))


if __name__ == '__main__':
    main()
