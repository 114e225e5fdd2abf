"""Exact verification of drafted tokens: the standard accept/reject rule with the residual distribution.

For drafted token ``x`` at position ``j``, with ``p`` the target's and ``q`` the draft's filtered distributions
(both after penalties, temperature, top-k/top-p/min-p), ``x`` is accepted with probability ``min(1, p(x) / q(x))``.
The first rejected position takes a token from the residual ``max(0, p - q)`` renormalized, and verification stops;
when every drafted token is accepted, the target's distribution after the last one gives one more (the "bonus")
token. Every emitted token is then distributed exactly as the target's sampler would have drawn it (Leviathan et
al. 2023, Chen et al. 2023). Greedy rows are point masses, so the rule reduces to "accept while the draft equals the
target's argmax, then the argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Verdict:
    """One sequence's verified drafts: how many were accepted, and the token the target adds after them (from the
    residual at the rejected position), or None when all were accepted (the caller then samples the bonus token
    from the target's next distribution with its ordinary sampler)."""

    num_accepted: int
    correction: int | None


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def verify_draft(target: torch.Tensor, tokens: list[int], draft: torch.Tensor | None,
                 generator: torch.Generator | None) -> Verdict:
    """Accept or reject ``tokens`` one by one against the target's distributions.

    Parameters
    ----------
    target : float ``[k, V]``, the target's filtered distribution at each drafted position (row j: the
        distribution of token j given the sequence and drafts ``0..j-1``).
    tokens : the ``k`` drafted ids.
    draft : float ``[k, V]``, the draft's distribution each token was drawn from, or None when each drafted token had
        probability 1 (a deterministic proposer, or a greedy draft).
    generator : the request's generator (seeded requests), or None for torch's default stream.

    Returns
    -------
    Verdict

    A draw is taken only where the outcome is random (``0 < p(x) < q(x)``), and one more for a residual token;
    greedy rows draw nothing.
    """
    for j, x in enumerate(tokens):
        p = float(target[j, x])
        q = 1.0 if draft is None else float(draft[j, x])
        if p >= q or (p > 0.0 and _uniform(generator) * q < p):
            continue
        residual = target[j].double().clone()
        if draft is None:
            residual[x] = 0.0
        else:
            residual = (residual - draft[j].double()).clamp_(min=0.0)
        total = float(residual.sum())
        if not total > 0.0:  # p <= q everywhere with p != q cannot happen; rounding can: fall back to p
            residual, total = target[j].double().clone(), float(target[j].sum())
        if int(torch.count_nonzero(residual)) == 1:  # a point mass (greedy rows): no draw
            return Verdict(j, int(torch.argmax(residual)))
        cdf = torch.cumsum(residual, 0)
        pick = int(torch.searchsorted(cdf, _uniform(generator) * total, right=True))
        pick = min(pick, residual.shape[0] - 1)
        while residual[pick] <= 0.0:  # rounding past the last kept token: step back to one with mass
            pick -= 1
        return Verdict(j, pick)
    return Verdict(len(tokens), None)


def verify_greedy(best: list[int], tokens: list[int]) -> Verdict:
    """:func:`verify_draft` for a greedy row without penalties, from the target's argmax at each drafted position
    (``best[j]``): accept while the draft matches, then the argmax."""
    for j, x in enumerate(tokens):
        if x != best[j]:
            return Verdict(j, best[j])
    return Verdict(len(tokens), None)
