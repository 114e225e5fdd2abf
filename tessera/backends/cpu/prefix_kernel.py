"""The shared-prefix (cascade) pass as a Numba kernel: many stacked queries against one prefix, at GEMM speed.

A cascade group stacks ``n`` requests' queries; per kv head that is ``R = n * group`` query rows against the same
prefix keys, a real GEMM-shaped problem (R = 128 for 32 requests of a 32/8-head model). The kernel runs it
FlashAttention-style over key tiles of ``KEY_TILE``, with every product in the outer-product form that keeps the
FMA ports busy and needs no horizontal sums:

* ``Qt [D, Rp]`` is the group's queries transposed once per head (query rows padded to ``ROW_BLOCK``), so
  ``St[t, r] = sum_x K[t, x] * Qt[x, r]``: :func:`_st_6x4` broadcasts one element of 6 keys and multiplies it into
  4 vectors of query rows (24 accumulators);
* the online softmax then runs down the key axis with query rows in the lanes (vector max, exp and sums);
* ``Ot[x, r] += sum_t V[t, x] * Pt[t, r]``: :func:`_ot_6x4`, the same shape with 6 head-dim positions.

Transposing the queries instead of the keys costs ``R * D`` per head once, not per key tile. K and V are read
straight from their token rows (paged or contiguous, float32 or 16-bit). Work items are (kv head, key part), cut so
that every core gets at least two; parts merge by log-sum-exp on the host.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.simd import LANES, line_elements, prefetch, vadd, vbroadcast, vexp, vfma, vhmax, vload, vmax, vmul, vsplat, vstore, vsub

#: keys per tile of the online softmax (``St`` / ``Pt`` stay in L1/L2); a multiple of 6, the key block of _st_6x4
KEY_TILE = 60
#: query rows per register block: 4 vectors
ROW_BLOCK = 4 * LANES


@njit(inline="always", fastmath=FASTMATH)
def _st_6x4(k, ko, t0, d, qt, r0, rp, st):  # pragma: no cover - compiled
    """``st[t0 + i, r0 : r0 + ROW_BLOCK] = K[key t0 + i] . Qt[:, r0 : r0 + ROW_BLOCK]`` for ``i < 6``; ``ko[t]`` is
    the flat offset of key ``t``'s head vector in ``k``."""
    o0 = ko[t0]
    o1 = ko[t0 + 1]
    o2 = ko[t0 + 2]
    o3 = ko[t0 + 3]
    o4 = ko[t0 + 4]
    o5 = ko[t0 + 5]
    a00 = a01 = a02 = a03 = vsplat(0.0)
    a10 = a11 = a12 = a13 = vsplat(0.0)
    a20 = a21 = a22 = a23 = vsplat(0.0)
    a30 = a31 = a32 = a33 = vsplat(0.0)
    a40 = a41 = a42 = a43 = vsplat(0.0)
    a50 = a51 = a52 = a53 = vsplat(0.0)
    for x in range(d):
        base = x * rp + r0
        q0 = vload(qt, base)
        q1 = vload(qt, base + LANES)
        q2 = vload(qt, base + 2 * LANES)
        q3 = vload(qt, base + 3 * LANES)
        b = vbroadcast(k, o0 + x)
        a00 = vfma(b, q0, a00)
        a01 = vfma(b, q1, a01)
        a02 = vfma(b, q2, a02)
        a03 = vfma(b, q3, a03)
        b = vbroadcast(k, o1 + x)
        a10 = vfma(b, q0, a10)
        a11 = vfma(b, q1, a11)
        a12 = vfma(b, q2, a12)
        a13 = vfma(b, q3, a13)
        b = vbroadcast(k, o2 + x)
        a20 = vfma(b, q0, a20)
        a21 = vfma(b, q1, a21)
        a22 = vfma(b, q2, a22)
        a23 = vfma(b, q3, a23)
        b = vbroadcast(k, o3 + x)
        a30 = vfma(b, q0, a30)
        a31 = vfma(b, q1, a31)
        a32 = vfma(b, q2, a32)
        a33 = vfma(b, q3, a33)
        b = vbroadcast(k, o4 + x)
        a40 = vfma(b, q0, a40)
        a41 = vfma(b, q1, a41)
        a42 = vfma(b, q2, a42)
        a43 = vfma(b, q3, a43)
        b = vbroadcast(k, o5 + x)
        a50 = vfma(b, q0, a50)
        a51 = vfma(b, q1, a51)
        a52 = vfma(b, q2, a52)
        a53 = vfma(b, q3, a53)
    s = t0 * rp + r0
    vstore(st, s, a00)
    vstore(st, s + LANES, a01)
    vstore(st, s + 2 * LANES, a02)
    vstore(st, s + 3 * LANES, a03)
    s += rp
    vstore(st, s, a10)
    vstore(st, s + LANES, a11)
    vstore(st, s + 2 * LANES, a12)
    vstore(st, s + 3 * LANES, a13)
    s += rp
    vstore(st, s, a20)
    vstore(st, s + LANES, a21)
    vstore(st, s + 2 * LANES, a22)
    vstore(st, s + 3 * LANES, a23)
    s += rp
    vstore(st, s, a30)
    vstore(st, s + LANES, a31)
    vstore(st, s + 2 * LANES, a32)
    vstore(st, s + 3 * LANES, a33)
    s += rp
    vstore(st, s, a40)
    vstore(st, s + LANES, a41)
    vstore(st, s + 2 * LANES, a42)
    vstore(st, s + 3 * LANES, a43)
    s += rp
    vstore(st, s, a50)
    vstore(st, s + LANES, a51)
    vstore(st, s + 2 * LANES, a52)
    vstore(st, s + 3 * LANES, a53)


