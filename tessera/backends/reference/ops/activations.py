"""Float64 oracle of the activation ops; ``*_f64`` return float64, the registered ops round once to the input dtype."""

from __future__ import annotations

import math

import torch


def silu_f64(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.sigmoid(x64)


def gelu_f64(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    x64 = x.double()
    if approximate == "tanh":
        return 0.5 * x64 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64.pow(3))))
    return 0.5 * x64 * (1.0 + torch.erf(x64 / math.sqrt(2.0)))


def relu_f64(x: torch.Tensor) -> torch.Tensor:
    return x.double().clamp_min(0.0)


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half].double(), gate_up[..., half:].double()


def silu_and_mul_f64(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = _halves(gate_up)
    return silu_f64(gate) * up


def gelu_and_mul_f64(gate_up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate, up = _halves(gate_up)
    return gelu_f64(gate, approximate) * up


def silu(x):
    return silu_f64(x).to(x.dtype)


def gelu(x, approximate):
    return gelu_f64(x, approximate).to(x.dtype)


def relu(x):
    return relu_f64(x).to(x.dtype)


def silu_and_mul(gate_up):
    return silu_and_mul_f64(gate_up).to(gate_up.dtype)


def gelu_and_mul(gate_up, approximate):
    return gelu_and_mul_f64(gate_up, approximate).to(gate_up.dtype)


OPS = {"silu": silu, "gelu": gelu, "relu": relu, "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul}
