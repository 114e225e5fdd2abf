"""Numba GEMV for float weights at decode shapes (M <= 8 rows of x): ``out = x @ w.T``, fp32 accumulation.

Memory-bound: each weight element is read once. ``w`` is float32, or bfloat16 / float16 passed as their uint16 /
int16 bits and widened in registers (:func:`tessera.backends.cpu.numba_math.widen`), so a half-precision weight moves
half the bytes and is never copied to float32. Four weight rows share each x load with one x row; with several x
rows each weight row is dotted with all of them while it is in L1.

``gemv`` splits the rows over threads in blocks of ``ROWS``; ``gemv_serial`` is the same loop on the calling thread,
for small matrices where waking the pool (~50 us) costs more than the weight read.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH, widen

ROWS = 32  # output rows per parallel work item


@njit(inline="always", fastmath=FASTMATH)
def _dot(a, x):  # pragma: no cover - compiled
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += widen(a[j]) * x[j]
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _dot4(a0, a1, a2, a3, x):  # pragma: no cover - compiled
    """Four rows against one x: x is loaded once per four FMAs."""
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    for j in range(x.shape[0]):
        xj = x[j]
        s0 += widen(a0[j]) * xj
        s1 += widen(a1[j]) * xj
        s2 += widen(a2[j]) * xj
        s3 += widen(a3[j]) * xj
    return s0, s1, s2, s3


@njit(inline="always", fastmath=FASTMATH)
def _rows(x, w, out, lo, hi):  # pragma: no cover - compiled
    m_rows = x.shape[0]
    if m_rows == 1:
        x0 = x[0]
        n = lo
        while n + 4 <= hi:
            s0, s1, s2, s3 = _dot4(w[n], w[n + 1], w[n + 2], w[n + 3], x0)
            out[0, n] = s0
            out[0, n + 1] = s1
            out[0, n + 2] = s2
            out[0, n + 3] = s3
            n += 4
        while n < hi:
            out[0, n] = _dot(w[n], x0)
            n += 1
    else:
        for n in range(lo, hi):
            row = w[n]
            for m in range(m_rows):
                out[m, n] = _dot(row, x[m])


@njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
def gemv(x, w, out):  # pragma: no cover - compiled
    """x float32 ``[M, K]``; w float32, uint16 (bf16 bits) or int16 (fp16 bits) ``[N, K]``; out float32 ``[M, N]``."""
    n_rows = w.shape[0]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        _rows(x, w, out, blk * ROWS, min(n_rows, (blk + 1) * ROWS))


@njit(fastmath=FASTMATH, nogil=True, cache=True)
def gemv_serial(x, w, out):  # pragma: no cover - compiled
    """:func:`gemv` on the calling thread."""
    _rows(x, w, out, 0, w.shape[0])