@njit(inline="always", fastmath=FASTMATH)
def _st_1x4(k, o, t, d, qt, r0, rp, st):  # pragma: no cover - compiled
    """One key of :func:`_st_6x4` (the tile's last ``tn % 6`` keys)."""
    a0 = a1 = a2 = a3 = vsplat(0.0)
    for x in range(d):
        base = x * rp + r0
        b = vbroadcast(k, o + x)
        a0 = vfma(b, vload(qt, base), a0)
        a1 = vfma(b, vload(qt, base + LANES), a1)
        a2 = vfma(b, vload(qt, base + 2 * LANES), a2)
        a3 = vfma(b, vload(qt, base + 3 * LANES), a3)
    s = t * rp + r0
    vstore(st, s, a0)
    vstore(st, s + LANES, a1)
    vstore(st, s + 2 * LANES, a2)
    vstore(st, s + 3 * LANES, a3)


@njit(inline="always", fastmath=FASTMATH)
def _ot_6x4(v, vo, tn, x0, pt, r0, rp, ot):  # pragma: no cover - compiled
    """``ot[x0 + i, r0 : r0 + ROW_BLOCK] += sum_t V[key t, x0 + i] * pt[t, r0 : r0 + ROW_BLOCK]`` for ``i < 6``."""
    s0 = x0 * rp + r0
    s1 = s0 + rp
    s2 = s1 + rp
    s3 = s2 + rp
    s4 = s3 + rp
    s5 = s4 + rp
    a00 = vload(ot, s0)
    a01 = vload(ot, s0 + LANES)
    a02 = vload(ot, s0 + 2 * LANES)
    a03 = vload(ot, s0 + 3 * LANES)
    a10 = vload(ot, s1)
    a11 = vload(ot, s1 + LANES)
    a12 = vload(ot, s1 + 2 * LANES)
    a13 = vload(ot, s1 + 3 * LANES)
    a20 = vload(ot, s2)
    a21 = vload(ot, s2 + LANES)
    a22 = vload(ot, s2 + 2 * LANES)
    a23 = vload(ot, s2 + 3 * LANES)
    a30 = vload(ot, s3)
    a31 = vload(ot, s3 + LANES)
    a32 = vload(ot, s3 + 2 * LANES)
    a33 = vload(ot, s3 + 3 * LANES)
    a40 = vload(ot, s4)
    a41 = vload(ot, s4 + LANES)
    a42 = vload(ot, s4 + 2 * LANES)
    a43 = vload(ot, s4 + 3 * LANES)
    a50 = vload(ot, s5)
    a51 = vload(ot, s5 + LANES)
    a52 = vload(ot, s5 + 2 * LANES)
    a53 = vload(ot, s5 + 3 * LANES)
    for t in range(tn):
        base = t * rp + r0
        p0 = vload(pt, base)
        p1 = vload(pt, base + LANES)
        p2 = vload(pt, base + 2 * LANES)
        p3 = vload(pt, base + 3 * LANES)
        o = vo[t] + x0
        b = vbroadcast(v, o)
        a00 = vfma(b, p0, a00)
        a01 = vfma(b, p1, a01)
        a02 = vfma(b, p2, a02)
        a03 = vfma(b, p3, a03)
        b = vbroadcast(v, o + 1)
        a10 = vfma(b, p0, a10)
        a11 = vfma(b, p1, a11)
        a12 = vfma(b, p2, a12)
        a13 = vfma(b, p3, a13)
        b = vbroadcast(v, o + 2)
        a20 = vfma(b, p0, a20)
        a21 = vfma(b, p1, a21)
        a22 = vfma(b, p2, a22)
        a23 = vfma(b, p3, a23)
        b = vbroadcast(v, o + 3)
        a30 = vfma(b, p0, a30)
        a31 = vfma(b, p1, a31)
        a32 = vfma(b, p2, a32)
        a33 = vfma(b, p3, a33)
        b = vbroadcast(v, o + 4)
        a40 = vfma(b, p0, a40)
        a41 = vfma(b, p1, a41)
        a42 = vfma(b, p2, a42)
        a43 = vfma(b, p3, a43)
        b = vbroadcast(v, o + 5)
        a50 = vfma(b, p0, a50)
        a51 = vfma(b, p1, a51)
        a52 = vfma(b, p2, a52)
        a53 = vfma(b, p3, a53)
    vstore(ot, s0, a00)
    vstore(ot, s0 + LANES, a01)
    vstore(ot, s0 + 2 * LANES, a02)
    vstore(ot, s0 + 3 * LANES, a03)
    vstore(ot, s1, a10)
    vstore(ot, s1 + LANES, a11)
    vstore(ot, s1 + 2 * LANES, a12)
    vstore(ot, s1 + 3 * LANES, a13)
    vstore(ot, s2, a20)
    vstore(ot, s2 + LANES, a21)
    vstore(ot, s2 + 2 * LANES, a22)
    vstore(ot, s2 + 3 * LANES, a23)
    vstore(ot, s3, a30)
    vstore(ot, s3 + LANES, a31)
    vstore(ot, s3 + 2 * LANES, a32)
    vstore(ot, s3 + 3 * LANES, a33)
    vstore(ot, s4, a40)
    vstore(ot, s4 + LANES, a41)
    vstore(ot, s4 + 2 * LANES, a42)
    vstore(ot, s4 + 3 * LANES, a43)
    vstore(ot, s5, a50)
    vstore(ot, s5 + LANES, a51)
    vstore(ot, s5 + 2 * LANES, a52)
    vstore(ot, s5 + 3 * LANES, a53)


