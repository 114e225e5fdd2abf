"""Embedding lookups and the LM head through IREE (``op_kernels.embed``, ``op_kernels.matmul`` with a softcap)."""

from __future__ import annotations

import torch

from tessera.backends.mlir.ops._call import f32, run
from tessera.mlir import op_kernels


def embed(ids, table, scale):
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = run(op_kernels.embed(), "embed", (flat.shape[0], table.shape[1]), flat, f32(table),
              1.0 if scale is None else scale)
    return out.reshape(*ids.shape, table.shape[1]).to(table.dtype)


def lm_head(hidden, table, softcap):
    flat = f32(hidden).reshape(-1, hidden.shape[-1])
    out = run(op_kernels.matmul(softcap is not None), "matmul", (flat.shape[0], table.shape[0]), flat, f32(table),
              1.0 if softcap is None else softcap)
    return out.reshape(*hidden.shape[:-1], table.shape[0])


OPS = {"embed": embed, "lm_head": lm_head}
