"""Numba kernels for decode-shaped quantized matmul (M <= 8 rows of x): memory-bound, each packed weight byte is
read once and widened in registers; the dequantized matrix never exists.

Work is split over blocks of ``ROWS`` output rows (``prange``), so both cores stream disjoint parts of the weight.
Per weight row and group, the kernel forms ``acc = sum_k q[k] * x[k]`` in float32 (integer codes convert exactly)
and applies the group's scale once: ``y += s * acc`` (int8, fp8), ``y += s * (acc - z * xsum)`` (int4) or
``y += s * acc + m * xsum`` (int4_min), where ``xsum`` is the sum of x over the group (precomputed). With one x row
the codes are widened straight into the FMA; with several, a group is widened once into an L1 buffer and then dotted
with every x row, so the widening cost does not grow with M.

8-bit codes arrive as int8 (int8 format) or as the uint8 bits of float8_e4m3fn. e4m3 bits ``seeeemmm`` moved to
``s0eeeemmm0000000`` are the float16 of the same value times 2^-8 (both subnormal ranges line up too), so F16C widens
them exactly; the 2^8 is folded into the scale by the caller.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core.extending import overload

from tessera.backends.cpu.numba_math import FASTMATH, _half_bits_to_f32, group_value

CHUNK = 32  # bytes per vectorized inner loop (literal trip count)
ROWS = 16  # output rows per parallel work item: 256 items at N=4096, plenty for 2..64 threads


def _code(v):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_code, inline="always")
def _code_overload(v):
    if v == types.int8:
        return lambda v: np.float32(v)
    if v == types.uint8:  # float8_e4m3fn bits -> value * 2^-8 via float16
        return lambda v: _half_bits_to_f32(np.int16(((np.int32(v) & 0x80) << 8) | ((np.int32(v) & 0x7F) << 7)))
    if v == types.float32:  # already widened (a row decoded into a buffer)
        return lambda v: v
    return None


@njit(inline="always")
def _log2(group):  # pragma: no cover - compiled
    """log2 of a power-of-two group size: group indices by shifts, since an integer division per chunk was a large
    part of the kernel's time."""
    shift = 0
    while (1 << shift) < group:
        shift += 1
    return shift


