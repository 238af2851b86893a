"""Check what a run needs before anything heavy starts, and say it all once.

MMEngine finds a missing dataset, pretrained file or checkpoint only when it
reaches it: after the process group started and the whole model was built
(billions of parameters for InternViT-6B), one problem per attempt, in the
words of whatever failed (``[Errno 2] ... images/training``). The tools call
:func:`check_preflight` right after the config is merged and the checkpoint
to load is chosen, and report every problem found, each with what to do
about it, before any of that:

* the data of every dataset the run reads (``data_root`` with each
  ``data_prefix`` folder, ``ann_file``), through dataset wrappers
  (``dataset``, ``datasets``); a dataset class that writes its own data
  (``generates_data(cfg)``, as
  :class:`~mmcv_custom.datasets.ToyShapesDataset`) is left out;
* ``load_from``, the checkpoint ``--resume`` takes and ``tools/test.py``'s
  CHECKPOINT: there, intact and holding only what the safe loader allows
  (:func:`mmcv_custom.checkpoint.check_checkpoint_file`); URLs are left to
  MMEngine;
* (training) every pretrained file of the model: ``pretrained`` keys and
  ``init_cfg=dict(type='Pretrained', checkpoint=...)`` anywhere in it;
* ``comm_hook``: its names and values (:func:`check_comm_hook_cfg`, and
  under FSDP2 whether the type has a sharded form), which the runner hook
  would check only once the model is built;
* ``custom_hooks``: a list of hook configs whose types are registered
  (the runner builds them only after the model; a dict written through
  ``--cfg-options`` stays a string);
* the launcher's environment: ``--launcher pytorch``, ``slurm`` or ``mpi``
  in a process that torchrun, ``srun`` or ``mpirun`` did not start;
* the work dir, and the CheckpointHook's ``out_dir`` when it has one:
  writable (nothing is left behind), and, for training, room on the
  checkpoints' disk for one save (:func:`checkpoint_size`: the weights,
  the optimizer state and every rank's hook state file), estimated from
  the model built on the meta device (no memory; a second for
  InternViT-6B). When the estimate fails, the room is not checked;
* problems the caller found first (``first``: where ``tools/train.py``'s
  run would start, see :mod:`mmcv_custom.run_start`).

:func:`checked_config` reads the config itself, so that a missing or
unreadable config file is reported the same way.

Only configs and file systems are read; no model memory is allocated.
"""
import copy
import os
import os.path as osp
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from mmengine.config import Config

from .checkpoint import (UnsafeCheckpointError, check_checkpoint_file,
                         is_sharded_checkpoint)
from .integrity import CheckpointDamagedError
from .launcher import LAUNCH_ENV, uses_fsdp2

__all__ = [
    'Problem', 'PreflightError', 'preflight', 'check_preflight',
    'checked_config', 'format_problems', 'estimate_checkpoint_bytes',
    'checkpoint_size', 'CheckpointSize', 'format_size', 'preflight_report',
    'exit_on_problems'
]

_GIB = 1024**3
# How long a quiet rank waits before it exits on a preflight problem; see
# exit_on_problems.
_QUIET_RANK_GRACE_S = 3.0
_MODES = ('train', 'test')
# The loaders of .safetensors and Hugging Face shard indexes execute
# nothing: only their presence is checked.
_NO_PICKLE = ('.safetensors', '.index.json')

_ADE_URL = ('http://data.csail.mit.edu/places/ADEchallenge/'
            'ADEChallengeData2016.zip')
_INTERNVIT_DOC = 'docs/en/user_guides/intern_vit.md'
_CONVERTER = '.venv/bin/python tools/model_converters/internvit2mmseg.py'
_SPLITS = ('.venv/bin/python tools/dataset_converters/'
           'ade20k_fewshot_splits.py')
# InternVL's released file names, e.g. intern_vit_6b_224px.pth.
_INTERNVIT_NAME = re.compile(r'^intern_vit_(\d+[mb])_(\d+px)\.pth$', re.I)

