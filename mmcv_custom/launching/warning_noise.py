"""Third-party warnings that a user of the tools cannot act on.

Each is matched by its message, category and the module that issues it, so
that any other warning, and these same ones where they matter, still show.
Every entry says why a user of the tools cannot act on it. The analysis
tools filter them out (:func:`mmcv_custom.analysis.filter_tool_warnings`),
and the console of ``tools/train.py`` and ``tools/test.py`` keeps those
that fit a run off the console
(:data:`mmcv_custom.launching.console.RUN_NOISE`). The list lives here,
below both, so that the console need not import the analysis package.
"""

__all__ = ['TOOL_NOISE']

#: (message regex, category, issuing module regex, why it is noise here).
TOOL_NOISE = (
    (r'``build_loss`` would be deprecated soon', UserWarning,
     r'mmseg\.models\.builder',
     "MMSegmentation's own decode heads call its deprecated builder; no "
     'config avoids it'),
    (r'Default ``avg_non_ignore`` is False', UserWarning,
     r'mmseg\.models\.losses\.cross_entropy_loss',
     "advice on how training averages its loss, which none of the tools' "
     'numbers depend on (tools/train.py writes it to its log file)'),
    (r'Multi-processing start method `\w+` is different from the previous '
     r'setting', UserWarning, r'mmengine\.utils\.dl_utils\.setup_env',
     "a tool that starts its own ranks sets up each one's environment "
     "itself: the config's env_cfg, which the warning points to, is not "
     'read'),
    (r'Setting (OMP|MKL)_NUM_THREADS environment variable for each '
     r'process', UserWarning, r'mmengine\.utils\.dl_utils\.setup_env',
     'the tools set the threads of each rank themselves '
     '(torch.set_num_threads)'),
)
