"""The ``vnni512`` forms of the group-32 quantized GEMV rows: two activation blocks per 512-bit ``VPDPBUSD``.

Same arithmetic as the 256-bit rows of :mod:`._qdot_kernels` (whose docstring has the layouts and the quantized
activation), in pairs of blocks: the unpack, the dot product, the conversion and the FMA each cover 64 weights, and a
pair's two scales are multiplied together and spread over the vector's halves (:func:`._int8_simd512.scales_x2`). A
row whose block count is not a multiple of the pair (or of the four-block unroll) finishes on the 256-bit operations,
so any K that is a multiple of 32 works. :mod:`._qdot_kernels` calls these only with the ``vnni512`` token.

One function per shape serves both formats: ``w`` is packed int4 (uint8, 16 bytes a block, codes unsigned) or int8
(32 bytes a block, codes signed), and :func:`._int8_simd512.block_codes_x2` / :func:`~._int8_simd512.dot_codes_x2`
pick the unpacking and the dot product from its dtype when the kernel is compiled.

The tails are ``while`` loops that run at most once, not ``if`` blocks: an ``if`` that reads arrays inside these
inlined per-row functions makes Numba keep reference-count calls in every row (see ``_qdot_kernels._offset``).
"""

from __future__ import annotations

from numba import njit

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._int8_simd import (
    block_codes, dot_codes, fma_i32, load_f32, load_i8x32, prefetch, sum_f32x8, zero_f32x8,
)
from tessera.backends.cpu.ops._int8_simd512 import (
    add_f32x16, block_codes_x2, dot_codes_x2, fma_i32x16, load_i8x64, scales_x2, sum_f32x16, zero_f32x16,
)

