"""Decode attention over an int8 KV cache with Q.K in int8 dot products (the ``kv_qk`` variants ``vnni512`` / ``vnni``).

The float path (:mod:`.decode_kernel`) widens every int8 key code to float32 and FMAs it against the float32
query: per 16 codes a sign-extending load, a conversion and, for the 4 query rows of a GQA group, 4 FMAs, so Q.K
alone costs about as many instructions per key as reading a bf16 key does, and int8's smaller stream buys little.
Here each query row is quantized once per step to int8 (symmetric, one float32 scale per (token, head), the softmax
scale folded in: :func:`quantize_queries`), and a key's dot product runs in ``VPDPBUSD`` (unsigned x signed bytes,
4 products summed into each int32 lane): the key codes are biased to unsigned (``k ^ 0x80`` is ``k + 128``) and
the query codes stay signed, so

    ``sum_x q_x k_x = VPDPBUSD(k + 128, q) - 128 sum_x q_x``,

with the second term one int32 per query row (``corr``), computed with the codes. One 512-bit ``VPDPBUSD`` covers
64 products, so a head dim of 128 is 2 instructions per (query row, key) plus the XOR and loads shared by the
group's rows. The int32 sums are exact (``|q|, |k| <= 127``: at most ``255 * 127 * D`` per lane); a score is
``(dot - corr) * q_scale * k_scale``, all three applied as the 4 x 4 tile of scores is stored. Softmax, the P.V pass
(codes widened and FMA'd), the K/V row prefetching and the item structure are the float path's own functions.

Scales: each chunk's key and value scales are gathered once, transposed to ``[Hkv, CHUNK]`` float32, and the next
chunk's scale lines are prefetched with its rows. Measured at batch 8, L=4096 (one thread, Zen 5): the float path's
two column passes over the scores (``_scale_columns``) and the scale lines' cache misses took 1.0 of this kernel's
4.7 ms; folding the key scale into the score store, one vector pass for the value scales and the prefetch bring it
to 4.1 ms.

Error class: the query's rounding to int8 (half a grid step, ``absmax / 254`` per element) is an error the float
path does not make; the result matches the float64 oracle run on the *de-quantized* query and K/V tightly, and the
unquantized oracle within about the bound of the KV quantization itself (``tests/attention/test_kv_qk8.py``).

The width is a compile-time choice carried by the ISA token (:mod:`.ops._int8_simd`): ``vnni512`` reads 64 codes
per vector, ``vnni`` 32 (256-bit ``VPDPBUSD``: AVX-VNNI, or AVX512-VNNI with VL). Each token is its own compiled
specialization, so a CPU without VNNI never compiles one; such CPUs (and head dims that are not a multiple of the
width) run the float path, the ``portable`` variant.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from tessera.backends.cpu import variants
from tessera.backends.cpu.attn_microkernels import prefetch_run
from tessera.backends.cpu.decode_kernel import (
    CHUNK,
    _apply_mask,
    _cursor_at,
    _next_chunk_offsets,
    _online_softmax_blocked,
    _post_scores,
    _round_up,
    _row_offsets,
    _values_blocked,
    _write_item,
)
from tessera.backends.cpu.decode_pv8 import quantize_weights, unpermute_rows, values_q8
from tessera.backends.cpu.kernel_args import DecodeSchedule
from tessera.backends.cpu.numba_math import FASTMATH, widen
from tessera.backends.cpu.ops._int8_simd import (
    TOKENS,
    IsaToken,
    _byte_pointer,
    _load,
    _mask,
    _splat,
    i32x8,
)
from tessera.backends.cpu.ops._int8_simd512 import i32x16
from tessera.backends.cpu.simd import LANES, line_elements, prefetch, vload, vmul, vstore
from tessera.backends.cpu.vnni_dot import CODE_BYTES, code_bytes, dpbusd, izero, vec_types, vnni_isa

_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _check_codes(arr, what: str) -> None:
    if not isinstance(arr, types.Array) or arr.dtype != types.int8 or arr.layout != "C":
        raise TypingError(f"{what}: expected a C-contiguous int8 array, got {arr}")


def _code_loader(name: str, biased: bool):
    def typer(typingctx, token, arr, index):
        vec = vec_types(vnni_isa(token, name))[0]
        _check_codes(arr, name)
        if not isinstance(index, types.Integer):
            raise TypingError(f"{name}: the offset must be an integer, got {index}")

        def codegen(context, builder, signature, args):
            ptr = _byte_pointer(context, builder, signature.args[1], args[1], args[2], signature.args[2])
            raw = _load(builder, ptr, vec.ir_type)
            # k ^ 0x80 = k + 128 read as unsigned: the operand VPDPBUSD takes unsigned (one VPXORD per vector)
            return builder.xor(raw, _splat(-128, vec.ir_type)) if biased else raw

        return vec(token, arr, index), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


load_keys = _code_loader("load_keys", True)
load_keys.__doc__ = "The token's width of int8 key codes from flat offset ``index``, biased to unsigned (``k + 128``)."
load_queries = _code_loader("load_queries", False)
load_queries.__doc__ = "The token's width of int8 query codes from flat offset ``index``."


@intrinsic
def isum(typingctx, acc):
    """The sum of an int32 accumulator's lanes (halving shuffles), as int32."""
    if acc not in (i32x16, i32x8):
        raise TypingError(f"isum: expected {i32x16} or {i32x8}, got {acc}")

    def codegen(context, builder, signature, args):
        vec = args[0]
        width = vec.type.count
        while width > 1:
            half = width // 2
            lo = builder.shuffle_vector(vec, vec, _mask(range(half)))
            hi = builder.shuffle_vector(vec, vec, _mask(range(half, width)))
            vec, width = builder.add(lo, hi), half
        return builder.extract_element(vec, ir.Constant(_I32, 0))

    return types.int32(acc), codegen


