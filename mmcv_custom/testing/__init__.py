"""Helpers to test communication hooks, the project's own and plugins'
alike (as :mod:`mmengine.testing` is for MMEngine's runners).

:func:`run_ranks` runs a test body on real gloo ranks, forked, meeting
through a ``FileStore``: real collectives on CPU, no ports to clash. The
harness itself uses only torch, so it serves a plain DDP model with any
``register_comm_hook`` hook as well as an MMEngine runner.
"""
from .ranks import run_ranks

__all__ = ['run_ranks']
