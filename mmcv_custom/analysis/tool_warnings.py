"""Third-party warnings the analysis tools keep off the console.

Each is matched by its message, category and the module that issues it, so
that any other warning, and these same ones in training, still show. Every
entry says why a user of the tools cannot act on it. The list is
:data:`mmcv_custom.launching.warning_noise.TOOL_NOISE`, which the console of
the training and test tools reads too.
"""
from ..launching.warning_noise import TOOL_NOISE, ignore

__all__ = ['filter_tool_warnings']


def filter_tool_warnings() -> None:
    """Keep :data:`TOOL_NOISE` off the console, in this process.

    Called first thing by each analysis tool's ``main``, and by each rank it
    starts (a spawned process begins with Python's default filters).
    """
    ignore(TOOL_NOISE)
