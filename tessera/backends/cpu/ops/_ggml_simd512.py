"""Vector forms of ggml block formats' scales, and their 512-bit codes, for the int8-activation rows of
:mod:`._qdot_ggml`.

Why vectors for the scales: a Q4_K block holds eight 6-bit scales and eight 6-bit mins packed in 12 bytes, a Q6_K
block sixteen int8 scales. Decoded one at a time in scalar code they cost about as many instructions as the block's
dot products (measured on Zen 4, 2026-12-04: a 5632 x 2048 Q4_K GEMV row by row, one thread, 0.51 ms with scalar
scales). Decoded as one vector per block, multiplied by ``d`` and by the eight activation scales of the block's
eight 32-value pieces at once, each dot product then needs only a lane broadcast (256-bit) or a permute (512-bit)
of that vector.

Vectors are :mod:`._int8_simd`'s and :mod:`._int8_simd512`'s types. ``f32x8`` lane ``j`` of a K-quant block's scale
vector (:func:`k_scales8`) belongs to its 32-value sub-block ``j``; the 512-bit rows decode scales and mins as one
``f32x16`` (:func:`k_scales_mins16`: lanes 0-7 scales, 8-15 mins); a Q6_K block's ``f32x16`` lane ``i`` belongs to its
16-value sub-block ``i``. The scale vectors, and the lane picks of the 256-bit rows (:func:`fma_i32_lane`,
:func:`fma_i32_halves_of`), are portable IR that LLVM lowers for AVX2 too (a 16-lane vector as two ymm). The 512-bit
codes, dot products and permutes (:func:`q4k_codes_x16`, :func:`q5k_codes_x2`, :func:`q6k_codes_x2`,
:func:`dot_minus32_x2`, :func:`pair_lanes16`, :func:`quad_lanes`) are used by the ``vnni512`` kernels only (see
:mod:`._int8_simd512` for why a CPU without AVX-512 never executes them).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from tessera.backends.cpu.ops._int8_simd import (
    _byte_pointer, _check_bytes, _fn, _load, _mask, _splat, f32x8, i32x8,
)
from tessera.backends.cpu.ops._ggml_simd import _check_offsets, _nibbles, _splat_value
from tessera.backends.cpu.ops._int8_simd512 import _dot512, f32x16, i8x64, i32x16

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_V8x8 = ir.VectorType(_I8, 8)
_V8x16 = ir.VectorType(_I8, 16)
_V8x32 = ir.VectorType(_I8, 32)
_V8x64 = ir.VectorType(_I8, 64)
_V32x8 = ir.VectorType(_I32, 8)
_V32x16 = ir.VectorType(_I32, 16)
_VF8 = ir.VectorType(_F32, 8)
_VF16 = ir.VectorType(_F32, 16)


def _ptr(context, builder, sig, args, i, j):
    return _byte_pointer(context, builder, sig[i], args[i], args[j], sig[j])


def _i64(context, builder, value, typ):
    return context.cast(builder, value, typ, types.int64)


def _permute16(builder, vec, base, offsets):
    """``vec[base + offsets[i]]`` in lane ``i`` of an ``f32x16`` (one ``VPERMPS``; ``base`` an IR int32)."""
    index = builder.add(_splat_value(builder, base, _V32x16), ir.Constant(_V32x16, list(offsets)))
    fn = _fn(builder, "llvm.x86.avx512.permvar.sf.512", _VF16, [_VF16, _V32x16])
    return builder.call(fn, [vec, index])


# ------------------------------------------------------------------------------------------------ scales
def _k_scales_mins(builder, raw):
    """The eight 6-bit scales and eight 6-bit mins (<8 x i8> each) of a Q4_K / Q5_K block's 12 scale bytes
    ``raw`` (<16 x i8>, the last four bytes unused): sub-block ``j < 4`` keeps the low six bits of byte ``j`` (scale)
    and ``j + 4`` (min); ``j >= 4`` takes four bits from byte ``j + 4`` and its top two from the top of byte ``j - 4``
    (scale) or ``j`` (min)."""
    low = builder.shuffle_vector(raw, raw, _mask([0, 1, 2, 3, 8, 9, 10, 11]))  # scale j<4; scale/min nibbles j>=4
    mid = builder.shuffle_vector(raw, raw, _mask([4, 5, 6, 7, 8, 9, 10, 11]))  # min j<4
    top_s = builder.shuffle_vector(raw, raw, _mask([0, 1, 2, 3, 0, 1, 2, 3]))  # bytes j-4: scale's top bits
    top_m = builder.shuffle_vector(raw, raw, _mask([4, 5, 6, 7, 4, 5, 6, 7]))  # bytes j: min's top bits
    first = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
    six = _splat(63, _V8x8)
    hi_s = builder.or_(builder.and_(low, _splat(15, _V8x8)), builder.shl(builder.lshr(top_s, _splat(6, _V8x8)),
                                                                          _splat(4, _V8x8)))
    hi_m = builder.or_(builder.lshr(low, _splat(4, _V8x8)), builder.shl(builder.lshr(top_m, _splat(6, _V8x8)),
                                                                         _splat(4, _V8x8)))
    scales = builder.select(first, builder.and_(low, six), hi_s)
    mins = builder.select(first, builder.and_(mid, six), hi_m)
    return scales, mins


def _k_vector_typer(what: str, want_mins: bool):
    def typer(typingctx, arr, index):
        _check_bytes(arr, what)
        _check_offsets(what, index)

        def codegen(context, builder, signature, args):
            raw = _load(builder, _ptr(context, builder, signature.args, args, 0, 1), _V8x16)
            scales, mins = _k_scales_mins(builder, raw)
            return builder.uitofp(mins if want_mins else scales, _VF8)

        return f32x8(arr, index), codegen

    typer.__name__ = typer.__qualname__ = what
    return intrinsic(typer)


k_scales8 = _k_vector_typer("k_scales8", False)
k_scales8.__doc__ = "``f32x8``: the eight 6-bit sub-block scales of the Q4_K / Q5_K block whose 12 scale bytes start at ``index``."
k_mins8 = _k_vector_typer("k_mins8", True)
k_mins8.__doc__ = "``f32x8``: the eight 6-bit sub-block mins of the Q4_K / Q5_K block whose 12 scale bytes start at ``index``."


@intrinsic
def k_scales_mins16(typingctx, arr, index):
    """``f32x16``: a Q4_K / Q5_K block's eight 6-bit sub-block scales (lanes 0-7) and eight mins (8-15), from its 12
    scale bytes at ``index``: both decoded in one 16-byte vector (about ten instructions where two 8-lane decodes
    took sixteen), for the 512-bit rows."""
    _check_bytes(arr, "k_scales_mins16")
    _check_offsets("k_scales_mins16", index)

    def codegen(context, builder, signature, args):
        raw = _load(builder, _ptr(context, builder, signature.args, args, 0, 1), _V8x16)
        # lane j < 8 is scale j, lane 8 + j min j; a: the byte holding the low bits (the low six for j < 4, a nibble
        # for j >= 4), t: the byte whose top two bits are bits 4-5 of j >= 4
        a = builder.shuffle_vector(raw, raw, _mask([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11]))
        t = builder.shuffle_vector(raw, raw, _mask([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]))
        low6 = builder.and_(a, _splat(63, _V8x16))
        high_nibble = ir.Constant(ir.VectorType(ir.IntType(1), 16), [0] * 12 + [1] * 4)
        nibble = builder.select(high_nibble, builder.lshr(a, _splat(4, _V8x16)), builder.and_(a, _splat(15, _V8x16)))
        top = builder.lshr(builder.and_(t, _splat(0xC0, _V8x16)), _splat(2, _V8x16))
        first_four = ir.Constant(ir.VectorType(ir.IntType(1), 16), ([1] * 4 + [0] * 4) * 2)
        codes = builder.select(first_four, low6, builder.or_(nibble, top))
        return builder.uitofp(codes, _VF16)

    return f32x16(arr, index), codegen


@intrinsic
def k_d_dmin16(typingctx, arr, index, sixteenths):
    """``f32x16``: a K-quant block's ``d`` in lanes 0-7 and ``dmin`` in 8-15 (the float16 pair at ``index``), the
    odd lanes of ``d`` times 1/16 when ``sixteenths`` (a literal bool; see :func:`q4k_codes_x16`)."""
    _check_bytes(arr, "k_d_dmin16")
    _check_offsets("k_d_dmin16", index)
    if not isinstance(sixteenths, types.BooleanLiteral):
        raise TypingError(f"k_d_dmin16: 'sixteenths' must be a literal bool, got {sixteenths}")
    factors = ([1.0, 1.0 / 16] * 4 if sixteenths.literal_value else [1.0] * 8) + [1.0] * 8

    def codegen(context, builder, signature, args):
        ptr = _ptr(context, builder, signature.args, args, 0, 1)
        pair = builder.load(builder.bitcast(ptr, ir.VectorType(ir.HalfType(), 2).as_pointer()), align=1)
        wide = builder.fpext(pair, ir.VectorType(_F32, 2))
        spread = builder.shuffle_vector(wide, wide, _mask([0] * 8 + [1] * 8))
        return builder.fmul(spread, ir.Constant(_VF16, factors))

    return f32x16(arr, index, sixteenths), codegen


@intrinsic
def load_f32x8_pair(typingctx, a, i, b, j):
    """``f32x16``: eight float32 of ``a`` from flat offset ``i`` in lanes 0-7, eight of ``b`` from ``j`` in 8-15."""
    for arr in (a, b):
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.layout == "C"):
            raise TypingError(f"load_f32x8_pair: expected C-contiguous float32 arrays, got {arr}")
    _check_offsets("load_f32x8_pair", i, j)

    def codegen(context, builder, signature, args):
        sig = signature.args
        lo = builder.load(builder.bitcast(_ptr(context, builder, sig, args, 0, 1), _VF8.as_pointer()), align=4)
        hi = builder.load(builder.bitcast(_ptr(context, builder, sig, args, 2, 3), _VF8.as_pointer()), align=4)
        return builder.shuffle_vector(lo, hi, _mask(range(16)))

    return f32x16(a, i, b, j), codegen


@intrinsic
def pair_lanes16(typingctx, scales, j):
    """``f32x16``: lanes 0-7 ``scales[j]``, 8-15 ``scales[j + 1]``, from a 16-lane vector."""
    if scales != f32x16:
        raise TypingError(f"pair_lanes16: expected {f32x16}, got {scales}")
    _check_offsets("pair_lanes16", j)

    def codegen(context, builder, signature, args):
        lane = builder.trunc(_i64(context, builder, args[1], signature.args[1]), _I32)
        return _permute16(builder, args[0], lane, [0] * 8 + [1] * 8)

    return f32x16(scales, j), codegen


@intrinsic
def sum_high8(typingctx, v):
    """The sum of lanes 8-15 of an ``f32x16``, as float32."""
    if v != f32x16:
        raise TypingError(f"sum_high8: expected {f32x16}, got {v}")

    def codegen(context, builder, signature, args):
        from tessera.backends.cpu.ops._int8_simd import emit_lane_sum

        return emit_lane_sum(builder, builder.shuffle_vector(args[0], args[0], _mask(range(8, 16))))

    return types.float32(v), codegen


@intrinsic
def q6k_scales16(typingctx, arr, index):
    """``f32x16``: the sixteen int8 sub-block scales of the Q6_K block whose scale bytes start at ``index``."""
    _check_bytes(arr, "q6k_scales16")
    _check_offsets("q6k_scales16", index)

    def codegen(context, builder, signature, args):
        raw = _load(builder, _ptr(context, builder, signature.args, args, 0, 1), _V8x16)
        return builder.sitofp(raw, _VF16)

    return f32x16(arr, index), codegen


# ------------------------------------------------------------------------------------------------ float vectors
@intrinsic
def load_f32x8(typingctx, arr, index):
    """``f32x8``: eight float32 from flat offset ``index`` of a C-contiguous float32 array."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.layout == "C"):
        raise TypingError(f"load_f32x8: expected a C-contiguous float32 array, got {arr}")
    _check_offsets("load_f32x8", index)

    def codegen(context, builder, signature, args):
        ptr = _ptr(context, builder, signature.args, args, 0, 1)
        return builder.load(builder.bitcast(ptr, _VF8.as_pointer()), align=4)

    return f32x8(arr, index), codegen


