"""Measured costs the adaptive draft length weighs: a target step's time per sequence against its token count, and
a draft model's forward times. Medians of recent samples, so a step that compiled a kernel or was interrupted does
not skew the estimate for long."""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

#: samples kept per statistic
_WINDOW = 16
#: a step shape's time counts once it has this many samples after its first (the first run of a shape may compile
#: a kernel: seconds, where a step takes milliseconds; kept, one such sample held k at 1 for a whole run)
_MIN_SAMPLES = 3
#: the cost of one more verified token relative to a one-token step, until two token counts were measured
VERIFY_COST_PRIOR = 0.1
#: a draft model's forward relative to a one-token target step, until measured
DRAFT_COST_PRIOR = 0.5


class StepCosts:
    """Running medians of the target's step time by tokens per sequence, and of a draft model's forward time per
    sequence: its first forward of a proposal (which also feeds the tokens the target emitted last step) and each
    forward after it (one drafted token)."""

    def __init__(self) -> None:
        self._step: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=_WINDOW))
        self._first: deque[float] = deque(maxlen=_WINDOW)
        self._next: deque[float] = deque(maxlen=_WINDOW)
        self._seen: set[object] = set()  # shapes whose first (possibly compiling) sample was dropped

    def _keep(self, shape: object) -> bool:
        if shape in self._seen:
            return True
        self._seen.add(shape)
        return False

    def observe_step(self, seconds_per_seq: float, tokens_per_seq: int) -> None:
        if self._keep(tokens_per_seq):
            self._step[tokens_per_seq].append(seconds_per_seq)

    def observe_draft(self, first: float | None, following: float | None) -> None:
        """A proposal's draft forwards, in seconds per sequence (None: not measured this time)."""
        if first is not None and self._keep("first"):
            self._first.append(first)
        if following is not None and self._keep("next"):
            self._next.append(following)

    def ratios(self) -> tuple[float, float, float]:
        """``(first, next, verify)`` in one-token target steps: a proposal's first draft forward, each further
        one, and the target's extra time per verified token."""
        counts = sorted(n for n, times in self._step.items() if len(times) >= _MIN_SAMPLES)
        if not counts:
            return DRAFT_COST_PRIOR, DRAFT_COST_PRIOR, VERIFY_COST_PRIOR
        low = statistics.median(self._step[counts[0]])
        slope = self._slope(counts, low)
        base = max(low - (counts[0] - 1) * slope, 1e-9)  # a one-token step
        verify = slope / base if len(counts) > 1 else VERIFY_COST_PRIOR
        following = statistics.median(self._next) / base if self._next else DRAFT_COST_PRIOR
        first = statistics.median(self._first) / base if self._first else following
        return first, following, verify

    def _slope(self, counts: list[int], low: float) -> float:
        if len(counts) < 2:
            return 0.0
        high = statistics.median(self._step[counts[-1]])
        return max(high - low, 0.0) / (counts[-1] - counts[0])
