"""The sharded (FSDP2) form of a ``comm_hook`` config.

FSDP2 has no DDP communication hooks; the config types whose record has an
FSDP2 form (:attr:`~.records.HookRecord.fsdp2_form`) are carried out by
FSDP2's reduce-scatter (:mod:`mmcv_custom.hooks.sharded`), in two levels
where the record has a two-level form and ``topology`` calls for it
(:class:`~mmcv_custom.hooks.sharded.TwoLevelReduceScatter`; decided as for
DDP, by :func:`~.topology.resolve_topology`).

Under hybrid sharding (``FSDP2Strategy(sharding='hybrid')``) FSDP2
reduce-scatters inside the node in the gradients' dtype, and the config
picks how each shard crosses the nodes (:mod:`mmcv_custom.hooks.hybrid`):
every type with a sharded form runs there, ``int8_compress`` with its error
feedback too (a rank's shard is the same slice at every step, so its
residual is a shard's size); PowerSGD does not (:func:`build_sharded_comm`
says why).
"""
import dataclasses
from types import MappingProxyType
from typing import Any, List, Optional, Tuple, Union

import torch

from ..hooks.topology import NodeClaim
from .accuracy import ACCURACY_CLASSES, class_rank
from .auto import AUTO, AutoCandidate, auto_candidates
from .builder import CommHookConfig, hook_record
from .half_notes import describe_sent_as_they_are
from .records import record_of
from .registry import COMM_HOOKS
from .topology import Topology, resolve_topology

__all__ = [
    'ShardedCommSpec', 'build_sharded_comm', 'sharded_topology',
    'sharded_auto_candidates', 'check_sharded_cfg', 'RESIDUAL_DTYPES'
]

#: ``int8_compress``'s ``residual_dtype`` under hybrid sharding: where its
#: error feedback of each shard is kept.
RESIDUAL_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16}


@dataclasses.dataclass
class ShardedCommSpec:
    """What a ``comm_hook`` config makes FSDP2's reduce-scatter do.

    FSDP2 has no DDP communication hooks; the same config types that have
    a sharded form (``allreduce``, ``fp16_compress``, ``bf16_compress``)
    are carried out by
    :class:`~mmcv_custom.hooks.sharded.AveragingReduceScatter`, and
    ``int8_compress`` with ``error_feedback=False`` by
    :class:`~mmcv_custom.hooks.sharded.Int8ReduceScatter`.

    Attributes:
        type (str): The config name.
        sent_dtype (torch.dtype, optional): What is sent; None for the
            gradients' own dtype (or int8, see ``int8_block_size``).
        notes (tuple[str]): Log warnings, as :class:`CommHookSpec`'s.
        int8_block_size (int, optional): Set for ``int8_compress``: values
            per fp32 scale. Defaults to None.
        topology: The config's ``topology`` (checked), decided at
            registration (:func:`sharded_topology`). Defaults to 'auto'.
        topology_used (str): Flat or two-level, and why, once decided (for
            :meth:`describe`); empty before.
        hybrid (bool): Built for hybrid sharding: the format of the
            cross-node all-reduce of each shard. Defaults to False.
        error_feedback (bool): ``int8_compress``'s under hybrid sharding.
            Defaults to False.
        residual_dtype (torch.dtype): Where that error feedback is kept.
            Defaults to ``torch.float32``.
    """
    type: str
    sent_dtype: Optional[torch.dtype]
    notes: tuple = ()
    state: Any = None  # no DDP-style state (no non-finite records)
    int8_block_size: Optional[int] = None
    topology: Any = 'auto'
    topology_used: str = ''
    hybrid: bool = False
    error_feedback: bool = False
    residual_dtype: Any = torch.float32

    def describe(self) -> str:
        """One line saying what is installed, for the training log."""
        if self.hybrid:
            return self._describe_hybrid()
        where = f', topology: {self.topology_used}' if self.topology_used \
            else ''
        if self.int8_block_size is not None:
            return (f"type='{self.type}' (FSDP2 reduce-scatter in int8, one "
                    f'fp32 scale per {self.int8_block_size} values, no error '
                    f'feedback, averaged before the rounding{where})')
        sent = ('the gradients\' own dtype' if self.sent_dtype is None else
                str(self.sent_dtype).replace('torch.', ''))
        return (f"type='{self.type}' (FSDP2 reduce-scatter in {sent}, "
                f'averaged before the cast{where})')

    def _describe_hybrid(self) -> str:
        if self.int8_block_size is not None:
            sent = (f'int8, one fp32 scale per {self.int8_block_size} '
                    'values, ' +
                    ('with error feedback of each rank\'s shard'
                     if self.error_feedback else 'no error feedback'))
            if self.error_feedback and self.residual_dtype is not (
                    torch.float32):
                sent += ' kept in bf16'
        else:
            sent = ('the gradients\' own dtype' if self.sent_dtype is None else
                    str(self.sent_dtype).replace('torch.', '') +
                    ', averaged before the cast')
        return (f"type='{self.type}' (hybrid sharding: FSDP2 reduce-scatters "
                'inside the node in the gradients\' dtype, then each shard '
                f'crosses the nodes in one all-reduce in {sent}; '
                f'{self.topology_used})')


