"""One hook's step on a cluster (:func:`predict_step`), every hook's and
the pick (:func:`recommend`), and the model's assumptions in words."""
import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mmcv_custom.comm.accuracy import (CLASS_WORDS, check_class,
                                       choose_by_class, class_rank)
from mmcv_custom.comm.traffic import reduced_bytes
from .buckets import Bucket, ParamSpec, ddp_buckets
from .checks import require_positive
from .codecs import CodecCost, GpuCodec
from .collectives import (GPU_CLUSTER_CONSTANTS, Cluster, LinkConstants,
                          group_size, traffic)
from .compute import Workload, estimate_compute
from .hooks import HookCost, hook_costs
from .memory import GiB, GpuMemory
from .overlap import even_ready_times, simulate_overlap
from .periodic import NO_SYNC

__all__ = [
    'StepPrediction', 'predict_step', 'Recommendation', 'recommend',
    'assumptions', 'SAME_SPEED'
]

#: The model's resolution, as a fraction of a step: two forms whose steps
#: differ by at most this are the same speed to it, and of two such forms
#: of one accuracy class the one that keeps less memory per GPU is picked.
SAME_SPEED = 0.01


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """One hook's predicted step on one cluster.

    Attributes:
        hook (str): Its name.
        label (str): With its settings (e.g. ``powerSGD (rank 1)``).
        step_s (float): ``compute_step_s * (1 + overhead_share) +
            exposed_s``.
        exposed_s (float): Communication not hidden by the backward.
        compute_step_s (float): The step without communication.
        comm_s (float): All buckets' communication, back to back (codec
            included).
        codec_s (float): The codec's part of ``comm_s``.
        wire_s (float): Bytes through the busiest link over its rate, with
            no latency and ``eta = 1``.
        overlap_bound_s (float): The exposed time with ``alpha = 0``,
            ``eta = 1`` and no codec: what no implementation beats on
            these links with this bucket order.
        sent_bytes (float): What the run's ``comm_MB`` counts per step
            (:class:`~mmcv_custom.comm.telemetry.CommCounter`'s
            ``bytes_sent``; ``comm_MB`` is it over ``2**20``): by the one
            counting rule, :func:`mmcv_custom.comm.traffic.sent_bytes`,
            the size of the tensors an all-reduce would carry to move the
            same bytes (all-reduced tensors as they are, an all-to-all
            and an all-gather by what they move against an all-reduce:
            int8's pair about its quantized bucket once). A two-level form
            counts what crosses nodes only, as its ``comm_MB`` does: its
            ``'cross'`` collectives, among one rank of each node (what
            stays inside the node is in neither; where the ranks' shares
            differ a little, int8's largest and PowerSGD's mean).
        node_bytes (float): Bytes through each node link per direction.
        collectives (int): Collectives per step.
        form (str): ``'flat'`` or ``'two-level'``
            (:data:`~.hooks.FORMS`), ``'hybrid'`` (hybrid sharding's,
            :class:`~.hybrid.HybridCost`) or ``'periodic'``
            (:class:`~.periodic.PeriodicHookCost`). Defaults to ``'flat'``.
        sync_s (float): A periodic hook's synchronisation across nodes,
            once every ``period`` steps after the optimizer step; every
            other field is per step averaged over the period, its share
            (``sync_s / period``, and its bytes') included, nothing of it
            hidden by the backward (``exposed_s`` holds it; its
            few collectives are left out of ``collectives``). Defaults to
            0: none. In the streaming form, one fragment's exposed time
            (what ``overlap`` steps do not hide).
        period (int): Steps between synchronisations. Defaults to 1.
        syncs (int): Synchronisations a period (``fragments``). Defaults
            to 1.
    """
    hook: str
    label: str
    step_s: float
    exposed_s: float
    compute_step_s: float
    comm_s: float
    codec_s: float
    wire_s: float
    overlap_bound_s: float
    sent_bytes: float
    node_bytes: float
    collectives: int
    form: str = 'flat'
    sync_s: float = 0.0
    period: int = 1
    syncs: int = 1

    @property
    def sync_step_s(self) -> float:
        """The step that synchronises (:attr:`syncs` in :attr:`period`,
        the worst): :attr:`step_s` with one whole synchronisation instead
        of the period's share."""
        return self.step_s + self.sync_s * (1 - self.syncs / self.period)

    @classmethod
    def of(cls, hook: HookCost, constants: LinkConstants,
           compute_step_s: float, exposed_s: float,
           **fields) -> 'StepPrediction':
        """``hook``'s prediction: its step is ``compute_step_s``, the
        exposed time and the hook's fitted overhead (a share of the compute
        step); ``fields``, the rest."""
        overhead = constants.overhead_share.get(hook.name,
                                                0.0) * compute_step_s
        return cls(
            hook=hook.name,
            label=hook.label(),
            step_s=compute_step_s + exposed_s + overhead,
            exposed_s=exposed_s,
            compute_step_s=compute_step_s,
            form=hook.form,
            **fields)