def _int_transpose_reduce(builder, vectors, lanes: int):
    """:func:`.simd._transpose_reduce` for int32 vectors of ``lanes`` lanes (integer adds: exact)."""
    owners = [[i] * lanes for i in range(len(vectors))]
    vecs = list(vectors)
    group = lanes
    while len(vecs) > 1 and group > 1:
        half = group // 2
        next_vecs, next_owners = [], []
        for a, b, oa, ob in zip(vecs[0::2], vecs[1::2], owners[0::2], owners[1::2]):
            lo_idx, hi_idx = [], []
            for start in range(0, lanes, group):
                lo = range(start, start + half)
                hi = range(start + half, start + group)
                lo_idx += list(lo) + [lanes + i for i in lo]
                hi_idx += list(hi) + [lanes + i for i in hi]
            next_vecs.append(builder.add(builder.shuffle_vector(a, b, _mask(lo_idx)),
                                         builder.shuffle_vector(a, b, _mask(hi_idx))))
            both = oa + ob
            next_owners.append([both[i] for i in lo_idx])
        vecs, owners, group = next_vecs, next_owners, half
    return vecs, owners


def _store_scores_typer(typingctx, sc, s_off, s_stride, corr, qscale, r, kscale, k_at, *accs):
    if not isinstance(sc, types.Array) or sc.dtype != types.float32 or sc.layout != "C":
        raise TypingError(f"store_scores_4x4: sc must be C-contiguous float32, got {sc}")
    if not isinstance(corr, types.Array) or corr.dtype != types.int32 or corr.layout != "C":
        raise TypingError(f"store_scores_4x4: corr must be C-contiguous int32, got {corr}")
    if not isinstance(qscale, types.Array) or qscale.dtype != types.float32 or qscale.layout != "C":
        raise TypingError(f"store_scores_4x4: qscale must be C-contiguous float32, got {qscale}")
    if not isinstance(kscale, types.Array) or kscale.dtype != types.float32 or kscale.layout != "C":
        raise TypingError(f"store_scores_4x4: kscale must be C-contiguous float32, got {kscale}")
    if len(accs) != 16 or accs[0] not in (i32x16, i32x8) or any(a != accs[0] for a in accs):
        raise TypingError(f"store_scores_4x4: expected 16 int32 accumulators of one width, got {accs}")
    lanes = accs[0].ir_type.count
    sig = types.void(sc, s_off, s_stride, corr, qscale, r, kscale, k_at, *accs)

    def codegen(context, builder, signature, args):
        vecs, owners = _int_transpose_reduce(builder, args[8:], lanes)
        lane_of = {who: (v * lanes + lane) for v, own in enumerate(owners) for lane, who in enumerate(own)}
        second = vecs[1] if len(vecs) > 1 else vecs[0]
        sums = builder.shuffle_vector(vecs[0], second, _mask([lane_of[i] for i in range(16)]))  # [4 * row + key]
        spread = _mask([i // 4 for i in range(16)])  # row r's value into its 4 lanes
        ip = context.cast(builder, args[5], signature.args[5], types.intp)
        corr_ary = context.make_array(signature.args[3])(context, builder, args[3])
        scale_ary = context.make_array(signature.args[4])(context, builder, args[4])
        c4 = builder.load(builder.bitcast(builder.gep(corr_ary.data, [ip]), ir.VectorType(_I32, 4).as_pointer()),
                          align=4)
        s4 = builder.load(builder.bitcast(builder.gep(scale_ary.data, [ip]), ir.VectorType(_F32, 4).as_pointer()),
                          align=4)
        dots = builder.sub(sums, builder.shuffle_vector(c4, c4, spread))  # exact: the bias removed in int32
        kp = builder.gep(context.make_array(signature.args[6])(context, builder, args[6]).data,
                         [context.cast(builder, args[7], signature.args[7], types.intp)])
        k4 = builder.load(builder.bitcast(kp, ir.VectorType(_F32, 4).as_pointer()), align=4)
        # one multiplier per score: the query row's scale times the key's (keys repeat every 4 lanes)
        mult = builder.fmul(builder.shuffle_vector(s4, s4, spread), builder.shuffle_vector(k4, k4, _mask([0, 1, 2, 3] * 4)))
        scores = builder.fmul(builder.sitofp(dots, ir.VectorType(_F32, 16)), mult)
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        b = context.cast(builder, args[1], signature.args[1], types.intp)
        st = context.cast(builder, args[2], signature.args[2], types.intp)
        row_type = ir.VectorType(_F32, 4).as_pointer()
        for i in range(4):
            row = builder.shuffle_vector(scores, scores, _mask(range(4 * i, 4 * i + 4)))
            ptr = builder.gep(ary.data, [builder.add(b, builder.mul(st, ir.Constant(b.type, i)))])
            builder.store(row, builder.bitcast(ptr, row_type), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_scores_4x4(typingctx, sc, s_off, s_stride, corr, qscale, r, kscale, k_at,
                     a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """Scores of 4 query rows x 4 keys from 16 int32 accumulators (row-major ``a[4 * i + c]``):
    ``sc[s_off + i * s_stride + c] = (sum(a[4 i + c]) - corr[r + i]) * qscale[r + i] * kscale[k_at + c]`` for
    ``i, c < 4`` (``kscale``: the keys' float32 scales)."""
    return _store_scores_typer(typingctx, sc, s_off, s_stride, corr, qscale, r, kscale, k_at,
                               a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)


# ------------------------------------------------------------------------------------------------ query rows
@njit(cache=True)
def quantize_queries(q, scale, seq_q_start, seq_q_len):  # pragma: no cover - compiled
    """The decode rows of ``q`` times the softmax ``scale``, quantized per (token, head) to symmetric int8.

    Parameters
    ----------
    q : float32 ``[tokens, Hq, D]``
    scale : float32, the softmax scale (folded into the row scales)
    seq_q_start, seq_q_len : int64 ``[seqs]``, the planned sequences' query tokens (other tokens stay 0)

    Returns
    -------
    codes : int8 ``[tokens, Hq, D]``, ``rint(q * scale / row_scale)`` within -127..127
    row_scale : float32 ``[tokens, Hq]``, ``absmax(q * scale) / 127`` (0 for a zero row)
    corr : int32 ``[tokens, Hq]``, ``128 * sum(codes)``: the bias the unsigned key operand adds to a dot product
    """
    t_all, hq, d = q.shape
    codes = np.zeros((t_all, hq, d), dtype=np.int8)
    row_scale = np.zeros((t_all, hq), dtype=np.float32)
    corr = np.zeros((t_all, hq), dtype=np.int32)
    for s in range(seq_q_start.shape[0]):
        for t in range(seq_q_start[s], seq_q_start[s] + seq_q_len[s]):
            for h in range(hq):
                amax = np.float32(0.0)
                for x in range(d):
                    amax = max(amax, abs(q[t, h, x] * scale))
                if amax == 0.0:
                    continue
                inv = np.float32(127.0) / amax
                total = 0
                for x in range(d):
                    c = min(max(np.rint(q[t, h, x] * scale * inv), np.float32(-127.0)), np.float32(127.0))
                    codes[t, h, x] = np.int8(c)
                    total += np.int32(c)
                row_scale[t, h] = amax / np.float32(127.0)
                corr[t, h] = 128 * total
    return codes, row_scale, corr


def dequantize_queries(codes: np.ndarray, row_scale: np.ndarray) -> np.ndarray:
    """float64 ``[tokens, Hq, D]``: what :func:`quantize_queries`' rows stand for (``q * scale``, rounded)."""
    return codes.astype(np.float64) * row_scale.astype(np.float64)[..., None]


# ------------------------------------------------------------------------------------------------ micro-kernels
@njit(inline="always", fastmath=FASTMATH)
def qk8_4x4(
    token, qc, q_off, d, k, k0, k1, k2, k3, sc, s_off, s_stride, corr, qscale, r, kscale, k_at,
    pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems,
):  # pragma: no cover - compiled
    """:func:`.attn_microkernels.qk_4x4` in int8: query code rows ``q_off + i * d`` of ``qc`` (rows ``r + i`` of
    ``corr`` / ``qscale``) against the key codes at ``k0..k3`` (their scales ``kscale[k_at:k_at + 4]``);
    prefetches once per cache line of K as it does."""
    a0 = izero(token)
    a1 = izero(token)
    a2 = izero(token)
    a3 = izero(token)
    a4 = izero(token)
    a5 = izero(token)
    a6 = izero(token)
    a7 = izero(token)
    a8 = izero(token)
    a9 = izero(token)
    a10 = izero(token)
    a11 = izero(token)
    a12 = izero(token)
    a13 = izero(token)
    a14 = izero(token)
    a15 = izero(token)
    w = code_bytes(token)
    line_mask = line_elements(k) - 1
    for x in range(0, d, w):
        if x & line_mask == 0 and pf_left > 0:
            pf_row, pf_col, pf_left = prefetch_run(pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems)
        c0 = load_keys(token, k, k0 + x)
        c1 = load_keys(token, k, k1 + x)
        c2 = load_keys(token, k, k2 + x)
        c3 = load_keys(token, k, k3 + x)
        qv = load_queries(token, qc, q_off + x)
        a0 = dpbusd(token, a0, c0, qv)
        a1 = dpbusd(token, a1, c1, qv)
        a2 = dpbusd(token, a2, c2, qv)
        a3 = dpbusd(token, a3, c3, qv)
        qv = load_queries(token, qc, q_off + d + x)
        a4 = dpbusd(token, a4, c0, qv)
        a5 = dpbusd(token, a5, c1, qv)
        a6 = dpbusd(token, a6, c2, qv)
        a7 = dpbusd(token, a7, c3, qv)
        qv = load_queries(token, qc, q_off + 2 * d + x)
        a8 = dpbusd(token, a8, c0, qv)
        a9 = dpbusd(token, a9, c1, qv)
        a10 = dpbusd(token, a10, c2, qv)
        a11 = dpbusd(token, a11, c3, qv)
        qv = load_queries(token, qc, q_off + 3 * d + x)
        a12 = dpbusd(token, a12, c0, qv)
        a13 = dpbusd(token, a13, c1, qv)
        a14 = dpbusd(token, a14, c2, qv)
        a15 = dpbusd(token, a15, c3, qv)
    store_scores_4x4(sc, s_off, s_stride, corr, qscale, r, kscale, k_at,
                     a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    return pf_row, pf_col, pf_left


@njit(inline="always", fastmath=FASTMATH)
def qk8_1x1(token, qc, r, d, k, k_off, corr, qscale, kscale):  # pragma: no cover - compiled
    """One score: query code row ``r`` against the key codes at ``k_off`` of scale ``kscale`` (edges of the 4 x 4
    blocking)."""
    a0 = izero(token)
    for x in range(0, d, code_bytes(token)):
        a0 = dpbusd(token, a0, load_keys(token, k, k_off + x), load_queries(token, qc, r * d + x))
    return np.float32(isum(a0) - corr[r]) * (qscale[r] * kscale)


@njit(inline="always", fastmath=FASTMATH)
def _scores_q8(token, sc, qc, corr, qscale, kst, k, v, row_off, hkv, rows_h, d, cn):  # pragma: no cover - compiled
    """``decode_kernel._scores_blocked`` with int8 dot products: the same blocking, padding rows and V hints; each
    score is multiplied by its key's scale as it is stored (``kst [Hkv, CHUNK]``: :func:`_gather_scales`)."""
    stride = sc.shape[1]
    row_elems = hkv * d
    share = 4 * d
    steps = -(-d // line_elements(k))
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
                pf_row, pf_col, pf_left = qk8_4x4(
                    token, qc, r * d, d, k, k0, k1, k2, k3, sc, r * stride + c, stride, corr, qscale, r,
                    kst, hk * CHUNK + c,
                    v, row_off, pf_row, pf_col, pf_left, pf_step, row_elems,
                )
        c += 4
    if c < cn:
        tail = (cn - c) * row_elems
        prefetch_run(v, row_off, c, 0, tail, tail, row_elems)
    for cc in range(c, cn):
        for hk in range(hkv):
            for rr in range(hk * rows_h, (hk + 1) * rows_h):
                sc[rr, cc] = qk8_1x1(token, qc, rr, d, k, row_off[cc] + hk * d, corr, qscale, kst[hk, cc])


@njit(inline="always", fastmath=FASTMATH)
def _gather_scales(kst, vst, ks, vs, rowi, hkv, cn):  # pragma: no cover - compiled
    """The chunk's key and value scales (float16 bits ``ks`` / ``vs [rows, Hkv]``) as float32, transposed to
    ``[Hkv, CHUNK]``: head ``hk``'s keys side by side, so the key scales are read 4 at a time with the scores and
    the value scales a vector at a time. Value columns past ``cn`` get 0."""
    for c in range(cn):
        row = rowi[c]
        for hk in range(hkv):
            kst[hk, c] = widen(ks[row, hk])
            vst[hk, c] = widen(vs[row, hk])
    for hk in range(hkv):
        for c in range(cn, CHUNK):
            vst[hk, c] = 0.0


@njit(inline="always", fastmath=FASTMATH)
def _scale_values(sc, vst, rows, rows_h):  # pragma: no cover - compiled
    """``sc[r, c] *= vst[r // rows_h, c]``: the values' scales on the probabilities (``p (c s) = (p s) c``), whole
    ``CHUNK``-wide rows in vectors."""
    for r in range(rows):
        hk = r // rows_h
        for c in range(0, CHUNK, LANES):
            vstore(sc, r * CHUNK + c, vmul(vload(sc, r * CHUNK + c), vload(vst, hk * CHUNK + c)))


@njit(inline="always", fastmath=FASTMATH)
def _decode_item_q8(
    item, qcodes, qrow_scale, qcorr, k, ks, v, vs, unit, part_out, part_lse, sch, next_item, token, pv, pv8_rows,
):  # pragma: no cover - compiled
    """``decode_kernel._decode_item_blocked`` with Q.K in int8 (``D`` a multiple of the token's width and of
    ``LANES``); the query arrives quantized (:func:`quantize_queries`). P.V runs in int8 too (:mod:`.decode_pv8`,
    at token ``pv``'s width) when the item has at least ``pv8_rows`` query rows per kv head (0: never), else the
    float path's pass."""
    hkv = k.shape[1]
    d = k.shape[2]
    hq = qcodes.shape[1]
    group = hq // hkv
    s = sch.item_seq[item]
    nq = sch.seq_q_len[s]
    kv_len = sch.seq_kv_len[s]
    nrows = hq * nq
    rows_h = group * nq
    pv8 = pv8_rows > 0 and rows_h >= pv8_rows
    start = sch.seq_q_start[s]
    # the item's rows h * nq + i, + 3 zero padding rows (see _scores_blocked); 4 KiB at Hq=32, D=128
    qc = np.zeros((nrows + 3, d), dtype=np.int8)
    corr = np.zeros(nrows + 3, dtype=np.int32)
    qscale = np.zeros(nrows + 3, dtype=np.float32)
    for h in range(hq):
        for i in range(nq):
            r = h * nq + i
            corr[r] = qcorr[start + i, h]
            qscale[r] = qrow_scale[start + i, h]
            for x in range(d):
                qc[r, x] = qcodes[start + i, h, x]
    acc = np.zeros((nrows, d), dtype=np.float32)
    m = np.full(nrows, -np.inf, dtype=np.float32)
    l = np.zeros(nrows, dtype=np.float32)
    sc = np.empty((nrows + 3, CHUNK), dtype=np.float32)
    row_off = np.empty(CHUNK, dtype=np.int64)
    next_off = np.empty(CHUNK, dtype=np.int64)
    rowi = np.empty(CHUNK, dtype=np.int64)
    kst = np.zeros((hkv, CHUNK), dtype=np.float32)
    vst = np.zeros((hkv, CHUNK), dtype=np.float32)
    w8 = np.zeros((nrows, CHUNK if pv8 else 0), dtype=np.uint8)
    wscale = np.zeros(nrows, dtype=np.float32)
    post = sch.softcap > 0.0 or sch.slopes.shape[0] > 0
    for seg in range(sch.item_seg_lo[item], sch.item_seg_hi[item]):
        j_begin = sch.seg_start[seg]
        j_end = sch.seg_end[seg]
        moff = sch.seg_mask_off[seg]
        for j0 in range(j_begin, j_end, CHUNK):
            cn = min(CHUNK, j_end - j0)
            _row_offsets(row_off, 0, s, j0, cn, sch.row_base, sch.block, hkv * d)
            _row_offsets(rowi, 0, s, j0, cn, sch.row_base, sch.block, 1)
            next_n = _next_chunk_offsets(next_off, sch, item, next_item, s, seg, j0 + cn, hkv * d)
            # Hint the next keys' scale lines too: no row hint covers them, and the first touch of each page's
            # scales (16 B per token at Hkv = 8, pages scattered) missed every chunk (measured at B=8, L=4096:
            # the two scale passes took 1.0 of 4.7 ms with these misses)
            for t in range(next_n):
                srow = next_off[t] // (hkv * d) * hkv
                prefetch(ks, srow)
                prefetch(vs, srow)
            _gather_scales(kst, vst, ks, vs, rowi, hkv, cn)
            _scores_q8(token, sc, qc, corr, qscale, kst, k, v, row_off, hkv, rows_h, d, cn)
            if post:
                _post_scores(sc, sch, hq, nq, kv_len, j0, cn)
            if moff >= 0:
                _apply_mask(sc, sch.mask_buf, moff, sch.seg_mask_hstride[seg], nq, hq, j_end - j_begin, j0 - j_begin,
                            cn)
            _online_softmax_blocked(sc, m, l, acc, cn)
            if pv8:
                quantize_weights(sc, vst, w8, wscale, nrows, rows_h)
                values_q8(pv, acc, w8, wscale, v, k, row_off, next_off, next_n, hkv, rows_h, d, cn)
            else:
                _scale_values(sc, vst, nrows, rows_h)
                _values_blocked(acc, sc, v, k, row_off, next_off, next_n, hkv, rows_h, d, cn)
    if pv8:
        unpermute_rows(pv, acc)
    _write_item(item, acc, m, l, part_out, part_lse)


@njit(fastmath=FASTMATH, cache=True)
def decode_item_q8(
    item, qcodes, qrow_scale, qcorr, k, ks, v, vs, unit, part_out, part_lse, sch, next_item, token, pv, pv8_rows,
):  # pragma: no cover - compiled
    """One work item (a function of its own for the reason ``decode_kernel.decode_item`` is)."""
    _decode_item_q8(item, qcodes, qrow_scale, qcorr, k, ks, v, vs, unit, part_out, part_lse, sch, next_item, token,
                    pv, pv8_rows)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def decode_q8_kernel(qcodes, qrow_scale, qcorr, k, ks, v, vs, unit, part_out, part_lse, sch, token, pv, pv8_rows):  # pragma: no cover
    """``decode_kernel.decode_attention_kernel`` with int8 Q.K.

    qcodes : int8 ``[tokens, Hq, D]``, qrow_scale : f32 ``[tokens, Hq]``, qcorr : int32 ``[tokens, Hq]`` (from
    :func:`quantize_queries`); k, v : int8 codes ``[rows, Hkv, D]``; ks, vs : their float16 scale bits (int16
    ``[rows, Hkv]``); unit : unused (1 for int8 codes; kept for the float kernel's argument order); part_out,
    part_lse, sch : as ``decode_attention_kernel``'s; token : the
    ``vnni512`` / ``vnni`` ISA token of Q.K; pv, pv8_rows : P.V's token and the query rows per kv head from
    which an item's P.V runs in int8, 0 for never (:func:`.decode_pv8.pv_token`).
    """
    sch = DecodeSchedule(*sch)
    item_order, worker_start = sch.item_order, sch.worker_start
    for w in prange(worker_start.shape[0] - 1):
        for i in range(worker_start[w], worker_start[w + 1]):
            decode_item_q8(item_order[i], qcodes, qrow_scale, qcorr, k, ks, v, vs, unit, part_out, part_lse, sch,
                           item_order[i + 1] if i + 1 < worker_start[w + 1] else -1, token, pv, pv8_rows)


@njit(fastmath=FASTMATH, cache=True)
def decode_q8_serial(qcodes, qrow_scale, qcorr, k, ks, v, vs, unit, part_out, part_lse, sch, token, pv, pv8_rows):  # pragma: no cover
    """:func:`decode_q8_kernel` on the calling thread, in item order."""
    sch = DecodeSchedule(*sch)
    n_items = sch.item_seq.shape[0]
    for item in range(n_items):
        decode_item_q8(item, qcodes, qrow_scale, qcorr, k, ks, v, vs, unit, part_out, part_lse, sch,
                       item + 1 if item + 1 < n_items else -1, token, pv, pv8_rows)


def qk_token(k: np.ndarray, head_dim: int) -> IsaToken | None:
    """The ISA token of the ``kv_qk`` variant that runs Q.K over key rows ``k`` (a NumPy view of the pages), or None
    for the float path: fp8 and float rows, the ``portable`` variant, and head dims that are not a multiple of the
    variant's vector of codes (nor of ``LANES``, which the shared P.V pass needs)."""
    if k.dtype != np.int8:
        return None
    name = variants.choose("kv_qk").name
    width = CODE_BYTES.get(name)
    if width is None or head_dim % width or head_dim % LANES:
        return None
    return TOKENS[name]
