"""Embedding ops on the cpu backend: torch's row gather, and the LM head as BLAS GEMMs over vocabulary chunks.

The LM head must accumulate in float32 and return float32 logits; torch's CPU matmul has no ``out_dtype``, so a
bf16/fp16 table is widened ``VOCAB_CHUNK_BYTES`` at a time (the widened chunk stays in L2/L3 while the GEMM reads it)
instead of copying the whole table to float32 per call. Up to ``quant.SMALL_M`` rows (decode) the quant family's
Numba GEMV reads the table once in its own dtype instead (fp32 accumulation; 2x torch's fp32 GEMV at 49152 x 576).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from tessera.backends.cpu.numba_math import group_value
from tessera.backends.cpu.ops import quant
from tessera.backends.cpu.ops._narrow import group_view

#: float32 bytes of one widened table chunk
VOCAB_CHUNK_BYTES = 2 << 20


def embed(ids, table, scale):
    table = table.detach()  # inference op: an nn.Parameter table must not record autograd history
    out = torch.index_select(table, 0, ids.reshape(-1).long()).view(*ids.shape, table.shape[1])
    if scale is None:
        return out
    if out.dtype == torch.float32:
        return out.mul_(scale)
    return (out.float() * scale).to(table.dtype)


def lm_head(hidden, table, softcap):
    table = table.detach()  # matmul(out=...) refuses tensors that require grad
    h = hidden.detach().reshape(-1, hidden.shape[-1]).to(torch.float32)
    vocab, width = table.shape
    logits = torch.empty(h.shape[0], vocab, dtype=torch.float32)
    if 0 < h.shape[0] <= quant.SMALL_M and table.dtype in quant._GEMV_VIEW:
        logits = quant.gemv(h, table)
    elif table.dtype == torch.float32 and table.is_contiguous():
        np.matmul(h.contiguous().numpy(), table.numpy().T, out=logits.numpy())  # OpenBLAS: see quant.blas_matmul
    elif table.dtype == torch.float32:
        torch.matmul(h, table.T, out=logits)
    else:
        rows = max(1, VOCAB_CHUNK_BYTES // (4 * width))
        for v0 in range(0, vocab, rows):
            v1 = min(v0 + rows, vocab)
            torch.matmul(h, table[v0:v1].to(torch.float32).T, out=logits[:, v0:v1])
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits.view(*hidden.shape[:-1], vocab)


# No fastmath in these two: a row must be exactly the float32 value of the float64 reference's de-quantization,
# rounded once (int8 and int4 values are one product of exact factors; int4_min's ``q * s + m`` is formed in float64).
@njit(cache=True, error_model="numpy")
def _int8_rows(ids, q, scales, group, out):  # pragma: no cover - compiled
    """``out[r] = q[ids[r]] * s`` (int8, one scale per group of ``group`` along K)."""
    for r in range(ids.shape[0]):
        n = ids[r]
        for k in range(out.shape[1]):
            out[r, k] = np.float32(q[n, k]) * group_value(scales[n, k // group])


@njit(cache=True, error_model="numpy")
def _int4_rows(ids, packed, scales, offsets, has_min, group, out):  # pragma: no cover - compiled
    """``out[r]`` of int4 (``(q - z) * s``) or int4_min (``q * s + m``) row ``ids[r]``: byte ``j`` of a group holds
    element ``j`` in its low nibble and ``j + group / 2`` in its high one."""
    half = group // 2
    for r in range(ids.shape[0]):
        n = ids[r]
        for g in range(out.shape[1] // group):
            s = group_value(scales[n, g])
            o = group_value(offsets[n, g])
            base = g * group
            for j in range(half):
                byte = packed[n, g * half + j]
                lo = np.float32(byte & 15)
                hi = np.float32(byte >> 4)
                if has_min:
                    out[r, base + j] = np.float32(np.float64(lo) * np.float64(s) + np.float64(o))
                    out[r, base + half + j] = np.float32(np.float64(hi) * np.float64(s) + np.float64(o))
                else:
                    out[r, base + j] = (lo - o) * s
                    out[r, base + half + j] = (hi - o) * s


def embed_packed(ids, table, dtype):
    """The rows ``ids`` (int64 ``[R]``) of a packed int8 / int4 / int4_min table de-quantized straight from its
    arrays, rounded to ``dtype``: ``[R, H]``, equal to the reference ``dequantize(table.rows(ids)).to(dtype)``. None
    for another format (the caller then de-quantizes the picked rows). SmolLM2's Q8_0 table, one token:
    ``K.embed`` took 20 us hot through the generic row pick and torch arithmetic, 12 us with this kernel (95 and
    44 us in a decode step, where the weight stream has just flushed the caches; Zen 5, 2026-12-05)."""
    if table.fmt not in ("int8", "int4", "int4_min"):
        return None
    out = np.empty((ids.shape[0], table.shape[1]), dtype=np.float32)
    index = ids.numpy()
    if table.fmt == "int8":
        _int8_rows(index, table.data.numpy(), group_view(table.scales), table.group_size, out)
    else:
        offsets = table.mins if table.fmt == "int4_min" else table.zeros
        _int4_rows(index, table.data.numpy(), group_view(table.scales), group_view(offsets),
                   table.fmt == "int4_min", table.group_size, out)
    rows = torch.from_numpy(out)
    return rows if dtype == torch.float32 else rows.to(dtype)


OPS = {"embed": embed, "lm_head": lm_head, "embed_packed": embed_packed}