def predict_step(hook: HookCost,
                 buckets: Sequence[Bucket],
                 cluster: Cluster,
                 backward_s: float,
                 compute_step_s: float,
                 constants: LinkConstants = GPU_CLUSTER_CONSTANTS,
                 codec: Optional[CodecCost] = None,
                 ready_s: Optional[Sequence[float]] = None) -> StepPrediction:
    """``hook``'s step time on ``cluster``.

    Args:
        hook (HookCost): The hook.
        buckets (Sequence[Bucket]): DDP's buckets (:func:`ddp_buckets`).
        cluster (Cluster): Nodes and links.
        backward_s (float): The backward pass.
        compute_step_s (float): The whole step without communication.
        constants (LinkConstants): alpha, eta and overheads. Defaults to
            :data:`GPU_CLUSTER_CONSTANTS`.
        codec (CodecCost, optional): Defaults to :class:`GpuCodec`'s
            defaults.
        ready_s (Sequence[float], optional): When each bucket is ready.
            Defaults to :func:`even_ready_times`.

    Returns:
        StepPrediction
    """
    require_positive('backward_s', backward_s, allow_zero=True)
    require_positive('compute_step_s', compute_step_s, allow_zero=True)
    codec = GpuCodec() if codec is None else codec
    if ready_s is None:
        ready_s = even_ready_times(buckets, backward_s)
    per_bucket = hook.collectives(buckets, cluster.world_size)
    busy, bound, codec_total, wire = [], [], 0.0, 0.0
    sent = node = 0.0
    # A periodic hook's synchronisation: after the optimizer step, every
    # period steps (per_period of them, a fragment each, in the streaming
    # form), so its share of a step is exposed, less what the overlap hides.
    sync = hook.synchronisation(buckets, cluster, constants, codec)
    period = 1 if sync is None else hook.period
    sync = NO_SYNC if sync is None else sync
    syncs = sync.per_period
    for bucket, collectives in zip(buckets, per_bucket):
        loads = [traffic(c, cluster) for c in collectives]
        local = codec.seconds(hook, bucket, cluster.world_size)
        link = sum(
            t.seconds(cluster, constants.alpha_s, constants.eta,
                      constants.intra_alpha_s) for t in loads)
        ideal = sum(t.seconds(cluster) for t in loads)
        busy.append(link + local)
        bound.append(ideal)
        codec_total += local
        wire += ideal
        node += sum(t.node_bytes for t in loads)
        # As the run's comm_MB: inside the node, nothing is counted.
        sent += sum(
            reduced_bytes(c.kind, c.nbytes, group_size(c, cluster))
            for c in collectives if c.level != 'intra')
    inner = simulate_overlap(ready_s, busy, backward_s).exposed_s
    # The step's own time (compute, overhead and the inner exchange): what
    # an overlapped exchange across nodes runs beside, a step at a time.
    own = compute_step_s * (
        1 + constants.overhead_share.get(hook.name, 0.0)) + inner
    exposed = sync.exposed_s(own)
    return StepPrediction.of(
        hook,
        constants,
        compute_step_s,
        inner + exposed * syncs / period,
        comm_s=sum(busy) + sync.seconds * syncs / period,
        codec_s=codec_total + sync.codec_s * syncs / period,
        wire_s=wire + sync.wire_s * syncs / period,
        overlap_bound_s=simulate_overlap(ready_s, bound, backward_s).exposed_s
        + sync.exposed_wire_s(own) * syncs / period,
        sent_bytes=sent + sync.sent_bytes * syncs / period,
        node_bytes=node + sync.node_bytes * syncs / period,
        collectives=sum(len(c) for c in per_bucket),
        sync_s=exposed,
        period=period,
        syncs=syncs)


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """Every hook's predicted step on one cluster, and the pick.

    The pick (:attr:`best`) is not simply the fastest hook: a hook of a
    lossier accuracy class (:mod:`mmcv_custom.comm.accuracy`) is taken
    only where the user accepts that class (``max_loss``) and where it is
    at least ``min_gain`` faster than the pick of the classes below it,
    starting from the exact ``allreduce``. So a 1% saving never trades
    exactness for rounding, nor rounding for a low-rank approximation.
    Within a class, forms whose steps are the fastest's within
    :data:`SAME_SPEED` (the model's resolution) are the same speed, and the
    one that keeps the least memory per GPU is taken (e.g. int8 with its
    error feedback in bf16 under hybrid sharding, as fast as in fp32 with
    half the residual).

    Attributes:
        cluster (Cluster): The cluster.
        predictions (dict): Hook key (:attr:`HookCost.key`: the name, or
            ``'NAME (two-level)'`` for a hook's two-level form) ->
            :class:`StepPrediction`, in :func:`hook_costs`' order, each
            hook's two-level form after its flat one.
        hooks (dict): Hook key -> its :class:`HookCost`.
        max_loss (str): The lossiest class weighed (one of
            :data:`~mmcv_custom.comm.accuracy.ACCURACY_CLASSES`, or
            ``'any'``). Defaults to ``'quantized_ef'``.
        min_gain (float): The least speed-up, as a fraction (0.1: 10%),
            for which a lossier class is taken. Defaults to 0.1.
        memory (dict): Hook key -> its
            :class:`~.memory.GpuMemory` per GPU. Defaults to empty: not
            counted.
        gpu_bytes (float, optional): The memory of a GPU: only hooks whose
            memory is known and fits are weighed (:meth:`fits`). Defaults
            to None: every hook is.
        reference (str): The key the speed-ups are against. Defaults to
            ``'allreduce'`` (under hybrid sharding, ``'allreduce
            (hybrid)'``).
        sharding (str, optional): Under FSDP2, the sharding the config
            runs (``'full'`` or ``'hybrid'``): a pick under the other one
            names the strategy line that sets it (:meth:`config_lines`).
            Defaults to None: DDP.
    """
    cluster: Cluster
    predictions: Mapping[str, StepPrediction]
    hooks: Mapping[str, HookCost]
    max_loss: str = 'quantized_ef'
    min_gain: float = 0.1
    memory: Mapping[str, GpuMemory] = dataclasses.field(default_factory=dict)
    gpu_bytes: Optional[float] = None
    reference: str = 'allreduce'
    sharding: Optional[str] = None

    def fits(self, hook: str) -> bool:
        """Whether ``hook`` (a key) fits the GPU, activations aside: True
        without a GPU's memory; False where its memory is unknown."""
        if self.gpu_bytes is None:
            return True
        memory = self.memory.get(hook)
        return memory is not None and bool(memory.fits(self.gpu_bytes))

    @property
    def _fitting(self) -> List[str]:
        return [h for h in self.predictions if self.fits(h)]

    def _rank(self, hook: str):
        # Where steps tie (fp16 and bf16 send the same), the hook whose
        # format does not overflow first.
        return (self.predictions[hook].step_s,
                getattr(self.hooks[hook], 'overflows', False))

    def klass(self, hook: str) -> str:
        """The accuracy class of ``hook`` (a key)."""
        return self.hooks[hook].accuracy.klass

    @property
    def fastest(self) -> str:
        """The fastest hook that fits, whatever its class."""
        return min(self._fitting, key=self._rank, default=None)

    @property
    def allowed(self) -> List[str]:
        """The hooks of ``max_loss``'s class or below."""
        limit = class_rank(self.max_loss)
        return [h for h in self._fitting if class_rank(self.klass(h)) <= limit]

    def _steps(self) -> List[Tuple[str, Optional[str]]]:
        """From the least lossy class up, the fastest allowed hook of each
        class and, where it is not taken, why (the rule is
        :func:`~mmcv_custom.comm.accuracy.choose_by_class`)."""
        steps: List[Tuple[str, Optional[str]]] = []
        pick = None
        for step in choose_by_class(
            {h: self.predictions[h].step_s
             for h in self._fitting},
            {h: self.klass(h)
             for h in self._fitting},
                self.max_loss,
                self.min_gain,
                tie=lambda h: getattr(self.hooks[h], 'overflows', False)):
            why, key = None, self._leanest(step.key)
            if not step.taken:
                why = (f'{self.predictions[key].label} '
                       f'({_class_name(self.klass(key))})'
                       f' would gain {step.gain:.0%} over '
                       f'{self.predictions[pick].label}, under the '
                       f'{self.min_gain:.0%} asked for')
            else:
                pick = key
            steps.append((key, why))
        return steps

    def _total(self, hook: str) -> Optional[int]:
        memory = self.memory.get(hook)
        return None if memory is None else memory.total

    def _same_speed(self, hook: str) -> List[str]:
        """The fitting forms of ``hook``'s class (``hook`` among them)
        whose steps are within :data:`SAME_SPEED` of ``hook``'s, the
        fastest of its class."""
        step = self.predictions[hook].step_s
        return [
            h for h in self._fitting if self.klass(h) == self.klass(hook)
            and self.predictions[h].step_s <= step * (1 + SAME_SPEED)
        ]

    def _leanest(self, hook: str) -> str:
        """Of the forms as fast as ``hook`` (:meth:`_same_speed`), the one
        that keeps the least memory per GPU; ``hook`` itself where none
        keeps less, or its memory is unknown."""
        held = self._total(hook)
        for other in self._same_speed(hook):
            total = self._total(other)
            if held is not None and total is not None and total < held:
                hook, held = other, total
        return hook

    def _lean_note(self, best: str) -> str:
        """Where the pick is not the fastest of its class: as fast, and
        how much less it keeps per GPU."""
        fastest = min(
            (h for h in self._fitting if self.klass(h) == self.klass(best)),
            key=self._rank)
        if fastest == best:
            return ''
        less = self._total(fastest) - self._total(best)
        return (f', the same speed as {self.predictions[fastest].label} '
                f'({self.predictions[fastest].step_s:.3f} s, within the '
                f'model\'s {SAME_SPEED:.0%}) with {less / GiB:.2f} GiB less '
                'per GPU')

    @property
    def best(self) -> Optional[str]:
        """The pick: see the class docstring (None: no hook allowed)."""
        return next((h for h, why in reversed(self._steps()) if why is None),
                    None)

    @property
    def best_lossless(self) -> Optional[str]:
        """The fastest hook that does not approximate the average."""
        lossless = [h for h in self._fitting if self.hooks[h].lossless]
        return min(lossless, key=self._rank, default=None)

    def speedup(self, hook: str) -> Optional[float]:
        """The reference's step (``allreduce``'s) over ``hook``'s; None
        without it."""
        if self.reference not in self.predictions:
            return None
        return (self.predictions[self.reference].step_s /
                self.predictions[hook].step_s)

    def config(self, key: str) -> str:
        """The config line that runs the hook (and form) of ``key``.

        A hook with a two-level form runs it by default on several nodes
        of several ranks (``topology='auto'``), so its flat form there
        needs ``topology='flat'``; other hooks need no ``topology``.
        """
        hook = self.hooks[key]
        keys = dict(type=hook.name, **hook.config_keys())
        if hook.form == 'two-level':
            keys['topology'] = 'auto'
        elif _runs_two_level(hook, self.cluster):
            keys['topology'] = 'flat'
        return 'comm_hook = dict(' + ', '.join(f'{k}={v!r}'
                                               for k, v in keys.items()) + ')'

    def config_lines(self, key: str) -> List[str]:
        """The config lines that run ``key``: its ``comm_hook`` line
        (:meth:`config`), after the strategy line where it runs under
        another sharding than the config's (e.g. ``strategy =
        dict(type='FSDP2Strategy', sharding='hybrid')``)."""
        lines = [self.config(key)]
        sharding = getattr(self.hooks[key], 'sharding', None)
        if self.sharding is not None and sharding not in (None, self.sharding):
            lines.insert(
                0, "strategy = dict(type='FSDP2Strategy', "
                f'sharding={sharding!r})')
        return lines

    def line(self) -> str:
        """One line: the hook (and form) to use, what it saves, its class,
        its caveat, its evidence and the config that sets it; why a lossier
        hook was not taken; the fastest hook where the pick is not."""
        rate = f'{self.cluster.link_bps / 1e9:g} Gbit/s'
        best = self.best
        if best is None:
            return (
                f'{rate}: no hook of class {self.max_loss!r} or below '
                'has a cost to project' +
                (' and fits the GPU.' if self.gpu_bytes is not None else '.'))
        chosen = self.predictions[best]
        text = f'{rate}: use {chosen.label}: {chosen.step_s:.3f} s per step'
        if chosen.period > 1:
            text += (f' on average (the step that synchronises, '
                     f'{"one" if chosen.syncs == 1 else chosen.syncs} in '
                     f'{chosen.period}, {chosen.sync_step_s:.3f} s)')
        if self.reference in self.predictions and best != self.reference:
            ref = self.predictions[self.reference]
            text += (f' against {ref.step_s:.3f} s with {ref.label} (saves '
                     f'{ref.step_s - chosen.step_s:.3f} s, '
                     f'{self.speedup(best):.2f}x)')
        memory = self.memory.get(best)
        if memory is not None and memory.total is not None:
            text += f'; {memory.total / GiB:.2f} GiB per GPU'
            if self.gpu_bytes is not None:
                text += (f', {(self.gpu_bytes - memory.total) / GiB:.2f} GiB '
                         'left for activations')
            text += self._lean_note(best)
        accuracy = self.hooks[best].accuracy
        text += (f'; {CLASS_WORDS[accuracy.klass]}: '
                 f'{self.hooks[best].caveat}; ' +
                 ' and '.join(f'`{x}`' for x in self.config_lines(best)) + '.')
        text += (f' Evidence: {accuracy.evidence}.' if accuracy.evidence else
                 ' Evidence: none recorded for this hook.')
        for _, why in self._steps():
            if why is not None:
                text += f' Not taken: {why}.'
        fastest = self.fastest
        if fastest is not None and fastest not in self.allowed:
            klass = self.klass(fastest)
            text += (f' Fastest of all: {self.predictions[fastest].label} at '
                     f'{self.predictions[fastest].step_s:.3f} s, '
                     f'{_class_name(klass)}, beyond '
                     f'--max-loss {self.max_loss}.')
        return text


