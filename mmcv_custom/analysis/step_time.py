"""What ``tools/analysis_tools/benchmark_step_time.py`` runs on each
emulated node: the model built from the config, one DDP model per hook,
the timed training steps at every link rate, the buckets' ready times and
the codecs' times (each alone); and what it shows on the console
meanwhile (:class:`ProgressOnly`) or after a failure (:func:`log_tails`).
The report on the results is :mod:`.step_time_report`.

The hooks compared are ``noop`` (a hook that sends nothing) and every
registered hook (:func:`hook_configs`), each with the settings its record
asks benchmarks to use, in one of its forms (``NAME``, ``NAME:flat``,
``NAME:two_level``: see :mod:`.hook_forms`).

A node runs one rank (the node worker itself) or, with several ranks per
node, a torchrun that starts them (:func:`node_command`). Around every
block of timed steps the ranks read their node's link counters
(:mod:`mmcv_custom.launching.emulated_cluster.counters`), so that the
report gives the bytes each node's link carried per step, measured, with
the start-up and warm-up traffic left out.
"""
import copy
import faulthandler
import json
import os
import os.path as osp
import signal
import statistics
import time
from datetime import timedelta

from .hook_forms import form_config, hook_configs, hook_labels

__all__ = [
    'hook_configs', 'hook_labels', 'rate_label', 'progress_steps',
    'ProgressOnly', 'node_command', 'run_on_cluster', 'node_worker',
    'log_tails', 'PROGRESS'
]


def rate_label(mbit):
    """A rate's name in the tables and the JSON: ``'unshaped'`` for None,
    else ``'<mbit> Mbit/s'``."""
    return 'unshaped' if mbit is None else f'{mbit:g} Mbit/s'


#: Marks the node workers' progress lines, the only ones shown on the
#: console (every node's whole output goes to its log file): one per
#: step of :func:`progress_steps`, in its order.
PROGRESS = '[step-time] '

#: Steps before any is timed: PowerSGD compresses from its second step on,
#: and DDP lays its buckets out again after the first.
_WARMUP = 3


# -- the node worker (runs on every emulated node) ---------------------------
def _noop_hook(state, bucket):
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class _Clock:
    """When each bucket reached the ``noop`` hook, from backward's start."""

    def __init__(self, positions):
        self.backward_start = 0.0
        self.ready = {}
        self.bytes = {}
        self.params = {}
        self.positions = positions  # id(parameter) -> its index

    def hook(self, state, bucket):
        self.ready.setdefault(bucket.index(), []).append(time.perf_counter() -
                                                         self.backward_start)
        buffer = bucket.buffer()
        self.bytes[bucket.index()] = buffer.numel() * buffer.element_size()
        self.params[bucket.index()] = [
            dict(
                shape=list(p.shape),
                dtype=str(p.dtype).split('.')[-1],
                index=self.positions[id(p)]) for p in bucket.parameters()
        ]
        return _noop_hook(state, bucket)


def _build(cfg):
    """Model, one batch (already preprocessed) and the optimizer config."""
    import torch
    from mmengine.registry import init_default_scope
    from mmengine.runner import Runner
    from mmengine.utils import import_modules_from_strings
    from mmseg.registry import MODELS

    from mmcv_custom.launching.cpu_start import prepare_launch
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg.custom_imports)
    prepare_launch(cfg, 'none', cuda=False)  # SyncBN -> BN on CPU
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    loader = Runner.build_dataloader(
        copy.deepcopy(cfg.train_dataloader), seed=0)
    batch = next(iter(loader))
    data = model.data_preprocessor(batch, True)
    return model, data


#: The optimizer of a ``comm_only`` run: the config's may name the
#: model's parameters (a layer-decay constructor), which are not there.
_COMM_ONLY_OPTIM = dict(
    type='OptimWrapper', optimizer=dict(type='SGD', lr=0.0))


