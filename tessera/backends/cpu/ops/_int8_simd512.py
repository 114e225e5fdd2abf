"""Explicit 512-bit integer SIMD for Numba: two activation blocks of 32 per instruction, for the ``vnni512`` variant.

Why a second width: with 256-bit vectors a block of 32 weights costs about eleven instructions (unpack, one
``VPDPBUSD``, convert, the block's scale loaded, multiplied and broadcast, one FMA). A zmm register holds two blocks,
so each of those steps covers 64 weights, and the two blocks' scales are multiplied as a pair and spread over the two
halves with one permute: 13 instructions per 64 weights in the compiled loop against 23. Measured on Zen 4
(2026-12-02, M = 1, group 32, one thread, in cache): 0.73-0.94x the time of the 256-bit rows (the table in
``docs/kernels/quant.md``).

Vectors: ``i8x64`` (64 int8 lanes), ``i32x16`` and ``f32x16``; lanes 0-7 of the latter two belong to the first block
of a pair, 8-15 to the second. Addresses are flat element offsets from a C-contiguous array's data pointer, as in
:mod:`._int8_simd`, whose vector type, load typer and lane sum these reuse. Only the ``vnni512`` kernels use these
(chosen on CPUs with AVX512-VNNI and AVX512-BW), so no other CPU executes them: kernels branch on :func:`is_wide`, a
compile-time constant of the token, and for any other token :func:`dot_codes_x2` emits portable IR instead of
``VPDPBUSD``, so even a branch LLVM failed to delete would compile on a CPU without AVX-512.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from tessera.backends.cpu.ops._int8_simd import (
    _byte_pointer, _fn, _load, _load_typer, _mask, _splat, _token_isa, _VecType, code_signedness, emit_lane_sum,
    is_scale_array,
)

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_V8x64 = ir.VectorType(_I8, 64)
_V8x32 = ir.VectorType(_I8, 32)
_V32x16 = ir.VectorType(_I32, 16)
_VF16 = ir.VectorType(_F32, 16)
_VF2 = ir.VectorType(_F32, 2)

i8x64 = _VecType("i8x64", _V8x64)
i32x16 = _VecType("i32x16", _V32x16)
f32x16 = _VecType("f32x16", _VF16)


def _emit_load64(builder, ptr, dtype=None):
    return _load(builder, ptr, _V8x64)


def _emit_nibbles_x2(builder, ptr, dtype=None):
    # 32 bytes = two packed groups of 32; low nibbles are elements 0-15 of a group, high ones 16-31. The shuffle puts
    # each group's low half before its high half (one VPERMT2Q after the mask and the shift).
    raw = _load(builder, ptr, _V8x32)
    lo = builder.and_(raw, _splat(15, _V8x32))
    hi = builder.lshr(raw, _splat(4, _V8x32))
    return builder.shuffle_vector(lo, hi, _mask([*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]))


def _emit_block_codes_x2(builder, ptr, dtype):
    return _emit_nibbles_x2(builder, ptr) if dtype == types.uint8 else _emit_load64(builder, ptr)


load_i8x64 = _load_typer("load_i8x64", _emit_load64, i8x64)
load_i8x64.__doc__ = "64 bytes from flat offset ``index``: two activation blocks."
block_codes_x2 = _load_typer("block_codes_x2", _emit_block_codes_x2, i8x64)
block_codes_x2.__doc__ = ("Two group-32 blocks of weight codes at flat offset ``index``, in element order, by the "
                          "array's dtype: a uint8 array holds packed int4 (32 bytes unpacked to 64 codes 0..15), an "
                          "int8 array int8 codes (64 bytes).")


@intrinsic
def is_wide(typingctx, token):
    """True for the ``vnni512`` token (its kernels take the 512-bit rows), False for any other: a constant LLVM folds,
    so each kernel specialization keeps one branch."""
    wide = _token_isa(token, "is_wide") == "vnni512"

    def codegen(context, builder, signature, args):
        return context.get_constant(types.boolean, wide)

    return types.boolean(token), codegen


def _dot512(builder, isa: str, u, s):
    """Per int32 lane ``i``: the sum of ``u[4i+j] * s[4i+j]``, j < 4, u unsigned and s signed bytes."""
    if isa == "vnni512":
        fn = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V32x16, [_V32x16] * 3)
        return builder.call(fn, [_splat(0, _V32x16), builder.bitcast(u, _V32x16), builder.bitcast(s, _V32x16)])
    # Any other token: the same sums in portable IR (widen, multiply, add lanes 4i..4i+3). Kernels never run this
    # (is_wide is False for them); it keeps the dead branch valid on every target.
    v32x64 = ir.VectorType(_I32, 64)
    prod = builder.mul(builder.zext(u, v32x64), builder.sext(s, v32x64))
    total = builder.shuffle_vector(prod, prod, _mask(range(0, 64, 4)))
    for j in (1, 2, 3):
        total = builder.add(total, builder.shuffle_vector(prod, prod, _mask(range(j, 64, 4))))
    return total


@intrinsic
def dot_codes_x2(typingctx, token, arr, w, s):
    """``i32x16``: lane ``i`` = sum over ``j < 4`` of ``w[4i+j] * s[4i+j]``, one ``VPDPBUSD``. ``arr`` is the weight
    array ``w`` came from (:func:`block_codes_x2`): uint8 (int4 codes, unsigned) goes in as it is; int8 as
    ``|w| * (s * sign(w))``, the sign a masked negation since AVX-512 has no ``VPSIGNB`` (``s`` must not hold -128:
    quantized activations are within -127..127; ``|-128|`` read as unsigned is 128, still exact)."""
    isa = _token_isa(token, "dot_codes_x2")
    signed = code_signedness(arr, "dot_codes_x2")
    if (w, s) != (i8x64, i8x64):
        raise TypingError(f"dot_codes_x2: expected two {i8x64}, got {w}, {s}")

    def codegen(context, builder, signature, args):
        w_, s_ = args[2], args[3]
        if not signed:
            return _dot512(builder, isa, w_, s_)
        absw = builder.call(_fn(builder, "llvm.abs.v64i8", _V8x64, [_V8x64, ir.IntType(1)]),
                            [w_, ir.Constant(ir.IntType(1), 0)])
        negative = builder.icmp_signed("<", w_, _splat(0, _V8x64))
        return _dot512(builder, isa, absw, builder.select(negative, builder.sub(_splat(0, _V8x64), s_), s_))

    return i32x16(token, arr, w, s), codegen


@intrinsic
def scales_x2(typingctx, a, i, b, j):
    """``f32x16``: lanes 0-7 ``a[i] * b[j]``, lanes 8-15 ``a[i + 1] * b[j + 1]`` (a block pair's weight scales times
    its activation scales; flat offsets into C-contiguous arrays of float32 or, for ``a``, float16 bits as int16)."""
    if not is_scale_array(a):
        raise TypingError(f"scales_x2: the first array must be C-contiguous float32 or float16 bits (int16), got {a}")
    if not isinstance(b, types.Array) or b.dtype != types.float32 or b.layout != "C":
        raise TypingError(f"scales_x2: the second array must be C-contiguous float32, got {b}")
    if not isinstance(i, types.Integer) or not isinstance(j, types.Integer):
        raise TypingError(f"scales_x2: the offsets must be integers, got {i}, {j}")

    def codegen(context, builder, signature, args):
        pa = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        pb = _byte_pointer(context, builder, signature.args[2], args[2], args[3], signature.args[3])
        if signature.args[0].dtype == types.float32:
            wa = builder.load(builder.bitcast(pa, _VF2.as_pointer()), align=4)
        else:  # two float16 scales, widened (VCVTPH2PS)
            wa = builder.fpext(builder.load(builder.bitcast(pa, ir.VectorType(ir.HalfType(), 2).as_pointer()),
                                            align=2), _VF2)
        pair = builder.fmul(wa, builder.load(builder.bitcast(pb, _VF2.as_pointer()), align=4))
        return builder.shuffle_vector(pair, pair, _mask([0] * 8 + [1] * 8))

    return f32x16(a, i, b, j), codegen


@intrinsic
def fma_i32x16(typingctx, d, scale, acc):
    """``acc + float(d) * scale`` lane by lane (``f32x16``); int32 sums of <= 2^24 convert exactly."""
    if (d, scale, acc) != (i32x16, f32x16, f32x16):
        raise TypingError(f"fma_i32x16: expected ({i32x16}, {f32x16}, {f32x16}), got ({d}, {scale}, {acc})")

    def codegen(context, builder, signature, args):
        fma = _fn(builder, "llvm.fma.v16f32", _VF16, [_VF16] * 3)
        return builder.call(fma, [builder.sitofp(args[0], _VF16), args[1], args[2]])

    return f32x16(d, scale, acc), codegen


@intrinsic
def zero_f32x16(typingctx):
    """An ``f32x16`` of zeros."""

    def codegen(context, builder, signature, args):
        return _splat(0.0, _VF16)

    return f32x16(), codegen


@intrinsic
def add_f32x16(typingctx, a, b):
    """``a + b`` lane by lane (``f32x16``)."""
    if (a, b) != (f32x16, f32x16):
        raise TypingError(f"add_f32x16: expected two {f32x16}, got {a}, {b}")

    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])

    return f32x16(a, b), codegen


@intrinsic
def sum_f32x16(typingctx, a):
    """The sum of an ``f32x16``'s lanes, as float32."""
    if a != f32x16:
        raise TypingError(f"sum_f32x16: expected {f32x16}, got {a}")

    def codegen(context, builder, signature, args):
        return emit_lane_sum(builder, args[0])

    return types.float32(a), codegen
