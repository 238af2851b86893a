"""A cost model of the DDP communication hooks, to project step times.

We measure a real training step per hook on a few emulated nodes (network
namespaces joined by veth, each node's link shaped to a rate by tc), but
want the step time on a GPU cluster of other sizes and link rates. This
package is the bridge: an alpha-beta model of the collectives each hook
issues, fitted to the measurement, and a simulation of how each bucket's
communication overlaps the backward pass. A model is a list of
:class:`ParamSpec` (shapes and dtypes), so a projection needs no
measurement of the model projected to.

Modules, one concern each (only :mod:`.hooks`, :mod:`.recommend`,
:mod:`.fsdp2`, :mod:`.hybrid`, :mod:`.periodic`, :mod:`.model` and
:mod:`.report` reach torch, through the hooks' records or the model):

* :mod:`.buckets`: :class:`ParamSpec`, :class:`Bucket`, :func:`ddp_buckets`;
* :mod:`.collectives`: the formulas below, :class:`Cluster`,
  :class:`LinkConstants`;
* :mod:`.codecs`: the codec's cost, :class:`GpuCodec`, :class:`FittedCodec`;
* :mod:`.hooks`: the catalogue, read from the hooks' records;
* :mod:`.overlap`: :func:`simulate_overlap`;
* :mod:`.compute`: :func:`estimate_compute`;
* :mod:`.measurements`: the benchmark JSON, :func:`load_benchmark`; a
  run's own step from its log, :func:`step_from_log`;
* :mod:`.fit`: :func:`fit`;
* :mod:`.recommend`: :func:`predict_step`, :func:`recommend`;
* :mod:`.fsdp2`: a config that trains with FSDP2, modelled as FSDP2
  (per unit, parameter all-gathers and a reduce-scatter in the hook's
  format, beside the compute), sharded over every rank;
* :mod:`.hybrid`: FSDP2's hybrid sharding (gathers and reduce-scatters
  inside the node, each rank's shard all-reduced across nodes in the
  hook's format), and both shardings weighed: :func:`recommend_sharded`;
* :mod:`.periodic`: the periodic hooks (``post_local_sgd``, ``diloco``):
  the inner hook's exchange inside the node every step, and the model
  across nodes every ``period`` steps, after the optimizer step:
  :func:`periodic_costs`;
* :mod:`.model`: a config's parameters, its model built on the meta device;
* :mod:`.report`: the tables ``tools/analysis_tools/comm_cost_model.py``
  prints.

**Collectives** on ``M`` nodes of ``G`` ranks (``P = M * G``), each node
link carrying ``B`` bits/s per direction, intra-node links ``B_in`` per
GPU, ``alpha`` seconds per message and an achieved fraction ``eta`` of
every rate (:func:`collective_time`):

* ring ``all_reduce`` of ``S`` bytes: ``2 (P - 1) alpha + 2 (P - 1) / P *
  S / (eta B)``. A flat ring crosses each node link once per direction, so
  the node link carries what one ring edge does; on one node (``M == 1``)
  the edges are intra-node and ``B_in`` sets the time;
* ``all_gather``, each rank contributing ``s`` bytes (``S = P s``):
  ``(P - 1) alpha + (P - 1) / P * S / (eta B)``;
* ``reduce_scatter`` of an ``S``-byte input (FSDP2's): a ring, ``(P - 1)
  alpha + (P - 1) / P * S / (eta B)``, half an all-reduce;
* ``all_to_all``, each rank sending ``S`` bytes (``S / P`` to every rank):
  ``(P - 1) alpha + G (M - 1) / M * S / (eta B)`` plus ``(G - 1) / P * S
  / (eta B_in)`` inside the node. Unlike a ring, nothing is reduced on the
  way: all ``G`` ranks of a node push their off-node shares through the one
  node link. With ``G`` GPUs per node the flat all-to-all of
  ``int8_compress`` therefore costs about ``G`` times a ring
  reduce-scatter across nodes, and int8's advantage shrinks on multi-GPU
  nodes, to a loss at ``G = 8`` against a 2-byte all-reduce: what the
  two-level forms fix.

With ``G = 1`` (the emulated nodes) ``B_in`` does not matter.

**Two-level forms** (the hooks' ``topology='auto'`` on ``M > 1`` nodes of
``G > 1`` ranks; :class:`TwoLevelRecordCost`): each collective carries its
level (:data:`LEVELS`). One ``'intra'`` runs among a node's ``G`` ranks on
the GPU links: a ring of ``G`` as above with ``B_in`` and the intra-node
latency ``alpha_in`` (:attr:`LinkConstants.intra_alpha_s`, assumed), and
no node-link bytes. One ``'cross'`` runs among the ``M`` ranks of one
local rank, one per node; the node's ``G`` such groups run at once and
share its link, which carries ``G`` times what one member sends (an
all-reduce of ``s`` bytes: ``G * 2 (M - 1) / M * s``), with ``2 (M - 1)``
steps of ``alpha``, not ``2 (P - 1)``. So a two-level hook that
compresses only across nodes sends its compressed ``1 / G`` share per rank
through the node link, ``G`` of them: the compressed bucket about once,
where the flat all-to-all sent it ``G`` times. A bucket's levels run one
after the other (no pipelining with the next bucket's); the codec counts
the hook's work on its ``1 / G`` share plus the full-bucket sums and
copies.

**Hooks** (:func:`hook_costs`, one :class:`HookCost` per registered hook
whose :class:`~mmcv_custom.comm.records.HookRecord` states a ``cost``):
what each sends for a bucket layout on a world size (:func:`ddp_buckets`
lays parameters out as DDP does) and what its local work (the codec) costs
on a GPU, as memory passes over HBM plus matmul FLOPs (:class:`GpuCodec`),
or as measured seconds per gradient byte (:class:`FittedCodec`). What a
step sends is counted by one rule,
:func:`mmcv_custom.comm.traffic.sent_bytes`.

**Overlap** (:func:`simulate_overlap`): bucket ``i`` becomes ready at
``ready_s[i]`` in the backward; its communication (codec included: it runs
on a stream or thread of its own, beside the backward) starts when it is
ready and the previous bucket's has finished (one link, first in first
out, in DDP's order). What runs past the end of the backward is exposed::

    step = compute_step + max(0, finish of the last bucket - backward)

**Fit** (:func:`fit`): ``alpha``, ``eta`` and optionally an overhead per
hook and step, as a share of the compute step, by least squares of the
relative error on a chosen subset of a benchmark's link rates, validated
on the others.

**Recommendation** (:func:`recommend`): per hook, the step on a cluster,
the speed-up against ``allreduce`` and the fastest hook, with its accuracy
caveats; only hooks whose memory per GPU (:mod:`.memory`: parameters,
gradients, AdamW, DDP's buckets and the hook's state) fits the GPU.

Example:
    >>> from mmcv_custom.analysis.cost import (Cluster, ParamSpec, recommend)
    >>> params = [ParamSpec((4096, 4096), 'bfloat16')] * 100
    >>> rec = recommend(params, Cluster(8, 8, 100e9), backward_s=0.2,
    ...                 compute_step_s=0.35)
    >>> rec.best  # doctest: +SKIP
    'powerSGD'
"""
from .buckets import DTYPE_BYTES, Bucket, MiB, ParamSpec, ddp_buckets
from .codecs import CodecCost, FittedCodec, GpuCodec
from .collectives import (COLLECTIVE_KINDS, GPU_CLUSTER_CONSTANTS, LEVELS,
                          Cluster, Collective, LinkConstants, Traffic,
                          all_gather_time, all_reduce_time, all_to_all_time,
                          collective_time, group_size, traffic)
