"""Say, in the log file, what ``load_from`` put into the model.

MMEngine loads ``load_from`` non-strictly and prints its missing and
unexpected keys with ``print`` to the console only: a checkpoint of another
model (a ResNet's weights under an InternViT config, a backbone-only file
whose keys lack the ``backbone.`` prefix) trains from random weights with
exit code 0 and nothing in the log. Before the runner loads it, this
compares the checkpoint's tensor names and shapes with the model's, logs
how many it found and names what is missing and unexpected, and stops the
run when less than ``load_from_min_match`` of the model (default: half)
would be loaded, unless the config lowers that (``load_from_min_match=0``
allows any partial load).
"""
import re
from typing import Dict, List

import torch

__all__ = [
    'DEFAULT_MIN_MATCH', 'LoadMismatchError', 'load_from_min_match',
    'report_load_from'
]

#: The share of the model's tensors ``load_from`` must fill by default.
DEFAULT_MIN_MATCH = 0.5
_SHOWN = 5


class LoadMismatchError(ValueError):
    """``load_from`` fills less of the model than the config allows."""


def load_from_min_match(cfg) -> float:
    """The config's ``load_from_min_match``, checked: a number in [0, 1]."""
    value = cfg.get('load_from_min_match', DEFAULT_MIN_MATCH)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= 1:
        raise ValueError(
            f'load_from_min_match={value!r}: expected a number from 0 to 1, '
            'the least share of the model\'s tensors load_from must fill '
            f'(default {DEFAULT_MIN_MATCH}; 0 allows any partial load)')
    return float(value)


def _state_dict(path: str) -> Dict[str, torch.Tensor]:
    try:
        ckpt = torch.load(
            path, map_location='cpu', mmap=True, weights_only=True)
    except RuntimeError:  # not a zip file: mmap cannot read it
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    state = ckpt.get('state_dict', ckpt) if isinstance(ckpt, dict) else {}
    # MMEngine's default revise_keys: a DDP-saved 'module.' prefix.
    return {
        re.sub(r'^module\.', '', k): v
        for k, v in state.items() if isinstance(v, torch.Tensor)
    }


def _names(keys: List[str]) -> str:
    shown = ', '.join(keys[:_SHOWN])
    more = len(keys) - _SHOWN
    return shown + (f' and {more} more' if more > 0 else '')


def _likely_cause(found: List[str], wanted: List[str]) -> str:
    prefixes = sorted({k.split('.', 1)[0] for k in found})
    if not found:
        return 'the file holds no tensors'
    if all(not k.startswith(('backbone.', 'decode_head.', 'auxiliary_head.'))
           for k in found) and any(k.startswith('backbone.') for k in wanted):
        return ('its keys have no "backbone." prefix (a backbone-only '
                'checkpoint: convert it, e.g. with '
                'tools/model_converters/internvit2mmseg.py for InternViT, '
                'or load it through the backbone\'s init_cfg=dict('
                'type="Pretrained", checkpoint=...))')
    return (f'it is a checkpoint of another model (its tensors start with '
            f'{", ".join(prefixes[:4])})')


def report_load_from(runner, path: str, min_match: float) -> None:
    """Log what ``path`` fills of ``runner.model``; raise
    :class:`LoadMismatchError` below ``min_match``."""
    model = runner.model
    model = getattr(model, 'module', model)
    if not isinstance(model, torch.nn.Module):
        return  # built later (FlexibleRunner): MMEngine's own report only
    wanted = {k: v.shape for k, v in model.state_dict().items()}
    state = _state_dict(path)
    matched = [k for k in wanted if k in state and state[k].shape == wanted[k]]
    shapes = [k for k in wanted if k in state and state[k].shape != wanted[k]]
    missing = [k for k in wanted if k not in state]
    unexpected = [k for k in state if k not in wanted]
    share = len(matched) / max(len(wanted), 1)
    line = (f'load_from {path}: {len(matched)} of the model\'s '
            f'{len(wanted)} tensors found ({100 * share:.0f}%)')
    details = []
    if missing:
        details.append(f'{len(missing)} missing ({_names(missing)})')
    if shapes:
        details.append(f'{len(shapes)} of another shape ({_names(shapes)})')
    if unexpected:
        details.append(f'{len(unexpected)} unexpected '
                       f'({_names(unexpected)})')
    if details:
        line += '; ' + '; '.join(details)
    if share < min_match:
        raise LoadMismatchError(
            f'{line}. That is less than load_from_min_match='
            f'{min_match:g} of the model; likely cause: '
            f'{_likely_cause(list(state), list(wanted))}. Nothing was '
            'trained. To load it anyway, set load_from_min_match=0 in the '
            'config.')
    from mmengine.dist import is_main_process
    if is_main_process():
        (runner.logger.warning if details else runner.logger.info)(line)
