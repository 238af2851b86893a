"""The checkpoint files a run loads: every pretrained file of the model,
``load_from``, the checkpoint ``--resume`` takes and ``tools/test.py``'s
CHECKPOINT: there, intact, and holding only what the safe loader allows;
the resumed one of the config's kind (sharded or not).
"""
import os.path as osp
import re
from typing import Iterator, List, Tuple

from ...integrity import CheckpointDamagedError
from ...integrity.checkpoint import (UnsafeCheckpointError,
                                     is_sharded_checkpoint)
from ...integrity.checkpoint_choice import check_checkpoint_file
from ..cpu_start import uses_fsdp2
from .problems import Problem, cwd_note

__all__ = [
    'pretrained_problems', 'checkpoint_problems', 'resume_layout_problems'
]

# The loaders of .safetensors and Hugging Face shard indexes execute
# nothing: only their presence is checked.
_NO_PICKLE = ('.safetensors', '.index.json')
_INTERNVIT_DOC = 'docs/en/user_guides/intern_vit.md'
_CONVERTER = '.venv/bin/python tools/model_converters/internvit2mmseg.py'
# InternVL's released file names, e.g. intern_vit_6b_224px.pth.
_INTERNVIT_NAME = re.compile(r'^intern_vit_(\d+[mb])_(\d+px)\.pth$', re.I)


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


def pretrained_problems(model) -> List[Problem]:
    """Every pretrained file the model config names (``pretrained`` keys,
    ``init_cfg=dict(type='Pretrained', checkpoint=...)``): there, one
    file, and loadable (URLs are left to MMEngine)."""
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
                Problem(f'{key}={path!r}: no such file{cwd_note(path)}',
                        _pretrained_fix(key, path)))
        elif not path.endswith(_NO_PICKLE):
            problems += checkpoint_problems(path, key, '')
    return problems


def checkpoint_problems(path, source: str, fix_missing: str) -> List[Problem]:
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


def resume_layout_problems(cfg, checkpoint: str) -> List[Problem]:
    """A checkpoint resumed by a config of the other layout: an ordinary
    config cannot resume a sharded checkpoint (its optimizer state is
    sharded), nor an FSDP2 config an ordinary one (one file, a DDP run's).
    A sharded checkpoint resumes under any sharding, full or hybrid, on
    any number of ranks: DCP reshards it."""
    sharded = is_sharded_checkpoint(checkpoint)
    weights = ('to start this config from its weights, use --cfg-options '
               f'load_from={checkpoint} without --resume')
    if uses_fsdp2(cfg):
        if sharded or not osp.isfile(checkpoint):
            return []
        return [
            Problem(
                f"{checkpoint} is an ordinary checkpoint (one file, a DDP "
                "run's): an FSDP2 config resumes only a sharded checkpoint "
                'directory that FSDP2Strategy wrote', weights)
        ]
    if not sharded:
        return []
    return [
        Problem(
            f'{checkpoint} is a sharded checkpoint of FSDP2Strategy: it '
            'resumes under an FSDP2 config only (its optimizer state is '
            'sharded)', weights)
    ]
