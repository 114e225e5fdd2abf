"""De-quantize rows of a packed weight straight to bfloat16 bits, for the bf16 prefill tiles (``qgemm`` variants).

One fused pass per tile, over all threads: each weight is computed in float32 from its code, scale and zero point
or min, and rounded to bf16 once (round to nearest even). De-quantizing with torch ops in bf16 instead rounds the
scale, the product and the sum separately (up to 9e-3 norm-relative error on Q4_1 weights, against about 2e-3 here)
and takes longer.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._narrow import narrow


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def dequant_int4_bf16(packed, scales, offsets, has_min, group, lo, out):  # pragma: no cover - compiled
    """Rows ``lo .. lo + out.shape[0] - 1`` of an int4 / int4_min weight into ``out`` (uint16 bf16 bits ``[n, K]``).

    ``packed`` uint8 ``[N, K // 2]`` (byte ``j`` of a group holds element ``j`` low, ``j + G/2`` high), ``scales``
    float32 ``[N, K // G]``, ``offsets`` uint8 zero points or float32 mins ``[N, K // G]``."""
    n, k = out.shape
    half = group // 2
    for r in prange(n):
        row = lo + r
        for g in range(k // group):
            s = scales[row, g]
            off = offsets[row, g] if has_min else -np.float32(offsets[row, g]) * s
            base = g * half
            for j in range(half):
                byte = packed[row, base + j]
                out[r, g * group + j] = narrow(np.float32(byte & 15) * s + off, out)
                out[r, g * group + half + j] = narrow(np.float32(byte >> 4) * s + off, out)


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def dequant_int8_bf16(q, scales, group, lo, out):  # pragma: no cover - compiled
    """Rows ``lo ..`` of an int8 weight (``q`` int8 ``[N, K]``, ``scales`` float32 ``[N, K // group]``; per channel:
    ``group = K``) into ``out`` (uint16 bf16 bits ``[n, K]``)."""
    n, k = out.shape
    for r in prange(n):
        row = lo + r
        for g in range(k // group):
            s = scales[row, g]
            for j in range(group):
                out[r, g * group + j] = narrow(np.float32(q[row, g * group + j]) * s, out)
