"""The fit: ``alpha``, ``eta`` and optionally an overhead per hook and
step, as a share of the compute step, by least squares of the relative
error on a chosen subset of a benchmark's link rates, validated on the
others. Standard library only (the simplex search is written out: scipy is
not a dependency)."""
import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .codecs import FittedCodec
from .collectives import Cluster, LinkConstants, traffic
from .measurements import Benchmark
from .overlap import simulate_overlap

__all__ = ['FitPoint', 'FitResult', 'fit', 'fits_on', 'fit_selection_problem']


@dataclasses.dataclass(frozen=True)
class FitPoint:
    """One measured (benchmark, hook, rate) against the fitted model.

    Attributes:
        source (str): The benchmark file.
        world_size (int): Its ranks.
        hook (str): The hook.
        mbit (float): The set rate, Mbit/s.
        measured_s (float): Median step measured.
        predicted_s (float): The model's, with the fitted constants.
        fitted (bool): Whether the fit saw it (else it validates).
    """
    source: str
    world_size: int
    hook: str
    mbit: float
    measured_s: float
    predicted_s: float
    fitted: bool

    @property
    def rel_error(self) -> float:
        """``predicted / measured - 1``."""
        return self.predicted_s / self.measured_s - 1


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What :func:`fit` found.

    Attributes:
        constants (LinkConstants): alpha, eta and each hook's overhead.
        codec (FittedCodec): Each hook's measured codec per byte.
        points (tuple[FitPoint]): Every point, fitted or validating.
        skipped (tuple[str]): What could not be used, and why.
    """
    constants: LinkConstants
    codec: FittedCodec
    points: Tuple[FitPoint, ...]
    skipped: Tuple[str, ...] = ()

    def worst(self, fitted: bool = False) -> Optional[FitPoint]:
        """The point of largest relative error among the validating (or
        the fitted) ones; None if there is none."""
        chosen = [p for p in self.points if p.fitted == fitted]
        return max(chosen, key=lambda p: abs(p.rel_error), default=None)


class _Point:
    """A benchmark point prepared for fast evaluation: per bucket the
    latency steps and the link seconds at eta = 1."""

    def __init__(self, bench: Benchmark, hook: str, mbit: float,
                 measured: float, fitted: bool) -> None:
        self.bench, self.hook, self.mbit = bench, hook, mbit
        self.measured, self.fitted = measured, fitted
        cluster = Cluster(bench.nodes, bench.ranks_per_node, mbit * 1e6)
        entry = bench.hooks[hook]
        per_byte = entry['codec_s'] / bench.grad_bytes
        n = len(bench.bucket_bytes)
        self.messages = [0] * n
        self.seconds = [0.0] * n
        self.codec = [per_byte * b for b in bench.bucket_bytes]
        for c in entry['collectives']:
            load = traffic(c, cluster)
            self.messages[c.bucket] += load.messages
            self.seconds[c.bucket] += load.seconds(cluster)

    def comm_exposed(self, alpha: float, eta: float) -> float:
        busy = [
            m * alpha + s / eta + c
            for m, s, c in zip(self.messages, self.seconds, self.codec)
        ]
        return simulate_overlap(self.bench.ready_s, busy,
                                self.bench.backward_s).exposed_s

    def base(self, alpha: float, eta: float) -> float:
        """The prediction without the hook's overhead."""
        return self.bench.compute_step_s + self.comm_exposed(alpha, eta)

    def predicted(self, alpha: float, eta: float,
                  shares: Mapping[str, float]) -> float:
        return (self.base(alpha, eta) +
                shares.get(self.hook, 0.0) * self.bench.compute_step_s)


