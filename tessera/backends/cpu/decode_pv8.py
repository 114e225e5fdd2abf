"""P.V of decode attention over an int8 KV cache in int8 dot products (the ``kv_pv`` variants ``vnni512`` / ``vnni``).

With Q.K in ``VPDPBUSD`` (:mod:`.decode_qk8`), P.V became the int8 kernel's largest part: every value code widened
to float32 (a sign-extending load and a conversion per 16 codes) and one FMA per 16 codes for each of a GQA
group's 4 query rows, about 28 instructions per key for each 64 dimensions of a kv head. Here the probabilities are
rounded to 8 bits instead, and the products run 4 keys at a time in ``VPDPBUSD`` (unsigned x signed bytes):

- **Weights.** After the chunk's softmax, each query row's weights ``w_c = p_c * s_c`` (``s_c``: key ``c``'s value
  scale) are non-negative; they are rounded to ``u8 = round(w_c * 255 / max_c w_c)``, one float32 scale
  ``max_c w_c / 255`` per row and chunk (:func:`quantize_weights`). The softmax denominator stays the unrounded
  sum of ``p``.
- **Values.** The value codes of 4 keys are interleaved so that each 32-bit lane holds one dimension's 4 codes
  (two rounds of byte and word unpacks, 8 shuffles per 4 keys and ``W`` dimensions, shared by the group's rows);
  one ``VPDPBUSD`` against the row's 4 weights broadcast to every lane adds 4 keys' products to ``W / 4``
  dimensions. Per 4 keys and 64 dimensions: 4 loads, 8 shuffles, 4 broadcasts and 16 ``VPDPBUSD`` for 4 rows,
  against about 112 instructions on the float path.
- **Layout.** The unpacks work within 128-bit lanes, so accumulator ``j`` of a block holds dimensions
  ``16 l + 4 j + i`` (lane ``l``, element ``i``). The float32 accumulators are kept in that order for the whole
  work item (the online softmax rescales whole rows, so order does not matter to it) and put back in dimension
  order once, before the item is written (:func:`unpermute_rows`).
- **Exactness.** The int32 sums are exact (at most ``CHUNK * 255 * 128`` per lane); each chunk's sums are
  converted and FMA'd into the float32 accumulators with the row's weight scale (:func:`flush_rows`).

When: only for items with at least :data:`PV8_MIN_ROWS` query rows per kv head. With fewer (a GQA group of 4 and
one query) the pass is half the float pass's time with its value rows in cache, but the kernel's time is the same
or up to 10% longer: the pass's first touch of each chunk's value rows waits on memory either way.

Error class: rounding a weight to 8 bits is off by at most ``max w / 510``. Against the float64 oracle on the
de-quantized query and K/V the output moves by 2e-3 to 7e-3 of its largest element on random inputs, inside the
error of the int8 K/V themselves (``tests/attention/test_kv_qk8.py`` has the measured figures and the bound); the
kernel matches a float64 model of the same rounding to ~1e-7.

The width is the token's (:mod:`.ops._int8_simd`): ``vnni512`` blocks of 64 dimensions, ``vnni`` 32; a head dim
that is not a multiple of it runs the float P.V (:func:`pv_token`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from tessera.backends.cpu import variants
from tessera.backends.cpu.attn_microkernels import prefetch_run
from tessera.backends.cpu.decode_kernel import CHUNK, _cursor_at, _round_up
from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops._int8_simd import TOKENS, IsaToken, _byte_pointer, _fn, _load, _mask
from tessera.backends.cpu.simd import LANES, f32vec, line_elements, vfma, vhmax, vload, vmax, vmul, vsplat, vstore, vzero
from tessera.backends.cpu.vnni_dot import CODE_BYTES, code_bytes, dpbusd, izero, vec_types, vnni_isa

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _is_array(arr, dtype) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"


def interleave_masks(width: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Shuffle masks of ``VPUNPCKLBW`` / ``VPUNPCKHBW`` (over ``width`` bytes) and ``VPUNPCKLWD`` / ``VPUNPCKHWD``
    (over ``width // 2`` words), per 128-bit lane, as LLVM ``shufflevector`` indices into the two operands."""
    lanes = width // 16
    words = width // 2
    lo8 = [x for ln in range(lanes) for i in range(8) for x in (16 * ln + i, width + 16 * ln + i)]
    hi8 = [x for ln in range(lanes) for i in range(8, 16) for x in (16 * ln + i, width + 16 * ln + i)]
    lo16 = [x for ln in range(lanes) for i in range(4) for x in (8 * ln + i, words + 8 * ln + i)]
    hi16 = [x for ln in range(lanes) for i in range(4, 8) for x in (8 * ln + i, words + 8 * ln + i)]
    return lo8, hi8, lo16, hi16


