"""The projection's command-line options, the GPU presets they start from,
and their checks (for ``tools/analysis_tools/comm_cost_model.py``).

A projection is only as good as the hardware it assumes, and a user reads
the result, not the assumptions: ``--gpu`` names a preset (A100, H100,
H200: achieved model FLOP/s, HBM and NVLink rates, memory), every value of
which a flag of its own overrides, and the result's header says which
preset and which overrides it used. Standard library only (and the
accuracy classes).
"""
import argparse
import math
from typing import Dict, NamedTuple, Optional

from mmcv_custom.comm.accuracy import ACCURACY_CLASSES, CLASS_WORDS
from mmcv_custom.comm.periodic_costs import overlap_limit
from .measurements import step_from_log
from .periodic import DEFAULT_PERIODS

__all__ = [
    'GpuPreset', 'GPU_PRESETS', 'PROJECTION_OPTIONS', 'add_projection_options',
    'add_streaming_options', 'check_projection_options', 'describe_hardware'
]


class GpuPreset(NamedTuple):
    """One GPU's figures for the model (per GPU; rates per direction).

    Attributes:
        tflops (float): Achieved model TFLOP/s (bf16, a large ViT's
            training step; well under the dense peak).
        hbm_tbps (float): Effective HBM bandwidth, TB/s (about 90% of the
            peak).
        intra_gbps (float): NVLink rate per GPU and direction, Gbit/s.
        matmul_tflops (float): PowerSGD's thin low-rank products, TFLOP/s
            (far under the peak: they are memory bound).
        source (str): Where the figures come from (the output names the
            preset and its figures; this says why they are what they are).
        memory_gib (float): Its memory, GiB (as ``nvidia-smi`` totals it):
            what the recommendation's candidates must fit in.
    """
    tflops: float
    hbm_tbps: float
    intra_gbps: float
    matmul_tflops: float
    source: str
    memory_gib: float


#: ``--gpu`` presets. The peaks are the vendors' data-sheet figures for
#: the SXM parts; the achieved fractions are assumptions, stated here.
GPU_PRESETS: Dict[str, GpuPreset] = {
    'a100':
    GpuPreset(
        150.0, 2.0, 2400.0, 20.0,
        'A100 SXM 80GB: 312 TFLOP/s bf16 dense peak (about 48% achieved), '
        '2.04 TB/s HBM2e, NVLink 3 600 GB/s (300 GB/s a direction), 80 GiB '
        '(81920 MiB; the A100 40GB: --gpu-mem 40)', 80.0),
    'h100':
    GpuPreset(
        400.0, 3.0, 3600.0, 50.0,
        'H100 SXM: 989 TFLOP/s bf16 dense peak (about 40% achieved), '
        '3.35 TB/s HBM3, NVLink 4 900 GB/s (450 GB/s a direction), 80 GB '
        '(81559 MiB)', 79.6),
    'h200':
    GpuPreset(
        400.0, 4.3, 3600.0, 50.0,
        'H200 SXM: the H100\'s compute (989 TFLOP/s bf16 dense peak, about '
        '40% achieved), 4.8 TB/s HBM3e, NVLink 4 900 GB/s (450 GB/s a '
        'direction), 141 GB (143771 MiB)', 140.4),
}

#: The preset's fields each flag overrides.
_PRESET_FLAGS = {
    '--tflops': 'tflops',
    '--hbm-tbps': 'hbm_tbps',
    '--intra-gbps': 'intra_gbps',
    '--matmul-tflops': 'matmul_tflops',
    '--gpu-mem': 'memory_gib'
}

