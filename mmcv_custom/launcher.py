"""Start training where MMEngine's own start-up cannot: CPUs.

MMEngine's ``init_dist`` calls ``torch.cuda.set_device``, its DDP wrapper
passes ``device_ids=[LOCAL_RANK]``, and SyncBN needs CUDA; all three fail on
a CPU-only machine. The tools call :func:`prepare_launch` before building
the runner: with CUDA it leaves everything to MMEngine (NCCL, unchanged
behaviour); without, it starts a gloo process group itself (the runner skips
``init_dist`` when a group exists), makes the DDP wrapper CPU-friendly and
turns SyncBN into BN. It also refuses, before the process group starts, a
``model_wrapper_cfg`` that a CPU run cannot use (anything but DDP).
"""
import contextlib
import json
import logging
import os
import tempfile
import time
import traceback
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.logging import print_log

__all__ = [
    'check_cpu_strategy', 'uses_fsdp2', 'build_runner', 'run_runner',
    'init_gloo', 'load_config', 'prepare_launch', 'is_launch_rank0',
    'shutdown_distributed', 'check_cpu_wrapper', 'check_writable',
    'spawn_ranks', 'write_results', 'free_port', 'NothingToTrain', 'LaunchEnv',
    'LAUNCH_ENV'
]

#: MMEngine's DDP wrappers, named in errors. A CPU launch takes any
#: subclass of torch's DistributedDataParallel, as these two are
#: (MMSeparateDistributedDataParallel wraps each trainable submodule in an
#: MMDistributedDataParallel).
_CPU_WRAPPERS = ('MMDistributedDataParallel',
                 'MMSeparateDistributedDataParallel')


class LaunchEnv(NamedTuple):
    """The variables a ``--launcher``'s starter sets in each process."""
    rank: str  # global rank
    world: str  # world size
    local: str  # rank on the node
    others: Tuple[str, ...]  # the rest the process group needs


#: Per ``--launcher``: what torchrun, ``srun`` and Open MPI's ``mpirun``
#: set. A gloo start copies the Slurm and MPI ones into torchrun's names.
LAUNCH_ENV = {
    'pytorch':
    LaunchEnv('RANK', 'WORLD_SIZE', 'LOCAL_RANK',
              ('MASTER_ADDR', 'MASTER_PORT')),
    'slurm':
    LaunchEnv('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID', ()),
    'mpi':
    LaunchEnv('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
              'OMPI_COMM_WORLD_LOCAL_RANK', ()),
}


