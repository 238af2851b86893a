"""The preflight itself: every check, in the order the run would meet
what it checks, and the config read the way the tools read it.

See :mod:`mmcv_custom.launching.preflight` for what is checked and why.
"""
import os.path as osp
from typing import List, Optional, Sequence

from mmengine.config import Config

from .config_values import (checked_comm_hook, custom_hooks_problems,
                            import_problems)
from .data import data_problems
from .launcher_env import launcher_problems
from .periodic import periodic_problems
from .problems import PreflightError, Problem
from .strategy import strategy_problems
from .weights import (checkpoint_problems, pretrained_problems,
                      resume_layout_problems)
from .work_dir import work_dir_problems

__all__ = ['preflight', 'check_preflight', 'checked_config']

_MODES = ('train', 'test')


def preflight(
    cfg: Config,
    mode: str = 'train',
    resume_checkpoint: Optional[str] = None,
    test_checkpoint: Optional[str] = None,
    launcher: str = 'none',
    first: Sequence[Problem] = ()) -> List[Problem]:
    """Every problem that would stop ``cfg``'s run, without starting it.

    Args:
        cfg (Config): The merged config (``work_dir`` set, as
            :func:`mmcv_custom.launching.running.load_config` sets it).
        mode (str): ``'train'`` (``tools/train.py``: the training data, the
            validation data when validation is configured, ``load_from``,
            pretrained files, room for a checkpoint) or ``'test'``
            (``tools/test.py``: the test data). Defaults to ``'train'``.
        resume_checkpoint (str, optional): The checkpoint the run resumes
            from (``load_from`` itself is then not checked a second time).
        test_checkpoint (str, optional): ``tools/test.py``'s CHECKPOINT.
        launcher (str): The tool's ``--launcher``, whose environment is
            checked. Defaults to ``'none'``.
        first (Sequence[Problem]): Problems the caller found already (where
            the run would start, see
            :mod:`mmcv_custom.launching.run_start`), said first.

    Returns:
        list[Problem]: Empty when nothing was found.

    Raises:
        ValueError: ``mode`` is neither ``'train'`` nor ``'test'``.
    """
    if mode not in _MODES:
        raise ValueError(f"mode should be 'train' or 'test', but got "
                         f'{mode!r}')
    problems = list(first) + launcher_problems(launcher)
    imports = import_problems(cfg)
    problems += imports
    # Hook types are looked up only once their modules are imported.
    problems += custom_hooks_problems(cfg, registered=not imports)
    # The runner builds the strategy before the comm_hook's runner hook.
    problems += strategy_problems(cfg, launcher)
    # Checked once; the checkpoint's size reads the checked config.
    comm_hook, found = checked_comm_hook(cfg, launcher)
    problems += found + periodic_problems(comm_hook, launcher)
    problems += data_problems(cfg, mode)
    if mode == 'train':
        # Runner.train initialises the weights (loading these) even when
        # it then resumes; Runner.test does not.
        problems += pretrained_problems(cfg.get('model'))
        if cfg.get('load_from') and cfg.load_from != resume_checkpoint:
            problems += checkpoint_problems(
                cfg.load_from, 'load_from',
                'correct the path, or leave load_from out')
        if resume_checkpoint:
            problems += checkpoint_problems(
                resume_checkpoint, 'the checkpoint to resume from',
                '') or resume_layout_problems(cfg, resume_checkpoint)
    elif test_checkpoint is not None:
        problems += checkpoint_problems(
            test_checkpoint, 'checkpoint',
            'give a checkpoint file (or sharded checkpoint directory) '
            'that tools/train.py wrote')
    problems += work_dir_problems(cfg, mode, launcher, comm_hook)
    return problems


def check_preflight(cfg: Config, mode: str = 'train', **kwargs) -> None:
    """:func:`preflight`, raising what it finds.

    Raises:
        PreflightError: One or more problems; its message lists them all.
    """
    problems = preflight(cfg, mode, **kwargs)
    if problems:
        raise PreflightError(problems)


# Where a config cannot be read: the file system, the parser, or a value
# --cfg-options or a _base_ merge refuses.
_CONFIG_ERRORS = (OSError, SyntaxError, ValueError, KeyError, TypeError,
                  AttributeError, ImportError)


def checked_config(path: str,
                   cfg_options: Optional[dict] = None,
                   work_dir: Optional[str] = None,
                   option: str = 'config') -> Config:
    """The config at ``path`` as the tools read it
    (:func:`mmcv_custom.launching.running.load_config`), or a
    :class:`PreflightError` naming the file and why: missing, not a config
    file, or one that does not parse or merge.

    Args:
        path (str): The config file.
        cfg_options (dict, optional): ``--cfg-options``, merged in.
        work_dir (str, optional): ``--work-dir``.
        option (str): How the command line names the file, for the
            message, e.g. ``'config'`` or ``'--config'``.

    Returns:
        Config: The merged config.
    """
    from ..running import load_config
    if not osp.isfile(path):
        raise PreflightError([Problem(f'{option} {path}: no such file')])
    try:
        return load_config(path, cfg_options, work_dir)
    except _CONFIG_ERRORS as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PreflightError([
            Problem(f'{option} {path}: cannot read it as a config '
                    f'({type(e).__name__}: {first})')
        ]) from e