#: The projection's plain options: (flag, type, default, help). Ints are
#: checked >= 1, floats > 0 (those of ``_AT_LEAST_0`` >= 0); None: from the
#: ``--gpu`` preset (its flags), the config, or estimated.
PROJECTION_OPTIONS = (
    ('--nodes', int, 8, 'nodes (M)'),
    ('--gpus-per-node', int, 8, 'GPUs per node (G)'),
    ('--intra-gbps', float, None, 'intra-node rate per GPU per direction, '
     'Gbit/s (default: the --gpu preset\'s NVLink; 3600 on H100/H200)'),
    ('--intra-alpha-us', float, 2.0, 'latency per message of the two-level '
     'forms\' collectives inside a node, us (default 2, assumed for NCCL '
     'on NVLink)'),
    ('--alpha-us', float, None, 'latency per message, us (default: fitted, '
     'else 10)'),
    ('--eta', float, None, 'achieved fraction of the link rate (default: '
     'fitted, else 0.9)'),
    ('--hbm-tbps', float, None, 'effective HBM bandwidth, TB/s (default: '
     'the --gpu preset\'s)'),
    ('--matmul-tflops', float, None, 'PowerSGD low-rank products, TFLOP/s '
     '(default: the --gpu preset\'s)'),
    ('--backward-s', float, None, 'backward time, s (default: from FLOPs)'),
    ('--compute-step-s', float, None, 'step time without communication, s '
     '(default: from FLOPs)'),
    ('--tokens-per-gpu', float, None, 'tokens per GPU and step (default: '
     'from the config, batch x (img_size / patch_size)^2)'),
    ('--tflops', float, None, 'achieved model FLOP/s per GPU, TFLOP/s '
     '(default: the --gpu preset\'s)'),
    ('--block-size', int, 256, 'int8_compress block size (default 256)'),
    ('--powersgd-rank', int, 1, 'PowerSGD matrix_approximation_rank '
     '(default 1)'),
    ('--min-compression-rate', float, 2.0, 'PowerSGD min_compression_rate '
     '(default 2)'),
    ('--gpu-mem', float, None, 'memory per GPU, GiB, that --recommend\'s '
     'candidates must fit in, activations aside (default: the --gpu '
     'preset\'s: 80 on A100 (the 80GB; 40 for the 40GB), 79.6 on H100, '
     '140.4 on H200)'),
    ('--bucket-cap-mb', float, None, 'DDP bucket_cap_mb (default: the '
     "config's model_wrapper_cfg, else DDP's 25)"),
)
_AT_LEAST_0 = ('--alpha-us', '--intra-alpha-us', '--backward-s',
               '--compute-step-s')


def add_streaming_options(group) -> None:
    """``--fragments`` and ``--overlap``: DiLoCo's streaming settings,
    each value a row of the periodic table at each period and outer format
    (checked by :func:`check_projection_options`)."""
    for flag, what in (('--fragments', 'parts of the slice synchronised at '
                        'staggered steps (default: 1)'),
                       ('--overlap', 'optimizer steps each fragment\'s '
                        'exchange across nodes runs beside (default: 0; '
                        'below period // fragments)')):
        group.add_argument(
            flag,
            nargs='+',
            type=int,
            metavar='N',
            help=f"diloco's streaming form, each a row: {what}")


def add_projection_options(group) -> None:
    """Add the plain options, ``--gpu``, ``--max-loss`` and ``--min-gain``
    to ``group`` (an argparse parser or group)."""
    for flag, kind, default, text in PROJECTION_OPTIONS:
        group.add_argument(flag, type=kind, default=default, help=text)
    group.add_argument(
        '--from-log',
        metavar='LOG',
        help="the compute step measured by a real run: its MMEngine JSON "
        'log (vis_data/TIMESTAMP.json), median time less comm_wait; '
        'instead of --compute-step-s and --backward-s')
    group.add_argument(
        '--gpu',
        choices=sorted(GPU_PRESETS),
        default='h100',
        help='the GPU the figures of --tflops, --hbm-tbps, --intra-gbps and '
        '--matmul-tflops default to (default h100; each flag given '
        'overrides its figure)')
    group.add_argument(
        '--max-loss',
        choices=ACCURACY_CLASSES + ('any', ),
        default='quantized_ef',
        help='the lossiest accuracy class --recommend may name, from the '
        'least lossy: ' + '; '.join(f'{k}: {CLASS_WORDS[k]}'
                                    for k in ACCURACY_CLASSES) +
        '; any: every hook, plugins\' too (default quantized_ef)')
    group.add_argument(
        '--min-gain',
        type=float,
        default=0.1,
        help='the least speed-up, a fraction (0.1: 10%%), for which '
        '--recommend takes a lossier class than exact (default 0.1)')


