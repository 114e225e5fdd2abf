"""Packed weights with random codes, for timing quantized kernels at model sizes."""

from __future__ import annotations

import torch

from tessera.kernels.quant import QuantizedWeight


def random_qweight(fmt: str, n: int, k: int, gen: torch.Generator, group: int = 32) -> QuantizedWeight:
    """A packed ``[n, k]`` weight with random codes, built directly (quantizing a float matrix of 1B-class size
    takes seconds; the kernels' speed does not depend on the values). Scales are ~0.01, so nothing is subnormal;
    fp8 codes avoid the NaN pattern."""
    g = k if fmt == "fp8_e4m3" else group
    scales = torch.full((n, k // g), 0.01)
    if fmt == "int8":
        data = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        return QuantizedWeight(fmt, (n, k), g, data, scales)
    if fmt == "fp8_e4m3":
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen) & 0x7E  # 0x7F / 0xFF are NaN
        return QuantizedWeight(fmt, (n, k), g, codes.view(torch.float8_e4m3fn), scales)
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    if fmt == "int4":
        zeros = torch.full((n, k // g), 8, dtype=torch.uint8)
        return QuantizedWeight(fmt, (n, k), g, data, scales, zeros=zeros)
    return QuantizedWeight(fmt, (n, k), g, data, scales, mins=torch.full((n, k // g), -0.08))