#: Optimizer states per trainable parameter, each of its size, that a
#: checkpoint saves (SGD: its momentum buffer, when momentum is set).
_OPTIMIZER_STATES = {
    'Adam': 2,
    'AdamW': 2,
    'Adamax': 2,
    'NAdam': 2,
    'RAdam': 2,
    'Adadelta': 2,
    'Adagrad': 1,
    'RMSprop': 1,
}


@dataclass(frozen=True)
class Problem:
    """One thing that would stop the run, found before it starts.

    Attributes:
        what (str): Names the config key or source, the path and what is
            wrong with it.
        fix (str): What to do about it; empty when ``what`` says it.
    """
    what: str
    fix: str = ''

    def __str__(self) -> str:
        if not self.fix:
            return self.what
        return f'{self.what.rstrip(".")}. Fix: {self.fix}'


def format_problems(problems: List[Problem]) -> str:
    """The one message for ``problems``: a single problem on one line,
    several under a header line, one line each."""
    if len(problems) == 1:
        return str(problems[0])
    lines = [
        f'{len(problems)} problems, found before building the model or '
        'starting the process group:'
    ]
    lines += [f'  {i}. {p}' for i, p in enumerate(problems, 1)]
    return '\n'.join(lines)


class PreflightError(RuntimeError):
    """What :func:`check_preflight` found; ``str()`` is the message.

    Attributes:
        problems (list[Problem]): Every problem, in the order found.
    """

    def __init__(self, problems: List[Problem]) -> None:
        self.problems = list(problems)
        super().__init__(format_problems(self.problems))


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
            :func:`mmcv_custom.launcher.load_config` sets it).
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
            the run would start, see :mod:`mmcv_custom.run_start`), said
            first.

    Returns:
        list[Problem]: Empty when nothing was found.

    Raises:
        ValueError: ``mode`` is neither ``'train'`` nor ``'test'``.
    """
    if mode not in _MODES:
        raise ValueError(f"mode should be 'train' or 'test', but got "
                         f'{mode!r}')
    problems = list(first) + _launcher_problems(launcher)
    imports = _import_problems(cfg)
    problems += imports
    # Hook types are looked up only once their modules are imported.
    problems += _custom_hooks_problems(cfg, registered=not imports)
    problems += _comm_hook_problems(cfg)
    problems += _data_problems(cfg, mode)
    if mode == 'train':
        # Runner.train initialises the weights (loading these) even when
        # it then resumes; Runner.test does not.
        problems += _pretrained_problems(cfg.get('model'))
        if cfg.get('load_from') and cfg.load_from != resume_checkpoint:
            problems += _checkpoint_problems(
                cfg.load_from, 'load_from',
                'correct the path, or leave load_from out')
        if resume_checkpoint:
            problems += _checkpoint_problems(resume_checkpoint,
                                             'the checkpoint to resume from',
                                             '')
    elif test_checkpoint is not None:
        problems += _checkpoint_problems(
            test_checkpoint, 'checkpoint',
            'give a checkpoint file (or sharded checkpoint directory) '
            'that tools/train.py wrote')
    problems += _work_dir_problems(cfg, mode, launcher)
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
    (:func:`mmcv_custom.launcher.load_config`), or a :class:`PreflightError`
    naming the file and why: missing, not a config file, or one that does
    not parse or merge.

    Args:
        path (str): The config file.
        cfg_options (dict, optional): ``--cfg-options``, merged in.
        work_dir (str, optional): ``--work-dir``.
        option (str): How the command line names the file, for the
            message, e.g. ``'config'`` or ``'--config'``.

    Returns:
        Config: The merged config.
    """
    from .launcher import load_config
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


# Per --launcher: what starts its processes, and how a user does that.
_STARTERS = {
    'pytorch':
    ('torchrun', 'start it with tools/dist_train.sh CONFIG NPROC (torchrun), '
     'or leave --launcher out to run one process'),
    'slurm':
    ('srun', 'start it with tools/slurm_train.sh PARTITION JOB_NAME CONFIG '
     '(srun), or leave --launcher out to run one process'),
    'mpi': ("Open MPI's mpirun",
            'start it with mpirun -np N, or leave --launcher out to run '
            'one process'),
}


