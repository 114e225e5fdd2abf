"""Numba kernel for decode-shaped attention (a few queries against a long KV): memory-bound, one pass over K and V.

One work item is one (sequence, kv head). It streams its KV in chunks of ``CHUNK`` keys, scores every query row of its
group (``G * q_len`` rows) against each chunk, and folds the chunk into an online softmax held in registers/L1. K/V
are read exactly once. Lengths are run-time values, so new lengths never recompile; a kernel is compiled once per
storage dtype (float32; bf16 and fp16 arrive as 16-bit integer views and are widened by bit operations).

The KV addressing is paged: key ``j`` of sequence ``s`` lives in row ``row_base[s, j // block] + j % block`` of
``k [rows, Hkv, D]``. A contiguous sequence is one "page" as long as the sequence (``row_base[s, 0] = kv_start``).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic, overload

CHUNK = 32

# fastmath without "nnan"/"ninf": the kernel relies on -inf for masked scores and empty rows.
FASTMATH = {"contract", "arcp", "nsz", "reassoc", "afn"}


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret a uint32 as float32 (a register move; vectorizes)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """Widen IEEE half bits (int16) to float32 (F16C on x86)."""
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def widen(x):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(widen, inline="always")
def _widen_overload(x):
    if x == types.uint16:  # bfloat16 bits: the high half of a float32
        return lambda x: _bits_to_f32(np.uint32(x) << np.uint32(16))
    if x == types.int16:  # float16 bits
        return lambda x: _half_bits_to_f32(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def decode_attention_kernel(
    q, k, v, out, lse,
    seq_q_start, seq_q_len, seq_kv_len, row_base, block,
    seg_ptr, seg_start, seg_end, seg_mask_off, seg_mask_hstride, mask_buf,
    scale, softcap, slopes, group,
):  # pragma: no cover - compiled
    """out ``[tokens, Hq, D]`` f32 and lse ``[tokens, Hq]`` f32 for every query row of every listed sequence.

    q : f32 ``[tokens, Hq, D]``; k, v : ``[rows, Hkv, D]`` f32 / uint16 (bf16 bits) / int16 (fp16 bits).
    seq_* : int64 ``[num_seqs]``; row_base : int64 ``[num_seqs, max_blocks]``; block : rows per addressing block.
    seg_ptr : int64 ``[num_seqs + 1]``, segments of sequence s are ``seg_ptr[s]:seg_ptr[s+1]``; each segment is a kv
    range ``[seg_start, seg_end)`` visited by every query of s; ``seg_mask_off >= 0`` points into ``mask_buf`` (uint8,
    laid out ``[heads, q_len, seg_len]``, head stride 0 when the mask ignores heads), -1 means all kept.
    softcap : 0 disables; slopes : f32 ``[Hq]`` ALiBi slopes or empty.
    """
    num_seqs = seq_q_len.shape[0]
    hkv = k.shape[1]
    d = k.shape[2]
    use_alibi = slopes.shape[0] > 0
    for item in prange(num_seqs * hkv):
        s = item // hkv
        hk = item % hkv
        nq = seq_q_len[s]
        kv_len = seq_kv_len[s]
        q0 = seq_q_start[s]
        nrows = group * nq
        acc = np.zeros((nrows, d), dtype=np.float32)
        m = np.full(nrows, -np.inf, dtype=np.float32)
        l = np.zeros(nrows, dtype=np.float32)
        qrows = np.empty((nrows, d), dtype=np.float32)
        for r in range(nrows):
            h = hk * group + r // nq
            for x in range(d):
                qrows[r, x] = q[q0 + r % nq, h, x] * scale
        kbuf = np.empty((CHUNK, d), dtype=np.float32)
        vbuf = np.empty((CHUNK, d), dtype=np.float32)
        sc = np.empty(CHUNK, dtype=np.float32)
        for seg in range(seg_ptr[s], seg_ptr[s + 1]):
            j_begin = seg_start[seg]
            j_end = seg_end[seg]
            moff = seg_mask_off[seg]
            seg_len = j_end - j_begin
            for j0 in range(j_begin, j_end, CHUNK):
                cn = min(CHUNK, j_end - j0)
                for c in range(cn):
                    j = j0 + c
                    row = row_base[s, j // block] + j % block
                    for x in range(d):
                        kbuf[c, x] = widen(k[row, hk, x])
                        vbuf[c, x] = widen(v[row, hk, x])
                for r in range(nrows):
                    h = hk * group + r // nq
                    i = r % nq
                    q_pos = kv_len - nq + i
                    mx = -np.inf
                    for c in range(cn):
                        acc_dot = np.float32(0.0)
                        for x in range(d):
                            acc_dot += qrows[r, x] * kbuf[c, x]
                        if softcap > 0.0:
                            acc_dot = softcap * math.tanh(acc_dot / softcap)
                        if use_alibi:
                            acc_dot += slopes[h] * np.float32(j0 + c - q_pos)
                        if moff >= 0:
                            midx = moff + ((h * seg_mask_hstride[seg]) * nq + i) * seg_len + (j0 + c - j_begin)
                            if mask_buf[midx] == 0:
                                acc_dot = -np.inf
                        sc[c] = acc_dot
                        mx = max(mx, acc_dot)
                    if mx == -np.inf:
                        continue
                    m_old = m[r]
                    m_new = max(m_old, mx)
                    if m_new > m_old:
                        alpha = math.exp(m_old - m_new)
                        l[r] *= alpha
                        for x in range(d):
                            acc[r, x] *= alpha
                        m[r] = m_new
                    for c in range(cn):
                        p = math.exp(sc[c] - m_new)
                        l[r] += p
                        for x in range(d):
                            acc[r, x] += p * vbuf[c, x]
        for r in range(nrows):
            h = hk * group + r // nq
            t = q0 + r % nq
            if l[r] > 0.0:
                inv = 1.0 / l[r]
                for x in range(d):
                    out[t, h, x] = acc[r, x] * inv
                lse[t, h] = m[r] + math.log(l[r])
            else:
                for x in range(d):
                    out[t, h, x] = 0.0
                lse[t, h] = -np.inf
