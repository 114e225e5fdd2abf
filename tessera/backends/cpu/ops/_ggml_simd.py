"""Explicit 256-bit SIMD for ggml's block formats (:mod:`tessera.kernels.ggml_blocks`): their weight codes unpacked
into ``i8x32`` vectors for the int8 dot products of :mod:`._int8_simd`, and a block's float16 ``d`` read from its bytes
(:func:`load_f16`). The scale vectors and the 512-bit forms are in :mod:`._ggml_simd512`.

Each function unpacks 32 codes of one block straight from the file's bytes, in the order of the 32 activation values
they multiply, so one ``dot_u8s8`` / ``dot_s8s8`` covers them:

- :func:`k_codes`: 32 codes of a Q4_K / Q5_K sub-block (the low or high nibbles of 32 bytes, plus the 5th bit of
  Q5_K from its ``qh`` bytes);
- :func:`q5_codes`: the 32 codes of a Q5_0 / Q5_1 block (16 nibble bytes, the 5th bits in a little-endian u32);
- :func:`q6k_codes`: 32 codes of a Q6_K block minus 32 (signed, -32..31: four low bits from ``ql``, two high ones
  from ``qh``).

Addresses are flat element offsets from a C-contiguous uint8 array's data pointer, as in :mod:`._int8_simd`.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from tessera.backends.cpu.ops._int8_simd import (
    _byte_pointer, _check_bytes, _load, _mask, _splat, i8x32,
)

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_V8x32 = ir.VectorType(_I8, 32)
_V8x16 = ir.VectorType(_I8, 16)
_V8x4 = ir.VectorType(_I8, 4)


def _check_offsets(what: str, *offsets) -> None:
    for o in offsets:
        if not isinstance(o, (types.Integer, types.Boolean)):
            raise TypingError(f"{what}: offsets and selectors must be integers, got {o}")


def _as_i8(context, builder, value, typ):
    return builder.trunc(context.cast(builder, value, typ, types.int64), _I8)


def _splat_value(builder, value, vec_type):
    """``value`` (an IR scalar) in every lane of ``vec_type``."""
    one = builder.insert_element(ir.Constant(vec_type, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec_type, ir.Undefined), _mask([0] * vec_type.count))


def _nibbles(context, builder, raw, high, high_type):
    """The high nibbles of byte vector ``raw`` where the (runtime) selector ``high`` is non-zero, else the low ones."""
    is_high = builder.icmp_signed("!=", context.cast(builder, high, high_type, types.int64),
                                  ir.Constant(ir.IntType(64), 0))
    vec = raw.type
    return builder.select(is_high, builder.lshr(raw, _splat(4, vec)), builder.and_(raw, _splat(15, vec)))


def _bit_lanes(builder, vec, bit):
    """16 where ``vec``'s lane has the bit of byte mask ``bit`` set, else 0."""
    mask = _splat_value(builder, bit, _V8x32)
    hit = builder.icmp_unsigned("!=", builder.and_(vec, mask), _splat(0, _V8x32))
    return builder.select(hit, _splat(16, _V8x32), _splat(0, _V8x32))


@intrinsic
def k_codes(typingctx, arr, qs, qh, high, bit):
    """``i8x32``: the codes of one 32-value sub-block of a Q4_K / Q5_K block. ``qs``: flat offset of the 32 bytes whose
    low (``high`` False) or high nibbles hold the sub-block; ``qh`` and ``bit`` (a byte mask, 0 for Q4_K): the
    sub-block's 5th bits, ``qh[l] & bit`` for value ``l``."""
    _check_bytes(arr, "k_codes")
    _check_offsets("k_codes", qs, qh, high, bit)

    def codegen(context, builder, signature, args):
        sig = signature.args
        raw = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[1], sig[1]), _V8x32)
        codes = _nibbles(context, builder, raw, args[3], sig[3])
        bit_ = _as_i8(context, builder, args[4], sig[4])
        hbits = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[2], sig[2]), _V8x32)
        # bit 0 (Q4_K) selects nothing; the load is of bytes inside the block either way
        return builder.or_(codes, _bit_lanes(builder, hbits, bit_))

    return i8x32(arr, qs, qh, high, bit), codegen


@intrinsic
def q5_codes(typingctx, arr, qs, qh):
    """``i8x32``: the 32 codes (0..31) of a Q5_0 / Q5_1 block: 16 bytes at ``qs`` (value ``j`` in the low nibble of byte
    ``j``, value ``j + 16`` in its high one) and the 5th bits at ``qh`` (bit ``j`` of a little-endian u32 for value
    ``j``)."""
    _check_bytes(arr, "q5_codes")
    _check_offsets("q5_codes", qs, qh)

    def codegen(context, builder, signature, args):
        sig = signature.args
        raw = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[1], sig[1]), _V8x16)
        lo = builder.and_(raw, _splat(15, _V8x16))
        hi = builder.lshr(raw, _splat(4, _V8x16))
        codes = builder.shuffle_vector(lo, hi, _mask(range(32)))
        four = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[2], sig[2]), _V8x4)
        spread = builder.shuffle_vector(four, four, _mask([j >> 3 for j in range(32)]))  # lane j: byte j / 8
        bits = ir.Constant(_V8x32, [1 << (j & 7) for j in range(32)])
        hit = builder.icmp_unsigned("!=", builder.and_(spread, bits), _splat(0, _V8x32))
        return builder.or_(codes, builder.select(hit, _splat(16, _V8x32), _splat(0, _V8x32)))

    return i8x32(arr, qs, qh), codegen


@intrinsic
def q6k_codes(typingctx, arr, ql, qh, high, shift):
    """``i8x32``: 32 codes of a Q6_K block minus 32 (-32..31): the low (``high`` False) or high nibbles of the 32
    bytes at ``ql``, with bits ``shift, shift + 1`` of the 32 bytes at ``qh`` above them."""
    _check_bytes(arr, "q6k_codes")
    _check_offsets("q6k_codes", ql, qh, high, shift)

    def codegen(context, builder, signature, args):
        sig = signature.args
        raw = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[1], sig[1]), _V8x32)
        low4 = _nibbles(context, builder, raw, args[3], sig[3])
        hbits = _load(builder, _byte_pointer(context, builder, sig[0], args[0], args[2], sig[2]), _V8x32)
        splat_s = _splat_value(builder, _as_i8(context, builder, args[4], sig[4]), _V8x32)
        high2 = builder.and_(builder.lshr(hbits, splat_s), _splat(3, _V8x32))
        codes = builder.or_(low4, builder.shl(high2, _splat(4, _V8x32)))
        return builder.sub(codes, _splat(32, _V8x32))

    return i8x32(arr, ql, qh, high, shift), codegen


@intrinsic
def load_f16(typingctx, arr, index):
    """The IEEE half at byte offset ``index`` of a C-contiguous uint8 array, widened to float32 (a block's ``d``)."""
    _check_bytes(arr, "load_f16")
    _check_offsets("load_f16", index)

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        half = builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()), align=1)
        return builder.fpext(half, ir.FloatType())

    return types.float32(arr, index), codegen
