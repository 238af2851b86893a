"""``post_local_sgd`` and ``diloco`` as ``comm_hook`` types: their settings
checked at start, and their node groups and inner exchanges built.

A config::

    comm_hook = dict(type='diloco', period=25,
                     inner=dict(type='bf16_compress'),   # inside the node
                     outer_lr=0.7, outer_momentum=0.9,    # Nesterov SGD
                     outer_format='int8')                 # across nodes

The math is in :mod:`mmcv_custom.hooks.local_sgd`; the run's side (the
step after each optimizer step, the buffers, the telemetry) in
:mod:`mmcv_custom.engine.periodic_sync`.
"""
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..hooks.local_sgd import (OUTER_FORMATS, PERIODIC_ALGORITHMS, DiLoCoState,
                               InnerExchange, LocalSGDState, PeriodicState)
from ..hooks.topology import (NodeClaim, agree_on_layout, blocks_layout,
                              check_stated_layout, make_node_groups)
from ..hooks.validation import (require_bool, require_int, require_real,
                                with_args_check)
from .periodic_costs import overlap_limit
from .registry import COMM_HOOK_STATES
from .telemetry import CommCounter

__all__ = [
    'MAX_OUTER_LR', 'check_inner', 'prepare_periodic', 'periodic_layout_error',
    'periodic_ranks_per_node'
]

#: Beyond it the outer step moves the model further past the nodes' average
#: than the average is from where it started (with momentum, more).
MAX_OUTER_LR = 2.0


def check_inner(inner: Any) -> dict:
    """The config of the exchange inside the node, refused where no hook
    that runs every step over the node's ranks could carry it: not a dict,
    ``auto``, a periodic type, or a ``topology`` of its own. The builder
    checks the rest as any ``comm_hook`` config
    (:attr:`~.builder.CommHookConfig.inner`).

    Raises:
        TypeError, ValueError: Saying which, and what would run.
    """
    runnable = ("a per-step hook such as dict(type='allreduce'), "
                "dict(type='bf16_compress') or dict(type='int8_compress')")
    if not isinstance(inner, dict):
        raise TypeError(f'inner should be {runnable} (the exchange inside '
                        f'each node), but got {type(inner).__name__}: '
                        f'{inner!r}')
    kind = inner.get('type')
    if kind == 'auto' or kind in PERIODIC_ALGORITHMS:
        raise ValueError(
            f'type={kind!r} cannot carry the exchange inside the node (it '
            f'is not one hook that runs every step); give {runnable}')
    if kind == 'fp16_compress' and inner.get('check_finite', True):
        raise ValueError(
            "fp16_compress's range guard (check_finite) stops the run when "
            'an average is not finite, and between synchronisations each '
            'node averages alone: one node would stop without the others. '
            "Give check_finite=False, or use dict(type='bf16_compress')")
    if 'topology' in inner:
        raise ValueError(
            'it takes no topology: it runs inside the node; give the layout '
            'as comm_hook topology=dict(ranks_per_node=N), not inner '
            f'topology={inner["topology"]!r}')
    return dict(inner)


def _check_common(hook_type: str, args: dict) -> None:
    if 'period' in args:  # else the builder names it missing
        require_int('period', args['period'], minimum=1)
    require_int('start_iter', args['start_iter'], minimum=0)
    # None: the default; the builder checks a dict.
    if args['inner'] is not None and not isinstance(args['inner'], dict):
        check_inner(args['inner'])


def _check_local_sgd_args(args: dict) -> None:
    _check_common('post_local_sgd', args)
    levels = args['group_periods']
    if levels is None:
        return
    shape = ('group_periods should be a dict {period: nodes} of shorter '
             'periods, each averaging within groups of that many nodes '
             '(e.g. {4: 2} with period=16)')
    if not isinstance(levels, dict) or not levels:
        raise TypeError(f'{shape}, but got {levels!r}')
    for p, nodes in levels.items():
        require_int(f'group_periods key (a period) {p!r}', p, minimum=1)
        require_int(f'group_periods[{p}] (nodes)', nodes, minimum=2)
        if 'period' in args and (p >= args['period'] or args['period'] % p):
            raise ValueError(f'{shape}: its period {p} should divide period='
                             f"{args['period']} and be shorter")


def _check_diloco_args(args: dict) -> None:
    _check_common('diloco', args)
    require_real('outer_lr', args['outer_lr'], minimum=0, inclusive=False)
    if args['outer_lr'] > MAX_OUTER_LR:
        raise ValueError(
            f'outer_lr should be in (0, {MAX_OUTER_LR}] (the paper uses 0.7; '
            f'1 with outer_momentum=0 averages the nodes), but got '
            f'{args["outer_lr"]!r}')
    require_real('outer_momentum', args['outer_momentum'], minimum=0)
    if args['outer_momentum'] >= 1:
        raise ValueError('outer_momentum should be in [0, 1) (the paper '
                         f'uses 0.9), but got {args["outer_momentum"]!r}')
    require_bool('nesterov', args['nesterov'])
    fmt = args['outer_format']
    if fmt not in OUTER_FORMATS:
        raise ValueError(f'outer_format should be one of '
                         f'{", ".join(map(repr, OUTER_FORMATS))}, but got '
                         f'{fmt!r}')
    for key in ('block_size', 'error_feedback'):
        if args[key] is not None and fmt != 'int8':
            raise ValueError(
                f"{key} applies to outer_format='int8' only, but "
                f'outer_format={fmt!r}: remove {key}, or send int8')
    if args['block_size'] is not None:
        require_int('block_size', args['block_size'], minimum=1)
    if args['error_feedback'] is not None:
        require_bool('error_feedback', args['error_feedback'])
    _check_streaming(args)