def build_sharded_comm(cfg: Union[dict, CommHookConfig],
                       param_names: Optional[dict] = None,
                       hybrid: bool = False) -> ShardedCommSpec:
    """The sharded (FSDP2) form of a ``comm_hook`` config.

    Args:
        cfg (dict or CommHookConfig): See :func:`check_sharded_cfg`; a
            config it checked for this sharding (or for full sharding,
            whose forms all run under hybrid sharding too) is not checked
            again.
        param_names (dict, optional): Parameter -> name of the sharded
            model, for ``spec.notes`` (a bf16 backbone under
            ``fp16_compress``). Defaults to None.
        hybrid (bool): The form under hybrid sharding, where the config
            picks the format of the cross-node all-reduce of each shard
            (``int8_compress`` with error feedback runs). Defaults to
            False.

    Raises:
        ValueError: The errors of :func:`check_sharded_cfg`; ``auto``,
            which is not one reduce-scatter.
    """
    checked = _sharded_config(cfg, hybrid)
    hook_type = checked.type
    if hook_type == AUTO:
        raise ValueError(
            f"comm_hook type={hook_type!r} is not one reduce-scatter: the "
            'runner hook tries the allowed ones (sharded_auto_candidates) '
            'and keeps one.')
    if checked.record.fsdp2_form == 'int8_reduce_scatter':
        kwargs = checked.state_kwargs
        feedback = kwargs.get('error_feedback', True)
        return ShardedCommSpec(
            type='int8_compress',
            sent_dtype=None,
            int8_block_size=kwargs.get('block_size', 256),
            topology=checked.topology,
            hybrid=hybrid,
            error_feedback=bool(feedback and hybrid),
            residual_dtype=RESIDUAL_DTYPES[checked.residual_dtype
                                           or 'float32'])
    notes = ()
    if param_names is not None:
        note = describe_sent_as_they_are(checked, checked.base_hook,
                                         param_names)
        notes = (note, ) if note else ()
    return ShardedCommSpec(
        type=hook_type,
        sent_dtype=checked.record.sent_dtype,
        notes=notes,
        topology=checked.topology,
        hybrid=hybrid)


def _sharded_config(cfg: Any, hybrid: bool) -> CommHookConfig:
    """``cfg`` checked for FSDP2 where ``hybrid`` says: as it is where it
    was (or for full sharding, whose forms all run under hybrid too)."""
    if isinstance(cfg, CommHookConfig):
        if cfg.sharding == ('hybrid' if hybrid else
                            'full') or (hybrid and cfg.sharding == 'full'):
            return cfg
        if cfg.sharding is not None:
            cfg = dict(cfg.given)
    return check_sharded_cfg(cfg, hybrid=hybrid)


