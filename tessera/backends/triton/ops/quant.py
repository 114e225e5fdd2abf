"""Triton backend of the quant family: one tiled matmul kernel that dequantizes weight tiles in registers.

Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K in ``BLOCK_K`` steps: it loads the x tile, loads
the packed codes of the weight tile with their per-group scales (and zero points or mins), widens them to float and
feeds ``tl.dot``. The dequantized weight only ever exists one tile at a time. fp8_e4m3 weights are dequantized by
torch first and go through the same kernel as float weights (``FMT_FLOAT``).

``quantize`` and ``dequantize`` are Triton kernels that reproduce the reference's packed bytes and float32 output bit
for bit: they compute in float64 exactly as the reference does (float64 scale, rounded once to the stored float32
scale; float64 reciprocal and product; round half to even), with FMA contraction off (``enable_fp_fusion=False``) so
no product is fused into a later add. Rounding half to even and the float32 -> float8_e4m3fn encoding are integer /
magic-number arithmetic, not ``libdevice`` or a cast: the interpreter has no libdevice, and torch converts float64 to
fp8 through float32 (two roundings), which the kernel mirrors. float64 costs throughput on consumer GPUs; both ops are
one-time weight preparation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.backends.reference.ops.quant import dequantize_in
from tessera.backends.triton.configs import interpreting
from tessera.kernels.ggml_blocks import BLOCKS, dequantize_rows
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
    s = tl.load(s_ptr + gidx, mask=mask, other=0.0).to(tl.float32)  # float32, or GGUF's float16
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
    if qw.fmt in BLOCKS:  # ggml's blocks: de-quantized by torch ops on the device, then the float kernel
        return _launch(x, dequantize_rows(qw.data, qw.fmt, qw.shape[1], torch.float32), None, None, n, FMT_FLOAT, 1)
    if qw.fmt == "fp8_e4m3":
        return _launch(x, dequantize_in(qw, torch.float32), None, None, n, FMT_FLOAT, 1)
    offsets = qw.zeros if qw.fmt == "int4" else qw.mins
    return _launch(x, qw.data, qw.scales, offsets, n, _FMT[qw.fmt], qw.group_size)


# ---------------------------------------------------------------- quantize / dequantize

_QMAX = {"int8": 127.0, "int4": 7.0, "int4_min": 15.0, "fp8_e4m3": 448.0}
_FMT_Q = {"int8": FMT_INT8, "int4": FMT_INT4, "int4_min": FMT_INT4_MIN, "fp8_e4m3": FMT_FLOAT}
_RNE64: tl.constexpr = 6755399441055744.0  # 1.5 * 2^52: x + C - C rounds |x| < 2^51 to the nearest even integer
_RNE32: tl.constexpr = 12582912.0  # 1.5 * 2^23, the same in float32


@triton.jit
def _rne(v):
    """float64 ``v`` rounded half to even (``torch.round``), as float64."""
    return (v + _RNE64) - _RNE64


@triton.jit
def _fp8_e4m3_bits(v):
    """float32 ``v`` with ``|v| <= 448`` -> float8_e4m3fn bits (int32 0..255), round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    abits = bits & 0x7FFFFFFF
    a = abits.to(tl.float32, bitcast=True)
    # normal: round the 23-bit mantissa to 3 bits (a carry moves into the exponent), rebias 127 -> 7
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal (< 2^-6): steps of 2^-9; code 8 (rounding up to 2^-6) is exactly the smallest normal's bits
    sub = ((a * 512.0 + _RNE32) - _RNE32).to(tl.int32)
    return tl.where(a < 0.015625, sub, normal) | (sign << 7)


@triton.jit
def _fp8_e4m3_value(b):
    """float8_e4m3fn bits (int32) -> float32 value (exact; 0x7F / 0xFF are NaN)."""
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = b & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(sign == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), v)


