"""The one timing loop every suite goes through: warm-up, interleaved repeats, median and spread.

Ours and the baseline run round-robin, so slow drift on a shared machine (neighbours, clock changes) moves both
alike and their ratio stays meaningful. Repeat counts adapt to the call's duration (a fixed time budget per case),
within bounds. The spread is the interquartile range over the median: ``compare`` treats changes inside it as noise.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: seconds of timed calls per case (ours + baseline together), and the bounds on repeats
BUDGET_S = {True: 0.4, False: 1.5}
MIN_REPS, MAX_REPS = 5, 200
#: memory-bound cases rotate through copies of their inputs adding up to at least this much
ROTATE_BYTES = 128 << 20


def rotate_bytes() -> int:
    """Bytes of copies that stream from DRAM on this machine: :data:`ROTATE_BYTES`, or twice the last-level cache
    when that is larger (an Intel Xeon here has 300 MiB of L3: 128 MiB of copies would be served from it)."""
    from tessera.tuning.fingerprint import cache_sizes

    return max(ROTATE_BYTES, 2 * (cache_sizes().get("L3") or 0))


def copies_for(bytes_each: int, total: int | None = None, most: int = 64) -> int:
    """How many copies of a ``bytes_each`` input make calls stream from memory instead of the last-level cache
    (``total`` defaults to :func:`rotate_bytes`)."""
    total = rotate_bytes() if total is None else total
    return max(1, min(most, -(-total // max(bytes_each, 1))))


def rotating(items: list[Any]) -> Callable[[], Any]:
    """A function returning ``items`` in turn: case closures call it to get the next copy of their inputs."""
    state = {"i": -1}

    def next_item() -> Any:
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return next_item


@dataclass
class Case:
    """One measurement: our call and (optionally) a baseline's call on the same inputs.

    Attributes
    ----------
    suite, name : where the case belongs and what it is (unique within the suite).
    run : our call. With ``self_timed`` it returns the seconds to report (e.g. the decode part of a generation).
    baseline, baseline_name : the reference implementation's call ("torch", "sdpa", "transformers", ...).
    flops, bytes_moved : useful floating point operations and minimum memory traffic of one call (for rates,
        ceilings and the roofline prediction); 0 when not meaningful.
    dtype : "fp32", "bf16" or "fp16": which GEMM ceiling applies.
    params : plot coordinates, e.g. ``{"phase": "decode", "context": 4096}``.
    target : the issue's bound on ours / baseline time, when there is one.
    self_timed : ``run`` and ``baseline`` return the seconds to report instead of being timed around.
    reps : fixed repeat count (expensive cases such as whole generations); None adapts it to the budget.
    """

    suite: str
    name: str
    run: Callable[[], Any]
    baseline: Callable[[], Any] | None = None
    baseline_name: str | None = None
    flops: float = 0.0
    bytes_moved: float = 0.0
    dtype: str = "fp32"
    params: dict[str, Any] = field(default_factory=dict)
    target: float | None = None
    self_timed: bool = False
    reps: int | None = None


@dataclass
class Result:
    """Medians in seconds; spreads as (p75 - p25) / median; ``error`` set when the case failed."""

    suite: str
    name: str
    dtype: str
    params: dict[str, Any]
    flops: float
    bytes_moved: float
    target: float | None
    seconds: float | None = None
    spread: float | None = None
    reps: int = 0
    baseline_name: str | None = None
    baseline_seconds: float | None = None
    baseline_spread: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """ours / baseline time (< 1: we are faster)."""
        if self.seconds is None or not self.baseline_seconds:
            return None
        return self.seconds / self.baseline_seconds

    @property
    def key(self) -> str:
        return f"{self.suite}/{self.name}"


def _spread(samples: list[float]) -> float:
    if len(samples) < 4:
        return (max(samples) - min(samples)) / statistics.median(samples)
    q = statistics.quantiles(samples, n=4)
    return (q[2] - q[0]) / statistics.median(samples)


def _call(fn: Callable[[], Any], self_timed: bool) -> float:
    start = time.perf_counter()
    out = fn()
    return float(out) if self_timed else time.perf_counter() - start


def measure(case: Case, quick: bool = False, reps: int | None = None) -> Result:
    """Time one case; exceptions become ``Result.error`` (with the traceback's last line) instead of propagating."""
    result = Result(case.suite, case.name, case.dtype, dict(case.params), case.flops, case.bytes_moved, case.target,
                    baseline_name=case.baseline_name if case.baseline else None)
    fns = {"ours": case.run}
    if case.baseline is not None:
        fns["base"] = case.baseline
    try:
        first = sum(_call(fn, case.self_timed) for fn in fns.values())  # warm-up (compiles, caches, page faults)
        n = reps or case.reps or max(MIN_REPS, min(MAX_REPS, int(BUDGET_S[quick] / max(first, 1e-6))))
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(n):
            for name, fn in fns.items():
                samples[name].append(_call(fn, case.self_timed))
    except Exception as exc:  # a broken case must not stop the other suites
        result.error = f"{type(exc).__name__}: {exc}"
        result.error += "\n" + "".join(traceback.format_exception(exc)[-3:])
        return result
    result.reps = n
    result.seconds, result.spread = statistics.median(samples["ours"]), _spread(samples["ours"])
    if "base" in samples:
        result.baseline_seconds, result.baseline_spread = statistics.median(samples["base"]), _spread(samples["base"])
    return result


def run_cases(cases: Iterable[Case], quick: bool = False,
              on_result: Callable[[Result], None] | None = None) -> Iterator[Result]:
    """Measure cases one at a time (suites build inputs lazily, so only one case's tensors are alive)."""
    for case in cases:
        result = measure(case, quick)
        if on_result is not None:
            on_result(result)
        yield result