def _comm_only(model):
    """A stand-in for ``model`` that times the hooks' communication alone:
    its trainable parameters (same shapes, dtypes and order), and a loss
    whose backward only fills their gradients. DDP lays out the same
    buckets, every hook issues the same collectives, and all the buckets
    are ready at once: a step is the hooks' work and their links, not the
    compute that more ranks than cores would starve."""
    import torch
    from torch import nn

    class CommOnly(nn.Module):

        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList(
                nn.Parameter(p.detach().clone()) for p in model.parameters()
                if p.requires_grad)

        def forward(self, *args, mode='loss', **kwargs):
            # Each parameter's own term: its gradient is ready when its
            # term's is, in reverse order (DDP's first layout).
            return dict(
                loss=torch.stack([p.float().sum()
                                  for p in self.weights]).sum())

        @staticmethod
        def parse_losses(losses):
            return losses['loss'], {}

    return CommOnly()


def _ddp_models(model, cfg, spec, group):
    """One DDP model per hook form (a hook is registered once per model),
    each on its own copy of the same weights."""
    from mmengine.optim import build_optim_wrapper
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mmcv_custom.comm.builder import build_comm_hook
    from mmcv_custom.comm.telemetry import CommCounter
    from mmcv_custom.engine.process_group import launcher_claim

    # What torchrun says of this rank's node: 'auto' decides on it, as in
    # a training run (CommHookRegistrationHook).
    claim = launcher_claim()
    out = {}
    for name in spec['hooks']:
        config = form_config(name)
        module = copy.deepcopy(model)
        ddp = DDP(
            module, process_group=group, bucket_cap_mb=spec['bucket_cap_mb'])
        counter = CommCounter()
        clock = None
        if config is None:
            clock = _Clock({
                id(p): i
                for i, p in enumerate(
                    p for p in ddp.module.parameters() if p.requires_grad)
            })
            ddp.register_comm_hook(None, clock.hook)
        else:
            built = build_comm_hook(
                dict(config),
                process_group=group,
                counter=counter,
                node_claim=claim)
            ddp.register_comm_hook(built.state, built.hook)
        optim = build_optim_wrapper(ddp.module,
                                    copy.deepcopy(cfg.optim_wrapper))
        out[name] = dict(ddp=ddp, optim=optim, counter=counter, clock=clock)
    return out


def _auto_model(model, cfg, spec, world_size):
    """A DDP model with ``comm_hook = dict(type='auto')``'s one hook, its
    candidates built as a training run builds them (a two-level form
    where the launcher's node layout allows)."""
    from mmengine.optim import build_optim_wrapper
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mmcv_custom.comm.auto import (AutoDispatch, AutoTrials,
                                       auto_candidates, auto_hook,
                                       build_candidates, check_auto_cfg)
    from mmcv_custom.comm.builder import build_comm_hook
    from mmcv_custom.comm.telemetry import CommCounter
    from mmcv_custom.engine.process_group import launcher_claim

    settings = check_auto_cfg(dict(spec['auto']))
    claim = launcher_claim()
    counter = CommCounter()
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=spec['bucket_cap_mb'])
    kept, specs = build_candidates(
        auto_candidates(settings['max_loss'], names=settings['candidates']),
        lambda config: build_comm_hook(
            config, counter=counter, node_claim=claim))
    trials = AutoTrials(kept, settings,
                        [world_size, claim.local_size if claim else 0])
    dispatch = AutoDispatch(trials, specs)
    ddp.register_comm_hook(dispatch, auto_hook)
    optim = build_optim_wrapper(ddp.module, copy.deepcopy(cfg.optim_wrapper))
    return dict(
        ddp=ddp, optim=optim, counter=counter, clock=None, dispatch=dispatch)


def _auto_block(entry, data, steps):
    """``auto`` at one rate: its trials afresh (untimed), then ``steps``
    timed steps of its choice. Returns ``(times, chosen key)``."""
    dispatch = entry['dispatch']
    dispatch.restart()
    while not dispatch.trials.step_done(_step(entry, data)[0]):
        entry['counter'].pop()
    dispatch.settle()
    times = [_step(entry, data)[0] for _ in range(steps)]
    entry['counter'].pop()
    return times, dispatch.trials.decision.key


