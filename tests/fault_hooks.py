"""A runner hook that kills its own rank once, for the restart tests.

Imported by a test config through ``custom_imports`` (``tools/`` put the
repository on ``PYTHONPATH``), so the kill happens inside a real training
process, as a crashed node's would: SIGKILL, no cleanup, no exception.
"""
import io
import os
import os.path as osp
import re
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

    def after_train_iter(self,
                         runner,
                         batch_idx,
                         data_batch=None,
                         outputs=None):
        if (runner.iter + 1 == self.at_iter and get_rank() == self.rank
                and not osp.exists(self.marker)):
            with open(self.marker, 'w') as f:
                f.write(f'killed rank {self.rank} after {self.at_iter}\n')
            os.kill(os.getpid(), signal.SIGKILL)


@HOOKS.register_module()
class KillAtRandomHook(Hook):
    """SIGKILL one rank at a random moment in each attempt of a run that
    dist_train.sh restarts, one kill per entry of ``moments``.

    Attempt ``n`` (:func:`mmcv_custom.engine.process_group.restart_count`) dies
    as ``moments[n]`` says, at a rank, an iteration (one to three past where
    the attempt resumed) and a delay drawn from
    ``random.Random(seed * 1000 + n)``:

    * ``timer``: a timer fires up to ``max_delay`` seconds into that
      iteration: in the forward or backward pass, the hooks'
      communication, the optimizer step or the checkpoint save;
    * ``save``: halfway through writing that iteration's checkpoint (rank
      0: ``iter_N.pth`` itself; other ranks: their hook state file), half
      of the bytes on disk under the temporary name;
    * ``rename``: after the rank's first file of that save is renamed into
      place, before its digest is written.

    Every kill is appended to ``record`` (attempt, rank, iteration, moment)
    before the signal, so the test knows what happened.
    """

    priority = 'VERY_HIGH'

    def __init__(self,
                 moments,
                 seed: int,
                 record: str,
                 max_delay: float = 0.6):
        self.moments, self.seed, self.record = tuple(moments), seed, record
        self.max_delay = max_delay
        self.plan = None

    def before_train(self, runner):
        import random

        from mmcv_custom.engine.process_group import restart_count
        attempt = restart_count()
        if attempt >= len(self.moments):
            return
        rng = random.Random(self.seed * 1000 + attempt)
        rank = rng.randrange(2)
        at_iter = min(runner.iter + rng.randint(1, 3), runner.max_iters)
        delay = rng.uniform(0, self.max_delay)
        if get_rank() == rank:
            self.plan = (attempt, rank, at_iter, self.moments[attempt], delay)

    def _die(self, what: str):
        attempt, rank, at_iter, how, _ = self.plan
        line = (f'attempt {attempt}: rank {rank} killed in iteration '
                f'{at_iter} ({how}{what})\n')
        fd = os.open(self.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, line.encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if self.plan is None or runner.iter + 1 != self.plan[2]:
            return
        how, delay = self.plan[3], self.plan[4]
        if how == 'timer':
            import threading
            timer = threading.Timer(delay, self._die,
                                    (f', {delay:.2f} s into it', ))
            timer.daemon = True
            timer.start()
            return
        # The module whose functions the writes call, to patch them there.
        from mmcv_custom.integrity import files as integrity
        if how == 'save':
            write = integrity._write_then_rename
            wanted = (r'iter_\d+\.pth' if get_rank() == 0 else
                      r'iter_\d+\.pth\.comm_hook_rank\d+\.pth')

            def half_written(path, fill):
                if not re.fullmatch(wanted, osp.basename(path)):
                    return write(path, fill)
                data = io.BytesIO()
                fill(data)
                with open(integrity.temporary_name(path), 'wb') as f:
                    f.write(data.getvalue()[:data.tell() // 2])
                self._die(f': {osp.basename(path)} half written')

            integrity._write_then_rename = half_written
        else:

            def renamed(path, hexdigest=None):
                self._die(f': {osp.basename(path)} without its digest')

            integrity.write_digest = renamed


@HOOKS.register_module()
class FillDiskHook(Hook):
    """Fill the disk of ``folder`` on rank 0 just before the checkpoint of
    iteration ``at_iter`` is saved (a real ``ENOSPC``: the test mounts a
    small tmpfs there), so that the save fails as on a full disk."""

    priority = 'HIGHEST'  # before the hook state files and the save

    def __init__(self, at_iter: int, folder: str):
        self.at_iter, self.folder = at_iter, folder

    def after_train_iter(self,
                         runner,
                         batch_idx,
                         data_batch=None,
                         outputs=None):
        if runner.iter + 1 != self.at_iter or get_rank() != 0:
            return
        import shutil

        # Leave room for the hook state files (written first), not for
        # the checkpoint: the save of iter_N.pth itself fails.
        keep = int(os.environ.get('FILL_DISK_KEEP', '0'))
        with open(osp.join(self.folder, 'filler'), 'wb') as f:
            while shutil.disk_usage(self.folder).free > keep:
                want = shutil.disk_usage(self.folder).free - keep
                try:
                    f.write(b'\0' * min(want, 1 << 20))
                    f.flush()
                except OSError:
                    break


@HOOKS.register_module()
class KillInValidationHook(Hook):
    """SIGKILL rank ``rank`` after its first validation batch, in the first
    run only: the file ``marker`` records that it happened."""

    def __init__(self, rank: int, marker: str):
        self.rank, self.marker = rank, marker

    def after_val_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if get_rank() == self.rank and not osp.exists(self.marker):
            with open(self.marker, 'w') as f:
                f.write(f'killed rank {self.rank} in a validation\n')
            os.kill(os.getpid(), signal.SIGKILL)