@njit(inline="always", fastmath=FASTMATH)
def _ot_1x4(v, vo, tn, x, pt, r0, rp, ot):  # pragma: no cover - compiled
    """One head-dim position of :func:`_ot_6x4` (the last ``D % 6``)."""
    s = x * rp + r0
    a0 = vload(ot, s)
    a1 = vload(ot, s + LANES)
    a2 = vload(ot, s + 2 * LANES)
    a3 = vload(ot, s + 3 * LANES)
    for t in range(tn):
        base = t * rp + r0
        b = vbroadcast(v, vo[t] + x)
        a0 = vfma(b, vload(pt, base), a0)
        a1 = vfma(b, vload(pt, base + LANES), a1)
        a2 = vfma(b, vload(pt, base + 2 * LANES), a2)
        a3 = vfma(b, vload(pt, base + 3 * LANES), a3)
    vstore(ot, s, a0)
    vstore(ot, s + LANES, a1)
    vstore(ot, s + 2 * LANES, a2)
    vstore(ot, s + 3 * LANES, a3)


@njit(inline="always", fastmath=FASTMATH)
def _key_offsets(offs, j0, count, row_base, block, hkv, hk, d):  # pragma: no cover - compiled
    """``offs[t]``: flat offset of head ``hk`` of key ``j0 + t`` (``t < count``), walking pages without a division
    per key (two 64-bit divisions per key were ~5% of a tile)."""
    if count <= 0:
        return
    page = j0 // block
    slot = j0 - page * block
    for t in range(count):
        offs[t] = ((row_base[page] + slot) * hkv + hk) * d
        slot += 1
        if slot == block:
            slot = 0
            page += 1


