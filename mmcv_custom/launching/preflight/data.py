"""The data check: every dataset the run reads, through dataset wrappers,
with what to do for each missing or empty path (ADE20K's download and
the few-shot splits named).
"""
import os
import os.path as osp
import re
from typing import Dict, Iterator, List, Optional, Tuple

from mmengine.config import Config

from .problems import Problem, cwd_note

__all__ = ['data_problems']

_ADE_URL = ('http://data.csail.mit.edu/places/ADEchallenge/'
            'ADEChallengeData2016.zip')
_SPLITS = ('.venv/bin/python tools/dataset_converters/'
           'ade20k_fewshot_splits.py')


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


def data_problems(cfg: Config, mode: str) -> List[Problem]:
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
            Problem(
                f'{where}: {_DATA_WHAT[kind].format(path)}{cwd_note(path)}',
                fix))
    return problems