def _check_sharded_form(checked: CommHookConfig, hybrid: bool) -> None:
    """The FSDP2 form's own rules for a named hook (:func:`check_sharded_cfg`
    says which)."""
    hook_type = checked.type
    what = f'comm_hook type={hook_type!r}'
    record = checked.record
    if record.periodic:
        raise ValueError(_no_periodic_form(hook_type))
    if record.fsdp2_form == 'int8_reduce_scatter':
        _check_sharded_int8(checked, what, hybrid)
        return
    if record.fsdp2_form != 'averaging_reduce_scatter' and hybrid:
        forms = [
            name for name, hook in COMM_HOOKS.module_dict.items()
            if record_of(hook).fsdp2_form is not None
        ]
        raise ValueError(
            f'{what} has no form under hybrid sharding (FSDP2Strategy '
            "sharding='hybrid', or 'auto' on several nodes of several "
            'ranks): there each rank\'s gradient shard, a flat slice of a '
            'unit\'s parameters, crosses the nodes in one all-reduce, and '
            'this hook reduces DDP buckets of whole gradients (PowerSGD '
            'needs their matrices). Use one of '
            f'{", ".join(repr(t) for t in forms)}, or train this hook with '
            'DDP (the default Runner).')
    if record.fsdp2_form != 'averaging_reduce_scatter':
        forms = [
            name for name, hook in COMM_HOOKS.module_dict.items()
            if record_of(hook).fsdp2_form == 'averaging_reduce_scatter'
        ]
        raise ValueError(
            f'{what} has no sharded form: under FSDP2 (FSDP2Strategy) '
            'gradients are reduce-scattered, not all-reduced through DDP '
            'communication hooks. Use one of '
            f'{", ".join(repr(t) for t in forms)}, or train this hook '
            'with DDP (the default Runner).')
    if checked.wrapper is not None:
        raise ValueError(
            f"{what}, wrapper={checked.wrapper!r}: wrappers have no "
            f"sharded form under FSDP2; use type='{checked.wrapper}"
            "_compress' instead.")
    given = {
        k: v
        for k, v in checked.state_kwargs.items()
        if k not in checked.defaults_set and v is not None and v is not False
    }
    if given:
        raise ValueError(
            f'{what}: {", ".join(f"{k}={v!r}" for k, v in given.items())} '
            'is not supported under FSDP2: the sharded form always divides '
            'by the whole world size before the cast (fp16 overflows only '
            'if the mean does) and does not record non-finite buckets. '
            f"Remove it, e.g. comm_hook = dict(type='{hook_type}').")


def _no_periodic_form(hook_type: str) -> str:
    """Why a periodic hook (local SGD, DiLoCo) has no form under FSDP2,
    full or hybrid sharding alike."""
    return (
        f'comm_hook type={hook_type!r} synchronises the model across nodes '
        "every period steps through DDP's buckets and the run's step; FSDP2 "
        '(FSDP2Strategy) shards the parameters, so it has no form of it: '
        'train it with DDP (the default Runner), or use a per-step hook with '
        "a sharded form, such as 'bf16_compress', or 'int8_compress' under "
        'hybrid sharding')


def _refuse_periodic(cfg: Any) -> None:
    """Refuse a periodic type before the DDP checks, which would ask for
    its ``period`` first: no period makes it run under FSDP2. A type the
    registry does not know is left to those checks to name."""
    try:
        record = hook_record(cfg.get('type'))
    except (AttributeError, KeyError, TypeError):
        return
    if record.periodic:
        raise ValueError(_no_periodic_form(cfg['type']))


def sharded_auto_candidates(settings: dict) -> List[AutoCandidate]:
    """``auto``'s candidates (:func:`~.auto.auto_candidates`) that have a
    sharded form under FSDP2: ``allreduce``, the half-precision hooks and
    ``int8_compress`` without error feedback (class ``quantized``), each
    two-level form too.

    Raises:
        ValueError: None of those ``settings`` allows has one, naming the
            candidates that run under FSDP2 and the ``max_loss`` each
            needs (:func:`_no_sharded_candidate`).
    """
    return [candidate for candidate, _ in _sharded_candidates(settings)]


def _sharded_candidates(
        settings: dict) -> List[Tuple[AutoCandidate, CommHookConfig]]:
    """:func:`sharded_auto_candidates`, each with its config as checked
    for full sharding (the forms that run there run under hybrid sharding
    too)."""
    out = _sharded(
        auto_candidates(settings['max_loss'], names=settings['candidates']))
    if not out:
        raise ValueError(_no_sharded_candidate(settings))
    return out


def _sharded(candidates: List[AutoCandidate]) -> list:
    """Those of ``candidates`` that have a sharded form, each with its
    checked config."""
    out = []
    for candidate in candidates:
        try:
            checked = check_sharded_cfg(dict(candidate.config))
        except ValueError:
            continue
        out.append((candidate, checked))
    return out


