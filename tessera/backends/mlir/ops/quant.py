"""Float matmul through IREE (``op_kernels.matmul``: linalg.matmul, tiled and vectorized by IREE)."""

from __future__ import annotations

from tessera.backends.mlir.ops._call import f32, run
from tessera.mlir import op_kernels


def matmul(x, w):
    return run(op_kernels.matmul(False), "matmul", (x.shape[0], w.shape[0]), f32(x), f32(w), 1.0).to(x.dtype)


OPS = {"matmul": matmul}
