"""The cost model of the DDP communication hooks, under its old path.

The code now lives in the package :mod:`mmcv_custom.analysis.cost` (one
module per concern: collectives, buckets, the hook catalogue read from the
hooks' records, overlap, compute, the benchmark JSON, the fit and the
recommendation); this module re-exports its old public names so that
``from mmcv_custom.comm_cost import ...`` keeps working.
"""
from .analysis.cost.buckets import (DTYPE_BYTES, Bucket, MiB, ParamSpec,
                                    ddp_buckets)
from .analysis.cost.codecs import CodecCost, FittedCodec, GpuCodec
from .analysis.cost.collectives import (COLLECTIVE_KINDS,
                                        GPU_CLUSTER_CONSTANTS, Cluster,
                                        Collective, LinkConstants, Traffic,
                                        all_gather_time, all_reduce_time,
                                        all_to_all_time, collective_time,
                                        traffic)
from .analysis.cost.compute import Workload, estimate_compute
from .analysis.cost.fit import FitPoint, FitResult, fit
from .analysis.cost.hooks import (HOOK_COSTS, AllReduceCost,
                                  BatchedPowerSGDCost, HalfPrecisionCost,
                                  HookCost, Int8Cost, PowerSGDCost,
                                  check_benchmark, compare_collectives,
                                  hook_costs, powersgd_compresses)
from .analysis.cost.measurements import Benchmark, load_benchmark
from .analysis.cost.overlap import Overlap, even_ready_times, simulate_overlap
from .analysis.cost.recommend import (Recommendation, StepPrediction,
                                      assumptions, predict_step, recommend)

__all__ = [
    'MiB', 'DTYPE_BYTES', 'COLLECTIVE_KINDS', 'ParamSpec', 'Bucket',
    'Collective', 'Cluster', 'LinkConstants', 'GPU_CLUSTER_CONSTANTS',
    'Traffic', 'traffic', 'collective_time', 'all_reduce_time',
    'all_gather_time', 'all_to_all_time', 'ddp_buckets', 'powersgd_compresses',
    'CodecCost', 'GpuCodec', 'FittedCodec', 'HookCost', 'AllReduceCost',
    'HalfPrecisionCost', 'Int8Cost', 'PowerSGDCost', 'BatchedPowerSGDCost',
    'HOOK_COSTS', 'hook_costs', 'compare_collectives', 'Overlap',
    'simulate_overlap', 'even_ready_times', 'Workload', 'estimate_compute',
    'StepPrediction', 'predict_step', 'Benchmark', 'load_benchmark',
    'check_benchmark', 'FitPoint', 'FitResult', 'fit', 'Recommendation',
    'recommend', 'assumptions'
]
