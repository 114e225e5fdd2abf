"""Numba building blocks shared by the cpu kernels: storage-dtype widening and a vectorizable exp."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic, overload

from tessera.backends.cpu.simd import widen_code

# fastmath without "nnan"/"ninf": the kernels rely on -inf for masked scores and empty rows.
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
    if x in (types.int8, types.uint8):  # quantized KV codes: int8, or e4m3 bits (times 2^-120; see simd._widen)
        return lambda x: widen_code(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


def group_value(x):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(group_value, inline="always")
def _group_value_overload(x):
    """A quantized weight's per-group value as float32: a uint8 zero point is a number; a scale or min is float32,
    or float16 bits (int16, GGUF's block scales) widened."""
    if x == types.uint8:
        return lambda x: np.float32(x)
    if x == types.int16 or isinstance(x, types.Float):
        return lambda x: widen(x)
    return None


@njit(inline="always", fastmath=FASTMATH)
def fast_exp(x):  # pragma: no cover - compiled
    """exp for float32 that LLVM can vectorize (Numba here has no SVML, and libm's expf stays scalar).

    ``exp(x) = 2^n * exp(r)`` with ``n = round(x / ln 2)`` and ``r = x - n ln 2`` reduced in two steps (Cody-Waite,
    so large ``|x|`` keeps its accuracy), ``exp(r)`` by its degree-7 Taylor polynomial on ``|r| <= ln2 / 2``, and
    ``2^n`` built in the exponent bits. Relative error below 5e-7 on [-87, 88]; 0 below -87, so exp(-inf) = 0.
    """
    xc = max(x, np.float32(-100.0))
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)  # ln 2 split: the high part has few bits, so n * hi is exact
    r = r + n * np.float32(2.12194440e-4)
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    y = p * _bits_to_f32(np.uint32(np.int32(n) + 127) << np.uint32(23))
    return y if x > np.float32(-87.0) else np.float32(0.0)


@njit(inline="always", fastmath=FASTMATH)
def row_max(row, n, part):  # pragma: no cover - compiled
    """max(row[:n]) (-inf when empty), using ``part`` (float32 ``[16]`` scratch) for sixteen independent partial
    maxima that LLVM vectorizes: a plain running ``max`` is a serial dependency chain that Numba leaves scalar
    (measured 0.48 vs 0.14 ns per element)."""
    for j in range(16):
        part[j] = -np.inf
    blocks = n // 16
    for b in range(blocks):
        for j in range(16):
            x = row[b * 16 + j]
            part[j] = x if x > part[j] else part[j]
    mx = np.float32(-np.inf)
    for c in range(blocks * 16, n):
        mx = max(mx, row[c])
    for j in range(16):
        mx = max(mx, part[j])
    return mx
