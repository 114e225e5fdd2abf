"""Decode-shaped attention over quantized KV rows (int8, fp8 e4m3): the codes are read as stored and widened in
registers, so a step streams ``D + 2`` bytes per token and head instead of bf16's ``2 D``.

The work items, segments, masks, split-KV merge, register-blocked micro-kernels and prefetch are exactly those of
:mod:`.decode_kernel` (one :class:`~tessera.backends.cpu.kernel_args.DecodeSchedule`; ``simd.vload`` widens int8
and e4m3 lanes as it widens bf16). Only the scales are new: a key's scale multiplies its scores once per chunk
(``q . (c s) = s (q . c)``), and a value's scale multiplies the probabilities after the softmax has summed them
(``p (c s) = (p s) c``), so the per-element work is one widening and one FMA, as for a float row.

Codes arrive as int8 (``int8``) or as uint8 bits (``fp8_e4m3``). An e4m3 byte becomes a float32 by moving its 7
exponent-and-mantissa bits to float32's bit 20 (exponent field plus the top 3 mantissa bits) and its sign to bit
31: that float is the e4m3 value times 2^-120 (the exponent biases differ by 127 - 7), subnormals included, since
float32's subnormals continue the same grid. The 2^120 goes into the row's scale (``unit``). e4m3's NaN code is
never written by the quantizer (it clamps to 448).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.core.extending import overload

from tessera.backends.cpu.decode_kernel import (
    CHUNK,
    _apply_mask,
    _chunk_offsets,
    _online_softmax,
    _online_softmax_blocked,
    _row_offsets,
    _scaled_queries,
    _scores_blocked,
    _values_blocked,
    _write_item,
)
from tessera.backends.cpu.kernel_args import DecodeSchedule
from tessera.backends.cpu.numba_math import FASTMATH, _bits_to_f32, widen
from tessera.backends.cpu.simd import LANES

#: what a widened code is multiplied by, per codes dtype (see the module docstring)
FP8_UNIT = np.float32(2.0 ** 120)


def code_value(x):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(code_value, inline="always")
def _code_value_overload(x):
    if x == types.int8:
        return lambda x: np.float32(x)
    if x == types.uint8:  # e4m3 bits, times 2^-120
        return lambda x: _bits_to_f32((np.uint32(x & 0x7F) << np.uint32(20)) | (np.uint32(x & 0x80) << np.uint32(24)))
    return None


@njit(inline="always", fastmath=FASTMATH)
def _qdot_n(qrows, r, crow, n):  # pragma: no cover - compiled
    acc = np.float32(0.0)
    for x in range(n):
        acc += qrows[r, x] * code_value(crow[x])
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _qdot(qrows, r, crow, d):  # pragma: no cover - compiled
    """``qrows[r] . crow`` over widened codes; literal trip counts for common head dims, which LLVM unrolls."""
    if d == 128:
        return _qdot_n(qrows, r, crow, 128)
    if d == 64:
        return _qdot_n(qrows, r, crow, 64)
    return _qdot_n(qrows, r, crow, d)


@njit(inline="always", fastmath=FASTMATH)
def _qaxpy_n(acc, r, p, crow, n):  # pragma: no cover - compiled
    for x in range(n):
        acc[r, x] += p * code_value(crow[x])


@njit(inline="always", fastmath=FASTMATH)
def _qaxpy(acc, r, p, crow, d):  # pragma: no cover - compiled
    if d == 128:
        _qaxpy_n(acc, r, p, crow, 128)
    elif d == 64:
        _qaxpy_n(acc, r, p, crow, 64)
    else:
        _qaxpy_n(acc, r, p, crow, d)


@njit(inline="always", fastmath=FASTMATH)
def _decode_item_q8(item, q, k, ks, v, vs, unit, part_out, part_lse, sch):  # pragma: no cover - compiled
    """One work item over quantized rows: ``k``/``v`` codes ``[rows, Hkv, D]``, ``ks``/``vs`` float16 bits
    ``[rows, Hkv]``."""
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
    softcap = sch.softcap
    slopes = sch.slopes
    for seg in range(sch.item_seg_lo[item], sch.item_seg_hi[item]):
        j_begin = sch.seg_start[seg]
        j_end = sch.seg_end[seg]
        moff = sch.seg_mask_off[seg]
        for j0 in range(j_begin, j_end, CHUNK):
            cn = min(CHUNK, j_end - j0)
            for c in range(cn):
                j = j0 + c
                row = sch.row_base[s, j // sch.block] + j % sch.block
                rows[c] = row
                for hk in range(hkv):
                    kscale = widen(ks[row, hk]) * unit
                    crow = k[row, hk]
                    for g in range(group):
                        h = hk * group + g
                        for i in range(nq):
                            r = h * nq + i
                            a = _qdot(qrows, r, crow, d) * kscale
                            if softcap > 0.0:
                                a = softcap * math.tanh(a / softcap)
                            if slopes.shape[0] > 0:
                                a += slopes[h] * np.float32(j - (kv_len - nq + i))
                            sc[r, c] = a
            if moff >= 0:
                _apply_mask(sc, sch.mask_buf, moff, sch.seg_mask_hstride[seg], nq, hq, j_end - j_begin, j0 - j_begin,
                            cn)
            _online_softmax(sc, m, l, acc, cn)
            for c in range(cn):
                row = rows[c]
                for hk in range(hkv):
                    vscale = widen(vs[row, hk]) * unit
                    crow = v[row, hk]
                    for r in range(hk * group * nq, (hk + 1) * group * nq):
                        _qaxpy(acc, r, sc[r, c] * vscale, crow, d)
    _write_item(item, acc, m, l, part_out, part_lse)


@njit(inline="always", fastmath=FASTMATH)
def _scale_columns(sc, scales, unit, rowi, colscale, hkv, rows_h, cn):  # pragma: no cover - compiled
    """``sc[r, c] *= scale of key c (token row rowi[c]) for r's kv head`` (head ``hk`` owns rows ``hk * rows_h ..``).

    The chunk's scales of one head are gathered into ``colscale`` first, so the multiply runs along whole
    ``CHUNK``-wide rows (vectorized) instead of down columns; columns past ``cn`` get 0, which the float kernel's
    softmax overwrites (before it) or leaves 0 (after it)."""
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
def _decode_item_q8_blocked(item, q, k, ks, v, vs, unit, part_out, part_lse, sch, next_item):  # pragma: no cover
    """:func:`.decode_kernel._decode_item_blocked` over codes, with the scale passes (``D % LANES == 0``)."""
    hkv = k.shape[1]
    d = k.shape[2]
    hq = q.shape[1]
    group = hq // hkv
    s = sch.item_seq[item]
    nq = sch.seq_q_len[s]
    kv_len = sch.seq_kv_len[s]
    nrows = hq * nq
    rows_h = group * nq
    row_elems = hkv * d
    qrows = _scaled_queries(q, sch.seq_q_start[s], nq, sch.scale, 3)  # + 3 padding rows, as there
    acc = np.zeros((nrows, d), dtype=np.float32)
    m = np.full(nrows, -np.inf, dtype=np.float32)
    l = np.zeros(nrows, dtype=np.float32)
    sc = np.empty((nrows + 3, CHUNK), dtype=np.float32)
    row_off = np.empty(CHUNK, dtype=np.int64)
    rowi = np.empty(CHUNK, dtype=np.int64)
    colscale = np.empty(CHUNK, dtype=np.float32)
    next_off = np.empty(CHUNK, dtype=np.int64)
    post = sch.softcap > 0.0 or sch.slopes.shape[0] > 0
    for seg in range(sch.item_seg_lo[item], sch.item_seg_hi[item]):
        j_begin = sch.seg_start[seg]
        j_end = sch.seg_end[seg]
        moff = sch.seg_mask_off[seg]
        for j0 in range(j_begin, j_end, CHUNK):
            cn = min(CHUNK, j_end - j0)
            _row_offsets(row_off, 0, s, j0, cn, sch.row_base, sch.block, row_elems)
            _row_offsets(rowi, 0, s, j0, cn, sch.row_base, sch.block, 1)  # token rows, for the scales
            next_n = _chunk_offsets(next_off, 0, s, seg, j0 + cn, sch.item_seg_hi[item], sch.seg_start, sch.seg_end,
                                    sch.row_base, sch.block, row_elems)
            if next_n < CHUNK and next_item >= 0:
                s2 = sch.item_seq[next_item]
                first = sch.item_seg_lo[next_item]
                next_n = _chunk_offsets(next_off, next_n, s2, first, sch.seg_start[first],
                                        sch.item_seg_hi[next_item], sch.seg_start, sch.seg_end, sch.row_base, sch.block,
                                        row_elems)
            _scores_blocked(sc, qrows, k, v, row_off, hkv, rows_h, d, cn)
            _scale_columns(sc, ks, unit, rowi, colscale, hkv, rows_h, cn)
            if post:
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
            if moff >= 0:
                _apply_mask(sc, sch.mask_buf, moff, sch.seg_mask_hstride[seg], nq, hq, j_end - j_begin, j0 - j_begin,
                            cn)
            _online_softmax_blocked(sc, m, l, acc, cn)
            _scale_columns(sc, vs, unit, rowi, colscale, hkv, rows_h, cn)
            _values_blocked(acc, sc, v, k, row_off, next_off, next_n, hkv, rows_h, d, cn)
    _write_item(item, acc, m, l, part_out, part_lse)


# Called, not inlined, as decode_kernel.decode_item: compiled once per codes dtype for both kernels below.
@njit(fastmath=FASTMATH, cache=True)
def decode_item_q8(item, q, k, ks, v, vs, unit, part_out, part_lse, sch, next_item):  # pragma: no cover - compiled
    """One work item: register-blocked when the head dim is a multiple of the vector width, else scalar."""
    if k.shape[2] % LANES == 0:
        _decode_item_q8_blocked(item, q, k, ks, v, vs, unit, part_out, part_lse, sch, next_item)
    else:
        _decode_item_q8(item, q, k, ks, v, vs, unit, part_out, part_lse, sch)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def decode_q8_kernel(q, k, ks, v, vs, unit, part_out, part_lse, sch):  # pragma: no cover - compiled
    """Every work item, one ``prange`` iteration per worker (as :func:`.decode_kernel.decode_attention_kernel`).

    q : f32 ``[tokens, Hq, D]``; k, v : int8 or uint8 (e4m3 bits) ``[rows, Hkv, D]``; ks, vs : int16 (float16
    bits) ``[rows, Hkv]``; unit : f32, 1 for int8 and 2^120 for e4m3; part_out / part_lse and sch as there.
    """
    sch = DecodeSchedule(*sch)
    item_order, worker_start = sch.item_order, sch.worker_start
    for w in prange(worker_start.shape[0] - 1):
        for i in range(worker_start[w], worker_start[w + 1]):
            decode_item_q8(item_order[i], q, k, ks, v, vs, unit, part_out, part_lse, sch,
                           item_order[i + 1] if i + 1 < worker_start[w + 1] else -1)


@njit(fastmath=FASTMATH, cache=True)
def decode_q8_serial(q, k, ks, v, vs, unit, part_out, part_lse, sch):  # pragma: no cover - compiled
    """:func:`decode_q8_kernel` on the calling thread, in item order (small steps)."""
    sch = DecodeSchedule(*sch)
    n_items = sch.item_seq.shape[0]
    for item in range(n_items):
        decode_item_q8(item, q, k, ks, v, vs, unit, part_out, part_lse, sch, item + 1 if item + 1 < n_items else -1)
