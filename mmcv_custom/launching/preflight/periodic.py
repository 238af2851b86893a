"""``post_local_sgd`` and ``diloco`` on the nodes the launcher started:
refused before the ranks start where the layout cannot hold them.

The runner hook refuses the same on every rank once the ranks agree on
their layout (:func:`mmcv_custom.comm.local_sgd.prepare_periodic`), after
the model is built; here it is said first, with the same words, from the
layout the launcher's environment states
(:func:`~mmcv_custom.engine.process_group.launcher_layout`).
"""
from typing import List, Optional

from ...comm.local_sgd import periodic_layout_error
from ...engine.process_group import LAUNCH_ENV, launcher_layout
from .problems import Problem

__all__ = ['periodic_problems']


def periodic_problems(checked, launcher: Optional[str]) -> List[Problem]:
    """The layout problems of a checked periodic ``comm_hook`` (none for
    other hooks, or where the launcher states no layout)."""
    if (checked is None or checked.record is None
            or not checked.record.periodic or launcher not in LAUNCH_ENV):
        return []
    world, layout, _ = launcher_layout(launcher)
    if world is None:
        return []
    error = periodic_layout_error(checked, world, layout)
    return [Problem(error)] if error else []
