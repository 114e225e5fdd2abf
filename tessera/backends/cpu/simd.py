"""Explicit SIMD vectors for Numba kernels: a float32 vector type and the handful of operations register-blocked
micro-kernels need.

Why: LLVM's auto-vectorizer turns a dot product into one vector accumulator and a horizontal sum per dot, and an
``acc[r, :] += p * v`` update into a load, an FMA and a store per vector: both keep a decode kernel far below the
FMA ports' rate (measured ~60 GFLOP/s of ~250 on this machine). With a vector *type*, a kernel can keep a 4 x 4 tile
of accumulators in registers across a loop (Numba's locals become SSA values after mem2reg) and reduce sixteen dot
products together with one shuffle tree.

The vector width ``LANES`` is 16 floats (one zmm) where the host has AVX-512F and 8 (one ymm) elsewhere; LLVM
legalizes either on any x86-64 target, so the choice only affects speed. Loads widen storage dtypes on the fly:
float32 as is, bfloat16 (uint16 bits) by a shift into the high half, float16 (int16 bits) with ``fpext`` (F16C).

Addresses are flat element offsets from an array's data pointer, so the array must be C-contiguous; the typing of
every load and store refuses any other layout.
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, models, register_model

from tessera.backends.cpu import variants


def _lanes() -> int:
    """16 under the ``simd=avx512`` kernel variant (chosen with AVX-512F), else 8; ``TESSERA_SIMD_LANES=8`` (or 16)
    overrides it, so that tests on one machine cover the other width's code paths (LLVM splits or joins registers as
    needed, so either width runs anywhere)."""
    forced = os.environ.get("TESSERA_SIMD_LANES")
    if forced is not None:
        if forced not in ("8", "16"):
            raise ValueError(f"TESSERA_SIMD_LANES must be 8 or 16, got {forced!r}")
        return int(forced)
    return 16 if variants.choose("simd").name == "avx512" else 8


#: float32 lanes per vector (16 with AVX-512F, else 8)
LANES = _lanes()

_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)


class F32Vector(types.Type):
    """A ``LANES``-wide float32 vector held in one (or, when legalized, two) SIMD registers."""

    def __init__(self) -> None:
        super().__init__(name=f"f32x{LANES}")


f32vec = F32Vector()


@register_model(F32Vector)
class _F32VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


#: float32, bf16 bits, fp16 bits; and the quantized KV codes (``tessera.kv.quantized``): int8, and e4m3 bits as
#: uint8, whose widened value is the e4m3 value times 2^-120 (``decode_kernel`` folds 2^120 into the row scales)
_STORAGE = (types.float32, types.uint16, types.int16, types.int8, types.uint8)


def _check_array(arr, what: str, storage=_STORAGE) -> None:
    if not isinstance(arr, types.Array) or arr.dtype not in storage:
        raise TypingError(f"{what}: expected an array of {[str(t) for t in storage]} (float32, bf16 bits, fp16 bits, "
                          f"int8 codes, e4m3 bits), got {arr}")
    if arr.layout != "C":
        raise TypingError(f"{what}: the array must be C-contiguous (flat offsets), got layout {arr.layout!r}")


def _element_pointer(context, builder, arr_type, arr, index, index_type):
    ary = context.make_array(arr_type)(context, builder, arr)
    idx = context.cast(builder, index, index_type, types.intp)
    return builder.gep(ary.data, [idx])


def _widen(builder, raw, dtype, lanes: int | None = LANES):
    """``raw`` (a vector of ``lanes`` storage elements, or one scalar when ``lanes`` is None) as float32: the one
    definition of each storage dtype's widening, shared by the vector loads and the scalar paths."""
    def of(t):
        return t if lanes is None else ir.VectorType(t, lanes)

    def const(t, value):
        return ir.Constant(of(t), value if lanes is None else [value] * lanes)

    i32, f32 = ir.IntType(32), of(_F32)
    if dtype == types.float32:
        return raw
    if dtype == types.int8:
        return builder.sitofp(raw, f32)
    if dtype == types.uint8:  # e4m3 bits: exponent and mantissa to float32 bit 20, the sign to bit 31
        wide = builder.zext(raw, of(i32))
        body = builder.shl(builder.and_(wide, const(i32, 0x7F)), const(i32, 20))
        sign = builder.shl(builder.and_(wide, const(i32, 0x80)), const(i32, 24))
        return builder.bitcast(builder.or_(body, sign), f32)
    if dtype == types.uint16:  # bf16 bits are the high half of a float32
        return builder.bitcast(builder.shl(builder.zext(raw, of(i32)), const(i32, 16)), f32)
    return builder.fpext(builder.bitcast(raw, of(ir.HalfType())), f32)