def _grad_bytes(model):
    """Bytes of the model's trainable gradients, as DDP hands them over."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.requires_grad)


def _step(entry, data):
    """One training step; its seconds and its backward's."""
    ddp, optim, clock = entry['ddp'], entry['optim'], entry['clock']
    start = time.perf_counter()
    optim.zero_grad()
    losses = ddp(**data, mode='loss')
    loss, _ = ddp.module.parse_losses(losses)
    backward = time.perf_counter()
    if clock is not None:
        clock.backward_start = backward
    loss.backward()
    backward = time.perf_counter() - backward
    optim.step()
    return time.perf_counter() - start, backward


def progress_steps(hooks, rates, rounds, steps, auto_steps=0):
    """What rank 0 of the nodes reports, as ``(what, weight)``: building
    and warming up, every (round, rate) block, the codec timings. A
    weight is the block's training steps (``auto_steps`` more where
    ``comm_hook auto`` decides and runs in each block)."""
    out = [('model built, hooks warmed up', len(hooks) * _WARMUP)]
    out += [(f'round {r + 1}/{rounds}, {rate_label(mbit)}',
             len(hooks) * steps + auto_steps) for r in range(rounds)
            for mbit in rates]
    # A codec pass is about a step's local work: one step a sample.
    out.append(('codec times', len(hooks) * rounds * steps))
    return out


class ProgressOnly:
    """The console side of the nodes' output: their progress lines only,
    as done/total with an ETA (:class:`~mmcv_custom.analysis.Progress`,
    on stderr)."""

    def __init__(self, progress):
        self.progress = progress

    def write(self, line):
        if PROGRESS in line:
            self.progress.advance(line.split(PROGRESS, 1)[1].strip())

    def flush(self):
        pass


def _set_rate(spec, mbit):
    from mmcv_custom.launching.emulated_cluster import shape_links
    shape_links([tuple(link) for link in spec['links']], mbit)


def _codec_times(spec, buckets, rank, world_size):
    """Per hook form, its codec's seconds per step; None where its record
    names no codec (``noop``, ``allreduce``, the PowerSGDs).

    The codec is the record's
    (:attr:`~mmcv_custom.comm.records.HookRecord.codec`: what the hook
    does to every element it sends, with its default settings), run on a
    copy of each of the step's ``buckets`` (their bytes and dtype, as DDP
    handed them over, on ``world_size`` ranks), here and alone: what it
    costs this rank per step, wherever the hook spends it (int8 on its
    communication thread, beside the backward). Timed as it is, not as
    the difference of two training steps, which read 35 ms for
    ``allreduce`` (no codec) and below zero for int8 (its thread hidden
    behind the backward) on a loaded host. The forms take turns, every
    rank at once, each from a fresh copy of the gradients.
    """
    import torch
    import torch.distributed as dist

    from mmcv_custom.comm.builder import hook_record
    runs = {}
    for name in spec['hooks']:
        config = form_config(name)
        codec = config and hook_record(config['type']).codec
        if codec is None:
            continue
        runs[name] = []
        for bucket in buckets:
            dtype = getattr(torch, bucket['params'][0]['dtype'])
            numel = bucket['bytes'] // dtype.itemsize
            source = torch.randn(numel).to(dtype)
            copy = source.clone()
            runs[name].append((source, copy, codec(copy, world_size, rank)))
    times = {name: [] for name in runs}
    for _ in range(spec['rounds'] * spec['steps']):
        for name, passes in runs.items():
            for source, copy, _ in passes:
                copy.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            for _, _, run in passes:
                run()
            times[name].append(time.perf_counter() - start)
    return {
        name: statistics.median(times[name]) if name in times else None
        for name in spec['hooks']
    }


def node_command(script_argv, ranks_per_node):
    """What each emulated node runs: the node worker (``script_argv``, a
    Python file and its arguments) by this interpreter with one rank per
    node; with several, torchrun starting that many of it
    (``--nproc-per-node``), so that the ranks see ``GROUP_RANK``,
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as on a real cluster,
    numbered node by node. A shell expands the node's own ``NODE_RANK``;
    the rendezvous is node 0's address, as for ``tools/dist_train.sh``."""
    import shlex
    import sys
    if ranks_per_node == 1:
        return [sys.executable] + list(script_argv)
    torchrun = shlex.join([sys.executable, '-m', 'torch.distributed.run'])
    return [
        'bash', '-c',
        f'exec {torchrun} --nnodes "$NNODES" --node-rank "$NODE_RANK" '
        f'--nproc-per-node {int(ranks_per_node)} --master-addr '
        '"$MASTER_ADDR" --master-port "$PORT" ' + shlex.join(script_argv)
    ]


