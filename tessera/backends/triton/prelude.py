"""Triton helpers that generated mask and score functions call (see ``codegen.py``).

Python (and torch) integer ``//`` and ``%`` round toward minus infinity; Triton's, like C's, round toward zero. The
helpers here give generated code torch's semantics, so a custom function means the same thing on every backend.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def floordiv(a, b):
    """``a // b`` with Python's rounding (toward minus infinity) for integers."""
    q = a // b
    fix = ((a % b) != 0) & ((a < 0) != (b < 0))
    return q - fix.to(q.dtype)


@triton.jit
def floormod(a, b):
    """``a % b`` with Python's sign convention (the result takes the sign of ``b``) for integers."""
    r = a % b
    fix = (r != 0) & ((r < 0) != (b < 0))
    return r + tl.where(fix, b, 0)


@triton.jit
def tanh(x):
    """``tanh`` from ``exp``: saturates cleanly to +-1 (exp overflows to inf, 2 / inf = 0)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def lookup_int(AUX_I, base, index):
    """``AUX_I[base + index]``: element of a tensor captured by a mask (document ids, user tables)."""
    return tl.load(AUX_I + base + index)


@triton.jit
def lookup_float(AUX_F, base, index):
    """``AUX_F[base + index]``: element of a float tensor captured by a score function (ALiBi slopes, tables)."""
    return tl.load(AUX_F + base + index)


@triton.jit
def clamp_index(i, size):
    """Indices of unused tile rows and columns may fall outside a captured tensor; their results are discarded."""
    return tl.minimum(tl.maximum(i, 0), size - 1)


@triton.jit
def keep_all(b, h, q_pos, kv_pos, AUX_I, AUX_F):
    """The mask of a spec without one (never called: kernels skip masking when ``HAS_MASK`` is False)."""
    return kv_pos >= 0


@triton.jit
def identity_score(score, b, h, q_pos, kv_pos, AUX_I, AUX_F):
    """The score function of a spec without one (never called when ``HAS_SCORE`` is False)."""
    return score
