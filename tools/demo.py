"""Run the quick-start demo and print a short summary.

Trains ``configs/demo/...`` on ``--nproc`` CPU (or GPU) ranks through
``tools/dist_train.sh``, then reads the run's own log and scalars back to say
what was registered, the final loss and the wall time. ``make demo`` calls
this.
"""
import argparse
import glob
import json
import os
import os.path as osp
import subprocess
import sys
import time

HERE = osp.dirname(osp.abspath(__file__))
ROOT = osp.dirname(HERE)
DEFAULT_CONFIG = osp.join(ROOT, 'configs', 'demo',
                          'mlp_2xb32-300iter_synthetic.py')


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default=DEFAULT_CONFIG)
    parser.add_argument('--nproc', type=int, default=2)
    parser.add_argument('--work-dir', default=osp.join('work_dirs', 'demo'))
    parser.add_argument(
        '--cfg-options', nargs='+', default=[],
        help='passed on to tools/train.py')
    return parser.parse_args()


def _free_port() -> str:
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return str(s.getsockname()[1])


def _latest_run(work_dir: str) -> str:
    runs = sorted(glob.glob(osp.join(work_dir, '2*_*')))
    if not runs:
        raise FileNotFoundError(f'no run folder under {work_dir}')
    return runs[-1]


def summarize(work_dir: str, wall: float) -> str:
    run = _latest_run(work_dir)
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
    metrics = [s for s in scalars if 'loss' not in s and 'step' in s]
    lines = ['', '=' * 72, 'Demo summary']
    lines.append('  comm hook : ' +
                 (registered[0] if registered else 'none registered'))
    if losses:
        lines.append(f"  loss      : {losses[0]['loss']:.4f} (iter "
                     f"{losses[0]['step']}) -> {losses[-1]['loss']:.4f} "
                     f"(iter {losses[-1]['step']})")
    for m in metrics[-1:]:
        shown = {k: v for k, v in m.items() if k not in ('step', 'time',
                                                          'data_time')}
        lines.append(f'  eval      : {shown}')
    lines.append(f'  wall time : {wall:.1f} s')
    lines.append(f'  work dir  : {osp.abspath(work_dir)}')
    lines.append('=' * 72)
    return '\n'.join(lines)


def main():
    args = parse_args()
    env = dict(os.environ, PORT=os.environ.get('PORT', _free_port()),
               PYTHON=sys.executable)
    cmd = ['bash', osp.join(HERE, 'dist_train.sh'), args.config,
           str(args.nproc), '--work-dir', args.work_dir]
    if args.cfg_options:
        cmd += ['--cfg-options', *args.cfg_options]
    start = time.time()
    code = subprocess.call(cmd, env=env)
    wall = time.time() - start
    if code != 0:
        sys.exit(f'training failed with exit code {code}; see the log '
                 f'under {args.work_dir}')
    print(summarize(args.work_dir, wall))


if __name__ == '__main__':
    main()
