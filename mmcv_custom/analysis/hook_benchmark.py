"""What ``tools/analysis_tools/benchmark_comm_hooks.py`` measures in each
rank: one DDP backward step per hook on one bucket (its time, its error
against the exact mean, the bytes it hands to its collectives, read from
the profiler), and each hook's codec timed alone against a plain copy.
The report is :mod:`.hook_benchmark_report`.

The hooks compared (:func:`compared_hooks`) are read from the registry
and the records: a hook that sends nothing (``noop``), DDP's built-in
all-reduce, and every registered hook (``ours.<name>_hook``) beside
PyTorch's hook of the same name where ``default_hooks`` has one
(``torch.<name>_hook``). The hooks on PowerSGD's state are left to
``benchmark_step_time.py``: they compress gradient matrices, and the one
flat parameter of a bucket here has none. So are the periodic hooks
(``post_local_sgd``, ``diloco``): their DDP hook carries only the
exchange inside the node, and what they send across the nodes goes every
``period`` optimizer steps after the step, outside any bucket, so a time
per bucket would show neither. A hook's codec
(:attr:`~mmcv_custom.comm.records.HookRecord.codec`) is timed where its
record names one, beside PyTorch's cast to the same half-precision format.
"""
import os
import statistics
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from mmengine.utils import import_modules_from_strings
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mmcv_custom.comm import states  # noqa: F401 (registers the factories)
from mmcv_custom.comm.records import HookRecord
from mmcv_custom.comm.registry import COMM_HOOK_STATES
from mmcv_custom.comm.traffic import COLLECTIVE_KINDS, sent_bytes
from mmcv_custom.hooks import int8_codec
from mmcv_custom.launching.bench_ranks import write_results
from mmcv_custom.launching.running import shutdown_distributed
from .progress import Progress
from .registered import RegisteredHook, registered_hooks

__all__ = [
    'MB', 'INT8_BLOCK', 'Pair', 'compared_hooks', 'pairs', 'codec_columns',
    'worker'
]

MB = 2**20


def _noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _called_through(theirs: Callable) -> Callable:
    """PyTorch's hook ``theirs`` under another name: DDP refuses to register
    its ``bf16_compress_hook`` under its own name off NCCL."""

    def hook(process_group, bucket):
        return theirs(process_group, bucket)

    return hook


def _state_of(name: str) -> Optional[Callable]:
    """What builds the state of the hook registered as ``name``: its state
    factory with its defaults, as a config of its type alone builds it
    (None: it takes the process group)."""
    factory = COMM_HOOK_STATES.module_dict.get(name)
    return None if factory is None else (lambda: factory(None))


#: Blocks of the int8 hook as benchmarked (Int8State's default).
INT8_BLOCK = 256


class Pair(NamedTuple):
    """One of our hooks in the tables, beside PyTorch's of the same name.

    Attributes:
        family (str): The wire format its record names (``'fp16'``,
            ``'bf16'``, ``'int8'``...), or ``'allreduce'`` for a hook that
            sends the gradients' own dtype.
        ours (str): Its name in the results, ``'ours.<name>_hook'``.
        theirs (str, optional): PyTorch's, ``'torch.<name>_hook'``; None:
            ``default_hooks`` has none.
        record (HookRecord): Its record.
        label (str): Its record's label (else its registry name).
        hook (RegisteredHook): Our hook as registered.
    """
    family: str
    ours: str
    theirs: Optional[str]
    record: HookRecord
    label: str
    hook: RegisteredHook


def pairs() -> List[Pair]:
    """Our hooks compared, in the order of registration (and of the step
    table): all but those on PowerSGD's state and the periodic ones (see
    the module's docstring), which one bucket's step cannot show."""
    out = []
    for hook in registered_hooks():
        if hook.record.powersgd_state or hook.record.periodic:
            continue
        twin = f'{hook.name}_hook'
        theirs = f'torch.{twin}' if hasattr(default_hooks, twin) else None
        out.append(
            Pair(hook.record.sent_format or 'allreduce',
                 f'ours.{hook.name}_hook', theirs, hook.record, hook.label,
                 hook))
    return out


def compared_hooks() -> Dict[str, Tuple[Optional[Callable], Any]]:
    """Name -> (hook or None for DDP's built-in all-reduce, state factory
    or None for the process group). Ours are registered as the runner hook
    builds them from a config of their type alone: with a state, which
    keeps the send buffers (and the int8 hook's error feedback) between
    steps. What each of ours sends is read from its record (see
    :func:`pairs`)."""
    out = {'noop': (_noop_hook, None), 'ddp_builtin': (None, None)}
    for pair in pairs():
        if pair.theirs:
            theirs = getattr(default_hooks, pair.theirs[len('torch.'):])
            out[pair.theirs] = (_called_through(theirs), None)
        out[pair.ours] = (pair.hook.hook, _state_of(pair.hook.name))
    return out