@njit(inline="always", fastmath=FASTMATH)
def _prefetch_keys(k, v, offs, t_lo, t_hi, d):  # pragma: no cover - compiled
    """Prefetch the head vectors (``d`` elements at ``offs[t]``) of keys ``t_lo <= t < t_hi`` in K and V."""
    step = line_elements(k)
    for t in range(t_lo, t_hi):
        for x in range(0, d, step):
            prefetch(k, offs[t] + x)
            prefetch(v, offs[t] + x)


@njit(inline="always", fastmath=FASTMATH)
def _softmax_tile(st, tn, rp, m, l, ot, d, softcap):  # pragma: no cover - compiled
    """Online softmax down the key axis of ``st [tn, rp]`` (query rows in the lanes); rescales ``ot`` and ``l``."""
    if softcap > 0.0:
        for e in range(tn * rp):
            st[e] = softcap * math.tanh(st[e] / softcap)
    for r in range(0, rp, LANES):
        mx = vload(st, r)
        for t in range(1, tn):
            mx = vmax(mx, vload(st, t * rp + r))
        m_old = vload(m, r)
        m_new = vmax(m_old, mx)
        alpha = vexp(vsub(m_old, m_new))  # 0 on the first tile (m_old = -inf); every score here is finite
        total = vsplat(0.0)
        for t in range(tn):
            p = vexp(vsub(vload(st, t * rp + r), m_new))
            vstore(st, t * rp + r, p)
            total = vadd(total, p)
        vstore(m, r, m_new)
        if vhmax(vsub(m_new, m_old)) > 0.0:  # some row's max grew: rescale (after the first tiles, rarely)
            vstore(l, r, vadd(vmul(vload(l, r), alpha), total))
            for x in range(d):
                vstore(ot, x * rp + r, vmul(vload(ot, x * rp + r), alpha))
        else:
            vstore(l, r, vadd(vload(l, r), total))


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def shared_prefix_kernel(q, k, v, q_rows, row_base, block, part_bounds, scale, softcap, out, lse):  # pragma: no cover
    """Attention of the stacked queries ``q[q_rows]`` to the prefix keys, unmasked, one result per key part.

    q : f32 ``[tokens, Hq, D]``; k, v : ``[rows, Hkv, D]`` f32 / uint16 (bf16 bits) / int16 (fp16 bits), C-contiguous.
    q_rows : int64 ``[n]``; row_base : int64 ``[pages]``: key ``j`` is row ``row_base[j // block] + j % block``.
    part_bounds : int64 ``[parts + 1]``: key ranges of the parts. softcap : 0 disables.
    out : f32 ``[parts, n, Hq, D]`` and lse : f32 ``[parts, n, Hq]``, written for every part (the caller merges).
    """
    hkv = k.shape[1]
    d = k.shape[2]
    group = q.shape[1] // hkv
    n = q_rows.shape[0]
    rows = n * group
    rp = (rows + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK
    parts = part_bounds.shape[0] - 1
    for item in prange(hkv * parts):
        hk = item // parts
        part = item % parts
        qt = np.zeros(d * rp, dtype=np.float32)  # padded rows stay 0: finite scores, never written out
        for i in range(n):
            for g in range(group):
                for x in range(d):
                    qt[x * rp + i * group + g] = q[q_rows[i], hk * group + g, x] * scale
        ot = np.zeros(d * rp, dtype=np.float32)
        m = np.full(rp, -np.inf, dtype=np.float32)
        l = np.zeros(rp, dtype=np.float32)
        st = np.empty(KEY_TILE * rp, dtype=np.float32)
        ko = np.empty(KEY_TILE, dtype=np.int64)
        nko = np.empty(KEY_TILE, dtype=np.int64)
        j_end = part_bounds[part + 1]
        for j0 in range(part_bounds[part], j_end, KEY_TILE):
            tn = min(KEY_TILE, j_end - j0)
            _key_offsets(ko, j0, tn, row_base, block, hkv, hk, d)
            # The next tile's head vectors (512 B every 4 KiB token row at Hkv=8) are prefetched during this tile's
            # first row block.
            nn = max(0, min(KEY_TILE, j_end - j0 - KEY_TILE))
            _key_offsets(nko, j0 + KEY_TILE, nn, row_base, block, hkv, hk, d)
            for r0 in range(0, rp, ROW_BLOCK):
                t = 0
                while t + 6 <= tn:
                    if r0 == 0:
                        _prefetch_keys(k, v, nko, min(t, nn), min(t + 6, nn), d)
                    _st_6x4(k, ko, t, d, qt, r0, rp, st)
                    t += 6
                if r0 == 0:
                    _prefetch_keys(k, v, nko, min(t, nn), nn, d)
                for t1 in range(t, tn):
                    _st_1x4(k, ko[t1], t1, d, qt, r0, rp, st)
            _softmax_tile(st, tn, rp, m, l, ot, d, softcap)
            for r0 in range(0, rp, ROW_BLOCK):
                x = 0
                while x + 6 <= d:
                    _ot_6x4(v, ko, tn, x, st, r0, rp, ot)
                    x += 6
                for x1 in range(x, d):
                    _ot_1x4(v, ko, tn, x1, st, r0, rp, ot)
        for i in range(n):
            for g in range(group):
                r = i * group + g
                h = hk * group + g
                if l[r] > 0.0:
                    inv = np.float32(1.0) / l[r]
                    for x in range(d):
                        out[part, i, h, x] = ot[x * rp + r] * inv
                    lse[part, i, h] = m[r] + math.log(l[r])
                else:
                    for x in range(d):
                        out[part, i, h, x] = 0.0
                    lse[part, i, h] = -np.inf


@njit(inline="always", fastmath=FASTMATH)
def _merge_member(i, out, lse, q_rows, part_out, part_lse):  # pragma: no cover - compiled
    """Member ``i`` of :func:`merge_prefix_parts`."""
    parts, _, hq, d = part_out.shape
    row = q_rows[i]
    for h in range(hq):
        mx = lse[row, h]
        for p in range(parts):
            mx = max(mx, part_lse[p, i, h])
        if mx == -np.inf:
            continue  # nothing visible anywhere: the row stays as the suffix pass left it (zeros, -inf)
        w0 = math.exp(lse[row, h] - mx)
        total = w0
        for x in range(d):
            out[row, h, x] *= w0
        for p in range(parts):
            w = math.exp(part_lse[p, i, h] - mx)
            total += w
            for x in range(d):
                out[row, h, x] += w * part_out[p, i, h, x]
        inv = 1.0 / total
        for x in range(d):
            out[row, h, x] *= inv
        lse[row, h] = mx + math.log(total)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def merge_prefix_parts(out, lse, q_rows, part_out, part_lse):  # pragma: no cover - compiled
    """Fold the prefix parts into the members' rows of ``out [tokens, Hq, D]`` / ``lse [tokens, Hq]`` (float32,
    holding their suffix results) by log-sum-exp, in place; ``part_out [parts, n, Hq, D]``, ``part_lse [parts, n,
    Hq]`` from :func:`shared_prefix_kernel`."""
    for i in prange(part_out.shape[1]):
        _merge_member(i, out, lse, q_rows, part_out, part_lse)


@njit(fastmath=FASTMATH, cache=True)
def merge_prefix_parts_serial(out, lse, q_rows, part_out, part_lse):  # pragma: no cover - compiled
    """:func:`merge_prefix_parts` on the calling thread (small merges: 32 members x 32 heads x 128 took 0.06 ms
    this way against 0.12 ms waking the pool)."""
    for i in range(part_out.shape[1]):
        _merge_member(i, out, lse, q_rows, part_out, part_lse)
