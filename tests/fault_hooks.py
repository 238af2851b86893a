"""A runner hook that kills its own rank once, for the restart tests.

Imported by a test config through ``custom_imports`` (``tools/`` put the
repository on ``PYTHONPATH``), so the kill happens inside a real training
process, as a crashed node's would: SIGKILL, no cleanup, no exception.
"""
import os
import os.path as osp
import signal

from mmengine.dist import get_rank
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class KillOnceHook(Hook):
    """SIGKILL rank ``rank`` after iteration ``at_iter`` of the first run
    only: the file ``marker`` records that it happened."""

    priority = 'VERY_LOW'  # after the CheckpointHook of that iteration

    def __init__(self, at_iter: int, rank: int, marker: str):
        self.at_iter, self.rank, self.marker = at_iter, rank, marker

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        if (runner.iter + 1 == self.at_iter and get_rank() == self.rank
                and not osp.exists(self.marker)):
            with open(self.marker, 'w') as f:
                f.write(f'killed rank {self.rank} after {self.at_iter}\n')
            os.kill(os.getpid(), signal.SIGKILL)
