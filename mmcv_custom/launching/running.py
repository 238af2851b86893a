"""Read a config, build its runner and run it, as the tools do.

:func:`run_runner` is what ``tools/train.py`` and ``tools/test.py`` share
after the checks and the start-up: the runner built from the config, the
console's header and summary around the run, a finished run resumed at its
end stopped with one line (after its final validation, when it stopped
during that: :mod:`mmcv_custom.engine.validation_record`), the metrics'
result parts kept in the work dir, and the runner and the process group
freed in an order that cannot hang (:func:`shutdown_distributed`), also
when the run fails.
"""
import contextlib
import logging
import os
import time
import traceback
from typing import Any, Optional

import torch.distributed as dist
from mmengine.config import Config
from mmengine.hooks import Hook

from ..engine.load_report import load_from_min_match, report_load_from
from ..engine.process_group import is_launch_rank0
from ..engine.validation_record import (ValidationRecordHook, last_step,
                                        run_lost_validation, trained_by_epoch,
                                        trained_steps)
from .cfg_options import read_literal
from .console import current_console, header_text, progress_text, summary_text
from .warning_noise import CONFIG_NOISE, quiet

__all__ = [
    'load_config', 'read_dicts', 'build_runner', 'run_runner',
    'NothingToTrain', 'shutdown_distributed'
]


