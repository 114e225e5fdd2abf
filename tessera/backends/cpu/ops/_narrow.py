"""Storage helpers shared by every cpu kernel (ops and attention): zero-copy NumPy views and float32 -> storage
rounding.

Kernels see float32 arrays as they are, bfloat16 as uint16 bits and float16 as int16 bits (the convention of
:func:`storage_view` here and :func:`tessera.backends.cpu.numba_math.widen`); ``narrow``
is the inverse of ``widen``: it rounds a float32 to the storage type of an output array, to nearest even, exactly as
torch's ``.to(dtype)`` does. Private (leading underscore), so the ops registry does not load it as a family.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic, overload

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.dtypes import FLOAT_DTYPES


def storage_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a CPU tensor: float32 as is, bf16 as uint16 bits, fp16 as int16 bits."""
    if t.dtype == torch.float32:
        return t.numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy()
    raise TypeError(f"cpu kernels store float32, bfloat16 or float16, got {t.dtype}")


def group_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a quantized weight's per-group array (scales, mins or zero points): float32 and uint8
    as they are, float16 (GGUF's block scales) as int16 bits, which the kernels widen with ``group_value``."""
    if t.dtype == torch.uint8:
        return t.numpy()
    if t.dtype in (torch.float32, torch.float16):
        return storage_view(t)
    raise TypeError(f"quantized weight groups are float32, float16 or uint8, got {t.dtype}")


_EMPTY_ROWS: dict[torch.dtype, np.ndarray] = {}


def no_rows(dtype: torch.dtype) -> np.ndarray:
    """A ``[0, 1]`` array typed like ``storage_view`` of ``dtype``: the "absent" value of an optional 2-D input."""
    if dtype not in _EMPTY_ROWS:
        _EMPTY_ROWS[dtype] = storage_view(torch.zeros(0, 1, dtype=dtype))
    return _EMPTY_ROWS[dtype]


def vector_view(v: torch.Tensor) -> np.ndarray:
    """A kernel view of a small per-channel vector (weight, bias): storage dtypes as they are, others as float32."""
    if v.dtype not in FLOAT_DTYPES:
        v = v.to(torch.float32)
    if v.requires_grad:  # an nn.Parameter
        v = v.detach()
    return storage_view(v if v.is_contiguous() else v.contiguous())


@intrinsic
def _f32_to_bits(typingctx, x):
    """Reinterpret a float32 as uint32 (a register move; vectorizes)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _f32_to_half_bits(typingctx, x):
    """Round a float32 to IEEE half (round to nearest even; F16C on x86) and return its bits as int16."""
    sig = types.int16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@njit(fastmath=FASTMATH)  # not inlined by Numba (its SSA pass warns on the select); LLVM inlines it
def _bf16_bits(x):  # pragma: no cover - compiled
    """float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN."""
    b = _f32_to_bits(x)
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(0x7FC0) if np.isnan(x) else np.uint16(rounded)


def narrow(x, like):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(narrow, inline="always")
def _narrow_overload(x, like):
    """``narrow(value, out_array)``: ``value`` (float32) rounded to ``out_array``'s storage type."""
    dtype = like.dtype
    if dtype == types.uint16:
        return lambda x, like: _bf16_bits(np.float32(x))
    if dtype == types.int16:
        return lambda x, like: _f32_to_half_bits(np.float32(x))
    if isinstance(dtype, types.Float):
        return lambda x, like: np.float32(x)
    return None
