"""Gather one sequence's keys (or values) out of token rows into head-major float32, in one Numba pass.

The BLAS tile path wants ``[Hkv, kv_len, D]`` float32 per sequence. torch's ``k_rows[rows].permute(1, 0, 2)
.to(float32).contiguous()`` makes two full copies (the gather, then the transpose) and took 5.2 ms for 4096 keys of
8 heads x 128 (fp32; 2.6 ms bf16); this kernel reads each source row once and writes each output element once:
0.54 ms (0.41 ms bf16), same values (widening is exact). End to end it did not move the benchmarks it was aimed at
(the 32 x 4k shared-prefix cascade stayed at 24-25 ms, causal prefill S=4096 at 0.93x SDPA): there the GEMMs
dominate.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from tessera.backends.cpu.numba_math import widen
from tessera.backends.cpu.ops._narrow import storage_view

#: keys per work item (all of one head)
BLOCK = 64
#: below this many output elements the gather runs on the calling thread (waking the pool costs ~50 us)
PARALLEL_MIN_ELEMENTS = 1 << 18


@njit(inline="always")
def _gather_item(src, rows, out, item):  # pragma: no cover - compiled
    hkv, n, d = out.shape
    h = item % hkv
    blk = item // hkv
    for j in range(blk * BLOCK, min(n, blk * BLOCK + BLOCK)):
        r = rows[j]
        for x in range(d):
            out[h, j, x] = widen(src[r, h, x])


@njit(parallel=True, cache=True)
def _gather_parallel(src, rows, out):  # pragma: no cover - compiled
    for item in prange(out.shape[0] * ((out.shape[1] + BLOCK - 1) // BLOCK)):
        _gather_item(src, rows, out, item)


@njit(cache=True)
def _gather_serial(src, rows, out):  # pragma: no cover - compiled
    for item in range(out.shape[0] * ((out.shape[1] + BLOCK - 1) // BLOCK)):
        _gather_item(src, rows, out, item)


def gather_heads(kv_rows: torch.Tensor, rows: np.ndarray | slice) -> torch.Tensor:
    """``kv_rows[rows]`` as float32 ``[Hkv, len(rows), D]``.

    Parameters
    ----------
    kv_rows : ``[num_rows, Hkv, D]`` float32 / bfloat16 / float16, contiguous.
    rows : int64 row indices, or a slice of consecutive rows (``KVLayout.rows``).
    """
    if isinstance(rows, slice):
        rows = np.arange(rows.start, rows.stop, dtype=np.int64)
    out = torch.empty(kv_rows.shape[1], len(rows), kv_rows.shape[2], dtype=torch.float32)
    if out.numel():
        kernel = _gather_parallel if out.numel() >= PARALLEL_MIN_ELEMENTS else _gather_serial
        kernel(storage_view(kv_rows), np.ascontiguousarray(rows, dtype=np.int64), out.numpy())
    return out
