"""RMSNorm through IREE (``op_kernels.rms_norm``); the fused residual sum is rounded to x's dtype first."""

from __future__ import annotations


from tessera.backends.mlir.ops._call import f32, run
from tessera.mlir import op_kernels


def rms_norm(x, weight, eps, residual, gemma):
    r = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    flat = f32(r).reshape(-1, r.shape[-1])
    y = run(op_kernels.rms_norm(), "rms_norm", tuple(flat.shape), flat, f32(weight), eps, 1.0 if gemma else 0.0)
    y = y.reshape(r.shape).to(x.dtype)
    return y if residual is None else (y, r)


def qk_norm(q, weight, eps, gemma):
    return rms_norm(q, weight, eps, None, gemma)


OPS = {"rms_norm": rms_norm, "qk_norm": qk_norm}