def _overheads(points: Sequence[_Point],
               bases: Sequence[float]) -> Dict[str, float]:
    """Each hook's overhead share minimizing the squared relative error of
    its points, given their predictions without it (closed form, weights
    ``1 / measured^2``: the share ``f`` of the compute step ``c`` with
    ``sum w c (measured - base - f c) = 0``), not below 0."""
    sums: Dict[str, List[float]] = {}
    for p, base in zip(points, bases):
        w = 1.0 / p.measured**2
        c = p.bench.compute_step_s
        s = sums.setdefault(p.hook, [0.0, 0.0])
        s[0] += w * c * (p.measured - base)
        s[1] += w * c * c
    return {h: max(0.0, a / b) if b else 0.0 for h, (a, b) in sums.items()}


def _loss(points: Sequence[_Point], alpha: float, eta: float,
          overhead: bool) -> float:
    bases = [p.base(alpha, eta) for p in points]
    shares = _overheads(points, bases) if overhead else {}
    return sum(
        ((b + shares.get(p.hook, 0.0) * p.bench.compute_step_s) / p.measured -
         1)**2 for p, b in zip(points, bases))


# Search bounds: log10(alpha / s), eta.
_LOG_ALPHA = (-8.0, 0.0)
_ETA = (0.02, 2.0)


