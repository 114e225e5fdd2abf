"""Numba kernels for decode-shaped attention (a few queries against a long KV): memory-bound, one pass over K and V.

One work item is one (sequence, kv part): a contiguous range of the sequence's kv segments, for every head. Reading
whole token rows ``[Hkv, D]`` keeps the memory stream contiguous (per-head items would touch a new 4 KiB page per
token at Hkv=8, D=128, fp32, which defeats the hardware prefetchers). Each item streams its keys in chunks of
``CHUNK``, scores every query row (``Hq * q_len`` rows) against the chunk, and folds it into an online softmax whose
state stays in L1/L2. K and V are read exactly once. Long sequences are split into several parts (split-KV, as in
flash-decoding) so that a small batch still fills every core; :func:`merge_parts_kernel` combines the parts by their
log-sum-exp.

Head dims that are a multiple of the SIMD width (``simd.LANES``) run :func:`_decode_item_blocked`: the same item
structure with register-blocked micro-kernels (``attn_microkernels.py``), a vector online softmax, and software
prefetch one phase ahead: while a chunk's Q.K pass reads its K, it hints the same keys' V rows into the caches, and
while the P.V pass reads V, it hints the next chunk's K rows. The hints walk the token rows in address order and are
spread evenly over the compute, a few lines per step. Both matter: the micro-kernels read 4 token rows at a time in
64-byte pieces, an order in which the hardware prefetchers fetch at a third of the streaming rate, and the same
hints issued in bursts, or in the micro-kernels' own order, gained far less (measured in ``docs/performance.md``,
"Read order and prefetch"). Other head dims run the scalar :func:`_decode_item`.

Lengths are run-time values, so new lengths never recompile; a kernel is compiled once per storage dtype (float32;
bf16 and fp16 arrive as 16-bit integer views and are widened by bit operations) and cached on disk.

Quantized pages (``tessera.kv.quantized``: int8 or fp8 e4m3 codes, one float16 scale per token and kv head) run the
same items, read as stored, so a step streams ``D + 2`` bytes per token and head instead of bf16's ``2 D``. The codes
widen in registers as the float dtypes do (``simd._widen``); e4m3 arrives as its uint8 bits, whose widened float is
the e4m3 value times 2^-120, and the 2^120 is folded into the scales (``unit``). Only the scales are extra work: a
key's scale multiplies its scores once per chunk (``q . (c s) = s (q . c)``), a value's scale multiplies the
probabilities after the softmax has summed them (``p (c s) = (p s) c``), so the per-element work stays one widening
and one FMA. Float rows pass :data:`NO_SCALES`, an empty array, and skip both multiplies.

KV addressing is paged: key ``j`` of sequence ``s`` lives in row ``row_base[s, j // block] + j % block`` of
``k [rows, Hkv, D]``. A contiguous sequence is one "page" as long as the sequence (``row_base[s, 0] = kv_start``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from tessera.backends.cpu.attn_microkernels import (
    PV_COLS,
    prefetch_run,
    pv_1x1,
    pv_1x4,
    pv_4x4,
    qk_1x1,
    qk_4x4,
)
from tessera.backends.cpu.kernel_args import DecodeSchedule
from tessera.backends.cpu.numba_math import FASTMATH, fast_exp, widen
from tessera.backends.cpu.simd import (
    LANES,
    line_elements,
    vadd,
    vexp,
    vhmax,
    vload,
    vmax,
    vmul,
    vsplat,
    vstore,
    vsub,
    vsum,
    vzero,
)

CHUNK = 32
#: the ``ks`` / ``vs`` of float rows: no scales (a 0-row int16 array, the type the float16 scale bits have)
NO_SCALES = np.empty((0, 0), dtype=np.int16)
#: what a widened code is multiplied by besides its scale: e4m3 bits widen to the value times 2^-120 (``simd._widen``)
FP8_UNIT = np.float32(2.0 ** 120)


def code_unit(k: np.ndarray) -> np.float32:
    """``unit`` for rows of ``k``'s dtype: 2^120 for e4m3 bits (uint8), else 1."""
    return FP8_UNIT if k.dtype == np.uint8 else np.float32(1.0)


