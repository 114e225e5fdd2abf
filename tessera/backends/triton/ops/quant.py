"""Triton backend of the quant family: one tiled matmul kernel that dequantizes weight tiles in registers.

Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K in ``BLOCK_K`` steps: it loads the x tile, loads
the packed codes of the weight tile with their per-group scales (and zero points or mins), widens them to float and
feeds ``tl.dot``. The dequantized weight only ever exists one tile at a time. fp8_e4m3 weights are dequantized by
torch first and go through the same kernel as float weights (``FMT_FLOAT``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.backends.reference.ops.quant import dequantize_in
from tessera.backends.triton.configs import interpreting
from tessera.kernels.quant import QuantizedWeight

FMT_FLOAT, FMT_INT8, FMT_INT4, FMT_INT4_MIN = 0, 1, 2, 3
_FMT = {"int8": FMT_INT8, "int4": FMT_INT4, "int4_min": FMT_INT4_MIN}


@triton.jit
def _weight_tile(w_ptr, s_ptr, o_ptr, rn, kk, mask, K, NG, FMT: tl.constexpr, GROUP: tl.constexpr):
    """The float32 ``[BLOCK_N, BLOCK_K]`` tile of ``w`` at rows ``rn``, columns ``kk``."""
    if FMT == FMT_FLOAT:
        return tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    g = kk // GROUP
    gidx = rn[:, None] * NG + g[None, :]
    s = tl.load(s_ptr + gidx, mask=mask, other=0.0)
    if FMT == FMT_INT8:
        q = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=mask, other=0).to(tl.float32)
        return q * s
    # int4: byte j of a group holds element j (low nibble) and element j + GROUP/2 (high nibble)
    HALF: tl.constexpr = GROUP // 2
    j = kk % GROUP
    byte = g * HALF + j % HALF
    shift = (j >= HALF).to(tl.int32) * 4
    b = tl.load(w_ptr + rn[:, None] * (K // 2) + byte[None, :], mask=mask, other=0).to(tl.int32)
    q = ((b >> shift[None, :]) & 15).to(tl.float32)
    off = tl.load(o_ptr + gidx, mask=mask, other=0).to(tl.float32)
    if FMT == FMT_INT4:
        return (q - off) * s
    return q * s + off


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, K, NG, FMT: tl.constexpr, GROUP: tl.constexpr,
                   WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        wt = _weight_tile(w_ptr, s_ptr, o_ptr, rn, kk, (rn[:, None] < N) & (kk[None, :] < K), K, NG, FMT, GROUP)
        if WIDEN:  # fp32 operands: exact fp32 products (and the interpreter's bf16 dot multiplies raw bits)
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, offsets: torch.Tensor | None,
            n: int, fmt: int, group: int) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    interp = interpreting() or x.device.type != "cuda"
    bm, bn, bk = (16, 32, 32) if interp else (16 if m <= 16 else 64, 64, 64)
    s = scales if scales is not None else w  # unused pointers still need a tensor
    o = offsets if offsets is not None else s
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](x.contiguous(), w, s, o, y, m, n, k, k // group, FMT=fmt, GROUP=group,
                         WIDEN=interp or x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _launch(x, w.contiguous(), None, None, w.shape[0], FMT_FLOAT, 1)


def qmatmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    n = qw.shape[0]
    if qw.fmt == "fp8_e4m3":
        return _launch(x, dequantize_in(qw, torch.float32), None, None, n, FMT_FLOAT, 1)
    offsets = qw.zeros if qw.fmt == "int4" else qw.mins
    return _launch(x, qw.data, qw.scales, offsets, n, _FMT[qw.fmt], qw.group_size)


OPS = {"matmul": matmul, "qmatmul": qmatmul}