@intrinsic
def mul_f32x8(typingctx, a, b):
    """``a * b`` lane by lane; ``b`` an ``f32x8`` or a float scalar (broadcast)."""
    if a != f32x8 or not (b == f32x8 or isinstance(b, types.Float)):
        raise TypingError(f"mul_f32x8: expected ({f32x8}, {f32x8} or a float), got ({a}, {b})")

    def codegen(context, builder, signature, args):
        other = args[1]
        if signature.args[1] != f32x8:
            other = _splat_value(builder, context.cast(builder, args[1], signature.args[1], types.float32), _VF8)
        return builder.fmul(args[0], other)

    return f32x8(a, b), codegen


@intrinsic
def fma_f32x8(typingctx, a, b, acc):
    """``acc + a * b`` lane by lane (``f32x8``)."""
    if (a, b, acc) != (f32x8, f32x8, f32x8):
        raise TypingError(f"fma_f32x8: expected three {f32x8}, got ({a}, {b}, {acc})")

    def codegen(context, builder, signature, args):
        return builder.call(_fn(builder, "llvm.fma.v8f32", _VF8, [_VF8] * 3), list(args))

    return f32x8(a, b, acc), codegen


@intrinsic
def fma_i32_lane(typingctx, d, scales, j, acc):
    """``acc + float(d) * scales[j]`` (``f32x8``; ``scales[j]`` broadcast): a 32-value sub-block's dot product times
    its lane of the block's scale vector."""
    if (d, scales, acc) != (i32x8, f32x8, f32x8):
        raise TypingError(f"fma_i32_lane: expected ({i32x8}, {f32x8}, int, {f32x8}), got ({d}, {scales}, {j}, {acc})")
    _check_offsets("fma_i32_lane", j)

    def codegen(context, builder, signature, args):
        lane = builder.trunc(_i64(context, builder, args[2], signature.args[2]), _I32)
        scale = _splat_value(builder, builder.extract_element(args[1], lane), _VF8)
        fma = _fn(builder, "llvm.fma.v8f32", _VF8, [_VF8] * 3)
        return builder.call(fma, [builder.sitofp(args[0], _VF8), scale, args[3]])

    return f32x8(d, scales, j, acc), codegen


