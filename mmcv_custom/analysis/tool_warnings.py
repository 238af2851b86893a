"""Third-party warnings the analysis tools keep off the console.

Each is matched by its message, category and the module that issues it, so
that any other warning, and these same ones in training, still show. Every
entry says why a user of the tools cannot act on it.
"""
import warnings

__all__ = ['filter_tool_warnings']

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


def filter_tool_warnings() -> None:
    """Keep :data:`TOOL_NOISE` off the console, in this process.

    Called first thing by each analysis tool's ``main``, and by each rank it
    starts (a spawned process begins with Python's default filters).
    """
    for message, category, module, _ in TOOL_NOISE:
        warnings.filterwarnings(
            'ignore', message=message, category=category, module=module)