def codec_columns() -> List[Tuple[str, str, HookRecord]]:
    """The codec table's columns after the fp32 copy, as ``(key in the
    results, header, record)``: ``ours.<label>`` for each compared hook
    whose record names a codec, then ``torch.<label>``, PyTorch's cast,
    where PyTorch has the same hook and it sends half precision."""
    out = []
    for pair in pairs():
        if pair.record.codec is None:
            continue
        out.append((f'ours.{pair.label}', f'ours {pair.label}', pair.record))
        if pair.theirs and pair.record.sent_dtype is not None:
            out.append(
                (f'torch.{pair.label}', f'PyTorch {pair.label}', pair.record))
    return out


class _OneBucket(nn.Module):
    """One parameter of ``numel`` floats; ``(p * x).sum()`` has gradient x,
    so the backward pass itself costs one elementwise pass."""

    def __init__(self, numel):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(numel))

    def forward(self, x):
        return (self.p * x).sum()


def _planted(rank, numel):
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(
        numel, generator=gen) * 10**torch.randint(
            -3, 3, (numel, ), generator=gen).float()


def _collective(name):
    """Which of the counting rule's collectives
    (:data:`~mmcv_custom.comm.traffic.COLLECTIVE_KINDS`) the profiler
    event ``name`` is, by the start of the name the backend gives it
    (``gloo:all_to_all``, ``nccl:_all_gather_base``, ...), or None (not a
    gloo or NCCL collective that moves gradients)."""
    backend, _, op = name.partition(':')
    if backend not in ('gloo', 'nccl'):
        return None
    op = op.lstrip('_')
    return next((c for c in COLLECTIVE_KINDS if op.startswith(c)), None)


def _wire_bytes(step):
    """Bytes handed to each collective during ``step()``, from the profiler.

    Gloo and NCCL record a collective's input tensor only (not the output
    it writes), so this is what the rank hands over: the tensor of an
    ``all_reduce``, the whole send tensor of an ``all_to_all`` (its own
    segment included), the rank's own part of an ``all_gather``.

    Returns:
        dict: Collective (each of
        :data:`~mmcv_custom.comm.traffic.COLLECTIVE_KINDS`) -> bytes.
    """
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    # The int8 hook issues its collectives on mmcv_custom.hooks.worker's
    # thread, started before the profiler: recorded only when all threads
    # are.
    with profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            experimental_config=_ExperimentalConfig(
                profile_all_threads=True)) as p:
        step()
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for event in p.profiler.kineto_results.events():
        kind = _collective(event.name())
        if kind is None:
            continue
        for shape, dtype in zip(event.shapes(), event.dtypes()):
            numel = 1
            for d in shape:
                numel *= d
            totals[kind] += numel * _DTYPE_SIZES.get(dtype, 4)
    return totals


_DTYPE_SIZES = {
    'float': 4,
    'c10::Half': 2,
    'c10::BFloat16': 2,
    'double': 8,
    'Half': 2,
    'BFloat16': 2,
    'Float': 4,
    'unsigned char': 1,
    'signed char': 1,
    'Byte': 1,
    'Char': 1,
}


def _time_codecs(numel, world_size, device, repeat):
    """Seconds of compress + decompress per method, and of a copy, in
    each of ``repeat`` rounds (after one untimed)."""
    source = torch.randn(numel, device=device)
    buffer = source.clone()
    copy_dst = torch.empty_like(buffer)

    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize()

    def theirs(dt):
        buffer.copy_(buffer.to(dt).div_(world_size))

    methods = {'copy_fp32': lambda: copy_dst.copy_(buffer)}
    for key, _, record in codec_columns():
        if key.startswith('ours.'):
            # What the hook does to every element it sends, with the
            # buffers its state keeps (see HookRecord.codec).
            methods[key] = record.codec(buffer, world_size, dist.get_rank())
        else:
            methods[key] = (lambda dt: lambda: theirs(dt))(record.sent_dtype)
    times = {k: [] for k in methods}
    for _ in range(repeat + 1):
        # Every method divides the buffer by world_size: without a fresh
        # start each round the values would shrink until fp16 flushes them
        # to zero, and the later rounds would time a bucket of zeros.
        buffer.copy_(source)
        for name, fn in methods.items():
            sync()
            # Every rank times the same method at the same moment, so each
            # one meets the same contention for memory from the others.
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {k: v[1:] for k, v in times.items()}


def _progress_steps(args, hooks):
    """The steps rank 0 reports, in order, as ``(note, weight)``: per
    bucket size, each hook's warm-up and measured bytes, each timed round
    (every hook once) and the codec timings. A weight is the step's DDP
    steps (or codec passes) times the bucket's MB, plus 0.1 MB for what
    does not grow with it, so that the ETA counts a 100 MB round as
    such."""
    steps = []
    # The methods _time_codecs times: a copy and the codecs.
    codecs = 1 + len(codec_columns())
    for size_mb in args.sizes_mb:
        cost = size_mb + 0.1
        for name in hooks:
            # The warm-up steps, one to read the error, one profiled.
            steps.append((f'{size_mb:g} MB, {name}: warm-up and bytes',
                          (args.warmup + 2) * cost))
        for i in range(args.repeat):
            steps.append((f'{size_mb:g} MB, round {i + 1}/{args.repeat}',
                          len(hooks) * cost))
        steps.append(
            (f'{size_mb:g} MB, codecs', (args.repeat + 1) * codecs * cost / 2))
    return steps


