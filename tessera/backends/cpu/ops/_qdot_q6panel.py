"""Row-panel int8-activation GEMV/GEMM for ggml's Q6_K weights on ``vnni512``.

A Q6_K row block holds 256 weights as sixteen sub-blocks of 16: value ``d * sc_s * (q - 32)`` with 6-bit codes
``q``, int8 sub-block scales ``sc_s`` and a float16 ``d`` per block. :func:`repack_q6k` lays sixteen rows out per
32-value activation block (two sub-blocks), 384 bytes:

- 256 bytes of low nibbles in the group-32 panel order of :mod:`._qdot_panel` (chunk ``c``, row ``j``, byte ``t``:
  code ``4c + t`` of the first sub-block in the low nibble, of the second in the high nibble);
- 64 bytes of the first sub-block's top two bits: chunk ``c``'s code of byte ``t`` in bits ``2c, 2c + 1``;
- 64 bytes of the second sub-block's top bits, the same way;

then per panel the int8 scales ``[panel, sub-block, 16]`` and ``d`` as float16 bits ``[panel, block, 16]``: the
file's 0.82 bytes per weight. Each ``VPDPBUSD`` takes 64 unsigned codes (:func:`._panel_simd512.q6_panel_codes`
joins nibble and top bits, a few bit operations shared by the four activation rows of the four-row form) against
four broadcast activation values, so a sub-block's sixteen rows get their exact int32 dots with no horizontal sums.
The ``- 32`` is applied as ``-32 * d * sc_s * xd * sum(x codes of the sub-block)``, with the sums over sixteen
activation codes formed once per call (:func:`q6panel_row_range`).

The arithmetic is :mod:`._qdot_ggml`'s (exact integer dots, float32 scaling), summed in another order, so results
agree with its Q6_K rows to float32 rounding. The layout exists for the same reason as :mod:`._qdot_kpanel`'s: the
block rows take one activation row at a time, so a batched decode step or a prefill chunk paid for every row.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._ggml_simd512 import mul_f32x16
from tessera.backends.cpu.ops._int8_simd512 import add_f32x16, zero_f32x16
from tessera.backends.cpu.ops._panel_simd512 import (
    add_i32x16, dot_bcast, fma_bcast, fma_i32_bcast, load_i8_f32x16, load_scales16, q6_panel_codes, zero_i32x16,
)
from tessera.backends.cpu.ops._qdot_panel import BLOCK, PANEL, ROWS, X_ROWS, _store, prefetch_ahead

#: bytes of one Q6_K block of 256 weights in a GGUF row: 128 of low nibbles, 64 of top bits, 16 int8 scales, d
Q6K_BYTES = 210
#: bytes of sixteen rows' 32 weights in the panel layout: 256 of nibbles, two planes of 64 of top bits
GROUP_BYTES = 384
GROUPS = 8  # 32-weight groups (activation blocks) per Q6_K block
SUB = 16  # weights per Q6_K scale


@njit(inline="always")
def _q6k_code(row, o, v):  # pragma: no cover - compiled
    """The 6-bit code (0..63) of value ``v`` (0..255) of the Q6_K block at byte ``o`` of ``row``."""
    h = v >> 7
    quarter = (v >> 5) & 3
    lane = v & 31
    ql = np.int64(row[o + 64 * h + lane + 32 * (quarter & 1)])
    qh = np.int64(row[o + 128 + 32 * h + lane])
    low = (ql >> 4) if quarter >= 2 else (ql & 15)
    return low | (((qh >> (2 * quarter)) & 3) << 4)


@njit(cache=True, nogil=True, error_model="numpy")
def repack_q6k(data):  # pragma: no cover - compiled
    """Panel layout (module docstring) of Q6_K rows ``data`` uint8 ``[N, K / 256 * 210]``. Returns ``(codes uint8
    [P, K / 32 * 384], sc int8 [P, K / 16 * 16], d int16 [P, K / 256 * 16])``, P = ceil(N / 16), ``d`` as float16
    bits; rows past N are zero (their outputs are never stored)."""
    n, row_bytes = data.shape
    blocks = row_bytes // Q6K_BYTES
    groups = blocks * GROUPS
    p_count = (n + PANEL - 1) // PANEL
    codes = np.zeros((p_count, groups * GROUP_BYTES), dtype=np.uint8)
    sc = np.zeros((p_count, 2 * groups * PANEL), dtype=np.int8)
    d = np.zeros((p_count, blocks * PANEL), dtype=np.int16)
    for r in range(n):
        p = r // PANEL
        j = r - p * PANEL
        row = data[r]
        for blk in range(blocks):
            o = blk * Q6K_BYTES
            d[p, blk * PANEL + j] = np.int16(np.int64(row[o + 208]) | (np.int64(row[o + 209]) << 8))
            for s in range(2 * GROUPS):
                sc[p, (2 * GROUPS * blk + s) * PANEL + j] = np.int8(row[o + 192 + s])
            for gi in range(GROUPS):
                base = (blk * GROUPS + gi) * GROUP_BYTES
                for c in range(4):
                    for t in range(4):
                        first = _q6k_code(row, o, 32 * gi + 4 * c + t)
                        second = _q6k_code(row, o, 32 * gi + 16 + 4 * c + t)
                        at = 4 * j + t
                        codes[p, base + 64 * c + at] = (first & 15) | ((second & 15) << 4)
                        codes[p, base + 256 + at] |= (first >> 4) << (2 * c)
                        codes[p, base + 320 + at] |= (second >> 4) << (2 * c)
    return codes, sc, d


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _sub_dot(isa, c0, c1, c2, c3, xq, x):  # pragma: no cover - compiled
    """The sixteen rows' exact int32 dots of one 16-value sub-block (codes ``c0 .. c3``, four values each) with the
    activation codes at flat offset ``x`` (two chains of two, summed)."""
    a = dot_bcast(isa, zero_i32x16(), c0, xq, x)
    b = dot_bcast(isa, zero_i32x16(), c1, xq, x + 4)
    a = dot_bcast(isa, a, c2, xq, x + 8)
    b = dot_bcast(isa, b, c3, xq, x + 12)
    return add_i32x16(a, b)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q6panel_x4(isa, xq, xd, xs16, codes, sc, d, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation rows ``m .. m + 3`` into ``out[m:m + 4, lo:hi]``; ``xs16`` from
    :func:`offsets16`."""
    k = xq.shape[1]
    nb = xd.shape[1]
    ns = xs16.shape[1]
    cb = p * codes.shape[1]
    sb = p * sc.shape[1]
    db = p * d.shape[1]
    a0 = zero_f32x16()
    a1 = zero_f32x16()
    a2 = zero_f32x16()
    a3 = zero_f32x16()
    z0 = zero_f32x16()
    z1 = zero_f32x16()
    z2 = zero_f32x16()
    z3 = zero_f32x16()
    for blk in range(nb // GROUPS):
        dd = load_scales16(d, db + blk * PANEL)
        for gi in range(GROUPS):
            g = blk * GROUPS + gi
            o = cb + g * GROUP_BYTES
            prefetch_ahead(codes, o, GROUP_BYTES)
            f0 = q6_panel_codes(codes, o, o + 256, 0, False)
            f1 = q6_panel_codes(codes, o + 64, o + 256, 1, False)
            f2 = q6_panel_codes(codes, o + 128, o + 256, 2, False)
            f3 = q6_panel_codes(codes, o + 192, o + 256, 3, False)
            s0 = q6_panel_codes(codes, o, o + 320, 0, True)
            s1 = q6_panel_codes(codes, o + 64, o + 320, 1, True)
            s2 = q6_panel_codes(codes, o + 128, o + 320, 2, True)
            s3 = q6_panel_codes(codes, o + 192, o + 320, 3, True)
            sf = mul_f32x16(load_i8_f32x16(sc, sb + 2 * g * PANEL), dd)
            ss = mul_f32x16(load_i8_f32x16(sc, sb + (2 * g + 1) * PANEL), dd)
            x = g * BLOCK
            a0 = fma_i32_bcast(_sub_dot(isa, f0, f1, f2, f3, xq, m * k + x), sf, xd, m * nb + g, a0)
            a1 = fma_i32_bcast(_sub_dot(isa, f0, f1, f2, f3, xq, (m + 1) * k + x), sf, xd, (m + 1) * nb + g, a1)
            a2 = fma_i32_bcast(_sub_dot(isa, f0, f1, f2, f3, xq, (m + 2) * k + x), sf, xd, (m + 2) * nb + g, a2)
            a3 = fma_i32_bcast(_sub_dot(isa, f0, f1, f2, f3, xq, (m + 3) * k + x), sf, xd, (m + 3) * nb + g, a3)
            a0 = fma_i32_bcast(_sub_dot(isa, s0, s1, s2, s3, xq, m * k + x + SUB), ss, xd, m * nb + g, a0)
            a1 = fma_i32_bcast(_sub_dot(isa, s0, s1, s2, s3, xq, (m + 1) * k + x + SUB), ss, xd, (m + 1) * nb + g,
                               a1)
            a2 = fma_i32_bcast(_sub_dot(isa, s0, s1, s2, s3, xq, (m + 2) * k + x + SUB), ss, xd, (m + 2) * nb + g,
                               a2)
            a3 = fma_i32_bcast(_sub_dot(isa, s0, s1, s2, s3, xq, (m + 3) * k + x + SUB), ss, xd, (m + 3) * nb + g,
                               a3)
            z0 = fma_bcast(ss, xs16, m * ns + 2 * g + 1, fma_bcast(sf, xs16, m * ns + 2 * g, z0))
            z1 = fma_bcast(ss, xs16, (m + 1) * ns + 2 * g + 1, fma_bcast(sf, xs16, (m + 1) * ns + 2 * g, z1))
            z2 = fma_bcast(ss, xs16, (m + 2) * ns + 2 * g + 1, fma_bcast(sf, xs16, (m + 2) * ns + 2 * g, z2))
            z3 = fma_bcast(ss, xs16, (m + 3) * ns + 2 * g + 1, fma_bcast(sf, xs16, (m + 3) * ns + 2 * g, z3))
    _store(out, m, lo, hi, add_f32x16(a0, z0))
    _store(out, m + 1, lo, hi, add_f32x16(a1, z1))
    _store(out, m + 2, lo, hi, add_f32x16(a2, z2))
    _store(out, m + 3, lo, hi, add_f32x16(a3, z3))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q6panel_x1(isa, xq, xd, xs16, codes, sc, d, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation row ``m`` into ``out[m, lo:hi]``."""
    k = xq.shape[1]
    nb = xd.shape[1]
    ns = xs16.shape[1]
    cb = p * codes.shape[1]
    sb = p * sc.shape[1]
    db = p * d.shape[1]
    a0 = zero_f32x16()
    z0 = zero_f32x16()
    for blk in range(nb // GROUPS):
        dd = load_scales16(d, db + blk * PANEL)
        for gi in range(GROUPS):
            g = blk * GROUPS + gi
            o = cb + g * GROUP_BYTES
            prefetch_ahead(codes, o, GROUP_BYTES)
            sf = mul_f32x16(load_i8_f32x16(sc, sb + 2 * g * PANEL), dd)
            ss = mul_f32x16(load_i8_f32x16(sc, sb + (2 * g + 1) * PANEL), dd)
            x = m * k + g * BLOCK
            first = _sub_dot(isa, q6_panel_codes(codes, o, o + 256, 0, False),
                             q6_panel_codes(codes, o + 64, o + 256, 1, False),
                             q6_panel_codes(codes, o + 128, o + 256, 2, False),
                             q6_panel_codes(codes, o + 192, o + 256, 3, False), xq, x)
            second = _sub_dot(isa, q6_panel_codes(codes, o, o + 320, 0, True),
                              q6_panel_codes(codes, o + 64, o + 320, 1, True),
                              q6_panel_codes(codes, o + 128, o + 320, 2, True),
                              q6_panel_codes(codes, o + 192, o + 320, 3, True), xq, x + SUB)
            # one chain, in the four-row form's order: a token's row is the same alone and in a batch
            a0 = fma_i32_bcast(second, ss, xd, m * nb + g, fma_i32_bcast(first, sf, xd, m * nb + g, a0))
            z0 = fma_bcast(ss, xs16, m * ns + 2 * g + 1, fma_bcast(sf, xs16, m * ns + 2 * g, z0))
    _store(out, m, lo, hi, add_f32x16(a0, z0))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def offsets16(xq, xd):  # pragma: no cover - compiled
    """float32 ``[M, K / 16]``: ``-32 * xd * sum(xq)`` over each sixteen activation codes, the ``- 32`` of the
    codes times the activation: K adds per activation row, formed once per GEMV (the fused decode layer: once per
    chunk of rows) against its N x K multiply-adds."""
    m_rows, k = xq.shape
    out = np.empty((m_rows, k // SUB), dtype=np.float32)
    for m in range(m_rows):
        for s in range(k // SUB):
            total = np.int32(0)
            for i in range(SUB):
                total += np.int32(xq[m, SUB * s + i])
            out[m, s] = np.float32(-32.0) * xd[m, s >> 1] * np.float32(total)
    return out


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def q6panel_row_range(isa, xq, xd, xs16, codes, sc, d, out, n_lo, n_hi):  # pragma: no cover - compiled
    """Output rows ``n_lo .. n_hi - 1`` of ``out [M, N]`` (``n_lo`` a multiple of :data:`PANEL`) from the Q6_K panel
    layout; ``xq, xd`` from :func:`._qdot_kernels.quantize_rows`, ``xs16`` from :func:`offsets16`. A called
    function shared by the standalone GEMV and the fused decode layer, with the activation-row blocking of
    ``_qdot_panel.panel_row_range``."""
    m_rows = xq.shape[0]
    for m0 in range(0, m_rows, X_ROWS):
        m1 = min(m_rows, m0 + X_ROWS)
        quads = m0 + (m1 - m0) // 4 * 4
        for p in range(n_lo // PANEL, (n_hi + PANEL - 1) // PANEL):
            lo = p * PANEL
            hi = min(n_hi, lo + PANEL)
            for m in range(m0, quads, 4):
                _q6panel_x4(isa, xq, xd, xs16, codes, sc, d, p, m, out, lo, hi)
            for m in range(quads, m1):
                _q6panel_x1(isa, xq, xd, xs16, codes, sc, d, p, m, out, lo, hi)


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_q6panel(isa, xq, xd, xs, codes, sc, d, out):  # pragma: no cover - compiled
    """:func:`q6panel_row_range` over all ``out.shape[1]`` rows, split over threads in blocks of :data:`ROWS`. ``xs``
    (the per-32 activation sums) is unused: taken so every panel GEMV has one signature (``_qdot.qmatmul``)."""
    n_rows = out.shape[1]
    xs16 = offsets16(xq, xd)
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        q6panel_row_range(isa, xq, xd, xs16, codes, sc, d, out, blk * ROWS, min(n_rows, (blk + 1) * ROWS))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_q6panel_serial(isa, xq, xd, xs, codes, sc, d, out):  # pragma: no cover - compiled
    """:func:`gemv_q6panel` on the calling thread."""
    q6panel_row_range(isa, xq, xd, offsets16(xq, xd), codes, sc, d, out, np.int64(0), out.shape[1])
