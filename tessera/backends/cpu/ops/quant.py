"""cpu backend of the quant family: Numba GEMV kernels for decode shapes, dequantize-and-BLAS for the rest.

Up to :data:`SMALL_M` rows of x the packed weights are streamed once by :mod:`._quant_kernels` (memory-bound; the
weight bytes are the traffic). Above it the matmul is compute-bound and BLAS wins: the weight is dequantized in
blocks of :data:`TILE_N` rows (a few MiB, so it stays in cache and the full float matrix is never held) and each
block goes through one fp32 GEMM.
"""

from __future__ import annotations

import torch

from tessera.backends.cpu.ops import _quant_kernels as kernels
from tessera.backends.reference.ops.quant import dequantize_in, quantize_in
from tessera.kernels.quant import QuantizedWeight

SMALL_M = 8
TILE_N = 512


def quantize(w: torch.Tensor, fmt: str, group_size: int) -> QuantizedWeight:
    return quantize_in(w, fmt, group_size, torch.float32)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    return dequantize_in(qw, torch.float32)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return x @ w.T
    # half-precision BLAS paths differ across CPUs in how they accumulate; widening makes fp32 accumulation certain
    return (x.float() @ w.float().T).to(x.dtype)


def _rows_slice(qw: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    """Rows ``lo:hi`` of ``qw`` (views; every part is row-major with N first)."""
    part = lambda t: None if t is None else t[lo:hi]
    return QuantizedWeight(qw.fmt, (hi - lo, qw.shape[1]), qw.group_size, qw.data[lo:hi], qw.scales[lo:hi],
                           part(qw.zeros), part(qw.mins))


def _gemm_tiled(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    n = qw.shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for lo in range(0, n, TILE_N):
        hi = min(n, lo + TILE_N)
        torch.matmul(x, dequantize_in(_rows_slice(qw, lo, hi), torch.float32).T, out=out[:, lo:hi])
    return out


def _gemv(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    m, k = x.shape
    g = qw.group_size
    out = torch.empty(m, qw.shape[0], dtype=torch.float32)
    xn, on = x.numpy(), out.numpy()
    if qw.fmt in ("int8", "fp8_e4m3"):
        q = qw.data.numpy() if qw.fmt == "int8" else qw.data.view(torch.uint8).numpy()
        # e4m3 codes are widened as value * 2^-8 (see _quant_kernels); the 2^8 goes into the scale
        scales = qw.scales if qw.fmt == "int8" else qw.scales * 256.0
        kernels.gemv_8bit(xn, q, scales.numpy(), g, on)
        return out
    halves = x.reshape(m, k // g, 2, g // 2)
    xlo, xhi = halves[:, :, 0].reshape(m, k // 2).numpy(), halves[:, :, 1].reshape(m, k // 2).numpy()
    xsum = x.reshape(m, k // g, g).sum(-1)
    offsets = qw.mins if qw.fmt == "int4_min" else qw.zeros
    kernels.gemv_int4(xlo, xhi, xsum.numpy(), qw.data.numpy(), qw.scales.numpy(), offsets.numpy(),
                      qw.fmt == "int4_min", g, on)
    return out


def qmatmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    if x.shape[0] == 0 or qw.shape[0] == 0:
        return torch.zeros(x.shape[0], qw.shape[0], dtype=x.dtype)
    xf = x.float().contiguous()
    out = _gemv(xf, qw) if x.shape[0] <= SMALL_M else _gemm_tiled(xf, qw)
    return out.to(x.dtype)


OPS = {"quantize": quantize, "dequantize": dequantize, "matmul": matmul, "qmatmul": qmatmul}
