"""Quantized matmul at a Llama-7B projection (4096 x 4096): ours (backend=host_backend()) vs torch's fp32 ``x @ w.T``.

Decode (M=1) is memory-bound: fp32 W is 64 MiB, int8 16 MiB, int4 8 MiB plus scales, hence the targets of
0.4x (int8) and 0.3x (int4) the fp32 time. Both the packed weights and the fp32 baseline rotate through copies
(:func:`tessera.bench.harness.rotate_bytes`: at least twice the last-level cache) so that both stream from DRAM.
The default ``qgemv`` variant runs every format; each other variant this CPU runs gets the GGUF block formats. M=8 is the Numba kernel's small-batch path; M=64 dequantizes tiles for BLAS.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tessera.bench.harness import copies_for, rotating
from tessera.bench.kernel_cases import KernelCase
from tessera.bench.machine import host_backend
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


def _variants() -> list[str]:
    """The ``qgemv`` kernel variants this machine runs, best first (from the timed backend's own report; none when it
    has no variants)."""
    from tessera.backends import registry

    for row in getattr(registry.get(host_backend()), "kernel_variants", list)():
        if row["family"] == "qgemv":
            return list(row["available"])
    return []


def _under(variant: str | None, fn):
    """``fn`` run with the ``qgemv`` variant forced (None: whatever is chosen by default)."""
    if variant is None:
        return fn

    def run():
        before = os.environ.get("TESSERA_CPU_VARIANTS")
        os.environ["TESSERA_CPU_VARIANTS"] = f"qgemv={variant}"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["TESSERA_CPU_VARIANTS"]
            else:
                os.environ["TESSERA_CPU_VARIANTS"] = before

    return run


def _case(fmt: str, group: int | None, target: float | None, m: int, w: torch.Tensor,
          baseline_weights, variant: str | None = None) -> KernelCase:
    ours = host_backend()  # the backend timed as ours, looked up once
    qw = quant.quantize(w, fmt, group)
    weights = rotating(_copies(qw))
    x = torch.randn(m, HIDDEN)
    n, k = w.shape
    label = f"qmatmul {fmt}" + (f"/g{group}" if group else "") + f" M={m} {n}x{k}" + (f" [{variant}]" if variant else "")
    return KernelCase("quant", label, _under(variant, lambda: quant.qmatmul(x, weights(), backend=ours)),
                      lambda: x @ baseline_weights().T,
                      bytes_moved=qw.nbytes + 4 * (m * k + m * n), flops=2 * m * n * k,
                      target=target if m == 1 else None)


def cases(quick: bool) -> list[KernelCase]:
    ours = host_backend()  # the backend timed as ours, looked up once
    w = torch.randn(HIDDEN, HIDDEN) * 0.02
    # the fp32 baseline streams from DRAM too: one 64 MiB matrix would sit in a 300 MiB L3
    fp32 = rotating([w] + [w.clone() for _ in range(copies_for(w.numel() * 4) - 1)])
    out = [_case(fmt, group, target, 1, w, fp32) for fmt, group, target in FORMATS]
    # every other qgemv variant this CPU runs, on the GGUF block formats
    for variant in _variants()[1:]:
        out += [_case(fmt, 32, target, 1, w, fp32, variant) for fmt, group, target in FORMATS if group == 32]
    if not quick:
        out += [_case(fmt, group, None, 8, w, fp32) for fmt, group, _ in FORMATS[::2]]
        out += [_case("int4", 128, None, 64, w, fp32)]
        x = torch.randn(64, HIDDEN)
        out.append(KernelCase("quant", f"matmul fp32 M=64 {HIDDEN}x{HIDDEN}",
                              lambda: quant.matmul(x, w, backend=ours), lambda: x @ w.T,
                              bytes_moved=4 * (w.numel() + 2 * x.numel()), flops=2 * 64 * HIDDEN * HIDDEN))
    return out
