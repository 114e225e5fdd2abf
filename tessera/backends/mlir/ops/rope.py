"""Rotary embeddings through IREE (``op_kernels.rope``); the angles' cos/sin are computed on the host in float64."""

from __future__ import annotations

import torch

from tessera.backends.mlir.ops._call import f32, run
from tessera.mlir import op_kernels


def apply_rope(q, k, positions, rope, interleaved=False):
    angles = positions.to("cpu", torch.float64)[:, None] * rope.inv_freq.double()[None, :]
    cos = (torch.cos(angles) * rope.attention_scaling).float().contiguous()
    sin = (torch.sin(angles) * rope.attention_scaling).float().contiguous()
    text = op_kernels.rope(bool(interleaved))
    for x in (q, k):
        x.copy_(run(text, "rope", tuple(x.shape), f32(x), cos, sin) if x.numel() else x)
    return q, k


OPS = {"apply_rope": apply_rope}
