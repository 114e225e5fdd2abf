"""Row-panel int8-activation GEMV/GEMM for group-32 int8 weights (GGUF Q8_0) on ``vnni512``.

The group-32 int4 panels of :mod:`._qdot_panel` for eight-bit codes: sixteen rows per panel, per 32-weight block
512 bytes, eight 64-byte chunks in which lane ``j`` (bytes ``4j .. 4j + 3``) holds codes ``4c .. 4c + 3`` of row
``j``'s block; the sixteen rows' scales of a block follow as ``[panel, block, 16]``. ``VPDPBUSD`` multiplies
unsigned bytes by signed ones, so the codes are stored biased, ``u = q + 128`` (:func:`repack_int8_g32`; exact for
every int8), and the bias comes back out with the activation block's sum: ``s * xd * dot(u, xq) - 128 * s * xs``.
The bytes per weight are Q8_0's own (32 codes and one scale per block).

These serve the tied Q8_0 embedding that SmolLM2 and the synthetic 1.1B files use as their LM head (49152 rows), and
Q8_0 projections; the int8 rows of :mod:`._qdot_kernels` reduce each row horizontally and take at most four
activation rows at a time, where one panel ``VPDPBUSD`` covers sixteen rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._ggml_simd512 import mul_f32x16
from tessera.backends.cpu.ops._int8_simd512 import add_f32x16, load_i8x64, zero_f32x16
from tessera.backends.cpu.ops._panel_simd512 import (
    add_i32x16, dot_bcast, fma_bcast, fma_i32_bcast, load_scales16, zero_i32x16,
)
from tessera.backends.cpu.ops._qdot_panel import BLOCK, PANEL, ROWS, X_ROWS, _store, prefetch_ahead

#: bytes of sixteen rows' 32-weight block in the panel layout
BLOCK_BYTES = PANEL * BLOCK


@njit(cache=True, nogil=True, error_model="numpy")
def repack_int8_g32(q, scales):  # pragma: no cover - compiled
    """Panel layout (module docstring) of group-32 int8 weights ``q`` int8 ``[N, K]`` with ``scales [N, K / 32]``
    (float32, or float16 bits as int16). Returns ``(codes uint8 [P, K / 32 * 512], scales [P, K / 32 * 16])``,
    P = ceil(N / 16), the codes biased by 128; rows past N are zero (their outputs are never stored)."""
    n, k = q.shape
    nb = k // BLOCK
    p_count = (n + PANEL - 1) // PANEL
    codes = np.zeros((p_count, nb * BLOCK_BYTES), dtype=np.uint8)
    sc = np.zeros((p_count, nb * PANEL), dtype=scales.dtype)
    for r in range(n):
        p = r // PANEL
        j = r - p * PANEL
        for b in range(nb):
            base = b * BLOCK_BYTES + 4 * j
            for c in range(8):
                for t in range(4):
                    codes[p, base + 64 * c + t] = np.uint8(np.int64(q[r, b * BLOCK + 4 * c + t]) + 128)
            sc[p, b * PANEL + j] = scales[r, b]
    return codes, sc


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _dot8(isa, c0, c1, c2, c3, c4, c5, c6, c7, xq, x):  # pragma: no cover - compiled
    """The sixteen rows' exact int32 dots of one block (biased codes ``c0 .. c7``) with the activation block at flat
    offset ``x`` (two chains of four, summed)."""
    a = dot_bcast(isa, zero_i32x16(), c0, xq, x)
    b = dot_bcast(isa, zero_i32x16(), c1, xq, x + 4)
    a = dot_bcast(isa, a, c2, xq, x + 8)
    b = dot_bcast(isa, b, c3, xq, x + 12)
    a = dot_bcast(isa, a, c4, xq, x + 16)
    b = dot_bcast(isa, b, c5, xq, x + 20)
    a = dot_bcast(isa, a, c6, xq, x + 24)
    b = dot_bcast(isa, b, c7, xq, x + 28)
    return add_i32x16(a, b)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q8panel_x4(isa, xq, xd, xs, codes, sc, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation rows ``m .. m + 3`` into ``out[m:m + 4, lo:hi]``."""
    k = xq.shape[1]
    nb = xd.shape[1]
    cb = p * codes.shape[1]
    sb = p * sc.shape[1]
    a0 = zero_f32x16()
    a1 = zero_f32x16()
    a2 = zero_f32x16()
    a3 = zero_f32x16()
    z0 = zero_f32x16()
    z1 = zero_f32x16()
    z2 = zero_f32x16()
    z3 = zero_f32x16()
    for b in range(nb):
        o = cb + b * BLOCK_BYTES
        prefetch_ahead(codes, o, BLOCK_BYTES)
        c0 = load_i8x64(codes, o)
        c1 = load_i8x64(codes, o + 64)
        c2 = load_i8x64(codes, o + 128)
        c3 = load_i8x64(codes, o + 192)
        c4 = load_i8x64(codes, o + 256)
        c5 = load_i8x64(codes, o + 320)
        c6 = load_i8x64(codes, o + 384)
        c7 = load_i8x64(codes, o + 448)
        s = load_scales16(sc, sb + b * PANEL)
        z = mul_f32x16(s, np.float32(-128.0))
        x = b * BLOCK
        a0 = fma_i32_bcast(_dot8(isa, c0, c1, c2, c3, c4, c5, c6, c7, xq, m * k + x), s, xd, m * nb + b, a0)
        a1 = fma_i32_bcast(_dot8(isa, c0, c1, c2, c3, c4, c5, c6, c7, xq, (m + 1) * k + x), s, xd,
                           (m + 1) * nb + b, a1)
        a2 = fma_i32_bcast(_dot8(isa, c0, c1, c2, c3, c4, c5, c6, c7, xq, (m + 2) * k + x), s, xd,
                           (m + 2) * nb + b, a2)
        a3 = fma_i32_bcast(_dot8(isa, c0, c1, c2, c3, c4, c5, c6, c7, xq, (m + 3) * k + x), s, xd,
                           (m + 3) * nb + b, a3)
        z0 = fma_bcast(z, xs, m * nb + b, z0)
        z1 = fma_bcast(z, xs, (m + 1) * nb + b, z1)
        z2 = fma_bcast(z, xs, (m + 2) * nb + b, z2)
        z3 = fma_bcast(z, xs, (m + 3) * nb + b, z3)
    _store(out, m, lo, hi, add_f32x16(a0, z0))
    _store(out, m + 1, lo, hi, add_f32x16(a1, z1))
    _store(out, m + 2, lo, hi, add_f32x16(a2, z2))
    _store(out, m + 3, lo, hi, add_f32x16(a3, z3))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q8panel_x1(isa, xq, xd, xs, codes, sc, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation row ``m`` into ``out[m, lo:hi]``."""
    k = xq.shape[1]
    nb = xd.shape[1]
    cb = p * codes.shape[1]
    sb = p * sc.shape[1]
    a0 = zero_f32x16()
    z0 = zero_f32x16()
    for b in range(nb):
        o = cb + b * BLOCK_BYTES
        prefetch_ahead(codes, o, BLOCK_BYTES)
        s = load_scales16(sc, sb + b * PANEL)
        d = _dot8(isa, load_i8x64(codes, o), load_i8x64(codes, o + 64), load_i8x64(codes, o + 128),
                  load_i8x64(codes, o + 192), load_i8x64(codes, o + 256), load_i8x64(codes, o + 320),
                  load_i8x64(codes, o + 384), load_i8x64(codes, o + 448), xq, m * k + b * BLOCK)
        a0 = fma_i32_bcast(d, s, xd, m * nb + b, a0)
        z0 = fma_bcast(mul_f32x16(s, np.float32(-128.0)), xs, m * nb + b, z0)
    _store(out, m, lo, hi, add_f32x16(a0, z0))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def q8panel_row_range(isa, xq, xd, xs, codes, sc, out, n_lo, n_hi):  # pragma: no cover - compiled
    """Output rows ``n_lo .. n_hi - 1`` of ``out [M, N]`` (``n_lo`` a multiple of :data:`PANEL`) from the int8 panel
    layout; ``xq, xd, xs`` from :func:`._qdot_kernels.quantize_rows`. Shared by the standalone GEMV and the fused
    decode layer, with the activation-row blocking of ``_qdot_panel.panel_row_range``."""
    m_rows = xq.shape[0]
    for m0 in range(0, m_rows, X_ROWS):
        m1 = min(m_rows, m0 + X_ROWS)
        quads = m0 + (m1 - m0) // 4 * 4
        for p in range(n_lo // PANEL, (n_hi + PANEL - 1) // PANEL):
            lo = p * PANEL
            hi = min(n_hi, lo + PANEL)
            for m in range(m0, quads, 4):
                _q8panel_x4(isa, xq, xd, xs, codes, sc, p, m, out, lo, hi)
            for m in range(quads, m1):
                _q8panel_x1(isa, xq, xd, xs, codes, sc, p, m, out, lo, hi)


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_q8panel(isa, xq, xd, xs, codes, sc, out):  # pragma: no cover - compiled
    """:func:`q8panel_row_range` over all ``out.shape[1]`` rows, split over threads in blocks of :data:`ROWS`."""
    n_rows = out.shape[1]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        q8panel_row_range(isa, xq, xd, xs, codes, sc, out, blk * ROWS, min(n_rows, (blk + 1) * ROWS))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_q8panel_serial(isa, xq, xd, xs, codes, sc, out):  # pragma: no cover - compiled
    """:func:`gemv_q8panel` on the calling thread."""
    q8panel_row_range(isa, xq, xd, xs, codes, sc, out, np.int64(0), out.shape[1])