def check_projection_options(parser: argparse.ArgumentParser,
                             args: argparse.Namespace) -> None:
    """Every number in its range, or a usage error naming it; then fill the
    preset's figures the command line left out, and note which it gave
    (``args.hardware``, see :func:`describe_hardware`)."""
    checked = [('--gbps', float, v) for v in args.gbps]
    checked += [(flag, kind, getattr(args, flag[2:].replace('-', '_')))
                for flag, kind, _, _ in PROJECTION_OPTIONS]
    for option, kind, value in checked:
        if value is None:
            continue
        if kind is int and value < 1:
            parser.error(f'{option} should be an int >= 1, but got {value}')
        low = option in _AT_LEAST_0
        if kind is float and not (math.isfinite(value) and
                                  (value >= 0 if low else value > 0)):
            parser.error(f'{option} should be a number '
                         f'{">=" if low else ">"} 0, but got {value}')
    if args.eta is not None and args.eta > 1:
        parser.error(f'--eta should be a fraction of the link rate, in '
                     f'(0, 1], but got {args.eta}: no link carries more than '
                     'its rate')
    if not (math.isfinite(args.min_gain) and 0 <= args.min_gain < 1):
        parser.error(
            f'--min-gain should be a fraction in [0, 1) (0.1: 10%), but got '
            f'{args.min_gain}' +
            (f'; for {args.min_gain:g}% give {args.min_gain / 100:g}'
             if 1 <= args.min_gain < 100 else ''))
    args.compute_how = None
    if args.from_log is not None:
        given = [
            f for f in ('--backward-s', '--compute-step-s')
            if getattr(args, f[2:].replace('-', '_')) is not None
        ]
        if given:
            parser.error(f'--from-log and {" and ".join(given)} both set the '
                         'compute: give one')
        try:
            logged = step_from_log(args.from_log)
        except ValueError as e:
            parser.error(str(e))
        args.compute_step_s, args.backward_s = (logged.compute_step_s,
                                                logged.backward_s)
        args.compute_how = logged.how
    if (args.backward_s is not None and args.compute_step_s is not None
            and args.compute_step_s < args.backward_s):
        parser.error(f'--compute-step-s {args.compute_step_s} should be at '
                     f'least --backward-s {args.backward_s}: the step '
                     'contains the backward')
    _check_periodic_options(parser, args)
    preset = GPU_PRESETS[args.gpu]
    given = {}
    for flag, field in _PRESET_FLAGS.items():
        attr = flag[2:].replace('-', '_')
        if getattr(args, attr) is None:
            setattr(args, attr, getattr(preset, field))
        else:
            given[flag] = getattr(args, attr)
    args.hardware = describe_hardware(args.gpu, given)


def _check_periodic_options(parser: argparse.ArgumentParser,
                            args: argparse.Namespace) -> None:
    """``--periods`` and ``--fragments`` ints >= 1, ``--overlap`` ints >=
    0 of which one at least is below ``period // fragments`` for some
    period and fragments given (the hook's rule; the others are left out),
    and none of them nor ``--outer-formats`` given where ``--hooks`` leaves
    out every hook they set (never accepted and ignored).
    ``args.periodic_settings``: each periodic hook whose record states a
    cost, with its settings (the tool's)."""
    settings = getattr(args, 'periodic_settings', None) or {}
    for flag, key in (('--periods', 'period'), ('--outer-formats',
                                                'outer_format'),
                      ('--fragments', 'fragments'), ('--overlap', 'overlap')):
        hooks = [name for name, keys in settings.items() if key in keys]
        if (getattr(args, flag[2:].replace('-', '_'), None) is not None
                and args.hooks and not set(hooks) & set(args.hooks)):
            parser.error(f'{flag} sets {" and ".join(hooks)}, but --hooks '
                         f'leaves {"them" if len(hooks) > 1 else "it"} out: '
                         f'add {" or ".join(hooks)} to --hooks, or drop '
                         f'{flag}')
    for period in getattr(args, 'periods', None) or ():
        if period < 1:
            parser.error(f'--periods should be ints >= 1 (optimizer steps '
                         f'between synchronisations), but got {period}')
    fragments = getattr(args, 'fragments', None) or (1, )
    overlap = getattr(args, 'overlap', None) or (0, )
    for n in fragments:
        if n < 1:
            parser.error(f'--fragments should be ints >= 1 (parts of the '
                         f'slice synchronised apart), but got {n}')
    for n in overlap:
        if n < 0:
            parser.error(f'--overlap should be ints >= 0 (optimizer steps a '
                         f'fragment\'s exchange runs beside), but got {n}')
    periods = getattr(args, 'periods', None) or DEFAULT_PERIODS
    if not any(o < overlap_limit(p, f) for p in periods for f in fragments
               for o in overlap):
        parser.error(f'--overlap {" ".join(map(str, overlap))} should be '
                     'below period // fragments for some of --periods '
                     f'{" ".join(map(str, periods))} and --fragments '
                     f'{" ".join(map(str, fragments))}: diloco refuses '
                     'every combination')


def describe_hardware(gpu: str, given: Optional[dict] = None) -> str:
    """One line: the preset, its figures and what the command line
    changed (``given``: flag -> value)."""
    preset = GPU_PRESETS[gpu]
    text = (f'{gpu.upper()} preset (--gpu {gpu}: {preset.tflops:g} TFLOP/s '
            f'achieved, {preset.hbm_tbps:g} TB/s HBM, '
            f'{preset.intra_gbps:g} Gbit/s NVLink a direction, '
            f'{preset.matmul_tflops:g} TFLOP/s for PowerSGD\'s products, '
            f'{preset.memory_gib:g} GiB a GPU)')
    if given:
        text += '; given: ' + ', '.join(f'{flag} {value:g}'
                                        for flag, value in given.items())
    return text
