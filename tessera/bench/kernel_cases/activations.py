"""Activation benchmarks: our cpu kernels against torch eager's composition of the same op.

The issue's target: the fused SiLU-and-mul at 64 tokens x I = 14336 (Llama-3-8B's intermediate size for hidden 4096)
at least 1.5x faster than ``gate, up = gate_up.chunk(2, -1); F.silu(gate) * up`` (fp32 and bf16), i.e.
ours / torch <= 1 / 1.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.bench.kernel_cases import KernelCase
from tessera.bench.machine import host_backend
from tessera.kernels.activations import gelu, gelu_and_mul, silu, silu_and_mul

TARGET = round(1 / 1.5, 3)


def _silu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def _gelu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


def _gated_cases(dtype: torch.dtype, tokens: int, inter: int, target: float | None) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    name = str(dtype).removeprefix("torch.")
    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype)
    moved = gate_up.numel() * gate_up.element_size() * 3 // 2  # read gate + up, write out
    return [
        KernelCase("activations", f"silu_and_mul {tokens}x{inter} {name}",
                   lambda: silu_and_mul(gate_up, backend=ours), lambda: _silu_mul_eager(gate_up),
                   bytes_moved=moved, target=target),
        KernelCase("activations", f"gelu_and_mul tanh {tokens}x{inter} {name}",
                   lambda: gelu_and_mul(gate_up, "tanh", backend=ours), lambda: _gelu_mul_eager(gate_up),
                   bytes_moved=moved),
    ]


def _elementwise_cases(dtype: torch.dtype) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    name = str(dtype).removeprefix("torch.")
    x = torch.randn(64, 14336, dtype=dtype)
    moved = 2 * x.numel() * x.element_size()
    return [
        KernelCase("activations", f"silu 64x14336 {name}", lambda: silu(x, backend=ours), lambda: F.silu(x),
                   bytes_moved=moved),
        KernelCase("activations", f"gelu 64x14336 {name}", lambda: gelu(x, backend=ours), lambda: F.gelu(x),
                   bytes_moved=moved),
    ]


def cases(quick: bool) -> list[KernelCase]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        out += _gated_cases(dtype, 64, 14336, TARGET)
        if not quick:
            out += _gated_cases(dtype, 1, 14336, None) + _gated_cases(dtype, 512, 14336, None)
            out += _elementwise_cases(dtype)
    return out
