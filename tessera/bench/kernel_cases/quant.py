"""Quantized matmul at a Llama-7B projection (4096 x 4096): ours (backend="cpu") vs torch's fp32 ``x @ w.T``.

Decode (M=1) is memory-bound: fp32 W is 64 MiB, int8 16 MiB, int4 8 MiB plus scales, hence issue 5's targets of
0.4x (int8) and 0.3x (int4) the fp32 time. The packed weights rotate through copies (128 MiB in all) so that they
stream from DRAM like the fp32 baseline does. M=8 is the Numba kernel's small-batch path; M=64 dequantizes tiles for BLAS.
"""

from __future__ import annotations

import dataclasses

import torch

from tessera.bench.harness import copies_for, rotating
from tessera.bench.kernel_cases import KernelCase
from tessera.kernels import quant

HIDDEN = 4096
# (format, group size, target at M=1)
FORMATS = [("int8", None, 0.4), ("int8", 32, 0.4), ("int4", 128, 0.3), ("int4", 32, 0.3), ("int4_min", 32, 0.3),
           ("fp8_e4m3", None, 0.4)]


def _copies(qw: quant.QuantizedWeight) -> list[quant.QuantizedWeight]:
    """Enough copies of a packed weight to stream from DRAM in turn: a single 8 MiB int4 matrix would sit in this
    machine's 32 MiB L3 after the first call while the 64 MiB fp32 baseline cannot, flattering the ratio."""
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return [qw] + [dataclasses.replace(qw, data=qw.data.clone(), scales=qw.scales.clone(), zeros=clone(qw.zeros),
                                       mins=clone(qw.mins)) for _ in range(copies_for(qw.nbytes) - 1)]


def _case(fmt: str, group: int | None, target: float | None, m: int, w: torch.Tensor) -> KernelCase:
    qw = quant.quantize(w, fmt, group)
    weights = rotating(_copies(qw))
    x = torch.randn(m, HIDDEN)
    n, k = w.shape
    label = f"qmatmul {fmt}" + (f"/g{group}" if group else "") + f" M={m} {n}x{k}"
    return KernelCase("quant", label, lambda: quant.qmatmul(x, weights(), backend="cpu"), lambda: x @ w.T,
                      bytes_moved=qw.nbytes + 4 * (m * k + m * n), flops=2 * m * n * k,
                      target=target if m == 1 else None)


def cases(quick: bool) -> list[KernelCase]:
    w = torch.randn(HIDDEN, HIDDEN) * 0.02
    out = [_case(fmt, group, target, 1, w) for fmt, group, target in FORMATS]
    if not quick:
        out += [_case(fmt, group, None, 8, w) for fmt, group, _ in FORMATS[::2]]
        out += [_case("int4", 128, None, 64, w)]
        x = torch.randn(64, HIDDEN)
        out.append(KernelCase("quant", f"matmul fp32 M=64 {HIDDEN}x{HIDDEN}",
                              lambda: quant.matmul(x, w, backend="cpu"), lambda: x @ w.T,
                              bytes_moved=4 * (w.numel() + 2 * x.numel()), flops=2 * 64 * HIDDEN * HIDDEN))
    return out
