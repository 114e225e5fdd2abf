"""Fused online-softmax step for one score tile (Numba, releases the GIL so prefill tasks run side by side).

Replaces four torch passes over the tile (row max, subtract, exp, row sum) with one kernel that walks each row twice
while it sits in L1. Measured on a 64 x 512 tile of 8 KV heads x 4 query heads (1M scores, one thread): the torch
passes took about 0.9 ms, about 15% of the tile's two GEMMs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tessera.backends.cpu.numba_math import FASTMATH, fast_exp, row_max


@njit(nogil=True, fastmath=FASTMATH, cache=True)
def online_softmax_tile(scores, m, l, alpha):  # pragma: no cover - compiled
    """Turn ``scores`` into probabilities relative to the updated running max; update the running state.

    Parameters
    ----------
    scores : float32 ``[rows, keys]``, C-contiguous; overwritten with ``exp(score - m_new)`` (0 where masked).
    m, l : float32 ``[rows]``: running max and denominator, updated in place (``-inf`` / 0 before the first tile).
    alpha : float32 ``[rows]``, output: the factor ``exp(m_old - m_new)`` by which the caller rescales its output.
    """
    rows, keys = scores.shape
    part = np.empty(16, dtype=np.float32)
    for r in range(rows):
        row = scores[r]
        mx = row_max(row, keys, part)
        m_old = m[r]
        m_new = max(m_old, mx)
        if m_new == -np.inf:  # nothing kept so far in this row
            for c in range(keys):
                row[c] = 0.0
            alpha[r] = 1.0
            continue
        total = np.float32(0.0)
        for c in range(keys):
            p = fast_exp(row[c] - m_new)
            row[c] = p
            total += p
        a = fast_exp(m_old - m_new)
        alpha[r] = a
        l[r] = l[r] * a + total
        m[r] = m_new
