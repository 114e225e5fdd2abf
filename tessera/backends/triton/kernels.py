"""The Triton attention kernels: one FlashAttention-2 style kernel over planned work items, and an lse merge.

Every program runs one *work item* (see ``planner.py``): a tile of ``BLOCK_M`` query rows that packs
``BLOCK_M // HEADS`` query tokens times ``HEADS`` query heads of one GQA group, so all heads sharing a kv head read
each K/V tile once. The item lists the kv tiles to visit, FULL ones (no mask evaluation) and PARTIAL ones (mask and
key-range checks), so block-sparse masks skip EMPTY tiles entirely. Prefill, chunked prefill, decode and
multi-token verification are the same kernel with different ``BLOCK_M``; decode items are split over the kv tiles
(flash-decoding) and their partial results merged by :func:`merge_kernel`.

Keys are addressed through a row table, ``row = ROW_BASE[seq, j // block_size] + j % block_size``, which covers
contiguous ragged batches (one block per sequence) and paged caches (``block_size = page_size``) alike.

Scores are kept in the log2 domain (``exp2`` is one instruction on NVIDIA GPUs): ``m`` is the running row maximum of
``s * log2(e)``, ``l`` the running sum of ``exp2(s * log2(e) - m)``, ``acc`` the unnormalized output.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Columns of the int32 work-item table ITEMS [num_items, ITEM_FIELDS].
SEQ, Q_ROW, Q_POS, N_TOK, HEAD0, N_HEADS, KV_HEAD, FULL_OFF, FULL_CNT, PART_OFF, PART_CNT, KV_LEN, SLOT = range(13)
ITEM_FIELDS = 13
# Columns of the int32 merge table MERGES [num_merges, MERGE_FIELDS].
M_Q_ROW, M_N_TOK, M_HEAD0, M_N_HEADS, M_SLOT0, M_N_SPLITS = range(6)
MERGE_FIELDS = 6


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``a @ b`` in float32. DOT_UPCAST works around Triton 3.9's interpreter, whose dot multiplies bfloat16 bit
    patterns as integers; widening first gives the products a GPU tensor core computes (exact, fp32 accumulate)."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _codes_to_float(codes, KV_QUANT: tl.constexpr):
    """Quantized KV codes as float32: int8 as numbers (KV_QUANT 1); e4m3 bytes (KV_QUANT 2, loaded as uint8) by
    moving exponent and mantissa to float32's bit 20 and the sign to bit 31, which is the e4m3 value times 2^-120
    (subnormals included), then scaling by 2^120."""
    if KV_QUANT == 1:
        return codes.to(tl.float32)
    bits = codes.to(tl.int32)
    f = (((bits & 0x7F) << 20) | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)
    return f * 1.329227995784916e36  # 2^120


@triton.jit
def _tile_step(q, m_i, l_i, acc, kv_start, seq, kv_len, kvh, b_row_base, h, q_pos, offs_n, offs_d,
               K, V, KS, VS, AUX_I, AUX_F, block_size, stride_kt, stride_kh, stride_vt, stride_vh, stride_st,
               qk_scale, sm_scale,
               MASK_FN: tl.constexpr, SCORE_FN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SCORE: tl.constexpr,
               MASKED: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
               DOT_UPCAST: tl.constexpr, KV_QUANT: tl.constexpr):
    """One kv tile of the online softmax; MASKED (partial) tiles drop keys past ``kv_len`` and evaluate the mask."""
    kv_pos = kv_start + offs_n  # [BLOCK_N]
    if MASKED:
        key_ok = kv_pos < kv_len
        page = tl.load(b_row_base + kv_pos // block_size, mask=key_ok, other=0)
    else:
        page = tl.load(b_row_base + kv_pos // block_size)
    rows = (page + kv_pos % block_size).to(tl.int64)
    d_ok = offs_d < HEAD_DIM
    if MASKED:
        kv_mask = key_ok[None, :] & d_ok[:, None]
    else:
        kv_mask = d_ok[:, None]
    k = tl.load(K + rows[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None], mask=kv_mask, other=0)
    if KV_QUANT != 0:  # codes [BLOCK_D, BLOCK_N] times each key's scale, in q's dtype for the dot
        if MASKED:
            k_scale = tl.load(KS + rows * stride_st + kvh, mask=key_ok, other=0.0).to(tl.float32)
        else:
            k_scale = tl.load(KS + rows * stride_st + kvh).to(tl.float32)
        k = (_codes_to_float(k, KV_QUANT) * k_scale[None, :]).to(q.dtype)
    s = _dot(q, k, DOT_PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N] float32
    if HAS_SCORE:
        s = SCORE_FN(s * sm_scale, seq, h[:, None], q_pos[:, None], kv_pos[None, :], AUX_I, AUX_F) * 1.4426950408889634
    else:
        s = s * qk_scale
    if MASKED:
        keep = key_ok[None, :]
        if HAS_MASK:
            keep = keep & MASK_FN(seq, h[:, None], q_pos[:, None], kv_pos[None, :], AUX_I, AUX_F)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf - 0) = 0, no NaN
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v_mask = key_ok[:, None] & d_ok[None, :]
    else:
        v_mask = d_ok[None, :]
    v = tl.load(V + rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=v_mask, other=0)
    if KV_QUANT != 0:
        if MASKED:
            v_scale = tl.load(VS + rows * stride_st + kvh, mask=key_ok, other=0.0).to(tl.float32)
        else:
            v_scale = tl.load(VS + rows * stride_st + kvh).to(tl.float32)
        v = (_codes_to_float(v, KV_QUANT) * v_scale[:, None]).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc


@triton.jit
def _tile_rows(head0, n_tok, n_heads, BLOCK_M: tl.constexpr, HEADS: tl.constexpr):
    """Row ``r`` of a tile is token ``r // HEADS`` and query head ``head0 + r % HEADS``; unused rows are masked."""
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // HEADS
    h = head0 + offs_m % HEADS
    row_ok = (tok < n_tok) & (offs_m % HEADS < n_heads)
    return offs_m, tok, h, row_ok


