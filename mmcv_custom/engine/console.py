"""Old path of :mod:`mmcv_custom.launching.console`; kept for users.

The tools' console is part of starting a run, so it now lives in
:mod:`mmcv_custom.launching.console`; this module only re-exports the names
it used to define.
"""
from ..launching.console import (FILE_ONLY, RUN_NOISE, ConsoleFilter,
                                 ToolConsole, current_console, header_text,
                                 progress_text, report_failure, summary_text)

__all__ = [
    'FILE_ONLY', 'RUN_NOISE', 'ConsoleFilter', 'ToolConsole',
    'current_console', 'report_failure', 'header_text', 'progress_text',
    'summary_text'
]