def preflight_report(error: PreflightError, prog: str,
                     launcher: str) -> Optional[str]:
    """What this process prints for ``error`` (``prog: error: ...``), or
    None where it stays quiet, so that every rank exits but each problem
    is said once.

    Local rank 0 of each node speaks (a single node: once), since every
    node checks its own disks; another node than global rank 0's says
    which it is. Works before the process group exists, from the
    launcher's environment.
    """
    if launcher in LAUNCH_ENV:
        env = LAUNCH_ENV[launcher]
        local = os.environ.get(env.local, '0').strip()
        if local not in ('', '0'):
            return None
        rank = os.environ.get(env.rank, '0').strip()
        if rank not in ('', '0'):
            prog = f'{prog} (on {socket.gethostname()}, rank {rank})'
    return f'{prog}: error: {error}'


def exit_on_problems(error: PreflightError, prog: str, launcher: str):
    """Stop this process with exit code 2 (as for a usage error), saying
    ``error`` where :func:`preflight_report` says this process speaks.

    Every rank finds the same problems at about the same time. A quiet
    rank waits a moment before it exits, so that the speaking one has
    said why and exited first: the launcher (torchrun, Slurm) stops the
    remaining ranks as soon as one exits, and a speaking rank stopped
    mid-sentence would leave a failure without its cause.
    """
    report = preflight_report(error, prog, launcher)
    if report:
        print(report, file=sys.stderr, flush=True)
    else:
        time.sleep(_QUIET_RANK_GRACE_S)
    sys.exit(2)


# -- the launcher ----------------------------------------------------------


def _launcher_problems(launcher: str) -> List[Problem]:
    """A process given ``--launcher`` that its launcher did not start
    would fail in the process group's start-up on a bare ``KeyError``."""
    if launcher not in LAUNCH_ENV:
        return []
    env = LAUNCH_ENV[launcher]
    # LOCAL_RANK: tools/train.py sets it from --local_rank when missing.
    names = (env.rank, env.world) + (
        (env.local, ) if launcher != 'pytorch' else ()) + env.others
    missing = [n for n in names if not os.environ.get(n, '').strip()]
    if not missing:
        return []
    starter, fix = _STARTERS[launcher]
    return [
        Problem(
            f'--launcher {launcher}: {", ".join(missing)} '
            f'{"is" if len(missing) == 1 else "are"} not set, so '
            f'{starter} did not start this process', fix)
    ]


# -- comm_hook ---------------------------------------------------------------


def _comm_hook_problems(cfg: Config) -> List[Problem]:
    """``comm_hook`` checked as the runner hook will check it, but before
    the model is built (minutes for InternViT-6B). Its messages name the
    bad value and the valid ones."""
    comm_hook = cfg.get('comm_hook')
    if comm_hook is None:
        return []
    from .comm.builder import CommHookConfigError, check_comm_hook_cfg
    from .comm.sharded import build_sharded_comm

    # Under FSDP2, also whether the type has a sharded form.
    check = build_sharded_comm if uses_fsdp2(cfg) else check_comm_hook_cfg
    try:
        check(comm_hook)
    except (KeyError, TypeError, ValueError) as e:
        # Every bad value, one problem each.
        errors = e.errors if isinstance(e, CommHookConfigError) else [e]
        return [
            Problem(
                str(err.args[0]
                    if isinstance(err, KeyError) and err.args else err))
            for err in errors
        ]
    return []


_CLI_DICT_FIX = (
    '--cfg-options cannot write a dict inside a list (it stays a string): '
    "set custom_hooks in a config that inherits this one (_base_ = ['...'] "
    "and custom_hooks = [dict(type='...')])")