@triton.jit
def _store_rows(OUT, LSE, out, lse, q_rows, h, row_ok, offs_d, stride_ot, stride_oh, stride_lt,
                HEAD_DIM: tl.constexpr):
    """Write finished rows: ``out`` in OUT's dtype, ``lse`` float32."""
    d_ok = offs_d < HEAD_DIM
    tl.store(OUT + q_rows[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + q_rows * stride_lt + h, lse, mask=row_ok)


@triton.jit
def attention_kernel(
    Q, K, V, KS, VS, OUT, LSE, PART_OUT, PART_LSE, SINKS, ITEMS, TILES, ROW_BASE, AUX_I, AUX_F,
    row_base_stride, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_st, stride_ot, stride_oh, stride_lt,
    sm_scale,
    MASK_FN: tl.constexpr, SCORE_FN: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_SINKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_QUANT: tl.constexpr,
):
    """One work item: ``BLOCK_M`` (token, head) rows of one GQA group against its planned kv tiles.

    With KV_QUANT (1: int8, 2: e4m3 bytes), K and V hold codes and KS / VS their float16 scales ``[rows, Hkv]``
    (row stride ``stride_st``), de-quantized per tile in registers; otherwise KS / VS are unused.

    Writes the finished rows (``out`` in the output dtype, ``lse`` natural log, sinks folded in) or, for a split
    item, its normalized partial rows and their log2-domain lse into ``PART_OUT`` / ``PART_LSE`` slot ``SLOT``.
    """
    item = ITEMS + tl.program_id(0) * 13  # the columns of ITEMS, in the order of ITEM_FIELDS above
    seq = tl.load(item + 0)
    q_row0 = tl.load(item + 1)
    q_pos0 = tl.load(item + 2)
    n_tok = tl.load(item + 3)
    head0 = tl.load(item + 4)
    n_heads = tl.load(item + 5)
    kvh = tl.load(item + 6)
    full_off = tl.load(item + 7)
    full_cnt = tl.load(item + 8)
    part_off = tl.load(item + 9)
    part_cnt = tl.load(item + 10)
    kv_len = tl.load(item + 11)
    slot = tl.load(item + 12)

    offs_m, tok, h, row_ok = _tile_rows(head0, n_tok, n_heads, BLOCK_M, HEADS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = q_pos0 + tok
    q_rows = (q_row0 + tok).to(tl.int64)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + q_rows[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    b_row_base = ROW_BASE + seq.to(tl.int64) * row_base_stride

    for i in range(0, full_cnt):
        kv_start = tl.load(TILES + full_off + i)
        m_i, l_i, acc = _tile_step(q, m_i, l_i, acc, kv_start, seq, kv_len, kvh, b_row_base, h, q_pos, offs_n,
                                   offs_d, K, V, KS, VS, AUX_I, AUX_F, block_size, stride_kt, stride_kh,
                                   stride_vt, stride_vh, stride_st, qk_scale, sm_scale, MASK_FN, SCORE_FN, HAS_MASK,
                                   HAS_SCORE, False, HEAD_DIM, BLOCK_D, DOT_PRECISION, DOT_UPCAST, KV_QUANT)
    for i in range(0, part_cnt):
        kv_start = tl.load(TILES + part_off + i)
        m_i, l_i, acc = _tile_step(q, m_i, l_i, acc, kv_start, seq, kv_len, kvh, b_row_base, h, q_pos, offs_n,
                                   offs_d, K, V, KS, VS, AUX_I, AUX_F, block_size, stride_kt, stride_kh,
                                   stride_vt, stride_vh, stride_st, qk_scale, sm_scale, MASK_FN, SCORE_FN, HAS_MASK,
                                   HAS_SCORE, True, HEAD_DIM, BLOCK_D, DOT_PRECISION, DOT_UPCAST, KV_QUANT)

    if slot >= 0:
        # A split of a decode item: store normalized rows and their log2 lse; merge_kernel finishes them.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        part = acc / l_safe[:, None]
        lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        slot_rows = slot.to(tl.int64) * BLOCK_M + offs_m
        tl.store(PART_OUT + slot_rows[:, None] * BLOCK_D + offs_d[None, :], part)
        tl.store(PART_LSE + slot_rows, lse2)
    else:
        out, lse = _finish(acc, m_i, l_i, h, SINKS, HAS_SINKS)
        _store_rows(OUT, LSE, out, lse, q_rows, h, row_ok, offs_d, stride_ot, stride_oh, stride_lt, HEAD_DIM)


@triton.jit
def _finish(acc, m_i, l_i, h, SINKS, HAS_SINKS: tl.constexpr):
    """Normalize, fold the per-head sink logit into the denominator, and give lse in natural log."""
    if HAS_SINKS:
        sink2 = tl.load(SINKS + h) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink2)  # finite: the sink always counts
        alpha = tl.math.exp2(m_i - m_f)  # 0 for a row without keys
        l_f = l_i * alpha + tl.math.exp2(sink2 - m_f)
        out = acc * (alpha / l_f)[:, None]
        lse = (m_f + tl.math.log2(l_f)) * 0.6931471805599453
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return out, lse


@triton.jit
def merge_kernel(
    OUT, LSE, PART_OUT, PART_LSE, SINKS, MERGES, stride_ot, stride_oh, stride_lt,
    HAS_SINKS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HEADS: tl.constexpr,
):
    """Combine the splits of one decode item by their lse (flash-decoding's second pass) and finish its rows."""
    merge = MERGES + tl.program_id(0) * 6  # the columns of MERGES, in the order of MERGE_FIELDS above
    q_row0 = tl.load(merge + 0)
    n_tok = tl.load(merge + 1)
    head0 = tl.load(merge + 2)
    n_heads = tl.load(merge + 3)
    slot0 = tl.load(merge + 4)
    n_splits = tl.load(merge + 5)

    offs_m, tok, h, row_ok = _tile_rows(head0, n_tok, n_heads, BLOCK_M, HEADS)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(0, n_splits):
        rows = (slot0 + i).to(tl.int64) * BLOCK_M + offs_m
        lse2 = tl.load(PART_LSE + rows)
        part = tl.load(PART_OUT + rows[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m_i, lse2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        w = tl.math.exp2(lse2 - m_use)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + part * w[:, None]
        m_i = m_new
    out, lse = _finish(acc, m_i, l_i, h, SINKS, HAS_SINKS)
    _store_rows(OUT, LSE, out, lse, (q_row0 + tok).to(tl.int64), h, row_ok, offs_d, stride_ot, stride_oh,
                stride_lt, HEAD_DIM)


__all__ = ["ITEM_FIELDS", "MERGE_FIELDS", "attention_kernel", "merge_kernel"]
