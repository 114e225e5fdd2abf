"""Int8-activation GEMV rows for ggml's block formats kept whole: Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1.

The activation is the one the group-32 kernels use (:func:`._qdot_kernels.quantize_rows`: int8 codes ``xq``, one
scale ``xd`` per block of 32 values and the block's sum ``xs = xd * sum(xq)``), so a decode layer quantizes its input
once whatever mix of formats its projections hold. Every 32 weights of these formats share one scale, or two for
Q6_K, so each 32-value activation block meets one integer dot product (:mod:`._int8_simd`: ``VPDPBUSD`` or
``VPMADDUBSW + VPMADDWD``) and one float FMA by ``weight scale * xd``:

========  ===================================================================================================
format    row of n's dot with activation row m (``b`` runs over the 32-value blocks, ``q`` the block's codes)
========  ===================================================================================================
q4_k/q5_k ``sum_b d * sc_b * xd_b * dot(q_b, xq_b) - dmin * m_b * xs_b`` (6-bit ``sc``, ``m`` per sub-block)
q6_k      ``sum_b d * xd_b * (sc_2b * dot(q - 32, xq) over 16 values + sc_2b+1 * ... the next 16)``
q5_0      ``sum_b d_b * xd_b * dot(q_b, xq_b) - 16 * d_b * xs_b``
q5_1      ``sum_b d_b * xd_b * dot(q_b, xq_b) + m_b * xs_b``
========  ===================================================================================================

The integer parts are exact (a block's dot stays below 2^24), so the result is ``W_deq @ x_deq`` up to float32
rounding, as for the group-32 formats. The codes are unpacked from the file's bytes in registers
(:mod:`._ggml_simd`, :mod:`._ggml_simd512`); a K-quant block's scales are decoded as one vector and multiplied by the
block's eight activation scales at once, so each dot product needs only a lane broadcast or permute of it.

Two forms, chosen at compile time by the ISA token as in :mod:`._qdot_kernels`: 256-bit rows (one 32-value piece per
dot product; ``avx2`` and ``vnni``) and, for ``vnni512``, 512-bit rows of the K-quants (64 values per dot product).
Q5_0 / Q5_1 have the 256-bit rows only. Measured on Zen 4 (2026-12-04, 5632 x 2048, M = 1, one thread, in cache,
``python benchmarks/qgemv_variants.py --formats q4_k,q6_k``): see ``docs/kernels/quant.md``.

Rows are computed one weight row at a time with every activation row before the next (the weight row stays in L1;
in the parallel GEMV the 512-bit K-quant rows take four activation rows at a time, each chunk of codes unpacked
once for the four: :data:`QUAD_PARALLEL`); under ``vnni512`` a Q4_K weight of one format runs the row panels of
:mod:`._qdot_kpanel` instead, and these rows serve Q5_K, Q6_K, Q5_0 / Q5_1 and two-format weights;
a weight given as two row blocks in different formats (a Q4_K_M file's q|k|v, whose v is Q6_K) is one call:
:func:`ggml_rows` takes both blocks and the row where the second starts.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._ggml_kernels import FMT_CODES
from tessera.backends.cpu.ops._ggml_simd import k_codes, load_f16, q5_codes, q6k_codes
from tessera.backends.cpu.ops._ggml_simd512 import (
    dot_minus32_x2, fma_f32x8, fma_i32_halves_of, fma_i32_lane, k_d_dmin16, k_mins8, k_scales8, k_scales_mins16,
    load_f32x8, load_f32x8_pair, mul_f32x8, mul_f32x16, pair_lanes16, pairs16, q4k_codes_x16, q5k_codes_x2,
    q6k_codes_x2, q6k_scales16, quad_lanes, sum_high8,
)
from tessera.backends.cpu.ops._int8_simd import (
    add_f32x8, dot_s8s8, dot_u8s8, fma_i32, high_nibbles32, load_f32, load_i8x32, low_nibbles32, prefetch,
    sum_f32x8, zero_f32x8,
)
from tessera.backends.cpu.ops._int8_simd512 import (
    add_f32x16, dot_codes_x2, fma_i32x16, is_wide, load_i8x64, sum_f32x16, zero_f32x16,
)
from tessera.backends.cpu.ops._qdot_kernels import BLOCK, ROWS
from tessera.backends.cpu.ops._qdot_wide import PREFETCH_BYTES

#: whether the 512-bit K-quant rows take four activation rows at a time (``quad`` of :func:`ggml_rows`) in the
#: parallel GEMV and in single-threaded code. The same source compiles very differently in the two: 2048 x 2048 and
#: 11264 x 2048 Q4_K at M = 4 and 8 on Zen 5 (2026-12-05), the four-row form took 0.67-0.69x the time of single
#: rows inside the parallel GEMV, and 2.0-2.1x inside the serial GEMV (0.94 against 0.47 ms at M = 8, 2048 x 2048),
#: which is also how the fused decode layer's call compiles. Why LLVM's output differs was not found.
QUAD_PARALLEL = True
QUAD_SERIAL = False
#: the kernels' format codes (:data:`._ggml_kernels.FMT_CODES`)
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = (FMT_CODES[f] for f in ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k"))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _k_row_narrow(isa, xq, xd, xs, m, w, n, five):  # pragma: no cover - compiled
    """Row ``n`` of Q4_K (``five`` False) or Q5_K weights dotted with activation row ``m``, on 256-bit vectors."""
    k = xq.shape[1]
    size = 176 if five else 144
    qs0 = 48 if five else 16
    r = n * w.shape[1]
    xo = m * k
    do = m * xd.shape[1]
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    mins = zero_f32x8()
    for blk in range(k // 256):
        o = r + blk * size
        prefetch(w, o + PREFETCH_BYTES)
        b = do + blk * 8
        # lane j: sub-block j's weight scale times its activation block's scale; its min times the block's sum
        sx = mul_f32x8(mul_f32x8(k_scales8(w, o + 4), load_f16(w, o)), load_f32x8(xd, b))
        mins = fma_f32x8(mul_f32x8(k_mins8(w, o + 4), load_f16(w, o + 2)), load_f32x8(xs, b), mins)
        for c in range(4):
            qs = o + qs0 + 32 * c
            if five:
                lo = k_codes(w, qs, o + 16, False, 1 << (2 * c))
                hi = k_codes(w, qs, o + 16, True, 2 << (2 * c))
            else:
                lo = low_nibbles32(w, qs)
                hi = high_nibbles32(w, qs)
            x = xo + (blk * 8 + 2 * c) * BLOCK
            acc0 = fma_i32_lane(dot_u8s8(isa, lo, load_i8x32(xq, x)), sx, 2 * c, acc0)
            acc1 = fma_i32_lane(dot_u8s8(isa, hi, load_i8x32(xq, x + BLOCK)), sx, 2 * c + 1, acc1)
    return sum_f32x8(add_f32x8(acc0, acc1)) - sum_f32x8(mins)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _k_scales_wide(w, o, five):  # pragma: no cover - compiled
    """A Q4_K / Q5_K block's scales times ``d`` (lanes 0-7) and mins times ``dmin`` (8-15), ``f32x16``. Q4_K's odd
    sub-blocks take 1/16 more: :func:`_k_codes_wide` leaves their nibbles in place."""
    if five:
        return mul_f32x16(k_scales_mins16(w, o + 4), k_d_dmin16(w, o, False))
    return mul_f32x16(k_scales_mins16(w, o + 4), k_d_dmin16(w, o, True))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _k_codes_wide(w, o, c, five):  # pragma: no cover - compiled
    """The 64 codes of chunk ``c`` of the Q4_K / Q5_K block at ``o`` (Q4_K's high nibbles times 16)."""
    if five:
        return q5k_codes_x2(w, o + 48 + 32 * c, o + 16, c)
    return q4k_codes_x16(w, o + 16 + 32 * c)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _k_row_wide(isa, xq, xd, xs, m, w, n, five):  # pragma: no cover - compiled
    """:func:`_k_row_narrow` on 512-bit vectors: a chunk's two sub-blocks (64 codes from 32 bytes) per
    ``VPDPBUSD``, their two scales spread over the halves by one permute. A block's scales and mins are one 16-lane
    vector: lanes 0-7 the sub-blocks' ``d * sc * xd``, 8-15 their ``dmin * m * xs`` (summed at the end)."""
    k = xq.shape[1]
    size = 176 if five else 144
    r = n * w.shape[1]
    xo = m * k
    do = m * xd.shape[1]
    acc0 = zero_f32x16()
    acc1 = zero_f32x16()
    mins = zero_f32x16()
    for blk in range(k // 256):
        o = r + blk * size
        prefetch(w, o + PREFETCH_BYTES)
        b = do + blk * 8
        x = xo + blk * 256
        sm = mul_f32x16(_k_scales_wide(w, o, five), load_f32x8_pair(xd, b, xs, b))
        mins = add_f32x16(mins, sm)
        # two FMA chains, chunks alternating between them
        acc0 = fma_i32x16(dot_codes_x2(isa, w, _k_codes_wide(w, o, 0, five), load_i8x64(xq, x)), pair_lanes16(sm, 0),
                          acc0)
        acc1 = fma_i32x16(dot_codes_x2(isa, w, _k_codes_wide(w, o, 1, five), load_i8x64(xq, x + 64)),
                          pair_lanes16(sm, 2), acc1)
        acc0 = fma_i32x16(dot_codes_x2(isa, w, _k_codes_wide(w, o, 2, five), load_i8x64(xq, x + 128)),
                          pair_lanes16(sm, 4), acc0)
        acc1 = fma_i32x16(dot_codes_x2(isa, w, _k_codes_wide(w, o, 3, five), load_i8x64(xq, x + 192)),
                          pair_lanes16(sm, 6), acc1)
    return sum_f32x16(add_f32x16(acc0, acc1)) - sum_high8(mins)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _k_chunks_x4(isa, xq, w, o, five, x0, x1, x2, x3, s0, s1, s2, s3, a0, a1, a2, a3):  # pragma: no cover
    """The four chunks of the K-quant block at ``o`` dotted with four activation rows (flat offsets ``x0 .. x3`` of
    the block's values), each chunk's codes unpacked once for the four."""
    for c in range(4):
        codes = _k_codes_wide(w, o, c, five)
        a0 = fma_i32x16(dot_codes_x2(isa, w, codes, load_i8x64(xq, x0 + 64 * c)), pair_lanes16(s0, 2 * c), a0)
        a1 = fma_i32x16(dot_codes_x2(isa, w, codes, load_i8x64(xq, x1 + 64 * c)), pair_lanes16(s1, 2 * c), a1)
        a2 = fma_i32x16(dot_codes_x2(isa, w, codes, load_i8x64(xq, x2 + 64 * c)), pair_lanes16(s2, 2 * c), a2)
        a3 = fma_i32x16(dot_codes_x2(isa, w, codes, load_i8x64(xq, x3 + 64 * c)), pair_lanes16(s3, 2 * c), a3)
    return a0, a1, a2, a3


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _k_x4_wide(isa, xq, xd, xs, m, w, n, five, out, col):  # pragma: no cover - compiled
    """Row ``n`` of Q4_K / Q5_K weights dotted with activation rows ``m .. m + 3`` into ``out[m:m + 4, col]``
    (512-bit): a batched decode step or a short prefill chunk unpacks each chunk of codes once for four x rows, as
    the group-32 rows' ``g32_x4`` do."""
    k = xq.shape[1]
    nb = xd.shape[1]
    size = 176 if five else 144
    r = n * w.shape[1]
    a0 = zero_f32x16()
    a1 = zero_f32x16()
    a2 = zero_f32x16()
    a3 = zero_f32x16()
    n0 = zero_f32x16()
    n1 = zero_f32x16()
    n2 = zero_f32x16()
    n3 = zero_f32x16()
    for blk in range(k // 256):
        o = r + blk * size
        prefetch(w, o + PREFETCH_BYTES)
        sm = _k_scales_wide(w, o, five)
        b = blk * 8
        s0 = mul_f32x16(sm, load_f32x8_pair(xd, m * nb + b, xs, m * nb + b))
        s1 = mul_f32x16(sm, load_f32x8_pair(xd, (m + 1) * nb + b, xs, (m + 1) * nb + b))
        s2 = mul_f32x16(sm, load_f32x8_pair(xd, (m + 2) * nb + b, xs, (m + 2) * nb + b))
        s3 = mul_f32x16(sm, load_f32x8_pair(xd, (m + 3) * nb + b, xs, (m + 3) * nb + b))
        n0 = add_f32x16(n0, s0)
        n1 = add_f32x16(n1, s1)
        n2 = add_f32x16(n2, s2)
        n3 = add_f32x16(n3, s3)
        x = blk * 256
        a0, a1, a2, a3 = _k_chunks_x4(isa, xq, w, o, five, m * k + x, (m + 1) * k + x,
                                      (m + 2) * k + x, (m + 3) * k + x, s0, s1, s2, s3, a0, a1, a2, a3)
    out[m, col] = sum_f32x16(a0) - sum_high8(n0)
    out[m + 1, col] = sum_f32x16(a1) - sum_high8(n1)
    out[m + 2, col] = sum_f32x16(a2) - sum_high8(n2)
    out[m + 3, col] = sum_f32x16(a3) - sum_high8(n3)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _k_row(isa, xq, xd, xs, m, w, n, five):  # pragma: no cover - compiled
    if is_wide(isa):
        return _k_row_wide(isa, xq, xd, xs, m, w, n, five)
    return _k_row_narrow(isa, xq, xd, xs, m, w, n, five)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q6k_row_wide(isa, xq, xd, m, w, n):  # pragma: no cover - compiled
    """:func:`_q6k_row_narrow` on 512-bit vectors: 64 codes (four 16-value sub-blocks) per dot product, the block's
    sixteen scales decoded as one vector."""
    k = xq.shape[1]
    r = n * w.shape[1]
    xo = m * k
    do = m * xd.shape[1]
    acc0 = zero_f32x16()
    acc1 = zero_f32x16()
    for blk in range(k // 256):
        o = r + blk * 210
        prefetch(w, o + PREFETCH_BYTES)
        # lane i: 16-value sub-block i's scale times d times the scale of the activation block holding it
        s16 = mul_f32x16(mul_f32x16(q6k_scales16(w, o + 192), load_f16(w, o + 208)),
                         pairs16(load_f32x8(xd, do + blk * 8)))
        x = xo + blk * 256
        acc0 = fma_i32x16(dot_minus32_x2(isa, q6k_codes_x2(w, o, o + 128, False, 0), load_i8x64(xq, x)),
                          quad_lanes(s16, 0), acc0)
        acc1 = fma_i32x16(dot_minus32_x2(isa, q6k_codes_x2(w, o, o + 128, True, 4), load_i8x64(xq, x + 64)),
                          quad_lanes(s16, 1), acc1)
        acc0 = fma_i32x16(dot_minus32_x2(isa, q6k_codes_x2(w, o + 64, o + 160, False, 0), load_i8x64(xq, x + 128)),
                          quad_lanes(s16, 2), acc0)
        acc1 = fma_i32x16(dot_minus32_x2(isa, q6k_codes_x2(w, o + 64, o + 160, True, 4), load_i8x64(xq, x + 192)),
                          quad_lanes(s16, 3), acc1)
    return sum_f32x16(add_f32x16(acc0, acc1))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q6k_row(isa, xq, xd, m, w, n):  # pragma: no cover - compiled
    if is_wide(isa):
        return _q6k_row_wide(isa, xq, xd, m, w, n)
    return _q6k_row_narrow(isa, xq, xd, m, w, n)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q6k_row_narrow(isa, xq, xd, m, w, n):  # pragma: no cover - compiled
    """Row ``n`` of Q6_K weights dotted with activation row ``m``, on 256-bit vectors; the block's sixteen scales
    decoded as one vector, as in :func:`_q6k_row_wide`."""
    k = xq.shape[1]
    r = n * w.shape[1]
    xo = m * k
    do = m * xd.shape[1]
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    for blk in range(k // 256):
        o = r + blk * 210
        prefetch(w, o + PREFETCH_BYTES)
        s16 = mul_f32x16(mul_f32x16(q6k_scales16(w, o + 192), load_f16(w, o + 208)),
                         pairs16(load_f32x8(xd, do + blk * 8)))
        x = xo + blk * 256
        # two halves of 128 values (ql 64 bytes, qh 32 bytes each); chunk j of a half (values 32j .. 32j + 31):
        # ql bytes from 32 (j & 1), nibble j >> 1, qh bits 2j and 2j + 1; its scales are lanes 8h + 2j, + 1
        for h in range(2):
            ql = o + 64 * h
            qh = o + 128 + 32 * h
            xh = x + 128 * h
            acc0 = fma_i32_halves_of(dot_s8s8(isa, q6k_codes(w, ql, qh, False, 0), load_i8x32(xq, xh)),
                                     s16, 4 * h, acc0)
            acc1 = fma_i32_halves_of(dot_s8s8(isa, q6k_codes(w, ql + 32, qh, False, 2), load_i8x32(xq, xh + 32)),
                                     s16, 4 * h + 1, acc1)
            acc0 = fma_i32_halves_of(dot_s8s8(isa, q6k_codes(w, ql, qh, True, 4), load_i8x32(xq, xh + 64)),
                                     s16, 4 * h + 2, acc0)
            acc1 = fma_i32_halves_of(dot_s8s8(isa, q6k_codes(w, ql + 32, qh, True, 6), load_i8x32(xq, xh + 96)),
                                     s16, 4 * h + 3, acc1)
    return sum_f32x8(add_f32x8(acc0, acc1))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _q5_row(isa, xq, xd, xs, m, w, n, has_min):  # pragma: no cover - compiled
    """Row ``n`` of Q5_0 (``has_min`` False) or Q5_1 weights dotted with activation row ``m``."""
    k = xq.shape[1]
    size = 24 if has_min else 22
    qh0 = 4 if has_min else 2
    r = n * w.shape[1]
    xo = m * k
    do = m * xd.shape[1]
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    offsets = np.float32(0.0)
    nb = k // BLOCK
    b = 0
    while b + 1 < nb:
        o = r + b * size
        prefetch(w, o + PREFETCH_BYTES)
        d0 = load_f16(w, o)
        d1 = load_f16(w, o + size)
        acc0 = fma_i32(dot_u8s8(isa, q5_codes(w, o + qh0 + 4, o + qh0), load_i8x32(xq, xo + b * BLOCK)),
                       d0 * load_f32(xd, do + b), acc0)
        acc1 = fma_i32(dot_u8s8(isa, q5_codes(w, o + size + qh0 + 4, o + size + qh0),
                                load_i8x32(xq, xo + (b + 1) * BLOCK)), d1 * load_f32(xd, do + b + 1), acc1)
        m0 = load_f16(w, o + 2) if has_min else np.float32(-16.0) * d0
        m1 = load_f16(w, o + size + 2) if has_min else np.float32(-16.0) * d1
        offsets += m0 * load_f32(xs, do + b) + m1 * load_f32(xs, do + b + 1)
        b += 2
    while b < nb:  # an odd block count (a loop, not an if: see _qdot_kernels._offset)
        o = r + b * size
        d0 = load_f16(w, o)
        acc0 = fma_i32(dot_u8s8(isa, q5_codes(w, o + qh0 + 4, o + qh0), load_i8x32(xq, xo + b * BLOCK)),
                       d0 * load_f32(xd, do + b), acc0)
        m0 = load_f16(w, o + 2) if has_min else np.float32(-16.0) * d0
        offsets += m0 * load_f32(xs, do + b)
        b += 1
    return sum_f32x8(add_f32x8(acc0, acc1)) + offsets


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _block_rows(isa, xq, xd, xs, w, fmt, out, lo, hi, at, quad):  # pragma: no cover - compiled
    """``out[:, at + i]`` for rows ``lo <= i < hi`` of one block of rows ``w`` in format ``fmt``. The format is
    chosen once here, outside the row loops (see ``_qdot_kernels._offset`` for why branches inside cost)."""
    m_rows = xq.shape[0]
    if fmt == Q4_K or fmt == Q5_K:
        five = fmt == Q5_K
        quads = m_rows // 4 * 4 if quad and is_wide(isa) else 0  # four x rows share each chunk's codes
        for n in range(lo, hi):
            for m in range(0, quads, 4):
                _k_x4_wide(isa, xq, xd, xs, m, w, n, five, out, at + n)
            for m in range(quads, m_rows):
                out[m, at + n] = _k_row(isa, xq, xd, xs, m, w, n, five)
    elif fmt == Q6_K:
        for n in range(lo, hi):
            for m in range(m_rows):
                out[m, at + n] = _q6k_row(isa, xq, xd, m, w, n)
    else:
        has_min = fmt == Q5_1
        for n in range(lo, hi):
            for m in range(m_rows):
                out[m, at + n] = _q5_row(isa, xq, xd, xs, m, w, n, has_min)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def ggml_rows(isa, xq, xd, xs, w0, w1, fmt0, fmt1, split, out, lo, hi, quad):  # pragma: no cover - compiled
    """Columns ``lo .. hi - 1`` of ``out [M, N]`` for a weight whose rows ``< split`` are ``w0`` (uint8
    ``[split, row bytes]``, format ``fmt0``) and the rest ``w1`` (format ``fmt1``; pass ``w0`` and ``split = N`` for a
    weight of one format). ``xq, xd, xs`` from :func:`._qdot_kernels.quantize_rows`. ``quad``: the four-row form of
    the 512-bit K-quant rows (:data:`QUAD_PARALLEL`; pass a compile-time constant)."""
    if lo < split:
        _block_rows(isa, xq, xd, xs, w0, fmt0, out, lo, min(hi, split), 0, quad)
    if hi > split:
        _block_rows(isa, xq, xd, xs, w1, fmt1, out, max(lo, split) - split, hi - split, split, quad)


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_ggml(isa, xq, xd, xs, w0, w1, fmt0, fmt1, split, out):  # pragma: no cover - compiled
    """:func:`ggml_rows` over all ``out.shape[1]`` rows, split over threads in blocks of :data:`ROWS`."""
    n_rows = out.shape[1]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        ggml_rows(isa, xq, xd, xs, w0, w1, fmt0, fmt1, split, out, blk * ROWS, min(n_rows, (blk + 1) * ROWS),
                  QUAD_PARALLEL)


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_ggml_serial(isa, xq, xd, xs, w0, w1, fmt0, fmt1, split, out):  # pragma: no cover - compiled
    """:func:`gemv_ggml` on the calling thread."""
    ggml_rows(isa, xq, xd, xs, w0, w1, fmt0, fmt1, split, out, 0, out.shape[1], QUAD_SERIAL)
