"""The interface every proposer implements, and what it hands back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tessera.engine.sequence import Sequence


@dataclass(slots=True)
class Draft:
    """Tokens proposed to follow a sequence, and the distribution each was drawn from.

    Attributes
    ----------
    tokens : the drafted token ids, in order (may be empty: nothing to propose).
    probs : float32 ``[len(tokens), V]``: the draft's (filtered) distribution at each position, which the
        accept/reject rule divides by; None for a deterministic proposer (each token had probability 1).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None

    def truncated(self, n: int) -> Draft:
        """The first ``n`` tokens only (the scheduler cuts a draft to the step's budget and free pages)."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n])


class Proposer(Protocol):
    """Drafts tokens for sequences that are about to decode.

    ``propose`` gets the sequences and, per sequence, the most tokens wanted (>= 1); it returns one
    :class:`Draft` per sequence, possibly shorter or empty. A proposer with per-sequence state (a draft model's KV
    cache) syncs it to ``seq.token_ids`` on each call: tokens it drafted and the target rejected are dropped then.
    ``release`` forgets a finished, aborted or preempted sequence.
    """

    #: whether drafting costs a model forward (the adaptive controller then weighs its measured time)
    costs_forward: bool

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]: ...

    def release(self, seq_id: int) -> None: ...