@intrinsic
def fma_i32_halves_of(typingctx, d, scales, i, acc):
    """``acc + float(d) * [scales[2i] x 4, scales[2i + 1] x 4]`` (``f32x8``): a Q6_K chunk of 32 values is two
    16-value sub-blocks, four int32 lanes of the dot product each, with lanes ``2i`` and ``2i + 1`` of the block's
    scale vector."""
    if (d, scales, acc) != (i32x8, f32x16, f32x8):
        raise TypingError(f"fma_i32_halves_of: expected ({i32x8}, {f32x16}, int, {f32x8}), got "
                          f"({d}, {scales}, {i}, {acc})")
    _check_offsets("fma_i32_halves_of", i)

    def codegen(context, builder, signature, args):
        lane = builder.trunc(_i64(context, builder, args[2], signature.args[2]), _I32)
        lane = builder.add(lane, lane)
        a = builder.extract_element(args[1], lane)
        b = builder.extract_element(args[1], builder.add(lane, ir.Constant(_I32, 1)))
        pair = builder.insert_element(ir.Constant(_VF8, ir.Undefined), a, ir.Constant(_I32, 0))
        pair = builder.insert_element(pair, b, ir.Constant(_I32, 1))
        scale = builder.shuffle_vector(pair, pair, _mask([0] * 4 + [1] * 4))
        fma = _fn(builder, "llvm.fma.v8f32", _VF8, [_VF8] * 3)
        return builder.call(fma, [builder.sitofp(args[0], _VF8), scale, args[3]])

    return f32x8(d, scales, i, acc), codegen


