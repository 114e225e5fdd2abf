"""Activation ops on the cpu backend.

The gated forms are one fused Numba pass: each work item (a row's chunk of ``CHUNK`` columns) reads its gate and up
values once, and writes ``act(gate) * up`` once, never materializing ``act(gate)`` (torch eager writes and rereads
it, and allocates it). Work items rather than rows are the parallel unit so that a single decode token still spreads
over every core. The transcendental functions are vectorizable (Numba here has no SVML; libm's ``expf``/``erff`` stay
scalar): sigmoid from :func:`fast_exp`, erf from Abramowitz & Stegun's formula 7.1.26 (absolute error < 1.5e-7).
``error_model="numpy"`` matters: under Numba's default (Python) error model every float division checks for zero
and raises, which keeps the loop scalar (measured 5.0 vs 0.17 ns per element for ``x * sigmoid(x)``).
The plain elementwise ops are single torch calls, which already compute bf16/fp16 in float32 and round once.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from tessera.backends.cpu.numba_math import fast_exp, widen
from tessera.backends.cpu.ops._narrow import narrow, storage_view

#: columns per work item: 8 KiB of fp32 gate + up, a few items per core even at one row of I = 11008
CHUNK = 1024
#: below this many outputs a call runs on the calling thread (waking the parallel workers costs more than the work)
PARALLEL_MIN_ELEMENTS = 32768
_KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
#: no "contract" / "reassoc" here: the serial and the parallel kernel are compiled apart, and with those flags LLVM
#: fused or reordered the same expression differently in each (one ulp apart), so a token's activation depended
#: on how many rows shared the call. Elementwise loops vectorize without them.
_EXACT = {"nsz", "arcp", "afn"}


@njit(inline="always", fastmath=_EXACT)
def _sigmoid(x):  # pragma: no cover - compiled
    """1 / (1 + e^-x). ``fast_exp`` is only valid below 88, so the exponent is clamped there: for x < -88 the result
    is 1 / (1 + e^88) ~ 6e-39 instead of a smaller subnormal, which rounds to the same output in every dtype."""
    return np.float32(1.0) / (np.float32(1.0) + fast_exp(min(-x, np.float32(88.0))))


@njit(inline="always", fastmath=_EXACT)
def _phi(x):  # pragma: no cover - compiled
    """Standard normal CDF ``0.5 (1 + erf(x / sqrt 2))``; the tail ``0.5 erfc(|z|)`` is computed directly (no
    cancellation) by A&S 7.1.26: ``erfc(z) ~ t (a1 + t (a2 + ...)) e^{-z^2}``, ``t = 1 / (1 + p z)``."""
    z = abs(x) * np.float32(0.7071067811865476)
    t = np.float32(1.0) / (np.float32(1.0) + np.float32(0.3275911) * z)
    poly = np.float32(1.061405429)
    poly = poly * t + np.float32(-1.453152027)
    poly = poly * t + np.float32(1.421413741)
    poly = poly * t + np.float32(-0.284496736)
    poly = poly * t + np.float32(0.254829592)
    tail = np.float32(0.5) * poly * t * fast_exp(-z * z)
    return np.float32(1.0) - tail if x >= np.float32(0.0) else tail


@njit(inline="always", fastmath=_EXACT, error_model="numpy")
def _act_and_mul_item(gate_up, out, kind, item, chunks):  # pragma: no cover - compiled
    """``out[i, c] = act(gate_up[i, c]) * gate_up[i, I + c]``; ``kind`` 0 SiLU, 1 GELU (erf), 2 GELU (tanh).

    Each item works on 1-D slices indexed from 0: with computed bounds (``range(c0, c1)``) Numba cannot prove the
    indices non-negative, keeps its negative-index wraparound per element and the loop stays scalar (measured 3.3 vs
    0.2 ns per element)."""
    inter = out.shape[1]
    i = item // chunks
    c0 = (item % chunks) * CHUNK
    c1 = min(c0 + CHUNK, inter)
    gate, up, dst = gate_up[i, c0:c1], gate_up[i, inter + c0:inter + c1], out[i, c0:c1]
    if kind == 0:
        for k in range(c1 - c0):
            g = widen(gate[k])
            dst[k] = narrow(g * _sigmoid(g) * widen(up[k]), out)
    elif kind == 1:
        for k in range(c1 - c0):
            g = widen(gate[k])
            dst[k] = narrow(g * _phi(g) * widen(up[k]), out)
    else:
        for k in range(c1 - c0):
            g = widen(gate[k])
            v = np.float32(2.0 * _SQRT_2_OVER_PI) * (g + np.float32(0.044715) * g * g * g)
            dst[k] = narrow(g * _sigmoid(v) * widen(up[k]), out)  # sigmoid(2u) = (1 + tanh u) / 2


@njit(parallel=True, fastmath=_EXACT, nogil=True, cache=True, error_model="numpy")
def _act_and_mul_parallel(gate_up, out, kind):  # pragma: no cover - compiled
    chunks = (out.shape[1] + CHUNK - 1) // CHUNK
    for item in prange(out.shape[0] * chunks):
        _act_and_mul_item(gate_up, out, kind, item, chunks)


@njit(fastmath=_EXACT, nogil=True, cache=True, error_model="numpy")
def _act_and_mul_serial(gate_up, out, kind):  # pragma: no cover - compiled
    chunks = (out.shape[1] + CHUNK - 1) // CHUNK
    for item in range(out.shape[0] * chunks):
        _act_and_mul_item(gate_up, out, kind, item, chunks)


def _act_and_mul(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    if out.numel() == 0:
        return out
    src = storage_view(gate_up if gate_up.is_contiguous() else gate_up.contiguous())
    dst = storage_view(out)
    kernel = _act_and_mul_parallel if out.numel() >= PARALLEL_MIN_ELEMENTS else _act_and_mul_serial
    kernel(src.reshape(-1, 2 * inter), dst.reshape(-1, inter), _KINDS[kind])
    return out


def silu_and_mul(gate_up):
    return _act_and_mul(gate_up, "silu")


def gelu_and_mul(gate_up, approximate):
    return _act_and_mul(gate_up, "gelu_tanh" if approximate == "tanh" else "gelu")


def silu(x):
    return F.silu(x)


def gelu(x, approximate):
    return F.gelu(x, approximate=approximate)


def relu(x):
    return torch.relu(x)


OPS = {"silu": silu, "gelu": gelu, "relu": relu, "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul}
