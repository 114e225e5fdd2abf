"""Row-panel int8-activation GEMV/GEMM for ggml's Q4_K weights on ``vnni512``.

A Q4_K row block holds 256 weights as eight sub-blocks of 32: value ``d * sc_j * q - dmin * m_j`` with 4-bit codes
``q``, 6-bit sub-block scales ``sc_j`` and mins ``m_j``, and float16 ``d`` and ``dmin`` per block. Per sub-block that
is the arithmetic of group-32 int4 with mins (GGUF Q4_1), so the panel kernels of :mod:`._qdot_panel` apply once the
bytes are laid out for them (:func:`repack_q4k`):

- the codes of each sub-block in the group-32 panel layout (sixteen rows per vector, four codes per int32 lane);
- the sixteen rows' ``sc_j`` and ``m_j`` of each sub-block as bytes, ``[panel, sub-block, 16]``;
- the sixteen rows' ``d`` and ``-dmin`` of each 256-value block as float16 bits, ``[panel, block, 16]``.

So a panel block costs the file's bytes plus 1/36 (148 bytes per row and 256 weights against 144): the scales stay
six-bit integers in memory, and the kernel forms ``d * sc_j`` and ``-dmin * m_j`` per sub-block, once for the
sixteen rows and shared by the activation rows of the four-row form. Both products are exact in float32 (an 11-bit
mantissa times a 6-bit integer), so the sums are those of the group-32 kernels with float32 scales: exact integer
sub-block dots, scaled and added in float32, agreeing with :mod:`._qdot_ggml`'s rows to float32 rounding.

Why a layout of its own: the Q4_K rows of :mod:`._qdot_ggml` need a horizontal sum per row and activation row and a
scale permute per chunk, and their four-row form compiled ~3x slower than four single rows inside the fused decode
layer and the serial GEMV on Zen 5 (2026-12-05): a batch of eight sequences spent ~10 ms per 1B-class layer.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._ggml_kernels import _k_scale_min
from tessera.backends.cpu.ops._int8_simd512 import add_f32x16, zero_f32x16
from tessera.backends.cpu.ops._ggml_simd512 import mul_f32x16
from tessera.backends.cpu.ops._panel_simd512 import (
    fma_bcast, fma_i32_bcast, load_scales16, load_u8_f32x16, panel_high, panel_low,
)
from tessera.backends.cpu.ops._qdot_panel import (
    BLOCK, PANEL, PANEL_BLOCK_BYTES, ROWS, X_ROWS, _block_dot, _store, prefetch_ahead,
)

#: bytes of one Q4_K block of 256 weights in a GGUF row: d, dmin (float16), 12 bytes of packed 6-bit scales and
#: mins, 128 bytes of 4-bit codes
Q4K_BYTES = 144
SUB_BLOCKS = 8  # 32-weight sub-blocks per Q4_K block


@njit(inline="always")
def _half_bits(row, at, flip):  # pragma: no cover - compiled
    """The float16 at bytes ``at, at + 1`` as int16 bits, its sign flipped when ``flip`` (exact negation)."""
    bits = np.int64(row[at]) | (np.int64(row[at + 1]) << 8)
    if flip:
        bits ^= 0x8000
    return np.int16(bits)


@njit(cache=True, nogil=True, error_model="numpy")
def repack_q4k(data):  # pragma: no cover - compiled
    """Panel layout (module docstring) of Q4_K rows ``data`` uint8 ``[N, K / 256 * 144]``. Returns ``(codes uint8
    [P, K / 32 * 256], sc uint8 [P, K / 32 * 16], mn uint8 [P, K / 32 * 16], d int16 [P, K / 256 * 16], dmin int16
    [P, K / 256 * 16])``, P = ceil(N / 16), ``d`` and ``dmin`` float16 bits with ``dmin`` negated; rows past N are
    zero (their outputs are never stored)."""
    n, row_bytes = data.shape
    blocks = row_bytes // Q4K_BYTES
    nb = blocks * SUB_BLOCKS
    p_count = (n + PANEL - 1) // PANEL
    codes = np.zeros((p_count, nb * PANEL_BLOCK_BYTES), dtype=np.uint8)
    sc = np.zeros((p_count, nb * PANEL), dtype=np.uint8)
    mn = np.zeros((p_count, nb * PANEL), dtype=np.uint8)
    d = np.zeros((p_count, blocks * PANEL), dtype=np.int16)
    dmin = np.zeros((p_count, blocks * PANEL), dtype=np.int16)
    for r in range(n):
        p = r // PANEL
        j = r - p * PANEL
        row = data[r]
        for blk in range(blocks):
            o = blk * Q4K_BYTES
            d[p, blk * PANEL + j] = _half_bits(row, o, False)
            dmin[p, blk * PANEL + j] = _half_bits(row, o + 2, True)
            for s in range(SUB_BLOCKS):
                b = blk * SUB_BLOCKS + s
                scale, low = _k_scale_min(row, o, s)
                sc[p, b * PANEL + j] = scale
                mn[p, b * PANEL + j] = low
                # sub-block s = 2c + h is nibble h of the 32 code bytes of chunk c; the group-32 panel wants its
                # codes t and 16 + t in the low and high nibble of byte t, four bytes per row and chunk
                qs = o + 16 + 32 * (s >> 1)
                shift = 4 * (s & 1)
                base = b * PANEL_BLOCK_BYTES + 4 * j
                for t in range(16):
                    lo = (np.int64(row[qs + t]) >> shift) & 15
                    hi = (np.int64(row[qs + 16 + t]) >> shift) & 15
                    codes[p, base + 64 * (t >> 2) + (t & 3)] = lo | (hi << 4)
    return codes, sc, mn, d, dmin


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _kpanel_x4(isa, xq, xd, xs, codes, sc, mn, d, dmin, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation rows ``m .. m + 3`` into ``out[m:m + 4, lo:hi]``."""
    k = xq.shape[1]
    nb = xd.shape[1]
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
    for blk in range(nb // SUB_BLOCKS):
        dd = load_scales16(d, db + blk * PANEL)
        dn = load_scales16(dmin, db + blk * PANEL)
        for s in range(SUB_BLOCKS):
            b = blk * SUB_BLOCKS + s
            o = cb + b * PANEL_BLOCK_BYTES
            prefetch_ahead(codes, o, PANEL_BLOCK_BYTES)
            l0 = panel_low(codes, o)
            h0 = panel_high(codes, o)
            l1 = panel_low(codes, o + 64)
            h1 = panel_high(codes, o + 64)
            l2 = panel_low(codes, o + 128)
            h2 = panel_high(codes, o + 128)
            l3 = panel_low(codes, o + 192)
            h3 = panel_high(codes, o + 192)
            scale = mul_f32x16(load_u8_f32x16(sc, sb + b * PANEL), dd)
            z = mul_f32x16(load_u8_f32x16(mn, sb + b * PANEL), dn)
            x = b * BLOCK
            a0 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, m * k + x), scale, xd,
                               m * nb + b, a0)
            a1 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, (m + 1) * k + x), scale, xd,
                               (m + 1) * nb + b, a1)
            a2 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, (m + 2) * k + x), scale, xd,
                               (m + 2) * nb + b, a2)
            a3 = fma_i32_bcast(_block_dot(isa, l0, l1, l2, l3, h0, h1, h2, h3, xq, (m + 3) * k + x), scale, xd,
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
def _kpanel_x1(isa, xq, xd, xs, codes, sc, mn, d, dmin, p, m, out, lo, hi):  # pragma: no cover - compiled
    """Panel ``p`` dotted with activation row ``m`` into ``out[m, lo:hi]``."""
    k = xq.shape[1]
    nb = xd.shape[1]
    cb = p * codes.shape[1]
    sb = p * sc.shape[1]
    db = p * d.shape[1]
    a0 = zero_f32x16()
    z0 = zero_f32x16()
    for blk in range(nb // SUB_BLOCKS):
        dd = load_scales16(d, db + blk * PANEL)
        dn = load_scales16(dmin, db + blk * PANEL)
        for s in range(SUB_BLOCKS):
            b = blk * SUB_BLOCKS + s
            o = cb + b * PANEL_BLOCK_BYTES
            prefetch_ahead(codes, o, PANEL_BLOCK_BYTES)
            dot = _block_dot(isa, panel_low(codes, o), panel_low(codes, o + 64), panel_low(codes, o + 128),
                             panel_low(codes, o + 192), panel_high(codes, o), panel_high(codes, o + 64),
                             panel_high(codes, o + 128), panel_high(codes, o + 192), xq, m * k + b * BLOCK)
            a0 = fma_i32_bcast(dot, mul_f32x16(load_u8_f32x16(sc, sb + b * PANEL), dd), xd, m * nb + b, a0)
            z0 = fma_bcast(mul_f32x16(load_u8_f32x16(mn, sb + b * PANEL), dn), xs, m * nb + b, z0)
    _store(out, m, lo, hi, add_f32x16(a0, z0))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def kpanel_row_range(isa, xq, xd, xs, codes, sc, mn, d, dmin, out, n_lo, n_hi):  # pragma: no cover - compiled
    """Output rows ``n_lo .. n_hi - 1`` of ``out [M, N]`` (``n_lo`` a multiple of :data:`PANEL`) from the Q4_K panel
    layout; ``xq, xd, xs`` from :func:`._qdot_kernels.quantize_rows`. A called function shared by the standalone
    GEMV and the fused decode layer, as ``_qdot_panel.panel_row_range`` (whose activation-row blocking it repeats)."""
    m_rows = xq.shape[0]
    for m0 in range(0, m_rows, X_ROWS):
        m1 = min(m_rows, m0 + X_ROWS)
        quads = m0 + (m1 - m0) // 4 * 4
        for p in range(n_lo // PANEL, (n_hi + PANEL - 1) // PANEL):
            lo = p * PANEL
            hi = min(n_hi, lo + PANEL)
            for m in range(m0, quads, 4):
                _kpanel_x4(isa, xq, xd, xs, codes, sc, mn, d, dmin, p, m, out, lo, hi)
            for m in range(quads, m1):
                _kpanel_x1(isa, xq, xd, xs, codes, sc, mn, d, dmin, p, m, out, lo, hi)


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_kpanel(isa, xq, xd, xs, codes, sc, mn, d, dmin, out):  # pragma: no cover - compiled
    """:func:`kpanel_row_range` over all ``out.shape[1]`` rows, split over threads in blocks of :data:`ROWS`."""
    n_rows = out.shape[1]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        kpanel_row_range(isa, xq, xd, xs, codes, sc, mn, d, dmin, out, blk * ROWS, min(n_rows, (blk + 1) * ROWS))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_kpanel_serial(isa, xq, xd, xs, codes, sc, mn, d, dmin, out):  # pragma: no cover - compiled
    """:func:`gemv_kpanel` on the calling thread."""
    kpanel_row_range(isa, xq, xd, xs, codes, sc, mn, d, dmin, out, np.int64(0), out.shape[1])