@intrinsic
def widen_code(typingctx, x):
    """One quantized KV code as float32, exactly as :func:`vload` widens it: an int8 code as its value, e4m3 bits
    (uint8) as the e4m3 value times 2^-120 (see ``_STORAGE``)."""
    if x not in (types.int8, types.uint8):
        raise TypingError(f"widen_code: expected an int8 code or e4m3 bits (uint8), got {x}")

    def codegen(context, builder, signature, args):
        return _widen(builder, args[0], signature.args[0], lanes=None)

    return types.float32(x), codegen


@intrinsic
def vload(typingctx, arr, index):
    """``LANES`` consecutive elements of a C-contiguous array from flat offset ``index``, widened to float32."""
    _check_array(arr, "vload")
    if not isinstance(index, types.Integer):
        raise TypingError(f"vload: the offset must be an integer, got {index}")
    sig = f32vec(arr, index)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        dtype = signature.args[0].dtype
        vec_type = ir.VectorType(ptr.type.pointee, LANES)
        raw = builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=dtype.bitwidth // 8)
        return _widen(builder, raw, dtype)

    return sig, codegen


@intrinsic
def vstore(typingctx, arr, index, vec):
    """Store a vector into ``LANES`` consecutive elements of a C-contiguous float32 array from flat offset ``index``."""
    _check_array(arr, "vstore", (types.float32,))
    if not isinstance(index, types.Integer) or vec != f32vec:
        raise TypingError(f"vstore: expected (float32 array, integer offset, {f32vec}), got ({arr}, {index}, {vec})")
    sig = types.void(arr, index, vec)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        builder.store(args[2], builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vzero(typingctx):
    """A vector of zeros."""
    sig = f32vec()

    def codegen(context, builder, signature, args):
        return ir.Constant(_VEC, [0.0] * LANES)

    return sig, codegen


@intrinsic
def vsplat(typingctx, x):
    """Every lane set to the float ``x``."""
    if not isinstance(x, (types.Float, types.Integer)):
        raise TypingError(f"vsplat: expected a number, got {x}")
    sig = f32vec(x)

    def codegen(context, builder, signature, args):
        scalar = context.cast(builder, args[0], signature.args[0], types.float32)
        one = builder.insert_element(ir.Constant(_VEC, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))

    return sig, codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """``a * b + c`` lane by lane, fused (one rounding)."""
    if (a, b, c) != (f32vec, f32vec, f32vec):
        raise TypingError(f"vfma: expected three {f32vec}, got {a}, {b}, {c}")
    sig = f32vec(f32vec, f32vec, f32vec)

    def codegen(context, builder, signature, args):
        fma = _fma_function(builder)
        return builder.call(fma, list(args))

    return sig, codegen


def _fma_function(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), f"llvm.fma.v{LANES}f32")


def _mask(values):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(values)), list(values))


def _reduce_lanes(builder, vec, combine):
    """``combine`` of all of a vector's lanes by halving (log2(LANES) shuffle pairs)."""
    width = vec.type.count
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(vec, vec, _mask(range(half)))
        hi = builder.shuffle_vector(vec, vec, _mask(range(half, width)))
        vec = combine(builder, lo, hi)
        width = half
    return builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))


