"""Measured compute peaks of the cpu backend's kernel variants, for the roofline.

The memory roof and the fp32 GEMM roof come from :mod:`tessera.hw.ceilings`. The int8-activation ``qgemv`` variants
run on a different roof: integer dot products (``VPDPBUSD``, ``VPMADDUBSW``), whose rate depends on the variant and
the CPU. :func:`int8_dot_peak` measures it with the chosen variant's own kernel on cache-resident weights, so
``tessera profile`` can say whether a quantized projection is bound by memory or by those instructions.
"""

from __future__ import annotations

import functools
import time

import torch

#: probe shape: 8 activation rows x (256 x 2048) int4 weights (256 KiB packed: cache-resident on every CPU here)
_M, _N, _K = 8, 256, 2048


@functools.cache
def int8_dot_peak(reps: int = 20) -> float | None:
    """Multiply-adds x 2 per second (OP/s) of the chosen int8-activation ``qgemv`` variant, all threads, weights in
    cache; None when the portable (float) variant runs. Measured once per process (~0.1 s after compilation)."""
    from tessera.backends.cpu.ops import _qdot
    from tessera.kernels.quant import quantize

    gen = torch.Generator().manual_seed(0)
    qw = quantize(torch.randn(_N, _K, generator=gen), "int4", 32)
    isa = _qdot.chosen_token(qw)
    if isa is None:
        return None
    x = torch.randn(_M, _K, generator=gen)
    _qdot.qmatmul(x, qw, isa, serial=False)  # compile / warm
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        _qdot.qmatmul(x, qw, isa, serial=False)
        best = min(best, time.perf_counter() - start)
    return 2.0 * _M * _N * _K / best


def compute_peaks() -> dict[str, float]:
    """Roofline peaks (OP/s) this backend adds to the device's: ``"int8"`` when an int8-activation variant runs."""
    peak = int8_dot_peak()
    return {} if peak is None else {"int8": peak}


def roof_of(op: str, args: tuple) -> str | None:
    """The compute roof an accounted call runs on, when it is not the model dtype's: ``"int8"`` for a quantized
    matmul (or packed lm_head) the int8-activation kernels take, and for a fused decoder layer whose projections
    they run (packed weight tuples, and an ISA token among its arguments)."""
    from tessera.backends.cpu.ops import _qdot
    from tessera.backends.cpu.kernel_args import LayerWeights
    from tessera.backends.cpu.ops._int8_simd import IsaToken
    from tessera.kernels.quant import QuantizedWeight

    if op in ("qmatmul", "lm_head") and len(args) > 1 and isinstance(args[1], QuantizedWeight):
        if _qdot.unsupported(args[1]) is None and _qdot.chosen_token(args[1]) is not None:
            return "int8"
    if op == "fused_decoder_layers" and any(isinstance(a, IsaToken) for a in args) and len(args) > 2 \
            and len(args[2]) > 0:
        weights = LayerWeights(*args[2][0][0])  # the first layer's plain weights tuple in the kernel's typed list
        if any(isinstance(w, tuple) for w in (weights.qkv_w, weights.o_w, weights.gate_up_w, weights.down_w)):
            return "int8"
    return None