def _no_sharded_candidate(settings: dict) -> str:
    """Why ``auto`` has nothing to try under FSDP2, and what would: raising
    ``max_loss`` only where one of the named hooks has a sharded form in a
    lossier class (``int8_compress`` without error feedback); else the
    hooks to name instead, with the ``max_loss`` each needs."""
    names, max_loss = settings['candidates'], settings['max_loss']
    runs = [c for c, _ in _sharded(auto_candidates('any', two_level=False))]
    named = [c for c in runs if names is None or c.config['type'] in names]
    what = f'none of {names}' if names else 'no hook'
    allowed = ('at any max_loss'
               if max_loss == 'any' else f'at max_loss={max_loss!r} or below')
    says = [
        f"comm_hook type='auto' under FSDP2 (FSDP2Strategy): {what} runs "
        f'under FSDP2 {allowed}'
    ]
    if named:
        least = min(named, key=lambda c: class_rank(c.klass))
        says.append(f'{least.key} does from max_loss='
                    f'{_max_loss_for(least.klass)!r} on: raise max_loss to '
                    f'{_max_loss_for(least.klass)!r}')
    without = sorted(set(names or ()) - {c.config['type'] for c in named})
    if without:
        says.append(f'{", ".join(without)} ha'
                    f'{"s" if len(without) == 1 else "ve"} no sharded form '
                    'at any max_loss (FSDP2 reduce-scatters; DDP '
                    'communication hooks do not run under it)')
    listing = ', '.join(f'{c.key} (max_loss={_max_loss_for(c.klass)!r})'
                        for c in runs)
    return ('; '.join(says) + '. The candidates that run under FSDP2, with '
            f'the max_loss each needs: {listing}; name those in candidates '
            '(or leave candidates out)')


def _max_loss_for(klass: str) -> str:
    """The least ``max_loss`` that allows a candidate of ``klass``."""
    return klass if klass in ACCURACY_CLASSES else 'any'


def check_sharded_cfg(cfg: Any, hybrid: bool = False) -> CommHookConfig:
    """A ``comm_hook`` config checked for FSDP2, without building anything:
    the checks of :meth:`~.builder.CommHookConfig.check`, then a named type
    needs a sharded form (no ``wrapper``, no CompressState keys, which
    change nothing under FSDP2: ``predivide_factor``, the whole division
    is done before the cast; ``check_finite``), ``auto`` at least one
    allowed candidate with one (:func:`sharded_auto_candidates`, in place
    of the check for DDP, whose advice to raise ``max_loss`` may not help
    here).

    Args:
        cfg (dict or CommHookConfig): The ``comm_hook`` config; one
            checked for DDP gets only the FSDP2 form's checks.
        hybrid (bool): Under hybrid sharding (the form of the cross-node
            all-reduce, where ``int8_compress`` with error feedback runs).
            Defaults to False.

    Returns:
        CommHookConfig: Checked for ``'hybrid'`` or ``'full'`` sharding;
        ``auto``'s with its candidates that run under FSDP2.

    Raises:
        ValueError: A type without a sharded form (PowerSGD, user hooks,
            ``int8_compress`` with error feedback under full sharding; a
            periodic one, ``post_local_sgd`` or ``diloco``, before its
            other keys are checked), or the keys above; besides the errors
            of :func:`~.builder.check_comm_hook_cfg`.
    """
    sharding = 'hybrid' if hybrid else 'full'
    if isinstance(cfg, CommHookConfig):
        checked = cfg
    elif (isinstance(cfg, dict) and cfg.get('type') == AUTO
          and AUTO not in COMM_HOOKS.module_dict):
        # Under hybrid sharding too: the same candidates, each the format
        # of the cross-node all-reduce. Found once, while checking.
        found = []
        checked = CommHookConfig.check(
            cfg, runnable=lambda s: found.extend(_sharded_candidates(s)))
        return dataclasses.replace(
            checked, candidates=tuple(found), sharding=sharding)
    else:
        plain, residual = _hybrid_keys(cfg, hybrid)
        _refuse_periodic(plain)
        checked = dataclasses.replace(
            CommHookConfig.check(plain),
            given=MappingProxyType(dict(cfg)),
            residual_dtype=residual)
    if checked.auto is not None:
        candidates = tuple(_sharded_candidates(checked.auto))
    else:
        _check_sharded_form(checked, hybrid)
        candidates = ()
    return dataclasses.replace(
        checked, candidates=candidates, sharding=sharding)


