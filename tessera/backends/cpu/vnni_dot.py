"""The VNNI pieces the int8 decode kernels share (:mod:`.decode_qk8`'s Q.K, :mod:`.decode_pv8`'s P.V): the width a
``vnni512`` / ``vnni`` ISA token stands for, a zeroed int32 accumulator of that width, and ``VPDPBUSD``.

Each token is its own compiled specialization (:mod:`.ops._int8_simd`), so a CPU without VNNI never compiles these.
"""

from __future__ import annotations

from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from tessera.backends.cpu.ops._int8_simd import IsaTokenType, _fn, _splat, i8x32, i32x8
from tessera.backends.cpu.ops._int8_simd512 import i8x64, i32x16

#: the tokens of the VNNI dot-product kernels and the int8 codes one of their vectors holds
CODE_BYTES = {"vnni512": 64, "vnni": 32}


def vnni_isa(token, what: str) -> str:
    """The ISA of a ``vnni512`` / ``vnni`` token (a TypingError naming ``what`` for any other argument)."""
    if not isinstance(token, IsaTokenType) or token.isa not in CODE_BYTES:
        raise TypingError(f"{what}: expected a vnni / vnni512 ISA token, got {token}")
    return token.isa


def vec_types(isa: str):
    """(int8 vector, int32 accumulator) of ``isa``'s width."""
    return (i8x64, i32x16) if isa == "vnni512" else (i8x32, i32x8)


@intrinsic
def code_bytes(typingctx, token):
    """Codes per vector of the token's width (64 or 32), a compile-time constant."""
    width = CODE_BYTES[vnni_isa(token, "code_bytes")]

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, width)

    return types.intp(token), codegen


@intrinsic
def izero(typingctx, token):
    """An int32 accumulator of zeros, of the token's width."""
    acc = vec_types(vnni_isa(token, "izero"))[1]

    def codegen(context, builder, signature, args):
        return _splat(0, acc.ir_type)

    return acc(token), codegen


@intrinsic
def dpbusd(typingctx, token, acc, u, s):
    """``acc + VPDPBUSD(u, s)``: int32 lane ``i`` plus ``sum_{j<4} u[4i+j] * s[4i+j]``, ``u`` unsigned and ``s``
    signed bytes (no saturation: the ``VPDPBUSD`` form, not ``VPDPBUSDS``)."""
    isa = vnni_isa(token, "dpbusd")
    vec, accty = vec_types(isa)
    if (acc, u, s) != (accty, vec, vec):
        raise TypingError(f"dpbusd: expected ({accty}, {vec}, {vec}), got ({acc}, {u}, {s})")
    name = "llvm.x86.avx512.vpdpbusd.512" if isa == "vnni512" else "llvm.x86.avx512.vpdpbusd.256"

    def codegen(context, builder, signature, args):
        t = accty.ir_type
        fn = _fn(builder, name, t, [t, t, t])
        return builder.call(fn, [args[1], builder.bitcast(args[2], t), builder.bitcast(args[3], t)])

    return accty(token, acc, u, s), codegen
