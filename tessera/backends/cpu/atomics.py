"""Atomic counters for Numba kernels whose threads share work inside one parallel region.

Numba has no CPU atomics. A kernel that runs several dependent phases over all cores otherwise needs one parallel
region per phase, and each region costs a thread wake-up: ~20 us with OpenMP's passive wait policy, which Tessera
sets so that torch's and Numba's thread pools do not spin against each other on a small machine. The fused decode
layer has eight phases per layer, so it claims work from counters instead (:mod:`tessera.backends.cpu.decode_layer`).

Both operations are sequentially consistent: a fetch-add that marks work done publishes the writes made before it,
and a load that sees the count sees those writes.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic


def _check(arr, index, what: str) -> None:
    if not isinstance(arr, types.Array) or arr.dtype != types.int64 or arr.ndim != 1 or arr.layout != "C":
        raise TypingError(f"{what}: expected a C-contiguous 1-D int64 array, got {arr}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"{what}: the index must be an integer, got {index}")


def _pointer(context, builder, arrty, arr, index, indexty):
    ary = context.make_array(arrty)(context, builder, arr)
    index = context.cast(builder, index, indexty, types.intp)
    return cgutils.get_item_pointer2(context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
                                     cgutils.unpack_tuple(builder, ary.strides), arrty.layout, [index])


@intrinsic
def fetch_add(typingctx, arr, index, value):
    """Atomically add ``value`` to ``arr[index]`` (int64, no bounds check) and return the value before the add."""
    _check(arr, index, "fetch_add")
    if not isinstance(value, types.Integer):
        raise TypingError(f"fetch_add: the value must be an integer, got {value}")

    def codegen(context, builder, signature, args):
        ptr = _pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(arr, index, value), codegen


@intrinsic
def load(typingctx, arr, index):
    """Atomically read ``arr[index]`` (int64, no bounds check): a load the compiler cannot hoist out of a spin loop."""
    _check(arr, index, "load")

    def codegen(context, builder, signature, args):
        ptr = _pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return types.int64(arr, index), codegen

