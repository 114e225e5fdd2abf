"""Measured costs the adaptive draft length weighs: a target step's time per sequence against its token count, and
the proposer's time per drafted token. Medians of recent samples, so a step that compiled a kernel or was
interrupted does not skew the estimate for long."""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

#: samples kept per statistic
_WINDOW = 16
#: the cost of one more verified token relative to a one-token step, until two token counts were measured
VERIFY_COST_PRIOR = 0.1
#: a drafting proposer's cost per token relative to a one-token target step, until measured
DRAFT_COST_PRIOR = 0.5


class StepCosts:
    """Running medians of step time by tokens per sequence, and of drafting time per drafted token."""

    def __init__(self) -> None:
        self._step: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=_WINDOW))
        self._draft: deque[float] = deque(maxlen=_WINDOW)

    def observe_step(self, seconds_per_seq: float, tokens_per_seq: int) -> None:
        self._step[tokens_per_seq].append(seconds_per_seq)

    def observe_draft(self, seconds_per_token: float) -> None:
        self._draft.append(seconds_per_token)

    def draft_token_ratio(self, drafting: bool) -> float:
        """One drafted token's cost in one-token target steps: the proposer's time per token (0 for a proposer
        that runs no model) plus the target's extra time per verified token."""
        counts = sorted(self._step)
        if not counts:
            return (DRAFT_COST_PRIOR if drafting else 0.0) + VERIFY_COST_PRIOR
        low = statistics.median(self._step[counts[0]])
        base = max(low - (counts[0] - 1) * self._slope(counts, low), 1e-9)  # a one-token step
        extra = self._slope(counts, low) / base if len(counts) > 1 else VERIFY_COST_PRIOR
        if not drafting:
            return extra
        draft = statistics.median(self._draft) / base if self._draft else DRAFT_COST_PRIOR
        return draft + extra

    def _slope(self, counts: list[int], low: float) -> float:
        if len(counts) < 2:
            return 0.0
        high = statistics.median(self._step[counts[-1]])
        return max(high - low, 0.0) / (counts[-1] - counts[0])