def _class_name(klass: str) -> str:
    """A class in a few words: its :data:`CLASS_WORDS` without the
    explanation in brackets (e.g. ``'low rank'``)."""
    return CLASS_WORDS[klass].split(' (')[0]


def _runs_two_level(hook: HookCost, cluster: Cluster) -> bool:
    """Whether ``hook`` runs a two-level form on ``cluster`` by default
    (``topology='auto'``): it has one, and there are several nodes of
    several ranks."""
    return (cluster.nodes > 1 and cluster.gpus_per_node > 1 and hook.two_level(
        cluster.gpus_per_node, cluster.nodes) is not None)


def _forms(hooks: Mapping[str, HookCost],
           cluster: Cluster) -> Dict[str, HookCost]:
    """Every hook's flat form and, where it runs one on ``cluster``, its
    two-level form after it, keyed by :attr:`HookCost.key`."""
    out: Dict[str, HookCost] = {}
    for hook in hooks.values():
        out[hook.key] = hook
        if hook.form == 'flat' and _runs_two_level(hook, cluster):
            two = hook.two_level(cluster.gpus_per_node, cluster.nodes)
            out[two.key] = two
    return out


def recommend(params: Sequence[ParamSpec],
              cluster: Cluster,
              backward_s: Optional[float] = None,
              compute_step_s: Optional[float] = None,
              constants: LinkConstants = GPU_CLUSTER_CONSTANTS,
              codec: Optional[CodecCost] = None,
              hooks: Optional[Mapping[str, HookCost]] = None,
              workload: Workload = Workload(),
              total_params: Optional[int] = None,
              bucket_cap_mb: Optional[float] = None,
              max_loss: str = 'quantized_ef',
              min_gain: float = 0.1,
              forward_flops: Optional[float] = None) -> Recommendation:
    """Predict every hook's step on ``cluster`` and pick one (see
    :class:`Recommendation`).

    Args:
        params (Sequence[ParamSpec]): Trainable parameters, model order.
        cluster (Cluster): Nodes, GPUs per node, link rates.
        backward_s (float, optional): Measured or given backward time.
            Defaults to None: :func:`estimate_compute` from ``workload``.
        compute_step_s (float, optional): The step without communication.
            Defaults to None: estimated (given a ``backward_s``, the
            estimate's forward and optimizer are added to it).
        constants (LinkConstants): Defaults to
            :data:`GPU_CLUSTER_CONSTANTS`.
        codec (CodecCost, optional): Defaults to :class:`GpuCodec`'s
            defaults.
        hooks (Mapping[str, HookCost], optional): Defaults to
            :func:`~.hooks.hook_costs`' defaults (every registered hook
            whose record states a cost). Each hook with a two-level form
            is weighed in both forms where the cluster has several nodes
            of several GPUs (elsewhere the hooks run flat).
        workload (Workload): For the estimates. Defaults to InternViT-6B's
            recipe.
        total_params (int, optional): All parameters, for the FLOPs.
        bucket_cap_mb (float, optional): DDP's. Defaults to DDP's default.
        max_loss (str): The lossiest accuracy class to weigh, or ``'any'``.
            Defaults to ``'quantized_ef'``.
        min_gain (float): The least speed-up (a fraction) a lossier class
            must bring. Defaults to 0.1.
        forward_flops (float, optional): The model's forward FLOPs per GPU
            and step, for the estimates. Defaults to None: ``2 N T``.

    Returns:
        Recommendation

    Raises:
        ValueError: ``max_loss`` names no class, or ``min_gain`` < 0.
    """
    check_class(max_loss)
    require_positive(
        'min_gain (a fraction: 0.1 is 10%)', min_gain, allow_zero=True)
    codec = GpuCodec() if codec is None else codec
    hooks = hook_costs() if hooks is None else hooks
    hbm = codec.hbm_Bps if isinstance(codec, GpuCodec) else GpuCodec().hbm_Bps
    est_backward, est_step = estimate_compute(params, workload, total_params,
                                              hbm, forward_flops)
    if backward_s is None:
        backward_s = est_backward
    if compute_step_s is None:
        compute_step_s = est_step - est_backward + backward_s
    buckets = ddp_buckets(params, bucket_cap_mb)
    forms = _forms(hooks, cluster)
    return Recommendation(
        cluster=cluster,
        predictions={
            key:
            predict_step(hook, buckets, cluster, backward_s, compute_step_s,
                         constants, codec)
            for key, hook in forms.items()
        },
        hooks=forms,
        max_loss=max_loss,
        min_gain=min_gain)