@intrinsic
def quad_lanes(typingctx, scales, p):
    """``f32x16``: four lanes each of ``scales[4p]`` .. ``scales[4p + 3]`` (four 16-value sub-blocks of a Q6_K
    block, one zmm of their dot products)."""
    if scales != f32x16:
        raise TypingError(f"quad_lanes: expected {f32x16}, got {scales}")
    _check_offsets("quad_lanes", p)

    def codegen(context, builder, signature, args):
        base = builder.mul(builder.trunc(_i64(context, builder, args[1], signature.args[1]), _I32),
                           ir.Constant(_I32, 4))
        return _permute16(builder, args[0], base, [i // 4 for i in range(16)])

    return f32x16(scales, p), codegen


@intrinsic
def pairs16(typingctx, v):
    """``f32x16``: ``[v0, v0, v1, v1, ..., v7, v7]`` (an activation scale per 32 values, per 16-value sub-block)."""
    if v != f32x8:
        raise TypingError(f"pairs16: expected {f32x8}, got {v}")

    def codegen(context, builder, signature, args):
        return builder.shuffle_vector(args[0], args[0], _mask([i // 2 for i in range(16)]))

    return f32x16(v), codegen


@intrinsic
def mul_f32x16(typingctx, a, b):
    """``a * b`` lane by lane; ``b`` an ``f32x16`` or a float scalar (broadcast)."""
    if a != f32x16 or not (b == f32x16 or isinstance(b, types.Float)):
        raise TypingError(f"mul_f32x16: expected ({f32x16}, {f32x16} or a float), got ({a}, {b})")

    def codegen(context, builder, signature, args):
        other = args[1]
        if signature.args[1] != f32x16:
            other = _splat_value(builder, context.cast(builder, args[1], signature.args[1], types.float32), _VF16)
        return builder.fmul(args[0], other)

    return f32x16(a, b), codegen


# ------------------------------------------------------------------------------------------------ 512-bit codes
def _bit16(builder, vec, bit):
    """16 where ``vec``'s byte has ``bit`` (a <64 x i8> constant mask per lane) set, else 0."""
    hit = builder.icmp_unsigned("!=", builder.and_(vec, bit), _splat(0, _V8x64))
    return builder.select(hit, _splat(16, _V8x64), _splat(0, _V8x64))


@intrinsic
def q5k_codes_x2(typingctx, arr, qs, qh, c):
    """``i8x64``: the 64 codes (0..31) of chunk ``c`` (0..3) of a Q5_K block: the low nibbles of the 32 bytes at
    ``qs`` (sub-block ``2c``), then their high nibbles (``2c + 1``), with the 5th bits from bits ``2c`` and ``2c + 1``
    of the 32 bytes at ``qh``."""
    _check_bytes(arr, "q5k_codes_x2")
    _check_offsets("q5k_codes_x2", qs, qh, c)

    def codegen(context, builder, signature, args):
        sig = signature.args
        raw = _load(builder, _ptr(context, builder, sig, args, 0, 1), _V8x32)
        lo = builder.and_(raw, _splat(15, _V8x32))
        hi = builder.lshr(raw, _splat(4, _V8x32))
        codes = builder.shuffle_vector(lo, hi, _mask(range(64)))
        hbits = _load(builder, _ptr(context, builder, sig, args, 0, 2), _V8x32)
        both = builder.shuffle_vector(hbits, hbits, _mask(list(range(32)) * 2))
        chunk = builder.trunc(_i64(context, builder, args[3], sig[3]), _I8)
        shift = builder.add(chunk, chunk)  # bit 2c for the first 32 codes, 2c + 1 for the last
        one = ir.Constant(_I8, 1)
        lo_bit = builder.shl(one, shift)
        hi_bit = builder.shl(one, builder.add(shift, one))
        mask = builder.shuffle_vector(_splat_value(builder, lo_bit, _V8x32), _splat_value(builder, hi_bit, _V8x32),
                                      _mask(range(64)))
        return builder.or_(codes, _bit16(builder, both, mask))

    return i8x64(arr, qs, qh, c), codegen


@intrinsic
def q4k_codes_x16(typingctx, arr, qs):
    """``i8x64``: the 32 bytes at ``qs`` in both halves, masked: the low nibbles (sub-block ``2c`` of a Q4_K chunk,
    codes 0..15) in lanes 0-31 and the high nibbles *left in place* (sub-block ``2c + 1``, codes times 16) in lanes
    32-63. Two instructions (a broadcast load, an AND) where shifting the high nibbles down and joining the halves
    took four; the caller scales sub-block ``2c + 1`` by 1/16 instead (exact: a power of two), and the unsigned
    products stay exact in the dot product's int32 lanes (``4 * 240 * 127``)."""
    _check_bytes(arr, "q4k_codes_x16")
    _check_offsets("q4k_codes_x16", qs)

    def codegen(context, builder, signature, args):
        raw = _load(builder, _ptr(context, builder, signature.args, args, 0, 1), _V8x32)
        both = builder.shuffle_vector(raw, raw, _mask(list(range(32)) * 2))
        return builder.and_(both, ir.Constant(_V8x64, [15] * 32 + [240] * 32))

    return i8x64(arr, qs), codegen


@intrinsic
def q6k_codes_x2(typingctx, arr, ql, qh, high, shift):
    """``i8x64``: 64 unsigned codes (0..63) of a Q6_K half-block: the low (``high`` False) or high nibbles of the
    64 bytes at ``ql``, with bits ``shift, shift + 1`` (first 32) and ``shift + 2, shift + 3`` (last 32) of the 32
    bytes at ``qh`` above them."""
    _check_bytes(arr, "q6k_codes_x2")
    _check_offsets("q6k_codes_x2", ql, qh, high, shift)

    def codegen(context, builder, signature, args):
        sig = signature.args
        raw = _load(builder, _ptr(context, builder, sig, args, 0, 1), _V8x64)
        low4 = _nibbles(context, builder, raw, args[3], sig[3])
        hbits = _load(builder, _ptr(context, builder, sig, args, 0, 2), _V8x32)
        s = builder.trunc(_i64(context, builder, args[4], sig[4]), _I8)
        first = builder.lshr(hbits, _splat_value(builder, s, _V8x32))
        second = builder.lshr(hbits, _splat_value(builder, builder.add(s, ir.Constant(_I8, 2)), _V8x32))
        high2 = builder.and_(builder.shuffle_vector(first, second, _mask(range(64))), _splat(3, _V8x64))
        return builder.or_(low4, builder.shl(high2, _splat(4, _V8x64)))

    return i8x64(arr, ql, qh, high, shift), codegen


@intrinsic
def dot_minus32_x2(typingctx, token, u, s):
    """``i32x16``: lane ``i`` = sum over ``j < 4`` of ``(u[4i+j] - 32) * s[4i+j]`` for unsigned ``u`` (Q6_K's codes
    0..63) and int8 ``s``: two ``VPDPBUSD``, the second by the constant 32."""
    from tessera.backends.cpu.ops._int8_simd import _token_isa

    isa = _token_isa(token, "dot_minus32_x2")
    if (u, s) != (i8x64, i8x64):
        raise TypingError(f"dot_minus32_x2: expected two {i8x64}, got {u}, {s}")

    def codegen(context, builder, signature, args):
        return builder.sub(_dot512(builder, isa, args[1], args[2]), _dot512(builder, isa, _splat(32, _V8x64), args[2]))

    return i32x16(token, u, s), codegen