def _custom_hooks_problems(cfg: Config, registered: bool) -> List[Problem]:
    """``custom_hooks``: a list of ``dict(type=...)`` (or Hook objects),
    each type registered (when ``registered``), as the runner will need
    them after building the model."""
    from mmengine.hooks import Hook
    hooks = cfg.get('custom_hooks')
    if hooks is None:
        return []
    if not isinstance(hooks, (list, tuple)):
        return [
            Problem(
                'custom_hooks should be a list of hook configs such as '
                f"[dict(type='...')], but got {hooks!r}",
                _CLI_DICT_FIX if isinstance(hooks, str) else '')
        ]
    problems = []
    for i, hook in enumerate(hooks):
        if isinstance(hook, Hook):
            continue
        if not isinstance(hook, dict) or 'type' not in hook:
            problems.append(
                Problem(
                    f'custom_hooks[{i}] should be a hook config such as '
                    f"dict(type='...'), but got {hook!r}",
                    _CLI_DICT_FIX if isinstance(hook, str) else ''))
        elif registered and isinstance(hook['type'], str):
            unknown = _unknown_hook(cfg, hook['type'])
            if unknown:
                problems.append(
                    Problem(
                        f'custom_hooks[{i}]: {unknown}',
                        'correct the type, or import the module that '
                        'registers it in custom_imports'))
    return problems