@njit(inline="always", fastmath=FASTMATH)
def _dot_n(qrows, r, krow, n):  # pragma: no cover - compiled
    acc = np.float32(0.0)
    for x in range(n):
        acc += qrows[r, x] * widen(krow[x])
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _dot(qrows, r, krow, d):  # pragma: no cover - compiled
    """``qrows[r] . krow``. Common head dims get a literal trip count, which LLVM unrolls into straight zmm/ymm code
    (measured: 10.5 -> 9.3 ms for the B=8, L=4096 fp32 decode)."""
    if d == 128:
        return _dot_n(qrows, r, krow, 128)
    if d == 64:
        return _dot_n(qrows, r, krow, 64)
    return _dot_n(qrows, r, krow, d)


@njit(inline="always", fastmath=FASTMATH)
def _axpy_n(acc, r, p, vrow, n):  # pragma: no cover - compiled
    for x in range(n):
        acc[r, x] += p * widen(vrow[x])


@njit(inline="always", fastmath=FASTMATH)
def _axpy(acc, r, p, vrow, d):  # pragma: no cover - compiled
    """``acc[r] += p * vrow``, with literal trip counts for common head dims (see ``_dot``)."""
    if d == 128:
        _axpy_n(acc, r, p, vrow, 128)
    elif d == 64:
        _axpy_n(acc, r, p, vrow, 64)
    else:
        _axpy_n(acc, r, p, vrow, d)


@njit(inline="always", fastmath=FASTMATH)
def _score(sc, qrows, k, row, hk, kscale, group, nq, c, softcap, slopes, j, kv_len):  # pragma: no cover - compiled
    """Scores of every query row of kv head ``hk`` against key ``j`` (token row ``row``, its scale ``kscale``: 1
    for float rows) into ``sc[:, c]``."""
    d = k.shape[2]
    krow = k[row, hk]
    for g in range(group):
        h = hk * group + g
        for i in range(nq):
            r = h * nq + i
            acc = _dot(qrows, r, krow, d) * kscale
            if softcap > 0.0:
                acc = softcap * math.tanh(acc / softcap)
            if slopes.shape[0] > 0:
                acc += slopes[h] * np.float32(j - (kv_len - nq + i))
            sc[r, c] = acc


@njit(inline="always", fastmath=FASTMATH)
def _scaled_queries(q, start, nq, scale, pad):  # pragma: no cover - compiled
    """A sequence's ``nq`` queries from token ``start`` as f32 rows ``[Hq * nq + pad, D]`` (row ``h * nq + i``),
    times ``scale``; the ``pad`` extra rows are 0."""
    hq = q.shape[1]
    d = q.shape[2]
    qrows = np.zeros((hq * nq + pad, d), dtype=np.float32)
    for h in range(hq):
        for i in range(nq):
            for x in range(d):
                qrows[h * nq + i, x] = q[start + i, h, x] * scale
    return qrows


@njit(inline="always", fastmath=FASTMATH)
def _write_item(item, acc, m, l, part_out, part_lse):  # pragma: no cover - compiled
    """Normalize an item's accumulators into ``part_out[item]`` and write its lse (0 and -inf for rows that saw no
    key)."""
    for r in range(m.shape[0]):
        if l[r] > 0.0:
            inv = np.float32(1.0) / l[r]
            for x in range(acc.shape[1]):
                part_out[item, r, x] = acc[r, x] * inv
            part_lse[item, r] = m[r] + math.log(l[r])
        else:
            for x in range(acc.shape[1]):
                part_out[item, r, x] = 0.0
            part_lse[item, r] = -np.inf


@njit(inline="always", fastmath=FASTMATH)
def _row_scale(scales, row, hk, unit):  # pragma: no cover - compiled
    """Token row ``row``'s scale for kv head ``hk`` (float16 bits) times ``unit``; 1 for float rows (no scales)."""
    if scales.shape[0] == 0:
        return np.float32(1.0)
    return widen(scales[row, hk]) * unit