def block_dims(width: int) -> np.ndarray:
    """int64 ``[width]``: the dimension (within a block of ``width``) that float accumulator position ``p`` holds,
    ``p = j * (width // 4) + 4 l + i`` holding ``16 l + 4 j + i`` (the unpacks' order, see the module docstring)."""
    lanes4 = width // 4
    dims = np.empty(width, dtype=np.int64)
    for j in range(4):
        for ln in range(width // 16):
            for i in range(4):
                dims[j * lanes4 + 4 * ln + i] = 16 * ln + 4 * j + i
    return dims


@intrinsic
def interleave4(typingctx, token, v, o0, o1, o2, o3):
    """The token's width of value codes from each of the flat offsets ``o0..o3`` of int8 ``v`` (4 keys' rows),
    interleaved into 4 vectors whose 32-bit lane ``4 l + i`` of vector ``j`` holds dimension ``16 l + 4 j + i``'s
    4 codes in key order."""
    vec, _ = vec_types(vnni_isa(token, "interleave4"))
    if not _is_array(v, types.int8):
        raise TypingError(f"interleave4: expected C-contiguous int8 value codes, got {v}")
    width = vec.ir_type.count
    lo8, hi8, lo16, hi16 = interleave_masks(width)
    words = ir.VectorType(_I16, width // 2)

    def codegen(context, builder, signature, args):
        rows = [_load(builder, _byte_pointer(context, builder, signature.args[1], args[1], a, t), vec.ir_type)
                for a, t in zip(args[2:], signature.args[2:])]
        lo01 = builder.bitcast(builder.shuffle_vector(rows[0], rows[1], _mask(lo8)), words)
        hi01 = builder.bitcast(builder.shuffle_vector(rows[0], rows[1], _mask(hi8)), words)
        lo23 = builder.bitcast(builder.shuffle_vector(rows[2], rows[3], _mask(lo8)), words)
        hi23 = builder.bitcast(builder.shuffle_vector(rows[2], rows[3], _mask(hi8)), words)
        outs = [builder.shuffle_vector(a, b, _mask(m)) for a, b, m in
                ((lo01, lo23, lo16), (lo01, lo23, hi16), (hi01, hi23, lo16), (hi01, hi23, hi16))]
        return context.make_tuple(builder, signature.return_type, [builder.bitcast(o, vec.ir_type) for o in outs])

    return types.UniTuple(vec, 4)(token, v, o0, o1, o2, o3), codegen


@intrinsic
def broadcast_weights4(typingctx, token, w, index):
    """The 4 bytes of uint8 ``w`` at flat offset ``index`` (4 keys' rounded weights), repeated in every 32-bit
    lane of a vector of the token's width."""
    vec, _ = vec_types(vnni_isa(token, "broadcast_weights4"))
    if not _is_array(w, types.uint8):
        raise TypingError(f"broadcast_weights4: expected C-contiguous uint8 weights, got {w}")
    lanes = vec.ir_type.count // 4

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[1], args[1], args[2], signature.args[2])
        word = builder.load(builder.bitcast(ptr, _I32.as_pointer()), align=1)
        one = builder.insert_element(ir.Constant(ir.VectorType(_I32, 1), None), word, ir.Constant(_I32, 0))
        spread = builder.shuffle_vector(one, one, _mask([0] * lanes))
        return builder.bitcast(spread, vec.ir_type)

    return vec(token, w, index), codegen


@intrinsic
def flush_rows(typingctx, token, acc, off, scale, a0, a1, a2, a3):
    """``acc.flat[off + j * L : + L] += float32(a_j) * scale`` for ``j < 4`` (``L``: the accumulators' lanes): a
    chunk's exact int32 sums into a row's float32 accumulators, in the interleaved order (one FMA per vector)."""
    _, accty = vec_types(vnni_isa(token, "flush_rows"))
    if not _is_array(acc, types.float32):
        raise TypingError(f"flush_rows: expected C-contiguous float32 accumulators, got {acc}")
    if (a0, a1, a2, a3) != (accty,) * 4:
        raise TypingError(f"flush_rows: expected 4 {accty} sums, got {(a0, a1, a2, a3)}")
    lanes = accty.ir_type.count
    fvec = ir.VectorType(_F32, lanes)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[1])(context, builder, args[1])
        base = context.cast(builder, args[2], signature.args[2], types.intp)
        scale = context.cast(builder, args[3], signature.args[3], types.float32)
        one = builder.insert_element(ir.Constant(ir.VectorType(_F32, 1), None), scale, ir.Constant(_I32, 0))
        sv = builder.shuffle_vector(one, one, _mask([0] * lanes))
        fma = _fn(builder, f"llvm.fma.v{lanes}f32", fvec, [fvec, fvec, fvec])
        for j, a in enumerate(args[4:]):
            ptr = builder.bitcast(builder.gep(ary.data, [builder.add(base, ir.Constant(base.type, j * lanes))]),
                                  fvec.as_pointer())
            cur = builder.load(ptr, align=4)
            builder.store(builder.call(fma, [builder.sitofp(a, fvec), sv, cur]), ptr, align=4)
        return context.get_dummy_value()

    return types.void(token, acc, off, scale, a0, a1, a2, a3), codegen