def assumptions(constants: LinkConstants,
                codec: CodecCost,
                cluster: Optional[Cluster] = None) -> List[str]:
    """The model's assumptions, one sentence each, for the output."""
    out = [
        f'link constants: alpha {constants.alpha_s * 1e6:.3g} us per '
        f'message, eta {constants.eta:.3g} of the link rate '
        f'({constants.source})',
        'flat forms: rings for all_reduce and all_gather (one node-link '
        'crossing per node and direction); a flat all_to_all for int8, whose '
        'G ranks per node all push their off-node shares through the node '
        'link',
        'two-level forms (topology=\'auto\', on several nodes of several '
        'GPUs): collectives inside the node at the intra-node rate and '
        f'latency ({constants.intra_alpha_s * 1e6:.3g} us per message, '
        'assumed), those across nodes among the G groups of one local rank '
        'at once, sharing the node link (G times what one rank sends); a '
        'bucket\'s levels one after the other, not pipelined with the next '
        'bucket\'s',
        'no propagation delay: the emulated links measured none, so alpha '
        'holds only the software latency; long-haul links add their own',
        codec.describe(),
        'one link, first in first out: each bucket communicates after it is '
        'ready and the previous bucket is done; its codec on a stream of its '
        'own, beside the backward',
        'steady state: DDP\'s rebuilt buckets (reverse parameter order), '
        'PowerSGD after its warm-up; empty collectives cost nothing',
        'latency as ring steps (2 (P - 1) alpha an all_reduce); NCCL '
        'switches to trees (about 2 log2 P steps) for small messages, so '
        'the many small collectives of PowerSGD may cost less than shown',
    ]
    if cluster is not None:
        out.insert(
            1, f'{cluster.nodes} nodes x {cluster.gpus_per_node} '
            f'GPUs, intra-node {cluster.intra_bps / 8e9:g} GB/s '
            'per GPU per direction')
    return out