def worker(rank, world_size, folder, args):
    """One rank of the benchmark (``spawn_ranks`` starts them): every
    bucket size of ``args.sizes_mb``; rank 0 writes the results."""
    # Kineto, under torch.profiler, writes "USDT: ... profiler_start" and
    # "profiler_stop" to stderr on every profiled step; its USDT level is
    # above ERROR, so only level 6 silences it (read when the profiler
    # first starts). A user's own KINETO_LOG_LEVEL wins.
    os.environ.setdefault('KINETO_LOG_LEVEL', '6')
    use_cuda = args.backend == 'nccl'
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device('cuda', rank) if use_cuda else torch.device('cpu')
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.FileStore(os.path.join(folder, 'store'), world_size)
    dist.init_process_group(
        args.backend, store=store, rank=rank, world_size=world_size)
    # Spawned: a plugin's hooks are registered here anew.
    import_modules_from_strings(list(args.imports))
    hooks = compared_hooks()
    steps = _progress_steps(args, hooks)
    # On stderr, from rank 0 only: the tables go to stdout at the end.
    progress = Progress(
        len(steps), weights=[w for _, w in steps], enabled=rank == 0)
    notes = iter(note for note, _ in steps)
    # Each size's DDP models live in _measure_size's frame and are gone
    # when it returns: see shutdown_distributed for why that must come
    # first.
    results = [
        _measure_size(size_mb, rank, world_size, device, args, progress, notes,
                      hooks) for size_mb in args.sizes_mb
    ]
    progress.close()
    if rank == 0:
        write_results(folder, results)
    shutdown_distributed()


def _measure_size(size_mb, rank, world_size, device, args, progress, notes,
                  hooks):
    """Every hook on one bucket of ``size_mb``: its error and bytes,
    then ``args.repeat`` timed rounds and the codecs."""
    use_cuda = device.type == 'cuda'
    numel = int(size_mb * MB) // 4
    x = _planted(rank, numel).to(device)
    exact = torch.stack([
        _planted(r, numel).double() for r in range(world_size)
    ]).mean(0).to(device)
    models = {}
    for name, (hook, make_state) in hooks.items():
        model = nn.parallel.DistributedDataParallel(
            _OneBucket(numel).to(device),
            device_ids=[rank] if use_cuda else None,
            bucket_cap_mb=size_mb * 2 + 1,
            gradient_as_bucket_view=True)
        if hook is not None:
            model.register_comm_hook(
                None if make_state is None else make_state(), hook)
        models[name] = model

    def step(model):
        model.zero_grad(set_to_none=False)
        model(x).backward()
        if use_cuda:
            torch.cuda.synchronize()

    entry = dict(size_mb=size_mb, numel=numel, hooks={})
    for name, model in models.items():
        for _ in range(args.warmup):
            step(model)
        err = (model.module.p.grad.double() - exact)
        counted = _wire_bytes(lambda: step(model))
        # The int8 hook's segments may differ in size between ranks:
        # the most any rank hands over is reported.
        counted = torch.tensor([counted[c] for c in COLLECTIVE_KINDS],
                               dtype=torch.int64,
                               device=device)
        dist.all_reduce(counted, op=dist.ReduceOp.MAX)
        by_collective = dict(zip(COLLECTIVE_KINDS, counted.tolist()))
        entry['hooks'][name] = dict(
            # By the one counting rule, as a training run's comm_MB: the
            # tensor an all-reduce would carry to move the same bytes
            # (int8's all_to_all and all_gather: its quantized bucket
            # about once; an all_gather alone: half what it gathers).
            wire_bytes=int(sent_bytes(by_collective.items(), world_size)),
            wire_bytes_by_collective=by_collective,
            rel_error=float(err.norm() / exact.norm()),
            max_abs_error=float(err.abs().max()),
            times=[])
        progress.advance(next(notes))
    for _ in range(args.repeat):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            step(model)
            # On the rank's device: NCCL reduces no CPU tensor.
            elapsed = torch.tensor([time.perf_counter() - start],
                                   device=device)
            # The slowest rank sets the step time.
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            entry['hooks'][name]['times'].append(float(elapsed))
        progress.advance(next(notes))
    noop = statistics.median(entry['hooks']['noop']['times'])
    for name, data in entry['hooks'].items():
        data['step_s'] = statistics.median(data['times'])
        data['hook_s'] = max(data['step_s'] - noop, 0.0)
    dist.barrier()
    # Each round's, for the verdict's spread, and their medians.
    entry['codec_rounds'] = _time_codecs(numel, world_size, device,
                                         args.repeat)
    entry['codec_s'] = {
        k: statistics.median(v)
        for k, v in entry['codec_rounds'].items()
    }
    progress.advance(next(notes))
    # Asked in the rank, whose thread count decides it.
    entry['int8_c_kernel'] = int8_codec.uses_c_kernel(
        torch.empty(1, device=device), INT8_BLOCK)
    return entry
