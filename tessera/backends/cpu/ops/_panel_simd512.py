"""512-bit SIMD for the row-panel quantized GEMV (:mod:`._qdot_panel`): sixteen weight rows in the lanes of a vector.

The row kernels of :mod:`._qdot_wide` put 64 consecutive weights of *one* row in a vector, so every pair of blocks
ends in a per-row conversion, a scale pair spread over the halves and, at the row's end, a horizontal sum. Here a
vector's sixteen int32 lanes are sixteen weight *rows* (a panel), each lane holding four consecutive codes of its
row, and the activation's four matching int8 values are broadcast to all lanes: one ``VPDPBUSD`` adds 4 x 16
products with no horizontal work, and the scales of sixteen rows are one vector load. The layout is written once,
when a weight is repacked (:func:`._qdot_panel.repack_int4_g32`).

Vectors are the ``i8x64`` / ``i32x16`` / ``f32x16`` of :mod:`._int8_simd512`. Only the ``vnni512`` token emits
``VPDPBUSD``; any other token gets the same sums in portable IR, so a branch LLVM failed to delete still compiles on
a CPU without AVX-512 (the kernels are only called with ``vnni512``).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from tessera.backends.cpu.ops._int8_simd import _byte_pointer, _fn, _load, _load_typer, _splat, _token_isa
from tessera.backends.cpu.ops._int8_simd import is_scale_array
from tessera.backends.cpu.ops._int8_simd512 import _dot512, f32x16, i8x64, i32x16

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_V8x64 = ir.VectorType(_I8, 64)
_V8x16 = ir.VectorType(_I8, 16)
_V32x16 = ir.VectorType(_I32, 16)
_VF16 = ir.VectorType(_F32, 16)


def _emit_low(builder, ptr, dtype=None):
    return builder.and_(_load(builder, ptr, _V8x64), _splat(15, _V8x64))


def _emit_high(builder, ptr, dtype=None):
    return builder.lshr(_load(builder, ptr, _V8x64), _splat(4, _V8x64))


panel_low = _load_typer("panel_low", _emit_low, i8x64)
panel_low.__doc__ = "The low nibbles of 64 packed bytes at flat offset ``index`` (codes 0..15)."
panel_high = _load_typer("panel_high", _emit_high, i8x64)
panel_high.__doc__ = "The high nibbles of 64 packed bytes at flat offset ``index`` (codes 0..15)."



def _emit_u8_f32x16(builder, ptr, dtype=None):
    return builder.uitofp(builder.load(builder.bitcast(ptr, _V8x16.as_pointer()), align=1), _VF16)


load_u8_f32x16 = _load_typer("load_u8_f32x16", _emit_u8_f32x16, f32x16)
load_u8_f32x16.__doc__ = ("``f32x16``: sixteen unsigned bytes from flat offset ``index``, widened (a Q4_K panel's "
                          "6-bit sub-block scales or mins of sixteen rows).")



def _emit_i8_f32x16(builder, ptr, dtype=None):
    return builder.sitofp(builder.load(builder.bitcast(ptr, _V8x16.as_pointer()), align=1), _VF16)


load_i8_f32x16 = _load_typer("load_i8_f32x16", _emit_i8_f32x16, f32x16)
load_i8_f32x16.__doc__ = ("``f32x16``: sixteen signed bytes from flat offset ``index``, widened (a Q6_K panel's "
                          "sub-block scales of sixteen rows).")


@intrinsic
def q6_panel_codes(typingctx, arr, nib, top, c, high):
    """``i8x64``: 64 six-bit codes (0..63) of a Q6_K panel: the low (``high`` False) or high nibbles of the 64 bytes
    at ``nib`` below bits ``2c, 2c + 1`` of the 64 bytes at ``top`` (:func:`._qdot_q6panel.repack_q6k`). ``c`` and
    ``high`` should be constants, so the shifts fold."""
    from tessera.backends.cpu.ops._int8_simd import _check_bytes

    _check_bytes(arr, "q6_panel_codes")
    for v in (nib, top, c):
        if not isinstance(v, types.Integer):
            raise TypingError(f"q6_panel_codes: offsets and the chunk must be integers, got {v}")
    if not isinstance(high, types.Boolean):
        raise TypingError(f"q6_panel_codes: high must be a bool, got {high}")

    def codegen(context, builder, signature, args):
        sig = signature.args
        low = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[1], sig[1]), _V8x64)
        bits = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[2], sig[2]), _V8x64)
        shift = builder.trunc(context.cast(builder, args[3], sig[3], types.int64), _I8)
        shift = builder.shl(shift, ir.Constant(_I8, 1))
        one = builder.insert_element(ir.Constant(_V8x64, ir.Undefined), shift, ir.Constant(_I32, 0))
        spread = builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 64), [0] * 64))
        top2 = builder.shl(builder.and_(builder.lshr(bits, spread), _splat(3, _V8x64)), _splat(4, _V8x64))
        nibble = builder.select(builder.icmp_unsigned("!=", args[4], ir.Constant(ir.IntType(1), 0)),
                                builder.lshr(low, _splat(4, _V8x64)), builder.and_(low, _splat(15, _V8x64)))
        return builder.or_(nibble, top2)

    return i8x64(arr, nib, top, c, high), codegen


@intrinsic
def dot_bcast(typingctx, token, acc, codes, xq, index):
    """``acc + dot``: lane ``i`` gains the sum over ``j < 4`` of ``codes[4i + j] * xq[index + j]`` (unsigned codes,
    the four int8 activation values broadcast to every lane: one ``VPDPBUSD`` with a broadcast operand)."""
    isa = _token_isa(token, "dot_bcast")
    if (acc, codes) != (i32x16, i8x64):
        raise TypingError(f"dot_bcast: expected ({i32x16}, {i8x64}), got ({acc}, {codes})")
    if not isinstance(xq, types.Array) or xq.dtype != types.int8 or xq.layout != "C":
        raise TypingError(f"dot_bcast: the activation must be a C-contiguous int8 array, got {xq}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"dot_bcast: the offset must be an integer, got {index}")

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[3], args[3], args[4], signature.args[4])
        word = builder.load(builder.bitcast(ptr, _I32.as_pointer()), align=1)
        one = builder.insert_element(ir.Constant(_V32x16, ir.Undefined), word, ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
        if isa == "vnni512":
            fn = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V32x16, [_V32x16] * 3)
            return builder.call(fn, [args[1], builder.bitcast(args[2], _V32x16), splat])
        return builder.add(args[1], _dot512(builder, isa, args[2], builder.bitcast(splat, _V8x64)))

    return i32x16(token, acc, codes, xq, index), codegen


@intrinsic
def zero_i32x16(typingctx):
    """An ``i32x16`` of zeros."""

    def codegen(context, builder, signature, args):
        return _splat(0, _V32x16)

    return i32x16(), codegen


@intrinsic
def add_i32x16(typingctx, a, b):
    """``a + b`` lane by lane (``i32x16``)."""
    if (a, b) != (i32x16, i32x16):
        raise TypingError(f"add_i32x16: expected two {i32x16}, got {a}, {b}")

    def codegen(context, builder, signature, args):
        return builder.add(args[0], args[1])

    return i32x16(a, b), codegen


def _load_f32x16(builder, arr_type, ptr):
    if arr_type.dtype == types.float32:
        return builder.load(builder.bitcast(ptr, _VF16.as_pointer()), align=4)
    half = builder.load(builder.bitcast(ptr, ir.VectorType(ir.HalfType(), 16).as_pointer()), align=2)
    return builder.fpext(half, _VF16)  # VCVTPH2PS


@intrinsic
def load_scales16(typingctx, arr, index):
    """``f32x16``: sixteen scales from flat offset ``index`` of a C-contiguous float32 array or of float16 bits
    (int16), widened."""
    if not is_scale_array(arr):
        raise TypingError(f"load_scales16: expected C-contiguous float32 or float16 bits (int16), got {arr}")

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        return _load_f32x16(builder, signature.args[0], ptr)

    return f32x16(arr, index), codegen


@intrinsic
def offsets16(typingctx, offsets, index, scales):
    """``f32x16``: sixteen rows' additive term per unit of activation. ``offsets`` uint8 holds zero points ``z``
    (result ``-z * scale``); float32 or float16 bits hold Q4_1-style mins (result the min, widened)."""
    zero_points = isinstance(offsets, types.Array) and offsets.dtype == types.uint8 and offsets.layout == "C"
    if not zero_points and not is_scale_array(offsets):
        raise TypingError(f"offsets16: expected uint8 zero points or float mins (C-contiguous), got {offsets}")
    if scales != f32x16:
        raise TypingError(f"offsets16: the scales must be {f32x16}, got {scales}")

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        if not zero_points:
            return _load_f32x16(builder, signature.args[0], ptr)
        z = builder.uitofp(builder.load(builder.bitcast(ptr, _V8x16.as_pointer()), align=1), _VF16)
        return builder.fneg(builder.fmul(z, args[2]))

    return f32x16(offsets, index, scales), codegen


def _splat_load(builder, ptr):
    one = builder.insert_element(ir.Constant(_VF16, ir.Undefined), builder.load(ptr, align=4), ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _check_f32(arr, what):
    if not isinstance(arr, types.Array) or arr.dtype != types.float32 or arr.layout != "C":
        raise TypingError(f"{what}: expected a C-contiguous float32 array, got {arr}")


@intrinsic
def fma_i32_bcast(typingctx, d, scales, arr, index, acc):
    """``acc + float(d) * (scales * arr[index])`` lane by lane: a block's int32 dots times the sixteen rows' weight
    scales times the block's activation scale (one broadcast)."""
    _check_f32(arr, "fma_i32_bcast")
    if (d, scales, acc) != (i32x16, f32x16, f32x16):
        raise TypingError(f"fma_i32_bcast: expected ({i32x16}, {f32x16}, array, index, {f32x16}), got "
                          f"({d}, {scales}, {acc})")

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[2], args[2], args[3], signature.args[3])
        scale = builder.fmul(args[1], _splat_load(builder, ptr))
        fma = _fn(builder, "llvm.fma.v16f32", _VF16, [_VF16] * 3)
        return builder.call(fma, [builder.sitofp(args[0], _VF16), scale, args[4]])

    return f32x16(d, scales, arr, index, acc), codegen