def _max(builder, a, b):
    """``a > b ? a : b`` lane by lane: -inf stays -inf (the kernels never feed NaN)."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _hsum(builder, vec):
    return _reduce_lanes(builder, vec, lambda b, lo, hi: b.fadd(lo, hi))


def _lane_op(name: str, emit, doc: str):
    """An intrinsic ``name(a, b) -> f32vec`` whose lanes are ``emit(builder, a, b)``."""

    def typer(typingctx, a, b):
        if (a, b) != (f32vec, f32vec):
            raise TypingError(f"{name}: expected two {f32vec}, got {a}, {b}")

        def codegen(context, builder, signature, args):
            return emit(builder, args[0], args[1])

        return f32vec(f32vec, f32vec), codegen

    typer.__name__, typer.__qualname__, typer.__doc__ = name, name, doc
    return intrinsic(typer)


vadd = _lane_op("vadd", lambda b, x, y: b.fadd(x, y), "``a + b`` lane by lane.")
vsub = _lane_op("vsub", lambda b, x, y: b.fsub(x, y), "``a - b`` lane by lane.")
vmul = _lane_op("vmul", lambda b, x, y: b.fmul(x, y), "``a * b`` lane by lane.")
vmax = _lane_op("vmax", _max, "Lane-wise maximum (``a > b ? a : b``: -inf stays -inf; kernels never feed NaN here).")


@intrinsic
def vhmax(typingctx, a):
    """The largest lane of ``a``, as float32."""
    if a != f32vec:
        raise TypingError(f"vhmax: expected {f32vec}, got {a}")
    sig = types.float32(f32vec)

    def codegen(context, builder, signature, args):
        return _reduce_lanes(builder, args[0], _max)

    return sig, codegen


@intrinsic
def vsum(typingctx, a):
    """The sum of ``a``'s lanes, as float32."""
    if a != f32vec:
        raise TypingError(f"vsum: expected {f32vec}, got {a}")
    sig = types.float32(f32vec)

    def codegen(context, builder, signature, args):
        return _hsum(builder, args[0])

    return sig, codegen


def _transpose_reduce(builder, vectors):
    """Reduce ``n`` vectors (``n`` a power of two, ``n <= LANES``) to their ``n`` lane sums, in order, with a shuffle
    tree: each level pairs vectors and adds the halves of their partial sums, so ``n`` dot products cost about ``n``
    shuffle-and-add steps instead of ``n * log2(LANES)``.

    Returns ``(vector, owners)``: a vector whose lanes hold partial sums, and for each lane the input it belongs to;
    lanes with the same owner still have to be added (when ``n < LANES``).
    """
    owners = [[i] * LANES for i in range(len(vectors))]
    vecs = list(vectors)
    group = LANES  # lanes of one vector that belong to the same input
    while len(vecs) > 1 and group > 1:
        half = group // 2
        next_vecs, next_owners = [], []
        for a, b, oa, ob in zip(vecs[0::2], vecs[1::2], owners[0::2], owners[1::2]):
            lo_idx, hi_idx = [], []
            for start in range(0, LANES, group):  # each run of `group` lanes: take its halves from a, then from b
                lo_idx += list(range(start, start + half)) + [LANES + i for i in range(start, start + half)]
                hi_idx += list(range(start + half, start + group)) + [LANES + i for i in range(start + half, start + group)]
            lo = builder.shuffle_vector(a, b, _mask(lo_idx))
            hi = builder.shuffle_vector(a, b, _mask(hi_idx))
            next_vecs.append(builder.fadd(lo, hi))
            both = oa + ob
            next_owners.append([both[i] for i in lo_idx])
        vecs, owners, group = next_vecs, next_owners, half
    return vecs, owners