@njit(inline="always", fastmath=FASTMATH)
def _dot(a, x):  # pragma: no cover - compiled
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += _code(a[j]) * x[j]
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _dot2(a, x, sa, sb, count):  # pragma: no cover - compiled
    """``count`` codes dotted with x, the first 32 scaled by ``sa``, the rest by ``sb`` (two groups of 32 or one
    larger). Called with a literal 64: LLVM vectorizes that, while loops of 16 or 32 get unrolled first and stay
    scalar."""
    acc = np.float32(0.0)
    for j in range(count):
        acc += (sa if j < 32 else sb) * _code(a[j]) * x[j]
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _dot4s(a, x, s0, s1, s2, s3):  # pragma: no cover - compiled
    """128 codes dotted with x, each quarter with its own scale (groups of 32; equal scales for larger groups):
    longer chunks amortize the per-chunk reduction and slicing (see ``_nib_chunk4``)."""
    acc = np.float32(0.0)
    for j in range(128):
        acc += (s0 if j < 32 else (s1 if j < 64 else (s2 if j < 96 else s3))) * _code(a[j]) * x[j]
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _decode_8bit(row, srow, group, buf):  # pragma: no cover - compiled
    gshift = _log2(group)
    for c in range(row.shape[0] // CHUNK):
        s = group_value(srow[(c * CHUNK) >> gshift])
        for j in range(CHUNK):
            buf[c * CHUNK + j] = s * _code(row[c * CHUNK + j])


@njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
def gemv_8bit(x, q, scales, group, out):  # pragma: no cover - compiled
    """``out[m, n] = sum_g scales[n, g] * sum_{k in g} code(q[n, k]) * x[m, k]``.

    x float32 ``[M, K]``; q int8 or uint8 (e4m3 bits) ``[N, K]``; scales float32 ``[N, K // group]``, group K (per
    channel) or 32, 64 or 128; out float32 ``[M, N]`` (written).
    """
    m_rows, k = x.shape
    n_rows = q.shape[0]
    gshift = _log2(group)
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        buf = np.empty(k, np.float32)
        x0 = x[0]
        for n in range(blk * ROWS, min(n_rows, (blk + 1) * ROWS)):
            row = q[n]
            if m_rows > 1:  # widen the row once into L1, then one plain dot per x row
                if group == k:
                    for j in range(k):
                        buf[j] = group_value(scales[n, 0]) * _code(row[j])
                else:
                    _decode_8bit(row, scales[n], group, buf)
                for m in range(m_rows):
                    out[m, n] = _dot(buf, x[m])
            elif group == k:
                out[0, n] = group_value(scales[n, 0]) * _dot(row, x0)
            else:
                # slices per chunk, not ``row[start + j]``: Numba's negative-index checks on computed indices stop
                # LLVM from vectorizing (measured 8x slower)
                y = np.float32(0.0)
                lo = 0
                while lo + 128 <= k:
                    y += _dot4s(row[lo:lo + 128], x0[lo:lo + 128], group_value(scales[n, lo >> gshift]),
                                group_value(scales[n, (lo + 32) >> gshift]),
                                group_value(scales[n, (lo + 64) >> gshift]),
                                group_value(scales[n, (lo + 96) >> gshift]))
                    lo += 128
                if lo + 64 <= k:
                    y += _dot2(row[lo:lo + 64], x0[lo:lo + 64], group_value(scales[n, lo >> gshift]),
                               group_value(scales[n, (lo + 32) >> gshift]),
                               64)
                if k % 64:  # group 32 and an odd number of groups: one left
                    last = group_value(scales[n, -1])
                    y += _dot2(row[k - 32:], x0[k - 32:], last, last, 32)
                out[0, n] = y


@njit(inline="always", fastmath=FASTMATH)
def _nib_chunk4(b, xlo, xhi, s0, s1, s2, s3):  # pragma: no cover - compiled
    """64 bytes (128 weights) at once, each 16-byte quarter with its own scale: longer chunks amortize the per-chunk
    reduction and slicing (measured 0.91 -> 0.54 ms per 4096 x 4096 on one core)."""
    acc = np.float32(0.0)
    for j in range(64):
        v = b[j]
        s = s0 if j < 16 else (s1 if j < 32 else (s2 if j < 48 else s3))
        acc += s * (np.float32(np.int32(v & 15)) * xlo[j] + np.float32(np.int32(v >> 4)) * xhi[j])
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _nib_chunk(b, xlo, xhi, sa, sb, count):  # pragma: no cover - compiled
    """``count`` (CHUNK, or 16 at a tail) bytes of one row dotted with their x entries; bytes 0..15 use scale ``sa``
    and 16..31 ``sb`` (two groups of 32, or one larger group with ``sa == sb``). int32 casts keep the unpacking in
    32-bit lanes (Numba widens integer ops to int64, which halves the vector width)."""
    acc = np.float32(0.0)
    for j in range(count):
        v = b[j]
        s = sa if j < 16 else sb
        acc += s * (np.float32(np.int32(v & 15)) * xlo[j] + np.float32(np.int32(v >> 4)) * xhi[j])
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _nib_decode(b, sa, sb, oa, ob, wlo, whi):  # pragma: no cover - compiled
    for j in range(b.shape[0]):
        v = b[j]
        s = sa if j < 16 else sb
        o = oa if j < 16 else ob
        wlo[j] = s * np.float32(np.int32(v & 15)) + o
        whi[j] = s * np.float32(np.int32(v >> 4)) + o


@njit(inline="always", fastmath=FASTMATH)
def _offset(s, off, has_min):  # pragma: no cover - compiled
    """The group's additive term per unit of x: ``m`` (int4_min) or ``-z * s`` (int4); both already float32
    (``group_value``)."""
    return off if has_min else -off * s


@njit(inline="always", fastmath=FASTMATH)
def _int4_rows(xlo, xhi, xsum, packed, scales, offsets, has_min, group, out, n_lo, n_hi, wlo, whi):  # pragma: no cover
    """Output rows ``n_lo .. n_hi - 1`` of :func:`gemv_int4`; ``wlo`` / ``whi`` are float32 ``[K // 2]`` scratch."""
    m_rows, half_k = xlo.shape
    ngroups, hshift = scales.shape[1], _log2(group) - 1
    xlo0, xhi0 = xlo[0], xhi[0]
    for n in range(n_lo, n_hi):
        row, srow, orow = packed[n], scales[n], offsets[n]
        if m_rows > 1:  # dequantize the row once into L1, then plain dots per x row
            for lo in range(0, half_k, CHUNK):
                hi = min(lo + CHUNK, half_k)
                ga, gb = lo >> hshift, min(lo + 16, half_k - 1) >> hshift
                sa, sb = group_value(srow[ga]), group_value(srow[gb])
                _nib_decode(row[lo:hi], sa, sb, _offset(sa, group_value(orow[ga]), has_min),
                            _offset(sb, group_value(orow[gb]), has_min), wlo[lo:hi], whi[lo:hi])
            for m in range(m_rows):
                out[m, n] = _dot(wlo, xlo[m]) + _dot(whi, xhi[m])
            continue
        y = np.float32(0.0)
        for g in range(ngroups):
            y += _offset(group_value(srow[g]), group_value(orow[g]), has_min) * xsum[0, g]
        lo = 0
        while lo + 64 <= half_k:
            y += _nib_chunk4(row[lo:lo + 64], xlo0[lo:lo + 64], xhi0[lo:lo + 64], group_value(srow[lo >> hshift]),
                             group_value(srow[(lo + 16) >> hshift]), group_value(srow[(lo + 32) >> hshift]),
                             group_value(srow[(lo + 48) >> hshift]))
            lo += 64
        if lo + CHUNK <= half_k:
            y += _nib_chunk(row[lo:lo + CHUNK], xlo0[lo:lo + CHUNK], xhi0[lo:lo + CHUNK],
                            group_value(srow[lo >> hshift]), group_value(srow[(lo + 16) >> hshift]), CHUNK)
        if half_k % CHUNK:  # group 32 and an odd number of groups: one left
            last = group_value(srow[-1])
            y += _nib_chunk(row[half_k - 16:], xlo0[half_k - 16:], xhi0[half_k - 16:], last, last, 16)
        out[0, n] = y


@njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
def gemv_int4(xlo, xhi, xsum, packed, scales, offsets, has_min, group, out):  # pragma: no cover - compiled
    """int4 codes (two per byte, see ``pack_nibbles``) times x.

    xlo, xhi float32 ``[M, K // 2]``: the x entries of each byte's low and high nibble (x permuted once per call, so
    every loop here is contiguous); xsum float32 ``[M, ng]`` sums of x per group; packed uint8 ``[N, K // 2]``;
    scales float32 ``[N, ng]``; offsets uint8 zero points (``has_min`` False) or float32 mins (True) ``[N, ng]``;
    out float32 ``[M, N]`` (written).
    """
    half_k = xlo.shape[1]
    n_rows = packed.shape[0]
    for blk in prange((n_rows + ROWS - 1) // ROWS):
        wlo, whi = np.empty(half_k, np.float32), np.empty(half_k, np.float32)
        _int4_rows(xlo, xhi, xsum, packed, scales, offsets, has_min, group, out, blk * ROWS,
                   min(n_rows, (blk + 1) * ROWS), wlo, whi)