def _check_streaming(args: dict) -> None:
    """The streaming form's keys: each fragment needs its own step of
    the period, and its exchange must be applied before the next
    fragment's place."""
    require_int('fragments', args['fragments'], minimum=1)
    require_int('overlap', args['overlap'], minimum=0)
    period = args.get('period')
    if isinstance(period, int) and args['fragments'] > period:
        raise ValueError(
            f"fragments should be at most period={period} (each fragment "
            f"synchronises at its own step of the period), but got "
            f"{args['fragments']}")
    limit = (
        overlap_limit(period, args['fragments'])
        if isinstance(period, int) else None)
    if limit is not None and args['overlap'] and args['overlap'] >= limit:
        raise ValueError(
            f"overlap should be below period // fragments = {limit} (a "
            "fragment's exchange is applied before the next fragment's "
            f"place), but got {args['overlap']}")
    if args['mix'] is None:
        return
    require_real('mix', args['mix'], minimum=0)
    if args['mix'] >= 1:
        raise ValueError('mix should be in [0, 1) (the share of the local '
                         f'values kept; the paper uses 0.5), but got '
                         f"{args['mix']!r}")
    if not args['overlap']:
        raise ValueError('mix applies with overlap > 0 only (without it '
                         'the fragment takes the global values as they '
                         'are): remove mix, or give overlap')


@COMM_HOOK_STATES.register_module(name='post_local_sgd')
@with_args_check(_check_local_sgd_args)
def _local_sgd_state(process_group: Optional[dist.ProcessGroup],
                     period: int,
                     start_iter: int = 0,
                     inner: dict = None,
                     group_periods: Optional[dict] = None) -> LocalSGDState:
    """Gradients over the world for ``start_iter`` steps, then inside the
    node through ``inner`` (default ``allreduce``); parameters averaged
    across nodes every ``period`` steps (and within groups of nodes at the
    ``group_periods``)."""
    return LocalSGDState(process_group, period, start_iter, group_periods)


@COMM_HOOK_STATES.register_module(name='diloco')
@with_args_check(_check_diloco_args)
def _diloco_state(process_group: Optional[dist.ProcessGroup],
                  period: int,
                  start_iter: int = 0,
                  inner: dict = None,
                  outer_lr: float = 0.7,
                  outer_momentum: float = 0.9,
                  nesterov: bool = True,
                  outer_format: str = 'int8',
                  block_size: Optional[int] = None,
                  error_feedback: Optional[bool] = None,
                  fragments: int = 1,
                  overlap: int = 0,
                  mix: Optional[float] = None) -> DiLoCoState:
    """The config's optimizer inside the node through ``inner`` (default
    ``allreduce``); every ``period`` steps the pseudo-gradient averaged
    across nodes in ``outer_format`` and applied by Nesterov SGD
    (``outer_lr``, ``outer_momentum``: the paper's 0.7 and 0.9); in
    ``fragments`` at staggered steps, each exchange ``overlap`` steps
    beside the training and mixed in by ``mix`` (0.5), the streaming
    form."""
    return DiLoCoState(
        process_group,
        period,
        start_iter,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        outer_format=outer_format,
        block_size=256 if block_size is None else block_size,
        error_feedback=True if error_feedback is None else error_feedback,
        fragments=fragments,
        overlap=overlap,
        mix=0.5 if mix is None else mix)


_PERIOD_HELP = ('the optimizer steps between synchronisations across '
                'nodes, an int >= 1 (e.g. period=25)')
_local_sgd_state.required_keys = {'period': _PERIOD_HELP}
_diloco_state.required_keys = {'period': _PERIOD_HELP}


def _one_node_error(layout) -> str:
    return (f'comm_hook post_local_sgd on one node ({layout.describe()}) '
            'averages nothing across nodes: the gradients of every step '
            'are averaged over all ranks already, so it would be plain DDP '
            'with redundant parameter averaging. Use the inner hook itself '
            "(e.g. comm_hook = dict(type='allreduce')) on one node")


def _stated_or_launched(checked, world_size: int, launched):
    """The layout ``checked`` states (``topology=dict(ranks_per_node=N)``,
    checked against the launcher's), else the launcher's (None: unknown).
    Raises the ``ValueError`` of a layout that cannot hold."""
    if not isinstance(checked.topology, dict):
        return launched
    stated = blocks_layout(world_size, checked.topology['ranks_per_node'])
    check_stated_layout(stated, launched)
    return stated