from .compute import Workload, estimate_compute
from .fit import FitPoint, FitResult, fit, fit_selection_problem, fits_on
from .fsdp2 import (ShardedCost, ShardUnit, predict_sharded_step, shard_units,
                    sharded_costs, simulate_sharded)
from .hooks import (FORMS, HOOK_COSTS, AllReduceCost, BatchedPowerSGDCost,
                    HalfPrecisionCost, HookCost, Int8Cost, PowerSGDCost,
                    RecordCost, TwoLevelRecordCost, check_benchmark,
                    compare_collectives, hook_costs, powersgd_compresses,
                    uncosted_hooks)
from .hybrid import (HybridCost, config_sharding, hybrid_costs,
                     hybrid_state_bytes, recommend_sharded)
from .measurements import Benchmark, LoggedStep, load_benchmark, step_from_log
from .memory import (GiB, GpuMemory, ddp_memory, hook_memory, hook_state_bytes,
                     hybrid_memory, sharded_memory)
from .model import config_params
from .overlap import Overlap, even_ready_times, simulate_overlap
from .periodic import DEFAULT_PERIODS, PeriodicHookCost, Sync, periodic_costs
from .recommend import (SAME_SPEED, Recommendation, StepPrediction,
                        assumptions, predict_step, recommend)
from .report import ProjectionSettings, fit_json, fit_report, project

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
    'check_benchmark', 'FitPoint', 'FitResult', 'fit', 'fits_on',
    'fit_selection_problem', 'Recommendation', 'recommend', 'assumptions',
    'RecordCost', 'uncosted_hooks', 'config_params', 'ProjectionSettings',
    'project', 'fit_report', 'fit_json', 'LEVELS', 'FORMS', 'group_size',
    'TwoLevelRecordCost', 'LoggedStep', 'step_from_log', 'ShardUnit',
    'ShardedCost', 'sharded_costs', 'shard_units', 'predict_sharded_step',
    'recommend_sharded', 'simulate_sharded', 'GiB', 'GpuMemory',
    'hook_state_bytes', 'ddp_memory', 'sharded_memory', 'hook_memory',
    'hybrid_memory', 'HybridCost', 'hybrid_costs', 'config_sharding',
    'hybrid_state_bytes', 'SAME_SPEED', 'PeriodicHookCost', 'Sync',
    'periodic_costs', 'DEFAULT_PERIODS'
]
