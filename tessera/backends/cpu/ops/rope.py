"""``apply_rope`` on the CPU: one Numba pass that rotates q and k in place, reading the cached float32 tables.

torch eager needs ~6 passes per tensor (two slices, negate, cat, two multiplies, add, copy back); this kernel
reads and writes each rotated element once. Work items are (token, head) rows of q and k together, so decode
(one token, many heads) still spreads over the cores. bf16/fp16 arrive as 16-bit integer views, are widened to
float32 and rounded back to nearest even.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.core.extending import overload

from tessera.backends.cpu.numba_math import FASTMATH, widen
from tessera.backends.cpu.ops._narrow import _f32_to_bits as _f32_bits
from tessera.backends.cpu.ops._narrow import _f32_to_half_bits, storage_view
from tessera.kernels.rope import RotaryEmbedding


def _narrow(x, out):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_narrow, inline="always")
def _narrow_overload(x, out):
    """float32 -> the element type of the array ``out`` it is stored into."""
    like = out.dtype
    if like == types.uint16:  # bfloat16: round to nearest even on the high 16 bits; NaN stays NaN
        def to_bf16(x, out):
            bits = _f32_bits(x)
            if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
            bias = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            return np.uint16((bits + bias) >> np.uint32(16))
        return to_bf16
    if like == types.int16:
        return lambda x, out: _f32_to_half_bits(x)
    if isinstance(like, types.Float):
        return lambda x, out: x
    return None


@njit(inline="always", fastmath=FASTMATH)
def _rotate_split(x, t, h, cos, sin, p, half):  # pragma: no cover - compiled
    """Half-rotation layout: pairs ``(x[t, h, i], x[t, h, i + half])``."""
    for i in range(half):
        a, b = widen(x[t, h, i]), widen(x[t, h, i + half])
        x[t, h, i] = _narrow(a * cos[p, i] - b * sin[p, i], x)
        x[t, h, i + half] = _narrow(b * cos[p, i] + a * sin[p, i], x)


@njit(inline="always", fastmath=FASTMATH)
def _rotate_interleaved(x, t, h, cos, sin, p, half):  # pragma: no cover - compiled
    """GPT-J layout: pairs ``(x[t, h, 2i], x[t, h, 2i + 1])``."""
    for i in range(half):
        a, b = widen(x[t, h, 2 * i]), widen(x[t, h, 2 * i + 1])
        x[t, h, 2 * i] = _narrow(a * cos[p, i] - b * sin[p, i], x)
        x[t, h, 2 * i + 1] = _narrow(b * cos[p, i] + a * sin[p, i], x)


@njit(inline="always", fastmath=FASTMATH)
def _split_row(x, t, h, cos, sin, p):  # pragma: no cover - compiled
    """Half-rotate head ``h`` of token ``t``. Common widths get a literal trip count, which LLVM unrolls and
    vectorizes (it can then also see that the stores to ``x[t, h, :half]`` miss the loads from the upper half)."""
    half = cos.shape[1]
    if half == 64:
        _rotate_split(x, t, h, cos, sin, p, 64)
    elif half == 32:
        _rotate_split(x, t, h, cos, sin, p, 32)
    else:
        _rotate_split(x, t, h, cos, sin, p, half)


@njit(inline="always", fastmath=FASTMATH)
def _rotate_item(x, positions, cos, sin, r, interleaved):  # pragma: no cover - compiled
    """Work item ``r``: head ``r % heads`` of token ``r // heads`` of ``x [tokens, heads, D]``."""
    heads = x.shape[1]
    t, h = r // heads, r % heads
    if interleaved:
        _rotate_interleaved(x, t, h, cos, sin, positions[t], cos.shape[1])
    else:
        _split_row(x, t, h, cos, sin, positions[t])


# Measured choices (64 tokens x 40 heads x D=128, fp32, one thread): the arrays are indexed in 3-D throughout, as
# row views (``x[t, h]``, ``cos[p]``) each cost two atomic refcount updates (~4x slower); and q and k get a loop
# each, as one loop branching between q and k rows ran ~6x slower (LLVM then left the inner loop scalar).
@njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
def _rope_parallel(q, k, positions, cos, sin, interleaved):  # pragma: no cover - compiled
    """q ``[T, Hq, D]``, k ``[T, Hkv, D]`` (float32 / uint16 bf16 bits / int16 fp16 bits), positions int64
    ``[T]``, cos/sin float32 ``[P, R / 2]``. Rotates the first R dims of every head in place."""
    for r in prange(q.shape[0] * q.shape[1]):
        _rotate_item(q, positions, cos, sin, r, interleaved)
    for r in prange(k.shape[0] * k.shape[1]):
        _rotate_item(k, positions, cos, sin, r, interleaved)


@njit(fastmath=FASTMATH, nogil=True, cache=True)
def _rope_serial(q, k, positions, cos, sin, interleaved):  # pragma: no cover - compiled
    """:func:`_rope_parallel` on the calling thread, for decode-sized calls (a few microseconds of work): waking
    the thread pool costs more than that, and far more when other processes hold the cores."""
    for r in range(q.shape[0] * q.shape[1]):
        _rotate_item(q, positions, cos, sin, r, interleaved)
    for r in range(k.shape[0] * k.shape[1]):
        _rotate_item(k, positions, cos, sin, r, interleaved)


#: rotated pairs below which the serial kernel runs
SERIAL_PAIRS = 1 << 15


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
               interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`tessera.kernels.rope.apply_rope` (arguments already validated)."""
    pos = positions.numpy() if positions.dtype == torch.int64 else positions.to(torch.int64).numpy()
    pairs = q.shape[0] * (q.shape[1] + k.shape[1]) * (rope.rotary_dim // 2)
    kernel = _rope_serial if pairs < SERIAL_PAIRS else _rope_parallel
    kernel(storage_view(q), storage_view(k), pos, rope.cos.numpy(), rope.sin.numpy(), bool(interleaved))
    return q, k


OPS = {"apply_rope": apply_rope}