def _store_sums_4x4_typer(typingctx, out, base, stride, *accs):
    _check_array(out, "store_sums_4x4", (types.float32,))
    if len(accs) != 16 or any(a != f32vec for a in accs):
        raise TypingError(f"store_sums_4x4: expected 16 {f32vec} accumulators, got {accs}")
    sig = types.void(out, base, stride, *accs)

    def codegen(context, builder, signature, args):
        vecs, owners = _transpose_reduce(builder, args[3:])
        # 16 sums over 8 or 16 lanes: every final lane holds exactly one sum, so rows are shuffles of the result
        lane_of = {who: (v * LANES + lane) for v, own in enumerate(owners) for lane, who in enumerate(own)}
        second = vecs[1] if len(vecs) > 1 else vecs[0]
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        b = context.cast(builder, args[1], signature.args[1], types.intp)
        s = context.cast(builder, args[2], signature.args[2], types.intp)
        row_type = ir.VectorType(_F32, 4).as_pointer()
        for r in range(4):
            row = builder.shuffle_vector(vecs[0], second, _mask([lane_of[4 * r + c] for c in range(4)]))
            ptr = builder.gep(ary.data, [builder.add(b, builder.mul(s, ir.Constant(b.type, r)))])
            builder.store(row, builder.bitcast(ptr, row_type), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_sums_4x4(typingctx, out, base, stride, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """Store the lane sums of 16 accumulators (row-major: ``a[4 * r + c]``) into ``out[base + r * stride + c]`` for
    ``r, c < 4``; ``out`` is a C-contiguous float32 array."""
    return _store_sums_4x4_typer(
        typingctx, out, base, stride, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15
    )


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the cache line holding flat element ``index`` of a C-contiguous array into the caches (no fault when it
    is out of range: a prefetch never traps)."""
    _check_array(arr, "prefetch")
    if not isinstance(index, types.Integer):
        raise TypingError(f"prefetch: the offset must be an integer, got {index}")
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        # read, high temporal locality (keep in every level), data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vbroadcast(typingctx, arr, index):
    """Element ``index`` (flat offset) of a C-contiguous array, widened to float32, in every lane: one broadcast load,
    and no negative-index wraparound code (which plain ``arr[i]`` carries when Numba cannot prove ``i >= 0``)."""
    _check_array(arr, "vbroadcast")
    if not isinstance(index, types.Integer):
        raise TypingError(f"vbroadcast: the offset must be an integer, got {index}")
    sig = f32vec(arr, index)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        dtype = signature.args[0].dtype
        scalar = _widen(builder, builder.load(ptr, align=dtype.bitwidth // 8), dtype, lanes=None)
        one = builder.insert_element(ir.Constant(_VEC, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, one, _mask([0] * LANES))

    return sig, codegen


@intrinsic
def line_elements(typingctx, arr):
    """Elements of ``arr``'s dtype per 64-byte cache line, as a compile-time constant."""
    if not isinstance(arr, types.Array):
        raise TypingError(f"line_elements: expected an array, got {arr}")
    sig = types.intp(arr)
    count = 64 // (arr.dtype.bitwidth // 8)

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, count)

    return sig, codegen


def _vconst(value):
    return ir.Constant(_VEC, [float(value)] * LANES)


@intrinsic
def vexp(typingctx, x):
    """``exp`` of every lane: :func:`.numba_math.fast_exp`'s range reduction with a degree-6 polynomial (relative
    error below 5e-7 on [-87, 88]; exactly 0 below -87, so ``exp(-inf) = 0``)."""
    if x != f32vec:
        raise TypingError(f"vexp: expected {f32vec}, got {x}")
    sig = f32vec(f32vec)

    def codegen(context, builder, signature, args):
        x = args[0]
        i32v = ir.VectorType(ir.IntType(32), LANES)
        fma = _fma_function(builder)
        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC]), f"llvm.floor.v{LANES}f32")
        low = _vconst(-100.0)
        xc = _max(builder, x, low)
        n = builder.call(floor, [builder.call(fma, [xc, _vconst(1.4426950408889634), _vconst(0.5)])])
        # ln 2 split in two (Cody-Waite): n * 0.693359375 is exact, the small part carries the rest
        r = builder.call(fma, [n, _vconst(-0.693359375), xc])
        r = builder.call(fma, [n, _vconst(2.12194440e-4), r])
        p = _vconst(1.0 / 720.0)  # degree 6: the first dropped term, r^7 / 7!, is below 1.2e-7 for |r| <= ln2 / 2
        for coef in (1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
            p = builder.call(fma, [p, r, _vconst(coef)])
        bits = builder.shl(builder.add(builder.fptosi(n, i32v), ir.Constant(i32v, [127] * LANES)),
                           ir.Constant(i32v, [23] * LANES))
        y = builder.fmul(p, builder.bitcast(bits, _VEC))
        return builder.select(builder.fcmp_ordered(">", x, _vconst(-87.0)), y, _vconst(0.0))

    return sig, codegen
