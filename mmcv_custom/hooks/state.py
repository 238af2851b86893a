"""What a stateful communication hook offers the checkpoint machinery.

A hook whose state lives across steps (PowerSGD's error feedback and warm
start, int8's residuals) has that state laid out by DDP's buckets, which
differ between a fresh run and a resumed one. A :class:`HookStateKeeper`
keeps it per parameter name instead, so it can be saved beside a
checkpoint by every rank and restored into whatever buckets the next run
builds (:mod:`mmcv_custom.engine.hook_state_files` saves and restores
through it; the builder calls :meth:`~HookStateKeeper.wrap`, the preflight
:meth:`~HookStateKeeper.file_bytes`). A plugin's keeper, member by member
with when each is called: ``docs/en/advanced_guides/own_hooks.md``.
Imports only the standard library.
"""
import abc
from typing import Callable

__all__ = ['HookStateKeeper']


class HookStateKeeper(abc.ABC):
    """Saves and restores one hook state, per parameter, across bucket
    layouts and checkpoints.

    A hook's record names its keeper class
    (:attr:`~mmcv_custom.comm.records.HookRecord.state_keeper`); the
    builder makes one per DDP model as ``keeper_cls(state, names)``, with
    ``names`` mapping each parameter to its name.
    """

    #: What a restore brings back, for the log (e.g. ``'error feedback'``).
    RESTORED: str = ''
    #: What :meth:`start_fresh` means for the run, for the warning (e.g.
    #: ``'error feedback from zero'``); :meth:`fresh_note` says it.
    FRESH_NOTE: str = ''
    #: The state key that turns error feedback off when False (None: it
    #: is always kept), for :meth:`file_bytes`.
    FEEDBACK_KEY = None

    @classmethod
    def file_bytes(cls, params, state_kwargs: dict) -> int:
        """About how many bytes one rank's state file takes for
        ``params``: one copy of the trainable gradients (error feedback,
        in their dtype), or none when ``state_kwargs`` turns feedback off.
        The preflight counts it, times the ranks, in the room a checkpoint
        needs; what else a keeper saves (PowerSGD's warm start) is small
        beside it."""
        if cls.FEEDBACK_KEY and state_kwargs.get(cls.FEEDBACK_KEY,
                                                 True) is False:
            return 0
        return sum(p.numel() * p.element_size() for p in params
                   if p.requires_grad)

    def wrap(self, hook: Callable) -> Callable:
        """The hook to register: ``hook`` itself, as here, where the state
        is kept per parameter; a keeper whose hook keeps its state by
        bucket (PyTorch's PowerSGD) returns ``hook`` with the state laid
        out for each bucket before it runs."""
        return hook

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """This rank's state, keyed by parameter name, on the CPU."""

    @abc.abstractmethod
    def check_state_dict(self, saved) -> None:
        """Raise ``ValueError`` saying why ``saved`` cannot be restored.

        Changes nothing, so that every rank can check first and all restore
        only when all can.
        """

    @abc.abstractmethod
    def load_state_dict(self, saved: dict) -> None:
        """Restore :meth:`state_dict`'s output before the first step."""

    def fresh_note(self, steps_done: int) -> str:
        """What :meth:`start_fresh` means for the run, for the log:
        :attr:`FRESH_NOTE`, unless it depends on ``steps_done`` (PowerSGD's
        warm-up)."""
        return self.FRESH_NOTE

    @abc.abstractmethod
    def start_fresh(self, steps_done: int) -> None:
        """Forget the saved state (it could not be used), keeping the
        count of ``steps_done`` gradient-synchronising steps."""