def _dict_literal(text: str) -> Optional[dict]:
    """``text`` as the dict it writes (``dict(type='X')`` or
    ``{'type': 'X'}``, literal values only: :func:`~.cfg_options.
    read_literal`), else None."""
    try:
        value = read_literal(text)
    except (SyntaxError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_dicts(value: Any) -> Any:
    """A ``--cfg-options`` value with each string that writes a dict read
    as that dict, in lists and tuples too.

    MMEngine's ``DictAction`` reads numbers, booleans, lists and tuples but
    keeps a ``dict(...)`` of one key as a string, which the config's user
    then refuses (``visualizer.vis_backends=[dict(type='TensorboardVis
    Backend')]``: a ``TypeError`` from the visualizer). The tools'
    parser (:mod:`.cfg_options`) reads dicts itself; this still reads
    options a caller parsed with ``DictAction``.
    """
    if isinstance(value, (list, tuple)):
        return type(value)(read_dicts(v) for v in value)
    if isinstance(value, str):
        parsed = _dict_literal(value)
        return value if parsed is None else parsed
    return value


def load_config(path: str,
                cfg_options: Optional[dict] = None,
                work_dir: Optional[str] = None) -> Config:
    """Read a config as MMSegmentation's tools do.

    ``--cfg-options`` are merged in (a ``dict(...)`` among them read as a
    dict: :func:`read_dicts`), and the work dir is the command line's,
    else the config's, else ``./work_dirs/<config name>``. MMEngine's
    reading warns of its own use of pkg_resources (:data:`CONFIG_NOISE`):
    silenced here, where it arises.
    """
    with quiet(CONFIG_NOISE):
        cfg = Config.fromfile(path)
    if cfg_options is not None:
        cfg.merge_from_dict({
            key: read_dicts(value)
            for key, value in cfg_options.items()
        })
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = os.path.join(
            './work_dirs',
            os.path.splitext(os.path.basename(path))[0])
    return cfg


def build_runner(cfg: Config):
    """The runner ``cfg`` asks for, as MMSegmentation's tools build it:
    MMEngine's ``Runner``, or ``runner_type`` (e.g. ``'FlexibleRunner'``)
    from the ``RUNNERS`` registry."""
    if 'runner_type' not in cfg:
        from mmengine.runner import Runner
        return Runner.from_cfg(cfg)
    from mmengine.registry import RUNNERS
    return RUNNERS.build(cfg)


class NothingToTrain(Exception):
    """Raised by :class:`_NothingLeftHook`: the resumed run is finished."""


class _NothingLeftHook(Hook):
    """First in ``before_train``: a run resumed at its end stops there,
    with one line, instead of replaying the data loader up to the end and
    saving nothing (see :func:`run_runner`)."""

    priority = 'HIGHEST'

    def before_train(self, runner) -> None:
        key = 'max_epochs' if trained_by_epoch(runner) else 'max_iters'
        if trained_steps(runner) >= last_step(runner.train_loop):
            # Its final validation first, when the run stopped during it.
            ran = run_lost_validation(runner)
            raise NothingToTrain(
                f'Nothing left to train ({progress_text(runner)}): the run '
                f'is finished. To train it further, raise train_cfg.{key} '
                f'(--cfg-options train_cfg.{key}=...) and --resume again.' +
                (' (Its final validation, lost when it stopped, ran now.)'
                 if ran else ''))


def run_runner(cfg: Config, method: str, notes=()) -> None:
    """Build the runner ``cfg`` asks for, call its ``method`` (``'train'``,
    ``'test'``), then free it and destroy the process group, even when the
    run fails: the DDP model (and the comm hook and state its reducer
    holds) must go while the group still exists.

    On rank 0 the console (see :mod:`mmcv_custom.launching.console`) opens
    with a header (config, work dir, log file, ranks) and closes with a
    summary (metrics, checkpoints, what the comm hook saved, wall time).
    ``notes`` are what was decided before the runner existed (e.g. which
    checkpoint ``--resume`` fell back to): lines logged as warnings, or
    ``(logging level, line)``; logged once on rank 0, into the run's log
    file and on the console. A ``load_from`` that is not a resume is first
    compared with the model (:mod:`mmcv_custom.engine.load_report`).
    Training resumed at its end says there is nothing left to train and
    returns.
    """
    console = current_console()
    start = console.start_time if console else time.time()
    prog = console.prog if console else None
    min_match = load_from_min_match(cfg)
    with console.building() if console else contextlib.nullcontext():
        runner = build_runner(cfg)
    try:
        main_process = is_launch_rank0()
        header = header_text(runner, method, prog) if main_process else None
        if console:
            console.open(header, runner.logger)
        elif header:
            runner.logger.info(header)
        if main_process:
            for note in notes:
                level, text = ((logging.WARNING,
                                note) if isinstance(note, str) else note)
                runner.logger.log(level, text)
        load_from = cfg.get('load_from')
        if load_from and not cfg.get('resume') and '://' not in str(
                load_from) and os.path.isfile(load_from):
            report_load_from(runner, load_from, min_match)
        if method == 'train':
            runner.register_hook(_NothingLeftHook())
        if not any(isinstance(h, ValidationRecordHook) for h in runner.hooks):
            runner.register_hook(
                ValidationRecordHook(remove_leftovers=method == 'train'))
        try:
            result = getattr(runner, method)()
        except NothingToTrain as e:
            if main_process:
                runner.logger.info(str(e))
            return
        if main_process:
            runner.logger.info(
                summary_text(runner, method, result,
                             time.time() - start))
    except BaseException as exc:
        if console:
            console.note_failure()
        _after_failure(runner)
        # The traceback's frames (the loops', the hooks') hold the runner:
        # drop their locals, or the model would outlive the group.
        _clear_frames(exc)
        raise
    finally:
        del runner
        shutdown_distributed()


def _after_failure(runner) -> None:
    """Let the hooks that have an ``after_failure(runner)`` method (this
    project's; MMEngine has no such stage) undo what the failure left
    half done, e.g. the hook state files of a checkpoint whose save
    failed. Their own errors are logged, not raised over the failure."""
    for hook in getattr(runner, 'hooks', ()):
        undo = getattr(hook, 'after_failure', None)
        if not callable(undo):
            continue
        try:
            undo(runner)
        except Exception as e:  # the run's failure is what to report
            runner.logger.warning(f'{type(hook).__name__}.after_failure '
                                  f'failed too: {e!r}')


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in ``exc``'s traceback and
    in those of the exceptions it was raised from or during (their code
    and line numbers, all a report shows, stay)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def shutdown_distributed() -> None:
    """Destroy the process group before the interpreter exits; call it
    once every DDP model is dropped.

    Left to interpreter shutdown, a DDP reducer holding a communication
    hook, its state and the group is destroyed after Python has begun to
    finalise; gloo's worker threads are then torn down while still joinable
    and a rank dies with "terminate called without an active exception"
    after an otherwise finished run.

    The order matters too. A reducer that holds the last reference to a
    gloo group destroys it with the GIL held (the reducer's Python binding
    keeps the GIL in its destructor; the group's own releases it), and the
    group's destructor joins its worker threads. A worker thread that is
    still freeing a finished collective (a barrier's work holds the
    all-gather before it, whose tensors are Python objects) needs the GIL
    for that: both wait forever, a rare hang after the last barrier
    (py-spy: ``~ProcessGroupGloo`` joining under ``~Reducer``, a gloo
    thread in ``decref`` waiting for the GIL). So the reducers go first,
    while the group is still registered, and the group last, from here.
    The tools drop their runner (or their DDP models) before calling this;
    after a failure :func:`run_runner` first clears the traceback's frames,
    which would otherwise keep the runner alive.
    """
    import gc
    gc.collect()  # what still holds the group (DDP reducers, hook states)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