@triton.jit
def _quantize_kernel(w_ptr, data_ptr, s_ptr, min_ptr, K, NG, G, FMT: tl.constexpr, QMAX: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One program per (row, group): pass 1 takes the group's max |w| (or min and max), pass 2 writes the codes."""
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    base = w_ptr + n * K + g * G
    amax = tl.max(tl.zeros([BLOCK], tl.float64), 0)
    lo = tl.min(tl.full([BLOCK], float("inf"), tl.float64), 0)
    hi = tl.max(tl.full([BLOCK], float("-inf"), tl.float64), 0)
    for start in range(0, G, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < G
        w = tl.load(base + offs, mask=mask, other=0.0).to(tl.float64)
        amax = tl.maximum(amax, tl.max(tl.abs(w), 0))
        lo = tl.minimum(lo, tl.min(tl.where(mask, w, float("inf")), 0))
        hi = tl.maximum(hi, tl.max(tl.where(mask, w, float("-inf")), 0))
    if FMT == FMT_INT4_MIN:
        s = ((hi - lo) / QMAX).to(tl.float32)
        tl.store(min_ptr + n * NG + g, lo.to(tl.float32))
    else:
        s = (amax / QMAX).to(tl.float32)
    tl.store(s_ptr + n * NG + g, s)
    s64 = s.to(tl.float64)
    inv = tl.where(s64 > 0, 1.0 / tl.where(s64 > 0, s64, 1.0), 0.0)
    if FMT == FMT_INT8 or FMT == FMT_FLOAT:  # FMT_FLOAT stands for fp8_e4m3 here
        for start in range(0, G, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < G
            v = tl.load(base + offs, mask=mask, other=0.0).to(tl.float64) * inv
            if FMT == FMT_INT8:
                q = tl.minimum(tl.maximum(_rne(v), -QMAX), QMAX).to(tl.int8)
            else:
                v = tl.minimum(tl.maximum(v, -QMAX), QMAX).to(tl.float32)
                q = _fp8_e4m3_bits(v).to(tl.uint8)
            tl.store(data_ptr + n * K + g * G + offs, q, mask=mask)
    else:
        # byte j of a group: element j in the low nibble, element j + G/2 in the high nibble
        half = G // 2
        for start in range(0, half, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < half
            w_lo = tl.load(base + offs, mask=mask, other=0.0).to(tl.float64)
            w_hi = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float64)
            if FMT == FMT_INT4_MIN:
                q_lo = tl.minimum(tl.maximum(_rne((w_lo - lo) * inv), 0.0), QMAX)
                q_hi = tl.minimum(tl.maximum(_rne((w_hi - lo) * inv), 0.0), QMAX)
            else:
                q_lo = tl.minimum(tl.maximum(_rne(w_lo * inv), -QMAX), QMAX) + 8.0
                q_hi = tl.minimum(tl.maximum(_rne(w_hi * inv), -QMAX), QMAX) + 8.0
            byte = q_lo.to(tl.int32) | (q_hi.to(tl.int32) << 4)
            tl.store(data_ptr + n * (K // 2) + g * half + offs, byte.to(tl.uint8), mask=mask)


@triton.jit
def _dequantize_kernel(data_ptr, s_ptr, o_ptr, out_ptr, K, NG, G, FMT: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, BLOCK columns); float64 formulas rounded once to float32, as the reference."""
    n = tl.program_id(0).to(tl.int64)
    kk = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = kk < K
    g = kk // G
    s = tl.load(s_ptr + n * NG + g, mask=mask, other=0.0).to(tl.float64)
    if FMT == FMT_INT8:
        w = tl.load(data_ptr + n * K + kk, mask=mask, other=0).to(tl.float64) * s
    elif FMT == FMT_FLOAT:  # fp8_e4m3, data viewed as uint8
        b = tl.load(data_ptr + n * K + kk, mask=mask, other=0).to(tl.int32)
        w = _fp8_e4m3_value(b).to(tl.float64) * s
    else:
        half = G // 2
        j = kk % G
        b = tl.load(data_ptr + n * (K // 2) + g * half + j % half, mask=mask, other=0).to(tl.int32)
        q = ((b >> ((j >= half).to(tl.int32) * 4)) & 15).to(tl.float64)
        off = tl.load(o_ptr + n * NG + g, mask=mask, other=0).to(tl.float64)
        if FMT == FMT_INT4:
            w = (q - off) * s
        else:
            w = q * s + off
    tl.store(out_ptr + n * K + kk, w.to(tl.float32), mask=mask)


def _q_block(extent: int) -> int:
    cap = 256 if interpreting() else 1024
    return max(16, min(cap, triton.next_power_of_2(extent)))


def quantize(w: torch.Tensor, fmt: str, group_size: int) -> QuantizedWeight:
    n, k = w.shape
    ng = k // group_size
    dev = w.device
    data = torch.empty(n, k // 2 if fmt.startswith("int4") else k, dtype=torch.int8 if fmt == "int8" else torch.uint8,
                       device=dev)
    scales = torch.empty(n, ng, dtype=torch.float32, device=dev)
    mins = torch.empty(n, ng, dtype=torch.float32, device=dev) if fmt == "int4_min" else None
    if n:
        extent = group_size // 2 if fmt.startswith("int4") else group_size
        _quantize_kernel[(n, ng)](w.contiguous(), data, scales, mins if mins is not None else scales, k, ng, group_size,
                                  FMT=_FMT_Q[fmt], QMAX=_QMAX[fmt], BLOCK=_q_block(extent), enable_fp_fusion=False)
    if fmt == "fp8_e4m3":
        data = data.view(torch.float8_e4m3fn)
    zeros = torch.full((n, ng), 8, dtype=torch.uint8, device=dev) if fmt == "int4" else None
    return QuantizedWeight(fmt, (n, k), group_size, data, scales, zeros=zeros, mins=mins)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    n, k = qw.shape
    if qw.fmt in BLOCKS:
        return dequantize_rows(qw.data, qw.fmt, k, torch.float32)
    out = torch.empty(n, k, dtype=torch.float32, device=qw.device)
    if n:
        data = qw.data.view(torch.uint8) if qw.fmt == "fp8_e4m3" else qw.data
        offsets = qw.zeros if qw.fmt == "int4" else qw.mins if qw.fmt == "int4_min" else qw.scales
        block = _q_block(k)
        _dequantize_kernel[(n, triton.cdiv(k, block))](data, qw.scales, offsets, out, k, k // qw.group_size,
                                                         qw.group_size, FMT=_FMT_Q[qw.fmt], BLOCK=block,
                                                         enable_fp_fusion=False)
    return out


OPS = {"matmul": matmul, "qmatmul": qmatmul, "quantize": quantize, "dequantize": dequantize}
