"""Third-party warnings that a user of the tools cannot act on.

Each is matched by its message, category and the module that issues it, so
that any other warning, and these same ones where they matter, still show.
Every entry says why a user of the tools cannot act on it. The analysis
tools filter them out (:func:`mmcv_custom.analysis.filter_tool_warnings`),
and the console of ``tools/train.py`` and ``tools/test.py`` keeps those
that fit a run off the console
(:data:`mmcv_custom.launching.console.RUN_NOISE`). The list lives here,
below both, so that the console need not import the analysis package.

:data:`CONFIG_NOISE` is silenced where it arises, around MMEngine's
reading of a config (:func:`quiet`, in
:func:`mmcv_custom.launching.running.load_config`), for every tool alike:
the same message from anywhere else still shows.
"""
import contextlib
import warnings
from typing import Iterator, Sequence

__all__ = ['TOOL_NOISE', 'CONFIG_NOISE', 'ignore', 'quiet']

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

#: Warnings MMEngine's ``Config.fromfile`` raises through no fault of the
#: config, silenced around it only (:func:`quiet`).
CONFIG_NOISE = (
    (r'pkg_resources is deprecated as an API', UserWarning,
     r'(mmengine\.utils\.package_utils|importlib)$',
     "MMEngine finds a config's mmseg:: bases with pkg_resources, which it "
     'imports and reloads at each one (setuptools warns at every load, '
     'reported from MMEngine or from importlib\'s reload); no config avoids '
     'it'), )


def ignore(noise: Sequence[tuple]) -> None:
    """Ignore each warning of ``noise`` (entries as :data:`TOOL_NOISE`'s)
    from here on: its message, category and issuing module must all
    match."""
    for message, category, module, _ in noise:
        warnings.filterwarnings(
            'ignore', message=message, category=category, module=module)


@contextlib.contextmanager
def quiet(noise: Sequence[tuple]) -> Iterator[None]:
    """Inside, :func:`ignore` ``noise``; after, the filters as they were
    (so that the same message from other code still shows)."""
    with warnings.catch_warnings():
        ignore(noise)
        yield