def sharded_topology(spec: ShardedCommSpec,
                     claim: Optional[NodeClaim] = None,
                     replicas: int = 1) -> Topology:
    """Flat or two-level for ``spec``, decided on every rank together, as
    for DDP (:func:`~.topology.resolve_topology`, over the whole world:
    FSDP2Strategy shards over every rank), and recorded in
    ``spec.topology_used``. Collective, except under hybrid sharding
    (``replicas`` > 1, the nodes FSDP2 replicates across), where the
    reduce-scatter is flat inside the node and FSDP2 all-reduces across
    nodes."""
    if replicas > 1:
        spec.topology_used = (
            f'comm_MB counts that all-reduce across the {replicas} nodes, '
            'not the reduce-scatter inside the node')
        return Topology(None, spec.topology_used)
    topology = resolve_topology(spec.topology, hook_record(spec.type), None,
                                claim)
    spec.topology_used = topology.describe
    return topology


def _hybrid_keys(cfg: Any, hybrid: bool) -> tuple:
    """``(cfg without the keys only hybrid sharding reads, residual_dtype)``:
    ``int8_compress``'s ``residual_dtype``, checked, None when not given.

    Raises:
        ValueError: ``residual_dtype`` is not one of
            :data:`RESIDUAL_DTYPES`, given to another type, or given
            without hybrid sharding (where nothing keeps a shard's
            residual).
    """
    if not isinstance(cfg, dict) or 'residual_dtype' not in cfg:
        return cfg, None
    cfg = dict(cfg)
    residual = cfg.pop('residual_dtype')
    choices = ', '.join(repr(d) for d in RESIDUAL_DTYPES)
    if cfg.get('type') != 'int8_compress':
        raise ValueError(
            f"comm_hook residual_dtype={residual!r} is int8_compress's key "
            f"(its error feedback under hybrid sharding), not type="
            f"{cfg.get('type')!r}'s: remove it")
    if residual not in RESIDUAL_DTYPES:
        raise ValueError(f'comm_hook int8_compress residual_dtype should be '
                         f'one of {choices}, but got {residual!r}')
    if not hybrid:
        raise ValueError(
            f"comm_hook int8_compress residual_dtype={residual!r} is hybrid "
            "sharding's (FSDP2Strategy sharding='hybrid', or 'auto' on "
            'several nodes of several ranks), where the error feedback of '
            "each rank's shard is kept; under full sharding int8 keeps none "
            'and under DDP its residual is fp32. Remove residual_dtype, or '
            'shard hybrid.')
    if cfg.get('error_feedback', True) is False:
        raise ValueError(
            f"comm_hook int8_compress residual_dtype={residual!r} with "
            'error_feedback=False changes nothing: there is no residual. '
            'Remove one of them.')
    return cfg, residual


def _check_sharded_int8(checked: CommHookConfig, what: str,
                        hybrid: bool) -> None:
    """``int8_compress`` under FSDP2: under full sharding only without error
    feedback; under hybrid sharding with it too.

    Under full sharding error feedback would keep, on every rank, what
    rounding dropped from the whole unsharded gradient the rank sends: as
    large as the gradients FSDP2 shards, so it would take back the memory
    FSDP2 saves. Under hybrid sharding what crosses the nodes is the rank's
    own shard, so its residual is a shard's size.
    """
    if checked.wrapper is not None:
        raise ValueError(
            f"{what}, wrapper={checked.wrapper!r}: int8_compress already "
            'quantizes; drop the wrapper.')
    feedback = checked.state_kwargs.get('error_feedback', True)
    if feedback and not hybrid:
        raise ValueError(
            f'{what} with error_feedback=True has no form under full '
            'sharding: there error feedback would keep a full-size, '
            'unsharded residual of the gradients on every rank, the memory '
            'FSDP2 is there to save. Set error_feedback=False (e.g. '
            '--cfg-options comm_hook.error_feedback=False) to reduce-scatter '
            "in int8 without it, use type='bf16_compress', or shard hybrid "
            "(strategy.sharding='hybrid' on several nodes), where the "
            "residual is of the rank's shard only.")
