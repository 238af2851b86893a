"""A run reads its ``comm_hook`` once: :func:`comm_hook_config`.

The config is a dict on its way in and a checked, read-only
:class:`~.builder.CommHookConfig` from here on. Each rank makes it once,
where it knows how its model reduces (the runner hook's ``before_run``:
DDP, or FSDP2 under full or hybrid sharding), and hands it on: to
:func:`~.builder.build_comm_hook` on each DDP module, to
:func:`~.sharded.build_sharded_comm` under FSDP2, to ``auto``'s trials
(its candidates come checked with it) and to the hook state files. None
of them checks it again. The preflight, before the ranks start, makes it
the same way (its one check), so the two cannot disagree on what is
wrong. The walk-through: ``docs/en/design/layout.md``, "The path of
``comm_hook``".
"""
import dataclasses
from typing import Any, Optional

from .auto import auto_candidates
from .builder import CommHookConfig
from .sharded import check_sharded_cfg

__all__ = ['SHARDINGS', 'comm_hook_config']

#: Where a config runs: None (DDP), or FSDP2's ``'full'`` or ``'hybrid'``
#: sharding (:mod:`.sharded`).
SHARDINGS = (None, 'full', 'hybrid')


def comm_hook_config(cfg: Any,
                     sharding: Optional[str] = None) -> CommHookConfig:
    """``cfg`` checked for where it runs, every problem named at once.

    Args:
        cfg (dict or CommHookConfig): The ``comm_hook`` config; one
            checked for DDP (a ``CommHookRegistrationHook`` argument, say)
            gets only the checks ``sharding`` adds.
        sharding (str, optional): None for DDP; ``'full'`` or
            ``'hybrid'`` for FSDP2 (:func:`~.sharded.check_sharded_cfg`).

    Returns:
        CommHookConfig: ``auto``'s with its candidates, each checked.

    Raises:
        ValueError: ``sharding`` is not one of :data:`SHARDINGS`; the
            errors of :func:`~.builder.check_comm_hook_cfg` and, under
            FSDP2, :func:`~.sharded.check_sharded_cfg`.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding should be None, 'full' or 'hybrid', but "
                         f'got {sharding!r}')
    if sharding is not None:
        return check_sharded_cfg(cfg, hybrid=sharding == 'hybrid')
    if isinstance(cfg, CommHookConfig) and cfg.sharding is None:
        checked = cfg
    else:
        checked = CommHookConfig.check(
            dict(cfg.given) if isinstance(cfg, CommHookConfig) else cfg)
    if checked.auto is None or checked.candidates:
        return checked
    # Under DDP every allowed hook runs: each candidate checked once.
    found = auto_candidates(
        checked.auto['max_loss'], names=checked.auto['candidates'])
    return dataclasses.replace(
        checked,
        candidates=tuple(
            (c, CommHookConfig.check(dict(c.config))) for c in found))
