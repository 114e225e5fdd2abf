"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""

from __future__ import annotations

from tessera.engine.sequence import Sequence
from tessera.engine.speculative.proposer import Draft


class _Index:
    """Per sequence: for each n, n-gram -> the position right after its latest occurrence that has a continuation.

    Built incrementally: a sequence only grows (preemption keeps its tokens), so each step adds the few n-grams that
    end at the new positions; a lookup is one dict probe per n.
    """

    __slots__ = ("maps", "upto")

    def __init__(self, sizes: range) -> None:
        self.maps = {n: {} for n in sizes}
        self.upto = 0  # n-grams ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # an n-gram ending at the last token has no continuation yet
        for e in range(max(self.upto, 1), end + 1):
            for n, table in self.maps.items():
                if e >= n:
                    table[tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, end + 1)


class NgramProposer:
    """Drafts by matching the last ``n`` tokens (``n_max`` down to ``n_min``) against the prompt and output so far,
    preferring the longest suffix and its latest occurrence; the tokens after it are the draft. No model runs, so
    drafting is nearly free and a sequence with no match drafts nothing (a plain decode step).

    Parameters
    ----------
    n_max, n_min : the longest and shortest suffix tried.
    """

    costs_forward = False

    def __init__(self, n_max: int = 3, n_min: int = 2) -> None:
        self.sizes = range(n_min, n_max + 1)
        self._index: dict[int, _Index] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        return [Draft(self.lookup(seq.seq_id, seq.token_ids, k)) for seq, k in zip(seqs, max_tokens)]

    def lookup(self, key: int, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens`` (whose index is kept under ``key``), or [] when nothing
        matches."""
        index = self._index.get(key)
        if index is None or index.upto > len(tokens):
            index = self._index[key] = _Index(self.sizes)
        index.update(tokens)
        for n in reversed(self.sizes):
            if len(tokens) <= n:
                continue
            start = index.maps[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
