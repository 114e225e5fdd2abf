"""Rounding float32 results to a bfloat16 output under Triton 3.9's interpreter.

The interpreter converts float32 -> bfloat16 by truncating the mantissa, where GPUs (and torch) round to nearest
even; a fused residual sum must round exactly as torch does. Kernels pass ``MANUAL_RNE = interpreting() and
dtype == bfloat16`` and store through :func:`to_storage`, which then rounds with integer bit operations. Private
(leading underscore): the ops registry does not load it as a family.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.backends.triton.configs import interpreting


def manual_rne(dtype: torch.dtype) -> bool:
    """The ``MANUAL_RNE`` flag for an output of ``dtype``."""
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def to_storage(v, dtype: tl.constexpr, MANUAL_RNE: tl.constexpr):
    """``v`` (float32) rounded to nearest even in ``dtype``."""
    if MANUAL_RNE:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)
