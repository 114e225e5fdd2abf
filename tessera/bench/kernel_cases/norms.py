"""Norm benchmarks: our cpu kernels against torch eager's Hugging Face composition of the same op.

The issue's target: the fused RMSNorm + residual add at hidden 4096 and 64 tokens at least 1.5x faster than
``x = x + residual; var = x.float().pow(2).mean(-1, keepdim=True); y = x.float() * torch.rsqrt(var + eps);
(w * y).to(dtype)`` (fp32 and bf16), i.e. ours / torch <= 1 / 1.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.bench.kernel_cases import KernelCase
from tessera.bench.machine import host_backend
from tessera.kernels.norms import layer_norm, qk_norm, rms_norm

EPS = 1e-6
TARGET = round(1 / 1.5, 3)


def _hf_rms(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        x = x + residual
    var = x.float().pow(2).mean(-1, keepdim=True)
    y = x.float() * torch.rsqrt(var + EPS)
    return (w * y).to(x.dtype)


def _rms_cases(dtype: torch.dtype, tokens: int, hidden: int, target: float | None) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    name = str(dtype).removeprefix("torch.")
    x, res = torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    size = x.numel() * x.element_size()
    return [
        KernelCase("norms", f"rms_norm+residual {tokens}x{hidden} {name}",
                   lambda: rms_norm(x, w, EPS, residual=res, backend=ours), lambda: _hf_rms(x, w, res),
                   bytes_moved=4 * size, target=target),
        KernelCase("norms", f"rms_norm {tokens}x{hidden} {name}", lambda: rms_norm(x, w, EPS, backend=ours),
                   lambda: _hf_rms(x, w), bytes_moved=2 * size),
    ]


def _other_cases(dtype: torch.dtype) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    name = str(dtype).removeprefix("torch.")
    x = torch.randn(64, 768, dtype=dtype)
    w, b = torch.randn(768, dtype=dtype), torch.randn(768, dtype=dtype)
    q = torch.randn(64, 32, 128, dtype=dtype)
    wq = torch.randn(128, dtype=dtype)
    return [
        KernelCase("norms", f"layer_norm 64x768 {name}", lambda: layer_norm(x, w, b, 1e-5, backend=ours),
                   lambda: F.layer_norm(x, (768,), w, b, 1e-5), bytes_moved=2 * x.numel() * x.element_size()),
        KernelCase("norms", f"qk_norm 64x32x128 {name}", lambda: qk_norm(q, wq, EPS, backend=ours),
                   lambda: _hf_rms(q, wq), bytes_moved=2 * q.numel() * q.element_size()),
    ]


def cases(quick: bool) -> list[KernelCase]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        out += _rms_cases(dtype, 64, 4096, TARGET)
        if not quick:
            out += _rms_cases(dtype, 1, 4096, None) + _rms_cases(dtype, 512, 4096, None)
            out += _other_cases(dtype)
    return out
