"""Explicit 256-bit integer SIMD for Numba: the int8 dot products behind the int8-activation quantized GEMV.

Why explicit: a quantized GEMV that widens every 4-bit code to float32 and FMAs it runs at ~10 GMAC/s per core,
compute-bound well below the memory's rate. Quantizing the activation row to int8 (one scale per block of 32, as
llama.cpp's Q8_0 does) turns each block of 32 multiply-adds into one or two integer instructions: ``VPMADDUBSW`` +
``VPMADDWD`` on AVX2, one ``VPDPBUSD`` with VNNI. LLVM's auto-vectorizer does not form either from Numba's loops
(the int16 saturation of ``VPMADDUBSW`` has no plain-IR spelling it matches), so these intrinsics emit them.

Which instruction a dot product uses is a compile-time choice carried by an *ISA token*: a Python object whose Numba
type names the variant (:data:`AVX2`, :data:`VNNI`). Kernels take the token as an argument, so each variant is its own
compiled specialization and a CPU without VNNI never compiles (or caches) a ``VPDPBUSD``.

Vectors: ``i8x32`` (32 int8 lanes, one ymm), ``i32x8`` and ``f32x8``. Addresses are flat element offsets from a
C-contiguous array's data pointer.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import NativeValue, intrinsic, models, register_model, typeof_impl, unbox

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_V8x32 = ir.VectorType(_I8, 32)
_V8x16 = ir.VectorType(_I8, 16)
_V16x16 = ir.VectorType(_I16, 16)
_V32x8 = ir.VectorType(_I32, 8)
_VF8 = ir.VectorType(_F32, 8)


class _VecType(types.Type):
    """A SIMD vector held in registers; ``ir_type`` is its LLVM vector type (also :mod:`._int8_simd512`'s)."""

    def __init__(self, name: str, ir_type: ir.VectorType) -> None:
        self.ir_type = ir_type
        super().__init__(name=name)


i8x32 = _VecType("i8x32", _V8x32)
i32x8 = _VecType("i32x8", _V32x8)
f32x8 = _VecType("f32x8", _VF8)


@register_model(_VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.ir_type)


# ------------------------------------------------------------------------------------------------ ISA tokens
class IsaToken:
    """A compile-time variant selector passed into kernels (see the module docstring)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"IsaToken({self.name!r})"


class IsaTokenType(types.Type):
    def __init__(self, isa: str) -> None:
        self.isa = isa
        super().__init__(name=f"IsaToken({isa})")


@register_model(IsaTokenType)
class _TokenModel(models.OpaqueModel):
    pass


_TOKEN_TYPES: dict[str, IsaTokenType] = {}


@typeof_impl.register(IsaToken)
def _typeof_token(val, c):
    # Numba's C fast path cannot fingerprint a token, so every call that passes one types it here in Python:
    # building a fresh Type each time costs ~8 us of dispatch per call, a cached one ~1 us. A token inside a tuple
    # argument is far worse (~100 us: the whole tuple, arrays included, is then typed in Python), so kernels take
    # the token as an argument of its own, never inside a tuple.
    typ = _TOKEN_TYPES.get(val.name)
    if typ is None:
        typ = _TOKEN_TYPES[val.name] = IsaTokenType(val.name)
    return typ


@unbox(IsaTokenType)
def _unbox_token(typ, obj, c):
    return NativeValue(c.context.get_constant_null(typ))


#: ``VPMADDUBSW`` + ``VPMADDWD`` (AVX2)
AVX2 = IsaToken("avx2")
#: ``VPDPBUSD`` on 256-bit vectors (AVX-VNNI, or AVX512-VNNI with VL: LLVM picks the encoding the CPU has)
VNNI = IsaToken("vnni")
#: two blocks per 512-bit ``VPDPBUSD`` where a kernel has a wide form (:mod:`._int8_simd512`), the EVEX 256-bit
#: ``VPDPBUSD`` elsewhere (AVX512-VNNI with BW and VL)
VNNI512 = IsaToken("vnni512")
TOKENS = {"avx2": AVX2, "vnni": VNNI, "vnni512": VNNI512}


# ------------------------------------------------------------------------------------------------ helpers
def _check_bytes(arr, what: str) -> None:
    if not isinstance(arr, types.Array) or arr.dtype not in (types.int8, types.uint8):
        raise TypingError(f"{what}: expected an int8 or uint8 array, got {arr}")
    if arr.layout != "C":
        raise TypingError(f"{what}: the array must be C-contiguous (flat offsets), got layout {arr.layout!r}")
    return None


def _byte_pointer(context, builder, arr_type, arr, index, index_type):
    ary = context.make_array(arr_type)(context, builder, arr)
    idx = context.cast(builder, index, index_type, types.intp)
    return builder.gep(ary.data, [idx])


def _load(builder, ptr, vec_type):
    return builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=1)


def _splat(value, vec_type):
    return ir.Constant(vec_type, [value] * vec_type.count)


def _fn(builder, name: str, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _mask(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def _load_typer(what: str, emit, ret: _VecType = i8x32):
    """An intrinsic ``what(arr, index)`` returning ``ret``: ``emit(builder, pointer, arr_dtype)`` builds the value
    from the bytes at flat offset ``index`` of a C-contiguous int8 / uint8 array."""

    def typer(typingctx, arr, index):
        _check_bytes(arr, what)
        if not isinstance(index, types.Integer):
            raise TypingError(f"{what}: the offset must be an integer, got {index}")

        def codegen(context, builder, signature, args):
            ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            return emit(builder, ptr, signature.args[0].dtype)

        return ret(arr, index), codegen

    typer.__name__ = typer.__qualname__ = what
    return intrinsic(typer)


def _emit_load32(builder, ptr, dtype=None):
    return _load(builder, ptr, _V8x32)


def _emit_nibbles16(builder, ptr, dtype=None):
    raw = _load(builder, ptr, _V8x16)
    lo = builder.and_(raw, _splat(15, _V8x16))
    hi = builder.lshr(raw, _splat(4, _V8x16))
    return builder.shuffle_vector(lo, hi, _mask(range(32)))


def _emit_low_nibbles32(builder, ptr, dtype=None):
    return builder.and_(_load(builder, ptr, _V8x32), _splat(15, _V8x32))


def _emit_high_nibbles32(builder, ptr, dtype=None):
    return builder.lshr(_load(builder, ptr, _V8x32), _splat(4, _V8x32))


load_i8x32 = _load_typer("load_i8x32", _emit_load32)
load_i8x32.__doc__ = "32 bytes from flat offset ``index``."
nibbles16 = _load_typer("nibbles16", _emit_nibbles16)
nibbles16.__doc__ = ("16 bytes from ``index`` unpacked to 32 codes: lanes 0-15 the low nibbles, 16-31 the high ones "
                     "(a 32-weight group packed as byte ``j`` = element ``j`` low, ``j + 16`` high).")
low_nibbles32 = _load_typer("low_nibbles32", _emit_low_nibbles32)
low_nibbles32.__doc__ = "The low nibbles of 32 bytes from ``index`` (codes 0..15)."
high_nibbles32 = _load_typer("high_nibbles32", _emit_high_nibbles32)
high_nibbles32.__doc__ = "The high nibbles of 32 bytes from ``index`` (codes 0..15)."


def _emit_block_codes(builder, ptr, dtype):
    return _emit_nibbles16(builder, ptr) if dtype == types.uint8 else _emit_load32(builder, ptr)


block_codes = _load_typer("block_codes", _emit_block_codes)
block_codes.__doc__ = ("One group-32 block of weight codes at flat offset ``index``, by the array's dtype: a uint8 "
                       "array holds packed int4 (16 bytes, :func:`nibbles16`), an int8 array int8 codes (32 bytes).")


def _emit_dot_u8s8(builder, isa: str, u, s):
    """Per int32 lane ``i``: the sum of ``u[4i+j] * s[4i+j]``, j < 4, u unsigned and s signed bytes."""
    if isa in ("vnni", "vnni512"):
        fn = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", _V32x8, [_V32x8] * 3)
        return builder.call(fn, [_splat(0, _V32x8), builder.bitcast(u, _V32x8), builder.bitcast(s, _V32x8)])
    # VPMADDUBSW: adjacent u8*s8 pairs summed into saturating int16 (a pair of 4-bit or 7-bit codes times int8
    # stays below 2 * 127 * 127 = 32258 < 32767, so it never saturates here); VPMADDWD by ones: pairs of those to int32
    pairs = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16x16, [_V8x32, _V8x32]), [u, s])
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _V32x8, [_V16x16, _V16x16]),
                        [pairs, _splat(1, _V16x16)])


def _token_isa(token, what: str) -> str:
    if not isinstance(token, IsaTokenType) or token.isa not in TOKENS:
        raise TypingError(f"{what}: expected an ISA token ({sorted(TOKENS)}), got {token}")
    return token.isa


@intrinsic
def dot_u8s8(typingctx, token, u, s):
    """``i32x8``: lane ``i`` = sum over ``j < 4`` of ``u[4i+j] * s[4i+j]`` (u unsigned codes <= 127, s int8)."""
    isa = _token_isa(token, "dot_u8s8")
    if (u, s) != (i8x32, i8x32):
        raise TypingError(f"dot_u8s8: expected two {i8x32}, got {u}, {s}")

    def codegen(context, builder, signature, args):
        return _emit_dot_u8s8(builder, isa, args[1], args[2])

    return i32x8(token, u, s), codegen


@intrinsic
def dot_s8s8(typingctx, token, w, s):
    """``i32x8`` as :func:`dot_u8s8` for signed ``w`` (int8 in -127..127): ``|w| * (s * sign(w))``."""
    isa = _token_isa(token, "dot_s8s8")
    if (w, s) != (i8x32, i8x32):
        raise TypingError(f"dot_s8s8: expected two {i8x32}, got {w}, {s}")

    def codegen(context, builder, signature, args):
        return _emit_dot_s8s8(builder, isa, args[1], args[2])

    return i32x8(token, w, s), codegen


def _emit_dot_s8s8(builder, isa: str, w, s):
    # |w| and sign(w) * s (VPABSB, VPSIGNB): the unsigned-by-signed instructions then give w * s exactly
    absw = builder.call(_fn(builder, "llvm.abs.v32i8", _V8x32, [_V8x32, ir.IntType(1)]),
                        [w, ir.Constant(ir.IntType(1), 0)])
    signed = builder.call(_fn(builder, "llvm.x86.avx2.psign.b", _V8x32, [_V8x32, _V8x32]), [s, w])
    return _emit_dot_u8s8(builder, isa, absw, signed)


def code_signedness(arr, what: str) -> bool:
    """Whether the weight array ``arr`` (a Numba type) holds signed codes: int8 yes, packed uint8 nibbles no."""
    _check_bytes(arr, what)
    return arr.dtype == types.int8


@intrinsic
def dot_codes(typingctx, token, arr, w, s):
    """:func:`dot_s8s8` when ``arr`` (the weights ``w`` came from, see :func:`block_codes`) is int8, else
    :func:`dot_u8s8`: one spelling for both weight formats, the choice made at compile time."""
    isa = _token_isa(token, "dot_codes")
    signed = code_signedness(arr, "dot_codes")
    if (w, s) != (i8x32, i8x32):
        raise TypingError(f"dot_codes: expected two {i8x32}, got {w}, {s}")

    def codegen(context, builder, signature, args):
        return (_emit_dot_s8s8 if signed else _emit_dot_u8s8)(builder, isa, args[2], args[3])

    return i32x8(token, arr, w, s), codegen


@intrinsic
def fma_i32(typingctx, d, scale, acc):
    """``acc + float(d) * scale`` lane by lane (``f32x8``); int32 sums of <= 2^24 convert exactly."""
    if d != i32x8 or acc != f32x8 or not isinstance(scale, (types.Float, types.Integer)):
        raise TypingError(f"fma_i32: expected ({i32x8}, a float, {f32x8}), got ({d}, {scale}, {acc})")

    def codegen(context, builder, signature, args):
        s = context.cast(builder, args[1], signature.args[1], types.float32)
        one = builder.insert_element(ir.Constant(_VF8, ir.Undefined), s, ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(one, one, _mask([0] * 8))
        fma = _fn(builder, "llvm.fma.v8f32", _VF8, [_VF8] * 3)
        return builder.call(fma, [builder.sitofp(args[0], _VF8), splat, args[2]])

    return f32x8(d, scale, acc), codegen


@intrinsic
def add_i32(typingctx, a, b):
    """``a + b`` lane by lane (``i32x8``)."""
    if (a, b) != (i32x8, i32x8):
        raise TypingError(f"add_i32: expected two {i32x8}, got {a}, {b}")

    def codegen(context, builder, signature, args):
        return builder.add(args[0], args[1])

    return i32x8(a, b), codegen


@intrinsic
def add_f32x8(typingctx, a, b):
    """``a + b`` lane by lane (``f32x8``)."""
    if (a, b) != (f32x8, f32x8):
        raise TypingError(f"add_f32x8: expected two {f32x8}, got {a}, {b}")

    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])

    return f32x8(a, b), codegen


@intrinsic
def zero_f32x8(typingctx):
    """An ``f32x8`` of zeros."""

    def codegen(context, builder, signature, args):
        return _splat(0.0, _VF8)

    return f32x8(), codegen


@intrinsic
def sum_f32x8(typingctx, a):
    """The sum of an ``f32x8``'s lanes, as float32 (halving shuffles)."""
    if a != f32x8:
        raise TypingError(f"sum_f32x8: expected {f32x8}, got {a}")

    def codegen(context, builder, signature, args):
        return emit_lane_sum(builder, args[0])

    return types.float32(a), codegen


def emit_lane_sum(builder, vec):
    """The sum of a float vector's lanes (halving shuffles), as a float scalar."""
    width = vec.type.count
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(vec, vec, _mask(range(half)))
        hi = builder.shuffle_vector(vec, vec, _mask(range(half, width)))
        vec, width = builder.fadd(lo, hi), half
    return builder.extract_element(vec, ir.Constant(_I32, 0))


@intrinsic
def load_f32(typingctx, arr, index):
    """Element ``index`` (flat offset) of a C-contiguous float32 array, or of float16 bits (int16, as
    ``storage_view`` gives a float16 tensor: GGUF's block scales) widened to float32, without the negative-index
    wraparound code that ``arr[i]`` carries when Numba cannot prove ``i >= 0``."""
    if not is_scale_array(arr):
        raise TypingError(f"load_f32: expected a C-contiguous float32 array or float16 bits (int16), got {arr}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"load_f32: the offset must be an integer, got {index}")

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        if signature.args[0].dtype == types.float32:
            return builder.load(ptr, align=4)
        return builder.fpext(builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()), align=2), ir.FloatType())

    return types.float32(arr, index), codegen


def is_scale_array(arr) -> bool:
    """True for the Numba types a quantized weight's scales (or mins) come in: C-contiguous float32, or float16 bits
    as int16."""
    return isinstance(arr, types.Array) and arr.dtype in (types.float32, types.int16) and arr.layout == "C"


@intrinsic
def prefetch(typingctx, arr, index):
    """Ask for the cache line holding flat element ``index`` of a C-contiguous array (``PREFETCHT0``; a hint that never
    faults, so an index past the end is harmless). Returns 0.

    Why: a quantized GEMV streaming its weights from DRAM spends ~20 instructions on every 64-byte line of codes, so
    the out-of-order window holds too few lines in flight to cover the memory latency, and the hardware prefetchers
    alone left two cores at 20 GB/s of a 50 GB/s machine (Zen 4, 2026-12-02); a hint a fixed distance ahead keeps the
    next lines coming while this one is being computed."""
    if not isinstance(arr, types.Array) or arr.layout != "C":
        raise TypingError(f"prefetch: expected a C-contiguous array, got {arr}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"prefetch: the offset must be an integer, got {index}")

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(ary.data, [idx]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return ir.Constant(ir.IntType(64), 0)

    return types.int64(arr, index), codegen
