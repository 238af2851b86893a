"""Which run a checkpoint belongs to, carried from save to resume.

A work dir holds one run, but files travel: another run's checkpoint
copied in with its digest passes every integrity check, and ``--resume``
would continue it (another hook, another seed, another config) with only
indirect clues in the log. So every checkpoint says which run saved it:
:class:`RunIdentityHook` writes ``meta['run']`` (an id drawn when the run
starts at iteration 0, its seed, its config's file name and its start
time), and a resumed run carries the identity of the checkpoint it
continues, so all the saves of one run, across restarts, carry one id.
:func:`~mmcv_custom.integrity.checkpoint_choice.foreign_checkpoint`
compares the checkpoint ``--resume`` would take with the others in the
folder before the run starts.
"""
import os.path as osp
import time
import uuid
from typing import Optional

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from ..integrity.checkpoint_choice import RUN_KEY

__all__ = ['RunIdentityHook']


@HOOKS.register_module()
class RunIdentityHook(Hook):
    """Write the run's identity into each checkpoint's ``meta``.

    ``tools/train.py`` adds it to every run; with MMSegmentation's own
    tool, add ``dict(type='RunIdentityHook')`` to ``custom_hooks``.
    Only rank 0 writes checkpoints, so no rank has to agree with another.
    """

    priority = 'LOW'

    def __init__(self) -> None:
        self._identity: Optional[dict] = None

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        # Called for load_from too; only a resume continues a run.
        if not getattr(runner, '_resume', False):
            return
        saved = (checkpoint.get('meta') or {}).get(RUN_KEY)
        if isinstance(saved, dict) and isinstance(saved.get('id'), str):
            self._identity = dict(saved)

    def before_train(self, runner) -> None:
        if self._identity is not None:
            return
        filename = getattr(runner.cfg, 'filename', None)
        self._identity = dict(
            id=uuid.uuid4().hex,
            seed=runner.seed,
            config=osp.basename(filename) if filename else None,
            started=time.strftime('%Y-%m-%d %H:%M:%S'))

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self._identity is not None:
            checkpoint.setdefault('meta', {})[RUN_KEY] = dict(self._identity)