def load_config(path: str,
                cfg_options: Optional[dict] = None,
                work_dir: Optional[str] = None) -> Config:
    """Read a config as MMSegmentation's tools do.

    ``--cfg-options`` are merged in, and the work dir is the command line's,
    else the config's, else ``./work_dirs/<config name>``.
    """
    cfg = Config.fromfile(path)
    if cfg_options is not None:
        cfg.merge_from_dict(cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = os.path.join(
            './work_dirs',
            os.path.splitext(os.path.basename(path))[0])
    return cfg


def is_launch_rank0() -> bool:
    """Whether this process is global rank 0, before or after the process
    group starts (torchrun sets ``RANK``, Slurm ``SLURM_PROCID``), so the
    tools log configuration facts once per run rather than once per rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get('RANK', os.environ.get('SLURM_PROCID', 0))) == 0


def check_cpu_wrapper(cfg: Config) -> None:
    """Raise if ``cfg.model_wrapper_cfg`` is not a DDP a CPU launch can run.

    Without CUDA the tools start gloo and give the wrapper
    ``device_ids=None`` and ``find_unused_parameters``, arguments of
    DistributedDataParallel. FSDP, DataParallel or another wrapper would
    fail later with an unrelated ``TypeError``, after the process group
    started. The type is resolved as the Runner resolves it, through
    MMEngine's ``MODEL_WRAPPERS`` registry.

    Raises:
        KeyError: the type is not registered.
        ValueError: the type is not MMDistributedDataParallel,
            MMSeparateDistributedDataParallel or a subclass of
            ``torch.nn.parallel.DistributedDataParallel``.
    """
    wrapper_cfg = cfg.get('model_wrapper_cfg')
    if not wrapper_cfg:
        return
    wrapper_type = wrapper_cfg.get('type', 'MMDistributedDataParallel')
    if isinstance(wrapper_type, str):
        from mmengine.registry import MODEL_WRAPPERS
        wrapper_cls = MODEL_WRAPPERS.get(wrapper_type)  # as Runner does
        if wrapper_cls is None:
            raise KeyError(
                f'model_wrapper_cfg type {wrapper_type!r} is not in '
                "MMEngine's MODEL_WRAPPERS registry; on CPU use one of "
                f'{", ".join(_CPU_WRAPPERS)}')
        shown = wrapper_type
    else:
        wrapper_cls = wrapper_type
        shown = (f'{wrapper_cls.__module__}.{wrapper_cls.__qualname__}'
                 if isinstance(wrapper_cls, type) else repr(wrapper_cls))
    name = getattr(wrapper_cls, '__name__', repr(wrapper_cls))
    if isinstance(wrapper_cls, type) and issubclass(
            wrapper_cls, torch.nn.parallel.DistributedDataParallel):
        return
    raise ValueError(
        f'model_wrapper_cfg type {shown!r} is not supported without '
        'CUDA: the tools then train on a gloo process group with a CPU '
        'DistributedDataParallel (device_ids=None), so the wrapper must be '
        f'{" or ".join(_CPU_WRAPPERS)} or a subclass of '
        f'torch.nn.parallel.DistributedDataParallel, but {name} is not. '
        'Remove model_wrapper_cfg, or run it on GPUs.')


# FlexibleRunner strategies that run on a CPU process group.
_CPU_STRATEGIES = ('DDPStrategy', 'FSDP2Strategy')


def _strategy_type(cfg: Config) -> Optional[str]:
    """The FlexibleRunner strategy's type name, or None for MMEngine's
    default Runner (which takes ``model_wrapper_cfg`` instead)."""
    if cfg.get('runner_type') != 'FlexibleRunner':
        return None
    strategy = cfg.get('strategy') or {}
    kind = strategy.get('type', 'DDPStrategy')
    return kind if isinstance(kind, str) else kind.__name__


def uses_fsdp2(cfg: Config) -> bool:
    """Whether ``cfg`` trains with FSDP2Strategy (FlexibleRunner), which
    reads and writes sharded checkpoint directories itself."""
    return _strategy_type(cfg) == 'FSDP2Strategy'


def check_cpu_strategy(cfg: Config) -> None:
    """Raise before gloo starts if the FlexibleRunner strategy needs CUDA.

    MMEngine's ``FSDPStrategy`` wraps FSDP1, which refuses CPUs ("FSDP
    needs a non-CPU accelerator device"), and the DeepSpeed and
    ColossalAI strategies need GPUs too; without this check the run fails
    after the process group started, in their words.

    Raises:
        ValueError: The strategy is not one of ``_CPU_STRATEGIES``.
    """
    kind = _strategy_type(cfg)
    if kind is None or kind in _CPU_STRATEGIES:
        return
    hint = (" Use strategy=dict(type='FSDP2Strategy') (PyTorch's FSDP2, "
            'which runs on CPUs) instead.' if 'FSDP' in kind else '')
    raise ValueError(
        f'strategy type {kind!r} needs CUDA, but there is none: on CPUs '
        f'the tools run {" or ".join(_CPU_STRATEGIES)} on a gloo process '
        f'group.{hint}')


def init_gloo(launcher: str) -> None:
    """Start a gloo process group from ``launcher``'s environment
    (``pytorch``: torchrun's; ``slurm``; ``mpi``), for CPU runs, where
    MMEngine's ``init_dist`` fails (it calls ``torch.cuda.set_device``)."""
    if launcher in ('slurm', 'mpi'):
        ours, theirs = LAUNCH_ENV['pytorch'], LAUNCH_ENV[launcher]
        for field in ('rank', 'world', 'local'):
            os.environ.setdefault(
                getattr(ours, field), os.environ[getattr(theirs, field)])
    if launcher == 'slurm':
        os.environ.setdefault('MASTER_PORT', '29500')
        if 'MASTER_ADDR' not in os.environ:
            raise RuntimeError(
                'MASTER_ADDR is not set: on CPU nodes the Slurm launcher '
                'needs it (e.g. the first host of $SLURM_NODELIST); '
                'tools/slurm_train.sh sets it.')
    elif launcher not in ('pytorch', 'mpi'):
        raise ValueError(f"launcher should be 'none', 'pytorch', 'slurm' or "
                         f"'mpi', but got {launcher!r}")
    restart = restart_count()
    if not restart:
        dist.init_process_group(backend='gloo', init_method='env://')
        return
    # A restart under torchrun meets its peers through the agent's store,
    # which still holds the killed attempt's gloo addresses under the same
    # keys: ranks would dial dead ports ("Connection refused") and the
    # restart fail. A prefix per attempt keeps each attempt's keys apart.
    store, rank, world_size = next(dist.rendezvous('env://'))
    dist.init_process_group(
        backend='gloo',
        store=dist.PrefixStore(f'attempt{restart}', store),
        rank=rank,
        world_size=world_size)


def _sync_bn_to_bn(node) -> int:
    """Replace ``type='SyncBN'`` in a config tree in place; count them."""
    count = 0
    if isinstance(node, dict):
        if node.get('type') == 'SyncBN':
            node['type'] = 'BN'
            count += 1
        for value in node.values():
            count += _sync_bn_to_bn(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            count += _sync_bn_to_bn(value)
    return count


def prepare_launch(cfg: Config,
                   launcher: str,
                   cuda: Optional[bool] = None) -> Config:
    """Prepare ``cfg`` and the process group for ``launcher``.

    Args:
        cfg (Config): The training config; changed in place.
        launcher (str): ``'none'``, ``'pytorch'``, ``'slurm'`` or ``'mpi'``.
        cuda (bool, optional): Whether to use GPUs. Defaults to None,
            meaning ``torch.cuda.is_available()``.

    Returns:
        Config: ``cfg``.

    Raises:
        KeyError, ValueError: Without CUDA, a distributed launch with a
            ``model_wrapper_cfg`` that is not a DDP (see
            :func:`check_cpu_wrapper`); raised before the process group
            starts.
    """
    cfg.launcher = launcher
    if _strategy_type(cfg) is not None and cfg.get('model_wrapper_cfg'):
        # FlexibleRunner.from_cfg never reads it: refuse rather than train
        # with something else than the config says.
        raise ValueError(
            'model_wrapper_cfg is not used with runner_type='
            "'FlexibleRunner': the strategy "
            f'({_strategy_type(cfg)}) wraps or shards the model. Remove '
            'model_wrapper_cfg, or set the wrapper through the strategy '
            "(e.g. strategy=dict(type='DDPStrategy', model_wrapper=...)).")
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return cfg
    if launcher != 'none':
        # Before the process group: every rank fails alike, at once.
        check_cpu_wrapper(cfg)
        check_cpu_strategy(cfg)
        if not dist.is_initialized():
            init_gloo(launcher)
    # One line per run, not per rank.
    main_process = is_launch_rank0()
    if _sync_bn_to_bn(cfg.get('model')) and main_process:
        print_log(
            'No CUDA: SyncBN needs GPUs, so the model uses BN instead '
            '(statistics per rank; DDP broadcasts rank 0\'s buffers).',
            logger='current',
            level=logging.WARNING)
    if launcher == 'none':
        return cfg
    env_cfg = dict(cfg.get('env_cfg') or {})
    env_cfg['dist_cfg'] = dict(env_cfg.get('dist_cfg') or {}, backend='gloo')
    cfg.env_cfg = env_cfg
    strategy = _strategy_type(cfg)
    if strategy is not None:
        # FlexibleRunner: the strategy wraps the model, no model wrapper.
        if main_process:
            print_log(
                f'No CUDA: started a gloo process group of '
                f'{dist.get_world_size()} ranks on CPU ({strategy}).',
                logger='current')
        return cfg
    wrapper_cfg = cfg.get('model_wrapper_cfg') or dict(
        type='MMDistributedDataParallel')
    wrapper_cfg.setdefault('find_unused_parameters',
                           cfg.get('find_unused_parameters', False))
    # CPU modules take no device_ids. Without SyncBN, keep DDP's default
    # broadcast_buffers=True so every rank uses rank 0's BN statistics, as
    # the saved checkpoint will.
    wrapper_cfg['device_ids'] = None
    cfg.model_wrapper_cfg = wrapper_cfg
    if main_process:
        print_log(
            f'No CUDA: started a gloo process group of '
            f'{dist.get_world_size()} ranks on CPU (DDP without device_ids).',
            logger='current')
    return cfg


def restart_count() -> int:
    """How many times this run was restarted after a failure: torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` (``--max-restarts``),
    ``MMCV_CUSTOM_RESTART_COUNT`` (``tools/slurm_train.sh``'s loop), or
    ``SLURM_RESTART_COUNT`` (a job Slurm requeued: ``scontrol requeue``,
    ``--requeue`` after a node failure)."""
    for name in ('TORCHELASTIC_RESTART_COUNT', 'MMCV_CUSTOM_RESTART_COUNT',
                 'SLURM_RESTART_COUNT'):
        value = os.environ.get(name, '').strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


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
        from mmengine.runner import EpochBasedTrainLoop

        from .engine.console import progress_text
        loop = runner.train_loop
        if isinstance(loop, EpochBasedTrainLoop):
            done, key = runner.epoch >= loop.max_epochs, 'max_epochs'
        else:
            done, key = runner.iter >= loop.max_iters, 'max_iters'
        if done:
            raise NothingToTrain(
                f'Nothing left to train ({progress_text(runner)}): the run '
                f'is finished. To train it further, raise train_cfg.{key} '
                f'(--cfg-options train_cfg.{key}=...) and --resume again.')


def run_runner(cfg: Config, method: str, notes=()) -> None:
    """Build the runner ``cfg`` asks for, call its ``method`` (``'train'``,
    ``'test'``), then free it and destroy the process group, even when the
    run fails: the DDP model (and the comm hook and state its reducer
    holds) must go while the group still exists.

    On rank 0 the console (see :mod:`mmcv_custom.engine.console`) opens
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
    from .engine.console import current_console, header_text, summary_text
    from .engine.load_report import load_from_min_match, report_load_from
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


def check_writable(parser, option: str, path: str) -> None:
    """For the tools' output options: ``parser.error`` (a usage error, exit
    code 2) now, not after a long run, if ``path`` cannot be written: its
    folder is missing or read-only, or it is a folder. Leaves no file
    behind when there was none.

    Args:
        parser (argparse.ArgumentParser): The tool's parser.
        option (str): The option, for the message, e.g. ``'--json'``.
        path (str): The file the tool will write.
    """
    if os.path.isdir(path):
        parser.error(f'{option} {path}: is a directory, not a file')
    existed = os.path.exists(path)
    try:
        with open(path, 'a'):
            pass
    except OSError as e:
        parser.error(f'{option} {path}: cannot write there ({e.strerror})')
    if not existed:
        os.remove(path)


def free_port() -> str:
    """A TCP port free on this host now, as ``PORT`` for
    ``tools/dist_train.sh`` (each run its own, so runs never meet)."""
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return str(s.getsockname()[1])


_RESULTS = 'results.json'


def spawn_ranks(worker: Callable, nproc: int, args) -> object:
    """For the benchmark tools: run ``worker(rank, nproc, folder, args)``
    in ``nproc`` spawned processes and return what one of them saved with
    :func:`write_results` in ``folder`` (a temporary folder, removed
    after)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            worker,
            args=(nproc, folder, args),
            nprocs=nproc,
            start_method='spawn')
        with open(os.path.join(folder, _RESULTS)) as f:
            return json.load(f)


def write_results(folder: str, results) -> None:
    """In a :func:`spawn_ranks` worker: hand ``results`` (JSON) back."""
    with open(os.path.join(folder, _RESULTS), 'w') as f:
        json.dump(results, f)