def run_on_cluster(cluster, spec, script, work_dir, folder):
    """Run the node worker (``script --node-worker SPEC``) on every node
    of the open ``cluster``, ``cluster.ranks_per_node`` ranks each, with
    ``spec`` (plus the cluster's links, which rank 0 shapes, and where the
    results go, both in ``folder``), its progress on stderr and each
    node's log in ``work_dir``.

    Returns:
        tuple: The :class:`~mmcv_custom.launching.emulated_cluster.RunResult`
        and, when every node ended well, the ranks' results (else None).
    """
    from mmcv_custom.launching.emulated_cluster import run_on_nodes
    from .progress import Progress
    spec = dict(
        spec,
        links=[list(link) for link in cluster.shaped_links],
        out=osp.join(folder, 'results.json'))
    spec_path = osp.join(folder, 'spec.json')
    with open(spec_path, 'w') as f:
        json.dump(spec, f)
    # auto's trials: about four rounds of its four to seven candidates.
    steps = progress_steps(spec['hooks'], spec['rates'], spec['rounds'],
                           spec['steps'],
                           spec['steps'] + 24 if spec.get('auto') else 0)
    with Progress(len(steps), weights=[w for _, w in steps]) as progress:
        result = run_on_nodes(
            cluster,
            node_command([script, '--node-worker', spec_path],
                         cluster.ranks_per_node),
            log_dir=work_dir,
            timeout=spec['timeout'],
            stream=ProgressOnly(progress))
    if result.returncode != 0:
        return result, None
    with open(spec['out']) as f:
        return result, json.load(f)


def _rank_env():
    """``(rank, world size, node, local rank)`` of this rank, from
    torchrun's variables where it started the rank, else from the node's
    (one rank per node, started by the emulated cluster itself)."""
    if 'LOCAL_WORLD_SIZE' in os.environ:
        return (int(os.environ['RANK']), int(os.environ['WORLD_SIZE']),
                int(os.environ['GROUP_RANK']), int(os.environ['LOCAL_RANK']))
    rank = int(os.environ['NODE_RANK'])
    world_size = int(os.environ['NNODES'])
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK='0',
        MASTER_PORT=os.environ['PORT'])
    return rank, world_size, rank, 0


def node_worker(spec_path):
    # Stopped for a timeout (SIGTERM), a node says where it was: every
    # thread's stack goes to its log before it ends.
    faulthandler.register(signal.SIGTERM, chain=True)
    import torch
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    rank, world_size, node, local_rank = _rank_env()
    torch.set_num_threads(spec['threads'])
    dist.init_process_group(
        'gloo',
        init_method='env://',
        timeout=None if spec['timeout'] is None else timedelta(
            seconds=spec['timeout']))
    from mmcv_custom.launching.running import shutdown_distributed

    # Every DDP model lives in _measure's frame and is gone when it
    # returns: see shutdown_distributed for why that must come first.
    result = _measure(spec, rank, world_size)
    result.update(node=node, local_rank=local_rank)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(spec['out'], 'w') as f:
            json.dump(gathered, f)
    dist.barrier()
    shutdown_distributed()


