"""Int8-activation quantized GEMV: packed int4 / int8 weights dotted with x quantized to int8, in integer SIMD.

The activation rows are quantized once per call, per block of 32 along K (llama.cpp's Q8_0 for activations):
``d = max|x| / 127``, ``q = round(x / d)``. Each block of 32 weights then costs one integer dot product
(:mod:`._int8_simd`: ``VPMADDUBSW + VPMADDWD`` or ``VPDPBUSD``) and one float FMA of its eight int32 partial sums by
``s_w * d``. The result is exactly ``W_deq @ x_deq`` up to float32 rounding of those FMAs, where ``x_deq = q * d`` is
the quantized activation (a relative error of at most ``1/254`` of each block's largest entry): the integer part is
exact, since a block's sum stays below 2^24.

Weight layouts (:class:`tessera.kernels.quant.QuantizedWeight`):

- int4 / int4_min, group 32 (GGUF Q4_0 / Q4_1): a group's 16 bytes hold elements 0-15 in their low nibbles and
  16-31 in their high ones, so ``nibbles16`` yields the group's 32 codes in order.
- int4 / int4_min, group 64 or 128: byte ``j`` of a group holds elements ``j`` and ``j + G/2``; 32 bytes give two
  activation blocks, one from the low nibbles and one from the high.
- int8, group 32 (GGUF Q8_0), 64, 128 or per channel: 32 signed codes per block, in order.

Codes are unsigned for int4 (0..15), so the zero point and the Q4_1 min enter as a per-group term
``offset * sum(x_deq over the group)`` added once per row, not per element.

The group-32 rows (GGUF's formats) have two forms, picked at compile time from the ISA token: the 256-bit rows here,
and for the ``vnni512`` token the 512-bit rows of :mod:`._qdot_wide`, two blocks per instruction. The choice is a
compile-time constant of the token's type (:func:`._int8_simd512.is_wide`), so each specialization keeps one form.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH, group_value, widen
from tessera.backends.cpu.ops import _qdot_wide as wide
from tessera.backends.cpu.ops._int8_simd import (
    add_f32x8, block_codes, dot_codes, dot_s8s8, dot_u8s8, fma_i32, high_nibbles32, load_f32, load_i8x32,
    low_nibbles32, nibbles16, prefetch, sum_f32x8, zero_f32x8,
)
from tessera.backends.cpu.ops._int8_simd512 import is_wide

BLOCK = 32  # activation elements per int8 scale
ROWS = 16  # output rows per parallel work item
#: activation width up to which int4 rows are dotted two at a time (see int4_rows)
PAIR_MAX_K = 1536


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def quantize_row(x, m, xq, xd, xs):  # pragma: no cover - compiled
    """Row ``m`` of storage ``x [M, K]`` (float32, bf16 or fp16 bits; K a multiple of 32) into int8 codes
    ``xq[m]``, block scales ``xd[m]`` and block sums ``xs[m] = d * sum(q)`` (the block's sum of ``x_deq``)."""
    k = x.shape[1]
    for b in range(k // BLOCK):
        amax = np.float32(0.0)
        for j in range(BLOCK):
            amax = max(amax, abs(widen(x[m, b * BLOCK + j])))
        d = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for j in range(BLOCK):
            q = np.int32(math.floor(widen(x[m, b * BLOCK + j]) * inv + np.float32(0.5)))
            xq[m, b * BLOCK + j] = np.int8(q)
            total += q
        xd[m, b] = d
        xs[m, b] = d * np.float32(total)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def quantize_rows(x):  # pragma: no cover - compiled
    """All rows of ``x`` (see :func:`quantize_row`); returns ``(xq int8 [M, K], xd, xs float32 [M, K // 32])``."""
    m_rows, k = x.shape
    xq = np.empty((m_rows, k), dtype=np.int8)
    xd = np.empty((m_rows, k // BLOCK), dtype=np.float32)
    xs = np.empty((m_rows, k // BLOCK), dtype=np.float32)
    for m in range(m_rows):
        quantize_row(x, m, xq, xd, xs)
    return xq, xd, xs


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def quantize_activations(x):  # pragma: no cover - compiled
    """:func:`quantize_rows` as a kernel of its own (what the per-op matmul and the tests call)."""
    return quantize_rows(x)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _group_sums(xs, group, m):  # pragma: no cover - compiled
    """Sum of ``x_deq`` over each weight group of row ``m`` (from the block sums)."""
    per = group // BLOCK
    ng = xs.shape[1] // per
    out = np.empty(ng, dtype=np.float32)
    for g in range(ng):
        total = np.float32(0.0)
        for j in range(per):
            total += xs[m, g * per + j]
        out[g] = total
    return out


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _int4_offsets(gsum, scales, offsets, keep, n):  # pragma: no cover - compiled
    """Row ``n``'s zero-point (``-z * s``) or min term against the group sums of x; ``keep`` from
    :func:`_offset_keep`."""
    y = np.float32(0.0)
    for g in range(gsum.shape[0]):
        y += _offset(offsets, scales, keep, n, g) * gsum[g]
    return y


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _offset_keep(has_min):  # pragma: no cover - compiled
    """1 for Q4_1-style mins (added as they are), 0 for zero points (times ``-scale``)."""
    return np.float32(1.0) if has_min else np.float32(0.0)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _offset(offsets, scales, keep, n, g):  # pragma: no cover - compiled
    """Group ``g``'s additive term per unit of x: the min, or ``-z * s``, without a branch. Why: an ``if`` that reads
    arrays inside these per-row functions made Numba keep its reference-count calls (NRT_incref / NRT_decref, with a
    VZEROUPPER each) in every row; on 576-wide rows they cost as much as the 512-bit dot itself."""
    return group_value(offsets[n, g]) * (keep - (np.float32(1.0) - keep) * group_value(scales[n, g]))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _g32_row_narrow(isa, xq, xd, m, w, scales, n):  # pragma: no cover - compiled
    """Scaled integer dot of group-32 weight row ``n`` with activation row ``m`` (for int4 without the zero-point
    term). ``w`` is packed int4 (uint8, 16 bytes a block) or int8 (32 bytes a block): ``block_codes`` and
    ``dot_codes`` pick the unpacking and the dot product from its dtype at compile time."""
    nb = xd.shape[1]
    per = w.shape[1] // nb
    xo = m * xq.shape[1]
    do = m * nb
    r = n * w.shape[1]
    s = n * scales.shape[1]
    # Two accumulators: one FMA chain per row is bound by the FMA latency (4 cycles per block of 32); two chains
    # took a 4096 x 4096 int4 row kernel from 25-28 to 31-36 GMAC/s per core on Zen 4 (in cache, 2026-12-02).
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    b = 0
    while b + 1 < nb:
        prefetch(w, r + b * per + wide.PREFETCH_BYTES)  # see _qdot_wide.PREFETCH_BYTES
        acc0 = fma_i32(dot_codes(isa, w, block_codes(w, r + b * per), load_i8x32(xq, xo + b * BLOCK)),
                       load_f32(scales, s + b) * load_f32(xd, do + b), acc0)
        acc1 = fma_i32(dot_codes(isa, w, block_codes(w, r + (b + 1) * per), load_i8x32(xq, xo + (b + 1) * BLOCK)),
                       load_f32(scales, s + b + 1) * load_f32(xd, do + b + 1), acc1)
        b += 2
    while b < nb:  # an odd block count (a loop, not an if: see _offset)
        acc0 = fma_i32(dot_codes(isa, w, block_codes(w, r + b * per), load_i8x32(xq, xo + b * BLOCK)),
                       load_f32(scales, s + b) * load_f32(xd, do + b), acc0)
        b += 1
    return sum_f32x8(add_f32x8(acc0, acc1))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _g32_block_x4(isa, xq, xd, m, w, scales, n, b, acc0, acc1, acc2, acc3):  # pragma: no cover - compiled
    """Block ``b`` of group-32 weight row ``n`` (as :func:`_g32_row_narrow`) dotted with activation rows
    ``m .. m + 3``, each FMA'd into its own accumulator: the block's codes unpacked and its scale loaded once for the
    four rows. Returns the four accumulators."""
    nb = xd.shape[1]
    k = xq.shape[1]
    c = block_codes(w, n * w.shape[1] + b * (w.shape[1] // nb))
    sw = load_f32(scales, n * scales.shape[1] + b)
    o = b * BLOCK
    acc0 = fma_i32(dot_codes(isa, w, c, load_i8x32(xq, m * k + o)), sw * load_f32(xd, m * nb + b), acc0)
    acc1 = fma_i32(dot_codes(isa, w, c, load_i8x32(xq, (m + 1) * k + o)), sw * load_f32(xd, (m + 1) * nb + b), acc1)
    acc2 = fma_i32(dot_codes(isa, w, c, load_i8x32(xq, (m + 2) * k + o)), sw * load_f32(xd, (m + 2) * nb + b), acc2)
    acc3 = fma_i32(dot_codes(isa, w, c, load_i8x32(xq, (m + 3) * k + o)), sw * load_f32(xd, (m + 3) * nb + b), acc3)
    return acc0, acc1, acc2, acc3


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _g32_x4_narrow(isa, xq, xd, m, w, scales, n):  # pragma: no cover - compiled
    """Group-32 weight row ``n`` (int4 or int8, as :func:`_g32_row_narrow`) dotted with activation rows
    ``m .. m + 3`` (:func:`_g32_block_x4` per block). Returns the four dots (for int4 without the zero-point terms).
    Each row is accumulated as :func:`_g32_row_narrow` does (even blocks on one chain, odd on another, an odd last
    block on the even chain), so its bits do not depend on the rows that share the call."""
    nb = xd.shape[1]
    a0 = zero_f32x8()
    a1 = zero_f32x8()
    a2 = zero_f32x8()
    a3 = zero_f32x8()
    e0 = zero_f32x8()
    e1 = zero_f32x8()
    e2 = zero_f32x8()
    e3 = zero_f32x8()
    b = 0
    while b + 1 < nb:
        a0, a1, a2, a3 = _g32_block_x4(isa, xq, xd, m, w, scales, n, b, a0, a1, a2, a3)
        e0, e1, e2, e3 = _g32_block_x4(isa, xq, xd, m, w, scales, n, b + 1, e0, e1, e2, e3)
        b += 2
    while b < nb:  # an odd block count (a loop, not an if: see _offset)
        a0, a1, a2, a3 = _g32_block_x4(isa, xq, xd, m, w, scales, n, b, a0, a1, a2, a3)
        b += 1
    return (sum_f32x8(add_f32x8(a0, e0)), sum_f32x8(add_f32x8(a1, e1)), sum_f32x8(add_f32x8(a2, e2)),
            sum_f32x8(add_f32x8(a3, e3)))


# ---------------------------------------------------------------------------------------- width dispatch
# ``is_wide(isa)`` is a compile-time constant per token, so LLVM keeps one branch of each of these.
@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _g32_row(isa, xq, xd, m, w, scales, n):  # pragma: no cover - compiled
    if is_wide(isa):
        return wide.g32_row(isa, xq, xd, m, w, scales, n)
    return _g32_row_narrow(isa, xq, xd, m, w, scales, n)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _g32_x4(isa, xq, xd, m, w, scales, n):  # pragma: no cover - compiled
    if is_wide(isa):
        return wide.g32_x4(isa, xq, xd, m, w, scales, n)
    return _g32_x4_narrow(isa, xq, xd, m, w, scales, n)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _int4_row(isa, xq, xd, m, packed, scales, group, n):  # pragma: no cover - compiled
    """Scaled integer dot of row ``n`` (group 64, 128, ...; group 32 is :func:`_g32_row`) with activation row
    ``m``."""
    nb = xd.shape[1]
    hk = packed.shape[1]
    ng = scales.shape[1]
    acc0 = zero_f32x8()  # two FMA chains, as in _g32_row_narrow
    acc1 = zero_f32x8()
    xo = m * xq.shape[1]
    do = m * nb
    r = n * hk
    per = group // BLOCK  # activation blocks per group; the low nibbles hold the first half of them
    half = per // 2
    for g in range(ng):
        sw = load_f32(scales, n * ng + g)
        for c in range(half):
            off = r + g * (group // 2) + c * BLOCK
            blo = g * per + c
            bhi = blo + half
            acc0 = fma_i32(dot_u8s8(isa, low_nibbles32(packed, off), load_i8x32(xq, xo + blo * BLOCK)),
                           sw * load_f32(xd, do + blo), acc0)
            acc1 = fma_i32(dot_u8s8(isa, high_nibbles32(packed, off), load_i8x32(xq, xo + bhi * BLOCK)),
                           sw * load_f32(xd, do + bhi), acc1)
    return sum_f32x8(add_f32x8(acc0, acc1))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _int4_row_x4(isa, xq, xd, gsums, m, packed, scales, offsets, keep, n, out):  # pragma: no cover - compiled
    """Row ``n`` of group-32 int4 weights dotted with activation rows ``m .. m + 3`` into ``out[m:m + 4, n]``."""
    y0, y1, y2, y3 = _g32_x4(isa, xq, xd, m, packed, scales, n)
    # each row's zero-point or min term summed on its own and added last, as a single row adds it: the same bits
    out[m, n] = y0 + _int4_offsets(gsums[m], scales, offsets, keep, n)
    out[m + 1, n] = y1 + _int4_offsets(gsums[m + 1], scales, offsets, keep, n)
    out[m + 2, n] = y2 + _int4_offsets(gsums[m + 2], scales, offsets, keep, n)
    out[m + 3, n] = y3 + _int4_offsets(gsums[m + 3], scales, offsets, keep, n)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _int4_row_pair(isa, xq, xd, gsums, m, packed, scales, offsets, keep, n, out):  # pragma: no cover - compiled
    """Rows ``n`` and ``n + 1`` of group-32 int4 weights dotted with activation row ``m`` into ``out[m, n:n + 2]``:
    four FMA chains instead of two, each activation block loaded once for both rows."""
    nb = xd.shape[1]
    hk = packed.shape[1]
    ng = scales.shape[1]
    a0 = zero_f32x8()
    a1 = zero_f32x8()
    b0 = zero_f32x8()
    b1 = zero_f32x8()
    xo = m * xq.shape[1]
    do = m * nb
    r0 = n * hk
    r1 = r0 + hk
    s0 = n * ng
    s1 = s0 + ng
    b = 0
    while b + 1 < nb:
        x0 = load_i8x32(xq, xo + b * BLOCK)
        x1 = load_i8x32(xq, xo + b * BLOCK + BLOCK)
        d0 = load_f32(xd, do + b)
        d1 = load_f32(xd, do + b + 1)
        a0 = fma_i32(dot_u8s8(isa, nibbles16(packed, r0 + b * 16), x0), load_f32(scales, s0 + b) * d0, a0)
        b0 = fma_i32(dot_u8s8(isa, nibbles16(packed, r1 + b * 16), x0), load_f32(scales, s1 + b) * d0, b0)
        a1 = fma_i32(dot_u8s8(isa, nibbles16(packed, r0 + b * 16 + 16), x1), load_f32(scales, s0 + b + 1) * d1, a1)
        b1 = fma_i32(dot_u8s8(isa, nibbles16(packed, r1 + b * 16 + 16), x1), load_f32(scales, s1 + b + 1) * d1, b1)
        b += 2
    while b < nb:  # an odd block count (a loop, not an if: see _offset)
        x0 = load_i8x32(xq, xo + b * BLOCK)
        d0 = load_f32(xd, do + b)
        a0 = fma_i32(dot_u8s8(isa, nibbles16(packed, r0 + b * 16), x0), load_f32(scales, s0 + b) * d0, a0)
        b0 = fma_i32(dot_u8s8(isa, nibbles16(packed, r1 + b * 16), x0), load_f32(scales, s1 + b) * d0, b0)
        b += 1
    out[m, n] = sum_f32x8(add_f32x8(a0, a1)) + _int4_offsets(gsums[m], scales, offsets, keep, n)
    out[m, n + 1] = sum_f32x8(add_f32x8(b0, b1)) + _int4_offsets(gsums[m], scales, offsets, keep, n + 1)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def int4_rows(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out, n_lo, n_hi):  # pragma: no cover
    """Output rows ``n_lo .. n_hi - 1`` of ``out [M, N]`` for int4 / int4_min weights (see the module docstring):
    ``xq, xd, xs`` from :func:`quantize_rows`, ``packed`` uint8 ``[N, K // 2]``, ``scales`` ``[N, ng]`` float32 or
    float16 bits (int16), ``offsets`` uint8 zero points or mins in the scales' type ``[N, ng]``."""
    # One weight row at a time, not four sharing each activation load: four rows are twelve address streams (codes,
    # scales, offsets of each), which the hardware prefetchers serve far below the memory's rate. Measured on Zen 3
    # (2026-12-02, M=1, 4096 x 4096 g32, one thread): 1.44 ms one row at a time against 2.70 ms four at a time
    # from DRAM, 1.21 vs 2.62 ms from L3, equal on SmolLM2's cache-resident shapes (the activation row stays in L1).
    # With several rows of x (a prefill chunk, a batched decode) each weight row is dotted with every x row before
    # the next weight row: the weight row stays in L1 and the x rows (M * K int8) in L2. x rows outside, as before,
    # re-read every weight row from L3 once per x row: a 128-token SmolLM2 prefill spent 4.2 ms per projection
    # there (Zen 4, 2026-12-02).
    m_rows = xq.shape[0]
    gsums = np.empty((m_rows, scales.shape[1]), dtype=np.float32)
    for m in range(m_rows):
        gsums[m, :] = _group_sums(xs, group, m)
    keep = _offset_keep(has_min)
    if group == BLOCK:
        _int4_rows_g32(isa, xq, xd, gsums, packed, scales, offsets, keep, out, n_lo, n_hi)
    else:
        for n in range(n_lo, n_hi):
            for m in range(m_rows):
                out[m, n] = _int4_row(isa, xq, xd, m, packed, scales, group, n) + \
                    _int4_offsets(gsums[m], scales, offsets, keep, n)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _int4_rows_g32(isa, xq, xd, gsums, packed, scales, offsets, keep, out, n_lo, n_hi):  # pragma: no cover
    """:func:`int4_rows` for group 32 (GGUF's Q4_0 / Q4_1)."""
    m_rows = xq.shape[0]
    # Four x rows share each unpacked weight block: at M = 8 on SmolLM2's shapes the unpacking, the per-row scale
    # loads and the zero-point term were half of the work done row by row.
    quads = m_rows // 4 * 4
    n = n_lo
    # Short rows in pairs on the 256-bit rows: a 576-wide row is 18 blocks, so each of its two FMA chains is only nine
    # FMAs long and the row's tail (horizontal sum, the 18-group offsets term) is latency the next row cannot hide;
    # two rows at once give four chains. On Zen 4, one thread, in cache: 8-20% less time on SmolLM2's rows (K = 576
    # and 1536), but 10% more on 4096-wide rows, whose chains are already long; hence the K limit.
    if xq.shape[1] <= PAIR_MAX_K and quads < m_rows and not is_wide(isa):
        while n + 1 < n_hi:
            for m in range(0, quads, 4):
                _int4_row_x4(isa, xq, xd, gsums, m, packed, scales, offsets, keep, n, out)
                _int4_row_x4(isa, xq, xd, gsums, m, packed, scales, offsets, keep, n + 1, out)
            for m in range(quads, m_rows):
                _int4_row_pair(isa, xq, xd, gsums, m, packed, scales, offsets, keep, n, out)
            n += 2
    for n in range(n, n_hi):
        for m in range(0, quads, 4):
            _int4_row_x4(isa, xq, xd, gsums, m, packed, scales, offsets, keep, n, out)
        for m in range(quads, m_rows):
            out[m, n] = _g32_row(isa, xq, xd, m, packed, scales, n) + \
                _int4_offsets(gsums[m], scales, offsets, keep, n)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _int8_row(isa, xq, xd, m, q, scales, group, n):  # pragma: no cover - compiled
    """Scaled integer dot of int8 row ``n`` per channel or in groups of 64, 128, ... (group 32 is :func:`_g32_row`)
    with activation row ``m``."""
    nb = xd.shape[1]
    k = q.shape[1]
    ng = scales.shape[1]
    xo = m * xq.shape[1]
    do = m * nb
    r = n * k
    # two FMA chains, as in _int4_row
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    if ng == 1:  # per channel: one scale for the row, applied at the end
        b = 0
        while b + 1 < nb:
            acc0 = fma_i32(dot_s8s8(isa, load_i8x32(q, r + b * BLOCK), load_i8x32(xq, xo + b * BLOCK)),
                           load_f32(xd, do + b), acc0)
            acc1 = fma_i32(dot_s8s8(isa, load_i8x32(q, r + b * BLOCK + BLOCK), load_i8x32(xq, xo + b * BLOCK + BLOCK)),
                           load_f32(xd, do + b + 1), acc1)
            b += 2
        while b < nb:  # an odd block count (a loop, not an if: see _offset)
            acc0 = fma_i32(dot_s8s8(isa, load_i8x32(q, r + b * BLOCK), load_i8x32(xq, xo + b * BLOCK)),
                           load_f32(xd, do + b), acc0)
            b += 1
        return (sum_f32x8(add_f32x8(acc0, acc1))) * load_f32(scales, n)
    per = group // BLOCK
    for g in range(ng):  # group 64 or 128 (any multiple of 32 works: an odd block count leaves one for acc0)
        sw = load_f32(scales, n * ng + g)
        for c in range(0, per - 1, 2):
            b = g * per + c
            acc0 = fma_i32(dot_s8s8(isa, load_i8x32(q, r + b * BLOCK), load_i8x32(xq, xo + b * BLOCK)),
                           sw * load_f32(xd, do + b), acc0)
            acc1 = fma_i32(dot_s8s8(isa, load_i8x32(q, r + b * BLOCK + BLOCK), load_i8x32(xq, xo + b * BLOCK + BLOCK)),
                           sw * load_f32(xd, do + b + 1), acc1)
        if per % 2:
            b = g * per + per - 1
            acc0 = fma_i32(dot_s8s8(isa, load_i8x32(q, r + b * BLOCK), load_i8x32(xq, xo + b * BLOCK)),
                           sw * load_f32(xd, do + b), acc0)
    return sum_f32x8(add_f32x8(acc0, acc1))


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _int8_row_x4(isa, xq, xd, m, q, scales, n, out):  # pragma: no cover - compiled
    """Row ``n`` of group-32 int8 weights dotted with activation rows ``m .. m + 3`` into ``out[m:m + 4, n]``."""
    y0, y1, y2, y3 = _g32_x4(isa, xq, xd, m, q, scales, n)
    out[m, n] = y0
    out[m + 1, n] = y1
    out[m + 2, n] = y2
    out[m + 3, n] = y3


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def int8_rows(isa, xq, xd, q, scales, group, out, n_lo, n_hi):  # pragma: no cover - compiled
    """Output rows ``n_lo .. n_hi - 1`` of ``out [M, N]`` for int8 weights ``q [N, K]`` with scales ``[N, ng]``
    (float32 or float16 bits as int16; group 32, 64, 128 or per channel, K a multiple of 32)."""
    m_rows = xq.shape[0]
    # The format is chosen here, once, not inside the per-row function (see _offset for why that matters).
    if group == BLOCK and scales.shape[1] > 1:  # group 32 (GGUF Q8_0): four x rows at a time, as in int4
        quads = m_rows // 4 * 4
        for n in range(n_lo, n_hi):  # weight rows outside, as in int4_rows
            for m in range(0, quads, 4):
                _int8_row_x4(isa, xq, xd, m, q, scales, n, out)
            for m in range(quads, m_rows):
                out[m, n] = _g32_row(isa, xq, xd, m, q, scales, n)
    else:
        for n in range(n_lo, n_hi):
            for m in range(m_rows):
                out[m, n] = _int8_row(isa, xq, xd, m, q, scales, group, n)


@njit(inline="always")
def zero_index():  # pragma: no cover - compiled
    """0 typed as int64: a literal 0 passed to a called kernel makes Numba compile a second specialization for
    ``Literal[int](0)`` (the serial GEMV would then not share the parallel one's row kernel)."""
    return np.int64(0)


# The row kernels proper are called, not inlined, by the parallel and serial GEMVs here and by the fused decode layer
# (backends/cpu/decode_layer.py): each compiles once per (ISA token, weight types) and is linked into every caller.
# Inlined, the same ~20 s of LLVM work was repeated for each of the three callers of every variant and weight kind
# (measured on Zen 5, 2026-12-04: int4 float32 scales cost 19.5 s serial + 32.7 s parallel), which made a cold first
# run, and the kernel tests, several times slower to compile. One call per 16-row work item costs nothing measurable.
@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def int4_row_range(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out, n_lo, n_hi):  # pragma: no cover
    """:func:`int4_rows` as a called (not inlined) function."""
    int4_rows(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out, n_lo, n_hi)


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def int8_row_range(isa, xq, xd, q, scales, group, out, n_lo, n_hi):  # pragma: no cover - compiled
    """:func:`int8_rows` as a called (not inlined) function."""
    int8_rows(isa, xq, xd, q, scales, group, out, n_lo, n_hi)


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_int4(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out):  # pragma: no cover - compiled
    """:func:`int4_rows` over all rows, split over threads in blocks of :data:`ROWS`."""
    n_rows = packed.shape[0]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        int4_row_range(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out, blk * ROWS,
                       min(n_rows, (blk + 1) * ROWS))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_int4_serial(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out):  # pragma: no cover
    """:func:`gemv_int4` on the calling thread."""
    int4_row_range(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out, zero_index(), packed.shape[0])


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_int8(isa, xq, xd, q, scales, group, out):  # pragma: no cover - compiled
    """:func:`int8_rows` over all rows, split over threads in blocks of :data:`ROWS`."""
    n_rows = q.shape[0]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        int8_row_range(isa, xq, xd, q, scales, group, out, blk * ROWS, min(n_rows, (blk + 1) * ROWS))


@njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gemv_int8_serial(isa, xq, xd, q, scales, group, out):  # pragma: no cover - compiled
    """:func:`gemv_int8` on the calling thread."""
    int8_row_range(isa, xq, xd, q, scales, group, out, zero_index(), q.shape[0])
