"""Float64 reference of the quant family: quantize, dequantize, matmul and qmatmul (the tests' oracle).

The packing helpers here take a compute dtype so the cpu backend reuses them in float32: quantizing is a one-time,
bandwidth-light step and one implementation of the layout is easier to keep right than two.
"""

from __future__ import annotations

import torch

from tessera.kernels.ggml_blocks import BLOCKS, dequantize_rows
from tessera.kernels.quant import QuantizedWeight

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def pack_nibbles(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 ``[N, K]`` values in 0..15 -> uint8 ``[N, K // 2]``: byte ``j`` of a group holds element ``j`` (low
    nibble) and element ``j + G/2`` (high nibble), so each half of a group is read from contiguous bytes."""
    n, k = q.shape
    g = q.reshape(n, k // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(data: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[N, K // 2]`` -> uint8 ``[N, K]``."""
    n, half = data.shape
    b = data.reshape(n, 2 * half // group_size, 1, group_size // 2)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(n, 2 * half)


def _safe_inverse(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)


def quantize_in(w: torch.Tensor, fmt: str, group_size: int, dt: torch.dtype) -> QuantizedWeight:
    """Quantize ``w [N, K]`` computing in ``dt``. Codes are rounded against the float32-rounded scales that are
    stored, so ``|w - dequantize(q)| <= s / 2`` holds for the stored ``s`` (up to ``dt`` rounding)."""
    n, k = w.shape
    ng = k // group_size
    wg = w.to(dt).reshape(n, ng, group_size)
    if fmt == "int4_min":
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / 15).float()
        q = torch.round((wg - lo[..., None]) * _safe_inverse(s.to(dt))[..., None]).clamp(0, 15)
        data = pack_nibbles(q.to(torch.uint8).reshape(n, k), group_size)
        return QuantizedWeight(fmt, (n, k), group_size, data, s.contiguous(), mins=lo.float().contiguous())
    amax = wg.abs().amax(-1)
    qmax = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": FP8_MAX}[fmt]
    s = (amax / qmax).float().contiguous()
    scaled = wg * _safe_inverse(s.to(dt))[..., None]
    if fmt == "fp8_e4m3":
        data = scaled.clamp(-FP8_MAX, FP8_MAX).reshape(n, k).to(torch.float8_e4m3fn)
        return QuantizedWeight(fmt, (n, k), group_size, data, s)
    q = torch.round(scaled).clamp(-qmax, qmax)
    if fmt == "int8":
        return QuantizedWeight(fmt, (n, k), group_size, q.to(torch.int8).reshape(n, k).contiguous(), s)
    data = pack_nibbles((q + 8).to(torch.uint8).reshape(n, k), group_size)
    return QuantizedWeight(fmt, (n, k), group_size, data, s, zeros=torch.full((n, ng), 8, dtype=torch.uint8))


def codes(qw: QuantizedWeight, dt: torch.dtype) -> torch.Tensor:
    """The integer (or fp8) codes ``q`` as ``dt`` ``[N, ng, G]``."""
    n, k = qw.shape
    q = unpack_nibbles(qw.data, qw.group_size) if qw.fmt.startswith("int4") else qw.data
    return q.to(dt).reshape(n, k // qw.group_size, qw.group_size)


def dequantize_in(qw: QuantizedWeight, dt: torch.dtype) -> torch.Tensor:
    """``w [N, K]`` in ``dt`` from the packed formats' formulas."""
    if qw.fmt in BLOCKS:  # ggml's blocks, by their definition
        return dequantize_rows(qw.data, qw.fmt, qw.shape[1], dt)
    q = codes(qw, dt)
    s = qw.scales.to(dt)[..., None]
    if qw.fmt == "int4":
        w = (q - qw.zeros.to(dt)[..., None]) * s
    elif qw.fmt == "int4_min":
        w = q * s + qw.mins.to(dt)[..., None]
    else:
        w = q * s
    return w.reshape(qw.shape)


def quantize(w: torch.Tensor, fmt: str, group_size: int) -> QuantizedWeight:
    return quantize_in(w, fmt, group_size, torch.float64)


def dequantize_f64(qw: QuantizedWeight) -> torch.Tensor:
    return dequantize_in(qw, torch.float64)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    return dequantize_f64(qw).float()


def matmul_f64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return matmul_f64(x, w).to(x.dtype)


def qmatmul_f64(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return x.double() @ dequantize_f64(qw).T


def qmatmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return qmatmul_f64(x, qw).to(x.dtype)


OPS = {"quantize": quantize, "dequantize": dequantize, "matmul": matmul, "qmatmul": qmatmul}
