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


#: byte offsets of the float16 fields (d, dmin / m) in a block of each ggml block format
GGML_HALF_FIELDS = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_ggml_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """A ``[n, k]`` weight in one of ggml's block formats kept whole (``q5_0``, ``q5_1``, ``q4_k``, ``q5_k``,
    ``q6_k``) with random bytes: every code, scale and bit pattern the format allows, except that the float16 fields
    hold values of about 0.01 (random bits would include NaNs and infinities)."""
    from tessera.kernels.ggml_blocks import BLOCKS

    _, values, size = BLOCKS[fmt]
    blocks = torch.randint(0, 256, (n * (k // values), size), dtype=torch.uint8, generator=gen)
    for at in GGML_HALF_FIELDS[fmt]:
        halves = (torch.rand(blocks.shape[0], generator=gen) * 0.02 + 0.001).half()
        blocks[:, at:at + 2] = halves.view(torch.uint8).view(-1, 2)
    return QuantizedWeight(fmt, (n, k), values, blocks.view(n, -1).contiguous(), None)