@intrinsic
def fma_bcast(typingctx, a, arr, index, acc):
    """``acc + a * arr[index]`` lane by lane (``f32x16``, the scalar broadcast)."""
    _check_f32(arr, "fma_bcast")
    if (a, acc) != (f32x16, f32x16):
        raise TypingError(f"fma_bcast: expected ({f32x16}, array, index, {f32x16}), got ({a}, {acc})")

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[1], args[1], args[2], signature.args[2])
        fma = _fn(builder, "llvm.fma.v16f32", _VF16, [_VF16] * 3)
        return builder.call(fma, [args[0], _splat_load(builder, ptr), args[3]])

    return f32x16(a, arr, index, acc), codegen


@intrinsic
def store_f32x16(typingctx, out, index, v):
    """Store the sixteen lanes of ``v`` at flat offset ``index`` of a C-contiguous float32 array. Returns 0."""
    _check_f32(out, "store_f32x16")
    if v != f32x16:
        raise TypingError(f"store_f32x16: expected {f32x16}, got {v}")

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        builder.store(args[2], builder.bitcast(ptr, _VF16.as_pointer()), align=4)
        return ir.Constant(ir.IntType(64), 0)

    return types.int64(out, index, v), codegen


@intrinsic
def lane_f32x16(typingctx, v, j):
    """Lane ``j`` of ``v`` as float32."""
    if v != f32x16 or not isinstance(j, types.Integer):
        raise TypingError(f"lane_f32x16: expected ({f32x16}, an integer), got ({v}, {j})")

    def codegen(context, builder, signature, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], signature.args[1], types.int32))

    return types.float32(v, j), codegen