BLOCK = 32
#: how far ahead of the block being dotted a row asks for weight bytes (:func:`._int8_simd.prefetch`): two 1024-byte
#: rows of a 2048-wide int4 matrix. On Zen 4 (2026-12-02, 5632 x 2048 Q4_0 rotating over 80 MB, one thread) 1024 to
#: 4096 took the streamed GEMV from 448 to 351-365 us; at two threads the gain was within the machine's noise.
PREFETCH_BYTES = 2048


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def g32_row(isa, xq, xd, m, w, scales, n):  # pragma: no cover - compiled
    """Scaled integer dot of group-32 weight row ``n`` (int4 or int8, see the module docstring) with activation
    row ``m`` (for int4 without the zero-point term)."""
    nb = xd.shape[1]
    per = w.shape[1] // nb  # bytes of a block: 16 packed int4, 32 int8
    xo = m * xq.shape[1]
    do = m * nb
    r = n * w.shape[1]
    s = n * scales.shape[1]
    # Two accumulators: each FMA chain waits out the FMA latency once per four blocks instead of twice.
    acc0 = zero_f32x16()
    acc1 = zero_f32x16()
    b = 0
    while b + 3 < nb:
        prefetch(w, r + b * per + PREFETCH_BYTES)
        acc0 = fma_i32x16(dot_codes_x2(isa, w, block_codes_x2(w, r + b * per), load_i8x64(xq, xo + b * BLOCK)),
                          scales_x2(scales, s + b, xd, do + b), acc0)
        acc1 = fma_i32x16(dot_codes_x2(isa, w, block_codes_x2(w, r + (b + 2) * per),
                                       load_i8x64(xq, xo + (b + 2) * BLOCK)),
                          scales_x2(scales, s + b + 2, xd, do + b + 2), acc1)
        b += 4
    while b + 1 < nb:  # at most once
        acc0 = fma_i32x16(dot_codes_x2(isa, w, block_codes_x2(w, r + b * per), load_i8x64(xq, xo + b * BLOCK)),
                          scales_x2(scales, s + b, xd, do + b), acc0)
        b += 2
    total = sum_f32x16(add_f32x16(acc0, acc1))
    while b < nb:  # an odd block count: the last block on 256-bit vectors
        tail = fma_i32(dot_codes(isa, w, block_codes(w, r + b * per), load_i8x32(xq, xo + b * BLOCK)),
                       load_f32(scales, s + b) * load_f32(xd, do + b), zero_f32x8())
        total += sum_f32x8(tail)
        b += 1
    return total


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def g32_x4(isa, xq, xd, m, w, scales, n):  # pragma: no cover - compiled
    """Group-32 weight row ``n`` dotted with activation rows ``m .. m + 3``: each pair of blocks unpacked once for the
    four rows. Returns the four dots (for int4 without the zero-point terms).

    Each row is accumulated exactly as :func:`g32_row` accumulates it (the same two chains over the same blocks,
    the same final sums), so a token's result does not depend on how many rows share the call: speculative
    verification (several tokens of a sequence) and batched decode then give the bits a lone decode gives."""
    nb = xd.shape[1]
    k = xq.shape[1]
    per = w.shape[1] // nb
    s = n * scales.shape[1]
    r = n * w.shape[1]
    a0 = zero_f32x16()
    a1 = zero_f32x16()
    a2 = zero_f32x16()
    a3 = zero_f32x16()
    b0 = zero_f32x16()
    b1 = zero_f32x16()
    b2 = zero_f32x16()
    b3 = zero_f32x16()
    x0, x1, x2, x3 = m * k, (m + 1) * k, (m + 2) * k, (m + 3) * k
    d0, d1, d2, d3 = m * nb, (m + 1) * nb, (m + 2) * nb, (m + 3) * nb
    b = 0
    while b + 3 < nb:
        c = block_codes_x2(w, r + b * per)
        e = block_codes_x2(w, r + (b + 2) * per)
        o = b * BLOCK
        p = o + 2 * BLOCK
        a0 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x0 + o)), scales_x2(scales, s + b, xd, d0 + b), a0)
        a1 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x1 + o)), scales_x2(scales, s + b, xd, d1 + b), a1)
        a2 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x2 + o)), scales_x2(scales, s + b, xd, d2 + b), a2)
        a3 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x3 + o)), scales_x2(scales, s + b, xd, d3 + b), a3)
        b0 = fma_i32x16(dot_codes_x2(isa, w, e, load_i8x64(xq, x0 + p)),
                        scales_x2(scales, s + b + 2, xd, d0 + b + 2), b0)
        b1 = fma_i32x16(dot_codes_x2(isa, w, e, load_i8x64(xq, x1 + p)),
                        scales_x2(scales, s + b + 2, xd, d1 + b + 2), b1)
        b2 = fma_i32x16(dot_codes_x2(isa, w, e, load_i8x64(xq, x2 + p)),
                        scales_x2(scales, s + b + 2, xd, d2 + b + 2), b2)
        b3 = fma_i32x16(dot_codes_x2(isa, w, e, load_i8x64(xq, x3 + p)),
                        scales_x2(scales, s + b + 2, xd, d3 + b + 2), b3)
        b += 4
    while b + 1 < nb:  # at most once
        c = block_codes_x2(w, r + b * per)
        o = b * BLOCK
        a0 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x0 + o)), scales_x2(scales, s + b, xd, d0 + b), a0)
        a1 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x1 + o)), scales_x2(scales, s + b, xd, d1 + b), a1)
        a2 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x2 + o)), scales_x2(scales, s + b, xd, d2 + b), a2)
        a3 = fma_i32x16(dot_codes_x2(isa, w, c, load_i8x64(xq, x3 + o)), scales_x2(scales, s + b, xd, d3 + b), a3)
        b += 2
    y0 = sum_f32x16(add_f32x16(a0, b0))
    y1 = sum_f32x16(add_f32x16(a1, b1))
    y2 = sum_f32x16(add_f32x16(a2, b2))
    y3 = sum_f32x16(add_f32x16(a3, b3))
    while b < nb:  # an odd block count: the last block on 256-bit vectors
        c8 = block_codes(w, r + b * per)
        sw = load_f32(scales, s + b)
        o = b * BLOCK
        y0 += sum_f32x8(fma_i32(dot_codes(isa, w, c8, load_i8x32(xq, x0 + o)), sw * load_f32(xd, d0 + b), zero_f32x8()))
        y1 += sum_f32x8(fma_i32(dot_codes(isa, w, c8, load_i8x32(xq, x1 + o)), sw * load_f32(xd, d1 + b), zero_f32x8()))
        y2 += sum_f32x8(fma_i32(dot_codes(isa, w, c8, load_i8x32(xq, x2 + o)), sw * load_f32(xd, d2 + b), zero_f32x8()))
        y3 += sum_f32x8(fma_i32(dot_codes(isa, w, c8, load_i8x32(xq, x3 + o)), sw * load_f32(xd, d3 + b), zero_f32x8()))
        b += 1
    return y0, y1, y2, y3
