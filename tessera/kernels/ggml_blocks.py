"""ggml's block formats that Tessera keeps as the file stores them: Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K.

A weight in one of these formats is a :class:`tessera.kernels.quant.QuantizedWeight` whose ``data`` is the file's
bytes, row by row (uint8 ``[N, row_bytes]``; a row is ``K / block`` whole blocks), with no separate scales: every
scale sits inside its block, as ggml lays it out. Keeping the blocks intact means a packed weight takes the file's
bytes and nothing more, and can be a view of the mapped file.

This module is the format's definition in torch operations (any device), de-quantizing in float64 by default: the
reference backend's path, the triton backend's for now, and the oracle of the cpu kernels (``tessera/backends/cpu/ops/_ggml_kernels.py``). gguf-py's de-quantizer is the independent
check of both, in the tests.

Block layouts (little-endian; ``f16`` is an IEEE half):

========  ======  =====  =======================================================================================
format    values  bytes  layout
========  ======  =====  =======================================================================================
q5_0      32      22     d f16, qh u32 (the 5th bit of each value), qs[16] (low nibbles: values 0-15, high: 16-31);
                         value = (q - 16) * d
q5_1      32      24     d f16, m f16, qh u32, qs[16]; value = q * d + m
q4_k      256     144    d f16, dmin f16, scales[12] (eight 6-bit scales and eight 6-bit mins), qs[128]; four
                         chunks of 64 values: the low nibbles of 32 bytes, then their high nibbles, each 32 with its
                         own scale and min; value = d * sc * q - dmin * m
q5_k      256     176    as q4_k, plus qh[32] (the 5th bit: bit 2c of byte l for chunk c's first 32, bit 2c+1 for
                         its second 32) before qs
q6_k      256     210    ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8 (one per 16 values), d f16;
                         two halves of 128 values; value = d * sc * (q - 32)
========  ======  =====  =======================================================================================
"""

from __future__ import annotations

import torch

#: format -> (ggml type id, values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int, int]] = {
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
    "q4_k": (12, 256, 144),
    "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210),
}
#: ggml type id -> format
BY_TYPE_ID: dict[int, str] = {tid: fmt for fmt, (tid, _, _) in BLOCKS.items()}


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of ``k`` values."""
    _, values, size = BLOCKS[fmt]
    return k // values * size


def _half(b: torch.Tensor, at: int, dt: torch.dtype) -> torch.Tensor:
    """The f16 at byte ``at`` of every block, as ``dt [blocks, 1]``."""
    return b[:, at:at + 2].contiguous().view(torch.float16).to(dt)


def _u32(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian u32 at byte ``at`` of every block, as int64 ``[blocks, 1]``."""
    v = b[:, at:at + 4].long()
    return v[:, 0:1] | (v[:, 1:2] << 8) | (v[:, 2:3] << 16) | (v[:, 3:4] << 24)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of q4_k / q5_k blocks from their 12 bytes: int64 ``[blocks, 8]`` each."""
    s = s.long()
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc, mn


def _dequant_blocks(b: torch.Tensor, fmt: str, dt: torch.dtype) -> torch.Tensor:
    """uint8 ``[blocks, bytes]`` -> ``dt [blocks, values]``."""
    if fmt in ("q5_0", "q5_1"):
        d = _half(b, 0, dt)
        at = 2 if fmt == "q5_0" else 4
        qh = _u32(b, at)
        qs = b[:, at + 4:at + 20].long()
        j = torch.arange(16, device=b.device)
        lo = (qs & 15) | (((qh >> j) & 1) << 4)
        hi = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4)
        q = torch.cat([lo, hi], dim=1).to(dt)
        return (q - 16) * d if fmt == "q5_0" else q * d + _half(b, 2, dt)
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _half(b, 0, dt), _half(b, 2, dt)
        sc, mn = _k_scales(b[:, 4:16])
        qh = b[:, 16:48].long() if fmt == "q5_k" else None
        qs = (b[:, 16:144] if fmt == "q4_k" else b[:, 48:176]).long().reshape(-1, 4, 32)
        parts = []
        for c in range(4):
            for half, q in ((0, qs[:, c] & 15), (1, qs[:, c] >> 4)):
                if qh is not None:
                    q = q + (((qh >> (2 * c + half)) & 1) << 4)
                sub = 2 * c + half
                parts.append(d * sc[:, sub:sub + 1].to(dt) * q.to(dt) - dmin * mn[:, sub:sub + 1].to(dt))
        return torch.cat(parts, dim=1)
    if fmt == "q6_k":
        ql = b[:, 0:128].long().reshape(-1, 2, 64)
        qh = b[:, 128:192].long().reshape(-1, 2, 32)
        sc = b[:, 192:208].contiguous().view(torch.int8).to(dt).reshape(-1, 2, 8)
        d = _half(b, 208, dt)
        parts = []
        for h in range(2):
            low = (ql[:, h, :32] & 15, ql[:, h, 32:] & 15, ql[:, h, :32] >> 4, ql[:, h, 32:] >> 4)
            for part in range(4):
                q = (low[part] | (((qh[:, h] >> (2 * part)) & 3) << 4)) - 32
                scale = sc[:, h, 2 * part:2 * part + 2].repeat_interleave(16, dim=1)  # l < 16: sc[is], else sc[is+1]
                parts.append(d * scale * q.to(dt))
        return torch.cat(parts, dim=1)
    raise ValueError(f"unknown ggml block format {fmt!r}; known: {sorted(BLOCKS)}")


def dequantize_rows(data: torch.Tensor, fmt: str, k: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``dtype [N, K]`` of uint8 rows ``data [N, row_bytes(fmt, K)]``, on ``data``'s device (torch ops only)."""
    _, values, size = BLOCKS[fmt]
    n = data.shape[0]
    blocks = data.contiguous().reshape(n * (k // values), size)
    return _dequant_blocks(blocks, fmt, dtype).reshape(n, k)
