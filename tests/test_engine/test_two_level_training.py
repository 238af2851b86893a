"""Two nodes of two ranks each, started as on a cluster (a torchrun per
node through ``tools/dist_train.sh``, ``NNODES``/``NODE_RANK``), train the
toy segmenter with ``int8_compress``: ``topology='auto'`` runs its
two-level form from the launchers' word, and a run resumes from its
checkpoint with every rank's error feedback."""
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

from mmcv_custom.launching.ports import free_port
from tests.test_launching.test_restart import FCN, FCN_FAST
from tests.tool_utils import ROOT

DIST_TRAIN = osp.join(ROOT, 'tools', 'dist_train.sh')
OPTIONS = FCN_FAST + ['comm_hook.type=int8_compress']


def _two_nodes(work_dir, max_iters, *extra):
    """Both nodes' launchers at once; their exit codes and node 0's
    output."""
    port = free_port()
    procs = []
    for node in (0, 1):
        env = dict(
            os.environ,
            PYTHON=sys.executable,
            PORT=port,
            NNODES='2',
            NODE_RANK=str(node),
            MASTER_ADDR='127.0.0.1')
        procs.append(
            subprocess.Popen([
                'bash', DIST_TRAIN, FCN, '2', '--work-dir',
                str(work_dir), *extra, '--cfg-options', *OPTIONS,
                f'train_cfg.max_iters={max_iters}'
            ],
                             cwd=ROOT,
                             env=env,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,
                             text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], outs[0] + outs[1]


def _weights(path):
    return torch.load(
        path, map_location='cpu', weights_only=False)['state_dict']


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_two_level_and_resume(tmp_path):
    """Two runs of four ranks each (the suite's time: that bit for bit a
    resumed two-level run is the uninterrupted one, DDP's new bucket
    layout included, is test_two_level.py's, on the hook's own ranks):
    the first saves at iteration 2, the second resumes from it with every
    rank's error feedback."""
    two_level = ('topology: two-level, 2 nodes x 2 ranks (ranks (0, 1) on '
                 'node 0, (2, 3) on node 1)')
    codes, log = _two_nodes(tmp_path, 2)
    assert codes == [0, 0], log[-4000:]
    assert two_level in log
    codes, log = _two_nodes(tmp_path, 4, '--resume')
    assert codes == [0, 0], log[-4000:]
    assert two_level in log and 'resumed epoch: 0, iter: 2' in log
    assert ('Restored the int8_compress state (error feedback) of all 4 '
            'ranks from the files beside') in log
    weights = _weights(tmp_path / 'iter_4.pth')
    assert all(
        torch.isfinite(w).all() for w in weights.values()
        if w.is_floating_point())