def _nelder_mead(f,
                 start: Sequence[float],
                 step: Sequence[float],
                 iterations: int = 400,
                 tolerance: float = 1e-12) -> List[float]:
    """Minimize ``f`` from ``start`` by Nelder and Mead's simplex (the
    standard coefficients: reflect 1, expand 2, contract and shrink 1/2).
    Written out because scipy is not a dependency."""
    simplex = [list(start)]
    for i, s in enumerate(step):
        vertex = list(start)
        vertex[i] += s
        simplex.append(vertex)
    values = [f(v) for v in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] <= tolerance * (abs(values[0]) + 1e-30):
            break
        centroid = [
            sum(v[k] for v in simplex[:-1]) / (len(simplex) - 1)
            for k in range(len(start))
        ]

        def toward(t, centroid=centroid):
            return [c + t * (w - c) for c, w in zip(centroid, simplex[-1])]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = ((expanded, fe) if fe < fr else
                                       (reflected, fr))
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5 if fr >= values[-1] else -0.5)
            fc = f(contracted)
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[
                    b + 0.5 * (v - b) for b, v in zip(best, vertex)
                ] for vertex in simplex[1:]]
                values = [values[0]] + [f(v) for v in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def fits_on(bench: Benchmark,
            rate: Mapping,
            fit_rates: Optional[Sequence[float]] = None,
            fit_world_sizes: Optional[Sequence[int]] = None) -> bool:
    """Whether :func:`fit` fits on the hooks ``bench`` measured at
    ``rate`` (one of its ``rates``) with this choice of rates and world
    sizes, rather than validating on them. The unshaped rate (``mbit``
    None) has nothing to fit."""
    return (rate['mbit'] is not None
            and (fit_rates is None or rate['mbit'] in fit_rates) and
            (fit_world_sizes is None or bench.world_size in fit_world_sizes))


def fit_selection_problem(benchmarks: Sequence[Benchmark],
                          fit_rates: Optional[Sequence[float]],
                          fit_world_sizes: Optional[Sequence[int]],
                          files: str) -> Optional[str]:
    """Why :func:`fit` cannot fit on this choice of rates and world sizes
    of ``benchmarks`` (read from ``files``, named in the message); None
    when it can. A rate or world size they did not measure, or nothing
    left to fit on, is named with what was measured."""
    rates = sorted({r for b in benchmarks for r in b.measured_rates})
    for rate in fit_rates or ():
        if rate not in rates:
            return (f'--fit-rates {rate:g} is not a shaped rate of {files}; '
                    'measured: '
                    f'{", ".join(f"{r:g}" for r in rates) or "none"} (Mbit/s)')
    sizes = sorted({b.world_size for b in benchmarks})
    for size in fit_world_sizes or ():
        if size not in sizes:
            return (f'--fit-world-sizes {size} is not a world size of '
                    f'{files}; measured: {", ".join(map(str, sizes))}')
    if not any(
            fits_on(b, r, fit_rates, fit_world_sizes) and any(
                h in b.hooks for h in r['median_step_s']) for b in benchmarks
            for r in b.rates):
        return (f'--fit {files.replace(", ", " ")}: nothing to fit on: no '
                'hook that lists its collectives was measured at a shaped '
                'rate (mbit not null)' +
                (' of the chosen --fit-rates and --fit-world-sizes'
                 if fit_rates or fit_world_sizes else ''))
    return None


def fit(benchmarks: Sequence[Benchmark],
        fit_rates: Optional[Sequence[float]] = None,
        fit_world_sizes: Optional[Sequence[int]] = None,
        overhead: bool = True) -> FitResult:
    """Fit alpha, eta (and each hook's overhead) to measured step times.

    Every hook of every shaped rate of every benchmark is a point: the model
    predicts its step from the benchmark's own buckets, ready times,
    collectives and codec time (no hook catalogue involved), on
    ``Cluster(nodes, ranks_per_node, mbit)``. The fit minimizes the summed
    squared relative error over the chosen points: a coarse grid over
    ``log10(alpha)`` and ``eta``, refined by Nelder-Mead; for given alpha
    and eta the overheads have a closed form. The other points validate.

    Args:
        benchmarks (Sequence[Benchmark]): From :func:`load_benchmark`.
        fit_rates (Sequence[float], optional): Rates (Mbit/s) to fit on.
            Defaults to None: all.
        fit_world_sizes (Sequence[int], optional): World sizes to fit on.
            Defaults to None: all.
        overhead (bool): Fit an overhead per hook and step (a share of
            the compute step). Defaults to True.

    Returns:
        FitResult

    Raises:
        ValueError: No point is left to fit on.
    """
    points, skipped = [], []
    for bench in benchmarks:
        skipped.extend(bench.notes)
        for rate in bench.rates:
            if rate['mbit'] is None:
                skipped.append(f'{bench.source}: the unshaped rate (no link '
                               'rate to model)')
                continue
            for hook, step in rate['median_step_s'].items():
                if hook not in bench.hooks:
                    continue  # 'noop' (the compute reference), or noted
                chosen = fits_on(bench, rate, fit_rates, fit_world_sizes)
                points.append(_Point(bench, hook, rate['mbit'], step, chosen))
    fitting = [p for p in points if p.fitted]
    if not fitting:
        raise ValueError('no measured point to fit on: the rates '
                         f'{list(fit_rates or [])} and world sizes '
                         f'{list(fit_world_sizes or [])} select none')

    def objective(x):
        alpha = 10**min(max(x[0], _LOG_ALPHA[0]), _LOG_ALPHA[1])
        eta = min(max(x[1], _ETA[0]), _ETA[1])
        return _loss(fitting, alpha, eta, overhead)

    grid = [(_LOG_ALPHA[0] + 0.5 * i, _ETA[0] + 0.09 * j) for i in range(17)
            for j in range(23)]
    start = min(grid, key=objective)
    best = _nelder_mead(objective, start, (0.25, 0.045))
    alpha = 10**min(max(best[0], _LOG_ALPHA[0]), _LOG_ALPHA[1])
    eta = min(max(best[1], _ETA[0]), _ETA[1])
    extra = (
        _overheads(fitting, [p.base(alpha, eta)
                             for p in fitting]) if overhead else {})
    sources = sorted({b.source for b in benchmarks})
    constants = LinkConstants(
        alpha, eta, extra, source='fitted to ' + ', '.join(sources))
    codec = FittedCodec({
        h: e['codec_s'] / b.grad_bytes
        for b in benchmarks
        for h, e in b.hooks.items()
    })
    return FitResult(
        constants=constants,
        codec=codec,
        points=tuple(
            FitPoint(p.bench.source, p.bench.world_size, p.hook, p.mbit,
                     p.measured, p.predicted(alpha, eta, extra), p.fitted)
            for p in points),
        skipped=tuple(dict.fromkeys(skipped)))
