"""Normalization ops on the cpu backend: one fused Numba pass per op, parallel over rows.

Each row is read once from memory (a second sweep over it hits L1: a 4096-wide fp32 row is 16 KiB), and every output
is written once. The fused residual add writes ``r = x + residual`` (rounded to storage) while accumulating
``sum(r^2)`` from the rounded values, then normalizes from the row it just wrote. bf16 and fp16 arrive as 16-bit
integer views, widened and rounded in registers, weights and biases too. A kernel is compiled once per (activation,
weight) storage dtype pair and cached on disk. At one token the call is dominated by fixed costs (about 10 us of
Python and dispatch), so the host side avoids every conversion it can.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from tessera.backends.cpu.numba_math import FASTMATH, widen
from tessera.backends.cpu.ops._narrow import narrow, no_rows, storage_view, vector_view

_NO_BIAS = np.zeros(0, dtype=np.float32)
#: below this many elements a call runs on the calling thread: waking the worker threads of a parallel region costs
#: more than the work (measured at one token, H = 4096: 11 us serial vs 50+ us parallel when the cores are busy)
PARALLEL_MIN_ELEMENTS = 32768


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _rms_norm_row(x, residual, w, w_offset, eps, y, r, i, fused):  # pragma: no cover - compiled
    """Row ``i``: ``y = s * rsqrt(mean(s^2) + eps) * (w + w_offset)`` with ``s = x``, or ``s = r = narrow(x + res)``
    when ``fused``. ``w_offset`` is 1.0 for Gemma's ``(1 + w)``, else 0.0."""
    h = x.shape[1]
    ss = np.float32(0.0)
    if fused:
        for j in range(h):
            s = narrow(widen(x[i, j]) + widen(residual[i, j]), r)
            r[i, j] = s
            v = widen(s)
            ss += v * v
    else:
        for j in range(h):
            v = widen(x[i, j])
            ss += v * v
    rstd = np.float32(1.0) / np.sqrt(ss / np.float32(h) + eps)
    src = r if fused else x
    for j in range(h):
        y[i, j] = narrow(widen(src[i, j]) * rstd * (widen(w[j]) + w_offset), y)


@njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True, error_model="numpy")
def _rms_norm_parallel(x, residual, w, w_offset, eps, y, r):  # pragma: no cover - compiled
    fused = residual.shape[0] > 0
    for i in prange(x.shape[0]):
        _rms_norm_row(x, residual, w, np.float32(w_offset), np.float32(eps), y, r, i, fused)


@njit(fastmath=FASTMATH, nogil=True, cache=True, error_model="numpy")
def _rms_norm_serial(x, residual, w, w_offset, eps, y, r):  # pragma: no cover - compiled
    fused = residual.shape[0] > 0
    for i in range(x.shape[0]):
        _rms_norm_row(x, residual, w, np.float32(w_offset), np.float32(eps), y, r, i, fused)


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _layer_norm_row(x, w, b, eps, y, i):  # pragma: no cover - compiled
    """Row ``i``: ``(x - mean) * rsqrt(var + eps) * w + b`` (two sweeps for the statistics: no cancellation)."""
    h = x.shape[1]
    total = np.float32(0.0)
    for j in range(h):
        total += widen(x[i, j])
    mean = total / np.float32(h)
    ss = np.float32(0.0)
    for j in range(h):
        d = widen(x[i, j]) - mean
        ss += d * d
    rstd = np.float32(1.0) / np.sqrt(ss / np.float32(h) + eps)
    if b.shape[0] > 0:
        for j in range(h):
            y[i, j] = narrow((widen(x[i, j]) - mean) * rstd * widen(w[j]) + widen(b[j]), y)
    else:
        for j in range(h):
            y[i, j] = narrow((widen(x[i, j]) - mean) * rstd * widen(w[j]), y)


@njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True, error_model="numpy")
def _layer_norm_parallel(x, w, b, eps, y):  # pragma: no cover - compiled
    for i in prange(x.shape[0]):
        _layer_norm_row(x, w, b, np.float32(eps), y, i)


@njit(fastmath=FASTMATH, nogil=True, cache=True, error_model="numpy")
def _layer_norm_serial(x, w, b, eps, y):  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        _layer_norm_row(x, w, b, np.float32(eps), y, i)


def _rows(t: torch.Tensor) -> np.ndarray:
    """``[rows, H]`` kernel view of ``[..., H]`` (reshaped on the NumPy side, which costs less than torch's)."""
    v = storage_view(t if t.is_contiguous() else t.contiguous())
    return v if v.ndim == 2 else v.reshape(-1, v.shape[-1])


def rms_norm(x, weight, eps, residual, gemma):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    w_offset = 1.0 if gemma else 0.0
    kernel = _rms_norm_parallel if x.numel() >= PARALLEL_MIN_ELEMENTS else _rms_norm_serial
    if residual is None:
        none = no_rows(x.dtype)
        kernel(_rows(x), none, vector_view(weight), w_offset, eps, _rows(y), none)
        return y
    r = torch.empty_like(y)
    kernel(_rows(x), _rows(residual), vector_view(weight), w_offset, eps, _rows(y), _rows(r))
    return y, r


def layer_norm(x, weight, bias, eps):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    b = _NO_BIAS if bias is None else vector_view(bias)
    kernel = _layer_norm_parallel if x.numel() >= PARALLEL_MIN_ELEMENTS else _layer_norm_serial
    kernel(_rows(x), vector_view(weight), b, eps, _rows(y))
    return y


def qk_norm(q, weight, eps, gemma):
    return rms_norm(q, weight, eps, None, gemma)


OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "qk_norm": qk_norm}