def _measure(spec, rank, world_size):
    """Build, warm up and time every hook at every rate, then the codecs;
    what this node measured."""
    import torch.distributed as dist
    from mmengine.utils import import_modules_from_strings

    from mmcv_custom.launching.running import load_config
    cfg = load_config(spec['config'], spec.get('cfg_options'))
    # The tool's --import (the config's custom_imports: _build's).
    import_modules_from_strings(list(spec.get('imports', ())))
    model, data = _build(cfg)
    if spec.get('comm_only'):
        model = _comm_only(model)
        cfg.optim_wrapper = _COMM_ONLY_OPTIM
    grad_bytes = _grad_bytes(model)
    if spec['bucket_cap_mb'] is None:
        # A sixth of the gradients, for at least 4 buckets.
        spec['bucket_cap_mb'] = round(grad_bytes / 6 / 2**20, 4)
    models = _ddp_models(model, cfg, spec, None)
    auto = None
    if spec.get('auto'):
        auto = _auto_model(model, cfg, spec, world_size)
        auto_steps = {rate_label(mbit): [] for mbit in spec['rates']}
        auto_choices = {rate_label(mbit): [] for mbit in spec['rates']}
    for entry in models.values():
        for _ in range(_WARMUP):
            _step(entry, data)
            entry['counter'].pop()
    if rank == 0:
        print(
            f'{PROGRESS}model built, {len(models)} hooks warmed up',
            flush=True)
    clock = models['noop']['clock']
    clock.ready.clear()

    labels = [rate_label(mbit) for mbit in spec['rates']]
    steps = {label: {name: [] for name in models} for label in labels}
    link = {label: {name: [] for name in models} for label in labels}
    wire = {name: [] for name in models}
    backward = []
    for round_ in range(spec['rounds']):
        for mbit, label in zip(spec['rates'], labels):
            dist.barrier()
            if rank == 0:
                _set_rate(spec, mbit)
            dist.barrier()
            for name, entry in models.items():
                before = _link_bytes()
                for _ in range(spec['steps']):
                    seconds, back = _step(entry, data)
                    steps[label][name].append(seconds)
                    _, sent = entry['counter'].pop()
                    if sent:
                        wire[name].append(sent)
                    if name == 'noop':
                        backward.append(back)
                moved = _link_bytes() - before
                link[label][name].append([moved.tx, moved.rx, moved.payload()])
            if auto is not None:
                times, key = _auto_block(auto, data, spec['steps'])
                auto_steps[label] += times
                auto_choices[label].append(key)
            if rank == 0:
                print(
                    f'{PROGRESS}round {round_ + 1}/{spec["rounds"]}, '
                    f'{label}: ' + ', '.join(
                        f'{n} {statistics.median(t[-spec["steps"]:]):.3f}s'
                        for n, t in steps[label].items()),
                    flush=True)
    if rank == 0:
        _set_rate(spec, None)
    dist.barrier()
    buckets = _bucket_records(clock)
    codec = _codec_times(spec, buckets, rank, world_size)
    if rank == 0:
        print(f'{PROGRESS}codec times', flush=True)
    result = dict(
        rank=rank,
        steps=steps,
        link_bytes=link,
        bucket_cap_mb=spec['bucket_cap_mb'],
        wire_bytes={
            n: max(w) if w else 0
            for n, w in wire.items()
        },
        backward_s=statistics.median(backward),
        buckets=buckets,
        codec_s=codec,
        grad_bytes=grad_bytes)
    if auto is not None:
        result['auto'] = dict(steps=auto_steps, choices=auto_choices)
    return result


def _link_bytes():
    """This node's link counters, read between two barriers: every rank's
    earlier steps are done, and none of the node's ranks (which share the
    counters) sends the next step's bytes before it is read. The
    barriers' own few hundred bytes are counted, the steps' all."""
    import torch.distributed as dist

    from mmcv_custom.launching.emulated_cluster import read_link_bytes
    dist.barrier()
    counters = read_link_bytes(os.environ['GLOO_SOCKET_IFNAME'])
    dist.barrier()
    return counters


def _bucket_records(clock):
    """Each bucket's bytes, median ready time and parameters, in DDP's
    order."""
    return [
        dict(
            index=index,
            bytes=clock.bytes[index],
            ready_s=statistics.median(clock.ready[index]),
            params=clock.params[index]) for index in sorted(clock.ready)
    ]


def log_tails(result, work_dir, lines=15):
    """The end of the failed node's log; after a timeout, of every
    node's (which one is stuck, and where, is the question)."""
    nodes = (
        range(len(result.returncodes))
        if result.failed_node is None else [result.failed_node])
    out = []
    for node in nodes:
        log = osp.join(work_dir, f'node{node}.log')
        try:
            with open(log, errors='replace') as f:
                tail = f.readlines()[-lines:]
        except OSError as e:
            out.append(f'; cannot read {log}: {e.strerror}')
            continue
        out.append(f'; the end of {log}:\n' + ''.join(tail))
    return ''.join(out)