def periodic_layout_error(checked, world_size: int, launched) -> Optional[str]:
    """Why ``checked`` (a periodic config) cannot run on ``world_size``
    ranks that the launcher placed as ``launched`` (None: unknown), or
    None: the layout it states does not divide the world or contradicts
    the launcher, or ``post_local_sgd`` would run on one node. The
    preflight and :func:`prepare_periodic` both ask it."""
    try:
        layout = _stated_or_launched(checked, world_size, launched)
    except (TypeError, ValueError) as e:
        return f'comm_hook {checked.type}: {e}'
    if (checked.type == 'post_local_sgd' and layout is not None
            and layout.num_nodes == 1):
        return _one_node_error(layout)
    return None


def periodic_ranks_per_node(checked, world_size: int, launched) -> int:
    """The ranks of a node ``checked`` (a periodic config) would run with
    on ``world_size`` ranks the launcher placed as ``launched``: each
    keeps the slice of DiLoCo's state that is its share of the node. 1
    where the layout is unknown or cannot hold (the larger state; the
    layout's problem is :func:`periodic_layout_error`'s to say)."""
    try:
        layout = _stated_or_launched(checked, world_size, launched)
    except (TypeError, ValueError):
        return 1
    return 1 if layout is None else layout.ranks_per_node


def _level_groups(layout, levels: dict) -> dict:
    """For each group size of ``group_periods``, this rank's peers of the
    same place on its group of consecutive nodes, and every rank of those
    nodes (collective: every rank makes every group, in one order)."""
    me = dist.get_rank()
    out = {}
    for p, size in levels.items():
        if size >= layout.num_nodes or layout.num_nodes % size:
            raise ValueError(
                f'comm_hook post_local_sgd group_periods={{{p}: {size}}}: '
                f'groups of {size} nodes should divide the '
                f'{layout.num_nodes} nodes into several whole groups '
                f'({layout.describe()})')
        if size in out:
            continue
        for first in range(0, layout.num_nodes, size):
            block = [sorted(node) for node in layout.nodes[first:first + size]]
            for place in range(layout.ranks_per_node):
                peers = dist.new_group([node[place] for node in block])
                if me in [node[place] for node in block]:
                    mine_peers = peers
            every = dist.new_group(sorted(r for node in block for r in node))
            if any(me in node for node in block):
                mine_every = every
        out[size] = (mine_peers, mine_every)
    return out


def _inner_exchange(checked, group, device, param_names,
                    build: Callable) -> InnerExchange:
    counter = CommCounter()
    spec = build(
        checked,
        process_group=group,
        device=device,
        counter=counter,
        param_names=param_names)

    def pop_sent():
        _, sent = counter.pop()
        return 0 if sent is None else sent

    return InnerExchange(spec.hook, spec.state, dist.get_world_size(group),
                         pop_sent if counter.bytes_sent_known else None,
                         spec.state_keeper)


def prepare_periodic(state: PeriodicState, checked,
                     process_group: Optional[dist.ProcessGroup],
                     device: Optional[torch.device], param_names,
                     claim: Optional[NodeClaim], build: Callable) -> str:
    """Give ``state`` its node groups and inner exchanges, built by
    ``build`` (:func:`~.builder.build_comm_hook`) from ``checked.inner``.
    Collective: every rank calls it with the same config. Returns what the
    log line says of the layout.

    Raises:
        ValueError: The DDP model reduces over a subgroup; the layout is
            unknown or contradicts the launcher; ``post_local_sgd`` on one
            node (it would be DDP with redundant averaging).
    """
    hook_type = checked.type
    if not dist.is_initialized() or (process_group is not None
                                     and dist.get_world_size(process_group)
                                     != dist.get_world_size()):
        raise ValueError(
            f'comm_hook {hook_type} needs the DDP model to reduce over every '
            'rank of an initialised process group')
    world_size = dist.get_world_size()
    launched, why = agree_on_layout(claim)
    error = periodic_layout_error(checked, world_size, launched)
    if error:
        raise ValueError(error)
    layout = _stated_or_launched(checked, world_size, launched)
    if layout is None:
        raise ValueError(
            f'comm_hook {hook_type} needs to know which ranks share a node, '
            f'but {why}: state it with comm_hook topology=dict('
            'ranks_per_node=N)')
    state.set_groups(make_node_groups(layout))
    levels = getattr(state, 'group_periods', {})
    if levels:
        state.set_level_groups(_level_groups(layout, levels))
    inner = checked.inner
    if layout.ranks_per_node > 1:
        state.intra_inner = _inner_exchange(inner, state.groups.intra, device,
                                            param_names, build)
    if state.start_iter > 0:
        state.world_inner = _inner_exchange(inner, process_group, device,
                                            param_names, build)
    where = (f'{inner.type} inside each node of {layout.ranks_per_node} '
             'ranks' if layout.ranks_per_node > 1 else
             'no exchange inside the node (one rank a node)')
    warm = (f', {inner.type} over all ranks for the first '
            f'{state.start_iter} steps' if state.start_iter else '')
    return f'{layout.describe()}; {where}{warm}'
