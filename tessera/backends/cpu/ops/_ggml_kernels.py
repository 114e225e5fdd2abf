"""Numba kernels for ggml's block formats kept whole (:mod:`tessera.kernels.ggml_blocks`: Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K): a GEMV that decodes each weight row once into float32 (in L1) and dots it with every row of x, and a row
de-quantizer for the tiles of the BLAS path.

Float activations, float32 accumulation: the portable kernel on every CPU. Each row's decode is amortized over the M
rows of x; at M = 1 it costs about as much as the dot, so decode is not yet at the memory roof that int8-activation
dot products (as the Q4_0/Q4_1/Q8_0 ``qgemv`` variants use) would reach.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import widen

#: format -> the kernels' integer code for it
FMT_CODES = {"q5_0": 0, "q5_1": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4}
_VALUES = (32, 32, 256, 256, 256)
_BYTES = (22, 24, 144, 176, 210)


@njit(inline="always")
def _half(row, at):  # pragma: no cover - compiled
    return widen(np.int16(np.int64(row[at]) | (np.int64(row[at + 1]) << 8)))


@njit(inline="always")
def _k_scale_min(row, o, j):  # pragma: no cover - compiled
    """The 6-bit scale and min of sub-block ``j`` (0..7) of the q4_k / q5_k block at byte ``o``."""
    s = o + 4
    if j < 4:
        return np.int64(row[s + j]) & 63, np.int64(row[s + j + 4]) & 63
    sc = (np.int64(row[s + j + 4]) & 15) | ((np.int64(row[s + j - 4]) >> 6) << 4)
    mn = (np.int64(row[s + j + 4]) >> 4) | ((np.int64(row[s + j]) >> 6) << 4)
    return sc, mn


@njit(fastmath=True)
def _decode_row(row, fmt, k, out):  # pragma: no cover - compiled
    """float32 ``out[:k]`` <- one row of blocks."""
    values, size = _VALUES[fmt], _BYTES[fmt]
    for blk in range(k // values):
        o, base = blk * size, blk * values
        if fmt <= 1:  # q5_0, q5_1
            d = _half(row, o)
            at = o + 2 if fmt == 0 else o + 4
            m = np.float32(-16.0) * d if fmt == 0 else _half(row, o + 2)
            qh = (np.int64(row[at]) | (np.int64(row[at + 1]) << 8) | (np.int64(row[at + 2]) << 16)
                  | (np.int64(row[at + 3]) << 24))
            for j in range(16):
                b = np.int64(row[at + 4 + j])
                lo = (b & 15) | (((qh >> j) & 1) << 4)
                hi = (b >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[base + j] = np.float32(lo) * d + m
                out[base + j + 16] = np.float32(hi) * d + m
        elif fmt <= 3:  # q4_k, q5_k
            d, dmin = _half(row, o), _half(row, o + 2)
            qs = o + 16 if fmt == 2 else o + 48
            for c in range(4):
                sc0, m0 = _k_scale_min(row, o, 2 * c)
                sc1, m1 = _k_scale_min(row, o, 2 * c + 1)
                d0, d1 = d * np.float32(sc0), d * np.float32(sc1)
                n0, n1 = dmin * np.float32(m0), dmin * np.float32(m1)
                for lane in range(32):
                    q = np.int64(row[qs + 32 * c + lane])
                    q0, q1 = q & 15, q >> 4
                    if fmt == 3:
                        h = np.int64(row[o + 16 + lane])
                        q0 += ((h >> (2 * c)) & 1) << 4
                        q1 += ((h >> (2 * c + 1)) & 1) << 4
                    out[base + 64 * c + lane] = d0 * np.float32(q0) - n0
                    out[base + 64 * c + 32 + lane] = d1 * np.float32(q1) - n1
        else:  # q6_k
            d = _half(row, o + 208)
            for h in range(2):
                ql, qh, sc = o + 64 * h, o + 128 + 32 * h, o + 192 + 8 * h
                for g in range(2):  # lanes 16g .. 16g + 15 share four scales: hoisted out of the lane loop
                    f1 = d * np.float32(np.int8(row[sc + g]))
                    f2 = d * np.float32(np.int8(row[sc + g + 2]))
                    f3 = d * np.float32(np.int8(row[sc + g + 4]))
                    f4 = d * np.float32(np.int8(row[sc + g + 6]))
                    for lane in range(16 * g, 16 * g + 16):
                        a, b = np.int32(row[ql + lane]), np.int32(row[ql + lane + 32])
                        hb = np.int32(row[qh + lane])
                        at = base + 128 * h + lane
                        out[at] = f1 * np.float32(((a & 15) | ((hb & 3) << 4)) - 32)
                        out[at + 32] = f2 * np.float32(((b & 15) | (((hb >> 2) & 3) << 4)) - 32)
                        out[at + 64] = f3 * np.float32(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32)
                        out[at + 96] = f4 * np.float32(((b >> 4) | (((hb >> 6) & 3) << 4)) - 32)


@njit(fastmath=True)
def _decode_row_q4k_nibble_order(row, k, out):  # pragma: no cover - compiled
    """A q4_k row into float32 ``out`` in the order its bytes hold the values: per block, the 128 low nibbles, then
    the 128 high ones (value ``64c + l`` is at ``l + 32c`` and ``64c + 32 + l`` at ``128 + 32c + l``). One loop of
    128 lanes with the sub-block's scale picked per lane vectorizes; four loops of 32 in value order are unrolled by
    Numba and left scalar. :func:`nibble_order` puts x in the same order."""
    for blk in range(k // 256):
        o, base = blk * 144, blk * 256
        d, dmin = _half(row, o), _half(row, o + 2)
        sa, ma = _k_scale_min(row, o, 0)
        sb, mb = _k_scale_min(row, o, 1)
        sc_, mc = _k_scale_min(row, o, 2)
        sd, md = _k_scale_min(row, o, 3)
        se, me = _k_scale_min(row, o, 4)
        sf, mf = _k_scale_min(row, o, 5)
        sg, mg = _k_scale_min(row, o, 6)
        sh, mh = _k_scale_min(row, o, 7)
        lo_s = (d * np.float32(sa), d * np.float32(sc_), d * np.float32(se), d * np.float32(sg))
        hi_s = (d * np.float32(sb), d * np.float32(sd), d * np.float32(sf), d * np.float32(sh))
        lo_m = (dmin * np.float32(ma), dmin * np.float32(mc), dmin * np.float32(me), dmin * np.float32(mg))
        hi_m = (dmin * np.float32(mb), dmin * np.float32(md), dmin * np.float32(mf), dmin * np.float32(mh))
        for lane in range(128):  # the sub-block's scale chosen by selects, which vectorize (blends)
            c = lane >> 5
            s0 = lo_s[0] if c == 0 else lo_s[1] if c == 1 else lo_s[2] if c == 2 else lo_s[3]
            s1 = hi_s[0] if c == 0 else hi_s[1] if c == 1 else hi_s[2] if c == 2 else hi_s[3]
            m0 = lo_m[0] if c == 0 else lo_m[1] if c == 1 else lo_m[2] if c == 2 else lo_m[3]
            m1 = hi_m[0] if c == 0 else hi_m[1] if c == 1 else hi_m[2] if c == 2 else hi_m[3]
            q = np.int32(row[o + 16 + lane])
            out[base + lane] = s0 * np.float32(q & 15) - m0
            out[base + 128 + lane] = s1 * np.float32(q >> 4) - m1


@njit(cache=True)
def nibble_order(x):  # pragma: no cover - compiled
    """x ``[M, K]`` permuted within each 256-value block to q4_k's nibble order (see above)."""
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for base in range(0, x.shape[1], 256):
            for lane in range(128):
                src = base + 64 * (lane >> 5) + (lane & 31)
                out[r, base + lane] = x[r, src]
                out[r, base + 128 + lane] = x[r, src + 32]
    return out


@njit(parallel=True, fastmath=True, cache=True)
def gemv(x, data, fmt, out):  # pragma: no cover - compiled
    """float32 ``out [M, N] = x [M, K] @ W.T`` for the rows of blocks ``data [N, row_bytes]`` in format ``fmt``."""
    m, k = x.shape
    q4k = fmt == 2
    xs = nibble_order(x) if q4k else x
    for i in prange(data.shape[0]):
        w = np.empty(k, np.float32)
        if q4k:
            _decode_row_q4k_nibble_order(data[i], k, w)
        else:
            _decode_row(data[i], fmt, k, w)
        for r in range(m):
            acc = np.float32(0.0)
            for j in range(k):
                acc += w[j] * xs[r, j]
            out[r, i] = acc


@njit(parallel=True, fastmath=True, cache=True)
def dequantize_rows(data, fmt, k, lo, out):  # pragma: no cover - compiled
    """float32 ``out [R, K]`` <- rows ``lo : lo + R`` of ``data``."""
    for i in prange(out.shape[0]):
        _decode_row(data[lo + i], fmt, k, out[i])
