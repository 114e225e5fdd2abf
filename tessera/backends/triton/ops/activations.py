"""Activation ops on the triton backend: elementwise kernels over flat blocks, and fused gated kernels over
(row, column block) programs that read gate and up once and write the product once. Math in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.backends.triton.ops._rounding import manual_rne, to_storage

BLOCK = 1024
SILU, GELU, GELU_TANH, RELU = 0, 1, 2, 3


@triton.jit
def _sigmoid(x):
    """1 / (1 + e^-x) from e^-|x| in (0, 1]: never overflows (tl.sigmoid's e^-x does for x < -88)."""
    t = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0, t) / (1.0 + t)


@triton.jit
def _act(x, KIND: tl.constexpr):
    """The activation of float32 ``x``; GELU-tanh as ``x * sigmoid(2v)`` = ``0.5 x (1 + tanh v)``."""
    if KIND == 0:
        return x * _sigmoid(x)
    elif KIND == 1:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif KIND == 2:
        return x * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # 2 sqrt(2 / pi)
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _elementwise_kernel(X, Y, n, KIND: tl.constexpr, BLOCK: tl.constexpr, MANUAL_RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, to_storage(_act(x, KIND), Y.dtype.element_ty, MANUAL_RNE), mask=ok)


@triton.jit
def _gated_kernel(GU, OUT, inter, KIND: tl.constexpr, BLOCK: tl.constexpr, MANUAL_RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(GU + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GU + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * inter + cols, to_storage(_act(gate, KIND) * up, OUT.dtype.element_ty, MANUAL_RNE), mask=ok)


def _elementwise(x: torch.Tensor, kind: int) -> torch.Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _elementwise_kernel[(triton.cdiv(n, BLOCK),)](xc, y, n, KIND=kind, BLOCK=BLOCK, MANUAL_RNE=manual_rne(x.dtype))
    return y


def _gated(gate_up: torch.Tensor, kind: int) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    gu = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // inter if inter else 0
    if rows:
        grid = (rows, triton.cdiv(inter, BLOCK))
        _gated_kernel[grid](gu, out, inter, KIND=kind, BLOCK=BLOCK, MANUAL_RNE=manual_rne(gate_up.dtype))
    return out


def silu(x):
    return _elementwise(x, SILU)


def gelu(x, approximate):
    return _elementwise(x, GELU_TANH if approximate == "tanh" else GELU)


def relu(x):
    return _elementwise(x, RELU)


def silu_and_mul(gate_up):
    return _gated(gate_up, SILU)


def gelu_and_mul(gate_up, approximate):
    return _gated(gate_up, GELU_TANH if approximate == "tanh" else GELU)


OPS = {"silu": silu, "gelu": gelu, "relu": relu, "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul}
