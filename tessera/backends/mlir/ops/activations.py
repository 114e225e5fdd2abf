"""Gated activations through IREE (``op_kernels.gated_activation``)."""

from __future__ import annotations

from tessera.backends.mlir.ops._call import f32, run
from tessera.mlir import op_kernels


def _gated(kind: str, gate_up):
    flat = f32(gate_up).reshape(-1, gate_up.shape[-1])
    out = run(op_kernels.gated_activation(kind), "gated", (flat.shape[0], flat.shape[1] // 2), flat)
    return out.reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2).to(gate_up.dtype)


def silu_and_mul(gate_up):
    return _gated("silu", gate_up)


def gelu_and_mul(gate_up, approximate):
    return _gated("gelu_tanh" if approximate == "tanh" else "gelu", gate_up)


OPS = {"silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul}
