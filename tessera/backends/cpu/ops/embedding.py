"""Embedding ops on the cpu backend: torch's row gather, and the LM head as BLAS GEMMs over vocabulary chunks.

The LM head must accumulate in float32 and return float32 logits; torch's CPU matmul has no ``out_dtype``, so a
bf16/fp16 table is widened ``VOCAB_CHUNK_BYTES`` at a time (the widened chunk stays in L2/L3 while the GEMM reads it)
instead of copying the whole table to float32 per call. Up to ``quant.SMALL_M`` rows (decode) the quant family's
Numba GEMV reads the table once in its own dtype instead (fp32 accumulation; 2x torch's fp32 GEMV at 49152 x 576).
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.backends.cpu.ops import quant

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


OPS = {"embed": embed, "lm_head": lm_head}
