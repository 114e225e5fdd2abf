"""The search behind ``tessera tune``: time every candidate interleaved, keep the default unless beaten beyond noise.

Timing on a shared machine (a compiler or another benchmark on the same cores) drifts by tens of percent within
seconds. Three things keep the choice robust to that:

- **Interleaving**: every round times each candidate once, in an order rotated from round to round, so drift moves
  all candidates alike (the same idea as :mod:`tessera.bench.harness`, which interleaves two calls; here there are
  up to ten).
- **Medians and quartiles** of the rounds, not means or minimums: one disturbed round moves neither.
- **Load is recorded**: the fraction of the CPUs other processes used during each search is stored with its result
  (``others_busy``). Interleaving cancels drift but not a steady neighbour: with another job on the cores, a parallel
  path loses to a serial one it would beat on an idle machine, so ``tessera tune`` warns above
  :data:`tessera.hw.ceilings.BUSY`.
- **The default wins ties**: a candidate replaces the default only when it is :func:`clearly_faster`, more than
  :data:`MIN_GAIN` faster by the median *and* with interquartile ranges that do not overlap. A constant chosen by
  hand was right somewhere; switching on a 1% difference would make the choice flip between runs and machines
  that are in fact equal, and each flip costs a re-validation of performance numbers for nothing.

A crossover tunable (a threshold between two code paths, :class:`~tessera.tuning.registry.Crossover`) times the two
paths at every grid point instead of timing thresholds, and scores each candidate threshold by the time its choice
of path would cost over the grid (per unit of ``m``, so every grid point weighs alike).
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.hw import probes
from tessera.tuning import cache, registry
from tessera.tuning.fingerprint import digest, fingerprint
from tessera.tuning.registry import Tunable
from tessera.tuning.summary import format_value

#: a candidate must beat the default's median by more than this fraction (and lie outside its IQR) to be chosen
MIN_GAIN = 0.03
#: seconds of timed calls per (tunable, shape class), and the bounds on the rounds
BUDGET_S = {True: 1.5, False: 6.0}
ROUNDS = {True: (3, 7), False: (5, 15)}


@dataclass(frozen=True)
class Options:
    """What measure functions may adapt to: ``quick`` (smaller workloads) and ``workload`` (e.g. a model's
    projection shapes; ``None`` = the tunable's built-in realistic shapes)."""

    quick: bool = False
    workload: Any = None


_options = Options()


def options() -> Options:
    """The options of the search in progress (measure functions read them)."""
    return _options


@contextlib.contextmanager
def using(opts: Options) -> Iterator[None]:
    """Run a block with ``opts`` as :func:`options`."""
    global _options
    saved, _options = _options, opts
    try:
        yield
    finally:
        _options = saved


@dataclass
class Outcome:
    """The result of tuning one (tunable, shape class).

    ``candidates`` lists ``{"value", "seconds", "spread"}`` per candidate: the median seconds (for a crossover, the
    modelled cost per unit of ``m`` over the grid) and the interquartile range over the median. ``grid`` (crossovers
    only) holds the raw medians of both paths per grid point. ``speedup`` is the default's time over the chosen one's.
    """

    name: str
    shape_class: str | None
    default: Any
    chosen: Any
    speedup: float
    reason: str
    candidates: list[dict[str, Any]]
    rounds: int
    seconds: float
    quick: bool
    workload: str | None = None
    grid: list[dict[str, Any]] | None = None
    others_busy: float = 0.0
    measured_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
                             .isoformat(timespec="seconds"))

    def to_entry(self) -> dict[str, Any]:
        """The JSON-ready cache entry."""
        entry = {"chosen": self.chosen, "default": self.default, "speedup": round(self.speedup, 4),
                 "reason": self.reason, "candidates": self.candidates, "rounds": self.rounds,
                 "seconds": round(self.seconds, 3), "quick": self.quick, "workload": self.workload,
                 "others_busy": round(self.others_busy, 3), "measured_at": self.measured_at}
        if self.grid is not None:
            entry["grid"] = self.grid
        return entry


def quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile); with fewer than 4 samples the min and max bound the range."""
    if len(samples) < 4:
        return min(samples), statistics.median(samples), max(samples)
    q1, q2, q3 = statistics.quantiles(samples, n=4)
    return q1, q2, q3


def spread(samples: Sequence[float]) -> float:
    """Interquartile range over the median (the harness's noise measure)."""
    q1, med, q3 = quartiles(samples)
    return (q3 - q1) / med if med > 0 else 0.0


def clearly_faster(new: Sequence[float], old: Sequence[float], min_gain: float = MIN_GAIN) -> bool:
    """Whether timings ``new`` beat ``old`` beyond noise: median more than ``min_gain`` lower and the interquartile
    ranges disjoint (``new``'s 75th percentile below ``old``'s 25th).

    Examples
    --------
    >>> clearly_faster([1.0, 1.01, 0.99, 1.0], [1.2, 1.21, 1.19, 1.2])
    True
    >>> clearly_faster([1.0, 1.3, 0.9, 1.0], [1.1, 1.2, 1.0, 1.1])
    False
    """
    n_q1, n_med, n_q3 = quartiles(new)
    o_q1, o_med, o_q3 = quartiles(old)
    return n_med < (1.0 - min_gain) * o_med and n_q3 < o_q1


def _rounds(first_round_s: float, quick: bool) -> int:
    lo, hi = ROUNDS[quick]
    return max(lo, min(hi, int(BUDGET_S[quick] / max(first_round_s, 1e-6))))


def _unique(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def search(tunable: Tunable, shape_class: str | None, quick: bool = False,
           tick: Callable[[], None] | None = None) -> Outcome:
    """Measure ``tunable`` for ``shape_class`` and choose its value (not recorded: see :func:`tune`).

    ``tick`` is called after every round (a progress bar)."""
    start, cpu_before = time.perf_counter(), probes.cpu_seconds()
    default = tunable.default_for(shape_class)
    workload = getattr(options().workload, "name", None)
    if tunable.crossover is not None:
        out = _search_crossover(tunable, shape_class, default, quick, tick)
    else:
        out = _search_choice(tunable, shape_class, default, quick, tick)
    out.seconds, out.workload = time.perf_counter() - start, workload
    out.others_busy = probes.others_busy_fraction(cpu_before, probes.cpu_seconds(), out.seconds)
    return out


def _search_choice(t: Tunable, sc: str | None, default: Any, quick: bool,
                   tick: Callable[[], None] | None) -> Outcome:
    assert t.measure is not None
    cands = _unique([default, *t.candidates])
    warm = time.perf_counter()
    for c in cands:  # untimed: compiles kernels, faults pages in, fills caches
        t.measure(c, sc)
    rounds = _rounds(time.perf_counter() - warm, quick)
    samples: dict[Any, list[float]] = {c: [] for c in cands}
    for r in range(rounds):
        k = r % len(cands)
        for c in cands[k:] + cands[:k]:  # rotated: no candidate always runs first, or right after the same one
            samples[c].append(float(t.measure(c, sc)))
        if tick is not None:
            tick()
    med = {c: statistics.median(s) for c, s in samples.items()}
    best = min(cands, key=lambda c: (med[c], c != default))
    if best != default and clearly_faster(samples[best], samples[default]):
        chosen = best
        reason = f"{best!r} is {med[default] / med[best]:.2f}x faster than the default, beyond noise"
    elif best != default:
        chosen = default
        reason = (f"{best!r} was {med[default] / med[best]:.2f}x faster by the median, within noise "
                  f"(needs > {MIN_GAIN:.0%} and disjoint IQRs): the default stays")
    else:
        chosen, reason = default, "the default was fastest"
    candidates = [{"value": c, "seconds": med[c], "spread": round(spread(samples[c]), 4)} for c in cands]
    return Outcome(t.name, sc, default, chosen, med[default] / med[chosen], reason, candidates, rounds, 0.0, quick)


def _search_crossover(t: Tunable, sc: str | None, default: int, quick: bool,
                      tick: Callable[[], None] | None) -> Outcome:
    x = t.crossover
    assert x is not None
    grid = sorted(_unique([*t.candidates, default]))
    paths = {"below": x.below, "above": x.above}
    warm = time.perf_counter()
    for m in grid:
        for fn in paths.values():
            fn(m, sc)
    rounds = _rounds(time.perf_counter() - warm, quick)
    samples: dict[tuple[str, int], list[float]] = {(p, m): [] for p in paths for m in grid}
    for r in range(rounds):
        # alternate the grid direction and which path goes first, so neither path always follows a large call
        order = grid if r % 2 == 0 else grid[::-1]
        for m in order:
            for p in (("below", "above") if (r + m) % 2 == 0 else ("above", "below")):
                samples[p, m].append(float(paths[p](m, sc)))
        if tick is not None:
            tick()
    med = {key: statistics.median(s) for key, s in samples.items()}

    def path(value: int, m: int) -> str:
        return "below" if x.uses_below(m, value) else "above"

    def cost(value: int) -> float:
        """Mean over the grid of the chosen path's seconds per unit of m (each grid point weighs alike)."""
        return statistics.fmean(med[path(value, m), m] / m for m in grid)

    def acceptable(value: int) -> bool:
        """Where ``value`` and the default send a grid point down different paths, ``value``'s path must be no
        slower by the median everywhere and clearly faster somewhere."""
        diff = [m for m in grid if path(value, m) != path(default, m)]
        return bool(diff) and all(med[path(value, m), m] <= med[path(default, m), m] for m in diff) and any(
            clearly_faster(samples[path(value, m), m], samples[path(default, m), m]) for m in diff)

    costs = {v: cost(v) for v in grid}
    better = [v for v in grid if v != default and acceptable(v)]
    below_wins = ", ".join(format_value(m) for m in grid if med["below", m] < med["above", m]) or "none"
    wins = f"{x.names[0]} had the lower median at {x.unit} = {below_wins}"
    if better:  # the cheapest acceptable threshold; among equal costs the one nearest the default
        chosen = min(better, key=lambda v: (costs[v], abs(grid.index(v) - grid.index(default))))
        reason = f"{wins}; {format_value(chosen)} beats the default beyond noise"
    else:
        chosen = default
        reason = f"{wins}; no other threshold is faster beyond noise where it changes the path"
    candidates = [{"value": v, "seconds": costs[v], "spread": None} for v in grid]
    raw = [{"m": m, "below": med["below", m], "above": med["above", m],
            "below_spread": round(spread(samples["below", m]), 4),
            "above_spread": round(spread(samples["above", m]), 4)} for m in grid]
    return Outcome(t.name, sc, default, chosen, costs[default] / costs[chosen], reason, candidates, rounds, 0.0,
                   quick, grid=raw)


def plan(names: Sequence[str] | None = None, classes: dict[str, Sequence[str | None]] | None = None
         ) -> list[tuple[Tunable, str | None]]:
    """The (tunable, shape class) pairs a run covers: ``names`` (default all), each over its shape classes or over
    ``classes[name]`` when given. Unknown names raise KeyError listing the registered ones."""
    every = registry.tunables()
    chosen = list(every) if not names else list(names)
    pairs = []
    for name in chosen:
        t = registry.get(name)
        for sc in (classes or {}).get(name, t.shape_classes):
            t.default_for(sc)  # validates the class
            pairs.append((t, sc))
    return pairs


def tune(pairs: Sequence[tuple[Tunable, str | None]], quick: bool = False, workload: Any = None,
         on_outcome: Callable[[Outcome], None] | None = None, tick: Callable[[], None] | None = None,
         write: bool = True) -> list[Outcome]:
    """Search every pair in order, record each result for this process at once (later tunables measure with the
    earlier ones' values) and write it to this machine's cache file (``write``) before the next search starts, so an
    interrupted run keeps what it measured.

    A value forced by ``TESSERA_TUNE_<NAME>`` does not stop the search; the recorded value applies once the
    variable is unset.
    """
    outcomes = []
    path = cache.cache_path(digest())
    with using(Options(quick=quick, workload=workload)):
        for t, sc in pairs:
            outcome = search(t, sc, quick, tick)
            entry = outcome.to_entry()
            registry.record(t.name, sc, entry)
            if write and not cache.save(path, fingerprint(),
                                        cache.merged(path, fingerprint(), {t.name: {cache.class_key(sc): entry}})):
                write = False  # warned once; the results stay in memory
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    return outcomes