@intrinsic
def store_u8(typingctx, w, index, x):
    """Store the float32 vector ``x`` (values in ``[0, 256)``) truncated to uint8 at flat offset ``index`` of uint8
    ``w`` (one ``VCVTTPS2DQ`` and one ``VPMOVDB``)."""
    if not _is_array(w, types.uint8):
        raise TypingError(f"store_u8: expected C-contiguous uint8 weights, got {w}")
    if x != f32vec:
        raise TypingError(f"store_u8: expected a {f32vec} vector, got {x}")

    def codegen(context, builder, signature, args):
        ints = builder.fptosi(args[2], ir.VectorType(_I32, LANES))
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        builder.store(builder.trunc(ints, ir.VectorType(_I8, LANES)), builder.bitcast(ptr, ir.VectorType(_I8, LANES)
                                                                                      .as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(w, index, x), codegen


# ------------------------------------------------------------------------------------------------ micro-kernels
@njit(inline="always", fastmath=FASTMATH)
def pv8_4rows(
    token, acc, a_off, d, v, v_offs, v_add, w, w_off, w_stride, wscale, r, cn4,
    pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems,
):  # pragma: no cover - compiled
    """Accumulator rows ``a_off + i * d`` (``i < 4``; query rows ``r + i``), one block of the token's width, plus
    ``sum_c w[w_off + i * w_stride + c] * v[v_offs[c] + v_add :]`` over keys ``c < cn4`` (a multiple of 4), times
    ``wscale[r + i]``. Advances the prefetch cursor by ``pf_step`` elements per 4 keys; returns it."""
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
    w1 = w_off + w_stride
    w2 = w_off + 2 * w_stride
    w3 = w_off + 3 * w_stride
    for c in range(0, cn4, 4):
        if pf_left > 0:
            pf_row, pf_col, pf_left = prefetch_run(pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems)
        t0, t1, t2, t3 = interleave4(token, v, v_offs[c] + v_add, v_offs[c + 1] + v_add, v_offs[c + 2] + v_add,
                                     v_offs[c + 3] + v_add)
        p = broadcast_weights4(token, w, w_off + c)
        a0 = dpbusd(token, a0, p, t0)
        a1 = dpbusd(token, a1, p, t1)
        a2 = dpbusd(token, a2, p, t2)
        a3 = dpbusd(token, a3, p, t3)
        p = broadcast_weights4(token, w, w1 + c)
        a4 = dpbusd(token, a4, p, t0)
        a5 = dpbusd(token, a5, p, t1)
        a6 = dpbusd(token, a6, p, t2)
        a7 = dpbusd(token, a7, p, t3)
        p = broadcast_weights4(token, w, w2 + c)
        a8 = dpbusd(token, a8, p, t0)
        a9 = dpbusd(token, a9, p, t1)
        a10 = dpbusd(token, a10, p, t2)
        a11 = dpbusd(token, a11, p, t3)
        p = broadcast_weights4(token, w, w3 + c)
        a12 = dpbusd(token, a12, p, t0)
        a13 = dpbusd(token, a13, p, t1)
        a14 = dpbusd(token, a14, p, t2)
        a15 = dpbusd(token, a15, p, t3)
    flush_rows(token, acc, a_off, wscale[r], a0, a1, a2, a3)
    flush_rows(token, acc, a_off + d, wscale[r + 1], a4, a5, a6, a7)
    flush_rows(token, acc, a_off + 2 * d, wscale[r + 2], a8, a9, a10, a11)
    flush_rows(token, acc, a_off + 3 * d, wscale[r + 3], a12, a13, a14, a15)
    return pf_row, pf_col, pf_left


@njit(inline="always", fastmath=FASTMATH)
def pv8_1row(
    token, acc, a_off, v, v_offs, v_add, w, w_off, wscale, r, cn4, pf, pf_rows, pf_row, pf_col, pf_left, pf_step,
    pf_row_elems,
):  # pragma: no cover - compiled
    """:func:`pv8_4rows` for one row (GQA groups below 4 leave 1-3 rows per kv head)."""
    a0 = izero(token)
    a1 = izero(token)
    a2 = izero(token)
    a3 = izero(token)
    for c in range(0, cn4, 4):
        if pf_left > 0:
            pf_row, pf_col, pf_left = prefetch_run(pf, pf_rows, pf_row, pf_col, pf_left, pf_step, pf_row_elems)
        t0, t1, t2, t3 = interleave4(token, v, v_offs[c] + v_add, v_offs[c + 1] + v_add, v_offs[c + 2] + v_add,
                                     v_offs[c + 3] + v_add)
        p = broadcast_weights4(token, w, w_off + c)
        a0 = dpbusd(token, a0, p, t0)
        a1 = dpbusd(token, a1, p, t1)
        a2 = dpbusd(token, a2, p, t2)
        a3 = dpbusd(token, a3, p, t3)
    flush_rows(token, acc, a_off, wscale[r], a0, a1, a2, a3)
    return pf_row, pf_col, pf_left


# ------------------------------------------------------------------------------------------------ chunk passes
@njit(inline="always", fastmath=FASTMATH)
def quantize_weights(sc, vst, w, wscale, rows, rows_h):  # pragma: no cover - compiled
    """Row ``r``'s weights ``sc[r, c] * vst[r // rows_h, c]`` (probabilities times the values' scales, ``CHUNK``
    columns, 0 past the chunk's keys) rounded to uint8 ``w[r]`` against the row's largest, whose ``/ 255`` goes to
    ``wscale[r]`` (0 and zero weights for a row without weight)."""
    inv255 = np.float32(1.0 / 255.0)
    half = vsplat(np.float32(0.5))
    for r in range(rows):
        hk = r // rows_h
        base = r * CHUNK
        top = vzero()
        for c in range(0, CHUNK, LANES):
            x = vmul(vload(sc, base + c), vload(vst, hk * CHUNK + c))
            vstore(sc, base + c, x)
            top = vmax(top, x)
        t = vhmax(top)
        if t > 0.0:
            wscale[r] = t * inv255
            inv = vsplat(np.float32(255.0) / t)
            for c in range(0, CHUNK, LANES):
                store_u8(w, base + c, vfma(vload(sc, base + c), inv, half))
        else:
            wscale[r] = 0.0
            for c in range(CHUNK):
                w[r, c] = 0


@njit(inline="always", fastmath=FASTMATH)
def values_q8(token, acc, w, wscale, v, k, row_off, next_off, next_n, hkv, rows_h, d, cn):  # pragma: no cover
    """``decode_kernel._values_blocked`` with the rounded weights ``w`` (:func:`quantize_weights`) in
    ``VPDPBUSD``: every row's accumulators (interleaved order) plus its chunk's weighted value codes; hints the
    next ``next_n`` keys' K rows as the float pass does, a stretch per 4 keys. Key slots ``cn..`` up to a multiple
    of 4 reuse key 0's row (their weights are 0)."""
    width = code_bytes(token)
    stride = w.shape[1]
    cn4 = (cn + 3) // 4 * 4
    for c in range(cn, cn4):
        row_off[c] = row_off[0]
    row_elems = hkv * d
    nxb = d // width
    total = next_n * row_elems
    share = _round_up(-(-total // (hkv * nxb)), line_elements(k))
    pf_step = _round_up(-(-share // max(cn4 // 4, 1)), line_elements(k))
    for hk in range(hkv):
        koff = hk * d
        r = hk * rows_h
        r_end = r + rows_h
        p = hk * nxb
        for x in range(0, d, width):
            start = p * share
            pf_left = max(min(share, total - start), 0)
            pf_row, pf_col = _cursor_at(start, row_elems)
            rr = r
            while rr + 4 <= r_end:
                pf_row, pf_col, pf_left = pv8_4rows(
                    token, acc, rr * d + x, d, v, row_off, koff + x, w, rr * stride, stride, wscale, rr, cn4,
                    k, next_off, pf_row, pf_col, pf_left, pf_step, row_elems,
                )
                rr += 4
            for r1 in range(rr, r_end):
                pf_row, pf_col, pf_left = pv8_1row(
                    token, acc, r1 * d + x, v, row_off, koff + x, w, r1 * stride, wscale, r1, cn4,
                    k, next_off, pf_row, pf_col, pf_left, pf_step, row_elems,
                )
            p += 1


@njit(inline="always", fastmath=FASTMATH)
def unpermute_rows(token, acc):  # pragma: no cover - compiled
    """Put every accumulator row of ``acc [rows, D]`` back in dimension order (from :func:`block_dims`' order,
    block by block of the token's width)."""
    width = code_bytes(token)
    lanes4 = width // 4
    tmp = np.empty(width, dtype=np.float32)
    for r in range(acc.shape[0]):
        for b in range(0, acc.shape[1], width):
            for x in range(width):
                tmp[x] = acc[r, b + x]
            for j in range(4):
                for ln in range(width // 16):
                    for i in range(4):
                        acc[r, b + 16 * ln + 4 * j + i] = tmp[j * lanes4 + 4 * ln + i]


#: query rows per kv head (GQA group x queries per sequence) from which an item's P.V runs in int8. Below it the
#: float pass was as fast or faster: at batch 8 x 4096 keys, Hkv = 8, D = 128, two threads (Zen 5, 2026-12-05), the
#: kernel with int8 P.V took 1.02-1.10x the time with the float pass at 1-4 rows, 0.87-0.91x at 8, 0.81x at 16 and
#: 0.77x at 32. With few rows the pass waits on the value rows' cache misses, not on its instructions
#: (docs/quantization.md)
PV8_MIN_ROWS = 8


def pv_token(qk: IsaToken, head_dim: int) -> tuple[IsaToken, int]:
    """``(token, min_rows)`` for the int8 Q.K kernel's P.V: the ``kv_pv`` variant's token and the query rows per kv
    head from which an item runs it (:data:`PV8_MIN_ROWS`), or ``(qk, 0)`` for the float P.V everywhere (the
    ``float`` variant, or a head dim that is not a multiple of the variant's width). The token is a compile-time
    argument either way; passing ``qk`` for the float P.V keeps one specialization."""
    name = variants.choose("kv_pv").name
    width = CODE_BYTES.get(name)
    if width is None or head_dim % width:
        return qk, 0
    return TOKENS[name], PV8_MIN_ROWS