@njit(inline="always", fastmath=FASTMATH)
def _scale_columns(sc, scales, unit, rowi, colscale, hkv, rows_h, cn):  # pragma: no cover - compiled
    """``sc[r, c] *= scale of key c (token row rowi[c]) for r's kv head`` (head ``hk`` owns rows ``hk * rows_h ..``).

    The chunk's scales of one head are gathered into ``colscale`` first, so the multiply runs along whole
    ``CHUNK``-wide rows (vectorized) instead of down columns; columns past ``cn`` get 0, which the softmax overwrites
    (before it) or leaves 0 (after it)."""
    width = sc.shape[1]
    for hk in range(hkv):
        for c in range(cn):
            colscale[c] = widen(scales[rowi[c], hk]) * unit
        for c in range(cn, width):
            colscale[c] = 0.0
        for r in range(hk * rows_h, (hk + 1) * rows_h):
            for c in range(width):
                sc[r, c] *= colscale[c]


@njit(inline="always", fastmath=FASTMATH)
def _decode_item(
    item, q, k, ks, v, vs, unit, part_out, part_lse, sch,
):  # pragma: no cover - compiled
    """One work item (``sch``: the step's :class:`~tessera.backends.cpu.kernel_args.DecodeSchedule`): its sequence's
    queries against the item's kv segments, normalized, with its lse (``ks``/``vs``/``unit``: see
    :func:`decode_item`)."""
    hkv = k.shape[1]
    d = k.shape[2]
    hq = q.shape[1]
    group = hq // hkv
    s = sch.item_seq[item]
    nq = sch.seq_q_len[s]
    kv_len = sch.seq_kv_len[s]
    nrows = hq * nq
    qrows = _scaled_queries(q, sch.seq_q_start[s], nq, sch.scale, 0)
    acc = np.zeros((nrows, d), dtype=np.float32)
    m = np.full(nrows, -np.inf, dtype=np.float32)
    l = np.zeros(nrows, dtype=np.float32)
    sc = np.empty((nrows, CHUNK), dtype=np.float32)
    rows = np.empty(CHUNK, dtype=np.int64)
    for seg in range(sch.item_seg_lo[item], sch.item_seg_hi[item]):
        j_begin = sch.seg_start[seg]
        j_end = sch.seg_end[seg]
        moff = sch.seg_mask_off[seg]
        for j0 in range(j_begin, j_end, CHUNK):
            cn = min(CHUNK, j_end - j0)
            for c in range(cn):
                j = j0 + c
                rows[c] = sch.row_base[s, j // sch.block] + j % sch.block
                for hk in range(hkv):
                    _score(sc, qrows, k, rows[c], hk, _row_scale(ks, rows[c], hk, unit), group, nq, c, sch.softcap,
                           sch.slopes, j, kv_len)
            if moff >= 0:
                _apply_mask(sc, sch.mask_buf, moff, sch.seg_mask_hstride[seg], nq, hq, j_end - j_begin, j0 - j_begin,
                            cn)
            _online_softmax(sc, m, l, acc, cn)
            for c in range(cn):
                for hk in range(hkv):
                    vrow = v[rows[c], hk]
                    vscale = _row_scale(vs, rows[c], hk, unit)
                    for r in range(hk * group * nq, (hk + 1) * group * nq):
                        _axpy(acc, r, sc[r, c] * vscale, vrow, d)
    _write_item(item, acc, m, l, part_out, part_lse)


@njit(inline="always", fastmath=FASTMATH)
def _round_up(n, multiple):  # pragma: no cover - compiled
    return -(-n // multiple) * multiple


@njit(inline="always", fastmath=FASTMATH)
def _cursor_at(start, row_elems):  # pragma: no cover - compiled
    """The prefetch cursor ``(row, col)`` of element ``start`` of a run of ``row_elems``-long rows."""
    row = start // row_elems
    return row, start - row * row_elems


@njit(inline="always", fastmath=FASTMATH)
def _scores_blocked(sc, qrows, k, v, row_off, hkv, rows_h, d, cn):  # pragma: no cover - compiled
    """``sc[r, c]`` for every query row against the chunk's keys (``row_off[c]``: flat offset of key ``c``'s token
    row), 4 keys x 4 rows at a time, hinting the same keys' V rows into the caches as it goes (for the P.V pass).

    The hints of a 4-key block walk its V rows in address order, head ``hk``'s tiles taking the ``hk``-th of
    ``hkv`` equal stretches, a few lines per cache line of K read.

    A head's last block may run past its rows (GQA groups of 1-3, or 5-7 rows): the extra rows get scores against
    the wrong head's keys, which the next head's block overwrites before anyone reads them, because heads go in
    increasing order within each key block; ``qrows`` and ``sc`` carry 3 padding rows for the last head.
    """
    stride = sc.shape[1]
    row_elems = hkv * d
    share = 4 * d  # one head's stretch of the block's 4 V rows
    steps = -(-d // line_elements(k))  # hint steps per tile: one per cache line of K
    tiles = (rows_h + 3) // 4
    pf_step = _round_up(-(-share // (tiles * steps)), line_elements(v))
    c = 0
    while c + 4 <= cn:
        for hk in range(hkv):
            koff = hk * d
            k0 = row_off[c] + koff
            k1 = row_off[c + 1] + koff
            k2 = row_off[c + 2] + koff
            k3 = row_off[c + 3] + koff
            pf_row, pf_col = _cursor_at(hk * share, row_elems)
            pf_row += c
            pf_left = share
            for r in range(hk * rows_h, (hk + 1) * rows_h, 4):
                pf_row, pf_col, pf_left = qk_4x4(
                    qrows, r * d, d, k, k0, k1, k2, k3, sc, r * stride + c, stride,
                    v, row_off, pf_row, pf_col, pf_left, pf_step, row_elems,
                )
        c += 4
    if c < cn:  # the chunk's last 1-3 keys: hint their V rows at once
        tail = (cn - c) * row_elems
        prefetch_run(v, row_off, c, 0, tail, tail, row_elems)
    for cc in range(c, cn):
        for hk in range(hkv):
            for rr in range(hk * rows_h, (hk + 1) * rows_h):
                sc[rr, cc] = qk_1x1(qrows, rr * d, d, k, row_off[cc] + hk * d)


@njit(inline="always", fastmath=FASTMATH)
def _values_blocked(acc, sc, v, k, row_off, next_off, next_n, hkv, rows_h, d, cn):  # pragma: no cover - compiled
    """``acc[r] += sum_c sc[r, c] * v_c`` for every row: 4 rows x ``PV_COLS`` vectors held in registers over the
    chunk's keys (1 row x ``PV_COLS`` for a head's last 1-3 rows), hinting the K rows of the next ``next_n`` keys
    (``next_off``) into the caches as it goes (for the next Q.K pass): each (head, column block) pass takes an equal
    stretch of them in address order, a few lines per key."""
    stride = sc.shape[1]
    block = PV_COLS * LANES
    row_elems = hkv * d
    nxb = d // block
    passes = hkv * max(nxb, 1)
    total = next_n * row_elems
    share = _round_up(-(-total // passes), line_elements(k))
    pf_step = _round_up(-(-share // max(cn, 1)), line_elements(k))
    for hk in range(hkv):
        koff = hk * d
        r = hk * rows_h
        r_end = r + rows_h
        p = hk * max(nxb, 1)
        if nxb == 0:  # narrow heads: no column block to spread the hints over
            start = p * share
            if start < total:
                left = min(share, total - start)
                row, col = _cursor_at(start, row_elems)
                prefetch_run(k, next_off, row, col, left, left, row_elems)
        x = 0
        while x + block <= d:
            start = p * share
            pf_left = max(min(share, total - start), 0)
            pf_row, pf_col = _cursor_at(start, row_elems)
            rr = r
            while rr + 4 <= r_end:
                pf_row, pf_col, pf_left = pv_4x4(
                    acc, rr * d + x, d, v, row_off, koff + x, sc, rr * stride, stride, cn,
                    k, next_off, pf_row, pf_col, pf_left, pf_step, row_elems,
                )
                rr += 4
            for r1 in range(rr, r_end):
                pf_row, pf_col, pf_left = pv_1x4(
                    acc, r1 * d + x, v, row_off, koff + x, sc, r1 * stride, cn,
                    k, next_off, pf_row, pf_col, pf_left, pf_step, row_elems,
                )
            x += block
            p += 1
        for r1 in range(r, r_end):
            for xx in range(x, d, LANES):
                pv_1x1(acc, r1 * d + xx, v, row_off, koff + xx, sc, r1 * stride, cn)


@njit(inline="always", fastmath=FASTMATH)
def _online_softmax_blocked(sc, m, l, acc, cn):  # pragma: no cover - compiled
    """:func:`_online_softmax` in explicit vectors over whole ``CHUNK``-wide rows (``CHUNK`` and ``D`` are multiples
    of ``LANES``); the columns past ``cn`` are set to -inf first, so they come out as 0. A plain running ``max``
    stays scalar without "nnan" fastmath, which made this ~15% of the blocked kernel's time."""
    d = acc.shape[1]
    width = sc.shape[1]
    rows = m.shape[0]  # sc may carry padding rows past them
    for r in range(rows):
        for c in range(cn, width):
            sc[r, c] = -np.inf
    for r in range(rows):
        base = r * width
        mv = vload(sc, base)
        for c in range(LANES, width, LANES):
            mv = vmax(mv, vload(sc, base + c))
        mx = vhmax(mv)
        m_old = m[r]
        m_new = max(m_old, mx)
        if m_new == -np.inf:
            for c in range(0, width, LANES):
                vstore(sc, base + c, vzero())
            continue
        if m_new > m_old:
            alpha = fast_exp(m_old - m_new)
            l[r] *= alpha
            av = vsplat(alpha)
            for x in range(0, d, LANES):
                vstore(acc, r * d + x, vmul(vload(acc, r * d + x), av))
            m[r] = m_new
        mn = vsplat(m_new)
        total = vzero()
        for c in range(0, width, LANES):
            p = vexp(vsub(vload(sc, base + c), mn))
            vstore(sc, base + c, p)
            total = vadd(total, p)
        l[r] += vsum(total)


@njit(inline="always", fastmath=FASTMATH)
def _chunk_offsets(offs, at, s, seg, j, item_seg_hi, seg_start, seg_end, row_base, block, row_elems):  # pragma: no cover
    """Fill ``offs[at:CHUNK]`` with the flat offsets of the keys of sequence ``s`` that follow key ``j`` of segment
    ``seg`` in visiting order (into the item's later segments, up to ``item_seg_hi``); returns the new fill."""
    n = at
    while n < CHUNK and seg < item_seg_hi:
        if j >= seg_end[seg]:
            seg += 1
            if seg < item_seg_hi:
                j = seg_start[seg]
            continue
        take = min(CHUNK - n, seg_end[seg] - j)
        _row_offsets(offs, n, s, j, take, row_base, block, row_elems)
        n += take
        j += take
    return n


@njit(inline="always", fastmath=FASTMATH)
def _row_offsets(offs, at, s, j0, count, row_base, block, row_elems):  # pragma: no cover - compiled
    """``offs[at + t]``: flat offset of key ``j0 + t``'s token row (``t < count``), walking the pages without a
    division per key (two 64-bit divisions per key cost ~5% of a chunk)."""
    if count <= 0:
        return
    page = j0 // block
    slot = j0 - page * block
    for t in range(count):
        offs[at + t] = (row_base[s, page] + slot) * row_elems
        slot += 1
        if slot == block:
            slot = 0
            page += 1


@njit(inline="always")
def _next_chunk_offsets(offs, sch, item, next_item, s, seg, j, row_elems):  # pragma: no cover - compiled
    """Row offsets of the keys whose K the P.V pass hints: this item's next chunk from key ``j`` of segment ``seg``,
    then (at its end) the start of the worker's next item (``next_item``, -1 for none), whose first chunk would
    otherwise arrive unprefetched. Returns how many were written (at most ``CHUNK``)."""
    n = _chunk_offsets(offs, 0, s, seg, j, sch.item_seg_hi[item], sch.seg_start, sch.seg_end, sch.row_base,
                       sch.block, row_elems)
    if n < CHUNK and next_item >= 0:
        s2 = sch.item_seq[next_item]
        first = sch.item_seg_lo[next_item]
        n = _chunk_offsets(offs, n, s2, first, sch.seg_start[first], sch.item_seg_hi[next_item], sch.seg_start,
                           sch.seg_end, sch.row_base, sch.block, row_elems)
    return n


@njit(inline="always", fastmath=FASTMATH)
def _post_scores(sc, sch, hq, nq, kv_len, j0, cn):  # pragma: no cover - compiled
    """Softcap and ALiBi on a chunk's scores ``sc [h * nq + i, c]`` (keys ``j0 + c``), in place."""
    for h in range(hq):
        for i in range(nq):
            r = h * nq + i
            for c in range(cn):
                x = sc[r, c]
                if sch.softcap > 0.0:
                    x = sch.softcap * math.tanh(x / sch.softcap)
                if sch.slopes.shape[0] > 0:
                    x += sch.slopes[h] * np.float32(j0 + c - (kv_len - nq + i))
                sc[r, c] = x


@njit(inline="always", fastmath=FASTMATH)
def _decode_item_blocked(
    item, q, k, ks, v, vs, unit, part_out, part_lse, sch, next_item,
):  # pragma: no cover - compiled
    """:func:`_decode_item` with register-blocked micro-kernels (``D % LANES == 0``; same arguments and results),
    prefetching ahead into ``next_item`` (the item its thread runs next, or -1)."""
    hkv = k.shape[1]
    d = k.shape[2]
    hq = q.shape[1]
    group = hq // hkv
    s = sch.item_seq[item]
    nq = sch.seq_q_len[s]
    kv_len = sch.seq_kv_len[s]
    nrows = hq * nq
    rows_h = group * nq
    qrows = _scaled_queries(q, sch.seq_q_start[s], nq, sch.scale, 3)  # + 3 padding rows: see _scores_blocked
    acc = np.zeros((nrows, d), dtype=np.float32)
    m = np.full(nrows, -np.inf, dtype=np.float32)
    l = np.zeros(nrows, dtype=np.float32)
    sc = np.empty((nrows + 3, CHUNK), dtype=np.float32)
    row_off = np.empty(CHUNK, dtype=np.int64)
    next_off = np.empty(CHUNK, dtype=np.int64)
    scaled = ks.shape[0] > 0
    rowi = np.empty(CHUNK if scaled else 0, dtype=np.int64)  # token rows, for the scales
    colscale = np.empty(CHUNK if scaled else 0, dtype=np.float32)
    post = sch.softcap > 0.0 or sch.slopes.shape[0] > 0
    for seg in range(sch.item_seg_lo[item], sch.item_seg_hi[item]):
        j_begin = sch.seg_start[seg]
        j_end = sch.seg_end[seg]
        moff = sch.seg_mask_off[seg]
        for j0 in range(j_begin, j_end, CHUNK):
            cn = min(CHUNK, j_end - j0)
            _row_offsets(row_off, 0, s, j0, cn, sch.row_base, sch.block, hkv * d)
            if scaled:
                _row_offsets(rowi, 0, s, j0, cn, sch.row_base, sch.block, 1)
            # (the next item's first chunk, unhinted, was a quarter of a 128-key suffix item's time)
            next_n = _next_chunk_offsets(next_off, sch, item, next_item, s, seg, j0 + cn, hkv * d)
            _scores_blocked(sc, qrows, k, v, row_off, hkv, rows_h, d, cn)
            if scaled:  # q . (c s) = s (q . c): the keys' scales once per score, before softcap and masks
                _scale_columns(sc, ks, unit, rowi, colscale, hkv, rows_h, cn)
            if post:
                _post_scores(sc, sch, hq, nq, kv_len, j0, cn)
            if moff >= 0:
                _apply_mask(sc, sch.mask_buf, moff, sch.seg_mask_hstride[seg], nq, hq, j_end - j_begin, j0 - j_begin,
                            cn)
            _online_softmax_blocked(sc, m, l, acc, cn)
            if scaled:  # p (c s) = (p s) c: the values' scales on the probabilities, after the softmax summed them
                _scale_columns(sc, vs, unit, rowi, colscale, hkv, rows_h, cn)
            _values_blocked(acc, sc, v, k, row_off, next_off, next_n, hkv, rows_h, d, cn)
    _write_item(item, acc, m, l, part_out, part_lse)


# Called, not inlined: its two item kernels take ~60 s to compile per K/V dtype, and as a function of its own it
# compiles once for every caller of the same argument types (the parallel and serial kernels here and the fused
# decode layer) instead of once inside each; a call per work item costs well under a microsecond.
@njit(fastmath=FASTMATH, cache=True)
def decode_item(
    item, q, k, ks, v, vs, unit, part_out, part_lse, sch, next_item,
):  # pragma: no cover - compiled
    """One work item, by the register-blocked kernel when the head dim is a multiple of the vector width;
    ``next_item``: the item the same thread runs next (-1: none), whose first keys are prefetched.

    Float rows pass :data:`NO_SCALES` as ``ks`` and ``vs``; quantized rows (codes) pass their float16 scale bits
    ``[rows, Hkv]`` and ``unit`` (:func:`code_unit`)."""
    if k.shape[2] % LANES == 0:
        _decode_item_blocked(item, q, k, ks, v, vs, unit, part_out, part_lse, sch, next_item)
    else:
        _decode_item(item, q, k, ks, v, vs, unit, part_out, part_lse, sch)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def decode_attention_kernel(q, k, ks, v, vs, unit, part_out, part_lse, sch):  # pragma: no cover - compiled
    """Partial attention of every work item: worker ``w`` runs items ``item_order[worker_start[w]:worker_start[w+1]]``
    (the plan balances their key counts; Numba's ``prange`` hands each thread one contiguous block of iterations,
    also under ``parallel_chunksize``, so the balance has to be decided up front).

    q : f32 ``[tokens, Hq, D]``; k, v : ``[rows, Hkv, D]`` f32 / uint16 (bf16 bits) / int16 (fp16 bits), or
    quantized codes: int8 / uint8 (e4m3 bits). ks, vs : the codes' float16 scale bits (int16 ``[rows, Hkv]``), or
    :data:`NO_SCALES` for float rows; unit : f32, what a widened code is multiplied by besides its scale
    (:func:`code_unit`).
    part_out : f32 ``[items, Hq * max_q, D]`` and part_lse : f32 ``[items, Hq * max_q]``; row ``h * q_len + i``.
    sch : :class:`~tessera.backends.cpu.kernel_args.DecodeSchedule` (or the plain tuple of its fields): the items,
    their kv segments and the schedule.
    """
    sch = DecodeSchedule(*sch)  # see kernel_args: callers pass a plain tuple, which Numba types faster
    item_order, worker_start = sch.item_order, sch.worker_start
    for w in prange(worker_start.shape[0] - 1):
        for i in range(worker_start[w], worker_start[w + 1]):
            decode_item(item_order[i], q, k, ks, v, vs, unit, part_out, part_lse, sch,
                        item_order[i + 1] if i + 1 < worker_start[w + 1] else -1)


@njit(fastmath=FASTMATH, cache=True)
def decode_attention_serial(q, k, ks, v, vs, unit, part_out, part_lse, sch):  # pragma: no cover - compiled
    """:func:`decode_attention_kernel` on the calling thread (in item order: the schedule only matters to the pool): for small steps (a short context at batch 1), where
    waking the pool costs more than the work (measured ~60 us per call on this machine)."""
    sch = DecodeSchedule(*sch)
    n_items = sch.item_seq.shape[0]
    for item in range(n_items):
        decode_item(item, q, k, ks, v, vs, unit, part_out, part_lse, sch, item + 1 if item + 1 < n_items else -1)


@njit(inline="always", fastmath=FASTMATH)
def _apply_mask(sc, mask_buf, moff, hstride, nq, hq, seg_len, offset, cn):  # pragma: no cover - compiled
    for h in range(hq):
        for i in range(nq):
            base = moff + ((h * hstride) * nq + i) * seg_len + offset
            for c in range(cn):
                if mask_buf[base + c] == 0:
                    sc[h * nq + i, c] = -np.inf


@njit(inline="always", fastmath=FASTMATH)
def _online_softmax(sc, m, l, acc, cn):  # pragma: no cover - compiled
    """Turn scores ``sc[:, :cn]`` into probabilities relative to the running max, rescaling the state."""
    d = acc.shape[1]
    for r in range(sc.shape[0]):
        mx = np.float32(-np.inf)
        for c in range(cn):
            mx = max(mx, sc[r, c])
        m_new = max(m[r], mx)
        if m_new == -np.inf:
            for c in range(cn):
                sc[r, c] = 0.0
            continue
        if m_new > m[r]:
            alpha = fast_exp(m[r] - m_new)
            l[r] *= alpha
            for x in range(d):
                acc[r, x] *= alpha
            m[r] = m_new
        total = np.float32(0.0)
        for c in range(cn):
            p = fast_exp(sc[r, c] - m_new)
            sc[r, c] = p
            total += p
        l[r] += total


@njit(inline="always", fastmath=FASTMATH)
def _merge_sequence(s, part_out, part_lse, seq_item_lo, seq_item_hi, seq_q_start, seq_q_len, out, lse):  # pragma: no cover
    hq = out.shape[1]
    d = out.shape[2]
    nq = seq_q_len[s]
    for h in range(hq):
        for i in range(nq):
            r = h * nq + i
            t = seq_q_start[s] + i
            mx = -np.inf
            for it in range(seq_item_lo[s], seq_item_hi[s]):
                mx = max(mx, part_lse[it, r])
            if mx == -np.inf:
                for x in range(d):
                    out[t, h, x] = 0.0
                lse[t, h] = -np.inf
                continue
            total = 0.0
            for x in range(d):
                out[t, h, x] = 0.0
            for it in range(seq_item_lo[s], seq_item_hi[s]):
                w = math.exp(part_lse[it, r] - mx)
                total += w
                for x in range(d):
                    out[t, h, x] += w * part_out[it, r, x]
            inv = 1.0 / total
            for x in range(d):
                out[t, h, x] *= inv
            lse[t, h] = mx + math.log(total)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def merge_parts_kernel(part_out, part_lse, seq_item_lo, seq_item_hi, seq_q_start, seq_q_len, out, lse):  # pragma: no cover
    """Combine each sequence's parts by log-sum-exp into ``out [tokens, Hq, D]`` and ``lse [tokens, Hq]`` (f32)."""
    for s in prange(seq_q_len.shape[0]):
        _merge_sequence(s, part_out, part_lse, seq_item_lo, seq_item_hi, seq_q_start, seq_q_len, out, lse)


@njit(fastmath=FASTMATH, cache=True)
def merge_parts_serial(part_out, part_lse, seq_item_lo, seq_item_hi, seq_q_start, seq_q_len, out, lse):  # pragma: no cover
    """:func:`merge_parts_kernel` on the calling thread."""
    for s in range(seq_q_len.shape[0]):
        _merge_sequence(s, part_out, part_lse, seq_item_lo, seq_item_hi, seq_q_start, seq_q_len, out, lse)