def _unknown_hook(cfg: Config, name: str) -> Optional[str]:
    """Why the runner would not find hook type ``name`` in the config's
    scope (with close matches), or None when it would."""
    import difflib

    from mmengine.registry import HOOKS
    with HOOKS.switch_scope_and_registry(cfg.get('default_scope')) as found:
        if found.get(name) is not None:
            return None
        names, registry = set(), found
        while registry is not None:
            names.update(registry.module_dict)
            registry = registry.parent
    close = difflib.get_close_matches(name, sorted(names), n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ''
    return f'{name!r} is not a registered hook{hint}'


# -- custom imports --------------------------------------------------------


def _import_problems(cfg: Config) -> List[Problem]:
    """Import ``custom_imports`` (the runner would), so that the dataset
    and model classes are registered; a failure is a problem itself."""
    custom = cfg.get('custom_imports')
    if not custom:
        return []
    from mmengine.utils import import_modules_from_strings
    try:
        import_modules_from_strings(**custom)
    except ImportError as e:
        return [
            Problem(f'custom_imports: {e}',
                    'install the package, or correct custom_imports')
        ]
    return []


# -- data --------------------------------------------------------------------


def _loader_keys(cfg: Config, mode: str) -> List[str]:
    if mode == 'test':
        return ['test_dataloader']
    keys = ['train_dataloader']
    # MMEngine validates only with all three.
    if all(
            cfg.get(k) is not None
            for k in ('val_dataloader', 'val_cfg', 'val_evaluator')):
        keys.append('val_dataloader')
    return keys


def _leaf_datasets(node, key: str) -> Iterator[Tuple[str, dict]]:
    """``(key, dataset cfg)`` of each dataset inside wrappers
    (RepeatDataset, ClassBalancedDataset: ``dataset``; ConcatDataset:
    ``datasets``)."""
    if not isinstance(node, dict):
        return
    if isinstance(node.get('datasets'), (list, tuple)):
        for i, child in enumerate(node['datasets']):
            yield from _leaf_datasets(child, f'{key}.datasets[{i}]')
    elif isinstance(node.get('dataset'), dict):
        yield from _leaf_datasets(node['dataset'], f'{key}.dataset')
    else:
        yield key, node


def _dataset_class(dataset: dict, default_scope: Optional[str]):
    """The registered class of ``dataset``, or None if it cannot be
    resolved (then its folders are checked as they are)."""
    kind = dataset.get('type')
    if not isinstance(kind, str):
        return kind
    from mmengine.registry import DATASETS
    try:
        scope = dataset.get('_scope_', default_scope)
        with DATASETS.switch_scope_and_registry(scope) as registry:
            return registry.get(kind)
    except Exception:
        return None


def _generates_data(dataset: dict, default_scope: Optional[str]) -> bool:
    cls = _dataset_class(dataset, default_scope)
    generates = getattr(cls, 'generates_data', None)
    if not callable(generates):
        return False
    try:
        return bool(generates(dataset))
    except Exception:
        return False


def _is_ade20k(dataset: dict) -> bool:
    kind = dataset.get('type')
    name = kind if isinstance(kind, str) else getattr(kind, '__name__', '')
    root = dataset.get('data_root') or ''
    return name.split('.')[-1] == 'ADE20KDataset' or ('ADEChallengeData2016'
                                                      in str(root))


def _ade20k_fix(root: str) -> str:
    name = osp.normpath(root)
    unzip = (f'unzip it in {osp.dirname(name) or "."}'
             if osp.basename(name) == 'ADEChallengeData2016' else
             f'unzip it and move its ADEChallengeData2016 to {root}')
    return (f'put ADE20K there: download {_ADE_URL} and {unzip}, so that '
            f'{root} holds images/training, images/validation (*.jpg) '
            'and annotations/training, annotations/validation (*.png)')


def _where(path: str) -> str:
    if osp.isabs(path):
        return ''
    return (' (relative paths are from the current directory, '
            f'{os.getcwd()})')


def _has_files(folder: str) -> bool:
    """Whether ``folder`` (searched recursively, as MMSegmentation lists
    it) holds at least one file; stops at the first."""
    for _, _, files in os.walk(folder, followlinks=True):
        if files:
            return True
    return False


def _join(root: Optional[str], path: str) -> str:
    return osp.join(root, path) if root and not osp.isabs(path) else path


def _missing_data(dataset: dict) -> Iterator[Tuple[str, str, str]]:
    """``(kind, path, fix)`` of what ``dataset`` lacks: its ``data_root``
    (then nothing below it is looked at), a ``data_prefix`` folder that is
    missing or empty, its ``ann_file``."""
    root = dataset.get('data_root')
    prefix = dataset.get('data_prefix') or {}
    folders = [p for p in prefix.values() if isinstance(p, str) and p
               ] if isinstance(prefix, dict) else []
    ann_file = dataset.get('ann_file')
    ade = _is_ade20k(dataset)
    if isinstance(root, str) and root and '://' not in root:
        if not osp.isdir(root):
            yield 'root', root, (
                _ade20k_fix(root) if ade else 'put the dataset there')
            return
    for folder in folders:
        path = _join(root, folder)
        if '://' in path:
            continue
        fix = (
            _ade20k_fix(root or '.')
            if ade else f'put the dataset\'s {folder} there')
        if not osp.isdir(path):
            yield 'folder', path, fix
        elif not _has_files(path):
            yield 'empty', path, fix
    if isinstance(ann_file, str) and ann_file:
        path = _join(root, ann_file)
        if '://' not in path and not osp.isfile(path):
            split = re.match(r'splits/train_1of\d+\.txt$', ann_file)
            yield 'ann_file', path, (
                f'write the few-shot splits: {_SPLITS} --data-root {root}'
                if ade and split else
                'correct ann_file, or leave it out to read every file of '
                'the folders')


_DATA_WHAT = {
    'root': 'data_root {!r} does not exist',
    'folder': '{!r}: no such folder',
    'empty': '{!r} holds no files',
    'ann_file': 'ann_file {!r}: no such file',
}


def _data_problems(cfg: Config, mode: str) -> List[Problem]:
    """One problem per missing or empty path, naming every dataset that
    reads it (train and val share ADE20K's root)."""
    found: Dict[Tuple[str, str], Tuple[List[str], str]] = {}
    scope = cfg.get('default_scope')
    for loader in _loader_keys(cfg, mode):
        for key, dataset in _leaf_datasets(cfg.get(loader), loader):
            if not (dataset.get('data_root') or dataset.get('data_prefix')
                    or dataset.get('ann_file')):
                continue  # data of its own (e.g. synthetic)
            if _generates_data(dataset, scope):
                continue
            for kind, path, fix in _missing_data(dataset):
                keys, _ = found.setdefault((kind, path), ([], fix))
                if key not in keys:
                    keys.append(key)
    problems = []
    for (kind, path), (keys, fix) in found.items():
        where = ' and '.join(k.split('.')[0] for k in keys)
        if kind != 'ann_file':
            settings = ' '.join(f'{k}.data_root=PATH' for k in keys)
            fix += ('; or set data_root to where the dataset is '
                    f'(--cfg-options {settings})')
        problems.append(
            Problem(f'{where}: {_DATA_WHAT[kind].format(path)}{_where(path)}',
                    fix))
    return problems


# -- pretrained weights and checkpoints ------------------------------------


def _weight_paths(node, key: str) -> Iterator[Tuple[str, str]]:
    """``(key, path)`` of every pretrained file named in a model config."""
    if isinstance(node, dict):
        for name, value in node.items():
            sub = f'{key}.{name}'
            if name == 'pretrained' and isinstance(value, str):
                yield sub, value
            elif name == 'init_cfg':
                inits = value if isinstance(value, (list, tuple)) else [value]
                for i, init in enumerate(inits):
                    if (isinstance(init, dict)
                            and init.get('type') == 'Pretrained'
                            and isinstance(init.get('checkpoint'), str)):
                        at = f'[{i}]' if isinstance(value,
                                                    (list, tuple)) else ''
                        yield f'{sub}{at}.checkpoint', init['checkpoint']
            else:
                yield from _weight_paths(value, sub)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _weight_paths(value, f'{key}[{i}]')


def _pretrained_fix(key: str, path: str) -> str:
    name = osp.basename(path)
    found = _INTERNVIT_NAME.match(name)
    if found or name.lower().startswith('intern_vit'):
        release = (f'OpenGVLab/InternViT-{found.group(1).upper()}-'
                   f'{found.group(2)}' if found else 'InternViT')
        return (f"put InternVL's released {name} there, or convert the "
                f'downloaded {release} weights into it: {_CONVERTER} SRC '
                f'{path} --sha256 HEX (SRC: its model.safetensors, '
                f'*.index.json or .pth; HEX: the SHA-256 its download page '
                f'lists for SRC, once per shard of an index; see '
                f'{_INTERNVIT_DOC})')
    return (f'put the file there, or set {key} to where it is '
            f'(--cfg-options {key}=PATH)')


def _pretrained_problems(model) -> List[Problem]:
    problems, seen = [], set()
    for key, path in _weight_paths(model, 'model'):
        if '://' in path or path in seen:
            continue
        seen.add(path)
        if osp.isdir(path):
            hint = ('an FSDP2 sharded checkpoint, not one file'
                    if is_sharded_checkpoint(path) else
                    'a directory, not a checkpoint file')
            fix = ('make it one file: tools/model_converters/fsdp2_to_pth.py'
                   if is_sharded_checkpoint(path) else
                   f'set {key} to the checkpoint file')
            problems.append(Problem(f'{key}={path!r}: {hint}', fix))
        elif not osp.isfile(path):
            problems.append(
                Problem(f'{key}={path!r}: no such file{_where(path)}',
                        _pretrained_fix(key, path)))
        elif not path.endswith(_NO_PICKLE):
            problems += _checkpoint_problems(path, key, '')
    return problems


def _checkpoint_problems(path, source: str, fix_missing: str) -> List[Problem]:
    """:func:`check_checkpoint_file`'s error as a problem, not raised."""
    path = str(path)
    try:
        check_checkpoint_file(path, source)
    except FileNotFoundError as e:
        return [Problem(str(e), fix_missing)]
    except CheckpointDamagedError as e:
        return [
            Problem(f'{source}: {e}',
                    'restore it from an intact copy, or load another one')
        ]
    except UnsafeCheckpointError as e:
        return [Problem(f'{source}: {e}')]  # it says what to do
    except (RuntimeError, OSError, EOFError) as e:
        what = str(e) if source in str(e) else f'{source}={path!r}: {e}'
        return [Problem(what, 'load another checkpoint')]
    return []


# -- the work dir ----------------------------------------------------------


def _optimizer_states(cfg: Config) -> int:
    """Tensors the checkpoint saves per trainable parameter for the
    optimizer (0 when unknown: the estimate stays a lower bound)."""
    checkpoint_hook = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    if checkpoint_hook.get('save_optimizer', True) is False:
        return 0
    optimizer = (cfg.get('optim_wrapper') or {}).get('optimizer') or {}
    kind = optimizer.get('type', '')
    name = kind if isinstance(kind, str) else getattr(kind, '__name__', '')
    name = name.split('.')[-1]
    if name == 'SGD':
        return 1 if optimizer.get('momentum') else 0
    return _OPTIMIZER_STATES.get(name, 0)


class CheckpointSize(NamedTuple):
    """What one save of a run writes, in bytes (see
    :func:`checkpoint_size`)."""
    weights: int  # parameters and buffers, in their dtypes
    optimizer: int  # the optimizer's state per trainable parameter
    hook_state: int  # every rank's communication-hook state file

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.hook_state

    def describe(self) -> str:
        parts = [f'weights {format_size(self.weights)}']
        if self.optimizer:
            parts.append(f'optimizer state {format_size(self.optimizer)}')
        if self.hook_state:
            parts.append('communication-hook state files '
                         f'{format_size(self.hook_state)}')
        return ', '.join(parts)


def format_size(size: float) -> str:
    """``size`` bytes for a message: GiB from 1 GiB, MiB below (so that a
    small model's checkpoint is not "0.0 GiB")."""
    if size >= _GIB:
        return f'{size / _GIB:.1f} GiB'
    return f'{size / 2**20:.1f} MiB'


def _hook_state_bytes(cfg: Config, params, world_size: int) -> int:
    """Every rank's hook state file for one save: the keeper of the
    ``comm_hook``'s record says how large one is (no table by hook)."""
    comm_hook = cfg.get('comm_hook')
    if not isinstance(comm_hook, dict) or uses_fsdp2(cfg):
        return 0
    try:
        from .comm.builder import check_comm_hook_cfg, hook_record
        keeper = hook_record(comm_hook.get('type')).state_keeper
        if keeper is None:
            return 0
        state_kwargs = check_comm_hook_cfg(comm_hook)['state_kwargs']
    except (KeyError, TypeError, ValueError):
        return 0  # said as a comm_hook problem
    return world_size * keeper.file_bytes(params, state_kwargs)


def checkpoint_size(cfg: Config,
                    world_size: int = 1) -> Optional[CheckpointSize]:
    """About how large one save of ``cfg``'s run is: the model's
    parameters and buffers in their dtypes, the optimizer's state per
    trainable parameter (two for Adam/AdamW), and the state file every one
    of ``world_size`` ranks writes beside it for a stateful ``comm_hook``
    (int8's and PowerSGD's error feedback).

    The model is built on the meta device, so no memory is allocated
    (InternViT-6B: about a second). Returns None when it cannot be built
    that way; the caller then checks nothing.
    """
    model_cfg = cfg.get('model')
    if not isinstance(model_cfg, dict):
        return None
    try:
        import torch
        from mmengine.registry import MODELS
        with warnings.catch_warnings():
            # The real build shows them again.
            warnings.simplefilter('ignore')
            with MODELS.switch_scope_and_registry(
                    cfg.get('default_scope')) as registry:
                with torch.device('meta'):
                    model = registry.build(copy.deepcopy(model_cfg))
        params = list(model.parameters())
        size = sum(p.numel() * p.element_size() for p in params)
        size += sum(b.numel() * b.element_size() for b in model.buffers())
        trainable = sum(p.numel() * p.element_size() for p in params
                        if p.requires_grad)
    except Exception:
        return None
    return CheckpointSize(size,
                          _optimizer_states(cfg) * trainable,
                          _hook_state_bytes(cfg, params, world_size))


def estimate_checkpoint_bytes(cfg: Config,
                              world_size: int = 1) -> Optional[int]:
    """:func:`checkpoint_size`'s total; None where it is unknown."""
    size = checkpoint_size(cfg, world_size)
    return None if size is None else size.total


def _world_size(launcher: str) -> int:
    """The ranks of this launch, from its launcher's environment (1 when
    it says none)."""
    env = LAUNCH_ENV.get(launcher)
    value = os.environ.get(env.world, '') if env else ''
    return int(value) if value.strip().isdigit() else 1


def _folder_problems(key: str,
                     folder: str) -> Tuple[List[Problem], Optional[str]]:
    """Whether ``folder`` (a work dir, or the checkpoint folder) can be
    made and written; returns the problems and its nearest existing
    folder (None with a problem)."""
    fix = ('choose another --work-dir' if key == 'work_dir' else
           f'set {key} to another folder (--cfg-options {key}=PATH)')
    what = 'work dir' if key == 'work_dir' else 'folder'
    for _ in range(_VANISHING_TRIES):
        existing = _nearest_existing(folder)
        if not osp.isdir(existing):
            return [
                Problem(
                    f'{key} {folder!r}: {existing} is a file, not a folder, '
                    f'so the {what} cannot be '
                    f'{"used" if existing == osp.abspath(folder) else "made"}',
                    fix)
            ], None
        try:
            # A real write (read-only mounts, ACLs), removed at once.
            os.rmdir(tempfile.mkdtemp(prefix='.preflight-', dir=existing))
        except FileNotFoundError:
            # Another rank's lock made the folder and removed it again
            # (its start was refused): look again.
            continue
        except OSError as e:
            return [
                Problem(
                    f'{key} {folder!r}: cannot write in {existing} '
                    f'({e.strerror})', f'{fix} (one you can write to)')
            ], None
        return [], existing
    return [
        Problem(
            f'{key} {folder!r}: it kept disappearing while it was checked '
            '(another process makes and removes it)', fix)
    ], None


# How often a folder that another rank made and removed meanwhile is
# looked for again.
_VANISHING_TRIES = 5


def _nearest_existing(folder: str) -> str:
    """``folder`` itself, or the nearest folder above it that exists."""
    existing = osp.abspath(folder)
    while not osp.exists(existing):
        existing = osp.dirname(existing)
    return existing


def _free_bytes(existing: str) -> int:
    """Free space on the disk of ``existing``, or of the nearest folder
    above it when another rank removed it meanwhile."""
    for _ in range(_VANISHING_TRIES):
        try:
            return shutil.disk_usage(existing).free
        except FileNotFoundError:
            existing = _nearest_existing(existing)
    return shutil.disk_usage(_nearest_existing(existing)).free


def _work_dir_problems(cfg: Config,
                       mode: str,
                       launcher: str = 'none') -> List[Problem]:
    """The work dir, and the checkpoint folder (``out_dir``) when it is
    elsewhere: writable, and (training) room for one save."""
    work_dir = cfg.get('work_dir')
    if not isinstance(work_dir, str) or not work_dir or '://' in work_dir:
        return []
    problems, existing = _folder_problems('work_dir', work_dir)
    if problems or mode != 'train':
        return problems
    key = 'work_dir'
    hook = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    out_dir = hook.get('out_dir') if isinstance(hook, dict) else None
    if out_dir and '://' not in str(out_dir):
        key = 'default_hooks.checkpoint.out_dir'
        problems, existing = _folder_problems(key, str(out_dir))
        if problems:
            return problems
        fix = f'free space there, or set {key} to a disk with room'
    else:
        fix = 'free space there, or choose another --work-dir on a disk ' \
              'with room'
    need = checkpoint_size(cfg, _world_size(launcher))
    if need is None:
        return []
    free = _free_bytes(existing)
    if need.total <= free:
        return []
    where = work_dir if key == 'work_dir' else out_dir
    return [
        Problem(
            f'{key} {where!r}: {format_size(free)} free on its disk, but '
            f'one checkpoint of this run takes about '
            f'{format_size(need.total)} ({need.describe()})', fix)
    ]
