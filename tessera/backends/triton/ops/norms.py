"""Normalization ops on the triton backend: one program per row, sweeping the row in ``BLOCK`` columns.

The first sweep accumulates the statistics in float32, the second writes the output (a row is read twice; on a GPU
the second read hits L2). The fused residual writes ``r = x + residual`` rounded to storage in the first sweep and
*recomputes* it in the second rather than reloading it, so no program reads memory it wrote itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.backends.triton.ops._rounding import manual_rne, to_storage

MAX_BLOCK = 4096


@triton.jit
def _source(x_row, res_row, cols, ok, FUSED: tl.constexpr, MANUAL_RNE: tl.constexpr):
    """The row being normalized, in storage dtype: x, or x + residual summed in float32 and rounded to storage."""
    x = tl.load(x_row + cols, mask=ok, other=0.0)
    if FUSED:
        s = x.to(tl.float32) + tl.load(res_row + cols, mask=ok, other=0.0).to(tl.float32)
        x = to_storage(s, x.dtype, MANUAL_RNE)
    return x


@triton.jit
def _rms_norm_kernel(X, RES, W, Y, R, h, eps, w_offset, FUSED: tl.constexpr, BLOCK: tl.constexpr,
                     MANUAL_RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * h, Y + row * h
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, h, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < h
        v = _source(x_row, RES + row * h, cols, ok, FUSED, MANUAL_RNE)
        if FUSED:
            tl.store(R + row * h + cols, v, mask=ok)
        v = v.to(tl.float32)
        acc += v * v
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / h + eps)
    for c0 in range(0, h, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < h
        x = _source(x_row, RES + row * h, cols, ok, FUSED, MANUAL_RNE)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + w_offset
        tl.store(y_row + cols, to_storage(x.to(tl.float32) * rstd * w, Y.dtype.element_ty, MANUAL_RNE), mask=ok)


@triton.jit
def _layer_norm_kernel(X, W, B, Y, h, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, MANUAL_RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * h, Y + row * h
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, h, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        acc += tl.load(x_row + cols, mask=cols < h, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / h
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, h, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < h
        d = tl.where(ok, tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) - mean, 0.0)
        acc += d * d
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / h + eps)
    for c0 in range(0, h, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < h
        y = (tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) - mean) * rstd
        y = y * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_row + cols, to_storage(y, Y.dtype.element_ty, MANUAL_RNE), mask=ok)


def _block(h: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(h))


def rms_norm(x, weight, eps, residual, gemma):
    h = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // h
    fused = residual is not None
    res = residual.contiguous() if fused else xc
    r = torch.empty_like(xc) if fused else y
    if rows:
        _rms_norm_kernel[(rows,)](xc, res, weight.contiguous(), y, r, h, eps, 1.0 if gemma else 0.0,
                                  FUSED=fused, BLOCK=_block(h), MANUAL_RNE=manual_rne(x.dtype))
    return (y, r) if fused else y


def layer_norm(x, weight, bias, eps):
    h = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // h
    if rows:
        b = bias.contiguous() if bias is not None else weight
        _layer_norm_kernel[(rows,)](xc, weight.contiguous(), b, y, h, eps, HAS_BIAS=bias is not None,
                                    BLOCK=_block(h), MANUAL_RNE=manual_rne(x.dtype))
    return y


def qk_norm(q, weight, eps, gemma):
    return rms_norm(q, weight, eps, None, gemma)


OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "qk_norm": qk_norm}
