"""Gather one sequence's keys (or values) out of token rows into head-major float32, in one Numba pass.

Quantized rows (:class:`tessera.kv.quantized.QuantizedPages`: int8 or e4m3 codes with one float16 scale per token
and kv head) are read as stored and de-quantized in the same pass, ``code * scale`` in float32, exactly as
:func:`tessera.kv.quantized.dequantize_kv` computes it before any rounding to a storage dtype: the prefill tiles and
the cascades never make a de-quantized copy of the pages (one pass over ``D + 2`` bytes per token and head instead
of de-quantizing the plan's pages to q's dtype and widening those again).

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

from tessera.backends.cpu.decode_kernel import code_unit
from tessera.backends.cpu.numba_math import widen
from tessera.backends.cpu.ops._narrow import storage_view
from tessera.kv.quantized import QuantizedPages

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


@njit(inline="always")
def _code_item(codes, scales, unit, rows, out, item, head_major):  # pragma: no cover - compiled
    # the scale times the code unit first (exact: a power of two), then one rounding per element as dequantize_kv
    hkv = codes.shape[1]
    n = out.shape[1] if head_major else out.shape[0]
    d = codes.shape[2]
    h = item % hkv
    blk = item // hkv
    for j in range(blk * BLOCK, min(n, blk * BLOCK + BLOCK)):
        r = rows[j]
        s = widen(scales[r, h]) * unit
        for x in range(d):
            if head_major:
                out[h, j, x] = widen(codes[r, h, x]) * s
            else:
                out[j, h, x] = widen(codes[r, h, x]) * s


@njit(parallel=True, cache=True)
def _codes_parallel(codes, scales, unit, rows, out, head_major):  # pragma: no cover - compiled
    for item in prange(codes.shape[1] * ((len(rows) + BLOCK - 1) // BLOCK)):
        _code_item(codes, scales, unit, rows, out, item, head_major)


@njit(cache=True)
def _codes_serial(codes, scales, unit, rows, out, head_major):  # pragma: no cover - compiled
    for item in range(codes.shape[1] * ((len(rows) + BLOCK - 1) // BLOCK)):
        _code_item(codes, scales, unit, rows, out, item, head_major)


def _row_indices(rows: np.ndarray | slice) -> np.ndarray:
    if isinstance(rows, slice):
        return np.arange(rows.start, rows.stop, dtype=np.int64)
    return np.ascontiguousarray(rows, dtype=np.int64)


def _dequantize_rows(kv_rows: QuantizedPages, rows: np.ndarray, out: torch.Tensor, head_major: bool) -> None:
    if kv_rows.codes.dim() != 3:
        raise ValueError(f"gather: quantized rows must be [rows, Hkv, D], got codes of shape {tuple(kv_rows.shape)}")
    codes = kv_rows.contiguous()
    bits = codes.code_bits().numpy()
    kernel = _codes_parallel if out.numel() >= PARALLEL_MIN_ELEMENTS else _codes_serial
    kernel(bits, storage_view(codes.scales), code_unit(bits), rows, out.numpy(), head_major)


def gather_heads(kv_rows: torch.Tensor | QuantizedPages, rows: np.ndarray | slice) -> torch.Tensor:
    """``kv_rows[rows]`` as float32 ``[Hkv, len(rows), D]``.

    Parameters
    ----------
    kv_rows : ``[num_rows, Hkv, D]`` float32 / bfloat16 / float16, contiguous; or quantized rows
        (:class:`~tessera.kv.quantized.QuantizedPages` reshaped to ``[num_rows, Hkv, D]``), de-quantized on the way.
    rows : int64 row indices, or a slice of consecutive rows (``KVLayout.rows``).
    """
    rows = _row_indices(rows)
    out = torch.empty(kv_rows.shape[1], len(rows), kv_rows.shape[2], dtype=torch.float32)
    if not out.numel():
        return out
    if isinstance(kv_rows, QuantizedPages):
        _dequantize_rows(kv_rows, rows, out, True)
        return out
    kernel = _gather_parallel if out.numel() >= PARALLEL_MIN_ELEMENTS else _gather_serial
    kernel(storage_view(kv_rows), rows, out.numpy())
    return out


def dequantize_token_rows(kv_rows: QuantizedPages, rows: np.ndarray | slice) -> torch.Tensor:
    """Quantized ``kv_rows[rows]`` de-quantized to float32 token rows ``[len(rows), Hkv, D]`` (the layout the
    shared-prefix kernel addresses), in one pass over the codes."""
    rows = _row_indices(rows)
    out = torch.empty(len(rows), kv_rows.shape[1], kv_rows.shape[2], dtype=torch.float32)
    if out.numel():
        _dequantize_rows(kv_rows, rows, out, False)
    return out
